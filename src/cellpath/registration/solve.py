"""Registration from the nuclei: the pose search, the window matching and the fine affine in turn,
what is refused, and the result as 10x's alignment matrix.

Each of the coarse search's best poses (``pose.coarse_poses``) is carried through the window matching
(``blocks``), which counts the windows that agree on it; the best, and any other with at least
``AMBIGUOUS_SHARE`` of its windows, through the fine affine (``refine``), scored by its consensus: the
moving nuclei within ``CONSENSUS_UM`` of their partner after it. The best is kept. Refused, each with its reason
(``RegistrationError``): fewer than ``MIN_NUCLEI`` nuclei on either side; fewer than ``MIN_MATCHES``
matched nuclei, a consensus below ``MIN_CONSENSUS_SHARE`` of the smaller set or below
``MIN_CHANCE_RATIO`` times what a decoy pose meets by chance (the images are not of one section, or
too little of it shows); and an ambiguous tissue, where a pose other than the best
(its fit placing a corner of the tissue more than ``DISTINCT_FIT_UM`` elsewhere) reaches
``AMBIGUOUS_SHARE`` of its consensus.
When fewer than ``MIN_WINDOW_SHARE`` of the windows agree on any pose at the mpp's scale, the slide's
mpp may be wrong: the search is run again at ``FALLBACK_SCALES`` (every ``FALLBACK_STEP_DEG``) and the
record says so; when no
pose gets there at any scale the nuclei are refused before any fine fit.

The alignment matrix maps H&E level-0 px to Xenium morphology px (10x's ``he_imagealignment.csv``):
``diag(1/pixel_size) · T · diag(mpp)``, with T the µm affine found here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cellpath.concordance.scoring import mutual_nearest_neighbours
from cellpath.errors import CellPathError
from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM
from cellpath.registration.blocks import MIN_WINDOWS, block_refined
from cellpath.registration.pose import ANGLE_STEP_DEG, Pose, apply, coarse_poses
from cellpath.registration.refine import RADII_UM, FineFit, bounding_corners, fine_affine

MIN_NUCLEI = 50
MIN_MATCHES = 30
MIN_CONSENSUS_SHARE = 0.1
MIN_CHANCE_RATIO = 2.0   # the consensus must be at least this many times a decoy's (chance_consensus)
DECOY_SHIFT_UM = np.array([37.0, 53.0])  # well beyond a nucleus spacing
CONSENSUS_UM = 3.0
AMBIGUOUS_SHARE = 0.8
CANDIDATES = 4
DISTINCT_FIT_UM = 20.0   # two fits whose placements of the tissue's corners differ by more are two poses
MIN_WINDOW_SHARE = 0.5   # a pose is taken up when this share of its matched windows agree on it
FALLBACK_SCALES = (0.9, 0.94, 0.98, 1.02, 1.06, 1.1)  # H&E µm per Xenium µm tried then (a wrong mpp)
FALLBACK_STEP_DEG = 2.0  # the angle step of that search (the window matching takes up a degree)


class RegistrationError(CellPathError):
    """The nuclei cannot be registered; the message says why and what to do."""


@dataclass(frozen=True)
class Registration:
    """One section's registration: ``he_um_to_xenium_um`` (3×3), the 10x ``alignment`` (3×3, H&E px →
    morphology px), the matched nuclei's distances and how it was found (``record``)."""

    he_um_to_xenium_um: np.ndarray
    alignment: np.ndarray
    record: dict


def _consensus(fit: FineFit, moving: np.ndarray, fixed: np.ndarray) -> int:
    if len(fit.pairs) == 0:
        return 0
    distance = np.hypot(*(apply(fit.matrix, moving[fit.pairs[:, 0]]) - fixed[fit.pairs[:, 1]]).T)
    return int(np.count_nonzero(distance <= CONSENSUS_UM))


