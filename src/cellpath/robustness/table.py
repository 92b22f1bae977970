"""Entry points: score one embedding (CRoMa, F(0), LTM, RI, MaRI, k-NN probes) and tabulate
which categories fill the low-margin tail.

Conventions: cosine distance ``1 - cos`` on L2-normalised features; *biology* is the label the
embedding should organise (cell type), the *confounder* the one it should not (tissue section,
scan batch), and the *group* the physical unit a sample comes from (image patch, spatial tile),
whose members are never each other's neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from cellpath.robustness.metrics import (
    K_CANDIDATES,
    croma_margins,
    fraction_non_positive,
    knn_balanced_accuracy,
    lower_tail,
    margin_aware_robustness_index,
    median_margin,
    robustness_index,
    select_k,
)
from cellpath.robustness.neighbours import DEFAULT_CANDIDATE_ROWS, DEFAULT_CHUNK_SIZE, RowSource, scan_neighbours
from cellpath.robustness.validation import (
    check_at_least_one,
    check_fraction,
    check_typed_support,
    encode_labels,
    feature_rows,
)


@dataclass(frozen=True)
class RobustnessScores:
    """Robustness of one embedding. Per-sample arrays are aligned with the input rows.

    ``margins``: CRoMa_m per sample, NaN where undefined (``defined`` False); ``n_unresolved``
    samples lack m SO or m OS neighbours, ``n_zero_distance`` have ``d_OS + d_SO = 0``.
    ``median``, ``f0``, ``ltm`` summarise the defined margins: LTM is the mean of the ``n_tail`` margins
    at or below ``q_alpha``, their alpha-quantile, so ties at the quantile can make the tail hold more
    than alpha of them.
    ``ri``/``mari`` are pooled at ``k``, ``support`` the share of anchors with an SO/OS neighbour in
    their top k, ``ri_samples``/``mari_samples`` the per-anchor shares (NaN outside support), ``tau``
    MaRI's temperature. ``bio_bacc``/``conf_bacc``: k-NN balanced accuracy at ``k`` for the biology
    and the confounder; ``bio_bacc_by_k`` the biological curve over the k's that were scored.
    ``anchors``: None when every sample was scored; else the row positions of the scored anchors,
    and every per-sample array follows them (``sampling.py``: the panel-scale estimator).
    ``ri_parts`` / ``mari_parts``: per-anchor (SO, SO + OS) evidence, which the pooled RI / MaRI are
    ratios of sums of (for bootstrap intervals). ``nearest_so`` / ``nearest_os``: per scored sample,
    the row of its nearest SO and OS neighbour (-1 where it has none) and ``nearest_so_distance`` /
    ``nearest_os_distance`` their cosine distances: the cells a margin is decided by.
    ``mean_so_distance`` / ``mean_os_distance``: per scored sample, the mean cosine distance to its m
    nearest SO and OS neighbours (NaN where unresolved), from which its margin is computed.
    """

    m: int
    k: int
    alpha: float
    margins: np.ndarray
    defined: np.ndarray
    n_unresolved: int
    n_zero_distance: int
    median: float
    f0: float
    ltm: float
    n_tail: int
    q_alpha: float
    ri: float
    mari: float
    support: float
    tau: float
    ri_samples: np.ndarray
    mari_samples: np.ndarray
    bio_bacc: float
    conf_bacc: float
    bio_bacc_by_k: dict[int, float]
    anchors: np.ndarray | None = None
    ri_parts: tuple[np.ndarray, np.ndarray] | None = None
    mari_parts: tuple[np.ndarray, np.ndarray] | None = None
    nearest_so: np.ndarray | None = None
    nearest_os: np.ndarray | None = None
    nearest_so_distance: np.ndarray | None = None
    nearest_os_distance: np.ndarray | None = None
    mean_so_distance: np.ndarray | None = None
    mean_os_distance: np.ndarray | None = None

    @property
    def n_undefined(self) -> int:
        return self.n_unresolved + self.n_zero_distance

    def summary(self) -> dict[str, float | int]:
        """The scalar results, for one row of a model table."""
        return {
            "n_samples": int(len(self.margins)), "n_undefined": self.n_undefined,
            "n_unresolved": self.n_unresolved, "n_zero_distance": self.n_zero_distance,
            "m": self.m, "k": self.k, "alpha": self.alpha, "croma_median": self.median, "f0": self.f0,
            "ltm": self.ltm, "n_tail": self.n_tail, "q_alpha": self.q_alpha, "ri": self.ri, "mari": self.mari,
            "support": self.support, "tau": self.tau, "bio_bacc": self.bio_bacc, "conf_bacc": self.conf_bacc,
        }


def _columns(frame: pd.DataFrame, names: Sequence[str]) -> list[np.ndarray]:
    missing = [name for name in names if name not in frame.columns]
    if missing:
        raise ValueError(f"frame is missing column(s) {missing}; it has {list(frame.columns)}")
    return [frame[name].to_numpy() for name in names]


def _k_values(k: int | None, k_candidates: Sequence[int], n: int) -> list[int]:
    """The k's to score: the fixed k, or the candidates below n."""
    if k is not None:
        if check_at_least_one("k", k) >= n:
            raise ValueError(f"k must be smaller than the number of samples ({n}), got {k}")
        return [int(k)]
    values = [check_at_least_one("k candidate", c) for c in k_candidates]
    below_n = [c for c in values if c < n]
    if not below_n:
        raise ValueError(f"no k candidate is smaller than the number of samples ({n}): {values}")
    return below_n


