"""The robustness maths of CRoMa (Grisi et al.), pure functions on neighbour distances and labels.

All distances are cosine distances ``1 - cos`` on L2-normalised features. Pair types, for an
anchor i and a neighbour j of another group: SO = same biology, other confounder (a
cross-confounder biological match); OS = other biology, same confounder (a same-confounder
distractor). Definitions follow the ``croma`` package (v1.0.1) exactly:

* ``CRoMa_m(i) = (d_OS - d_SO) / (d_OS + d_SO)``, the d's the mean distances to the m nearest
  SO / OS neighbours; undefined (NaN) without m neighbours of each type or when
  ``d_OS + d_SO == 0``.
* median, ``F(0) = mean(CRoMa <= 0)`` (exact zeros count as non-positive) and
  ``LTM_alpha`` = mean of the defined values ``<= np.percentile(values, 100 alpha)``
  (numpy's linear interpolation), all over the defined samples.
* RI at k: within each anchor's k nearest other-group neighbours, the pooled share of SO among
  SO + OS neighbours; anchors with no SO/OS neighbour there are excluded (support = share of
  anchors included); 0.5 when no anchor is included. MaRI: the same with each neighbour weighted
  ``exp(-d / tau)``, tau defaulting to the median SO/OS distance within the top-k sets (0.2 when
  there is none or it is 0).
* k-NN balanced accuracy: leave-one-out majority vote of the k nearest other-group neighbours
  (ties to the label that appears first in the data), balanced over the classes present.
* k selection: per model, the first k of the candidate grid maximising biological k-NN balanced
  accuracy; across models, the lower median of those optima.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cellpath.robustness.validation import check_fraction

#: PathoROB's k grid: 1, 3, 5, 7, 9, then steps of 10 up to 91.
K_CANDIDATES: tuple[int, ...] = (1, 3, 5, 7, 9, *range(11, 92, 10))
#: MaRI temperature used when the typed-distance median cannot set a scale (croma's fallback).
TAU_FALLBACK = 0.2


@dataclass(frozen=True)
class Margins:
    """Per-sample CRoMa margins; ``values`` is NaN exactly where ``defined`` is False.

    ``n_unresolved``: samples lacking m neighbours of a type; ``n_zero_distance``: samples whose
    margin has a zero denominator (duplicated rows, collapsed embedding). ``d_so`` / ``d_os``: the
    mean cosine distance to the m nearest same-type other-confounder and other-type same-confounder
    neighbours the margin ``(d_os - d_so) / (d_os + d_so)`` is made of (NaN where unresolved).
    """

    values: np.ndarray
    defined: np.ndarray
    n_unresolved: int
    n_zero_distance: int
    d_so: np.ndarray
    d_os: np.ndarray

    @property
    def n_undefined(self) -> int:
        return self.n_unresolved + self.n_zero_distance


@dataclass(frozen=True)
class TailSummary:
    """The alpha-quantile of the defined margins and the mean of the values at or below it."""

    alpha: float
    q_alpha: float
    ltm: float
    n_tail: int


@dataclass(frozen=True)
class FixedKScore:
    """A pooled fixed-k score (RI or MaRI) with its per-sample values and support.

    ``so_weight`` / ``typed_weight``: each anchor's SO and SO + OS evidence on one common scale,
    so the pooled value is ``so_weight.sum() / typed_weight.sum()`` over any set of anchors (what
    a bootstrap over anchors resamples).
    """

    k: int
    value: float
    samples: np.ndarray
    informative: np.ndarray
    tau: float
    so_weight: np.ndarray
    typed_weight: np.ndarray

    @property
    def support(self) -> float:
        return float(np.mean(self.informative))


def croma_margins(so_distances: np.ndarray, os_distances: np.ndarray) -> Margins:
    """CRoMa per sample from (n, m) distances to the m nearest SO and OS neighbours (inf = missing)."""
    unresolved = ~(np.isfinite(so_distances).all(axis=1) & np.isfinite(os_distances).all(axis=1))
    d_so = np.where(unresolved[:, None], 0.0, so_distances).mean(axis=1)
    d_os = np.where(unresolved[:, None], 0.0, os_distances).mean(axis=1)
    total = d_os + d_so
    zero = ~unresolved & (total == 0.0)
    defined = ~unresolved & ~zero
    values = np.full(len(total), np.nan)
    values[defined] = (d_os[defined] - d_so[defined]) / total[defined]
    d_so[unresolved], d_os[unresolved] = np.nan, np.nan
    return Margins(values, defined, int(unresolved.sum()), int(zero.sum()), d_so, d_os)


def _finite(values: np.ndarray) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    return arr[np.isfinite(arr)]


def median_margin(values: np.ndarray) -> float:
    """Median of the defined margins (NaN when none is defined)."""
    finite = _finite(values)
    return float(np.median(finite)) if finite.size else float("nan")


def fraction_non_positive(values: np.ndarray) -> float:
    """F(0): the share of defined margins <= 0 (NaN when none is defined)."""
    finite = _finite(values)
    return float(np.mean(finite <= 0.0)) if finite.size else float("nan")


def lower_tail(values: np.ndarray, alpha: float = 0.10) -> TailSummary:
    """LTM_alpha: mean of the defined margins at or below their alpha-percentile."""
    alpha = check_fraction("alpha", alpha)
    finite = _finite(values)
    if not finite.size:
        return TailSummary(alpha, float("nan"), float("nan"), 0)
    q = float(np.percentile(finite, alpha * 100))
    tail = finite[finite <= q]
    return TailSummary(alpha, q, float(tail.mean()), int(tail.size))


def _typed_slots(
    neighbour_index: np.ndarray, biology: np.ndarray, confounder: np.ndarray, k: int,
    anchor_rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Boolean (anchors, k) masks of the SO and OS slots among each anchor's first k neighbours.
    Rows of ``neighbour_index`` are the samples ``anchor_rows`` (None: all, in order)."""
    index = neighbour_index[:, :k]
    found = index >= 0
    safe = np.where(found, index, 0)
    own_b, own_c = (biology, confounder) if anchor_rows is None else (biology[anchor_rows], confounder[anchor_rows])
    same_b = biology[safe] == own_b[:, None]
    same_c = confounder[safe] == own_c[:, None]
    return found & same_b & ~same_c, found & ~same_b & same_c


