"""What the expression stage reports from its run table: protocol-balanced means with intervals, the
expression CRA (Nuc − Mean) and significant wins — the type probes' statistics (``probing.stats``),
unchanged, on mean Pearson r — the per-gene r across runs, and the headline numbers for
``dvc metrics show``.

The run table carries ``taxonomy = EXPRESSION_TARGET`` so that it has the type probes' condition
keys; r is reported as is (not in percentage points).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from cellpath.probing import stats
from cellpath.vocabulary import EXPRESSION_TARGET, HEADLINE_READOUT, PROTOCOL_LABELS, PROTOCOLS, headline_magnification

#: The per-run scores summarised: features, type alone, type + features, and the gains over the type.
METRICS = ("mean_pearson", "mean_pearson_type", "mean_pearson_type_features", "gain_features_over_type",
           "gain_type_features_over_type", "mean_spearman", "share_r_above")
CONDITION_KEYS = ["model", "protocol", "magnification", "readout", "taxonomy"]
#: expression_metrics.json's entry for the regression from the transferred Tfine label alone
TYPE_ENTRY = "type label (Tfine)"


def summarise(runs: pd.DataFrame, genes: pd.DataFrame, magnifications: list[str]) -> dict[str, pd.DataFrame]:
    """``summary`` (balanced mean, SD, 95 % interval per condition and metric), ``wins`` (paired
    Wilcoxon on mean Pearson r, with Holm), ``cra`` (Nuc − Mean of mean Pearson r per magnification,
    with its interval and wins) and ``genes`` (per model, magnification, readout and gene: r averaged
    over the runs that scored it)."""
    ok = runs[runs["status"] == "ok"]
    summary = pd.concat([stats.protocol_summary(ok, m).assign(metric=m) for m in METRICS], ignore_index=True)
    wins = stats.win_counts(ok, "mean_pearson").assign(metric="mean_pearson")
    cra = pd.concat([stats.pooled_cell_representation_advantage(ok, "mean_pearson", mag).assign(metric="mean_pearson")
                     for mag in magnifications], ignore_index=True)
    return {"summary": summary, "wins": wins, "cra": cra, "gene_summary": gene_summary(genes)}


def gene_summary(genes: pd.DataFrame) -> pd.DataFrame:
    """Per (model, magnification, readout, protocol, gene): mean Pearson r from the features, the type and
    both over the runs that scored the gene, and how many runs did (genes without an r are not averaged)."""
    keys = ["model", "magnification", "readout", "protocol", "gene"]
    columns = [*keys, "pearson", "pearson_type", "pearson_type_features", "n_runs"]
    if genes.empty:
        return pd.DataFrame(columns=columns)
    grouped = genes.groupby(keys, sort=True)
    table = grouped[["pearson", "pearson_type", "pearson_type_features"]].mean()
    return table.assign(n_runs=grouped["pearson"].count()).reset_index()[columns]


def _rounded(value: float | None) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), 4)


def headline_metrics(summaries: dict[str, pd.DataFrame], magnifications: list[str]) -> dict:
    """``reports/expression_metrics.json``: at the headline magnification and readout, per model the mean
    Pearson r per protocol (``IS r``, …) with its 95 % interval (``IS r_ci95``; a list, which ``dvc exp
    show`` shows as no column) and the expression CRA (``CRA r``, Nuc − Mean); and once, under
    ``TYPE_ENTRY``, r from the transferred type alone (the same for every model: no model enters it), so
    that a model's gain over the type is the difference of the two. Keys of what was not computed are
    left out; the gains, SDs and the other metrics are in ``expression/summary.csv``."""
    headline = headline_magnification(magnifications)
    summary = summaries["summary"]
    chosen = summary[(summary["readout"] == HEADLINE_READOUT) & (summary["magnification"] == headline)]
    cra = summaries["cra"]
    cra = cra[cra["magnification"] == headline].set_index("model")
    metrics: dict = {"magnification": headline, "readout": HEADLINE_READOUT}
    models = sorted(chosen["model"].unique())
    for model in models:
        mine = chosen[chosen["model"] == model]
        entry: dict = {}
        for protocol in PROTOCOLS:
            rows = mine[mine["protocol"] == protocol].set_index("metric")
            label = PROTOCOL_LABELS[protocol]
            if "mean_pearson" in rows.index:
                entry[f"{label} r"] = _rounded(rows.at["mean_pearson", "mean"])
                ends = [_rounded(rows.at["mean_pearson", "low"]), _rounded(rows.at["mean_pearson", "high"])]
                entry[f"{label} r_ci95"] = None if None in ends else ends
        if model in cra.index:
            entry["CRA r"] = _rounded(cra.at[model, "cra"])
        metrics[model] = {key: value for key, value in entry.items() if value is not None}
    if models:
        typed = chosen[(chosen["model"] == models[0]) & (chosen["metric"] == "mean_pearson_type")].set_index("protocol")
        metrics[TYPE_ENTRY] = {f"{PROTOCOL_LABELS[p]} r": _rounded(typed.at[p, "mean"])
                               for p in PROTOCOLS if p in typed.index}
    return metrics


def condition_name(part: pd.DataFrame) -> str:
    """One MLflow run's name: ``expression <model> <protocol> <magnification> <readout>``."""
    first = part.iloc[0]
    return " ".join(["expression", *(str(first[key]) for key in CONDITION_KEYS if key != "taxonomy")])


def condition_metrics(part: pd.DataFrame) -> dict[str, float]:
    """One (model, magnification, readout, protocol)'s MLflow metrics, the same names for every model:
    each metric's balanced mean, SD and interval, and the run counts."""
    fitted = part[part["status"] == "ok"]
    metrics = {"runs_ok": float(len(fitted)), "runs_skipped": float((part["status"] == "skipped").sum()),
               "cells_excluded_low_counts": float(part["n_excluded_low_counts"].sum())}
    for metric in METRICS:
        summary = stats.protocol_summary(fitted, metric)
        if len(summary):
            for key, column in ((metric, "mean"), (f"{metric}_sd", "sd"), (f"{metric}_low", "low"),
                                (f"{metric}_high", "high")):
                value = float(summary[column].iloc[0])
                if np.isfinite(value):
                    metrics[key] = value
    return metrics


def expression_runs(rows: pd.DataFrame, model: str, magnification: str, readout: str) -> pd.DataFrame:
    """A feature source's run rows with the condition keys the statistics group by."""
    return rows.assign(model=model, magnification=magnification, readout=readout, taxonomy=EXPRESSION_TARGET)
