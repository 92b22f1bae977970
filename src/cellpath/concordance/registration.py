"""Registration QC: how well the nuclei seen on the H&E line up with the Xenium nuclei placed on it.

The concordance stage places Xenium nuclei on the H&E through 10x's alignment (``he_x_px``,
``he_y_px``) and matches them to the nuclei detected on the H&E. When the alignment is off, matched
nuclei lie far apart. Per section this module reports, all in the H&E frame scaled to µm (level-0
px × ``he_mpp``, origin at the slide's top-left corner):

- the median and 90th percentile of the matched distances under the alignment as given;
- the residual affine that maps the H&E-detected positions onto the Xenium-placed ones (a trimmed
  least-squares fit about the detected nuclei's centroid): its translation (µm, the shift of that
  centroid), rotation (degrees, positive from +x towards +y: clockwise on screen, where y points
  down), scale along x and y, shear (degrees), and the RMS distance that remains after it.

A global misregistration (a shift, a rotation) shows as a large translation or rotation and a
residual RMS well below the RMS before the fit; a local one (each nucleus displaced on its own, as
the simulator's registration jitter does) leaves the affine near the identity and the residual RMS
near the RMS before it.

Matching is by mutual nearest neighbours within a QC radius that is wider than the score's match
cap (a cap truncates the very distances the QC measures). A global shift larger than about half
the nucleus spacing would pair nuclei with their neighbours, so matching also starts from the most
common displacement between nearby nuclei (``displacement_mode``), kept when far more pairs then
agree with the fitted affine; either way the detections are moved by each fit and matched again
(``refined_pairs``). Distances are always measured under the alignment as given, between the
nuclei so paired. Everything here is pure (arrays in, numbers out).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import ndimage as ndi
from scipy.spatial import cKDTree

from cellpath.concordance.scoring import mutual_nearest_neighbours

MIN_AFFINE_PAIRS = 3  # an affine has six parameters: three non-collinear pairs
TRIM_FACTOR = 3.0  # a pair whose residual exceeds this × the median residual is left out of the next fit
TRIM_ROUNDS = 3
REFINE_ROUNDS = 2
MODE_BIN_UM = 0.5  # histogram bin of the displacement mode (µm)
MODE_SMOOTHING_UM = 1.0  # Gaussian sigma the histogram is smoothed by (µm)
MODE_MAX_DETECTIONS = 50_000  # the mode is taken over at most this many detections (every k-th)
MODE_WINDOW_UM = 3.0  # the peak is refined to the mean displacement within this distance of it (µm)
CONSENSUS_UM = 2.0  # a pair within this distance after the affine supports it (µm)
MODE_ADVANTAGE = 1.2  # the displacement mode's matching must have this many times the consensus


@dataclass(frozen=True)
class AffineFit:
    """An affine ``dst = A · (src − centre) + centre + t`` and its decomposition.

    ``A = R(rotation) · [[scale_x, k], [0, scale_y]]`` with shear angle ``atan2(k, scale_y)``; all
    lengths in µm, angles in degrees. ``residual_rms_um`` is over every pair (trimmed ones included);
    ``n_inliers`` counts the pairs the last fit used.
    """

    linear: np.ndarray  # (2, 2) A
    centre_um: np.ndarray  # (2,) the source centroid the fit is about
    translation_um: np.ndarray  # (2,) t: the shift of the centre
    rotation_deg: float
    scale_x: float
    scale_y: float
    shear_deg: float
    residual_rms_um: float
    n_inliers: int

    def apply(self, xy_um: np.ndarray) -> np.ndarray:
        """(N, 2) source µm → (N, 2) destination µm."""
        return (np.asarray(xy_um, float) - self.centre_um) @ self.linear.T + self.centre_um + self.translation_um


@dataclass(frozen=True)
class RegistrationQC:
    """One section's registration QC (module docstring); NaN where there are too few pairs."""

    reg_pairs: int
    reg_median_um: float
    reg_p90_um: float
    reg_rms_um: float
    reg_translation_x_um: float
    reg_translation_y_um: float
    reg_rotation_deg: float
    reg_scale_x: float
    reg_scale_y: float
    reg_shear_deg: float
    reg_residual_rms_um: float

    def as_columns(self) -> dict[str, float | int]:
        """The panels-table columns, floats rounded to 4 decimals (µm, degrees, unitless scales)."""
        return {k: (v if isinstance(v, int) else round(float(v), 4)) for k, v in asdict(self).items()}


