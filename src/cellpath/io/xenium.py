"""The 10x Xenium format: its constants (the cell summary's columns, the cell-id encoding) and
the vintages of its output bundle (:data:`LAYOUTS`), read by :mod:`cellpath.io.ingest` and written by
the simulator (:mod:`cellpath.simulation.xenium_bundle`), so that one reader serves both sources.
A bundle holds (``prefix`` as in 10x's names):

- ``experiment.xenium``: JSON run metadata with ``pixel_size`` (µm per morphology px);
- ``cell_feature_matrix.h5``: 10x HDF5 matrix, v3 layout (features × cells, CSC);
- ``cells.parquet``: one row per cell, centroids in µm;
- ``cells.zarr.zip``: zarr v2 store in a zip with ``cell_id`` (N, 2) uint32 and ``cell_summary``;
- ``nucleus_boundaries.parquet``: polygon vertices in µm per cell;
- ``<prefix>he_image.ome.tif``: pyramidal RGB OME-TIFF with its mpp in the OME metadata;
- ``<prefix>he_imagealignment.csv``: 3×3 affine H&E px → morphology px.

The files differ between Xenium Onboard Analysis (XOA) versions (:class:`XeniumLayout`), and ingest
reads every one of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from cellpath.vocabulary import DEFAULT_XENIUM_LAYOUT

SUMMARY_COLUMNS = (
    "cell_centroid_x", "cell_centroid_y", "cell_area", "nucleus_centroid_x", "nucleus_centroid_y",
    "nucleus_area", "z_level", "nucleus_count",
)
SUMMARY_COLUMNS_1X = SUMMARY_COLUMNS[:7]  # XOA 1.x: no nucleus_count
NUCLEUS_CENTROID_COLUMNS = ("nucleus_centroid_x", "nucleus_centroid_y")


@dataclass(frozen=True)
class XeniumLayout:
    """One vintage of the Xenium output bundle: how its files differ from today's.

    ``integer_cell_ids``: XOA < 1.3 numbers cells 1, 2, … (cells.parquet, the matrix's barcodes)
    and stores ``cell_id`` in cells.zarr.zip as a 1-D integer array; from 1.3 ids are strings
    ("aaabcdef-1") and ``cell_id`` is (N, 2) uint32, prefix and dataset suffix.
    ``summary_columns``: ``cell_summary``'s columns (1.x: 7, no ``nucleus_count``; from 2.0: 8).
    ``summary_has_nucleus_centroids``: False for a bundle whose ``cell_summary`` lacks them (ingest
    then takes them from nucleus_boundaries.parquet). ``boundaries_label_id``: the boundary
    parquet's ``label_id`` (from 2.0). ``binary_parquet_ids``: cell ids stored as Arrow binary
    (XOA 1.3-1.4). ``xenium_ranger_version``: the ``xenium_ranger`` block Xenium Ranger adds when it
    re-segments a bundle, whose version then decides the layout. Sources: spatialdata-io's Xenium
    reader (its branches on < 1.3 and < 2.0), 10x's "Understanding Xenium Outputs" (cells.zarr.zip:
    ``cell_id`` uint32, prefix and suffix), SpatialFeatureExperiment (binary ids); decision 0022.
    """

    analysis_sw_version: str
    integer_cell_ids: bool = False
    summary_columns: tuple[str, ...] = SUMMARY_COLUMNS
    summary_has_nucleus_centroids: bool = True
    boundaries_label_id: bool = True
    binary_parquet_ids: bool = False
    xenium_ranger_version: str | None = None
    panel_name: str = "cellpath simulated panel"

    def cell_ids(self, prefixes: np.ndarray) -> list[str]:
        """The bundle's cell ids, as strings (cells.parquet, the matrix's barcodes)."""
        if self.integer_cell_ids:
            return [str(i) for i in range(1, len(prefixes) + 1)]
        return xenium_cell_ids(prefixes)


LAYOUTS: dict[str, XeniumLayout] = {
    "xoa-1.0": XeniumLayout("xenium-1.0.2", integer_cell_ids=True, summary_columns=SUMMARY_COLUMNS_1X,
                            boundaries_label_id=False),
    "xoa-1.4": XeniumLayout("xenium-1.4.0.6", summary_columns=SUMMARY_COLUMNS_1X, boundaries_label_id=False,
                            binary_parquet_ids=True),
    "xoa-1.9": XeniumLayout("xenium-1.9.0.1", summary_columns=SUMMARY_COLUMNS_1X, boundaries_label_id=False),
    "xoa-2.0": XeniumLayout("xenium-2.0.0.10"),
    "xoa-3.0": XeniumLayout("xenium-3.0.0.15"),
    "xenium-prime-5k": XeniumLayout("xenium-3.1.0.4",
                                    panel_name="Xenium Prime 5K Human Pan Tissue & Pathways Panel"),
    "xenium-ranger-3.0": XeniumLayout("xenium-1.6.0.7", summary_columns=SUMMARY_COLUMNS,
                                      xenium_ranger_version="xenium-3.0.1.1"),
}
DEFAULT_LAYOUT = LAYOUTS[DEFAULT_XENIUM_LAYOUT]
_VERSION = re.compile(r"^[xX]enium-(\d+)\.(\d+)\.(\d+)")


def bundle_version(experiment: dict) -> tuple[tuple[int, int, int] | None, str]:
    """The (major, minor, patch) that decides a bundle's layout and the string it came from:
    Xenium Ranger's ``xenium_ranger.version`` when the bundle was re-segmented, else
    ``analysis_sw_version`` ("xenium-1.0.2"); None when neither parses (read as today's layout)."""
    ranger = experiment.get("xenium_ranger")
    text = str(ranger.get("version", "")) if isinstance(ranger, dict) else str(experiment.get("analysis_sw_version", ""))
    match = _VERSION.match(text)
    return (tuple(int(g) for g in match.groups()) if match else None), text


def xenium_cell_ids(prefixes: np.ndarray, dataset_suffix: int = 1) -> list[str]:
    """Xenium string cell ids ("aaabcdef-1") from uint32 prefixes: hex digits shifted 0-f → a-p."""
    shift = str.maketrans("0123456789abcdef", "abcdefghijklmnop")
    return [f"{int(p):08x}".translate(shift) + f"-{dataset_suffix}" for p in prefixes]
