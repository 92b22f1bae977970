"""The fine affine: mutual nearest neighbours and a trimmed least-squares affine, iterated (ICP).

From a start within a few µm, each round moves the moving nuclei by the current affine, pairs them
with the fixed ones by mutual nearest neighbours within the round's radius, and refits the affine to
the pairs (``concordance.registration.fit_affine``: trimmed, so missed or false nuclei and a fold's
displaced nuclei do not pull it). The radii shrink (``RADII_UM``); at each the rounds go on until the
affine moves no corner of the moving nuclei's bounding box by more than ``TOL_UM``. ``converged`` says
whether the last radius got there within ``MAX_ROUNDS``: checked where it is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cellpath.concordance.registration import fit_affine
from cellpath.concordance.scoring import mutual_nearest_neighbours
from cellpath.registration.pose import apply

RADII_UM = (8.0, 5.0)
TOL_UM = 1e-3
MAX_ROUNDS = 30


@dataclass(frozen=True)
class FineFit:
    """The fine affine (3×3 moving → fixed µm), its last pairs (moving, fixed indices), rounds and
    whether it converged."""

    matrix: np.ndarray
    pairs: np.ndarray
    rounds: int
    converged: bool


def _as_matrix(fit) -> np.ndarray:
    matrix = np.eye(3)
    matrix[:2, :2] = fit.linear
    matrix[:2, 2] = fit.centre_um + fit.translation_um - fit.linear @ fit.centre_um
    return matrix


def bounding_corners(points: np.ndarray) -> np.ndarray:
    """The four corners (4, 2) of the points' axis-aligned bounding box."""
    low, high = points.min(axis=0), points.max(axis=0)
    return np.array([[low[0], low[1]], [high[0], low[1]], [low[0], high[1]], [high[0], high[1]]])


def fine_affine(moving_um: np.ndarray, fixed_um: np.ndarray, start: np.ndarray) -> FineFit:
    """ICP from ``start`` (3×3) to convergence at each of ``RADII_UM`` (module docstring)."""
    matrix, corners, rounds = np.asarray(start, float), bounding_corners(moving_um), 0
    pairs = np.empty((0, 2), dtype=np.int64)
    converged = False
    for radius in RADII_UM:
        converged = False
        for _ in range(MAX_ROUNDS):
            rounds += 1
            pairs, _, _ = mutual_nearest_neighbours(apply(matrix, moving_um), fixed_um, radius)
            fit = fit_affine(moving_um[pairs[:, 0]], fixed_um[pairs[:, 1]])
            if fit is None:
                return FineFit(matrix, pairs, rounds, False)
            updated = _as_matrix(fit)
            moved = float(np.hypot(*(apply(updated, corners) - apply(matrix, corners)).T).max())
            matrix = updated
            if moved <= TOL_UM:
                converged = True
                break
    pairs, _, _ = mutual_nearest_neighbours(apply(matrix, moving_um), fixed_um, RADII_UM[-1])
    return FineFit(matrix, pairs, rounds, converged)
