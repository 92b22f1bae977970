"""How much the model comparison depends on CRoMa's m and LTM's α (CRoMa paper, Supplementary A.2
and A.3, Tables S1 and S2). Optional analyses (``robustness.sensitivity``).

- α (Table S1): "we recompute LTM_α per model at α ∈ {0.05, 0.10, 0.20} from the per-sample
  CRoMa(m=5) values, rank the models, and measure the Spearman rank correlation between the
  rankings induced by different α" — here at every pair of the configured α's.
- m (Table S2): "we take the pooled CRoMa per model at every integer m ∈ [1, 20] and track both the
  ranking and the number of confounder-dominant models (CRoMa < 0)"; the Spearman correlations are
  "between the median CRoMa model rankings at the headline radius m = 5 and each extreme (m = 1,
  m = 20), and between the two extremes". One typed-neighbour search at the largest m serves every
  m: CRoMa_m averages the m nearest distances of each type, a prefix of the sorted search result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from cellpath.robustness.agreement import spearman
from cellpath.robustness.metrics import croma_margins, fraction_non_positive, lower_tail, median_margin
from cellpath.robustness.neighbours import DEFAULT_CANDIDATE_ROWS, DEFAULT_CHUNK_SIZE, RowSource, typed_neighbours
from cellpath.robustness.validation import check_at_least_one, check_typed_support, encode_labels, feature_rows

#: One sweep row: ``n_tail`` is how many margins LTM averages (those at or below its quantile).
SWEEP_COLUMNS = ["parameter", "value", "croma_median", "f0", "ltm", "n_tail", "n_undefined"]


def margin_sweep(features: ArrayLike | RowSource, biology: ArrayLike, confounder: ArrayLike, group: ArrayLike,
                 m_values: Sequence[int], alpha: float = 0.10, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 anchors: np.ndarray | None = None, candidate_rows: int = DEFAULT_CANDIDATE_ROWS) -> pd.DataFrame:
    """Median CRoMa_m, F(0) and LTM_alpha (with its ``n_tail``) at each m of ``m_values`` (rows in the order given),
    over every sample or over ``anchors`` (row positions, searched against every candidate).

    A sample without m neighbours of a type is undefined at that m (counted in ``n_undefined``);
    raises ValueError when no sample has ``max(m_values)`` of each type."""
    m_values = [check_at_least_one("m", m) for m in m_values]
    if not m_values:
        raise ValueError("m_values is empty")
    unit = feature_rows(features, candidate_rows)
    labels = encode_labels(len(unit), biology, confounder, group)
    largest = max(m_values)
    check_typed_support(labels, largest)
    typed = typed_neighbours(unit, labels.biology, labels.confounder, labels.group, largest, chunk_size,
                             anchors=anchors, candidate_rows=candidate_rows)
    rows = []
    for m in m_values:
        margins = croma_margins(typed.so[:, :m], typed.os[:, :m])
        tail = lower_tail(margins.values, alpha)
        rows.append({"parameter": "m", "value": float(m), "croma_median": median_margin(margins.values),
                     "f0": fraction_non_positive(margins.values), "ltm": tail.ltm, "n_tail": tail.n_tail,
                     "n_undefined": margins.n_undefined})
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS)


def tail_sweep(margins: ArrayLike, alphas: Sequence[float]) -> pd.DataFrame:
    """LTM (with its ``n_tail``) at each α of ``alphas`` from one set of per-sample margins (NaN =
    undefined, counted)."""
    values = np.asarray(margins, dtype=float)
    n_undefined = int(np.sum(~np.isfinite(values)))
    median, f0 = median_margin(values), fraction_non_positive(values)
    tails = [lower_tail(values, alpha) for alpha in alphas]
    return pd.DataFrame([{"parameter": "alpha", "value": float(tail.alpha), "croma_median": median, "f0": f0,
                          "ltm": tail.ltm, "n_tail": tail.n_tail, "n_undefined": n_undefined} for tail in tails],
                        columns=SWEEP_COLUMNS)


def _comparisons(parameter: str, values: Sequence[float], headline: float) -> list[tuple[float, float]]:
    """Which settings are compared: every pair of α's; for m, the headline with each extreme and the extremes."""
    ordered = sorted(set(values))
    if parameter == "alpha":
        return [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:]]
    low, high = ordered[0], ordered[-1]
    pairs = [(headline, low), (headline, high), (low, high)] if headline in ordered else [(low, high)]
    return [(a, b) for a, b in dict.fromkeys(pairs) if a != b]


def sensitivity_agreement(sweep: pd.DataFrame, condition: Sequence[str], headline_m: int) -> pd.DataFrame:
    """Spearman ρ across models between the rankings at two settings, per condition and parameter.

    ``sweep``: one row per (model, condition, parameter, value) with ``croma_median`` and ``ltm``.
    The α comparisons rank LTM, the m comparisons median CRoMa. ``n_negative_x`` / ``_y``: models
    whose ranked statistic is below 0 at each setting (for m: the confounder-dominant models).
    ``n_negative_min`` / ``_max``: their fewest and most over every value of the sweep."""
    statistic = {"alpha": "ltm", "m": "croma_median"}
    rows = []
    for keys, group in sweep.groupby([*condition, "parameter"], sort=True):
        *condition_values, parameter = keys
        column = statistic[parameter]
        table = group.pivot(index="model", columns="value", values=column)
        negative = (table < 0).sum(axis=0)
        for a, b in _comparisons(parameter, list(table.columns), float(headline_m)):
            rho, n = spearman(table[a].to_numpy(), table[b].to_numpy())
            rows.append({**dict(zip(condition, condition_values)), "parameter": parameter, "statistic": column,
                         "x": a, "y": b, "rho": rho, "n_models": n, "n_negative_x": int(negative[a]),
                         "n_negative_y": int(negative[b]), "n_negative_min": int(negative.min()),
                         "n_negative_max": int(negative.max())})
    return pd.DataFrame(rows, columns=[*condition, "parameter", "statistic", "x", "y", "rho", "n_models",
                                       "n_negative_x", "n_negative_y", "n_negative_min", "n_negative_max"])
