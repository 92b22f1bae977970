"""The coarse pose: every rotation and a mirror flip, a translation anywhere, by FFT cross-correlation.

Both point sets are rasterised into nucleus counts on one grid of ``bin_um`` bins (the moving set
rotated, and flipped, about its centroid; each set centred on the grid), reduced to the tissue's
structure (``structure_spectrum``: the density less its local mean over the tissue, by normalised
convolution, so that neither the tissue's area nor its border — a square H&E crop, the Xenium
field's edge — decides), and cross-correlated by scipy's FFT; the grid is at least twice the two
sets' radii together, so every overlap is a shift of the circular correlation. The correlation's
peak over the shifts is the score of a (flip, angle); the best poses, distinct by more than
``DISTINCT_DEG`` or by their flip, are the candidates the finer steps start from. The scale is the
slide's mpp: the window matching and the fine affine take up a few per cent; beyond that ``solve``
searches the scale too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import fft

COARSE_POINTS = 100_000  # points of each set rasterised (an even subsample beyond it)
GRID_BINS = 512          # bins along the grid's side: bin_um = the grid's extent / GRID_BINS
MIN_BIN_UM = 10.0        # bins are never finer than this (µm): about a nucleus spacing
STRUCTURE_SIGMAS = (1.0, 6.0)  # the structure's narrow and wide Gaussians (bins)
TISSUE_SHARE = 0.3        # a bin is tissue where the blurred density reaches this share of the typical
ANGLE_STEP_DEG = 1.0
DISTINCT_DEG = 5.0       # candidates at least this far apart in angle (or of the other flip)


@dataclass(frozen=True)
class Pose:
    """A pose moving → fixed (µm): ``q = scale · R(angle) · F · (p − moving_centre) + fixed_centre + shift``,
    F the mirror (y → −y) when ``flipped``; ``score`` the structures' correlation's peak, normalised."""

    angle_deg: float
    flipped: bool
    shift_um: np.ndarray
    moving_centre: np.ndarray
    fixed_centre: np.ndarray
    score: float
    scale: float = 1.0

    def matrix(self) -> np.ndarray:
        """The pose as a 3×3 affine matrix on (x, y, 1) µm."""
        return rigid_matrix(self.angle_deg, self.flipped, self.moving_centre, self.fixed_centre + self.shift_um,
                            self.scale)


def rigid_matrix(angle_deg: float, flipped: bool, about: np.ndarray, to: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """3×3 matrix of ``q = scale · R(angle) · F · (p − about) + to`` (µm)."""
    theta = np.deg2rad(angle_deg)
    linear = scale * np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    if flipped:
        linear = linear @ np.diag([1.0, -1.0])
    matrix = np.eye(3)
    matrix[:2, :2] = linear
    matrix[:2, 2] = np.asarray(to, float) - linear @ np.asarray(about, float)
    return matrix


def apply(matrix: np.ndarray, xy: np.ndarray) -> np.ndarray:
    """(N, 2) points through a 3×3 affine matrix."""
    return np.asarray(xy, float) @ matrix[:2, :2].T + matrix[:2, 2]


def _subsample(points: np.ndarray, limit: int) -> np.ndarray:
    step = max(1, int(np.ceil(len(points) / limit)))
    return points[::step]


def rasterise(centred_um: np.ndarray, bin_um: float, side: int) -> np.ndarray:
    """Counts per bin of points given about the grid's centre (µm); points off the grid are dropped."""
    index = np.floor(centred_um / bin_um).astype(np.int64) + side // 2
    inside = ((index >= 0) & (index < side)).all(axis=1)
    flat = index[inside, 1] * side + index[inside, 0]
    return np.bincount(flat, minlength=side * side).reshape(side, side).astype(np.float32)