def _weighted_share(so: np.ndarray, os_: np.ndarray, log_weight: np.ndarray, k: int, tau: float) -> FixedKScore:
    """Pooled and per-anchor SO share of typed evidence, weights given as logs (shift-stable)."""
    typed = so | os_
    informative = typed.any(axis=1)
    logs = np.where(typed, log_weight, -np.inf)
    row_max = np.where(informative, logs.max(axis=1), 0.0)
    weights = np.exp(logs - row_max[:, None])
    samples = np.full(len(so), np.nan)
    samples[informative] = (weights * so).sum(axis=1)[informative] / weights.sum(axis=1)[informative]
    if not informative.any():
        zeros = np.zeros(len(so))
        return FixedKScore(k, 0.5, samples, informative, tau, zeros, zeros)
    pooled = np.exp(logs - logs.max())
    return FixedKScore(k, float(pooled[so].sum() / pooled[typed].sum()), samples, informative, tau,
                       np.where(so, pooled, 0.0).sum(axis=1), np.where(typed, pooled, 0.0).sum(axis=1))


def robustness_index(neighbour_index: np.ndarray, biology: np.ndarray, confounder: np.ndarray, k: int,
                     anchor_rows: np.ndarray | None = None) -> FixedKScore:
    """RI at k from the (anchors, >=k) nearest other-group neighbours (-1 = missing) of the samples
    ``anchor_rows`` (None: every sample, in order)."""
    so, os_ = _typed_slots(neighbour_index, biology, confounder, k, anchor_rows)
    return _weighted_share(so, os_, np.zeros(so.shape), k, float("nan"))


