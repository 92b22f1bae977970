"""`cellpath export`: SpatialData per section and AnnData embeddings, read back with spatialdata/anndata."""

from __future__ import annotations

import shutil
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import tifffile
from skimage.color import rgb2hed

from cellpath.errors import InputError
from cellpath.features.store import artifact_dir, open_artifact
from cellpath.io.coords import um_to_he_px
from cellpath.io.layout import export_embeddings_h5ad, export_section_zarr, features_dir, section_labels
from cellpath.io.scverse import he_image_element, he_px_to_um
from cellpath.commands.export import run as run_export


@pytest.fixture(scope="module")
def exported(tiny_features, tmp_path_factory) -> dict:
    """The tiny panel with 10× features, exported at full resolution (breast_a) and 2× coarser (breast_b)."""
    data_dir = tmp_path_factory.mktemp("export") / "data"
    shutil.copytree(tiny_features["data_dir"], data_dir)
    params = tiny_features["params"]
    full = run_export(params, data_dir, sections=["breast_a"], encoders=["filterbank-dense"], magnifications=["10x"])
    halved = run_export(params, data_dir, sections=["breast_b"], encoders=["filterbank-dense"],
                        magnifications=["10x"], he_downsample=2)
    return {"data_dir": data_dir, "params": params, "full": full, "halved": halved}


def _read(path):
    import spatialdata as sd

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sd.read_zarr(path)


def _hematoxylin_at(sdata, xy_um: np.ndarray) -> np.ndarray:
    """Hematoxylin density of the exported H&E (level 0) at points given in µm, through the image's
    own transformation µm → px."""
    from spatialdata.transformations import get_transformation

    matrix = get_transformation(sdata["he"], "global").to_affine_matrix(("x", "y"), ("x", "y"))
    px = np.column_stack([xy_um, np.ones(len(xy_um))]) @ np.linalg.inv(matrix).T
    image = np.moveaxis(sdata["he"]["scale0"]["image"].values, 0, -1)
    hed = rgb2hed(image)[..., 0]
    col = np.clip(np.round(px[:, 0]).astype(int), 0, image.shape[1] - 1)
    row = np.clip(np.round(px[:, 1]).astype(int), 0, image.shape[0] - 1)
    return hed[row, col]


@pytest.mark.parametrize("section, factor", [("breast_a", 1), ("breast_b", 2)])
def test_section_export_places_the_he_on_the_nuclei(exported, section, factor):
    sdata = _read(export_section_zarr(exported["data_dir"], section))
    table = sdata["table"]
    xy = table.obsm["spatial"]
    assert np.allclose(xy, table.obs[["nucleus_x_um", "nucleus_y_um"]].to_numpy())
    at_nuclei = _hematoxylin_at(sdata, xy)
    shifted = _hematoxylin_at(sdata, xy + np.array([12.0, 12.0]))  # a nucleus diameter or two away
    assert np.median(at_nuclei) > np.median(shifted) + 0.02, (np.median(at_nuclei), np.median(shifted))
    he = sdata["he"]
    level0 = he["scale0"]["image"]
    width = int(table.uns["section"]["he_width_px"])
    assert level0.shape[2] == width // factor and level0.dtype == np.uint8
    assert len(he.children) >= 2  # a pyramid napari can zoom out of


def test_he_transformation_is_the_inverse_of_the_cell_placement():
    alignment = np.array([[1.28, -0.12, -150.0], [0.12, 1.28, -378.0], [0.0, 0.0, 1.0]])
    xy_um = np.array([[10.0, 20.0], [300.5, 41.25], [0.0, 0.0]])
    he_px = um_to_he_px(xy_um, alignment, 0.2125)
    back = np.column_stack([he_px, np.ones(3)]) @ he_px_to_um(alignment, 0.2125).T
    np.testing.assert_allclose(back[:, :2], xy_um, atol=1e-9)


