"""Ingest: one reader for simulated and hand-written bundles, the coordinate mapping, and bad inputs."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tifffile
import zarr
from skimage.color import rgb2hed

from cellpath.errors import InputError
from cellpath.io.ingest import ingest_section
from helpers.files import mismatch_cell_ids, truncate_file

# ---------------------------------------------------------------------------------------------
# The simulated panel


def _table(tiny_panel, section_id: str) -> ad.AnnData:
    return ad.read_zarr(tiny_panel["data_dir"] / "sections" / f"{section_id}.zarr" / "tables" / "table")


def test_every_section_is_ingested_with_its_metadata(tiny_panel):
    index = tiny_panel["sections"]
    assert list(index["section_id"]) == ["breast_a", "breast_b", "tonsil_a"]
    assert set(index["organ"]) == {"Breast", "Lymphoid"}
    assert (index["he_mpp"].round(4) == 0.2738).all()
    for section_id in index["section_id"]:
        table = _table(tiny_panel, section_id)
        truth = pd.read_parquet(tiny_panel["data_dir"] / "raw" / section_id / "simulation_truth.parquet")
        assert table.n_obs == len(truth) == index.set_index("section_id").loc[section_id, "n_cells"]
        assert table.n_vars == 300  # genes only: control probes are not expression
        assert (table.obs["section_id"] == section_id).all()
        assert list(table.obs_names) == list(truth["cell_id"])
        assert table.uns["section"]["organ"] in ("Breast", "Lymphoid")
        for column in ("nucleus_x_um", "nucleus_y_um", "he_x_px", "he_y_px", "cell_area", "nucleus_area"):
            assert np.isfinite(table.obs[column]).all()


def test_mapped_coordinate_lands_on_the_rendered_nucleus(tiny_panel):
    """Without jitter the mapped H&E coordinate is the rendered nucleus centre, to well under 1 µm."""
    mpp = 0.2738
    table = _table(tiny_panel, "breast_b")  # simulated with registration_jitter_um = 0
    folder = tiny_panel["data_dir"] / "raw" / "breast_b"
    truth = pd.read_parquet(folder / "simulation_truth.parquet").set_index("cell_id").loc[table.obs_names]
    mapped = table.obs[["he_x_px", "he_y_px"]].to_numpy()
    rendered = truth[["true_he_x_px", "true_he_y_px"]].to_numpy()
    assert np.abs(mapped - rendered).max() * mpp < 0.01
    # And on the pixels: the haematoxylin-weighted centre of an isolated lymphocyte's nucleus.
    image = tifffile.imread(next(folder.glob("*he_image.ome.tif")), level=0)
    lymph = np.flatnonzero(truth["cell_type"].isin(["CD4 T cell", "CD8 T cell", "B cell"]).to_numpy())
    from scipy.spatial import cKDTree

    distance, _ = cKDTree(rendered).query(rendered[lymph], k=2)
    cell = lymph[np.argmax(distance[:, 1])]  # the most isolated lymphocyte
    x, y = mapped[cell]
    r = int(round(4.0 / mpp))
    x0, y0 = int(round(x)) - r, int(round(y)) - r
    window = rgb2hed(image[y0:y0 + 2 * r + 1, x0:x0 + 2 * r + 1])[..., 0]
    weight = np.clip(window - np.percentile(window, 30), 0, None)
    ys, xs = np.mgrid[0:window.shape[0], 0:window.shape[1]]
    centre = np.array([(xs * weight).sum(), (ys * weight).sum()]) / weight.sum() + [x0 + 0.5, y0 + 0.5]
    assert np.linalg.norm(centre - [x, y]) * mpp < 1.0


def test_jittered_section_lands_within_jitter(tiny_panel):
    mpp, jitter = 0.2738, 2.0  # breast_a: RMS displacement 2 µm, i.e. σ = 2/√2 per axis
    table = _table(tiny_panel, "breast_a")
    truth = pd.read_parquet(tiny_panel["data_dir"] / "raw" / "breast_a" / "simulation_truth.parquet")
    error_um = np.linalg.norm(table.obs[["he_x_px", "he_y_px"]].to_numpy()
                              - truth[["true_he_x_px", "true_he_y_px"]].to_numpy(), axis=1) * mpp
    assert error_um.max() < 1.0 + 5 * jitter / np.sqrt(2)
    assert np.median(error_um) < jitter


# ---------------------------------------------------------------------------------------------
# A hand-written minimal bundle (written here with h5py/pyarrow/zarr/tifffile, not the simulator)

HAND_IDS = ["aaaaaaab-1", "aaaaaaac-1", "aaaaaaad-1"]
HAND_PREFIX = np.array([1, 2, 3], dtype=np.uint32)
HAND_NUCLEI_UM = np.array([[10.0, 20.0], [30.0, 15.0], [22.5, 40.0]])
HAND_ALIGNMENT = np.array([[1.2, 0.1, -4.0], [-0.1, 1.2, 6.0], [0.0, 0.0, 1.0]])  # H&E px → morphology px
HAND_GENES = ["EPCAM", "PTPRC", "COL1A1"]


def _write_hand_bundle(folder: Path, *, mpp: float | None = 0.26, image_size: int = 400) -> None:
    folder.mkdir(parents=True)
    (folder / "section.json").write_text(json.dumps(
        {"section_id": "hand", "dataset": "Hand-written", "organ": "Colon", "status": "Normal", "source": "10x"}))
    (folder / "experiment.xenium").write_text(json.dumps(
        {"analysis_sw_version": "xenium-3.0.0.15", "pixel_size": 0.2125, "run_name": "hand"}))
    counts = np.array([[5, 0, 1], [0, 7, 0], [1, 0, 9]])  # cells × genes
    features_by_cells = counts.T
    indptr = np.concatenate([[0], np.cumsum((features_by_cells != 0).sum(axis=0))])
    indices = np.concatenate([np.flatnonzero(features_by_cells[:, j]) for j in range(3)])
    data = np.concatenate([features_by_cells[features_by_cells[:, j] != 0, j] for j in range(3)])
    with h5py.File(folder / "cell_feature_matrix.h5", "w") as f:
        m = f.create_group("matrix")
        m["barcodes"] = np.array(HAND_IDS, dtype="S")
        m["data"] = data.astype(np.int32)
        m["indices"] = indices.astype(np.int64)
        m["indptr"] = indptr.astype(np.int64)
        m["shape"] = np.array([3, 3], dtype=np.int32)
        feats = m.create_group("features")
        feats["id"] = np.array(HAND_GENES, dtype="S")
        feats["name"] = np.array(HAND_GENES, dtype="S")
        feats["feature_type"] = np.array([b"Gene Expression"] * 3)
        feats["genome"] = np.array([b"GRCh38"] * 3)
        feats["_all_tag_keys"] = np.array([b"genome"])
    pq.write_table(pa.table({
        "cell_id": pa.array(HAND_IDS, type=pa.string()),
        "x_centroid": HAND_NUCLEI_UM[:, 0] + 1.0,
        "y_centroid": HAND_NUCLEI_UM[:, 1] - 1.0,
        "transcript_counts": counts.sum(1),
        "cell_area": [80.0, 60.0, 90.0],
        "nucleus_area": [30.0, 25.0, 35.0],
    }), folder / "cells.parquet")
    zarr_dir = folder.parent / "cells.zarr"
    root = zarr.open_group(store=str(zarr_dir), mode="w", zarr_format=2)
    root.create_array("cell_id", data=np.column_stack([HAND_PREFIX, np.ones(3, dtype=np.uint32)]))
    summary = root.create_array("cell_summary", data=np.column_stack([
        HAND_NUCLEI_UM + [1.0, -1.0], [80, 60, 90], HAND_NUCLEI_UM, [30, 25, 35], np.zeros(3), np.ones(3)]).astype(float))
    summary.attrs["column_names"] = ["cell_centroid_x", "cell_centroid_y", "cell_area", "nucleus_centroid_x",
                                     "nucleus_centroid_y", "nucleus_area", "z_level", "nucleus_count"]
    with zipfile.ZipFile(folder / "cells.zarr.zip", "w") as zf:
        for member in sorted(p for p in zarr_dir.rglob("*") if p.is_file()):
            zf.write(member, member.relative_to(zarr_dir).as_posix())
    shutil.rmtree(zarr_dir)
    image = np.full((image_size, image_size, 3), 230, dtype=np.uint8)
    metadata = {"axes": "YXS"}
    if mpp is not None:
        metadata |= {"PhysicalSizeX": mpp, "PhysicalSizeY": mpp}
    tifffile.imwrite(folder / "hand_he_image.ome.tif", image, photometric="rgb", metadata=metadata)
    (folder / "hand_he_imagealignment.csv").write_text(
        "\n".join(",".join(str(v) for v in row) for row in HAND_ALIGNMENT) + "\n")


def _expected_he_px(nuclei_um: np.ndarray) -> np.ndarray:
    # Solve alignment · (x, y, 1) = (µm / 0.2125, 1) for each nucleus, by hand.
    a, b, tx = HAND_ALIGNMENT[0]
    c, d, ty = HAND_ALIGNMENT[1]
    out = []
    for mx, my in nuclei_um / 0.2125:
        det = a * d - b * c
        out.append([(d * (mx - tx) - b * (my - ty)) / det, (-c * (mx - tx) + a * (my - ty)) / det])
    return np.array(out)


def test_hand_written_minimal_bundle(tmp_path):
    _write_hand_bundle(tmp_path / "raw" / "hand")
    meta = ingest_section(tmp_path / "raw" / "hand", tmp_path / "sections")
    assert meta["n_cells"] == 3 and meta["he_mpp"] == pytest.approx(0.26)
    table = ad.read_zarr(tmp_path / "sections" / "hand.zarr" / "tables" / "table")
    assert list(table.obs_names) == HAND_IDS
    assert list(table.var_names) == HAND_GENES
    np.testing.assert_array_equal(table.X.toarray(), [[5, 0, 1], [0, 7, 0], [1, 0, 9]])
    np.testing.assert_allclose(table.obs[["nucleus_x_um", "nucleus_y_um"]].to_numpy(), HAND_NUCLEI_UM)
    np.testing.assert_allclose(table.obs[["he_x_px", "he_y_px"]].to_numpy(), _expected_he_px(HAND_NUCLEI_UM),
                               atol=1e-9)
    assert table.uns["section"]["organ"] == "Colon"


# ---------------------------------------------------------------------------------------------
# Bad inputs: one clear error naming the section and the file; nothing written


def _no_mpp(folder: Path) -> None:
    image = folder / "hand_he_image.ome.tif"
    image.unlink()
    tifffile.imwrite(image, np.full((400, 400, 3), 230, dtype=np.uint8), photometric="rgb")


def _small_image(folder: Path) -> None:
    image = folder / "hand_he_image.ome.tif"
    image.unlink()
    tifffile.imwrite(image, np.full((120, 120, 3), 230, dtype=np.uint8), photometric="rgb",
                     metadata={"axes": "YXS", "PhysicalSizeX": 0.26, "PhysicalSizeY": 0.26})


def test_plain_tiff_resolution_tags_give_the_mpp(tmp_path):
    """An H&E whose OME-XML lacks PhysicalSizeX but whose TIFF resolution tags are set is accepted."""
    folder = tmp_path / "raw" / "hand"
    _write_hand_bundle(folder)
    image = folder / "hand_he_image.ome.tif"
    image.unlink()
    tifffile.imwrite(image, np.full((400, 400, 3), 230, dtype=np.uint8), photometric="rgb",
                     resolution=(1e4 / 0.25, 1e4 / 0.25), resolutionunit="CENTIMETER")
    assert ingest_section(folder, tmp_path / "sections")["he_mpp"] == pytest.approx(0.25)


BAD_BUNDLES = {
    "missing matrix": (lambda f: (f / "cell_feature_matrix.h5").unlink(), "cell_feature_matrix.h5", "missing"),
    "truncated matrix": (lambda f: truncate_file(f / "cell_feature_matrix.h5"), "cell_feature_matrix.h5", "truncated"),
    "truncated cells.parquet": (lambda f: truncate_file(f / "cells.parquet"), "cells.parquet", "truncated"),
    "truncated cells.zarr.zip": (lambda f: truncate_file(f / "cells.zarr.zip", 0.6), "cells.zarr.zip", "re-download"),
    "ids disagree": (mismatch_cell_ids, "cells.parquet", "do not match the barcodes"),
    "singular alignment": (lambda f: (f / "hand_he_imagealignment.csv").write_text("1,2,0\n2,4,0\n0,0,1\n"),
                           "hand_he_imagealignment.csv", "singular"),
    "malformed alignment": (lambda f: (f / "hand_he_imagealignment.csv").write_text("1,0\n0,1\n"),
                            "hand_he_imagealignment.csv", "3×3 matrix"),
    "NaN alignment": (lambda f: (f / "hand_he_imagealignment.csv").write_text("1,0,0\n0,nan,0\n0,0,1\n"),
                      "hand_he_imagealignment.csv", "NaN"),
    "H&E without mpp": (_no_mpp, "hand_he_image.ome.tif", "no pixel size"),
    "cells outside the image": (_small_image, "hand_he_imagealignment.csv", "map outside the 120×120 px"),
    "truncated H&E": (lambda f: truncate_file(f / "hand_he_image.ome.tif", 0.1), "hand_he_image.ome.tif",
                      "cannot open"),
    "missing section.json": (lambda f: (f / "section.json").unlink(), "section.json", "rerun `cellpath fetch`"),
    "bad pixel size": (lambda f: (f / "experiment.xenium").write_text('{"pixel_size": "x"}'), "experiment.xenium",
                       "pixel_size"),
    "two H&E images": (lambda f: shutil.copy(f / "hand_he_image.ome.tif", f / "other_he_image.ome.tif"),
                       "hand", "exactly one registered H&E"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_bad_bundle_is_rejected_cleanly(tmp_path, case):
    corrupt, file_named, needle = BAD_BUNDLES[case]
    folder = tmp_path / "raw" / "hand"
    _write_hand_bundle(folder)
    corrupt(folder)
    out = tmp_path / "sections"
    with pytest.raises(InputError) as err:
        ingest_section(folder, out)
    message = str(err.value)
    assert "section hand" in message
    assert file_named in message
    assert needle in message
    assert not out.exists() or list(out.iterdir()) == []


def test_zip_member_corruption_is_detected(tmp_path):
    folder = tmp_path / "raw" / "hand"
    _write_hand_bundle(folder)
    path = folder / "cells.zarr.zip"
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("cell_summary/0.0") if "cell_summary/0.0" in zf.namelist() else zf.infolist()[-1]
    data = bytearray(path.read_bytes())
    data[info.header_offset + 40] ^= 0xFF  # flip a byte inside the member's data
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="cells.zarr.zip"):
        ingest_section(folder, tmp_path / "sections")
