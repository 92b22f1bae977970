"""Outputs for scverse tools: one SpatialData per section for napari-spatialdata, embeddings as AnnData.

A section's export holds, in one coordinate system ``global`` in Xenium µm (the frame of the
ingested cell table):

- ``images/he``: the registered H&E as a multiscale image (c, y, x; uint8), every level 2× coarser
  than the one before, with the alignment as an affine transformation level-0 px → µm;
- ``shapes/nucleus_boundaries``: each cell's nucleus polygon (µm) read by spatialdata-io from
  ``nucleus_boundaries.parquet``, or a circle of the cell's nucleus area where a bundle has none;
- ``tables/table``: the ingested counts with the labels in ``obs`` (68-type, Tfine, Tcoarse,
  eligibility, confidence), annotating the boundaries by ``cell_id``; ``obsm["spatial"]`` in µm.

Why the image is written through ome-zarr rather than ``SpatialData.write``: the pinned stack holds
spatialdata 0.7.0 (every later release needs ``dask<2026.1.2``, tiatoolbox 2.1.3 needs
``>=2026.1.2``), and 0.7.0 hands dask's chunk tuples to zarr, which refuses them. The pyramid is
written with ome-zarr's own writer in spatialdata's raster format, and the transformation is then
set through spatialdata's public API (docs/decisions/0029-scverse-exports.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.errors import InputError

HE_IMAGE = "he"
NUCLEUS_SHAPES = "nucleus_boundaries"
TABLE = "table"
COORDINATE_SYSTEM = "global"  # Xenium µm
HE_CHUNK_PX = 512  # zarr chunk edge of every pyramid level (px)
HE_SMALLEST_LEVEL_PX = 512  # coarsening stops once a level's longer side is at most this (px)


@dataclass(frozen=True)
class NucleusShapes:
    """Nucleus outlines (µm) in the table's cell order, and how many cells got a circle instead."""

    shapes: object  # geopandas.GeoDataFrame indexed by cell_id: polygons, or points with a radius
    source: str
    n_without_polygon: int


def he_px_to_um(alignment: np.ndarray, pixel_size_um: float) -> np.ndarray:
    """3×3 affine H&E level-0 px (x, y, 1) → Xenium µm: the alignment (px → morphology px) scaled by
    the morphology pixel size (µm/px). The inverse of :func:`cellpath.io.coords.um_to_he_px`."""
    return np.diag([pixel_size_um, pixel_size_um, 1.0]) @ np.asarray(alignment, dtype=float)


def _level0_cyx(path: Path, section: str):
    """The TIFF's first series at level 0 as a lazy (c, y, x) dask array, through tifffile's zarr view
    (nothing is read into memory)."""
    import dask.array as da
    import tifffile
    import zarr

    try:
        with tifffile.TiffFile(path) as tif:
            axes = tif.series[0].axes
        store = zarr.open(tifffile.imread(path, aszarr=True, series=0, level=0), mode="r")
    except (OSError, ValueError, tifffile.TiffFileError) as exc:
        raise InputError(f"cannot read the H&E image ({type(exc).__name__}: {exc})", path=path, section=section) \
            from None
    image = da.from_zarr(store)
    if axes == "YXS":
        return image.transpose(2, 0, 1)
    if axes in ("CYX", "SYX"):
        return image
    if axes == "YX":
        return image[None]
    raise InputError(f"H&E image axes {axes!r} are not an RGB (YXS / CYX) or grey (YX) plane; export a 2-D "
                     "image series", path=path, section=section)


