"""Ingest: one raw Xenium bundle + registered H&E → ``data/sections/<section_id>.zarr`` (SpatialData).

The same code reads a real 10x download and a simulated bundle, of every vintage (XOA 1.0 to
today, Xenium Prime, Xenium Ranger re-segmentations; :data:`cellpath.io.xenium.LAYOUTS`). The
expression table comes from spatialdata-io's Xenium reader; nucleus centroids (µm) from
``cells.zarr.zip``'s ``cell_summary`` — or, for a bundle whose summary lacks them, from the
polygons of ``nucleus_boundaries.parquet`` (the section's metadata says which); they are placed on
the H&E through the inverse of the alignment (:func:`cellpath.io.coords.um_to_he_px`). The H&E stays
the OME-TIFF on disk (read later with tiatoolbox at a target mpp); the zarr holds the table and
the nucleus centroids as shapes, plus the section's metadata in ``table.uns["section"]``.

Every problem with a bundle stops the section with one InputError naming the section, the file
and what is wrong; outputs are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import logging
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import zarr

from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.coords import check_alignment_scale, read_alignment, um_to_he_px
from cellpath.io.wsi import open_slide
from cellpath.io.xenium import (NUCLEUS_CENTROID_COLUMNS, SUMMARY_COLUMNS, SUMMARY_COLUMNS_1X, bundle_version,
                                xenium_cell_ids)

log = logging.getLogger(__name__)

REQUIRED_FILES = ("experiment.xenium", "cell_feature_matrix.h5", "cells.parquet", "cells.zarr.zip")
REQUIRED_CELL_COLUMNS = ("cell_id", "x_centroid", "y_centroid")
SECTION_FIELDS = ("section_id", "organ", "status", "dataset")


@dataclass(frozen=True)
class Bundle:
    """Paths of one section's raw files."""

    section_id: str
    folder: Path
    he_image: Path
    he_alignment: Path | None  # None only where the bundle was located for registration
    metadata: dict

    def file(self, name: str) -> Path:
        return self.folder / name


def _single(folder: Path, pattern: str, section: str, what: str) -> Path:
    matches = sorted(folder.glob(pattern))
    if len(matches) != 1:
        found = ", ".join(m.name for m in matches) or "none"
        raise InputError(f"expected exactly one {what} matching {pattern!r}, found {found}", path=folder, section=section)
    return matches[0]


def locate_bundle(folder: Path, require_alignment: bool = True) -> Bundle:
    """Check that a raw section folder holds every file ingest needs; read its section.json. Without
    ``require_alignment`` (registration), a folder with no alignment file is accepted (more than one
    is still refused)."""
    folder = Path(folder)
    meta_path = folder / "section.json"
    section = folder.name
    if not meta_path.is_file():
        raise InputError("section.json is missing; rerun `cellpath fetch`", path=meta_path, section=section)
    try:
        metadata = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"section.json is not valid JSON ({exc})", path=meta_path, section=section) from None
    missing_fields = [f for f in SECTION_FIELDS if f not in metadata]
    if missing_fields:
        raise InputError(f"section.json lacks {missing_fields}", path=meta_path, section=section)
    section = metadata["section_id"]
    for name in REQUIRED_FILES:
        path = folder / name
        if not path.is_file() or path.stat().st_size == 0:
            raise InputError(f"{name} is missing or empty; re-download the bundle", path=path, section=section)
    he_image = _single(folder, "*he_image.ome.tif", section, "registered H&E image")
    alignments = sorted(folder.glob("*he_imagealignment.csv"))
    he_alignment = None if not alignments and not require_alignment else _single(
        folder, "*he_imagealignment.csv", section, "H&E alignment file")
    return Bundle(section, folder, he_image, he_alignment, metadata)


