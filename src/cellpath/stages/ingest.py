"""ingest: every raw section bundle → ``data/sections/<section_id>.zarr`` and ``sections.csv``.

A section is registered first (``registration.section.register_bundle``; docs/decisions/0051) when
its folder has no alignment file, or when its section.json says ``"registration": "propose"`` or
``"accept"``: the record goes to ``data/sections/<section_id>.registration.json``, and the nuclei are
placed with the registered alignment where there was none or the registration was accepted, else
with the given one. ``sections.csv`` says which (``alignment_source``) and the matched distances
under each alignment that was measured.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from cellpath.config import ConcordanceConfig, Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output, remove_stale_temporaries
from cellpath.io.layout import raw_dir, section_index_csv, sections_dir

if TYPE_CHECKING:
    from cellpath.io.ingest import Placement

REGISTRATION_MODES = ("given", "propose", "accept")

log = logging.getLogger(__name__)


def raw_section_folders(data_dir: Path) -> list[Path]:
    """Raw section folders (those holding section.json), sorted by name."""
    root = raw_dir(data_dir)
    if not root.is_dir():
        raise InputError("no raw data; run `cellpath fetch` (or `dvc repro fetch`) first", path=root)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise InputError("no section folders; run `cellpath fetch` first", path=root)
    return folders


def run(params: Params, data_dir: Path) -> pd.DataFrame:
    """ingest: every raw section → data/sections/<section_id>.zarr, plus data/sections/sections.csv."""
    from cellpath.io.ingest import ingest_section

    out = sections_dir(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    rows = []
    for folder in raw_section_folders(data_dir):
        placement, measured = _registered(folder, out, params.concordance)
        rows.append(ingest_section(folder, out, placement) | measured)
    index = pd.DataFrame(rows).sort_values("section_id").reset_index(drop=True)
    with atomic_output(section_index_csv(data_dir)) as tmp:
        index.to_csv(tmp, index=False)
    log.info("ingest: %d sections, %d cells → %s", len(index), int(index["n_cells"].sum()), out)
    return index


def _registered(folder: Path, out: Path, qc: ConcordanceConfig) -> tuple[Placement | None, dict]:
    """(the registered placement to use, or None for the given file; the registration's columns for
    sections.csv) of one raw folder, registering it where it has no alignment file or asks for it."""
    from cellpath.io.ingest import Placement, locate_bundle
    from cellpath.registration.section import register_bundle

    bundle = locate_bundle(folder, require_alignment=False)
    mode = bundle.metadata.get("registration", "given")
    if mode not in REGISTRATION_MODES:
        raise InputError(f"registration must be one of {', '.join(REGISTRATION_MODES)}, found {mode!r}",
                         path=folder / "section.json", section=bundle.section_id)
    if bundle.he_alignment is not None and mode == "given":
        return None, {}
    result, record = register_bundle(bundle, qc)
    source = ("registered (no alignment file)" if bundle.he_alignment is None
              else "registered (accepted over the given)" if mode == "accept" else "given (a registration proposed)")
    record["used"] = source
    with atomic_output(out / f"{bundle.section_id}.registration.json") as tmp:
        tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
    measured = {"alignment_source": source} | {f"{side}_{key}": record[side][key] for side in ("registered", "given")
                                               if side in record for key in ("median_um", "p90_um")}
    log.info("ingest %s: %s; registered median %.2f µm, p90 %.2f µm", bundle.section_id, source,
             record["registered"]["median_um"], record["registered"]["p90_um"])
    return (Placement(result.alignment, source) if source.startswith("registered") else None), measured
