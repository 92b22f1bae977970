"""Patch grids at a target mpp and the assignment of nuclear centres to patches."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cellpath.features.tiling import assign_cells, patch_grid, patch_origins_level0  # noqa: E402

SLIDE_MPP = 0.2738  # the simulated H&E's µm per level-0 px (about 10x's registered H&E)


@pytest.mark.parametrize(("target_mpp", "side", "n_cols", "n_rows"), [
    (0.25, 204.52885317750, 49, 35),  # 40×: 10000 / 204.53 = 48.9, 7000 / 204.53 = 34.2
    (0.5, 409.05770635500, 25, 18),  # 20×: 24.4, 17.1
    (1.0, 818.11541271001, 13, 9),  # 10×: 12.2, 8.6
])
def test_grid_sizes_at_40x_20x_10x(target_mpp, side, n_cols, n_rows):
    grid = patch_grid(10_000, 7_000, SLIDE_MPP, target_mpp, 224)
    assert grid.patch_side_level0_px == pytest.approx(side, rel=1e-10)
    assert (grid.n_cols, grid.n_rows, grid.n_patches) == (n_cols, n_rows, n_cols * n_rows)


def test_grid_depends_on_the_input_size():
    grid = patch_grid(10_000, 7_000, SLIDE_MPP, 0.5, 512)  # 935 level-0 px per patch
    assert (grid.n_cols, grid.n_rows) == (11, 8)


def test_slide_of_whole_patches_gets_no_empty_column():
    grid = patch_grid(896, 448, 0.25, 0.5, 224)  # 448 level-0 px per patch
    assert (grid.n_cols, grid.n_rows) == (2, 1)


def test_invalid_grid_arguments():
    with pytest.raises(ValueError, match="mpp"):
        patch_grid(100, 100, 0.0, 0.5, 224)
    with pytest.raises(ValueError, match="slide size"):
        patch_grid(0, 100, 0.25, 0.5, 224)


@pytest.fixture
def grid3():
    """1000² level-0 px at 0.25 mpp read at 0.5 mpp in 224 px patches: 448 px sides, 3 × 3 patches,
    the last column and row padded (real extent 104 px of 448)."""
    return patch_grid(1000, 1000, 0.25, 0.5, 224)


def test_patch_origins(grid3):
    np.testing.assert_array_equal(patch_origins_level0(grid3, [0, 1, 3, 8]), [[0, 0], [448, 0], [0, 448], [896, 896]])
    with pytest.raises(ValueError, match="patch index"):
        patch_origins_level0(grid3, [9])


def test_cells_at_the_corners_of_a_patch_go_by_the_half_open_rule(grid3):
    """Corners of patch (col 1, row 1): each belongs to the patch that starts there."""
    corners = np.array([[448, 448], [896, 448], [448, 896], [896, 896]], dtype=float)
    for radius in (None, 5.0):
        index, position = assign_cells(grid3, corners, nucleus_radius_px=radius)
        np.testing.assert_array_equal(index, [4, 5, 7, 8])
        np.testing.assert_array_equal(position, np.zeros((4, 2)))


def test_boundary_with_the_far_half_of_the_nucleus_cut_by_the_slide_edge():
    """Slide edge 3 px past the last boundary: a nucleus of radius 5 centred on that boundary has
    more area in the previous patch; one of radius 2 is split evenly (tie → the next patch)."""
    grid = patch_grid(899, 899, 0.25, 0.5, 224)
    centres = np.array([[896.0, 100.0], [100.0, 896.0], [896.0, 896.0], [448.0, 100.0]])
    index, position = assign_cells(grid, centres, nucleus_radius_px=5.0)
    # (col 1, row 0) at its right edge; (col 0, row 1) at its bottom edge; the shared corner goes
    # to (col 1, row 1) at its bottom-right corner; an interior boundary is unaffected.
    np.testing.assert_array_equal(index, [1, 3, 4, 1])
    np.testing.assert_allclose(position, [[224, 50], [50, 224], [224, 224], [0, 50]])
    index, position = assign_cells(grid, centres, nucleus_radius_px=2.0)
    np.testing.assert_array_equal(index, [2, 6, 8, 1])
    np.testing.assert_allclose(position, [[0, 50], [50, 0], [0, 0], [0, 50]])
    index, _ = assign_cells(grid, centres, nucleus_radius_px=np.array([5.0, 2.0, 2.0, 5.0]))
    np.testing.assert_array_equal(index, [1, 6, 8, 1])


def test_boundary_detection_tolerates_rounding_of_the_patch_side():
    grid = patch_grid(10_000, 7_000, SLIDE_MPP, 0.5, 224)
    side = grid.patch_side_level0_px
    on_boundary = np.array([[3 * side, 2 * side], [np.nextafter(3 * side, 0), 0.5 * side]])
    index, position = assign_cells(grid, on_boundary)
    np.testing.assert_array_equal(index, [2 * grid.n_cols + 3, 3])
    np.testing.assert_allclose(position, [[0, 0], [0, 112]], atol=1e-9)


def test_cells_away_from_boundaries(grid3):
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 1000, size=(500, 2))
    index, position = assign_cells(grid3, xy, nucleus_radius_px=4.0)
    np.testing.assert_array_equal(index, (xy[:, 1] // 448) * 3 + xy[:, 0] // 448)
    assert position.min() >= 0 and position.max() < 224
    # position is the centre in patch px (0.5 µm/px): back to level-0 px through the patch origin
    np.testing.assert_allclose(patch_origins_level0(grid3, index) + position * 2.0, xy)


def test_cells_in_the_last_padded_patch(grid3):
    centres = np.array([[1000.0, 1000.0], [999.5, 950.0], [1000.0, 0.0]])
    index, position = assign_cells(grid3, centres)
    np.testing.assert_array_equal(index, [8, 8, 2])
    np.testing.assert_allclose(position, [[52, 52], [51.75, 27], [52, 0]])


def test_far_edge_of_a_slide_of_whole_patches_belongs_to_the_last_patch():
    grid = patch_grid(896, 448, 0.25, 0.5, 224)
    index, position = assign_cells(grid, np.array([[896.0, 448.0]]), nucleus_radius_px=3.0)
    np.testing.assert_array_equal(index, [1])
    np.testing.assert_array_equal(position, [[224, 224]])


def test_invalid_cells(grid3):
    with pytest.raises(ValueError, match=r"1 nuclear centre\(s\) lie outside the slide"):
        assign_cells(grid3, np.array([[10.0, 10.0], [1000.5, 10.0]]))
    with pytest.raises(ValueError, match="smaller than a patch side"):
        assign_cells(grid3, np.array([[10.0, 10.0]]), nucleus_radius_px=500.0)
    with pytest.raises(ValueError, match=r"\(N, 2\)"):
        assign_cells(grid3, np.array([10.0, 10.0]))
