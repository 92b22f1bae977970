"""The ``probe`` stage: every planned probe run on every (encoder, magnification, readout), the run
table, the paper's summaries, ``reports/metrics.json`` and the MLflow runs.

Outputs (paths relative to the reports folder):

- ``probe/runs.parquet``: one row per run (``probing.RUN_COLUMNS``), skipped runs included;
- ``probe/c_scores.parquet``: per fitted run, every C of the grid with its validation Macro-F1 as a
  float and as the exact fraction the tie rule compared (``probing.tasks.C_SCORE_KEYS``), so that
  every run's ``chosen_c`` and ``c_tied`` can be recomputed from the files;
- ``probe/is_errors.parquet``: per fitted IS run, its ``probe.is_errors`` most confidently
  misclassified test cells (model keys + ``probing.plan.ERROR_COLUMNS``), for the failure gallery;
- ``probe/summary.csv``: protocol-balanced mean ± SD per condition (Macro-F1, -AUROC, -AUPRC) with
  its 95% bootstrap interval (``low``, ``high``);
- ``probe/cra.csv``, ``probe/cra_pooled.csv`` (with its interval), ``probe/wins.csv`` (the paper's
  uncorrected ``wins`` and the Holm-corrected ``wins_holm``), ``probe/crt.csv``,
  ``probe/rank_agreement.csv``;
- ``probe/counts.json``: runs fitted, skipped (fewer than two gated classes) and structurally
  unavailable (Cls readouts of CLS-less encoders), per protocol; ``probe/timing.json``;
- ``metrics.json``: the headline numbers for ``dvc metrics show`` / ``dvc exp show``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import load_panel_cells, panel_sections
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (COUNTS_NAME, TIMING_NAME, panels_csv, probe_is_errors_parquet, probe_metrics_json,
                                probe_reports, probe_runs_parquet, probe_table_csv, stage_lock, stage_log)
from cellpath.io.locks import exclusive
from cellpath.probing.summary import (comparison_metrics, condition_metrics, condition_name, headline_metrics,
                                      run_counts, summarise)
from cellpath.probing.tasks import (C_SCORE_KEYS, ERROR_KEYS, empty_c_scores, plan_magnification, probe_tasks,
                                    read_shard, unavailable_runs)
from cellpath.runtime.executor import run_tasks
from cellpath.runtime.shards import prune
from cellpath.runtime.tracking import Tracker, flat_metrics

log = logging.getLogger(__name__)

C_SCORES_NAME = "c_scores.parquet"  # in the probe folder, beside runs.parquet


def run(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> pd.DataFrame:
    """probe: fit and score every run, write the run table, summaries and metrics, log to MLflow.

    One probe stage of a project at a time: it holds its work folder's lock (``data/.work/probe.lock``),
    so a second one stops at once rather than prune the first one's shards."""
    with exclusive(stage_lock(data_dir, "probe"), "the probe stage of this project"):
        return _run(params, data_dir, reports, root)


def _run(params: Params, data_dir: Path, reports: Path, root: Path | None) -> pd.DataFrame:
    started = time.perf_counter()
    cfg = params.probe
    magnifications = params.stage_magnifications(cfg.magnifications)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    panel = load_panel_cells(data_dir, params.panel)
    plans = {magnification: plan_magnification(params, data_dir, panel, encoders, magnification)
             for magnification in magnifications}
    context, tasks = probe_tasks(params, data_dir, panel, plans, encoders, magnifications)
    with Tracker(params.mlflow, "probe", root, stage_log(reports, "probe")) as tracker:
        outcomes = run_tasks(tasks, params.executor)
        runs_table, errors, c_scores = _collect(outcomes, tracker, params)
        summaries = summarise(runs_table, magnifications, nested_panels(data_dir, params.panel))
        for name, comparison in comparison_metrics(runs_table, summaries, magnifications).items():
            tracker.add_metrics(name, comparison)
        counts = run_counts(runs_table, unavailable_runs(params, encoders, plans))
        write_outputs(reports, runs_table, errors, summaries, counts,
                      headline_metrics(runs_table, summaries, magnifications), c_scores=c_scores)
        tracker.finish(stage_params(params, magnifications), flat_metrics(counts, "runs/"),
                       [probe_runs_parquet(reports), probe_metrics_json(reports)])
    prune(context.parent, [context, *(task.output for task in tasks)])
    _write_timing(reports, params, time.perf_counter() - started, runs_table, tracker, outcomes)
    log.info("probe: %d runs fitted, %d skipped, %d unavailable in %.1f s; MLflow: %d runs, %.1f s blocking, "
             "%.1f s in the logging thread", counts["total"]["ok"], counts["total"]["skipped"],
             counts["total"]["unavailable"], time.perf_counter() - started, tracker.children + 1, tracker.seconds,
             tracker.busy_seconds)
    return runs_table


