"""Every vintage of the Xenium bundle (cellpath.io.xenium.LAYOUTS) is written by the simulator in
that vintage's form and read through ingest end to end, with a known answer: the nucleus centroids
written (registration jitter 0, so the simulator's truth) and the cell ids of that vintage."""

from __future__ import annotations

import json
import shutil
import zipfile

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

from cellpath.errors import InputError
from cellpath.io.ingest import FROM_BOUNDARIES, FROM_SUMMARY, ingest_section, polygon_centroids
from cellpath.io.xenium import LAYOUTS, bundle_version
from cellpath.vocabulary import XENIUM_LAYOUTS
from helpers.project import tiny_params

SECTIONS = {name: f"breast_{name.replace('-', '_').replace('.', '_')}" for name in XENIUM_LAYOUTS}


@pytest.fixture(scope="module")
def vintages(tmp_path_factory):
    from cellpath.stages.fetch import run as run_fetch

    root = tmp_path_factory.mktemp("vintages")
    sections = [{"section_id": section_id, "organ": "Breast", "status": "Breast cancer", "n_cells": 80,
                 "registration_jitter_um": 0.0, "xenium_layout": name} for name, section_id in SECTIONS.items()]
    run_fetch(tiny_params(cells=80, sections=sections), root / "data")
    return root / "data" / "raw"


def _ingest(folder, out):
    meta = ingest_section(folder, out)
    table = ad.read_zarr(out / f"{meta['section_id']}.zarr" / "tables" / "table")
    return meta, table


def _truth(folder) -> pd.DataFrame:
    return pd.read_parquet(folder / "simulation_truth.parquet").set_index("cell_id")


def test_the_layouts_are_the_vocabularys():
    assert tuple(LAYOUTS) == XENIUM_LAYOUTS


@pytest.mark.parametrize("name", XENIUM_LAYOUTS)
def test_each_vintage_is_read_with_its_own_ids_and_the_written_centroids(vintages, tmp_path, name):
    layout, folder = LAYOUTS[name], vintages / SECTIONS[name]
    with zipfile.ZipFile(folder / "cells.zarr.zip"):  # the fixture really is that vintage
        root = zarr.open_group(store=zarr.storage.ZipStore(folder / "cells.zarr.zip", mode="r"), mode="r")
        assert root["cell_id"].ndim == (1 if layout.integer_cell_ids else 2)
        assert root["cell_summary"].shape[1] == len(layout.summary_columns)
    cell_id_type = pq.read_schema(folder / "cells.parquet").field("cell_id").type
    assert cell_id_type == (pa.int64() if layout.integer_cell_ids else pa.binary() if layout.binary_parquet_ids
                            else pa.string())
    assert ("label_id" in pq.read_schema(folder / "nucleus_boundaries.parquet").names) == layout.boundaries_label_id
    experiment = json.loads((folder / "experiment.xenium").read_text())

    meta, table = _ingest(folder, tmp_path)
    truth = _truth(folder)
    assert list(table.obs_names) == list(truth.index)
    if layout.integer_cell_ids:
        assert list(table.obs_names[:3]) == ["1", "2", "3"]
    else:
        assert all(len(i) == 10 and i.endswith("-1") for i in table.obs_names)
    np.testing.assert_allclose(table.obsm["nucleus_um"], truth[["true_x_um", "true_y_um"]].to_numpy(), atol=1e-9)
    assert meta["nucleus_centroids_from"] == FROM_SUMMARY
    assert meta["xenium_layout_version"] == (layout.xenium_ranger_version or layout.analysis_sw_version)
    assert bundle_version(experiment)[0] == tuple(int(v) for v in meta["xenium_layout_version"][7:].split(".")[:3])
    assert table.n_vars == 300 and table.X.sum() > 0


@pytest.mark.parametrize("name", ["xoa-1.0", "xoa-2.0"])
def test_without_centroids_in_the_summary_they_come_from_the_nucleus_polygons(vintages, tmp_path, name):
    folder = tmp_path / "raw" / SECTIONS[name]
    shutil.copytree(vintages / SECTIONS[name], folder)
    _drop_summary_centroids(folder / "cells.zarr.zip")
    meta, table = _ingest(folder, tmp_path / "sections")
    assert meta["nucleus_centroids_from"] == FROM_BOUNDARIES
    # the simulator's 13-vertex polygons are symmetric about the centre: their area centroid is it,
    # up to the float32 the vertices are stored in
    np.testing.assert_allclose(table.obsm["nucleus_um"], _truth(folder)[["true_x_um", "true_y_um"]].to_numpy(),
                               atol=1e-3)
    (folder / "nucleus_boundaries.parquet").unlink()
    with pytest.raises(InputError, match=r"no nucleus centroids .*nucleus_boundaries\.parquet.* is missing"):
        ingest_section(folder, tmp_path / "again")