def he_image_element(path: Path, section: str, level0_to_um: np.ndarray, *, downsample: int = 1):
    """The H&E as spatialdata's multiscale image model (lazy, uint8, c × y × x): level 0 is the slide's
    level 0 coarsened by ``downsample`` (an integer factor, block mean), each next level 2× coarser
    (spatialdata's own pyramid) until the longer side is ≤ :data:`HE_SMALLEST_LEVEL_PX`, with
    ``level0_to_um`` (3×3, the exported level-0 px → µm) as the transformation to
    :data:`COORDINATE_SYSTEM`."""
    import dask.array as da
    from spatialdata.models import Image2DModel
    from spatialdata.transformations import Affine

    if downsample < 1:
        raise ValueError(f"downsample must be a positive integer, got {downsample}")
    image = _level0_cyx(path, section)
    if image.dtype != np.uint8:
        raise InputError(f"H&E image is {image.dtype}, expected 8-bit RGB", path=path, section=section)
    if downsample > 1:
        mean = da.coarsen(np.mean, image.astype(np.float32), {1: downsample, 2: downsample}, trim_excess=True)
        image = da.round(mean).astype(np.uint8)
    n_levels = max(0, int(np.ceil(np.log2(max(image.shape[1:]) / HE_SMALLEST_LEVEL_PX))))
    transform = Affine(np.asarray(level0_to_um, dtype=float), input_axes=("x", "y"), output_axes=("x", "y"))
    channels = ["r", "g", "b"] if image.shape[0] == 3 else [f"c{i}" for i in range(image.shape[0])]
    return Image2DModel.parse(image, dims=("c", "y", "x"), c_coords=channels, scale_factors=[2] * n_levels or None,
                              transformations={COORDINATE_SYSTEM: transform},
                              chunks=(image.shape[0], HE_CHUNK_PX, HE_CHUNK_PX))


def nucleus_shapes(raw_folder: Path, obs: pd.DataFrame, section: str) -> NucleusShapes:
    """Each cell's nucleus outline (µm), in ``obs``'s order (index = cell_id): spatialdata-io's polygons
    from ``nucleus_boundaries.parquet``; cells it has none for (or a bundle without the file) get a
    circle at the nucleus centroid with the cell's nucleus area (µm²), counted."""
    import geopandas as gpd
    from shapely import buffer, points

    polygons = None
    if (raw_folder / "nucleus_boundaries.parquet").is_file():
        from spatialdata_io import xenium

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                read = xenium(raw_folder, cells_boundaries=False, nucleus_boundaries=True, cells_labels=False,
                              nucleus_labels=False, transcripts=False, morphology_mip=False, morphology_focus=False,
                              aligned_images=False, cells_as_circles=False, cells_table=False)
        except Exception as exc:  # the reader raises many types for malformed files
            raise InputError(f"spatialdata-io could not read the nucleus boundaries ({type(exc).__name__}: {exc})",
                             path=raw_folder / "nucleus_boundaries.parquet", section=section) from None
        polygons = read.shapes[NUCLEUS_SHAPES].geometry  # µm; spatialdata-io's "global" is morphology px
    cell_ids = obs.index.astype(str)
    geometry = (polygons.reindex(cell_ids).to_numpy() if polygons is not None
                else np.full(len(obs), None, dtype=object))
    missing = pd.isna(geometry)
    if missing.any():
        area = obs["nucleus_area"].to_numpy(float) if "nucleus_area" in obs else np.full(len(obs), np.nan)
        area = np.where(np.isfinite(area) & (area > 0), area, 25.0 * np.pi)  # else a 5 µm radius
        centres = points(obs[["nucleus_x_um", "nucleus_y_um"]].to_numpy(float)[missing])
        geometry[missing] = buffer(centres, np.sqrt(area[missing] / np.pi), quad_segs=16)
    source = ("nucleus_boundaries.parquet (spatialdata-io)" if polygons is not None
              else "circles of the nucleus area (no nucleus_boundaries.parquet)")
    frame = gpd.GeoDataFrame(geometry=gpd.GeoSeries(geometry, index=cell_ids))
    return NucleusShapes(frame, source, int(missing.sum()))


def labelled_table(table, labels: pd.DataFrame, section: str):
    """The ingested AnnData (cells × genes) with the labels joined on cell_id into ``obs`` and
    ``obsm["spatial"]`` = nucleus centroids (µm), annotating :data:`NUCLEUS_SHAPES` by ``cell_id``."""
    from spatialdata.models import TableModel

    cell_ids = table.obs_names.to_numpy()
    if not np.array_equal(labels["cell_id"].to_numpy(), cell_ids):
        raise InputError("labels and the section table list different cells (or orders); rerun `cellpath "
                         "annotate`", section=section)
    table = table.copy()
    for column in ("type_68", "predicted_type", "fine", "coarse"):
        table.obs[column] = pd.Categorical(labels[column].astype(object).where(labels[column].notna(), None))
    table.obs["confidence"] = labels["confidence"].to_numpy(np.float32)
    table.obs["eligible"] = labels["eligible"].to_numpy(bool)
    table.obs["region"] = pd.Categorical([NUCLEUS_SHAPES] * table.n_obs)
    table.obs["cell_id"] = cell_ids.astype(str)
    table.obs = table.obs.drop(columns=["instance_id"], errors="ignore")  # ingest's key for its centroid circles
    table.obsm["spatial"] = table.obs[["nucleus_x_um", "nucleus_y_um"]].to_numpy(float)
    table.uns.pop("spatialdata_attrs", None)
    return TableModel.parse(table, region=NUCLEUS_SHAPES, region_key="region", instance_key="cell_id")


