"""ingest: every raw section bundle → ``data/sections/<section_id>.zarr`` and ``sections.csv``."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output, remove_stale_temporaries
from cellpath.io.layout import raw_dir, section_index_csv, sections_dir

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
    rows = [ingest_section(folder, out) for folder in raw_section_folders(data_dir)]
    index = pd.DataFrame(rows).sort_values("section_id").reset_index(drop=True)
    with atomic_output(section_index_csv(data_dir)) as tmp:
        index.to_csv(tmp, index=False)
    log.info("ingest: %d sections, %d cells → %s", len(index), int(index["n_cells"].sum()), out)
    return index
