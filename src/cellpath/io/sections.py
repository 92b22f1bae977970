"""Reading what ingest wrote: the section index and each section's cell table."""

from __future__ import annotations

import logging
from pathlib import Path

import anndata as ad
import pandas as pd

from cellpath.errors import InputError
from cellpath.io.layout import label_summary_csv, section_index_csv, section_zarr

log = logging.getLogger(__name__)


def read_section_index(data_dir: Path) -> pd.DataFrame:
    """data/sections/sections.csv: one row per ingested section (id, organ, status, H&E geometry …)."""
    path = section_index_csv(data_dir)
    if not path.is_file():
        raise InputError("no section index; run `cellpath ingest` (or `dvc repro ingest`) first", path=path)
    return pd.read_csv(path)


def read_section_table(data_dir: Path, section_id: str) -> ad.AnnData:
    """The ingested cell table of one section (cells × genes, raw counts, coordinates in obs)."""
    path = section_zarr(data_dir, section_id) / "tables" / "table"
    if not path.is_dir():
        raise InputError("section table not found; rerun `cellpath ingest`", path=path, section=section_id)
    return ad.read_zarr(path)


def read_section_obs(data_dir: Path, section_id: str) -> pd.DataFrame:
    """The per-cell table (obs: ids, coordinates in µm and H&E level-0 px) of one section, without
    reading its count matrix — a 5K-gene panel's counts are gigabytes per section."""
    import zarr
    from anndata.io import read_elem

    path = section_zarr(data_dir, section_id) / "tables" / "table"
    if not path.is_dir():
        raise InputError("section table not found; rerun `cellpath ingest`", path=path, section=section_id)
    return read_elem(zarr.open_group(path, mode="r")["obs"])


def read_section_meta(data_dir: Path, section_id: str) -> dict:
    """The ingested section's metadata (``uns["section"]``: H&E geometry, alignment, pixel size), without
    reading its count matrix."""
    import zarr
    from anndata.io import read_elem

    path = section_zarr(data_dir, section_id) / "tables" / "table"
    if not path.is_dir():
        raise InputError("section table not found; rerun `cellpath ingest`", path=path, section=section_id)
    return read_elem(zarr.open_group(path, mode="r")["uns"])["section"]


def sections_to_extract(data_dir: Path) -> pd.DataFrame:
    """Ingested sections that annotation did not exclude (with their H&E geometry)."""
    index = read_section_index(data_dir)
    summary_path = label_summary_csv(data_dir)
    if not summary_path.is_file():
        raise InputError("no label summary; run `cellpath annotate` first", path=summary_path)
    summary = pd.read_csv(summary_path)
    excluded = set(summary.loc[summary["excluded"], "section_id"])
    if excluded:
        log.info("skipping %d section(s) excluded by annotation: %s", len(excluded), ", ".join(sorted(excluded)))
    return index[~index["section_id"].isin(excluded)].reset_index(drop=True)