def _read_experiment(bundle: Bundle) -> dict:
    path = bundle.file("experiment.xenium")
    try:
        experiment = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"experiment.xenium is not valid JSON ({exc})", path=path, section=bundle.section_id) from None
    pixel_size = experiment.get("pixel_size")
    if not isinstance(pixel_size, (int, float)) or not 0 < pixel_size < 10:
        raise InputError(f"pixel_size must be a positive number of µm, found {pixel_size!r}", path=path,
                         section=bundle.section_id)
    return experiment


def _check_matrix(bundle: Bundle) -> np.ndarray:
    """Open cell_feature_matrix.h5 and return its barcodes; InputError if truncated or malformed."""
    path = bundle.file("cell_feature_matrix.h5")
    needed = ("matrix/barcodes", "matrix/data", "matrix/indices", "matrix/indptr", "matrix/shape",
              "matrix/features/name", "matrix/features/feature_type")
    try:
        with h5py.File(path, "r") as f:
            absent = [k for k in needed if k not in f]
            if absent:
                raise InputError(f"not a 10x v3 matrix: missing {absent}", path=path, section=bundle.section_id)
            barcodes = f["matrix/barcodes"][:].astype(str)
            shape = f["matrix/shape"][:]
            n_data, n_indices, n_indptr = f["matrix/data"].shape[0], f["matrix/indices"].shape[0], f["matrix/indptr"].shape[0]
            f["matrix/data"][-1:]  # reading the last chunk is where a truncated file fails
    except OSError as exc:
        raise InputError(f"cannot read the HDF5 matrix ({exc}); the file is truncated or corrupt, re-download it",
                         path=path, section=bundle.section_id) from None
    if len(shape) != 2 or shape[1] != len(barcodes) or n_indptr != len(barcodes) + 1 or n_data != n_indices:
        raise InputError(f"inconsistent matrix: shape {shape.tolist()}, {len(barcodes)} barcodes, "
                         f"{n_indptr} indptr, {n_data} data, {n_indices} indices", path=path, section=bundle.section_id)
    return barcodes


def _read_cells_parquet(bundle: Bundle) -> pd.DataFrame:
    path = bundle.file("cells.parquet")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"cannot read parquet ({exc}); the file is truncated or corrupt", path=path,
                         section=bundle.section_id) from None
    missing = [c for c in REQUIRED_CELL_COLUMNS if c not in table.column_names]
    if missing:
        raise InputError(f"missing columns {missing}", path=path, section=bundle.section_id)
    cells = table.to_pandas()
    cells["cell_id"] = _id_strings(cells["cell_id"])
    return cells


def _id_strings(ids: pd.Series) -> np.ndarray:
    """Cell ids as strings, whatever the vintage stored: Arrow string, binary (XOA 1.3-1.4, decoded
    as UTF-8) or integer (XOA < 1.3)."""
    values = ids.to_numpy()
    if len(values) and isinstance(values[0], bytes):
        return np.array([v.decode("utf-8") for v in values], dtype=object)
    return ids.astype(str).to_numpy()


OPTIONAL_PARQUET_FILES = ("nucleus_boundaries.parquet", "cell_boundaries.parquet")


def _check_optional_parquet(bundle: Bundle) -> None:
    """Bundle files ingest does not read (boundary polygons) must still be readable when present:
    a truncated one means the download or copy of the bundle broke."""
    for name in OPTIONAL_PARQUET_FILES:
        path = bundle.file(name)
        if not path.exists():
            continue
        try:
            pq.ParquetFile(path).close()  # reads the footer, which truncation removes
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise InputError(f"cannot read parquet ({exc}); the file is truncated or corrupt, re-download the "
                             "bundle", path=path, section=bundle.section_id) from None


#: Where a section's nucleus centroids came from (``table.uns["section"]["nucleus_centroids_from"]``).
FROM_SUMMARY = "cells.zarr.zip cell_summary"
FROM_BOUNDARIES = "nucleus_boundaries.parquet polygons (largest nucleus of each cell)"


