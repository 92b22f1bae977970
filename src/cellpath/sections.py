"""Reading what ingest wrote: the section index and each section's cell table."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import pandas as pd

from cellpath.errors import InputError


def sections_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "sections"


def read_section_index(data_dir: Path) -> pd.DataFrame:
    """data/sections/sections.csv: one row per ingested section (id, organ, status, H&E geometry …)."""
    path = sections_dir(data_dir) / "sections.csv"
    if not path.is_file():
        raise InputError("no section index; run `cellpath ingest` (or `dvc repro ingest`) first", path=path)
    return pd.read_csv(path)


def read_section_table(data_dir: Path, section_id: str) -> ad.AnnData:
    """The ingested cell table of one section (cells × genes, raw counts, coordinates in obs)."""
    path = sections_dir(data_dir) / f"{section_id}.zarr" / "tables" / "table"
    if not path.is_dir():
        raise InputError("section table not found; rerun `cellpath ingest`", path=path, section=section_id)
    return ad.read_zarr(path)