def chance_consensus(matrix: np.ndarray, moving: np.ndarray, fixed: np.ndarray) -> int:
    """The consensus of a decoy: the moving nuclei under ``matrix`` moved by ``DECOY_SHIFT_UM``, paired
    as the fine fit pairs them — how many nuclei meet a partner by chance at this density."""
    pairs, _, _ = mutual_nearest_neighbours(apply(matrix, moving) + DECOY_SHIFT_UM, fixed, RADII_UM[-1])
    distance = np.hypot(*(apply(matrix, moving[pairs[:, 0]]) + DECOY_SHIFT_UM - fixed[pairs[:, 1]]).T)
    return int(np.count_nonzero(distance <= CONSENSUS_UM))


def _check_inputs(he_px: np.ndarray, mpp: float, xenium_um: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if mpp is None or not np.isfinite(mpp) or mpp <= 0:
        raise RegistrationError(f"the H&E has no usable µm per pixel (got {mpp}): registration needs the "
                                "slide's physical scale; give the OME-TIFF its PhysicalSizeX")
    he = np.asarray(he_px, float).reshape(-1, 2)
    xenium = np.asarray(xenium_um, float).reshape(-1, 2)
    for name, points in (("H&E", he), ("Xenium", xenium)):
        points = points[np.isfinite(points).all(axis=1)]
        if len(points) < MIN_NUCLEI:
            raise RegistrationError(f"{len(points)} {name} nuclei (at least {MIN_NUCLEI} are needed): "
                                    f"{'no nuclei were detected on the H&E' if name == 'H&E' else 'no cells'}"
                                    " to register from")
    return he[np.isfinite(he).all(axis=1)] * mpp, xenium[np.isfinite(xenium).all(axis=1)]


def _agreed(started: list[tuple[Pose, np.ndarray, int, int]]) -> bool:
    """Whether a start has ``MIN_WINDOW_SHARE`` of its windows agreeing; a tissue too small for
    ``MIN_WINDOWS`` windows has no such test (the fine fit and the consensus decide alone)."""
    return any(matched < MIN_WINDOWS or support >= max(MIN_WINDOWS, MIN_WINDOW_SHARE * matched)
               for _, _, support, matched in started)


def _starts(moving: np.ndarray, fixed: np.ndarray, scale: float,
            angle_step_deg: float = ANGLE_STEP_DEG) -> list[tuple[Pose, np.ndarray, int, int]]:
    """(coarse pose, its window-matched start, windows supporting it, windows matched) of each coarse
    candidate at ``scale``."""
    return [(pose, *block_refined(moving, fixed, pose.matrix()))
            for pose in coarse_poses(moving, fixed, keep=CANDIDATES, scale=scale, angle_step_deg=angle_step_deg)]


def _different(a: FineFit, b: FineFit, moving: np.ndarray) -> bool:
    """Whether two fine fits are two poses: some corner of the moving nuclei's bounding box lands more
    than ``DISTINCT_FIT_UM`` apart under them (two starts that converged to one pose are one)."""
    corners = bounding_corners(moving)
    return float(np.hypot(*(apply(a.matrix, corners) - apply(b.matrix, corners)).T).max()) > DISTINCT_FIT_UM


def register_nuclei(he_px: np.ndarray, mpp: float, xenium_um: np.ndarray) -> Registration:
    """Register H&E nuclei (level-0 px, ``mpp`` µm/px) to Xenium nuclei (µm) from any starting pose."""
    moving, fixed = _check_inputs(he_px, mpp, xenium_um)
    started = _starts(moving, fixed, 1.0)
    if not _agreed(started):
        started = [start for scale in FALLBACK_SCALES for start in _starts(moving, fixed, scale, FALLBACK_STEP_DEG)]
    if not _agreed(started):
        best = max(support for _, _, support, _ in started)
        raise RegistrationError(f"no pose lines the nuclei up: at most {best} of the windows agree on one, under "
                                "every rotation, flip and scale tried; check that the H&E and the Xenium section "
                                "are of the same section and that the H&E's nuclei were detected")
    best_support = max(support for _, _, support, _ in started)
    tried = []
    for pose, start, support, _ in started:  # the fine fit for the best start and any that rivals it
        if support >= AMBIGUOUS_SHARE * best_support:
            fit = fine_affine(moving, fixed, start)
            tried.append((_consensus(fit, moving, fixed), pose, support, fit))
    tried.sort(key=lambda item: -item[0])
    consensus, pose, windows, fit = tried[0]
    smaller, chance = min(len(moving), len(fixed)), chance_consensus(fit.matrix, moving, fixed)
    if len(fit.pairs) < MIN_MATCHES or consensus < max(MIN_CONSENSUS_SHARE * smaller, MIN_CHANCE_RATIO * chance):
        raise RegistrationError(f"too few matched nuclei ({consensus} within {CONSENSUS_UM} µm, of {smaller}; "
                                f"{chance} by chance): "
                                "the H&E and the Xenium section do not line up under any pose; check that "
                                "they are of the same section and that the H&E's nuclei were detected")
    rivals = [(c, p) for c, p, _, other in tried[1:]
              if c >= AMBIGUOUS_SHARE * consensus and _different(other, fit, moving)]
    if rivals:
        c, p = rivals[0]
        raise RegistrationError(
            f"ambiguous: the pose at {p.angle_deg:.0f}°{' flipped' if p.flipped else ''} matches {c} nuclei "
            f"against {consensus} at {pose.angle_deg:.0f}°{' flipped' if pose.flipped else ''}: the tissue looks "
            "alike under both (a symmetric section); register it by hand (Xenium Explorer's keypoints)")
    return _result(fit, mpp, moving, fixed, pose, windows, (consensus, chance), tried)


def alignment_matrix(he_um_to_xenium_um: np.ndarray, mpp: float) -> np.ndarray:
    """10x's alignment (H&E level-0 px → morphology px) of a µm → µm affine."""
    return np.diag([1 / XENIUM_PIXEL_SIZE_UM, 1 / XENIUM_PIXEL_SIZE_UM, 1.0]) @ he_um_to_xenium_um @ np.diag(
        [mpp, mpp, 1.0])


def _result(fit: FineFit, mpp: float, moving: np.ndarray, fixed: np.ndarray, pose: Pose, windows: int,
            consensus: tuple[int, int], tried: list) -> Registration:
    distance = np.hypot(*(apply(fit.matrix, moving[fit.pairs[:, 0]]) - fixed[fit.pairs[:, 1]]).T)
    record = {
        "method": "nuclei: FFT pose search (every 1°, both flips), window matching, ICP affine",
        "coarse": {"angle_deg": pose.angle_deg, "flipped": pose.flipped, "scale": pose.scale,
                   "score": round(pose.score, 6),
                   "runner_up_consensus": int(tried[1][0]) if len(tried) > 1 else 0, "candidates": CANDIDATES},
        "fine_fitted": [{"angle_deg": p.angle_deg, "flipped": p.flipped, "scale": p.scale, "score": round(p.score, 6),
                         "windows_supporting": w, "consensus_nuclei": c, "converged": f.converged}
                        for c, p, w, f in tried],  # every start the fine fit was run from, and its consensus
        "windows_supporting": windows, "icp_rounds": fit.rounds, "converged": fit.converged,
        "n_he_nuclei": int(len(moving)), "n_xenium_nuclei": int(len(fixed)),
        "matched_nuclei": int(len(fit.pairs)), "consensus_nuclei": consensus[0],
        "chance_consensus_nuclei": consensus[1],
        "residual_median_um": float(np.median(distance)), "residual_p90_um": float(np.percentile(distance, 90)),
    }
    return Registration(fit.matrix, alignment_matrix(fit.matrix, mpp), record)
