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
  (numpy's linear interpolation; every value tied at the cut-off is in the tail), all over the
  defined samples.
* RI at k: within each anchor's k nearest other-group neighbours, the pooled share of SO among
  SO + OS neighbours; anchors with no SO/OS neighbour there are excluded (support = share of
  anchors included); 0.5 when no anchor is included. MaRI: the same with each neighbour weighted
  ``exp(-d / tau)``, tau defaulting to the median SO/OS distance within the top-k sets (0.2 when
  there is none or it is 0).
* k-NN balanced accuracy: leave-one-out majority vote of the k nearest other-group neighbours
  (ties between labels to the smallest label), balanced over the classes present.
* k selection: per model, the first k of the candidate grid maximising biological k-NN balanced
  accuracy; across models, the lower median of those optima.

Ties (docs/decisions/0039): where neighbours are tied at the k-th distance (duplicate rows), they
share the places left among the k nearest in equal fractions (:func:`rank_weights`), so RI, MaRI,
support, the k-NN accuracies and k* are functions of the distances alone; croma takes the first
of them in its search order instead. Sums are taken in sorted order and exact quantities (votes,
balanced accuracies) in integers or fractions, so the order of the samples changes no bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from cellpath.robustness.neighbours import TIE_TOLERANCE
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
    """The finite values, sorted: every summary is computed from the sorted multiset, so that the
    order of the samples cannot change a rounding."""
    arr = np.asarray(values, dtype=float)
    return np.sort(arr[np.isfinite(arr)])


def median_margin(values: np.ndarray) -> float:
    """Median of the defined margins (NaN when none is defined)."""
    finite = _finite(values)
    return float(np.median(finite)) if finite.size else float("nan")


def fraction_non_positive(values: np.ndarray) -> float:
    """F(0): the share of defined margins <= 0 (NaN when none is defined)."""
    finite = _finite(values)
    return float(np.count_nonzero(finite <= 0.0) / finite.size) if finite.size else float("nan")


def lower_tail(values: np.ndarray, alpha: float = 0.10) -> TailSummary:
    """LTM_alpha: the mean of every defined margin at or below Q_alpha, their alpha-quantile by
    linear interpolation (``np.percentile``), as the CRoMa paper and croma define it. Margins tied
    at Q_alpha are all in the tail, so it may hold more than alpha of the samples (``n_tail``)."""
    alpha = check_fraction("alpha", alpha)
    finite = _finite(values)
    if not finite.size:
        return TailSummary(alpha, float("nan"), float("nan"), 0)
    q = float(np.percentile(finite, alpha * 100))
    tail = finite[finite <= q]
    return TailSummary(alpha, q, float(tail.mean()), int(tail.size))


def rank_weights(distance: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """How much each listed neighbour counts among an anchor's k nearest, as integer numerators
    (anchors, W) over one integer denominator per anchor: 1 for a neighbour nearer than the k-th
    distance; for the t neighbours tied with it (within ``TIE_TOLERANCE``), the places left,
    ``(k - nearer) / t`` each; 0 beyond. An anchor with fewer than k neighbours counts each one 1.

    ``distance``: ascending per row, listing every neighbour tied with the k-th (a
    :class:`~cellpath.robustness.neighbours.Neighbours`); inf = none. The weights are a function of
    the distances alone, not of the order in which tied neighbours were found.
    """
    if distance.shape[1] < k:
        raise ValueError(f"k={k} needs {k} neighbours per sample, got {distance.shape[1]}")
    finite = np.isfinite(distance)
    kth = distance[:, k - 1][:, None]
    tied = finite & (np.abs(distance - np.where(np.isfinite(kth), kth, 0.0)) <= TIE_TOLERANCE) & np.isfinite(kth)
    nearer = finite & ~tied & (distance < kth)
    n_nearer, n_tied = nearer.sum(axis=1), tied.sum(axis=1)
    denominator = np.maximum(n_tied, 1)
    numerator = nearer * denominator[:, None] + tied * (k - n_nearer)[:, None]
    return numerator.astype(np.int64), denominator.astype(np.int64)


def _typed_slots(
    neighbour_index: np.ndarray, biology: np.ndarray, confounder: np.ndarray,
    anchor_rows: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Boolean (anchors, W) masks of the SO and OS neighbours listed per anchor. Rows of
    ``neighbour_index`` are the samples ``anchor_rows`` (None: all, in order)."""
    found = neighbour_index >= 0
    safe = np.where(found, neighbour_index, 0)
    own_b, own_c = (biology, confounder) if anchor_rows is None else (biology[anchor_rows], confounder[anchor_rows])
    same_b = biology[safe] == own_b[:, None]
    same_c = confounder[safe] == own_c[:, None]
    return found & same_b & ~same_c, found & ~same_b & same_c


def _sorted_sum(values: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """Sum of ``values`` (all, or along ``axis``) taken in ascending order: the same float whatever
    the order of the terms."""
    if axis is None:
        return np.sort(values, axis=None).sum()
    return np.sort(values, axis=axis).sum(axis=axis)


def _weighted_share(so: np.ndarray, os_: np.ndarray, log_weight: np.ndarray, k: int, tau: float) -> FixedKScore:
    """Pooled and per-anchor SO share of typed evidence, weights given as logs (shift-stable).
    Every sum is taken in sorted order, so the result does not depend on the order of the anchors
    or of tied neighbours."""
    typed = (so | os_) & np.isfinite(log_weight)
    so = so & typed
    informative = typed.any(axis=1)
    logs = np.where(typed, log_weight, -np.inf)
    row_max = np.where(informative, logs.max(axis=1), 0.0)
    weights = np.exp(logs - row_max[:, None])
    samples = np.full(len(so), np.nan)
    samples[informative] = (_sorted_sum(weights * so, axis=1)[informative]
                            / _sorted_sum(weights, axis=1)[informative])
    if not informative.any():
        zeros = np.zeros(len(so))
        return FixedKScore(k, 0.5, samples, informative, tau, zeros, zeros)
    pooled = np.exp(logs - logs.max())
    so_weight, typed_weight = _sorted_sum(np.where(so, pooled, 0.0), axis=1), _sorted_sum(pooled, axis=1)
    return FixedKScore(k, float(_sorted_sum(so_weight) / _sorted_sum(typed_weight)), samples, informative, tau,
                       so_weight, typed_weight)


def _log_rank_weights(neighbour_distance: np.ndarray, k: int) -> np.ndarray:
    """log of :func:`rank_weights` (-inf where a neighbour does not count)."""
    numerator, denominator = rank_weights(neighbour_distance, k)
    with np.errstate(divide="ignore"):
        return np.log(numerator / denominator[:, None])


def robustness_index(neighbour_index: np.ndarray, neighbour_distance: np.ndarray, biology: np.ndarray,
                     confounder: np.ndarray, k: int, anchor_rows: np.ndarray | None = None) -> FixedKScore:
    """RI at k from the nearest other-group neighbours (-1 = missing; every neighbour tied with the
    k-th listed) of the samples ``anchor_rows`` (None: every sample, in order); neighbours tied at
    the k-th distance share its places (:func:`rank_weights`)."""
    so, os_ = _typed_slots(neighbour_index, biology, confounder, anchor_rows)
    return _weighted_share(so, os_, _log_rank_weights(neighbour_distance, k), k, float("nan"))


def typed_distance_median(
    neighbour_index: np.ndarray, neighbour_distance: np.ndarray, biology: np.ndarray, confounder: np.ndarray, k: int,
    anchor_rows: np.ndarray | None = None,
) -> float:
    """MaRI's default tau: the median distance of the SO/OS neighbours within each anchor's k-th
    distance (ties at it included), TAU_FALLBACK if there is none or it is 0."""
    so, os_ = _typed_slots(neighbour_index, biology, confounder, anchor_rows)
    counted = rank_weights(neighbour_distance, k)[0] > 0
    typed = neighbour_distance[(so | os_) & counted]
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
    """MaRI at k: RI with each typed neighbour weighted exp(-d / tau) (tau > 0; None = auto), tied
    neighbours at the k-th distance sharing its places as in RI."""
    if tau is None:
        tau = typed_distance_median(neighbour_index, neighbour_distance, biology, confounder, k, anchor_rows)
    if not tau > 0.0:
        raise ValueError(f"tau must be > 0, got {tau}")
    so, os_ = _typed_slots(neighbour_index, biology, confounder, anchor_rows)
    log_weight = _log_rank_weights(neighbour_distance, k) - np.where(so | os_, neighbour_distance, 0.0) / tau
    return _weighted_share(so, os_, log_weight, k, float(tau))


def balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean per-class recall over the classes present in ``y_true`` (scikit-learn's definition),
    computed as an exact fraction and rounded once, so that equal accuracies are equal floats."""
    n_classes = int(max(y_true.max(), y_pred.max())) + 1
    support = np.bincount(y_true, minlength=n_classes)
    hits = np.bincount(y_true[y_true == y_pred], minlength=n_classes)
    present = np.flatnonzero(support > 0)
    return float(sum(Fraction(int(hits[c]), int(support[c])) for c in present) / len(present))


def knn_balanced_accuracy(neighbour_index: np.ndarray, neighbour_distance: np.ndarray, labels: np.ndarray,
                          k_values: Iterable[int], anchor_rows: np.ndarray | None = None) -> dict[int, float]:
    """Leave-one-out k-NN balanced accuracy at each k (neighbours as from ``knn_excluding_groups``).

    Each of the k nearest votes for its label with its :func:`rank_weights` (neighbours tied at the
    k-th distance share its places; votes compared exactly, in integers); a tie between labels goes
    to the smallest label code (labels are coded in sorted order). Samples with no neighbour at all
    are left out. Rows of ``neighbour_index`` are the samples ``anchor_rows`` (None: all, in order).
    """
    wanted = sorted({int(k) for k in k_values})
    if wanted[-1] > neighbour_index.shape[1]:
        raise ValueError(f"k={wanted[-1]} needs {wanted[-1]} neighbours per sample, got {neighbour_index.shape[1]}")
    n, n_classes = len(neighbour_index), int(labels.max()) + 1
    truth = labels if anchor_rows is None else labels[anchor_rows]
    found = neighbour_index >= 0
    slot_label = labels[np.where(found, neighbour_index, 0)]
    used = found[:, 0]
    cells = (np.arange(n)[:, None] * n_classes + slot_label)[found]
    scores: dict[int, float] = {}
    for k in wanted:
        numerator, _ = rank_weights(neighbour_distance, k)
        votes = np.bincount(cells, weights=numerator[found], minlength=n * n_classes).reshape(n, n_classes)
        scores[k] = balanced_accuracy(truth[used], votes[used].argmax(axis=1))
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