def test_section_table_carries_the_labels_and_annotates_the_boundaries(exported):
    data_dir = exported["data_dir"]
    sdata = _read(export_section_zarr(data_dir, "breast_a"))
    table, shapes = sdata["table"], sdata["nucleus_boundaries"]
    labels = pd.read_parquet(section_labels(data_dir, "breast_a"))
    assert table.obs_names.tolist() == labels["cell_id"].tolist()
    for column in ("type_68", "fine", "coarse"):
        expected = labels[column].astype(object).where(labels[column].notna(), None).tolist()
        got = table.obs[column].astype(object).where(table.obs[column].notna(), None).tolist()
        assert got == expected, column
    np.testing.assert_array_equal(table.obs["eligible"].to_numpy(), labels["eligible"].to_numpy())
    np.testing.assert_allclose(table.obs["confidence"].to_numpy(), labels["confidence"].to_numpy())
    attrs = table.uns["spatialdata_attrs"]
    assert attrs["region"] == "nucleus_boundaries" and attrs["instance_key"] == "cell_id"
    assert set(table.obs["cell_id"]) == set(shapes.index)
    # polygons from nucleus_boundaries.parquet, each around its own nucleus centroid (µm)
    assert (shapes.geometry.geom_type == "Polygon").all()
    centroids = np.array([[g.centroid.x, g.centroid.y] for g in shapes.geometry.loc[table.obs_names]])
    assert np.abs(centroids - table.obsm["spatial"]).max() < 1.0
    assert exported["full"]["sections"][0]["without_polygon"] == 0


def test_embeddings_are_the_stored_features_keyed_by_cell_id(exported):
    data_dir = exported["data_dir"]
    adata = ad.read_h5ad(export_embeddings_h5ad(data_dir, "filterbank-dense", "10x", "breast_a"))
    stored = open_artifact(artifact_dir(features_dir(data_dir), "filterbank-dense", "10x", "breast_a"))
    labels = pd.read_parquet(section_labels(data_dir, "breast_a"))
    assert adata.obs_names.tolist() == labels["cell_id"].tolist()
    assert set(adata.obsm) == set(stored)
    for name, matrix in stored.items():
        np.testing.assert_array_equal(adata.obsm[name], np.asarray(matrix, dtype=np.float32))
    assert adata.uns["features"]["magnification"] == "10x"
    assert (adata.obs["section_id"] == "breast_a").all()


def test_sections_without_features_are_counted_not_skipped_silently(exported):
    written = run_export(exported["params"], exported["data_dir"], sections=["breast_a"],
                         encoders=["random-vit-t16"], magnifications=["10x"], images=False)
    assert written == {"sections": [], "embeddings": 0, "without_features": ["breast_a random-vit-t16 10x"]}


def test_a_bundle_without_nucleus_polygons_gets_circles_of_the_nucleus_area(exported, tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(exported["data_dir"], data_dir, ignore=shutil.ignore_patterns("exports", "features"))
    (data_dir / "raw" / "tonsil_a" / "nucleus_boundaries.parquet").unlink()
    written = run_export(exported["params"], data_dir, sections=["tonsil_a"], he_downsample=4)
    sdata = _read(export_section_zarr(data_dir, "tonsil_a"))
    n_cells = sdata["table"].n_obs
    assert written["sections"][0]["without_polygon"] == n_cells
    area = sdata["table"].obs["nucleus_area"].to_numpy(float)
    area = np.where(area > 0, area, 25.0 * np.pi)  # a cell without a nucleus area gets a 5 µm radius
    shapes = sdata["nucleus_boundaries"].loc[sdata["table"].obs_names]
    np.testing.assert_allclose(shapes.geometry.area.to_numpy(), area, rtol=0.02)


def test_unknown_section_is_refused_and_nothing_is_written(exported, tmp_path):
    with pytest.raises(InputError, match="no_such_section"):
        run_export(exported["params"], exported["data_dir"], sections=["breast_a", "no_such_section"])
    with pytest.raises(InputError, match="he-downsample"):
        run_export(exported["params"], exported["data_dir"], he_downsample=0)


def test_pyramid_levels_are_block_means_of_the_slide(tmp_path):
    rng = np.random.default_rng(3)
    slide = rng.integers(0, 256, size=(1100, 1300, 3), dtype=np.uint8)
    path = tmp_path / "he.ome.tif"
    tifffile.imwrite(path, slide, photometric="rgb", tile=(256, 256))
    element = he_image_element(path, "s", np.eye(3), downsample=2)
    level0 = element["scale0"]["image"].values
    expected = np.round(slide[:1100, :1300].reshape(550, 2, 650, 2, 3).astype(np.float64).mean(axis=(1, 3)))
    np.testing.assert_array_equal(level0, np.moveaxis(expected.astype(np.uint8), -1, 0))
    assert [element[k]["image"].shape[1:] for k in element.children][-1][1] <= 512
