"""The failure gallery's maths: which cells it shows, and crops centred on their nuclei."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tifffile

from cellpath.io.wsi import open_slide
from cellpath.report.gallery import (OUTLINE_RGB, cell_lines, crop_geometry, errors_with_neighbours, list_conditions,
                                     lowest_margins, most_confident_errors, neighbour_lines, outline_crop_px, read_crop,
                                     thumbnail)

KEYS = {"model": "m1", "magnification": "20x", "readout": "Nuc", "taxonomy": "fine"}


def _margins() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for model in ("m1", "m2"):
        for scope, unit in (("panel", "panel"), ("organ", "Breast")):
            for i in range(40):
                rows.append({**KEYS, "model": model, "scope": scope, "unit": unit, "section_id": f"s{i % 3}",
                             "cell_id": f"c{i:03d}", "margin": rng.uniform(-1, 1)})
    frame = pd.DataFrame(rows)
    frame.loc[5, "margin"] = np.nan  # undefined: never shown
    frame.loc[6, "margin"] = -5.0    # impossible for CRoMa, but the lowest: must come first
    return frame


def test_lowest_margins_are_the_n_smallest_defined_panel_scope_margins_per_model():
    margins = _margins()
    chosen = lowest_margins(margins, 7)
    for model in ("m1", "m2"):
        panel = margins[(margins["model"] == model) & (margins["scope"] == "panel")]
        expected = panel.dropna(subset=["margin"]).nsmallest(7, "margin")["cell_id"].tolist()
        assert chosen[chosen["model"] == model]["cell_id"].tolist() == expected
    assert chosen["margin"].notna().all() and (chosen["scope"] == "panel").all()
    assert chosen.iloc[0]["cell_id"] == "c006"


def test_most_confident_errors_count_a_cell_once_at_its_most_confident():
    errors = pd.DataFrame([
        {**KEYS, "seed": 0, "section_id": "s0", "cell_id": "a", "confidence": 0.70},
        {**KEYS, "seed": 1, "section_id": "s0", "cell_id": "a", "confidence": 0.95},  # the same cell, another seed
        {**KEYS, "seed": 0, "section_id": "s0", "cell_id": "b", "confidence": 0.90},
        {**KEYS, "seed": 0, "section_id": "s1", "cell_id": "a", "confidence": 0.80},  # another section's "a"
        {**KEYS, "seed": 0, "section_id": "s1", "cell_id": "c", "confidence": 0.60},
        {**KEYS, "readout": "Mean", "seed": 0, "section_id": "s0", "cell_id": "z", "confidence": 0.99},
    ])
    chosen = most_confident_errors(errors, 3)
    nuc = chosen[chosen["readout"] == "Nuc"]
    assert list(zip(nuc["section_id"], nuc["cell_id"], nuc["confidence"])) == [
        ("s0", "a", 0.95), ("s0", "b", 0.90), ("s1", "a", 0.80)]
    assert chosen[chosen["readout"] == "Mean"]["cell_id"].tolist() == ["z"]


def test_errors_take_their_neighbours_from_the_panel_scope_only():
    errors = pd.DataFrame([{**KEYS, "seed": 0, "section_id": "s0", "cell_id": c, "confidence": p}
                           for c, p in (("a", 0.9), ("b", 0.8))])
    neighbours = {"so_section_id": "s1", "so_cell_id": "x", "so_distance": 0.1, "os_section_id": "s0",
                  "os_cell_id": "y", "os_distance": 0.2}
    margins = pd.DataFrame([{**KEYS, "scope": "panel", "unit": "panel", "section_id": "s0", "cell_id": "a",
                             "margin": -0.4, **neighbours},
                            {**KEYS, "scope": "organ", "unit": "Breast", "section_id": "s0", "cell_id": "b",
                             "margin": -0.9, **neighbours}])
    wrong = errors_with_neighbours(errors, margins, 5).set_index("cell_id")
    assert list(wrong.index) == ["a", "b"] and wrong.at["a", "margin"] == -0.4 and wrong.at["a", "so_cell_id"] == "x"
    assert np.isnan(wrong.at["b", "margin"]) and pd.isna(wrong.at["b", "so_cell_id"])  # scored only at organ scope


def test_list_conditions_follow_the_vocabulary_order():
    frame = pd.DataFrame([{**KEYS, "magnification": m, "readout": r, "taxonomy": t}
                          for m, r, t in (("10x", "Mean", "fine"), ("20x", "Mean", "coarse"), ("20x", "Nuc", "coarse"),
                                          ("20x", "Nuc", "coarse"), ("40x", "Cls", "fine"))])
    assert [(c["magnification"], c["readout"], c["taxonomy"]) for c in list_conditions(frame)] == [
        ("40x", "Cls", "fine"), ("20x", "Nuc", "coarse"), ("20x", "Mean", "coarse"), ("10x", "Mean", "fine")]


def test_captions_name_the_cell_its_error_margin_and_neighbour_distance():
    row = {"section_id": "s0", "cell_id": "a", "true_class": "T", "predicted_class": "P", "confidence": 0.912,
           "margin": -0.12345}
    label = pd.Series({"type_68": "CD8 T cell", "fine": "Lymphocyte"})
    assert cell_lines(row, label) == ["s0 · a", "68-type: CD8 T cell; Tfine: Lymphocyte",
                                      "true T → predicted P (0.91)", "CRoMa margin -0.123"]
    assert cell_lines({"section_id": "s0", "cell_id": "a", "margin": np.nan}, None) == ["s0 · a"]
    # a near-duplicate neighbour keeps its distance: 3 significant digits, never "0.000"
    assert neighbour_lines("os", "s1", "b", "Immune", 0.000361) == ["OS · s1 · b", "Immune; cosine distance 0.000361"]


def _dot_slide(tmp_path, centre: tuple[int, int], size=(600, 700)) -> tuple:
    """A grey slide with one bright 3×3 dot centred on level-0 pixel ``centre`` (x, y)."""
    image = np.full((*size, 3), 90, dtype=np.uint8)
    x, y = centre
    image[y - 1:y + 2, x - 1:x + 2] = 255
    path = tmp_path / "dot.tif"
    tifffile.imwrite(path, image, photometric="rgb")
    return path


@pytest.mark.parametrize("he_mpp, mpp, side_um", [(0.25, 0.25, 20.0), (0.25, 0.5, 20.0), (0.25, 0.5, 20.5),
                                                  (0.2738, 0.5, 40.0), (0.5, 1.0, 41.0)])
def test_crops_are_centred_on_the_nucleus(tmp_path, he_mpp, mpp, side_um):
    centre = (333, 271)
    reader = open_slide(_dot_slide(tmp_path, centre), mpp=he_mpp)
    geometry = crop_geometry(centre, he_mpp, mpp, side_um)
    crop = read_crop(reader, geometry, mpp)
    assert crop.shape == (geometry.side, geometry.side, 3) == (round(side_um / mpp),) * 2 + (3,)
    excess = np.clip(crop.astype(float).mean(axis=2) - 90.0, 0, None)  # the dot above the grey background
    ys, xs = np.indices(excess.shape)
    x, y = (xs * excess).sum() / excess.sum(), (ys * excess).sum() / excess.sum()
    middle = (geometry.side - 1) / 2
    assert abs(x - middle) <= 1 and abs(y - middle) <= 1, (x, y, middle)
    # the geometry's own mapping puts the nucleus on the central pixel (to half a level-0 px)
    np.testing.assert_allclose(geometry.to_crop_px(np.array([centre], float))[0], [middle, middle],
                               atol=0.5 * he_mpp / mpp + 1e-9)


def test_a_crop_over_the_slide_edge_is_padded_with_glass(tmp_path):
    reader = open_slide(_dot_slide(tmp_path, (20, 20)), mpp=0.5)
    crop = read_crop(reader, crop_geometry((3.0, 3.0), 0.5, 0.5, 20.0), 0.5)
    assert (crop[0, 0] == 255).all()  # beyond the slide: white glass, not black


def test_outline_maps_the_nucleus_polygon_through_the_alignment_around_the_crop_centre():
    # H&E px -> morphology px: a rotation by 0.1 rad, scale 1.28, shift; µm = 0.2125 µm per morphology px
    c, s = np.cos(0.1) * 1.28, np.sin(0.1) * 1.28
    alignment = np.array([[c, -s, -150.0], [s, c, -380.0], [0, 0, 1]])
    pixel_size = 0.2125
    he_centre = np.array([812.4, 533.9])
    morph = alignment @ np.array([*he_centre, 1.0])
    centre_um = morph[:2] * pixel_size
    angles = np.linspace(0, 2 * np.pi, 24, endpoint=False)
    polygon_um = centre_um + 3.0 * np.column_stack([np.cos(angles), np.sin(angles)])  # a 3 µm radius nucleus
    he_mpp = 1.28 * pixel_size  # what the alignment implies
    geometry = crop_geometry(tuple(he_centre), he_mpp, 0.5, 40.0)
    outline = outline_crop_px(polygon_um, alignment, pixel_size, geometry)
    middle = (geometry.side - 1) / 2
    np.testing.assert_allclose(outline.mean(axis=0), [middle, middle], atol=0.5 * he_mpp / 0.5 + 1e-6)
    # the radius in crop px: 3 µm at 0.5 µm/px
    np.testing.assert_allclose(np.linalg.norm(outline - outline.mean(axis=0), axis=1), 6.0, rtol=1e-6)


def test_thumbnail_draws_the_outline_and_upsamples():
    from io import BytesIO

    from PIL import Image

    image = np.full((40, 40, 3), 120, dtype=np.uint8)
    square = np.array([[10, 10], [30, 10], [30, 30], [10, 30]], float)
    picture = np.asarray(Image.open(BytesIO(thumbnail(image, square))))
    assert picture.shape[:2] == (160, 160)  # 40 px upsampled 4× to reach 160
    yellow = (np.abs(picture.astype(int) - OUTLINE_RGB).sum(axis=2) < 90)
    assert yellow[40:44, 45:115].any(axis=0).mean() > 0.9  # the top edge (crop y = 10 → 10·4 + 1.5)
    assert yellow[:, 80].sum() <= 8 and not yellow[80, 80]  # one line above and below, the inside not filled
    plain = np.asarray(Image.open(BytesIO(thumbnail(image, None))))
    assert (np.abs(plain.astype(int) - OUTLINE_RGB).sum(axis=2) < 90).sum() == 0
