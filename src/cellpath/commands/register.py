"""``cellpath register <section folder>``: register a section's H&E to its Xenium nuclei (not a DVC stage).

The folder is a raw section as ingest reads it (the Xenium outputs, the H&E OME-TIFF with its mpp,
section.json); ``registration.section.register_bundle`` registers it (the built-in detector's nuclei
against the Xenium nuclei, from any starting pose).

- Without an alignment file it writes ``<prefix>he_imagealignment.csv`` (10x's format: H&E level-0 px
  → morphology px, what Xenium Explorer, spatialdata-io and ingest read).
- With one, the given alignment is never touched: the registered one is written beside it as
  ``<prefix>he_imagealignment.registered.csv``, a proposal, with the matched distances under each.

Either way ``<prefix>he_registration.json`` records the transform, how it was found, the nuclei
matched, the residual median and 90th percentile (µm) and the verdict against the concordance
stage's registration QC thresholds (``concordance.registration_max_median_um`` / ``_max_p90_um``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cellpath.config import ConcordanceConfig
from cellpath.io.atomic import atomic_output
from cellpath.io.coords import write_alignment_csv
from cellpath.io.ingest import locate_bundle
from cellpath.registration.section import register_bundle

log = logging.getLogger(__name__)

ALIGNMENT_SUFFIX = "he_imagealignment.csv"
PROPOSAL_SUFFIX = "he_imagealignment.registered.csv"
RECORD_SUFFIX = "he_registration.json"


def _prefix(he_image: Path) -> str:
    """The file prefix the bundle's H&E carries (``<prefix>he_image.ome.tif``)."""
    name = he_image.name
    return name[: name.index("he_image")] if "he_image" in name else ""


def register_section(folder: Path, qc: ConcordanceConfig) -> dict:
    """Register one raw section folder (module docstring); returns the record it writes."""
    bundle = locate_bundle(Path(folder), require_alignment=False)
    result, record = register_bundle(bundle, qc)
    prefix = _prefix(bundle.he_image)
    if bundle.he_alignment is None:
        target = bundle.folder / f"{prefix}{ALIGNMENT_SUFFIX}"
    else:
        target = bundle.folder / f"{prefix}{PROPOSAL_SUFFIX}"
    record["written"] = target.name
    write_alignment_csv(target, result.alignment)
    with atomic_output(bundle.folder / f"{prefix}{RECORD_SUFFIX}") as tmp:
        tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
    log.info("register %s: %s written; matched median %.2f µm, p90 %.2f µm (%s)%s", bundle.section_id, target.name,
             record["registered"]["median_um"], record["registered"]["p90_um"], record["registered"]["verdict"],
             "" if "given" not in record else f"; the given alignment: median {record['given']['median_um']:.2f} µm, "
             f"p90 {record['given']['p90_um']:.2f} µm ({record['given']['verdict']})")
    return record
