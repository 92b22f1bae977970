"""Non-overlapping patch grids at a target magnification, and which patch holds each nucleus.

Coordinates:

- level-0 px: continuous position on the slide's full-resolution image, origin at the top-left
  corner of the top-left pixel (pixel (c, r) covers [c, c+1) × [r, r+1)).
- patch px: position inside a patch as read at the target mpp (what the encoder sees), origin at
  the patch's top-left corner; a patch spans [0, input_size] in each direction.

A patch read at ``target_mpp`` with ``input_size`` px per side covers
``input_size · target_mpp / slide_mpp`` level-0 px. Patch (col, row) covers level-0
[col·side, (col+1)·side) × [row·side, (row+1)·side); the grid has ceil(extent / side) columns and
rows, so the last column and row extend past the slide edge (the reader pads them). Patch indices
are row-major: ``index = row · n_cols + col``. Origins are real numbers; a reader that rounds them
to whole level-0 px shifts the content by at most half a level-0 px.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

# A centre within this distance (level-0 px) of a patch boundary counts as lying exactly on it.
BOUNDARY_TOLERANCE_PX = 1e-6


@dataclass(frozen=True)
class PatchGrid:
    """The patch grid of one slide at one target mpp for one encoder input size."""

    slide_width_px: int
    slide_height_px: int
    slide_mpp: float
    target_mpp: float
    input_size: int
    n_cols: int
    n_rows: int

    @property
    def patch_side_level0_px(self) -> float:
        """Side of one patch in level-0 px."""
        return self.input_size * self.target_mpp / self.slide_mpp

    @property
    def n_patches(self) -> int:
        return self.n_cols * self.n_rows

    @property
    def patch_px_per_level0_px(self) -> float:
        """Scale from level-0 px to patch px (slide_mpp / target_mpp)."""
        return self.slide_mpp / self.target_mpp


def patch_grid(slide_width_px: int, slide_height_px: int, slide_mpp: float, target_mpp: float,
               input_size: int) -> PatchGrid:
    """The grid of non-overlapping ``input_size``² patches at ``target_mpp`` covering the slide.

    Sizes in level-0 px, mpp in µm/px. The grid depends on nothing else.
    """
    if slide_width_px <= 0 or slide_height_px <= 0:
        raise ValueError(f"slide size must be positive, got {slide_width_px}×{slide_height_px} px")
    if not (slide_mpp > 0 and target_mpp > 0 and math.isfinite(slide_mpp) and math.isfinite(target_mpp)):
        raise ValueError(f"mpp must be positive and finite, got slide {slide_mpp}, target {target_mpp}")
    if input_size <= 0:
        raise ValueError(f"input_size must be positive, got {input_size}")
    extent_in_patches = np.array([slide_width_px, slide_height_px]) * slide_mpp / (input_size * target_mpp)
    # Tolerance: a slide that is a whole number of patches wide does not get an empty extra column.
    n_cols, n_rows = (int(math.ceil(n - 1e-9)) for n in extent_in_patches)
    return PatchGrid(int(slide_width_px), int(slide_height_px), float(slide_mpp), float(target_mpp),
                     int(input_size), n_cols, n_rows)


def patch_origins_level0(grid: PatchGrid, patch_index: np.ndarray) -> np.ndarray:
    """(N,) row-major patch indices → (N, 2) level-0 (x, y) of each patch's top-left corner."""
    index = np.asarray(patch_index, dtype=np.int64)
    if index.size and (index.min() < 0 or index.max() >= grid.n_patches):
        raise ValueError(f"patch index outside 0..{grid.n_patches - 1}")
    col_row = np.stack([index % grid.n_cols, index // grid.n_cols], axis=-1)
    return col_row * grid.patch_side_level0_px


def assign_cells(grid: PatchGrid, xy_level0_px: np.ndarray,
                 nucleus_radius_px: float | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Assign each nuclear centre to the patch holding it.

    ``xy_level0_px``: (N, 2) centres (x, y) in level-0 px, inside [0, width] × [0, height].
    ``nucleus_radius_px``: optional radius of each nucleus (scalar or (N,)) in level-0 px, smaller
    than a patch side; the nucleus is modelled as a disc.

    Returns ``patch_index`` (N,) int64, row-major, and ``position_px`` (N, 2) float64: the centre in
    patch px of that patch, each coordinate in [0, input_size].

    Boundary rule (the paper's "adjacent patch holding the largest portion of the nucleus"), decided
    per axis, for a centre on a boundary between two patches:

    - Without a radius, or when both sides hold the same area, the centre goes to the patch that
      starts at the boundary (right/lower), i.e. the half-open rule [start, end) used everywhere.
    - With a radius, the disc is split into equal halves by the boundary line, and the left/upper
      half always lies wholly inside its patch (a patch side > radius away from the slide origin);
      the right/lower half holds less area exactly when the slide's far edge cuts into it
      (edge − boundary < radius): then the centre goes to the left/upper patch at its far edge
      (position = input_size). Cutting by the other axis's slide edges shrinks both halves alike.
      Per-axis decisions equal the decision over the four patches meeting at a corner.

    A centre on the far slide edge belongs to the last column/row (also when the slide is a whole
    number of patches wide).
    """
    xy = np.asarray(xy_level0_px, dtype=np.float64)
    if xy.ndim != 2 or xy.shape[1] != 2:
        raise ValueError(f"xy_level0_px must have shape (N, 2), got {xy.shape}")
    extents = np.array([grid.slide_width_px, grid.slide_height_px], dtype=np.float64)
    outside = ~np.all((xy >= -BOUNDARY_TOLERANCE_PX) & (xy <= extents + BOUNDARY_TOLERANCE_PX), axis=1)
    if outside.any():
        first = xy[np.argmax(outside)]
        raise ValueError(f"{int(outside.sum())} nuclear centre(s) lie outside the slide "
                         f"[0, {grid.slide_width_px}] × [0, {grid.slide_height_px}] level-0 px, "
                         f"e.g. ({first[0]:.2f}, {first[1]:.2f}); drop them before assigning")
    radius = _validated_radius(nucleus_radius_px, len(xy), grid.patch_side_level0_px)
    cols, offset_x = _assign_axis(xy[:, 0], grid.patch_side_level0_px, grid.n_cols, extents[0], radius)
    rows, offset_y = _assign_axis(xy[:, 1], grid.patch_side_level0_px, grid.n_rows, extents[1], radius)
    position = np.stack([offset_x, offset_y], axis=1) * grid.patch_px_per_level0_px
    return rows * grid.n_cols + cols, np.clip(position, 0.0, grid.input_size)


def _assign_axis(coord: np.ndarray, side: float, n_patches: int, extent: float,
                 radius: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Patch index along one axis and the offset (level-0 px) from that patch's start."""
    nearest = np.rint(coord / side)
    on_boundary = np.abs(coord - nearest * side) <= BOUNDARY_TOLERANCE_PX
    index = np.where(on_boundary, nearest, np.floor(coord / side)).astype(np.int64)
    if radius is not None:
        interior = on_boundary & (nearest >= 1) & (nearest <= n_patches - 1)
        far_half_cut = extent - nearest * side < radius
        index = np.where(interior & far_half_cut, index - 1, index)
    index = np.clip(index, 0, n_patches - 1)
    return index, coord - index * side


def _validated_radius(radius: float | np.ndarray | None, n_cells: int, side: float) -> np.ndarray | None:
    if radius is None:
        return None
    values = np.broadcast_to(np.asarray(radius, dtype=np.float64), (n_cells,))
    if not np.all(np.isfinite(values) & (values >= 0) & (values < side)):
        raise ValueError("nucleus_radius_px must be finite, ≥ 0 and smaller than a patch side "
                         f"({side:.2f} level-0 px)")
    return values


@dataclass(frozen=True)
class CellPlacement:
    """Which patch holds each cell and where (patch px at the target mpp)."""

    grid: PatchGrid
    patch_index: np.ndarray  # (N,) row-major index into the grid
    position_px: np.ndarray  # (N, 2)

    def tiling_record(self) -> dict:
        return {"input_size": self.grid.input_size, "slide_mpp": self.grid.slide_mpp,
                "target_mpp": self.grid.target_mpp, "n_cols": self.grid.n_cols, "n_rows": self.grid.n_rows,
                "patch_side_level0_px": self.grid.patch_side_level0_px}


def place_cells(xy_level0_px: np.ndarray, nucleus_area_um2: np.ndarray, *, slide_size: tuple[int, int],
                slide_mpp: float, target_mpp: float, input_size: int) -> CellPlacement:
    """Tile the slide and assign every nucleus (centre in level-0 px, area in µm²) to its patch; a
    nucleus's radius (capped below half a patch) decides which patch holds one on a boundary."""
    grid = patch_grid(slide_size[0], slide_size[1], slide_mpp, target_mpp, input_size)
    radius_px = np.sqrt(np.clip(nucleus_area_um2, 0.0, None) / np.pi) / slide_mpp
    radius_px = np.minimum(radius_px, 0.49 * grid.patch_side_level0_px)
    patch_index, position = assign_cells(grid, xy_level0_px, radius_px)
    return CellPlacement(grid, patch_index, position)


def place_section_cells(obs: pd.DataFrame, section: Mapping, *, target_mpp: float, input_size: int) -> CellPlacement:
    """:func:`place_cells` for an ingested section: its cell table's ``obs`` (``he_x_px``, ``he_y_px``:
    nucleus centre, level-0 px; ``nucleus_area``: µm²) and its row of the section index
    (``he_width_px``, ``he_height_px``, ``he_mpp``). What extraction tiles, and what every stage that
    needs a cell's patch recomputes."""
    return place_cells(obs[["he_x_px", "he_y_px"]].to_numpy(), obs["nucleus_area"].to_numpy(dtype=float),
                       slide_size=(int(section["he_width_px"]), int(section["he_height_px"])),
                       slide_mpp=float(section["he_mpp"]), target_mpp=target_mpp, input_size=input_size)