def _collect(outcomes: list, tracker: Tracker, params: Params) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The run table, IS confident errors and per-C validation scores of every task, in task order (so
    none depends on the executor), logging one MLflow run per condition as its rows arrive."""
    frames, error_frames, c_frames = [], [], []
    for outcome in outcomes:
        shard, errors, c_scores = read_shard(outcome.output)
        error_frames.append(errors)
        c_frames.append(c_scores)
        for _, frame in shard.groupby(["readout", "taxonomy"], sort=False):
            frame = frame.reset_index(drop=True)
            frames.append(frame)
            if not outcome.computed:
                log.info("probe %s %s %s %s: %d runs (finished in an earlier run)",
                         *frame.loc[0, ["model", "magnification", "readout", "taxonomy"]],
                         int((frame["status"] == "ok").sum()))
            log_conditions(tracker, frame, params)
    errors = pd.concat(error_frames, ignore_index=True).reindex(columns=ERROR_KEYS)
    c_scores = pd.concat(c_frames, ignore_index=True).reindex(columns=C_SCORE_KEYS) if c_frames else empty_c_scores()
    return pd.concat(frames, ignore_index=True), errors, c_scores


def nested_panels(data_dir: Path, panel: str) -> dict[str, list[str]]:
    """The evaluated panel and every smaller panel of data/panels.csv (nested in it): name → sections."""
    size = int(panel[1:])
    built = pd.read_csv(panels_csv(data_dir), nrows=0).columns
    names = sorted((c for c in built if re.fullmatch(r"S\d+", c) and int(c[1:]) <= size), key=lambda c: int(c[1:]))
    return {name: panel_sections(data_dir, name)["section_id"].tolist() for name in names}


def log_conditions(tracker: Tracker, frame: pd.DataFrame, params: Params) -> None:
    """One MLflow run per protocol of one model's (magnification, readout, taxonomy) rows, spanning
    its fitting time, with its probe rows as a logged table."""
    for _, part in frame.groupby("protocol", sort=False):
        part = part.reset_index(drop=True)
        tracker.log_child(condition_name(part), condition_params(part, params), condition_metrics(part),
                          {"probe_runs.json": part}, seconds=float(part["fit_seconds"].sum()))


def condition_params(part: pd.DataFrame, params: Params) -> dict:
    """MLflow params of one (model, magnification, readout, taxonomy, protocol) run."""
    first = part.iloc[0]
    taxonomy, protocol = first["taxonomy"], first["protocol"]
    return {"model": first["model"], "magnification": first["magnification"], "readout": first["readout"],
            "taxonomy": taxonomy, "protocol": protocol, "panel": params.panel, "seeds": params.probe.seeds[protocol],
            "min_train_cells": getattr(params.probe.min_train_cells, taxonomy),
            "min_test_cells": getattr(params.probe.min_test_cells, taxonomy)}


def stage_params(params: Params, magnifications: list[str]) -> dict:
    """MLflow params of the stage's own run."""
    cfg = params.probe
    return {"panel": params.panel, "protocol": params.protocol, "encoders": ",".join(params.extract.encoders),
            "magnifications": ",".join(magnifications), "readouts": ",".join(cfg.readouts),
            "taxonomies": ",".join(cfg.taxonomies), "seeds": json.dumps(cfg.seeds, sort_keys=True),
            "c_grid": ",".join(map(str, cfg.c_grid)), "max_iter": cfg.max_iter,
            "max_train_cells": cfg.max_train_cells, "min_train_cells": cfg.min_train_cells.model_dump_json(),
            "min_test_cells": cfg.min_test_cells.model_dump_json(), "device": cfg.device}


def write_outputs(reports: Path, runs: pd.DataFrame, errors: pd.DataFrame, summaries: dict[str, pd.DataFrame],
                  counts: dict, metrics: dict, *, c_scores: pd.DataFrame | None = None) -> None:
    """The probe folder (run table, per-C validation scores — none given: an empty table with its
    columns —, IS confident errors, summaries, counts) and metrics.json, each written atomically."""
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(probe_reports(reports)) as out:
        out.mkdir()
        runs.to_parquet(out / probe_runs_parquet(reports).name, index=False)
        (empty_c_scores() if c_scores is None else c_scores).to_parquet(out / C_SCORES_NAME, index=False)
        errors.to_parquet(out / probe_is_errors_parquet(reports).name, index=False)
        for name, frame in summaries.items():
            frame.to_csv(out / probe_table_csv(reports, name).name, index=False)
        (out / COUNTS_NAME).write_text(json.dumps(counts, indent=2) + "\n")
    with atomic_output(probe_metrics_json(reports)) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")


def _write_timing(reports: Path, params: Params, elapsed: float, runs: pd.DataFrame, tracker: Tracker,
                  outcomes: list) -> None:
    """``probe/timing.json``: the stage's wall time, fitting time, MLflow's share and the executor's tasks."""
    timing = {"stage_seconds": round(elapsed, 2), "fit_seconds": round(float(runs["fit_seconds"].sum()), 2),
              "mlflow_blocking_seconds": round(tracker.seconds, 2), "mlflow_fraction": round(tracker.seconds / elapsed, 4),
              "mlflow_logging_thread_seconds": round(tracker.busy_seconds, 2), "mlflow_runs": tracker.children + 1,
              "executor": {"backend": params.executor.backend, "workers": params.executor.workers,
                           "tasks": len(outcomes), "tasks_computed": sum(o.computed for o in outcomes)}}
    with atomic_output(probe_reports(reports) / TIMING_NAME) as tmp:
        tmp.write_text(json.dumps(timing, indent=2) + "\n")
