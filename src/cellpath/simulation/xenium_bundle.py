"""Writers of a 10x Xenium output bundle plus a registered H&E in 10x Genomics' own file formats
(:mod:`cellpath.io.xenium` names the format): the simulator writes with these to produce exactly
what a 10x download holds, in any vintage of :data:`cellpath.io.xenium.LAYOUTS`.

All writers are deterministic: the same inputs give byte-identical files (no timestamps or UUIDs).
Coordinates are Xenium µm; the H&E alignment maps H&E level-0 px → morphology px.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tifffile
import zarr
from scipy import sparse

from cellpath.io.xenium import DEFAULT_LAYOUT, NUCLEUS_CENTROID_COLUMNS, XeniumLayout

NUCLEUS_POLYGON_VERTICES = 13
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class BundleCells:
    """What the bundle says about cells. Coordinates in Xenium µm; areas in µm²."""

    id_prefix: np.ndarray  # (N,) uint32
    cell_xy_um: np.ndarray  # (N, 2)
    nucleus_xy_um: np.ndarray  # (N, 2)
    cell_area: np.ndarray
    nucleus_area: np.ndarray
    nucleus_axes_um: np.ndarray  # (N, 2) semi-major, semi-minor, for boundary polygons
    nucleus_angle: np.ndarray  # (N,) radians, in the µm frame
    counts: sparse.csr_matrix  # cells × features
    feature_names: tuple[str, ...]
    feature_types: tuple[str, ...]
    layout: XeniumLayout = DEFAULT_LAYOUT

    @property
    def cell_ids(self) -> list[str]:
        return self.layout.cell_ids(self.id_prefix)


def write_experiment(path: Path, *, run_name: str, region_name: str, n_cells: int, panel_name: str,
                     n_targets: int, pixel_size_um: float, median_transcripts: float,
                     layout: XeniumLayout = DEFAULT_LAYOUT) -> None:
    meta = {
        "major_version": 5,
        "minor_version": 0,
        "run_name": run_name,
        "run_start_time": "2024-01-01T00:00:00Z",
        "region_name": region_name,
        "preservation_method": "ffpe",
        "num_cells": int(n_cells),
        "transcripts_per_cell": float(median_transcripts),
        "transcripts_per_100um": None,
        "cassette_name": "simulated",
        "slide_id": "0000000",
        "panel_design_id": "simulated",
        "panel_name": panel_name,
        "panel_organism": "Human",
        "panel_num_targets_predesigned": int(n_targets),
        "panel_num_targets_custom": 0,
        "pixel_size": float(pixel_size_um),
        "instrument_sn": "simulated",
        "instrument_sw_version": "3.0.0.15",
        "analysis_sw_version": layout.analysis_sw_version,
        "experiment_uuid": "00000000-0000-0000-0000-000000000000",
        "cassette_uuid": "00000000-0000-0000-0000-000000000000",
        "roi_uuid": "00000000-0000-0000-0000-000000000000",
        "z_step_size": 3.0,
        "well_uuid": "",
        "calibration_uuid": "N/A",
        "images": {"morphology_filepath": "morphology.ome.tif", "morphology_focus_filepath": "morphology_focus/"},
    }
    if layout.xenium_ranger_version is not None:
        meta["xenium_ranger"] = {"version": layout.xenium_ranger_version, "segmentation": "resegment"}
    path.write_text(json.dumps(meta, indent=2) + "\n")


def write_feature_matrix(path: Path, cells: BundleCells, genome: str = "GRCh38") -> None:
    """10x HDF5 feature-barcode matrix, v3 layout: features × cells in CSC form."""
    matrix = cells.counts.T.tocsc()  # features × cells; CSC columns are cells
    matrix.sort_indices()
    ids = list(cells.feature_names)  # Xenium uses the gene symbol (or control name) as the feature id
    with h5py.File(path, "w", track_order=False) as f:
        f.attrs["chemistry_description"] = "Xenium"
        f.attrs["filetype"] = "matrix"
        f.attrs["library_ids"] = np.array([b"id1"])
        f.attrs["original_gem_groups"] = np.array([1])
        f.attrs["software_version"] = cells.layout.xenium_ranger_version or cells.layout.analysis_sw_version
        f.attrs["version"] = 2
        g = f.create_group("matrix")

        def put(group: h5py.Group, name: str, data: np.ndarray) -> None:
            compress = {"compression": "gzip", "compression_opts": 4, "shuffle": True} if len(data) else {}
            group.create_dataset(name, data=data, track_times=False, **compress)

        put(g, "barcodes", np.array(cells.cell_ids, dtype="S"))
        put(g, "data", matrix.data.astype(np.int32))
        put(g, "indices", matrix.indices.astype(np.int64))
        put(g, "indptr", matrix.indptr.astype(np.int64))
        g.create_dataset("shape", data=np.array(matrix.shape, dtype=np.int32), track_times=False)
        feats = g.create_group("features")
        put(feats, "id", np.array(ids, dtype="S"))
        put(feats, "name", np.array(cells.feature_names, dtype="S"))
        put(feats, "feature_type", np.array(cells.feature_types, dtype="S"))
        put(feats, "genome", np.array([genome] * len(ids), dtype="S"))
        feats.create_dataset("_all_tag_keys", data=np.array([b"genome"]), track_times=False)


def write_cells_parquet(path: Path, cells: BundleCells) -> None:
    """cells.parquet with Arrow string ids (pandas' "string" dtype would break the id link)."""
    counts = cells.counts
    is_gene = np.array([k == "Gene Expression" for k in cells.feature_types])
    gene_totals = np.asarray(counts[:, np.flatnonzero(is_gene)].sum(axis=1)).ravel()
    probe = np.array([k == "Negative Control Probe" for k in cells.feature_types])
    codeword = np.array([k == "Negative Control Codeword" for k in cells.feature_types])
    unassigned = np.array([k == "Unassigned Codeword" for k in cells.feature_types])

    def total(mask: np.ndarray) -> np.ndarray:
        return np.asarray(counts[:, np.flatnonzero(mask)].sum(axis=1)).ravel().astype(np.int64)

    table = pa.table({
        "cell_id": _id_column(cells.cell_ids, cells.layout),
        "x_centroid": pa.array(cells.cell_xy_um[:, 0], type=pa.float64()),
        "y_centroid": pa.array(cells.cell_xy_um[:, 1], type=pa.float64()),
        "transcript_counts": pa.array(gene_totals.astype(np.int64)),
        "control_probe_counts": pa.array(total(probe)),
        "genomic_control_counts": pa.array(np.zeros(len(gene_totals), dtype=np.int64)),
        "control_codeword_counts": pa.array(total(codeword)),
        "unassigned_codeword_counts": pa.array(total(unassigned)),
        "deprecated_codeword_counts": pa.array(np.zeros(len(gene_totals), dtype=np.int64)),
        "total_counts": pa.array(np.asarray(counts.sum(axis=1)).ravel().astype(np.int64)),
        "cell_area": pa.array(cells.cell_area, type=pa.float64()),
        "nucleus_area": pa.array(cells.nucleus_area, type=pa.float64()),
        "nucleus_count": pa.array(np.ones(len(gene_totals), dtype=np.int64)),
        "segmentation_method": pa.array(["Segmented by nucleus expansion of 5.0µm"] * len(gene_totals)),
    })
    pq.write_table(table, path, compression="zstd")


def _id_column(ids: list[str], layout: XeniumLayout) -> pa.Array:
    """A parquet cell_id column of the layout: int64, Arrow binary or (today) Arrow string."""
    if layout.integer_cell_ids:
        return pa.array(np.array(ids, dtype=np.int64))
    if layout.binary_parquet_ids:
        return pa.array([i.encode() for i in ids], type=pa.binary())
    return pa.array(ids, type=pa.string())


def write_nucleus_boundaries(path: Path, cells: BundleCells) -> None:
    """Nucleus outlines as closed 13-vertex polygons (first vertex repeated), µm."""
    k = NUCLEUS_POLYGON_VERTICES
    theta = np.linspace(0, 2 * np.pi, k, endpoint=False)
    theta = np.append(theta, 0.0)
    a, b = cells.nucleus_axes_um[:, :1], cells.nucleus_axes_um[:, 1:]
    c, s = np.cos(cells.nucleus_angle)[:, None], np.sin(cells.nucleus_angle)[:, None]
    u, v = a * np.cos(theta)[None, :], b * np.sin(theta)[None, :]
    x = cells.nucleus_xy_um[:, :1] + u * c - v * s
    y = cells.nucleus_xy_um[:, 1:] + u * s + v * c
    ids = list(np.repeat(np.array(cells.cell_ids, dtype=object), k + 1))
    columns = {
        "cell_id": _id_column(ids, cells.layout),
        "vertex_x": pa.array(x.ravel().astype(np.float32)),
        "vertex_y": pa.array(y.ravel().astype(np.float32)),
    }
    if cells.layout.boundaries_label_id:
        columns["label_id"] = pa.array(np.repeat(np.arange(1, len(x) + 1, dtype=np.uint32), k + 1))
    pq.write_table(pa.table(columns), path, compression="zstd")


def write_cells_zarr_zip(path: Path, cells: BundleCells) -> None:
    """cells.zarr.zip: a zarr v2 group zipped with fixed timestamps and sorted members."""
    layout = cells.layout
    n = len(cells.cell_area)
    values = {"cell_centroid_x": cells.cell_xy_um[:, 0], "cell_centroid_y": cells.cell_xy_um[:, 1],
              "cell_area": cells.cell_area, "nucleus_centroid_x": cells.nucleus_xy_um[:, 0],
              "nucleus_centroid_y": cells.nucleus_xy_um[:, 1], "nucleus_area": cells.nucleus_area,
              "z_level": np.zeros(n), "nucleus_count": np.ones(n)}
    names = [c for c in layout.summary_columns
             if layout.summary_has_nucleus_centroids or c not in NUCLEUS_CENTROID_COLUMNS]
    summary = np.column_stack([values[c] for c in names]).astype(np.float64)
    if layout.integer_cell_ids:
        cell_id = np.arange(1, n + 1, dtype=np.uint32)
    else:
        cell_id = np.column_stack([cells.id_prefix.astype(np.uint32), np.ones(n, dtype=np.uint32)])
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        root = zarr.open_group(store=tmp, mode="w", zarr_format=2)
        root.attrs["major_version"] = 5
        root.attrs["minor_version"] = 0
        root.attrs["number_cells"] = int(len(cell_id))
        rows = max(1, min(len(cell_id), 100_000))
        root.create_array("cell_id", data=cell_id, chunks=(rows, *cell_id.shape[1:]), compressors=None)
        arr = root.create_array("cell_summary", data=summary, chunks=(rows, len(names)), compressors=None)
        arr.attrs["column_names"] = names
        members = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
            for member in members:
                info = zipfile.ZipInfo(member.relative_to(tmp).as_posix(), date_time=ZIP_EPOCH)
                info.external_attr = 0o644 << 16
                zf.writestr(info, member.read_bytes())


def _ome_xml(shape: tuple[int, int, int], mpp: float, name: str) -> str:
    height, width, _ = shape
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<OME xmlns="http://www.openmicroscopy.org/Schemas/OME/2016-06" '
        'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" '
        'xsi:schemaLocation="http://www.openmicroscopy.org/Schemas/OME/2016-06 '
        'http://www.openmicroscopy.org/Schemas/OME/2016-06/ome.xsd" Creator="cellpath">'
        '<Instrument ID="Instrument:0"><Objective ID="Objective:0" NominalMagnification="40.0"/></Instrument>'
        f'<Image ID="Image:0" Name="{name}"><InstrumentRef ID="Instrument:0"/><ObjectiveSettings ID="Objective:0"/><Pixels ID="Pixels:0" DimensionOrder="XYCZT" Type="uint8" '
        f'SizeX="{width}" SizeY="{height}" SizeC="3" SizeZ="1" SizeT="1" '
        f'PhysicalSizeX="{mpp:.6f}" PhysicalSizeXUnit="&#181;m" PhysicalSizeY="{mpp:.6f}" PhysicalSizeYUnit="&#181;m" '
        'Interleaved="true"><Channel ID="Channel:0:0" SamplesPerPixel="3"><LightPath/></Channel>'
        '<TiffData IFD="0" PlaneCount="1"/></Pixels></Image></OME>'
    )


