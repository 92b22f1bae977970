"""Reading CellViT++ outputs: every format, the PanNuke → Tcoarse mapping and every bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cellpath.concordance.cellvit import PANNUKE_TO_COARSE, Detections, find_cellvit_output, read_cellvit
from cellpath.errors import InputError
from helpers.files import CELLS, MPP, TYPE_MAP, cellvit_document

E, I, S = "Epithelial/Tumor", "Immune/Inflammatory", "Stromal/Structural"
# (centroid x, y in level-0 px, PanNuke class id)
def _geojson_points(cells=CELLS) -> list[dict]:
    """CellViT++'s detection GeoJSON: one MultiPoint Feature per class present."""
    features = []
    for type_id in sorted({t for _, t in cells}):
        points = [list(xy) for xy, t in cells if t == type_id]
        features.append({"type": "Feature", "id": f"id-{type_id}",
                         "geometry": {"type": "MultiPoint", "coordinates": points},
                         "properties": {"objectType": "annotation",
                                        "classification": {"name": TYPE_MAP[str(type_id)], "color": [0, 0, 0]}}})
    return features


def _square(cx: float, cy: float, half: float = 3.0) -> list[list[float]]:
    ring = [[cx - half, cy - half], [cx + half, cy - half], [cx + half, cy + half], [cx - half, cy + half]]
    return ring + [ring[0]]


def _geojson_polygons(cells=CELLS) -> list[dict]:
    """CellViT++'s segmentation GeoJSON: one MultiPolygon Feature per class present."""
    features = []
    for type_id in sorted({t for _, t in cells}):
        polygons = [[_square(*xy)] for xy, t in cells if t == type_id]
        features.append({"type": "Feature", "geometry": {"type": "MultiPolygon", "coordinates": polygons},
                         "properties": {"classification": {"name": TYPE_MAP[str(type_id)]}}})
    return features


def _write(path: Path, document) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def _snappy_raw(data: bytes) -> bytes:
    """Raw (block) snappy, as python-snappy's ``compress`` writes: a varint length, then literals."""
    out = bytearray()
    n = len(data)
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    for start in range(0, len(data), 65536):
        chunk = data[start:start + 65536]
        size = len(chunk) - 1
        if size < 60:
            out.append(size << 2)
        elif size < 256:
            out += bytes([60 << 2, size])
        else:
            out += bytes([61 << 2]) + size.to_bytes(2, "little")
        out += chunk
    return bytes(out)


def _expected(kept_types=(1, 2, 3, 5)) -> tuple[np.ndarray, list[str]]:
    xy = np.array([xy for xy, t in CELLS if t in kept_types])
    return xy, [PANNUKE_TO_COARSE[TYPE_MAP[str(t)]] for _, t in CELLS if t in kept_types]


def _by_position(det: Detections) -> list[tuple[float, float, str, str]]:
    return sorted(zip(det.x_px.tolist(), det.y_px.tolist(), det.label.tolist(), det.coarse.tolist()))


# --- formats ---------------------------------------------------------------------------------

def test_pannuke_mapping():
    assert PANNUKE_TO_COARSE == {"Neoplastic": E, "Epithelial": E, "Inflammatory": I, "Connective": S, "Dead": None}


@pytest.mark.parametrize("name, full", [("slide_cells.json", True), ("slide_cell_detection.json", False)])
def test_reads_cells_and_cell_detection_json(tmp_path, name, full):
    det = read_cellvit(_write(tmp_path / name, cellvit_document(full=full)), slide_mpp=MPP, slide_dimensions=(100, 100))
    assert isinstance(det, Detections) and len(det) == 5 and det.n_dropped == 1
    assert det.x_px.tolist() == [10.5, 30.0, 50.0, 90.0, 12.0]
    assert det.y_px.tolist() == [20.0, 40.25, 60.0, 15.0, 95.0]
    assert det.label.tolist() == ["Neoplastic", "Inflammatory", "Connective", "Epithelial", "Inflammatory"]
    assert det.coarse.tolist() == [E, I, S, E, I]
    assert det.xy.shape == (5, 2) and det.source == str(tmp_path / name)
    assert list(det.to_frame().columns) == ["x_px", "y_px", "label", "coarse"]
    with pytest.raises(ValueError):
        det.x_px[0] = 1.0  # read-only


