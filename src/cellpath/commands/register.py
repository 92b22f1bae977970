"""``cellpath register <section folder>``: register a section's H&E to its Xenium nuclei (not a DVC stage).

The folder is a raw section as ingest reads it (the Xenium outputs, the H&E OME-TIFF with its mpp,
section.json). The nuclei of the H&E come from the built-in detector, the Xenium nuclei from
cells.zarr.zip (``io.ingest``); ``registration.solve`` registers them from any starting pose.

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

import numpy as np

from cellpath.concordance.detector import detect_nuclei
from cellpath.concordance.registration import registration_qc
from cellpath.config import ConcordanceConfig
from cellpath.io.atomic import atomic_output
from cellpath.io.coords import read_alignment, um_to_he_px, write_alignment_csv
from cellpath.io.ingest import locate_bundle, read_he_geometry, read_nucleus_centroids
from cellpath.registration.solve import register_nuclei

log = logging.getLogger(__name__)

ALIGNMENT_SUFFIX = "he_imagealignment.csv"
PROPOSAL_SUFFIX = "he_imagealignment.registered.csv"
RECORD_SUFFIX = "he_registration.json"


def _prefix(he_image: Path) -> str:
    """The file prefix the bundle's H&E carries (``<prefix>he_image.ome.tif``)."""
    name = he_image.name
    return name[: name.index("he_image")] if "he_image" in name else ""


def _distances(detected_px: np.ndarray, xenium_um: np.ndarray, alignment: np.ndarray, mpp: float,
               qc: ConcordanceConfig) -> dict:
    """Matched-nucleus distances (µm) of the detected nuclei against the Xenium nuclei placed on the
    H&E by ``alignment``: the concordance stage's registration QC."""
    result = registration_qc(detected_px, um_to_he_px(xenium_um, alignment), mpp, qc.registration_radius_um)
    flagged = result.reg_median_um > qc.registration_max_median_um or result.reg_p90_um > qc.registration_max_p90_um
    return {"matched_nuclei": result.reg_pairs, "median_um": result.reg_median_um, "p90_um": result.reg_p90_um,
            "verdict": "fails QC" if flagged or not np.isfinite(result.reg_median_um) else "passes QC"}


def register_section(folder: Path, qc: ConcordanceConfig) -> dict:
    """Register one raw section folder (module docstring); returns the record it writes."""
    bundle = locate_bundle(Path(folder), require_alignment=False)
    mpp, _ = read_he_geometry(bundle)
    nuclei, _ = read_nucleus_centroids(bundle)
    xenium_um = nuclei[["nucleus_x_um", "nucleus_y_um"]].to_numpy(float)
    detections = detect_nuclei(bundle.he_image, mpp=mpp)
    detected_px = np.column_stack([detections.x_px, detections.y_px])
    log.info("register %s: %d nuclei detected on the H&E (mpp %.4f), %d Xenium nuclei", bundle.section_id,
             len(detected_px), mpp, len(xenium_um))
    result = register_nuclei(detected_px, mpp, xenium_um)
    prefix = _prefix(bundle.he_image)
    record = {"section_id": bundle.section_id, "he_image": bundle.he_image.name, "he_mpp": mpp,
              "alignment_he_px_to_morphology_px": result.alignment.tolist(),
              "he_um_to_xenium_um": result.he_um_to_xenium_um.tolist(), **result.record,
              "registered": _distances(detected_px, xenium_um, result.alignment, mpp, qc)}
    if bundle.he_alignment is None:
        target = bundle.folder / f"{prefix}{ALIGNMENT_SUFFIX}"
    else:
        target = bundle.folder / f"{prefix}{PROPOSAL_SUFFIX}"
        given, _ = read_alignment(bundle.he_alignment, bundle.section_id)
        record["given"] = {"file": bundle.he_alignment.name, **_distances(detected_px, xenium_um, given, mpp, qc)}
    record["written"] = target.name
    write_alignment_csv(target, result.alignment)
    with atomic_output(bundle.folder / f"{prefix}{RECORD_SUFFIX}") as tmp:
        tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
    log.info("register %s: %s written; matched median %.2f µm, p90 %.2f µm (%s)%s", bundle.section_id, target.name,
             record["registered"]["median_um"], record["registered"]["p90_um"], record["registered"]["verdict"],
             "" if "given" not in record else f"; the given alignment: median {record['given']['median_um']:.2f} µm, "
             f"p90 {record['given']['p90_um']:.2f} µm ({record['given']['verdict']})")
    return record