def write_he_ome_tiff(path: Path, rgb: np.ndarray, mpp: float | None, *, tile: int = 256, min_level_px: int = 512) -> None:
    """Pyramidal RGB OME-TIFF (levels as SubIFDs, ×2 per level, JPEG tiles).

    ``mpp`` goes into the OME PhysicalSizeX/Y and the TIFF resolution tags; ``None`` writes an
    image without any pixel size (used to test that ingest refuses it).
    """
    levels = [rgb]
    while min(levels[-1].shape[:2]) // 2 >= min_level_px:
        prev = levels[-1]
        h, w = (prev.shape[0] // 2) * 2, (prev.shape[1] // 2) * 2
        levels.append(prev[:h, :w].reshape(h // 2, 2, w // 2, 2, 3).mean(axis=(1, 3)).round().astype(np.uint8))
    options = {"tile": (tile, tile), "photometric": "rgb", "compression": "jpeg", "compressionargs": {"level": 90},
               "metadata": None, "software": "cellpath"}
    description = _ome_xml(rgb.shape, mpp, path.name) if mpp is not None else None
    with tifffile.TiffWriter(path, bigtiff=True) as tif:
        for i, level in enumerate(levels):
            kwargs = dict(options)
            if mpp is not None:
                px_per_cm = 1e4 / (mpp * 2**i)
                kwargs.update(resolution=(px_per_cm, px_per_cm), resolutionunit="CENTIMETER")
            if i == 0:
                tif.write(level, subifds=len(levels) - 1, description=description, **kwargs)
            else:
                tif.write(level, subfiletype=1, **kwargs)