def read_nucleus_centroids(bundle: Bundle) -> tuple[pd.DataFrame, str]:
    """Nucleus centroids (µm) per cell id, and where they came from: cells.zarr.zip's cell_summary,
    or nucleus_boundaries.parquet when the summary has no nucleus centroid columns."""
    path = bundle.file("cells.zarr.zip")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"member {bad} is corrupt")
        store = zarr.storage.ZipStore(path, mode="r")
        root = zarr.open_group(store=store, mode="r")
        for name in ("cell_id", "cell_summary"):
            if name in root:
                _check_every_chunk(root[name], name, path, bundle.section_id)
        cell_id = np.asarray(root["cell_id"][:])
        summary_array = root["cell_summary"] if "cell_summary" in root else None
        summary = None if summary_array is None else np.asarray(summary_array[:])
        columns = None if summary_array is None else summary_array.attrs.get("column_names")
        store.close()
    except (zipfile.BadZipFile, KeyError, OSError, ValueError) as exc:
        raise InputError(f"cannot read cell_id / cell_summary ({exc}); re-download the bundle", path=path,
                         section=bundle.section_id) from None
    ids = _zarr_cell_ids(cell_id, path, bundle.section_id)
    if summary is not None and columns is None:  # no names stored: 1.x has 7 columns, 2.0 on 8
        columns = {len(SUMMARY_COLUMNS_1X): SUMMARY_COLUMNS_1X, len(SUMMARY_COLUMNS): SUMMARY_COLUMNS}.get(
            summary.shape[1] if summary.ndim == 2 else -1)
        if columns is None:
            raise InputError(f"cell_summary has {summary.shape} values and no column_names attribute; expected 7 "
                             "(XOA 1.x) or 8 columns", path=path, section=bundle.section_id)
    columns = list(columns or [])
    if summary is None or not all(c in columns for c in NUCLEUS_CENTROID_COLUMNS):
        return _centroids_from_boundaries(bundle, ids), FROM_BOUNDARIES
    if len(ids) != len(summary):
        raise InputError(f"cell_id ({len(ids)} cells) and cell_summary {summary.shape} disagree", path=path,
                         section=bundle.section_id)
    return pd.DataFrame({
        "cell_id": ids,
        "nucleus_x_um": summary[:, columns.index("nucleus_centroid_x")],
        "nucleus_y_um": summary[:, columns.index("nucleus_centroid_y")],
    }), FROM_SUMMARY


def _check_every_chunk(array: zarr.Array, name: str, path: Path, section: str) -> None:
    """An array whose archive lacks some of its chunks reads them as the fill value, silently (zarr writes
    a chunk unless it is all fill value, which no chunk of cell ids or centroids is): refuse it."""
    missing = array.nchunks - array.nchunks_initialized
    if missing:
        rows = array.chunks[0]
        raise InputError(f"{name}: {missing} of its {array.nchunks} chunks ({rows} cells each) are missing from the "
                         f"archive, and would read as {np.asarray(array.fill_value).item()!r} (cells at 0 µm); the bundle is incomplete, "
                         "re-download it", path=path, section=section)


def _zarr_cell_ids(cell_id: np.ndarray, path: Path, section: str) -> np.ndarray:
    """cells.zarr.zip's ``cell_id`` as the bundle's string ids: (N, 2) uint32 prefix and dataset
    suffix (XOA ≥ 1.3, "aaabcdef-1"), or 1-D integers (XOA < 1.3, "1", "2", …)."""
    if cell_id.ndim == 1:
        return cell_id.astype(np.int64).astype(str).astype(object)
    if cell_id.ndim == 2 and cell_id.shape[1] == 2:
        return np.array(xenium_cell_ids(cell_id[:, 0], int(cell_id[0, 1]) if len(cell_id) else 1), dtype=object)
    raise InputError(f"cell_id has shape {cell_id.shape}; expected (N,) integers (XOA < 1.3) or (N, 2) uint32",
                     path=path, section=section)


