"""What the probe stage reports from its run table: the paper's summaries, the run counts, the
headline numbers of ``reports/metrics.json`` and the per-condition comparisons MLflow shows.

Everything here is pure: the run table (``probing.plan.RUN_COLUMNS``, scores as fractions) goes
in, tables and dicts come out; scores for people (metrics.json, MLflow) are percentage points.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from cellpath.probing import stats
from cellpath.runtime.tracking import metric_key
from cellpath.vocabulary import (CROSS_DOMAIN_PROTOCOLS, HEADLINE_READOUT, HEADLINE_TAXONOMY, PROTOCOL_LABELS,
                                 PROTOCOLS, headline_magnification)

#: The per-run scores every summary is computed for.
METRICS = ("macro_f1", "macro_auroc", "macro_auprc")
#: Scores for people (metrics.json, MLflow) are in percentage points, as the report shows them.
PERCENT = 100.0
#: The keys that name one comparable condition (an MLflow run).
CONDITION_KEYS = ["model", "protocol", "magnification", "readout", "taxonomy"]


def summarise(runs: pd.DataFrame, magnifications: list[str], panels: dict[str, list[str]]) -> dict[str, pd.DataFrame]:
    """The paper's summaries of a run table (``probing.stats``), computed on the fitted runs:
    ``summary``, ``wins``, ``crt``, ``cra``, ``cra_pooled``, ``rank_agreement``, ``is_panels``,
    ``cra_panels``. ``panels``: the nested panels within the evaluated one (name → section ids)."""
    ok = runs[runs["status"] == "ok"]
    summary = pd.concat([stats.protocol_summary(ok, m).assign(metric=m) for m in METRICS], ignore_index=True)
    wins = pd.concat([stats.win_counts(ok, m).assign(metric=m) for m in METRICS], ignore_index=True)
    headline = headline_magnification(magnifications)
    crt = stats.cell_representation_transferability(wins[wins["metric"] == "macro_f1"], magnification=headline)
    cra = pd.concat([stats.cell_representation_advantage(ok, m).assign(metric=m) for m in METRICS],
                    ignore_index=True)
    cra_pooled = pd.concat([stats.pooled_cell_representation_advantage(ok, m, mag).assign(metric=m)
                            for m in METRICS for mag in magnifications], ignore_index=True)
    is_panels, cra_panels = stats.nested_panel_tables(ok, panels, METRICS)
    agreement = pd.DataFrame([
        {"protocol": p, "readout": HEADLINE_READOUT, "magnification": headline,
         "spearman": stats.taxonomy_rank_agreement(summary[summary["metric"] == "macro_f1"], protocol=p,
                                                   magnification=headline)}
        for p in sorted(ok["protocol"].unique())])
    return {"summary": summary, "wins": wins, "crt": crt, "cra": cra, "cra_pooled": cra_pooled,
            "rank_agreement": agreement, "is_panels": is_panels, "cra_panels": cra_panels}


def run_counts(runs: pd.DataFrame, unavailable: dict[str, int]) -> dict:
    """Per protocol and in total: runs fitted (``ok``), ``skipped`` (fewer than two gated classes),
    structurally ``unavailable`` (given) and fitted but ``not_converged``."""
    counts = {}
    for protocol in unavailable:
        part = runs[runs["protocol"] == protocol]
        fitted = part[part["status"] == "ok"]
        counts[protocol] = {"ok": len(fitted), "skipped": int((part["status"] == "skipped").sum()),
                            "unavailable": unavailable[protocol],
                            "not_converged": int((~fitted["converged"].astype(bool)).sum())}
    counts["total"] = {k: sum(c[k] for c in counts.values()) for k in ("ok", "skipped", "unavailable", "not_converged")}
    return counts


def points(value: float | None) -> float | None:
    """A fraction as percentage points, 2 decimals, as the report shows it (None when undefined)."""
    return None if value is None or not np.isfinite(value) else round(PERCENT * float(value), 2)


def _interval(low: float, high: float) -> list[float] | None:
    """A [low, high] interval in percentage points (None when undefined)."""
    ends = [points(low), points(high)]
    return None if None in ends else ends


def headline_metrics(runs: pd.DataFrame, summaries: dict[str, pd.DataFrame], magnifications: list[str]) -> dict:
    """``reports/metrics.json`` for ``dvc metrics show`` / ``dvc exp show``: the report's headline
    table without its SDs. Per model: Tfine Nuc Macro-F1 (pp) per protocol at the headline
    magnification (``IS``, ``IOCD``, ``MOCV``, ``LOOO``), ``CRA`` (pp, Eq. 4, taxonomies pooled) and
    ``CRT``, and each mean's 95% bootstrap interval as a ``[low, high]`` list (``IS_ci95``, …,
    ``CRA_ci95``; DVC shows no lists, so they add no columns to ``dvc exp show``). Keys of what was
    not computed are left out. Run counts are in ``probe/counts.json``."""
    headline = headline_magnification(magnifications)
    summary = summaries["summary"]
    chosen = summary[(summary["readout"] == HEADLINE_READOUT) & (summary["taxonomy"] == HEADLINE_TAXONOMY)
                     & (summary["magnification"] == headline) & (summary["metric"] == "macro_f1")]
    cra = summaries["cra_pooled"]
    cra = cra[(cra["magnification"] == headline) & (cra["metric"] == "macro_f1")].set_index("model")
    crt = summaries["crt"].set_index("model")["crt"] if len(summaries["crt"]) else pd.Series(dtype=float)
    metrics: dict = {"magnification": headline}
    for model in sorted(runs["model"].unique()):
        mine = chosen[chosen["model"] == model].set_index("protocol")
        entry = {PROTOCOL_LABELS[p]: points(mine.at[p, "mean"]) for p in PROTOCOLS if p in mine.index}
        entry |= {"CRA": points(cra["cra"].get(model)), "CRT": None if not np.isfinite(crt.get(model, np.nan))
                  else round(float(crt[model]), 2)}
        intervals = {f"{PROTOCOL_LABELS[p]}_ci95": _interval(mine.at[p, "low"], mine.at[p, "high"])
                     for p in PROTOCOLS if p in mine.index}
        if model in cra.index:
            intervals["CRA_ci95"] = _interval(cra.at[model, "low"], cra.at[model, "high"])
        metrics[model] = {key: value for key, value in (entry | intervals).items() if value is not None}
    return metrics


def condition_name(part: pd.DataFrame) -> str:
    """The name of one comparable condition: ``<model> <protocol> <magnification> <readout> <taxonomy>``."""
    first = part.iloc[0]
    return " ".join(str(first[key]) for key in CONDITION_KEYS)


def condition_metrics(part: pd.DataFrame) -> dict[str, float]:
    """One condition's balanced summary (percentage points), run counts and seed-averaged Macro-F1 per
    unit: ``macro_f1``, ``macro_f1_sd``, its 95% bootstrap interval ``macro_f1_low`` / ``_high``,
    ``n_units``, ``runs_ok``, ``unit/<section>/macro_f1``, …"""
    fitted = part[part["status"] == "ok"]
    metrics: dict[str, float] = {"runs_ok": float(len(fitted)),
                                 "runs_skipped": float((part["status"] == "skipped").sum()),
                                 "runs_not_converged": float((~fitted["converged"].astype(bool)).sum())}
    for metric in METRICS:
        summary = stats.protocol_summary(part, metric)
        if len(summary):
            for key, column in ((metric, "mean"), (f"{metric}_sd", "sd"), (f"{metric}_low", "low"),
                                (f"{metric}_high", "high")):
                metrics[key] = PERCENT * float(summary[column].iloc[0])
            metrics["n_units"] = float(summary["n_units"].iloc[0])
    for row in stats.unit_scores(part, "macro_f1").itertuples():
        metrics[metric_key("unit", row.unit, "macro_f1")] = PERCENT * float(row.score)
    return metrics


def comparison_metrics(runs: pd.DataFrame, summaries: dict[str, pd.DataFrame],
                       magnifications: list[str]) -> dict[str, dict[str, float]]:
    """Per condition name, what needs every model: significant wins per metric (``wins_macro_f1``,
    …; Wilcoxon over paired units, out of the other models), for IS the CRA of its magnification
    and taxonomy (``cra_macro_f1``, pp, and ``cra_wins``), and CRT on the headline condition's
    cross-domain protocols (Tfine, Nuc, headline magnification)."""
    out: dict[str, dict[str, float]] = {" ".join(map(str, row)): {}
                                        for row in runs[CONDITION_KEYS].drop_duplicates().itertuples(index=False)}
    for row in summaries["wins"].itertuples():
        name = " ".join(str(getattr(row, key)) for key in CONDITION_KEYS)
        if name in out:
            out[name][f"wins_{row.metric}"] = float(row.wins)
            out[name][f"wins_holm_{row.metric}"] = float(row.wins_holm)
    cra = summaries["cra"]
    for row in cra[cra["metric"] == "macro_f1"].itertuples():
        name = f"{row.model} is {row.magnification} {HEADLINE_READOUT} {row.taxonomy}"
        if name in out:
            out[name] |= {"cra_macro_f1": PERCENT * float(row.cra), "cra_wins": float(row.wins)}
    headline = headline_magnification(magnifications)
    for row in summaries["crt"].itertuples():
        for protocol in CROSS_DOMAIN_PROTOCOLS:
            name = f"{row.model} {protocol} {headline} {HEADLINE_READOUT} {HEADLINE_TAXONOMY}"
            if name in out and np.isfinite(row.crt):
                out[name]["crt"] = float(row.crt)
    return {name: metrics for name, metrics in out.items() if metrics}