def score_embeddings(
    features: ArrayLike | RowSource,
    biology: ArrayLike | str,
    confounder: ArrayLike | str,
    group: ArrayLike | str,
    *,
    frame: pd.DataFrame | None = None,
    m: int = 5,
    k: int | None = None,
    k_candidates: Sequence[int] = K_CANDIDATES,
    alpha: float = 0.10,
    tau: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    anchors: np.ndarray | None = None,
    candidate_rows: int = DEFAULT_CANDIDATE_ROWS,
) -> RobustnessScores:
    """Score an (n, d) embedding against per-sample biology, confounder and group labels.

    The labels are arrays of length n, or column names of ``frame`` when it is given. ``m``:
    neighbours averaged per type for CRoMa. ``k``: the fixed neighbourhood of RI, MaRI and the
    k-NN probes; None selects this model's k* (first maximiser of biological k-NN balanced
    accuracy over the ``k_candidates`` below n). ``tau``: MaRI temperature (None = the median
    SO/OS distance at k). Undefined margins are counted in the result, never dropped silently.
    ``anchors`` (row positions): score only those samples, each searched exactly against every
    candidate; the margins, RI, MaRI and k-NN accuracies are then estimates from the anchors
    (``sampling.stratified_anchors`` draws them, ``sampling.bootstrap_intervals`` bounds them).
    ``features`` may be a :class:`~cellpath.robustness.neighbours.RowSource` (a memory-mapped
    store): it is then read ``candidate_rows`` at a time and never held whole.

    Raises:
        ValueError: non-finite features (the error counts the bad rows), label arrays of the wrong
            length or with missing values, a single confounder level, m or k below 1 (or k >= n),
            or no sample with m SO and m OS candidates.
    """
    if frame is not None:
        biology, confounder, group = _columns(frame, [biology, confounder, group])
    unit = feature_rows(features, candidate_rows)
    n = len(unit)
    m = check_at_least_one("m", m)
    alpha = check_fraction("alpha", alpha)
    k_values = _k_values(k, k_candidates, n)
    labels = encode_labels(n, biology, confounder, group)
    check_typed_support(labels, m)

    rows = None if anchors is None else np.asarray(anchors, dtype=np.int64)
    typed, nearest = scan_neighbours(unit, labels.group, labels.biology, labels.confounder, m=m, k=max(k_values),
                                     anchors=rows, chunk_size=chunk_size, candidate_rows=candidate_rows)
    margins = croma_margins(typed.so, typed.os)
    tail = lower_tail(margins.values, alpha)

    return RobustnessScores(
        m=m, alpha=alpha, margins=margins.values, defined=margins.defined,
        n_unresolved=margins.n_unresolved, n_zero_distance=margins.n_zero_distance,
        median=median_margin(margins.values), f0=fraction_non_positive(margins.values),
        ltm=tail.ltm, n_tail=tail.n_tail, q_alpha=tail.q_alpha, anchors=rows,
        nearest_so=typed.so_index[:, 0], nearest_os=typed.os_index[:, 0], nearest_so_distance=typed.so[:, 0],
        nearest_os_distance=typed.os[:, 0], mean_so_distance=margins.d_so, mean_os_distance=margins.d_os,
        **_neighbourhood_scores(nearest, labels, k_values, k is not None, tau, rows),
    )


