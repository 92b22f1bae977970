"""Robustness at panel scale: exact scores for a stratified sample of anchors, with bootstrap intervals.

Scoring every cell is an exact search per cell, O(n²·d) per condition: about 3 minutes at 128k
cells on 2 cores, and about 3,000× that at the paper's 7M. Above a size threshold the stage
therefore scores a sample of anchors instead.
- The anchors are drawn per (biology × confounder) cell, in proportion to its size (largest
  remainders, at least one anchor per non-empty cell), uniformly within it.
- Each anchor's margin and neighbourhood is exact: it is searched against *all* candidates, not
  against the sample.
- The summaries (median, F(0), LTM, RI, MaRI) are estimates of the full-panel values.
- Their 95 % intervals come from a stratified bootstrap: the anchors are resampled with
  replacement within each cell, and percentile intervals are taken.

RI and MaRI are ratios of pooled sums, so the bootstrap resamples each anchor's (SO, SO + OS)
evidence (``RobustnessScores.ri_parts``) and recomputes the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cellpath.robustness.metrics import fraction_non_positive, lower_tail, median_margin
from cellpath.robustness.table import RobustnessScores

#: summaries a bootstrap interval is given for, in ``RobustnessScores.summary`` names
INTERVAL_METRICS = ("croma_median", "f0", "ltm", "ri", "mari")


@dataclass(frozen=True)
class Interval:
    """A percentile bootstrap interval (``level``, e.g. 0.95) from ``n_boot`` resamples."""

    low: float
    high: float
    level: float
    n_boot: int


def stratified_anchors(strata: np.ndarray, n_anchors: int, seed: int) -> np.ndarray:
    """Sorted row positions of ``n_anchors`` anchors drawn per stratum in proportion to its size
    (largest remainders; every non-empty stratum at least one when ``n_anchors`` allows), uniformly
    without replacement within each. All rows when ``n_anchors`` ≥ the number of rows."""
    strata = np.asarray(strata)
    n = len(strata)
    if n_anchors >= n:
        return np.arange(n)
    levels, codes, sizes = np.unique(strata, return_inverse=True, return_counts=True)
    exact = sizes * n_anchors / n
    quota = np.floor(exact).astype(np.int64)
    if n_anchors >= len(levels):
        quota = np.maximum(quota, 1)
    remaining = n_anchors - int(quota.sum())
    if remaining > 0:
        order = np.lexsort((np.arange(len(levels)), -(exact - np.floor(exact))))
        room = order[quota[order] < sizes[order]]
        quota[room[:remaining]] += 1
    elif remaining < 0:  # the at-least-one floor overshot: take back from the largest quotas
        for level in np.argsort(-quota, kind="stable")[:-remaining]:
            quota[level] -= 1
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(np.flatnonzero(codes == level), size=int(q), replace=False)
              for level, q in enumerate(quota) if q > 0]
    return np.sort(np.concatenate(chosen))


def _summaries(margins: np.ndarray, ri: tuple[np.ndarray, np.ndarray], mari: tuple[np.ndarray, np.ndarray],
               alpha: float) -> dict[str, float]:
    """The five summaries of a set of anchors (margins NaN where undefined), as ``score_embeddings`` computes them."""
    out = {"croma_median": median_margin(margins), "f0": fraction_non_positive(margins),
           "ltm": lower_tail(margins, alpha).ltm}
    for name, (so, typed) in (("ri", ri), ("mari", mari)):
        total = typed.sum()
        out[name] = float(so.sum() / total) if total > 0 else 0.5
    return out


def bootstrap_intervals(scores: RobustnessScores, strata: np.ndarray, *, n_boot: int = 200, seed: int = 0,
                        level: float = 0.95) -> dict[str, Interval]:
    """Percentile intervals on median, F(0), LTM, RI and MaRI from a stratified bootstrap of the
    anchors (``strata``: each anchor's (biology, confounder) cell, aligned with ``scores.margins``)."""
    strata = np.asarray(strata)
    if len(strata) != len(scores.margins):
        raise ValueError(f"strata has {len(strata)} rows, the scores {len(scores.margins)} anchors")
    _, codes = np.unique(strata, return_inverse=True)
    order = np.argsort(codes, kind="stable")  # anchors grouped by stratum
    sizes = np.bincount(codes)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    rng = np.random.default_rng(seed)
    draws = {name: np.empty(n_boot) for name in INTERVAL_METRICS}
    for b in range(n_boot):
        pick = order[np.repeat(starts, sizes) + (rng.random(len(order)) * np.repeat(sizes, sizes)).astype(np.int64)]
        values = _summaries(scores.margins[pick], tuple(p[pick] for p in scores.ri_parts),
                            tuple(p[pick] for p in scores.mari_parts), scores.alpha)
        for name in INTERVAL_METRICS:
            draws[name][b] = values[name]
    tail = 100 * (1 - level) / 2
    return {name: Interval(float(np.nanpercentile(v, tail)), float(np.nanpercentile(v, 100 - tail)), level, n_boot)
            for name, v in draws.items()}