def _drop_summary_centroids(path) -> None:
    """Rewrite cells.zarr.zip's cell_summary without nucleus_centroid_x/y (a bundle that lacks them)."""
    unpacked = path.with_suffix(".d")
    with zipfile.ZipFile(path) as zf:
        zf.extractall(unpacked)
    root = zarr.open_group(store=str(unpacked), mode="r+")
    names = list(root["cell_summary"].attrs["column_names"])
    keep = [i for i, c in enumerate(names) if not c.startswith("nucleus_centroid")]
    values = np.asarray(root["cell_summary"][:])[:, keep]
    del root["cell_summary"]
    array = root.create_array("cell_summary", data=values, chunks=values.shape, compressors=None)
    array.attrs["column_names"] = [names[i] for i in keep]
    path.unlink()
    with zipfile.ZipFile(path, "w") as zf:
        for member in sorted(p for p in unpacked.rglob("*") if p.is_file()):
            zf.write(member, member.relative_to(unpacked).as_posix())
    shutil.rmtree(unpacked)


def test_polygon_centroids_are_area_centroids_and_the_largest_nucleus_is_a_cells():
    square = [(0, 0), (4, 0), (4, 4), (0, 4), (0, 0)]          # closed; centroid (2, 2), area 16
    triangle = [(10, 0), (16, 0), (10, 3)]                      # open; centroid (12, 1), area 9
    vertices = pd.DataFrame([("c1", "c1/1", x, y) for x, y in square] + [("c1", "c1/2", x, y) for x, y in triangle]
                            + [("c2", "c2/1", 5.0, 5.0), ("c2", "c2/1", 5.0, 5.0)],  # degenerate: the vertex mean
                            columns=["cell_id", "polygon", "x", "y"])
    centroids = polygon_centroids(vertices)
    np.testing.assert_allclose(centroids[["x", "y", "area"]].to_numpy(), [[2, 2, 16], [12, 1, 9], [5, 5, 0]])
    shuffled = vertices.iloc[[0, 5, 1, 2, 3, 4, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="not consecutive"):
        polygon_centroids(shuffled)


@pytest.mark.parametrize(("experiment", "expected"), [
    ({"analysis_sw_version": "xenium-1.0.2"}, (1, 0, 2)),
    ({"analysis_sw_version": "xenium-2.0.0.6-35-ga7e17149a"}, (2, 0, 0)),
    ({"analysis_sw_version": "Xenium-3.0.1.1"}, (3, 0, 1)),
    ({"analysis_sw_version": "xenium-1.6.0.7", "xenium_ranger": {"version": "xenium-3.0.1.1"}}, (3, 0, 1)),
    ({"analysis_sw_version": "unknown"}, None),
    ({}, None),
])
def test_the_version_that_decides_the_layout(experiment, expected):
    assert bundle_version(experiment)[0] == expected


# ------------------------------------------------------------------ Xenium Explorer keypoint exports


def _keypoints_instead_of_the_matrix(folder, *, fixed_in_um: bool, pixel_size: float = 0.2125) -> None:
    """Replace the section's alignment matrix by a keypoint export of the same registration: four
    H&E px points (alignmentX/Y) and where the matrix sends them (fixedX/Y), in morphology px or µm."""
    path = next(folder.glob("*he_imagealignment.csv"))
    matrix = np.loadtxt(path, delimiter=",")
    he = np.array([[100.0, 80.0], [1500.0, 120.0], [200.0, 1400.0], [1300.0, 1250.0]])
    fixed = (np.column_stack([he, np.ones(4)]) @ matrix.T)[:, :2] * (pixel_size if fixed_in_um else 1.0)
    rows = [f"{f[0]:.6f},{f[1]:.6f},{h[0]},{h[1]}" for f, h in zip(fixed, he)]
    path.write_text("fixedX,fixedY,alignmentX,alignmentY\n" + "\n".join(rows) + "\n")


@pytest.mark.parametrize(("fixed_in_um", "read_as"), [(False, "keypoints (fixed in morphology px)"),
                                                       (True, "keypoints (fixed in µm, converted)")])
def test_keypoint_units_are_told_apart_by_the_images_pixel_sizes(vintages, tmp_path, fixed_in_um, read_as):
    source = vintages / SECTIONS["xoa-3.0"]
    expected_meta, expected = _ingest(source, tmp_path / "matrix")
    folder = tmp_path / "raw" / source.name
    shutil.copytree(source, folder)
    _keypoints_instead_of_the_matrix(folder, fixed_in_um=fixed_in_um)
    meta, table = _ingest(folder, tmp_path / "keypoints")
    assert (expected_meta["alignment_read_as"], meta["alignment_read_as"]) == ("matrix", read_as)
    np.testing.assert_allclose(table.obsm["nucleus_he_px"], expected.obsm["nucleus_he_px"], atol=1e-3)


def test_an_alignment_of_another_scale_is_refused(vintages, tmp_path):
    folder = tmp_path / "raw" / SECTIONS["xoa-3.0"]
    shutil.copytree(vintages / SECTIONS["xoa-3.0"], folder)
    path = next(folder.glob("*he_imagealignment.csv"))
    matrix = np.loadtxt(path, delimiter=",")
    matrix[:2, :2] *= 2.0  # the alignment of an H&E scanned at half the resolution
    path.write_text("\n".join(",".join(f"{v:.9g}" for v in row) for row in matrix) + "\n")
    with pytest.raises(InputError, match=r"he_imagealignment\.csv: the alignment scales H&E px by 2\.57\d* but the "
                                         r"images need 1\.28\d* \(H&E 0\.2738 µm/px ÷ morphology 0\.2125 µm/px"):
        ingest_section(folder, tmp_path / "sections")