def _centroids_from_boundaries(bundle: Bundle, ids: np.ndarray) -> pd.DataFrame:
    """Each cell's nucleus centroid (µm) from nucleus_boundaries.parquet: the area centroid of its
    polygon (its largest, where XOA ≥ 2.0 gives a cell several nuclei, told apart by ``label_id``).
    A polygon's vertices are consecutive rows, as 10x writes them."""
    path = bundle.file("nucleus_boundaries.parquet")
    section = bundle.section_id
    if not path.is_file():
        raise InputError("cells.zarr.zip has no nucleus centroids (cell_summary lacks nucleus_centroid_x/y) and "
                         "nucleus_boundaries.parquet, from which they are computed, is missing; re-download the "
                         "bundle", path=path, section=section)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"cannot read parquet ({exc}); the file is truncated or corrupt", path=path,
                         section=section) from None
    missing = [c for c in ("cell_id", "vertex_x", "vertex_y") if c not in table.column_names]
    if missing:
        raise InputError(f"missing columns {missing}", path=path, section=section)
    frame = pd.DataFrame({"cell_id": _id_strings(table.column("cell_id").to_pandas()),
                          "x": table.column("vertex_x").to_numpy().astype(np.float64),
                          "y": table.column("vertex_y").to_numpy().astype(np.float64)})
    frame["polygon"] = (frame["cell_id"] + "\0" + (table.column("label_id").to_pandas().astype(str)
                        if "label_id" in table.column_names else "")).to_numpy()
    try:
        centroids = polygon_centroids(frame)
    except ValueError as exc:
        raise InputError(f"{exc}; the file is not a 10x boundary table", path=path, section=section) from None
    largest = centroids.sort_values("area", ascending=False, kind="stable").drop_duplicates("cell_id")
    located = largest.set_index("cell_id").reindex(ids)
    absent = located["x"].isna()
    if absent.any():
        raise InputError(f"{int(absent.sum())} of {len(ids)} cells have no nucleus polygon (e.g. {ids[absent][0]}); "
                         "the boundaries and cells.zarr.zip come from different runs", path=path, section=section)
    return pd.DataFrame({"cell_id": ids, "nucleus_x_um": located["x"].to_numpy(),
                         "nucleus_y_um": located["y"].to_numpy()})


def polygon_centroids(vertices: pd.DataFrame) -> pd.DataFrame:
    """Area centroid and |area| of each polygon of ``vertices`` (columns cell_id, polygon, x, y; a
    polygon's rows consecutive, closed or not); the vertex mean where the area is 0."""
    polygon = vertices["polygon"].to_numpy()
    starts = np.r_[0, np.flatnonzero(polygon[1:] != polygon[:-1]) + 1]
    if len(starts) != len(pd.unique(polygon)):
        raise ValueError("the vertices of a polygon are not consecutive rows")
    lengths = np.diff(np.r_[starts, len(polygon)])
    group = np.repeat(np.arange(len(starts)), lengths)
    following = np.arange(1, len(polygon) + 1)
    following[starts + lengths - 1] = starts  # each polygon's last vertex closes on its first
    x, y = vertices["x"].to_numpy(), vertices["y"].to_numpy()
    cross = x * y[following] - x[following] * y
    area = np.bincount(group, cross) / 2.0
    cx = np.bincount(group, (x + x[following]) * cross)
    cy = np.bincount(group, (y + y[following]) * cross)
    flat = np.abs(area) < 1e-12
    with np.errstate(invalid="ignore", divide="ignore"):
        cx, cy = np.where(flat, np.bincount(group, x) / lengths, cx / (6.0 * area)), \
            np.where(flat, np.bincount(group, y) / lengths, cy / (6.0 * area))
    return pd.DataFrame({"cell_id": vertices["cell_id"].to_numpy()[starts], "x": cx, "y": cy, "area": np.abs(area)})


