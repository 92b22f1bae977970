"""The ``expression`` stage: label-free expression probes on every (encoder, magnification, readout),
beside the type probes (``cellpath.expression``; docs/decisions/0049).

Outputs (paths relative to the reports folder):

- ``expression/runs.parquet``: one row per run (``expression.plan.RUN_COLUMNS`` with the model keys),
  skipped runs included: mean Pearson and Spearman r and the share of genes with r > 0.3 from the
  features, from the transferred Tfine type alone (``_type``) and from both (``_type_features``), the
  gains over the type, and the low-count cells left out;
- ``expression/genes.parquet``: per run and gene, r from each design and the penalty each chose;
- ``expression/gene_lists.csv``: per run, its genes in rank order (chosen on its training cells);
- ``expression/summary.csv`` (balanced mean, SD, 95 % interval per condition and metric),
  ``wins.csv`` (paired Wilcoxon on mean Pearson r, with Holm), ``cra.csv`` (Nuc − Mean),
  ``gene_summary.csv`` (per gene, r averaged over runs) and ``counts.json``;
- ``expression_metrics.json``: the headline numbers for ``dvc metrics show`` / ``dvc exp show``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.expression.panel import load_panel_expression
from cellpath.expression.summary import condition_metrics, condition_name, headline_metrics, summarise
from cellpath.expression.tasks import expression_tasks, gene_lists, plan_magnification, read_shard
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import load_panel_cells
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import expression_metrics_json, expression_reports, stage_lock, stage_log
from cellpath.io.locks import exclusive
from cellpath.runtime.executor import run_tasks
from cellpath.runtime.shards import prune
from cellpath.runtime.tracking import Tracker

log = logging.getLogger(__name__)


def run(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> pd.DataFrame:
    """expression: fit and score every run, write the tables and metrics, log to MLflow. One
    expression stage of a project at a time (``data/.work/expression.lock``)."""
    with exclusive(stage_lock(data_dir, "expression"), "the expression stage of this project"):
        return _run(params, data_dir, reports, root)


def _run(params: Params, data_dir: Path, reports: Path, root: Path | None) -> pd.DataFrame:
    started = time.perf_counter()
    cfg = params.expression
    magnifications = params.stage_magnifications(cfg.magnifications)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    panel = load_panel_cells(data_dir, params.panel)
    expression = load_panel_expression(data_dir, panel, cfg.min_counts)
    plans = {magnification: plan_magnification(params, data_dir, panel, expression, encoders, magnification)
             for magnification in magnifications}
    context, tasks = expression_tasks(params, data_dir, panel, expression, plans, encoders, magnifications)
    with Tracker(params.mlflow, "expression", root, stage_log(reports, "expression")) as tracker:
        outcomes = run_tasks(tasks, params.executor)
        shards = [read_shard(outcome.output) for outcome in outcomes]
        runs = pd.concat([r for r, _ in shards], ignore_index=True)
        genes = pd.concat([g for _, g in shards], ignore_index=True)
        for _, part in runs.groupby(["model", "magnification", "readout", "protocol"], sort=False):
            part = part.reset_index(drop=True)
            tracker.log_child(condition_name(part), _condition_params(part, params), condition_metrics(part),
                              {"expression_runs.json": part}, seconds=float(part["fit_seconds"].fillna(0).sum()))
        summaries = summarise(runs, genes, magnifications)
        for row in summaries["wins"].itertuples():  # they need every model: added to each condition's run
            tracker.add_metrics(f"expression {row.model} {row.protocol} {row.magnification} {row.readout}",
                                {"wins_mean_pearson": float(row.wins), "wins_holm_mean_pearson": float(row.wins_holm)})
        counts = _counts(runs, expression, panel)
        write_outputs(reports, runs, genes, gene_lists(plans), summaries, counts,
                      headline_metrics(summaries, magnifications))
        tracker.finish(_stage_params(params, magnifications), {"runs/ok": float(counts["runs"]["ok"])},
                       [expression_reports(reports) / "runs.parquet", expression_metrics_json(reports)])
    prune(context.parent, [context, *(task.output for task in tasks)])
    log.info("expression: %d runs fitted, %d skipped in %.1f s", counts["runs"]["ok"], counts["runs"]["skipped"],
             time.perf_counter() - started)
    return runs


def _counts(runs: pd.DataFrame, expression, panel) -> dict:
    """Runs fitted and skipped (per protocol and in total) and the cells left out of the targets."""
    per_protocol = {protocol: {"ok": int((part["status"] == "ok").sum()),
                               "skipped": int((part["status"] == "skipped").sum())}
                    for protocol, part in runs.groupby("protocol", sort=True)}
    return {"runs": {"ok": int((runs["status"] == "ok").sum()), "skipped": int((runs["status"] == "skipped").sum())},
            "per_protocol": per_protocol, "cells": int(len(panel.cells)),
            "cells_below_min_counts": int((~expression.counted).sum())}


def _condition_params(part: pd.DataFrame, params: Params) -> dict:
    """MLflow params of one (model, magnification, readout, protocol) run."""
    first = part.iloc[0]
    cfg = params.expression
    return {"model": first["model"], "magnification": first["magnification"], "readout": first["readout"],
            "protocol": first["protocol"], "panel": params.panel, "seeds": params.probe.seeds[first["protocol"]],
            "genes": cfg.genes, "min_counts": cfg.min_counts, "penalties": ",".join(map(str, cfg.penalties))}


def _stage_params(params: Params, magnifications: list[str]) -> dict:
    cfg = params.expression
    return {"panel": params.panel, "protocol": params.protocol, "encoders": ",".join(params.extract.encoders),
            "magnifications": ",".join(magnifications), "readouts": ",".join(cfg.readouts), "genes": cfg.genes,
            "min_counts": cfg.min_counts, "penalties": ",".join(map(str, cfg.penalties)), "device": cfg.device}


def write_outputs(reports: Path, runs: pd.DataFrame, genes: pd.DataFrame, lists: pd.DataFrame,
                  summaries: dict[str, pd.DataFrame], counts: dict, metrics: dict) -> None:
    """The expression folder and expression_metrics.json, each written atomically."""
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(expression_reports(reports)) as out:
        out.mkdir()
        runs.to_parquet(out / "runs.parquet", index=False)
        genes.to_parquet(out / "genes.parquet", index=False)
        lists.to_csv(out / "gene_lists.csv", index=False)
        for name in ("summary", "wins", "cra", "gene_summary"):
            summaries[name].to_csv(out / f"{name}.csv", index=False)
        (out / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    with atomic_output(expression_metrics_json(reports)) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
