"""Where everything lives under the data folder (``data/``): one place for every data path.

Each helper takes the data folder (``data_dir``) and returns a path inside it; no stage or domain
module builds a ``data/...`` path by hand.
"""

from __future__ import annotations

from pathlib import Path


def raw_dir(data_dir: Path) -> Path:
    """Raw section bundles as fetched: ``data/raw/<section folder>/`` (Xenium outputs + H&E)."""
    return Path(data_dir) / "raw"


def references_dir(data_dir: Path) -> Path:
    """scRNA-seq references for label transfer: ``data/references/<name>.h5ad``."""
    return Path(data_dir) / "references"


def sections_dir(data_dir: Path) -> Path:
    """Ingested sections: ``data/sections/<section_id>.zarr`` (SpatialData) and ``sections.csv``."""
    return Path(data_dir) / "sections"


def labels_dir(data_dir: Path) -> Path:
    """Per-section labels and their summary: ``data/labels/<section_id>.parquet``, ``summary.csv``."""
    return Path(data_dir) / "labels"


def features_dir(data_dir: Path) -> Path:
    """Feature artifacts: ``data/features/<encoder slug>/<magnification>/<section_id>/``."""
    return Path(data_dir) / "features"


def panels_csv(data_dir: Path) -> Path:
    """The concordance ranking and nested panel membership: ``data/panels.csv``."""
    return Path(data_dir) / "panels.csv"