def _tiff_resolution_mpp(path: Path) -> float | None:
    """µm per px from the first page's TIFF resolution tags, or None when they are absent or unitless."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            tags = tif.pages[0].tags
            unit = tags.get("ResolutionUnit")
            x_res = tags.get("XResolution")
            if unit is None or x_res is None:
                return None
            per_unit = x_res.value[0] / x_res.value[1]
            um_per_unit = {2: 25_400.0, 3: 10_000.0}.get(int(unit.value))
    except (tifffile.TiffFileError, OSError, ZeroDivisionError):
        return None
    if um_per_unit is None or per_unit <= 0:
        return None
    return um_per_unit / per_unit


def _tiff_truncation(path: Path) -> str | None:
    """Why a TIFF's image data is incomplete (a level's tiles or strips end past the end of the file),
    or None. Opening reads only the tags, so a file cut inside a pyramid level opens fine."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            size = tif.filehandle.size
            for series in tif.series:
                for level_index, level in enumerate(series.levels):
                    for page in level.pages:
                        if page is None:
                            continue
                        ends = [offset + count for offset, count in zip(page.dataoffsets, page.databytecounts)
                                if count]
                        if ends and max(ends) > size:
                            return (f"pyramid level {level_index} needs {max(ends)} bytes but the file has {size}; "
                                    "it is truncated, copy or download it again")
    except (tifffile.TiffFileError, OSError, ValueError, IndexError) as exc:
        return f"its TIFF structure cannot be read ({type(exc).__name__}: {exc})"
    return None


def read_he_geometry(bundle: Bundle) -> tuple[float, tuple[int, int]]:
    """mpp (µm/px) and level-0 (width, height) of the H&E.

    tiatoolbox reads the OME-XML PhysicalSizeX/Y; when that is absent, the TIFF resolution tags are
    used (later reads then pass this mpp to tiatoolbox explicitly).
    """
    path = bundle.he_image
    try:
        info = open_slide(path).info
    except Exception as exc:  # tiatoolbox/tifffile/openslide raise many types for unreadable slides
        raise InputError(f"cannot open the H&E image ({type(exc).__name__}: {exc})", path=path,
                         section=bundle.section_id) from None
    if path.suffix.lower() in (".tif", ".tiff") and (problem := _tiff_truncation(path)) is not None:
        raise InputError(f"the H&E image is incomplete: {problem}", path=path, section=bundle.section_id)
    mpp = np.asarray(info.mpp if info.mpp is not None else [np.nan, np.nan], dtype=float)
    if not np.all(np.isfinite(mpp)) or np.any(mpp <= 0):
        fallback = _tiff_resolution_mpp(path)
        if fallback is None:
            raise InputError("the H&E image has no pixel size (mpp): neither OME-XML PhysicalSizeX/Y nor TIFF "
                             "resolution tags; add one of them", path=path, section=bundle.section_id)
        mpp = np.array([fallback, fallback])
    width, height = (int(v) for v in info.slide_dimensions)
    return float(mpp.mean()), (width, height)


def _read_table(bundle: Bundle):
    """The expression table through spatialdata-io's Xenium reader (the same for both sources)."""
    from spatialdata_io import xenium

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sdata = xenium(bundle.folder, cells_boundaries=False, nucleus_boundaries=False, cells_labels=False,
                           nucleus_labels=False, transcripts=False, morphology_mip=False, morphology_focus=False,
                           aligned_images=False, cells_as_circles=False)
    except Exception as exc:  # the reader raises many types for malformed bundles
        raise InputError(f"spatialdata-io could not read the Xenium bundle ({type(exc).__name__}: {exc})",
                         path=bundle.folder, section=bundle.section_id) from None
    return sdata["table"]


