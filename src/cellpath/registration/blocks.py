"""From the coarse pose to a few µm: the nuclei's own patterns matched window by window.

After the coarse pose a nucleus can still be some 100 µm from its partner (a bin of the coarse grid
and half an angle step at the tissue's edge), far beyond the nucleus spacing that nearest-neighbour
matching needs. Over a grid of windows on the moving nuclei as posed (``GRID_WINDOWS`` along each side,
each a quarter of the nuclei's extent within ``WINDOW_UM``), each window's nuclei are rasterised at
``BIN_UM`` and cross-correlated (scipy's FFT) with the fixed nuclei around it, ``SEARCH_UM`` further
on every side: the peak is the window's local shift, sharp because no two patches of nuclei look
alike. scikit-image's RANSAC fits an affine to the windows' shifts, so a window over a fold or an
empty patch does not pull it (unless the fold covers most windows); that affine after the pose is
the start of the fine fit.
"""

from __future__ import annotations

import numpy as np
from scipy import fft
from scipy.spatial import cKDTree
from skimage.measure import ransac
from skimage.transform import AffineTransform

from cellpath.registration.pose import apply, rasterise

WINDOW_UM = (150.0, 400.0)  # a window's side: a quarter of the moving nuclei's extent, within these (µm)
SEARCH_UM = 250.0
BIN_UM = 2.0
GRID_WINDOWS = 6          # windows along each side of the moving set's bounding box (at most 6 × 6)
MIN_WINDOW_NUCLEI = 100   # a window with fewer moving nuclei is not matched
RANSAC_RESIDUAL_UM = 6.0  # a window's shift within this of the affine's supports it
RANSAC_TRIALS = 500
MIN_WINDOWS = 4           # an affine from fewer supporting windows is not trusted: the pose is kept


def _window_shift(moving: np.ndarray, fixed: np.ndarray, centre: np.ndarray, window_um: float
                  ) -> tuple[np.ndarray, float]:
    """(shift µm, normalised peak) of the fixed nuclei against the moving ones about ``centre``."""
    side = fft.next_fast_len(int(np.ceil((window_um + 2 * SEARCH_UM) / BIN_UM)), real=True)

    def raster(points: np.ndarray) -> np.ndarray:
        return rasterise(points - centre, BIN_UM, side)

    ky, kx = fft.fftfreq(side)[:, None], fft.rfftfreq(side)[None, :]
    blur = np.exp(-2 * np.pi**2 * (kx**2 + ky**2)).astype(np.float32)  # σ = 1 bin: a nucleus's position noise
    a, b = fft.rfft2(raster(moving)) * blur, fft.rfft2(raster(fixed)) * blur
    a[0, 0] = b[0, 0] = 0.0  # zero mean: the count of nuclei decides nothing
    correlation = fft.irfft2(b * np.conj(a), s=(side, side))
    peak = int(np.argmax(correlation))
    norm = float(np.sqrt((np.abs(a) ** 2).sum() * (np.abs(b) ** 2).sum())) / (side * side)
    row, col = divmod(peak, side)
    shift = np.array([(col + side // 2) % side - side // 2, (row + side // 2) % side - side // 2], float) * BIN_UM
    return shift, (correlation.flat[peak] / norm if norm > 0 else 0.0)


def window_shifts(moving_um: np.ndarray, fixed_um: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(window centres (K, 2), their shifts (K, 2)), µm in the fixed frame, of the moving nuclei posed by
    ``start`` (3×3) against the fixed ones; windows with too few nuclei are left out."""
    posed = apply(start, moving_um)
    low, high = posed.min(axis=0), posed.max(axis=0)
    window = float(np.clip((high - low).max() / 4, *WINDOW_UM))
    steps = [np.linspace(low[k] + window / 2, high[k] - window / 2, GRID_WINDOWS)
             if high[k] - low[k] > window else np.array([(low[k] + high[k]) / 2]) for k in range(2)]
    moving_tree, fixed_tree = cKDTree(posed), cKDTree(fixed_um)
    centres, shifts = [], []
    for cy in steps[1]:
        for cx in steps[0]:
            centre = np.array([cx, cy])
            mine = moving_tree.query_ball_point(centre, window / 2, p=np.inf)
            if len(mine) < MIN_WINDOW_NUCLEI:
                continue
            theirs = fixed_tree.query_ball_point(centre, window / 2 + SEARCH_UM, p=np.inf)
            if len(theirs) < MIN_WINDOW_NUCLEI:
                continue
            shift, _ = _window_shift(posed[mine], fixed_um[theirs], centre, window)
            centres.append(centre)
            shifts.append(shift)
    return np.reshape(centres, (-1, 2)), np.reshape(shifts, (-1, 2))


def block_refined(moving_um: np.ndarray, fixed_um: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(3×3 moving → fixed, windows supporting it, windows matched): ``start`` corrected by the RANSAC
    affine of the window shifts; ``start`` itself with support 0 when fewer than ``MIN_WINDOWS`` agree."""
    centres, shifts = window_shifts(moving_um, fixed_um, start)
    if len(centres) < MIN_WINDOWS:
        return start, 0, len(centres)
    model, inliers = ransac((centres, centres + shifts), AffineTransform, min_samples=3,
                            residual_threshold=RANSAC_RESIDUAL_UM, max_trials=RANSAC_TRIALS, rng=0)
    if model is None or inliers is None or int(inliers.sum()) < MIN_WINDOWS:
        return start, 0, len(centres)
    correction = AffineTransform.from_estimate(centres[inliers], centres[inliers] + shifts[inliers])
    if not correction:  # the agreeing windows lie on a line: no affine follows from them
        return start, 0, len(centres)
    return np.asarray(correction.params) @ start, int(inliers.sum()), len(centres)