def test_only_dead_cells_give_no_detections_but_a_count(tmp_path):
    det = read_cellvit(_write(tmp_path / "s_cells.json", cellvit_document(cells=[((5.0, 5.0), 4)] * 3)))
    assert len(det) == 0 and det.n_dropped == 3


@pytest.mark.parametrize("document", [
    _geojson_points(), {"type": "FeatureCollection", "features": _geojson_points()}, _geojson_polygons(),
], ids=["multipoint_list", "feature_collection", "multipolygon"])
def test_reads_geojson(tmp_path, document):
    det = read_cellvit(_write(tmp_path / "slide_cells.geojson", document), slide_dimensions=(100, 100))
    xy, coarse = _expected()
    expected = sorted(zip(xy[:, 0].tolist(), xy[:, 1].tolist(), [TYPE_MAP[str(t)] for _, t in CELLS if t != 4], coarse))
    assert [(pytest.approx(x), pytest.approx(y), lab, c) for x, y, lab, c in expected] == _by_position(det)
    assert det.n_dropped == 1


def test_reads_single_point_and_polygon_features(tmp_path):
    features = [
        {"type": "Feature", "geometry": {"type": "Point", "coordinates": [5.0, 6.0]},
         "properties": {"classification": {"name": "Connective"}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [4, 0], [4, 2], [0, 2]]]},
         "properties": {"classification": {"name": "Neoplastic"}}},
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[7, 7], [7, 7], [7, 7]]]},
         "properties": {"classification": {"name": "Inflammatory"}}},  # degenerate: vertex mean
    ]
    det = read_cellvit(_write(tmp_path / "s_cells.geojson", features))
    assert det.xy.tolist() == [[5.0, 6.0], [2.0, 1.0], [7.0, 7.0]]
    assert det.coarse.tolist() == [S, E, I]


@pytest.fixture(params=["snappy", "cramjam"])
def snappy_backend(request, monkeypatch):
    """Run with python-snappy, or with cramjam alone (python-snappy hidden)."""
    if request.param == "cramjam":
        monkeypatch.setitem(sys.modules, "snappy", None)
    return request.param


@pytest.mark.parametrize("name, document", [
    ("slide_cells.json.snappy", cellvit_document()),
    ("slide_cell_detection.json.snappy", cellvit_document(full=False)),
    ("slide_cells.geojson.snappy", _geojson_polygons()),
    ("slide_cell_detection.geojson.snappy", _geojson_points()),
])
def test_reads_snappy_compressed_outputs(tmp_path, snappy_backend, name, document):
    path = tmp_path / name
    path.write_bytes(_snappy_raw(json.dumps(document).encode()))
    det = read_cellvit(path, slide_mpp=MPP)
    assert len(det) == 5 and det.n_dropped == 1
    assert sorted(det.coarse.tolist()) == sorted([E, I, S, E, I])


def test_reads_framed_snappy(tmp_path, snappy_backend):
    import cramjam

    path = tmp_path / "slide_cells.json.snappy"
    path.write_bytes(bytes(cramjam.snappy.compress(json.dumps(cellvit_document()).encode())))
    assert len(read_cellvit(path)) == 5


def test_snappy_without_a_library_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "snappy", None)
    monkeypatch.setitem(sys.modules, "cramjam", None)
    path = tmp_path / "slide_cells.json.snappy"
    path.write_bytes(_snappy_raw(json.dumps(cellvit_document()).encode()))
    with pytest.raises(InputError, match=r"slide_cells\.json\.snappy.*pip install python-snappy"):
        read_cellvit(path)


def test_corrupt_snappy_is_an_input_error(tmp_path, snappy_backend):
    path = tmp_path / "slide_cells.json.snappy"
    path.write_bytes(b"\x05not snappy at all")
    with pytest.raises(InputError, match=r"slide_cells\.json\.snappy.*could not be decompressed"):
        read_cellvit(path)


# --- mpp and slide extent --------------------------------------------------------------------

def test_mpp_within_five_percent_is_accepted(tmp_path):
    path = _write(tmp_path / "s_cells.json", cellvit_document(base_mpp=MPP * 1.04))
    assert len(read_cellvit(path, slide_mpp=MPP)) == 5


@pytest.mark.parametrize("metadata", [{"base_mpp": 0.5}, {"base_mpp": None, "mpp": 0.2}])
def test_mpp_mismatch_is_an_input_error(tmp_path, metadata):
    path = _write(tmp_path / "s_cells.json", cellvit_document(**metadata))
    with pytest.raises(InputError, match=r"s_cells\.json.*µm/px.*rerun CellViT\+\+"):
        read_cellvit(path, slide_mpp=MPP)