def _gaussians(side: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian transfer functions on ``rfft2``'s frequencies, σ = ``STRUCTURE_SIGMAS`` bins."""
    k2 = fft.rfftfreq(side)[None, :] ** 2 + fft.fftfreq(side)[:, None] ** 2
    return tuple(np.exp(-2 * np.pi**2 * sigma**2 * k2).astype(np.float32) for sigma in STRUCTURE_SIGMAS)


def structure_spectrum(counts: np.ndarray, gaussians: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """``rfft2`` of the tissue's structure: the density blurred by the narrow Gaussian, less its local
    mean over the tissue (the wide Gaussian by normalised convolution, so the tissue's border adds
    nothing), zero off the tissue (bins below ``TISSUE_SHARE`` of the typical density)."""
    narrow, wide = gaussians
    side = counts.shape[0]
    spectrum = fft.rfft2(counts)
    near = fft.irfft2(spectrum * narrow, s=(side, side))
    occupied = near[near > 0.1 * near.max()] if near.max() > 0 else near.ravel()
    tissue = near > TISSUE_SHARE * float(np.median(occupied))
    cover = fft.irfft2(fft.rfft2(tissue.astype(np.float32)) * wide, s=(side, side))
    around = fft.irfft2(spectrum * wide, s=(side, side))
    local = np.divide(around, cover, out=np.zeros_like(around), where=cover > 0.2)
    return fft.rfft2(np.where(tissue, near - local, 0.0).astype(np.float32))


def grid_for(moving_um: np.ndarray, fixed_um: np.ndarray) -> tuple[float, int]:
    """(bin µm, grid side in bins) that hold every overlap of the two sets about their centroids."""
    radius = float(np.hypot(*(moving_um - moving_um.mean(axis=0)).T).max()
                   + np.hypot(*(fixed_um - fixed_um.mean(axis=0)).T).max())
    extent = 2.2 * radius  # every shift up to the two radii together, and a margin, without wrapping
    bin_um = max(MIN_BIN_UM, extent / GRID_BINS)
    side = fft.next_fast_len(int(np.ceil(extent / bin_um)), real=True)
    return bin_um, side


def coarse_poses(moving_um: np.ndarray, fixed_um: np.ndarray, *, keep: int = 4,
                 angle_step_deg: float = ANGLE_STEP_DEG, scale: float = 1.0) -> list[Pose]:
    """The best ``keep`` distinct poses moving → fixed over every angle (``angle_step_deg`` steps) and
    both flips at ``scale`` (moving µm per fixed µm), best first."""
    moving, fixed = _subsample(np.asarray(moving_um, float), COARSE_POINTS), _subsample(np.asarray(fixed_um, float),
                                                                                        COARSE_POINTS)
    moving_centre, fixed_centre = moving.mean(axis=0), fixed.mean(axis=0)
    bin_um, side = grid_for(moving, fixed)
    gaussians = _gaussians(side)
    target = structure_spectrum(rasterise(fixed - fixed_centre, bin_um, side), gaussians)
    target_norm = float(np.sqrt((np.abs(target) ** 2).sum()))
    angles = np.arange(0.0, 360.0, angle_step_deg)
    scores = np.empty((2, len(angles)))
    shifts = np.empty((2, len(angles), 2))
    for f, flipped in enumerate((False, True)):
        for a, angle in enumerate(angles):
            placed = apply(rigid_matrix(angle, flipped, moving_centre, np.zeros(2), scale), moving)
            spectrum = structure_spectrum(rasterise(placed, bin_um, side), gaussians)
            correlation = fft.irfft2(target * np.conj(spectrum), s=(side, side))
            peak = int(np.argmax(correlation))
            norm = target_norm * float(np.sqrt((np.abs(spectrum) ** 2).sum())) / (side * side)
            scores[f, a] = correlation.flat[peak] / norm if norm > 0 else 0.0
            row, col = divmod(peak, side)
            shifts[f, a] = (((col + side // 2) % side - side // 2) * bin_um,
                            ((row + side // 2) % side - side // 2) * bin_um)
    return _distinct(scores, shifts, angles, moving_centre, fixed_centre, keep, scale)


def _distinct(scores: np.ndarray, shifts: np.ndarray, angles: np.ndarray, moving_centre: np.ndarray,
              fixed_centre: np.ndarray, keep: int, scale: float) -> list[Pose]:
    """The ``keep`` best (flip, angle) peaks, each more than ``DISTINCT_DEG`` from a better one of its flip."""
    order = np.argsort(-scores, axis=None, kind="stable")
    chosen: list[Pose] = []
    for flat in order:
        f, a = divmod(int(flat), len(angles))
        angle = float(angles[a])
        if any(p.flipped == bool(f) and abs((p.angle_deg - angle + 180) % 360 - 180) <= DISTINCT_DEG for p in chosen):
            continue
        chosen.append(Pose(angle, bool(f), shifts[f, a].copy(), moving_centre, fixed_centre, float(scores[f, a]),
                           scale))
        if len(chosen) == keep:
            break
    return chosen