def _neighbourhood_scores(nearest, labels, k_values: list[int], fixed_k: bool, tau: float | None,
                          rows: np.ndarray | None) -> dict:
    """RI, MaRI and the k-NN probes at the k used: the fixed k, or the first maximiser of the
    biological k-NN balanced accuracy over ``k_values`` (k*)."""
    bio_curve = knn_balanced_accuracy(nearest.index, nearest.distance, labels.biology, k_values, rows)
    k_used = k_values[0] if fixed_k else select_k(bio_curve, k_values)
    ri = robustness_index(nearest.index, nearest.distance, labels.biology, labels.confounder, k_used, rows)
    mari = margin_aware_robustness_index(
        nearest.index, nearest.distance, labels.biology, labels.confounder, k_used, tau, rows
    )
    return {"k": k_used, "ri": ri.value, "mari": mari.value, "support": ri.support, "tau": mari.tau,
            "ri_samples": ri.samples, "mari_samples": mari.samples, "bio_bacc": bio_curve[k_used],
            "conf_bacc": knn_balanced_accuracy(nearest.index, nearest.distance, labels.confounder, [k_used],
                                               rows)[k_used],
            "bio_bacc_by_k": bio_curve, "ri_parts": (ri.so_weight, ri.typed_weight),
            "mari_parts": (mari.so_weight, mari.typed_weight)}


def low_margin_enrichment(
    margins: ArrayLike,
    frame: pd.DataFrame,
    columns: Sequence[str] = ("cell_type", "organ", "section"),
    fraction: float = 0.10,
) -> pd.DataFrame:
    """Which categories fill the worst ``fraction`` of defined margins, and by how much.

    Low-margin samples are the defined margins at or below their ``fraction``-percentile (the
    LTM rule). Per column and category: ``n_low`` (low-margin samples), ``n_defined`` (defined
    samples), ``share_low`` (share among low-margin samples), ``share_all`` (share among defined
    samples) and ``enrichment = share_low / share_all``; sorted by column, then enrichment.
    Samples with undefined (NaN) margins are left out of both shares. The threshold is in
    ``result.attrs["threshold"]``.
    """
    values = np.asarray(margins, dtype=float)
    if values.ndim != 1 or len(values) != len(frame):
        raise ValueError(f"margins must be 1-D with one value per frame row ({len(frame)}), got shape {values.shape}")
    fraction = check_fraction("fraction", fraction)
    defined = np.isfinite(values)
    if not defined.any():
        raise ValueError("no margin is defined; there is no low-margin tail to describe")
    threshold = float(np.percentile(values[defined], fraction * 100))
    low = defined & (values <= threshold)
    tables = []
    for name, column in zip(columns, _columns(frame, columns)):
        counts = pd.DataFrame({"category": column[defined], "low": low[defined]}).groupby("category", sort=True)["low"]
        table = pd.DataFrame({"n_low": counts.sum().astype(int), "n_defined": counts.size()}).reset_index()
        table.insert(0, "column", name)
        tables.append(table)
    result = pd.concat(tables, ignore_index=True)
    result["share_low"] = result["n_low"] / int(low.sum())
    result["share_all"] = result["n_defined"] / int(defined.sum())
    result["enrichment"] = result["share_low"] / result["share_all"]
    order = {name: position for position, name in enumerate(columns)}
    result = result.sort_values(["column", "enrichment"], key=lambda s: s.map(order) if s.name == "column" else -s)
    result = result.reset_index(drop=True)
    result.attrs["threshold"] = threshold
    return result