def test_mpp_is_not_checked_without_a_recorded_or_given_mpp(tmp_path):
    document = cellvit_document()
    document["wsi_metadata"] = {"magnification": 40}
    assert len(read_cellvit(_write(tmp_path / "s_cells.json", document), slide_mpp=MPP)) == 5
    assert len(read_cellvit(_write(tmp_path / "t_cells.json", cellvit_document(base_mpp=0.5)))) == 5


def test_detections_outside_the_slide_are_an_input_error(tmp_path):
    path = _write(tmp_path / "s_cells.json", cellvit_document())
    with pytest.raises(InputError, match=r"s_cells\.json: 2 detection\(s\) lie outside the 80×90 px slide"):
        read_cellvit(path, slide_dimensions=(80, 90))


def test_the_cells_are_read_whatever_the_order_of_the_documents_keys(tmp_path):
    """The reader streams the cells and looks the small keys up separately: cells first (another
    writer's order) read the same as CellViT++'s wsi_metadata, type_map, cells."""
    document = cellvit_document(full=True)
    reordered = {"cells": document["cells"], "type_map": document["type_map"], "wsi_metadata": document["wsi_metadata"]}
    first = read_cellvit(_write(tmp_path / "a_cells.json", document), slide_mpp=MPP)
    second = read_cellvit(_write(tmp_path / "b_cells.json", reordered), slide_mpp=MPP)
    assert second.x_px.tolist() == first.x_px.tolist() and second.label.tolist() == first.label.tolist()
    with pytest.raises(InputError, match="CellViT\\+\\+ ran on a slide of 0.2738"):  # wsi_metadata still checked
        read_cellvit(tmp_path / "b_cells.json", slide_mpp=0.5)


# --- malformed files -------------------------------------------------------------------------

def _bad_documents() -> dict[str, tuple[object, str]]:
    no_cells = cellvit_document()
    del no_cells["cells"]
    no_centroid = cellvit_document()
    del no_centroid["cells"][2]["centroid"]
    unknown_id = cellvit_document()
    unknown_id["cells"][1]["type"] = 9
    unknown_name = cellvit_document()
    unknown_name["type_map"] = TYPE_MAP | {"2": "Lymphocyte"}
    bad_centroid = cellvit_document()
    bad_centroid["cells"][3]["centroid"] = [1.0, float("nan")]
    short_centroid = cellvit_document()
    short_centroid["cells"][0]["centroid"] = [1.0]
    no_class = _geojson_points()
    del no_class[0]["properties"]["classification"]
    unknown_geo = _geojson_points()
    unknown_geo[1]["properties"]["classification"]["name"] = "Tumour"
    bad_geometry = _geojson_points()
    bad_geometry[0]["geometry"] = {"type": "LineString", "coordinates": [[0, 0], [1, 1]]}
    bad_polygon = _geojson_polygons()
    bad_polygon[0]["geometry"]["coordinates"] = [5]
    return {
        "s_cells.json:list": ([1, 2, 3], "expected a JSON object"),
        "s_cells.json:no_cells": (no_cells, r"missing key\(s\) \['cells'\]"),
        "s_cells.json:cells_object": (no_cells | {"cells": {"0": {}}}, "type_map must be an object and cells a list"),
        "s_cells.json:no_centroid": (no_centroid, "cell 2 has no centroid or type"),
        "s_cells.json:unknown_id": (unknown_id, "cell 1 has class id 9, which type_map does not list"),
        "s_cells.json:unknown_name": (unknown_name, "class 'Lymphocyte' is not a PanNuke class.*default PanNuke"),
        "s_cells.json:nan_centroid": (bad_centroid, r"cell 3 must be two finite numbers"),
        "s_cells.json:short_centroid": (short_centroid, r"cell 0 must be two finite numbers"),
        "s_cells.json:empty": (cellvit_document(cells=[]), "holds no detections"),
        "s_cells.geojson:empty": ([], "holds no detections"),
        "s_cells.geojson:object": ({"type": "Feature"}, "FeatureCollection or a list of Features"),
        "s_cells.geojson:no_class": (no_class, "feature 0 lacks .*classification.name"),
        "s_cells.geojson:unknown_name": (unknown_geo, "class 'Tumour' is not a PanNuke class"),
        "s_cells.geojson:geometry": (bad_geometry, "feature 0: unsupported geometry 'LineString'"),
        "s_cells.geojson:polygon": (bad_polygon, "feature 0: malformed MultiPolygon"),
    }