def _read_cells(bundle: Bundle) -> tuple[pd.DataFrame, pd.DataFrame]:
    """cells.parquet and the nucleus centroids (cells.zarr.zip), checked against the matrix's barcodes."""
    section = bundle.section_id
    barcodes = _check_matrix(bundle)
    cells = _read_cells_parquet(bundle)
    _check_optional_parquet(bundle)
    if len(cells) == 0:
        raise InputError("cells.parquet has no cells", path=bundle.file("cells.parquet"), section=section)
    repeated = cells["cell_id"][cells["cell_id"].duplicated()]
    if len(repeated):
        raise InputError(f"{len(repeated)} cell ids repeat (e.g. {repeated.iloc[0]}); every later step joins on "
                         "cell_id, so each must name one cell: the bundle is damaged or was merged from several runs",
                         path=bundle.file("cells.parquet"), section=section)
    if len(cells) != len(barcodes) or not np.array_equal(cells["cell_id"].to_numpy(), barcodes):
        unmatched = len(set(cells["cell_id"]) ^ set(barcodes))
        raise InputError(
            f"cell ids of cells.parquet ({len(cells)}) do not match the barcodes of cell_feature_matrix.h5 "
            f"({len(barcodes)}; {unmatched} ids in only one of them, or a different order); the files come from "
            "different runs", path=bundle.file("cells.parquet"), section=section)
    nuclei, source = read_nucleus_centroids(bundle)
    if not np.array_equal(nuclei["cell_id"].to_numpy(), cells["cell_id"].to_numpy()):
        raise InputError("cell ids of cells.zarr.zip do not match cells.parquet", path=bundle.file("cells.zarr.zip"),
                         section=section)
    return cells, nuclei.assign(source=source)


def _check_counts(matrix, path: Path, section: str) -> None:
    """Transcript counts are finite and non-negative (a NaN or a negative count is no measurement)."""
    values = matrix.data if hasattr(matrix, "data") and not isinstance(matrix, np.ndarray) else np.asarray(matrix)
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        raise InputError(f"{int(bad.sum())} counts are NaN, infinite or negative (e.g. {float(values[bad][0])}); "
                         "Xenium counts are whole numbers ≥ 0: the matrix is damaged, re-download the bundle",
                         path=path, section=section)


@dataclass(frozen=True)
class Placement:
    """An alignment found for a bundle rather than read from it (H&E level-0 px → morphology px, 3×3)
    and what it is, for the section's metadata (``alignment_source``)."""

    alignment: np.ndarray
    source: str