def write_he_image(zarr_path: Path, element) -> None:
    """Add ``element`` (from :func:`he_image_element`) as the image :data:`HE_IMAGE` of the SpatialData
    store at ``zarr_path``: what ``SpatialData.write`` does for a multiscale image, with the zarr
    chunks given as integers (spatialdata 0.7.0 passes dask's chunk tuples, which zarr 3 refuses)."""
    import zarr
    from ome_zarr.writer import write_multiscale
    from spatialdata._io._utils import overwrite_coordinate_transformations_raster
    from spatialdata._io.format import CurrentRasterFormat
    from spatialdata.transformations import get_transformation
    from xarray import DataTree

    raster_format = CurrentRasterFormat()
    levels = [element[name]["image"] for name in element.children] if isinstance(element, DataTree) else [element]
    group = zarr.open_group(zarr_path, mode="a").require_group("images").require_group(HE_IMAGE)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="zarr v3 autosharding")
        write_multiscale([lv.data for lv in levels], group, fmt=raster_format, axes=list(levels[0].dims),
                         storage_options=[{"chunks": lv.data.chunksize} for lv in levels],
                         metadata={"omero": {"channels": [{"label": str(c)} for c in levels[0].coords["c"].values]}})
    overwrite_coordinate_transformations_raster(group=group, axes=tuple(levels[0].dims),
                                                transformations=get_transformation(element, get_all=True),
                                                raster_format=raster_format)
    group.attrs["spatialdata_attrs"] = {"version": raster_format.spatialdata_format_version}
    zarr.consolidate_metadata(zarr_path)  # the store's index of elements, as SpatialData.write leaves it


def write_section_sdata(path: Path, *, table, shapes: NucleusShapes, he_image) -> None:
    """Write one section's SpatialData (image, boundaries, labelled table) to ``path`` (a new folder)."""
    from spatialdata import SpatialData
    from spatialdata.models import ShapesModel

    sdata = SpatialData(shapes={NUCLEUS_SHAPES: ShapesModel.parse(shapes.shapes)}, tables={TABLE: table})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="zarr v3 autosharding")
        sdata.write(path)
    write_he_image(path, he_image)


def embeddings_anndata(section: str, labels: pd.DataFrame, readouts: dict[str, np.ndarray], sidecar: dict):
    """One section's base readouts as AnnData: obs indexed by cell_id (with section_id and the labels),
    ``obsm[<readout>]`` float32 cells × D (Nuc, Mean, Cls as stored), ``uns["features"]`` the sidecar;
    X is empty (cells × 0), as :func:`anndata.experimental.concat_on_disk` concatenates sections."""
    import anndata as ad
    from scipy import sparse

    obs = pd.DataFrame({
        "section_id": pd.Categorical([section] * len(labels)),
        **{c: pd.Categorical(labels[c].astype(object).where(labels[c].notna(), None))
           for c in ("type_68", "fine", "coarse")},
        "confidence": labels["confidence"].to_numpy(np.float32),
        "eligible": labels["eligible"].to_numpy(bool),
    }, index=pd.Index(labels["cell_id"].astype(str).to_numpy(), name="cell_id"))
    for name, matrix in readouts.items():
        if matrix.shape[0] != len(obs):
            raise InputError(f"{name} has {matrix.shape[0]} rows, the section has {len(obs)} cells; rerun "
                             "`cellpath extract`", section=section)
    return ad.AnnData(X=sparse.csr_matrix((len(obs), 0), dtype=np.float32), obs=obs,
                      obsm={name: np.asarray(m, dtype=np.float32) for name, m in readouts.items()},
                      uns={"features": sidecar})