@pytest.mark.parametrize("case", sorted(_bad_documents()))
def test_malformed_outputs_are_input_errors_naming_the_file(tmp_path, case):
    document, message = _bad_documents()[case]
    name = case.split(":")[0]
    with pytest.raises(InputError, match=rf"{name.replace('.', r'[.]')}: .*{message}"):
        read_cellvit(_write(tmp_path / name, document))


def test_truncated_json_is_an_input_error(tmp_path):
    path = tmp_path / "s_cells.json"
    path.write_text(json.dumps(cellvit_document())[:-20])
    with pytest.raises(InputError, match=r"s_cells\.json: the CellViT\+\+ output is not valid JSON.*truncated"):
        read_cellvit(path)


def test_unreadable_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=r"absent_cells\.json: cannot read"):
        read_cellvit(tmp_path / "absent_cells.json")


# --- locating a section's output -------------------------------------------------------------

def test_find_prefers_cells_json_then_detection_then_geojson(tmp_path):
    for name in ("breast_1_he_image_cell_detection.json", "breast_1_he_image_cells.geojson",
                 "breast_10_he_image_cells.json"):
        _write(tmp_path / name, {})
    assert find_cellvit_output(tmp_path, "breast_1").name == "breast_1_he_image_cell_detection.json"
    _write(tmp_path / "breast_1_he_image_cells.json.snappy", {})
    assert find_cellvit_output(tmp_path, "breast_1").name == "breast_1_he_image_cells.json.snappy"
    _write(tmp_path / "breast_1_he_image_cells.json", {})
    assert find_cellvit_output(tmp_path, "breast_1").name == "breast_1_he_image_cells.json"
    assert find_cellvit_output(tmp_path, "breast_10").name == "breast_10_he_image_cells.json"


def test_find_falls_back_to_geojson_and_compressed_files(tmp_path):
    _write(tmp_path / "s1_cell_detection.geojson", {})
    _write(tmp_path / "s1_cells.geojson.snappy", {})
    assert find_cellvit_output(tmp_path, "s1").name == "s1_cells.geojson.snappy"
    _write(tmp_path / "s2_cell_detection.json.snappy", {})
    assert find_cellvit_output(tmp_path, "s2").name == "s2_cell_detection.json.snappy"


def test_find_reads_the_folder_per_slide_layout(tmp_path):
    _write(tmp_path / "liver_2_he_image.ome" / "cells.json", {})
    _write(tmp_path / "liver_2_he_image.ome" / "cell_detection.json", {})
    assert find_cellvit_output(tmp_path, "liver_2") == tmp_path / "liver_2_he_image.ome" / "cells.json"


def test_find_matches_the_he_image_name(tmp_path):
    _write(tmp_path / "Xenium_V1_hLiver_he_image_cells.json", {})
    found = find_cellvit_output(tmp_path, "xenium_v1_hliver", wsi_name="Xenium_V1_hLiver_he_image.ome.tif")
    assert found.name == "Xenium_V1_hLiver_he_image_cells.json"


def test_find_errors_name_the_section_and_folder(tmp_path):
    _write(tmp_path / "other_cells.json", {})
    with pytest.raises(InputError, match=r"section breast_1: .*no CellViT\+\+ output for this section"):
        find_cellvit_output(tmp_path, "breast_1")
    with pytest.raises(InputError, match=r"section breast_1: .*absent: CellViT\+\+ output folder not found"):
        find_cellvit_output(tmp_path / "absent", "breast_1")
    _write(tmp_path / "breast_1_cells.json", {})
    _write(tmp_path / "breast_1" / "cells.json", {})
    with pytest.raises(InputError, match="several CellViT\\+\\+ outputs match"):
        find_cellvit_output(tmp_path, "breast_1")


# ------------------------------------------------------------------ CellViT v1 (TIO-IKIM/CellViT)

V1_TYPES = {"Background": 0, "Neoplastic": 1, "Inflammatory": 2, "Connective": 3, "Dead": 4, "Epithelial": 5}