def build_section_table(bundle: Bundle, placement: Placement | None = None):
    """Read and cross-check one bundle; return the AnnData table with µm and H&E px coordinates. The
    nuclei are placed with the bundle's alignment file, or with ``placement`` where one is given."""
    section = bundle.section_id
    experiment = _read_experiment(bundle)
    cells, nuclei = _read_cells(bundle)
    alignment, kind = ((placement.alignment, "matrix") if placement is not None
                       else read_alignment(bundle.he_alignment, section))
    he_mpp, (width, height) = read_he_geometry(bundle)
    pixel_size = float(experiment["pixel_size"])
    alignment, alignment_read_as = check_alignment_scale(alignment, kind, he_mpp, pixel_size, bundle.he_alignment,
                                                         section)
    nucleus_um = nuclei[["nucleus_x_um", "nucleus_y_um"]].to_numpy(dtype=float)
    if not np.all(np.isfinite(nucleus_um)):
        raise InputError(f"{int((~np.isfinite(nucleus_um)).any(axis=1).sum())} cells have non-finite nucleus "
                         "centroids", path=bundle.file("cells.zarr.zip"), section=section)
    he_px = um_to_he_px(nucleus_um, alignment, pixel_size)
    outside = (he_px[:, 0] < 0) | (he_px[:, 1] < 0) | (he_px[:, 0] >= width) | (he_px[:, 1] >= height)
    if outside.any():
        first = int(np.flatnonzero(outside)[0])
        raise InputError(
            f"{int(outside.sum())} of {len(he_px)} cells map outside the {width}×{height} px H&E image "
            f"(e.g. {cells['cell_id'].iloc[first]} at H&E px {he_px[first].round(1).tolist()}); the alignment "
            "does not belong to this image or the image is cropped", path=bundle.he_alignment, section=section)

    table = _read_table(bundle)
    _check_counts(table.X, bundle.file("cell_feature_matrix.h5"), section)
    table.obs_names = table.obs["cell_id"].astype(str).to_numpy() if "cell_id" in table.obs else table.obs_names
    if not np.array_equal(table.obs_names.to_numpy(), cells["cell_id"].to_numpy()):
        raise InputError("spatialdata-io returned cells in another order than cells.parquet", path=bundle.folder,
                         section=section)
    obs = table.obs
    obs["cell_id"] = cells["cell_id"].to_numpy()
    obs["section_id"] = section
    obs["nucleus_x_um"] = nucleus_um[:, 0]
    obs["nucleus_y_um"] = nucleus_um[:, 1]
    obs["he_x_px"] = he_px[:, 0]
    obs["he_y_px"] = he_px[:, 1]
    table.obsm["nucleus_um"] = nucleus_um
    table.obsm["nucleus_he_px"] = he_px
    table.uns["section"] = {
        **{k: bundle.metadata[k] for k in SECTION_FIELDS},
        "source": bundle.metadata.get("source", "unknown"),
        "he_image": bundle.he_image.name,
        "he_mpp": he_mpp,
        "he_width_px": width,
        "he_height_px": height,
        "alignment_he_to_morphology_px": alignment.tolist(),
        "alignment_read_as": alignment_read_as,
        "alignment_source": "given" if placement is None else placement.source,
        "pixel_size_um": pixel_size,
        "xenium_software": str(experiment.get("analysis_sw_version", "")),
        "xenium_layout_version": bundle_version(experiment)[1],
        "nucleus_centroids_from": str(nuclei["source"].iloc[0]),
        "n_cells": int(len(cells)),
        "n_genes": int(table.n_vars),
    }
    return table


def write_section_zarr(table, path: Path) -> None:
    """Write the table and nucleus centroids (0.5 µm circles, µm) as a SpatialData zarr, atomically."""
    import geopandas as gpd
    from shapely import points
    from spatialdata import SpatialData
    from spatialdata.models import ShapesModel, TableModel

    nucleus_um = table.obsm["nucleus_um"]
    shapes = gpd.GeoDataFrame({"radius": np.full(len(nucleus_um), 0.5)}, geometry=points(nucleus_um),
                              index=table.obs_names.copy())
    table.obs["region"] = pd.Categorical(["nucleus_centroids"] * table.n_obs)
    table.obs["instance_id"] = table.obs_names.to_numpy()
    table.uns.pop("spatialdata_attrs", None)
    table = TableModel.parse(table, region="nucleus_centroids", region_key="region", instance_key="instance_id")
    sdata = SpatialData(shapes={"nucleus_centroids": ShapesModel.parse(shapes)}, tables={"table": table})
    with atomic_output(path) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="zarr v3 autosharding")
        sdata.write(tmp)


def ingest_section(folder: Path, out_dir: Path, placement: Placement | None = None) -> dict:
    """Ingest one raw section folder into ``out_dir/<section_id>.zarr``; return its metadata row. With
    ``placement`` (a registered alignment) the folder needs no alignment file."""
    bundle = locate_bundle(folder, require_alignment=placement is None)
    table = build_section_table(bundle, placement)
    write_section_zarr(table, out_dir / f"{bundle.section_id}.zarr")
    meta = dict(table.uns["section"])
    log.info("ingested %s: %d cells × %d genes, H&E %.4f µm/px (%d×%d px)", bundle.section_id, meta["n_cells"],
             meta["n_genes"], meta["he_mpp"], meta["he_width_px"], meta["he_height_px"])
    meta.pop("alignment_he_to_morphology_px")
    return meta | {"raw_folder": bundle.folder.name}