def typed_distance_median(
    neighbour_index: np.ndarray, neighbour_distance: np.ndarray, biology: np.ndarray, confounder: np.ndarray, k: int,
    anchor_rows: np.ndarray | None = None,
) -> float:
    """MaRI's default tau: the median SO/OS distance in the top-k sets, TAU_FALLBACK if none or 0."""
    so, os_ = _typed_slots(neighbour_index, biology, confounder, k, anchor_rows)
    typed = neighbour_distance[:, :k][so | os_]
    tau = float(np.median(typed)) if typed.size else float("nan")
    return tau if np.isfinite(tau) and tau > 0.0 else TAU_FALLBACK


def margin_aware_robustness_index(
    neighbour_index: np.ndarray,
    neighbour_distance: np.ndarray,
    biology: np.ndarray,
    confounder: np.ndarray,
    k: int,
    tau: float | None = None,
    anchor_rows: np.ndarray | None = None,
) -> FixedKScore:
    """MaRI at k: RI with each typed neighbour weighted exp(-d / tau) (tau > 0; None = auto)."""
    if tau is None:
        tau = typed_distance_median(neighbour_index, neighbour_distance, biology, confounder, k, anchor_rows)
    if not tau > 0.0:
        raise ValueError(f"tau must be > 0, got {tau}")
    so, os_ = _typed_slots(neighbour_index, biology, confounder, k, anchor_rows)
    log_weight = np.where(so | os_, -neighbour_distance[:, :k] / tau, -np.inf)
    return _weighted_share(so, os_, log_weight, k, float(tau))


def balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean per-class recall over the classes present in ``y_true`` (scikit-learn's definition)."""
    n_classes = int(max(y_true.max(), y_pred.max())) + 1
    support = np.bincount(y_true, minlength=n_classes)
    hits = np.bincount(y_true[y_true == y_pred], minlength=n_classes)
    present = support > 0
    return float(np.mean(hits[present] / support[present]))


def knn_balanced_accuracy(neighbour_index: np.ndarray, labels: np.ndarray, k_values: Iterable[int],
                          anchor_rows: np.ndarray | None = None) -> dict[int, float]:
    """Leave-one-out k-NN balanced accuracy at each k (neighbours as from ``knn_excluding_groups``).

    Votes among the first min(k, available) neighbours; ties go to the smallest label code.
    Samples with no neighbour at all are left out. Rows of ``neighbour_index`` are the samples
    ``anchor_rows`` (None: all, in order).
    """
    wanted = sorted({int(k) for k in k_values})
    if wanted[-1] > neighbour_index.shape[1]:
        raise ValueError(f"k={wanted[-1]} needs {wanted[-1]} neighbours per sample, got {neighbour_index.shape[1]}")
    n, n_classes = len(neighbour_index), int(labels.max()) + 1
    truth = labels if anchor_rows is None else labels[anchor_rows]
    found = neighbour_index >= 0
    votes_for = labels[np.where(found, neighbour_index, 0)]
    used = found[:, 0]
    counts = np.zeros((n, n_classes), dtype=np.int32)
    rows = np.arange(n)
    scores: dict[int, float] = {}
    for column in range(wanted[-1]):
        counts[rows, votes_for[:, column]] += found[:, column]
        if column + 1 in wanted:
            scores[column + 1] = balanced_accuracy(truth[used], counts[used].argmax(axis=1))
    return scores


def select_k(scores: Mapping[int, float], candidates: Sequence[int] = K_CANDIDATES) -> int:
    """The first candidate k with the highest score (a model's biologically selected k*)."""
    best: int | None = None
    for k in candidates:
        if k in scores and (best is None or scores[k] > scores[best]):
            best = k
    if best is None:
        raise ValueError("no candidate k has a k-NN score")
    return best


def shared_k(selected: Sequence[int]) -> int:
    """The shared operating k across models: the lower median of their k*."""
    if not selected:
        raise ValueError("shared_k needs at least one selected k")
    ordered = sorted(int(k) for k in selected)
    return ordered[(len(ordered) - 1) // 2]