def _v1_document(cells, *, base_mpp=MPP, target_patch_mpp=MPP, downsampling=1, patch_size=1024, overlap=64) -> dict:
    """A cells.json as CellViT v1's cell_detection.py writes it: type_map name → id, and centroids in
    px of the patches it ran on (at target_patch_mpp: the global patch offset plus the in-patch
    position), given here as ``cells`` ((x, y) in those px, type id)."""
    written = [{"bbox": [[0, 0], [6, 6]], "centroid": list(xy), "type": type_id, "patch_coordinates": [0, 0],
                "offset_global": [0, 0]} for xy, type_id in cells]
    metadata = {"base_mpp": base_mpp, "target_patch_mpp": target_patch_mpp, "downsampling": downsampling,
                "patch_size": patch_size, "patch_overlap": overlap, "base_magnification": 40.0}
    return {"wsi_metadata": metadata, "processed_patches": 4, "type_map": V1_TYPES, "cells": written}


@pytest.mark.parametrize("name", ["cells.json", "cell_detection.json"])
def test_reads_cellvit_v1_with_its_name_to_id_type_map(tmp_path, name):
    path = tmp_path / "slide" / "cell_detection" / name
    _write(path, _v1_document(CELLS))
    detections = read_cellvit(path, slide_mpp=MPP)
    assert list(detections.label) == ["Neoplastic", "Inflammatory", "Connective", "Epithelial", "Inflammatory"]
    np.testing.assert_allclose(np.c_[detections.x_px, detections.y_px],
                               [xy for xy, t in CELLS if t != 4])  # same mpp: patch px are level-0 px
    assert detections.n_dropped == 1


def test_cellvit_v1_coordinates_of_rescaled_patches_are_scaled_to_level_0(tmp_path):
    # a 10x H&E at 0.2125 µm/px that CellViT v1 read as 0.25 µm/px patches: 1 patch px = 0.25/0.2125 level-0 px
    level0 = [((1500.0, 2200.0), 1), ((40.0, 1100.0), 2)]
    scale = 0.25 / 0.2125
    patch_px = [((x / scale, y / scale), t) for (x, y), t in level0]
    _write(tmp_path / "v1.json", _v1_document(patch_px, base_mpp=0.2125, target_patch_mpp=0.25))
    detections = read_cellvit(tmp_path / "v1.json", slide_mpp=0.2125)
    np.testing.assert_allclose(np.c_[detections.x_px, detections.y_px], [xy for xy, _ in level0])


def test_cellvit_v1_on_downsampled_patches_is_refused(tmp_path):
    _write(tmp_path / "v1.json", _v1_document(CELLS, downsampling=2))
    with pytest.raises(InputError, match=r"v1\.json: .*downsampled 2×.*mix two scales"):
        read_cellvit(tmp_path / "v1.json")


def test_a_type_map_giving_one_id_to_two_classes_is_named(tmp_path):
    document = _v1_document(CELLS) | {"type_map": V1_TYPES | {"Epithelial": 1}}
    _write(tmp_path / "v1.json", document)
    with pytest.raises(InputError, match=r"type_map gives one id to several classes"):
        read_cellvit(tmp_path / "v1.json")


def test_find_reads_cellvit_v1s_cell_detection_folder(tmp_path):
    _write(tmp_path / "breast_1_he_image.ome" / "cell_detection" / "cells.json", {})
    _write(tmp_path / "breast_1_he_image.ome" / "cell_detection" / "cell_detection.json", {})
    assert find_cellvit_output(tmp_path, "breast_1") == \
        tmp_path / "breast_1_he_image.ome" / "cell_detection" / "cells.json"
    _write(tmp_path / "breast_2" / "cell_detection" / "run-a" / "cell_detection.json", {})  # --subdir_name
    assert find_cellvit_output(tmp_path, "breast_2").parent.name == "run-a"


def test_find_matches_slide_names_with_inner_dots(tmp_path):
    # CellViT names its output by wsi_path.stem, which keeps a TCGA name's inner dots
    slide = "TCGA-A2-A0T2-01Z-00-DX1.5D26C1A6-9A4E-4C4F-8F5B-2D9A1C1E6F12"
    _write(tmp_path / slide / "cells.json", {})
    assert find_cellvit_output(tmp_path, "tcga-a2", wsi_name=f"{slide}.svs") == tmp_path / slide / "cells.json"
    _write(tmp_path / f"{slide}_cell_detection.json", {})
    assert find_cellvit_output(tmp_path, "tcga-a2", wsi_name=f"/slides/{slide}.svs") == tmp_path / slide / "cells.json"
