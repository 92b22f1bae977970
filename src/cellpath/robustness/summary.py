"""What the robustness stage reports from its scored conditions: condition names and metrics for
MLflow, ``robustness_metrics.json`` and the sensitivity table. Pure: tables in, tables and dicts out
(robustness scores are fractions, as the report's robustness table shows them)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cellpath.robustness.sensitivity import SWEEP_COLUMNS
from cellpath.vocabulary import HEADLINE_READOUT, HEADLINE_TAXONOMY

#: The summary columns of one scored condition that are its headline results.
SUMMARY_KEYS = ("croma_median", "f0", "ltm", "ri", "mari", "bio_bacc", "conf_bacc")
#: The keys that, with the model, name one scored condition.
CONDITION_KEYS = ("magnification", "readout", "taxonomy", "scope", "unit")
#: Summary columns that describe the condition or its settings (MLflow params), not a result.
SETTING_KEYS = ("model", *CONDITION_KEYS, "confounder", "m", "k", "alpha")
#: ``robustness_metrics.json`` keys: the report's names for the summary columns.
METRIC_LABELS = {"croma_median": "CRoMa median", "f0": "F(0)", "ltm": "LTM10", "ri": "RI", "mari": "MaRI",
                 "bio_bacc": "k-NN BAcc biology", "conf_bacc": "k-NN BAcc confounder"}
#: ``robustness_metrics.json``'s key for how many margins LTM averages (ties at its quantile included).
N_TAIL_LABEL = "LTM10 n_tail"
#: The shortcut probe's tables when it is switched off (``robustness.shortcut.enabled: false``).
SHORTCUT_CURVE_COLUMNS = ["model", "setting", "cramers_v", "balanced_accuracy_mean", "balanced_accuracy_sd"]
SHORTCUT_SUMMARY_COLUMNS = ["model", "setting", "readout", "taxonomy", "magnification", "confounder", "n_runs", "apd",
                            "nipd", "nipd_low", "nipd_high"]


def condition_name(row: dict) -> str:
    """The name of one scored condition: model, magnification, readout, taxonomy, then the scope and
    unit where they say more than ``panel``."""
    parts = [row["model"], row["magnification"], row["readout"], row["taxonomy"]]
    return " ".join(parts + ([] if row["scope"] == row["unit"] == "panel" else [row["scope"], row["unit"]]))


def condition_metrics(row: dict, shortcut_summary: pd.DataFrame) -> dict[str, float]:
    """A scored condition's MLflow metrics, as fractions like the report's robustness table: CRoMa
    median, F(0), LTM, RI, MaRI with their anchor intervals (``<metric>_low`` / ``_high``, absent
    when every cell was scored), the k-NN probes, counts and the model's own k*. On the condition the
    shortcut probe was fitted on (same model, magnification, readout, taxonomy, confounder, panel
    scope; as the report pairs them) also its nIPD with the bootstrap interval and APD per setting
    (``nipd_held_out``, ``nipd_held_out_low``, ``apd_held_out``, …)."""
    metrics = {key: float(value) for key, value in row.items()
               if key not in SETTING_KEYS and isinstance(value, (int, float, np.number)) and not isinstance(value, bool)}
    if row["scope"] == "panel" and len(shortcut_summary):
        mine = shortcut_summary[np.logical_and.reduce([shortcut_summary[key] == row[key] for key in
                                                       ("model", "magnification", "readout", "taxonomy", "confounder")])]
        for entry in mine.itertuples():  # setting: in_domain or held_out
            metrics |= {f"nipd_{entry.setting}": float(entry.nipd), f"nipd_{entry.setting}_low": float(entry.nipd_low),
                        f"nipd_{entry.setting}_high": float(entry.nipd_high), f"apd_{entry.setting}": float(entry.apd)}
    return {key: value for key, value in metrics.items() if np.isfinite(value)}


def robustness_metrics(summary: pd.DataFrame, shortcut: pd.DataFrame, magnification: str) -> dict:
    """``robustness_metrics.json`` for ``dvc metrics show``: per model, panel-scope Tfine Nuc
    summaries at the headline magnification and the shortcut probe's nIPD, under the report's names
    (``CRoMa median``, ``F(0)``, ``LTM10``, ``RI``, ``MaRI``, ``nIPD held out``, …), as fractions
    like the report's robustness table, 4 decimals; beside LTM10 the count of margins it averages
    (``LTM10 n_tail``: every margin at or below the 10 % quantile, so more than 10 % with ties)."""
    chosen = summary[(summary["scope"] == "panel") & (summary["magnification"] == magnification)
                     & (summary["readout"] == HEADLINE_READOUT) & (summary["taxonomy"] == HEADLINE_TAXONOMY)]
    metrics: dict = {"magnification": magnification}
    for row in chosen.itertuples():
        values: dict = {}
        for key in SUMMARY_KEYS:
            if np.isfinite(getattr(row, key)):
                values[METRIC_LABELS[key]] = round(float(getattr(row, key)), 4)
            if key == "ltm":
                values[N_TAIL_LABEL] = int(row.n_tail)
        metrics[row.model] = values
    for row in shortcut.itertuples() if len(shortcut) else []:
        if np.isfinite(row.nipd):
            metrics.setdefault(row.model, {})[f"nIPD {row.setting.replace('_', ' ')}"] = round(float(row.nipd), 4)
    return metrics


def sensitivity_table(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The α and m sweep rows of every shard (empty, with its columns, when the sweeps are off)."""
    columns = ["model", *CONDITION_KEYS, *SWEEP_COLUMNS]
    frames = [frame for frame in frames if len(frame)]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)
