"""Across-model rank agreement of the robustness metrics (CRoMa paper, Supplementary A.6 and A.10).

Per condition (magnification, readout, taxonomy, confounder; panel scope), Spearman ρ across the
models between:

- each pair of RI, MaRI and median CRoMa (Table S4: "the three metrics induce nearly identical
  model orderings");
- each representation metric (median CRoMa, F(0), LTM, RI, MaRI) and the shortcut probe's nIPD,
  in domain and held out, where the probe ran on that same condition (Table S8: "Positive values
  indicate that more robust representations undergo less degradation"), and median CRoMa against
  PathoROB's APD;
- the confounder k-NN balanced accuracy and median CRoMa (how decodable the acquisition batch is
  against how far biology dominates the neighbourhoods).

ρ is undefined (NaN) with fewer than three models, or when a metric is constant across them;
``n_models`` says how many entered each value. F(0) is a failure fraction (lower is more robust),
so its ρ with nIPD is expected to be negative.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

METRIC_PAIRS = tuple(itertools.combinations(("ri", "mari", "croma_median"), 2))
VERSUS_NIPD = ("croma_median", "f0", "ltm", "ri", "mari")
CONDITION = ["magnification", "readout", "taxonomy", "confounder"]
MIN_MODELS = 3


def spearman(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Spearman ρ over the pairs where both are finite, and their number (ρ NaN below MIN_MODELS)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    both = np.isfinite(a) & np.isfinite(b)
    n = int(both.sum())
    if n < MIN_MODELS or np.ptp(a[both]) == 0 or np.ptp(b[both]) == 0:
        return float("nan"), n
    return float(scipy_stats.spearmanr(a[both], b[both]).statistic), n


def metric_agreement(summary: pd.DataFrame, shortcut: pd.DataFrame) -> pd.DataFrame:
    """One row per (condition, metric pair): ``x``, ``y``, ``rho``, ``n_models``.

    ``summary``: the robustness summary (one row per model and condition, with ``confounder``);
    ``shortcut``: the shortcut summary (model, setting, magnification, readout, taxonomy,
    confounder, apd, nipd). Only panel-scope rows are used: the shortcut probe is panel-wide."""
    panel = summary[(summary["scope"] == "panel") & (summary["unit"] == "panel")]
    rows = []
    for condition, group in panel.groupby(CONDITION, sort=True):
        keys = dict(zip(CONDITION, condition))
        by_model = group.set_index("model")
        pairs = [(x, y, by_model[x], by_model[y]) for x, y in METRIC_PAIRS]
        pairs.append(("conf_bacc", "croma_median", by_model["conf_bacc"], by_model["croma_median"]))
        matching = shortcut
        for key, value in keys.items():
            matching = matching[matching[key] == value] if key in matching.columns else matching.iloc[0:0]
        for setting, part in matching.groupby("setting", sort=True):
            nipd = part.set_index("model")["nipd"].reindex(by_model.index)
            pairs += [(metric, f"nipd_{setting}", by_model[metric], nipd) for metric in VERSUS_NIPD]
            pairs.append(("croma_median", f"apd_{setting}", by_model["croma_median"],
                          part.set_index("model")["apd"].reindex(by_model.index)))
        for x, y, a, b in pairs:
            rho, n = spearman(a.to_numpy(), b.to_numpy())
            rows.append({**keys, "x": x, "y": y, "rho": rho, "n_models": n})
    return pd.DataFrame(rows, columns=[*CONDITION, "x", "y", "rho", "n_models"])