def decompose_linear(linear: np.ndarray) -> tuple[float, float, float, float]:
    """Rotation (degrees), scale_x, scale_y and shear (degrees) of a 2×2 matrix ``R(θ) · [[sx, k], [0, sy]]``.

    θ is the angle of the transformed x axis; the shear is the angle between the transformed y axis
    and the perpendicular of the transformed x axis, ``atan2(k, sy)``. A reflection gives sy < 0.
    """
    a = np.asarray(linear, dtype=float)
    if a.shape != (2, 2) or not np.all(np.isfinite(a)):
        raise ValueError(f"linear must be a finite 2×2 matrix, got shape {a.shape}")
    scale_x = float(math.hypot(a[0, 0], a[1, 0]))
    if scale_x == 0:
        raise ValueError("linear maps the x axis to zero: not an affine registration")
    rotation = math.atan2(a[1, 0], a[0, 0])
    scale_y = float(np.linalg.det(a)) / scale_x
    shear = float(a[:, 0] @ a[:, 1]) / scale_x
    return math.degrees(rotation), scale_x, scale_y, math.degrees(math.atan2(shear, scale_y))


def _lstsq_affine(src: np.ndarray, dst: np.ndarray, centre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares (A, t) of ``dst ≈ A · (src − centre) + centre + t``."""
    design = np.column_stack([src - centre, np.ones(len(src))])
    solution, *_ = np.linalg.lstsq(design, dst - centre, rcond=None)
    return solution[:2].T, solution[2]


def fit_affine(src_um: np.ndarray, dst_um: np.ndarray) -> AffineFit | None:
    """Trimmed least-squares affine from ``src_um`` to ``dst_um`` ((N, 2) matched pairs, µm), about
    the centroid of ``src_um``; None with fewer than ``MIN_AFFINE_PAIRS`` pairs or collinear ones.

    Each of ``TRIM_ROUNDS`` refits leaves out the pairs whose residual exceeds ``TRIM_FACTOR`` × the
    median residual (for a Gaussian displacement that drops about 0.2 % of true pairs), so a few
    wrong matches do not pull the fit.
    """
    src, dst = np.asarray(src_um, dtype=float), np.asarray(dst_um, dtype=float)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2:
        raise ValueError(f"src_um and dst_um must be matched (N, 2) arrays, got {src.shape} and {dst.shape}")
    if len(src) < MIN_AFFINE_PAIRS or np.linalg.matrix_rank(src - src.mean(axis=0)) < 2:
        return None
    centre = src.mean(axis=0)
    keep = np.ones(len(src), dtype=bool)
    for _ in range(TRIM_ROUNDS):
        linear, translation = _lstsq_affine(src[keep], dst[keep], centre)
        residual = np.hypot(*((src - centre) @ linear.T + centre + translation - dst).T)
        cut = TRIM_FACTOR * float(np.median(residual))
        trimmed = residual <= cut if cut > 0 else np.ones(len(src), dtype=bool)
        if trimmed.sum() < MIN_AFFINE_PAIRS or np.linalg.matrix_rank(src[trimmed] - centre) < 2 \
                or np.array_equal(trimmed, keep):
            break
        keep = trimmed
    linear, translation = _lstsq_affine(src[keep], dst[keep], centre)
    residual = np.hypot(*((src - centre) @ linear.T + centre + translation - dst).T)
    rotation, scale_x, scale_y, shear = decompose_linear(linear)
    return AffineFit(linear=linear, centre_um=centre, translation_um=translation, rotation_deg=rotation,
                     scale_x=scale_x, scale_y=scale_y, shear_deg=shear,
                     residual_rms_um=float(np.sqrt(np.mean(residual**2))), n_inliers=int(keep.sum()))


def _match(detected_um: np.ndarray, placed_um: np.ndarray, radius_um: float) -> np.ndarray:
    pairs, _, _ = mutual_nearest_neighbours(detected_um, placed_um, radius_um)
    return pairs


def displacement_mode(detected_um: np.ndarray, placed_um: np.ndarray, radius_um: float) -> np.ndarray:
    """The most common displacement placed − detected (µm, (2,)) over every pair within ``radius_um``.

    Each detected nucleus contributes one vector to its own Xenium nucleus, which all share a global
    shift, and vectors to its neighbours, which spread over a ring; the peak of their 2-D histogram
    (``MODE_BIN_UM`` bins, smoothed by ``MODE_SMOOTHING_UM``) is the shift, refined to the mean of the
    vectors within ``MODE_WINDOW_UM`` of it (mean shift). Zero when no pair lies within the radius.
    Taken over at most ``MODE_MAX_DETECTIONS`` detections (every k-th).
    """
    if len(detected_um) == 0 or len(placed_um) == 0:
        return np.zeros(2)
    step = max(1, int(np.ceil(len(detected_um) / MODE_MAX_DETECTIONS)))
    detected_um = detected_um[::step]  # an even subsample bounds the pairs on a large section
    near = cKDTree(detected_um).sparse_distance_matrix(cKDTree(placed_um), radius_um, output_type="ndarray")
    if len(near) == 0:
        return np.zeros(2)
    vectors = placed_um[near["j"]] - detected_um[near["i"]]
    edges = np.arange(-radius_um, radius_um + MODE_BIN_UM, MODE_BIN_UM)
    counts, _, _ = np.histogram2d(vectors[:, 0], vectors[:, 1], bins=(edges, edges))
    counts = ndi.gaussian_filter(counts, MODE_SMOOTHING_UM / MODE_BIN_UM, mode="constant")
    ix, iy = np.unravel_index(int(np.argmax(counts)), counts.shape)
    mode = np.array([edges[ix], edges[iy]]) + MODE_BIN_UM / 2
    for _ in range(20):
        window = vectors[np.hypot(*(vectors - mode).T) < MODE_WINDOW_UM]
        if len(window) == 0:
            break
        shifted, mode = mode, window.mean(axis=0)
        if np.hypot(*(mode - shifted)) < 1e-3:
            break
    return mode


def _icp(detected_um: np.ndarray, placed_um: np.ndarray, radius_um: float,
         start_um: np.ndarray) -> tuple[np.ndarray, AffineFit | None, int]:
    """Pairs, affine and consensus (pairs within ``CONSENSUS_UM`` after the fit) from a start shift:
    match, fit, then ``REFINE_ROUNDS`` times move the detections by the fit and match again."""
    pairs = _match(detected_um + start_um, placed_um, radius_um)
    fit = fit_affine(detected_um[pairs[:, 0]], placed_um[pairs[:, 1]])
    for _ in range(REFINE_ROUNDS):
        if fit is None:
            break
        pairs = _match(fit.apply(detected_um), placed_um, radius_um)
        fit = fit_affine(detected_um[pairs[:, 0]], placed_um[pairs[:, 1]])
    if fit is None:
        return pairs, None, 0
    residual = np.hypot(*(fit.apply(detected_um[pairs[:, 0]]) - placed_um[pairs[:, 1]]).T)
    return pairs, fit, int(np.count_nonzero(residual <= CONSENSUS_UM))


def refined_pairs(detected_um: np.ndarray, placed_um: np.ndarray,
                  radius_um: float) -> tuple[np.ndarray, AffineFit | None]:
    """Mutual-nearest-neighbour pairs (detected, placed) within ``radius_um`` and their affine fit.

    Matched from the alignment as given and, separately, from the displacement mode (a global
    shift); the mode's result is kept only when its consensus beats the given alignment's by
    ``MODE_ADVANTAGE``. Per-cell displacement makes the mode a noisy estimate of zero that would
    otherwise lock the matching onto a spurious shift.
    """
    pairs, fit, consensus = _icp(detected_um, placed_um, radius_um, np.zeros(2))
    mode = displacement_mode(detected_um, placed_um, radius_um)
    if np.hypot(*mode) > MODE_BIN_UM:
        shifted_pairs, shifted_fit, shifted_consensus = _icp(detected_um, placed_um, radius_um, mode)
        if shifted_consensus > MODE_ADVANTAGE * consensus:
            return shifted_pairs, shifted_fit
    return pairs, fit


def distance_summary(detected_um: np.ndarray, placed_um: np.ndarray) -> tuple[float, float, float]:
    """Median, 90th percentile and RMS (µm) of the distances between matched (N, 2) µm positions; NaN if N = 0."""
    distance = np.hypot(*(np.asarray(detected_um, float) - np.asarray(placed_um, float)).T)
    if distance.size == 0:
        return math.nan, math.nan, math.nan
    return (float(np.median(distance)), float(np.percentile(distance, 90)),
            float(np.sqrt(np.mean(distance**2))))


def registration_qc(detected_px: np.ndarray, placed_px: np.ndarray, mpp: float, radius_um: float) -> RegistrationQC:
    """Registration QC of one section (module docstring).

    ``detected_px``: (N, 2) nuclei detected on the H&E; ``placed_px``: (M, 2) Xenium nuclei placed on
    the H&E by the alignment; both H&E level-0 px (x, y). ``mpp``: µm per level-0 px;
    ``radius_um``: the matching radius in µm.
    """
    if not np.isfinite(mpp) or mpp <= 0:
        raise ValueError(f"mpp must be a positive number of µm per level-0 px, got {mpp}")
    if not np.isfinite(radius_um) or radius_um <= 0:
        raise ValueError(f"radius_um must be a positive distance in µm, got {radius_um}")
    detected = np.asarray(detected_px, dtype=float).reshape(-1, 2) * mpp
    placed = np.asarray(placed_px, dtype=float).reshape(-1, 2) * mpp
    pairs, fit = refined_pairs(detected, placed, radius_um)
    median, p90, rms = distance_summary(detected[pairs[:, 0]], placed[pairs[:, 1]])
    nan = math.nan
    return RegistrationQC(
        reg_pairs=int(len(pairs)), reg_median_um=median, reg_p90_um=p90, reg_rms_um=rms,
        reg_translation_x_um=nan if fit is None else float(fit.translation_um[0]),
        reg_translation_y_um=nan if fit is None else float(fit.translation_um[1]),
        reg_rotation_deg=nan if fit is None else fit.rotation_deg,
        reg_scale_x=nan if fit is None else fit.scale_x, reg_scale_y=nan if fit is None else fit.scale_y,
        reg_shear_deg=nan if fit is None else fit.shear_deg,
        reg_residual_rms_um=nan if fit is None else fit.residual_rms_um)


def registration_flagged(qc: RegistrationQC, max_median_um: float, max_p90_um: float) -> bool:
    """True when the median matched distance exceeds ``max_median_um`` or the 90th percentile exceeds
    ``max_p90_um`` (both µm). A section without matched pairs is not flagged (its counts show it)."""
    median, p90 = qc.reg_median_um, qc.reg_p90_um
    return bool((np.isfinite(median) and median > max_median_um) or (np.isfinite(p90) and p90 > max_p90_um))
