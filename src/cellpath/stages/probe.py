"""The ``probe`` stage: every planned probe run on every (encoder, magnification, readout), the run
table, the paper's summaries, ``reports/metrics.json`` and the MLflow runs.

Outputs (paths relative to the reports folder):

- ``probe/runs.parquet``: one row per run (``probing.RUN_COLUMNS``), skipped runs included;
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

import numpy as np
import pandas as pd

from cellpath.config import Params, ProbeConfig
from cellpath.features.encoders.registry import EncoderSpec, selected_encoders
from cellpath.features.panel import PanelCells, PanelFeatures, encoder_patch_ids, load_panel_cells, panel_sections
from cellpath.features.readouts import readout_available
from cellpath.features.store import artifact_dir
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (TIMING_NAME, features_dir, panels_csv, probe_is_errors_parquet, probe_metrics_json,
                                probe_reports, probe_runs_parquet, stage_log)
from cellpath.probing.plan import ERROR_COLUMNS, RUN_COLUMNS, fit_condition, plan_runs
from cellpath.probing.protocols import IS_EXCLUSION_RULES
from cellpath.runtime.code_deps import stage_fingerprint
from cellpath.runtime.executor import Task, run_tasks, thread_settings
from cellpath.runtime.shards import file_fingerprint, prune, read_context, shard_task, work_dir, write_context
from cellpath.runtime.tracking import Tracker, flat_metrics, metric_key
from cellpath.vocabulary import CROSS_DOMAIN_PROTOCOLS, PROTOCOL_LABELS, PROTOCOLS, headline_magnification

log = logging.getLogger(__name__)

METRICS = ("macro_f1", "macro_auroc", "macro_auprc")


def run(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> pd.DataFrame:
    """probe: fit and score every run, write the run table, summaries and metrics, log to MLflow."""
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
    unavailable = {p: 0 for p in params.protocols}
    for spec in encoders:
        missing = sum(1 for readout in cfg.readouts if not readout_available(spec, readout))
        for by_taxonomy in plans.values():
            for runs in by_taxonomy.values():
                for run in runs:
                    unavailable[run.protocol] += missing
    context, tasks = probe_tasks(params, data_dir, panel, plans, encoders, magnifications)
    frames, error_frames = [], []
    with Tracker(params.mlflow, "probe", root, stage_log(reports, "probe")) as tracker:
        outcomes = run_tasks(tasks, params.executor)
        for outcome in outcomes:  # in task order: the run table does not depend on the executor
            shard = pd.read_parquet(outcome.output / "runs.parquet")
            error_frames.append(pd.read_parquet(outcome.output / "is_errors.parquet"))
            for _, frame in shard.groupby(["readout", "taxonomy"], sort=False):
                frame = frame.reset_index(drop=True)
                frames.append(frame)
                model, magnification, readout, taxonomy = frame.loc[0, ["model", "magnification", "readout",
                                                                         "taxonomy"]]
                if not outcome.computed:
                    log.info("probe %s %s %s %s: %d runs (finished in an earlier run)", model, magnification,
                             readout, taxonomy, int((frame["status"] == "ok").sum()))
                log_conditions(tracker, frame, params)
        runs_table = pd.concat(frames, ignore_index=True)
        summaries = summarise(runs_table, magnifications, nested_panels(data_dir, params.panel))
        for name, comparison in comparison_metrics(runs_table, summaries, magnifications).items():
            tracker.add_metrics(name, comparison)
        counts = run_counts(runs_table, unavailable)
        metrics = headline_metrics(runs_table, summaries, magnifications)
        errors = pd.concat(error_frames, ignore_index=True).reindex(columns=ERROR_KEYS)
        write_outputs(reports, runs_table, errors, summaries, counts, metrics)
        tracker.finish(stage_params(params, magnifications), flat_metrics(counts, "runs/"),
                       [probe_runs_parquet(reports), probe_metrics_json(reports)])
    prune(context.parent, [context, *(task.output for task in tasks)])
    elapsed = time.perf_counter() - started
    timing = {"stage_seconds": round(elapsed, 2), "fit_seconds": round(float(runs_table["fit_seconds"].sum()), 2),
              "mlflow_blocking_seconds": round(tracker.seconds, 2), "mlflow_fraction": round(tracker.seconds / elapsed, 4),
              "mlflow_logging_thread_seconds": round(tracker.busy_seconds, 2), "mlflow_runs": tracker.children + 1,
              "executor": {"backend": params.executor.backend, "workers": params.executor.workers,
                           "tasks": len(outcomes), "tasks_computed": sum(o.computed for o in outcomes)}}
    with atomic_output(probe_reports(reports) / TIMING_NAME) as tmp:
        tmp.write_text(json.dumps(timing, indent=2) + "\n")
    log.info("probe: %d runs fitted, %d skipped, %d unavailable in %.1f s; MLflow: %d runs, %.1f s blocking "
             "(%.1f %%), %.1f s in the logging thread", counts["total"]["ok"], counts["total"]["skipped"],
             counts["total"]["unavailable"], elapsed, tracker.children + 1, tracker.seconds,
             100 * tracker.seconds / elapsed, tracker.busy_seconds)
    return runs_table


def plan_magnification(params: Params, data_dir: Path, panel: PanelCells, encoders: list[EncoderSpec],
                       magnification: str) -> dict[str, list]:
    """Every planned run at one magnification, per taxonomy. Only IS depends on the magnification: its
    test cells share no patch with the ROI under any evaluated encoder's grid there, so every model
    is tested on the same cells (paired tests stay paired)."""
    cfg = params.probe
    sizes = sorted({spec.input_size for spec in encoders})
    groups = tuple(encoder_patch_ids(data_dir, panel, size, magnification) for size in sizes) \
        if "is" in params.protocols else ()
    plans = {taxonomy: [run for protocol in params.protocols
                        for run in plan_runs(panel.cells, protocol, taxonomy, cfg, groups)]
             for taxonomy in cfg.taxonomies}
    for taxonomy, runs in plans.items():
        for protocol in params.protocols:
            mine = [r for r in runs if r.protocol == protocol]
            removed = {rule: sum(dict(r.excluded).get(rule, 0) for r in mine) for rule in IS_EXCLUSION_RULES}
            log.info("probe plan %s %s %s: %d runs, %d skipped (fewer than two gated classes)%s", magnification,
                     taxonomy, protocol, len(mine), sum(r.task is None for r in mine),
                     f"; test cells removed: {removed} (patch grids {sizes} px)" if protocol == "is" else "")
    return plans


def probe_tasks(params: Params, data_dir: Path, panel: PanelCells, plans: dict[str, dict[str, list]],
                encoders: list[EncoderSpec],
                magnifications: list[str]) -> tuple[Path, list[Task]]:
    """The context file and one task per (encoder, magnification) with a usable readout: all its
    readouts × taxonomies.

    The panel and the plan are written once to the work folder (the context every task reads); a shard's
    key covers them, the probe parameters, the encoder, the feature files, the code and the thread
    counts, so a shard is reused only for exactly these inputs (docs/decisions/0010-executor.md).
    """
    cfg = params.probe
    work = work_dir(data_dir, "probe")
    basis = {"code": stage_fingerprint("probe"), "threads": thread_settings(), "panel": params.panel,
             "cells": panel.digest(), "protocols": params.protocols, "probe": cfg.model_dump(mode="json"),
             "is_patch_grids": sorted({spec.input_size for spec in encoders})}  # they shape the IS test sets
    context = write_context(work, "probe", basis, (panel, plans))
    features = features_dir(data_dir).resolve()
    tasks = []
    for spec in encoders:
        if not any(readout_available(spec, readout) for readout in cfg.readouts):
            continue
        for magnification in magnifications:
            inputs = file_fingerprint([artifact_dir(features, spec.slug, magnification, section_id)
                                       for section_id in panel.rows_in_section])
            material = basis | {"encoder": spec.model_dump(mode="json"), "magnification": magnification,
                                "features": inputs}
            tasks.append(shard_task("probe", f"{spec.slug} {magnification}", material, probe_shard,
                                    (context, features, spec, magnification, cfg), work, gpu=cfg.device == "cuda"))
    return context, tasks


def probe_shard(out: Path, context: Path, features: Path, spec: EncoderSpec, magnification: str,
                cfg: ProbeConfig) -> None:
    """Task: fit every planned run of one encoder at one magnification; writes ``out/`` with its run
    rows (``runs.parquet``) and IS confident errors (``is_errors.parquet``). Features are read from the
    memory-mapped store as each fit needs them (``probe.batch_memory_mb``)."""
    panel, plans = read_context(context)
    base = PanelFeatures(features, spec.slug, magnification, panel)
    frames, error_frames = [], []
    for readout in cfg.readouts:
        if not readout_available(spec, readout):
            continue
        x = base.readout(readout)
        for taxonomy, runs in plans[magnification].items():
            started = time.perf_counter()
            frame, errors = fit_condition(x, panel.cells, runs, cfg)
            log.info("probe %s %s %s %s: %d runs fitted in %.1f s", spec.name, magnification, readout, taxonomy,
                     int((frame["status"] == "ok").sum()), time.perf_counter() - started)
            frames.append(frame.assign(model=spec.name, magnification=magnification, readout=readout)[RUN_COLUMNS])
            error_frames.append(errors.assign(model=spec.name, magnification=magnification, readout=readout))
    out.mkdir()
    pd.concat(frames, ignore_index=True).to_parquet(out / "runs.parquet", index=False)
    errors = pd.concat(error_frames, ignore_index=True) if error_frames else pd.DataFrame()
    errors.reindex(columns=ERROR_KEYS).to_parquet(out / "is_errors.parquet", index=False)


#: ``probe/is_errors.parquet``'s columns: the model keys, then the run's and the cell's.
ERROR_KEYS = ["model", "magnification", "readout", *ERROR_COLUMNS]


#: MLflow logs the probe's scores in percentage points, as the report shows them.
PERCENT = 100.0


def condition_name(part: pd.DataFrame) -> str:
    """The MLflow name of one comparable condition: ``<model> <protocol> <magnification> <readout> <taxonomy>``."""
    first = part.iloc[0]
    return " ".join(str(first[key]) for key in ("model", "protocol", "magnification", "readout", "taxonomy"))


def log_conditions(tracker: Tracker, frame: pd.DataFrame, params: Params) -> None:
    """One MLflow child run per protocol of one model's (magnification, readout, taxonomy) rows,
    spanning its fitting time, with its probe rows as a logged table."""
    for _, part in frame.groupby("protocol", sort=False):
        part = part.reset_index(drop=True)
        tracker.log_child(condition_name(part), condition_params(part, params), condition_metrics(part),
                          {"probe_runs.json": part}, seconds=float(part["fit_seconds"].sum()))


def condition_params(part: pd.DataFrame, params: Params) -> dict:
    """MLflow params of one (model, magnification, readout, taxonomy, protocol) child run."""
    first = part.iloc[0]
    taxonomy, protocol = first["taxonomy"], first["protocol"]
    return {"model": first["model"], "magnification": first["magnification"], "readout": first["readout"],
            "taxonomy": taxonomy, "protocol": protocol, "panel": params.panel, "seeds": params.probe.seeds[protocol],
            "min_train_cells": getattr(params.probe.min_train_cells, taxonomy),
            "min_test_cells": getattr(params.probe.min_test_cells, taxonomy)}


def condition_metrics(part: pd.DataFrame) -> dict[str, float]:
    """One condition's balanced summary (percentage points), run counts and seed-averaged Macro-F1 per
    unit: ``macro_f1``, ``macro_f1_sd``, its 95% bootstrap interval ``macro_f1_low`` / ``_high``,
    ``n_units``, ``runs_ok``, ``unit/<section>/macro_f1``, …"""
    from cellpath.probing.stats import protocol_summary, unit_scores

    fitted = part[part["status"] == "ok"]
    metrics: dict[str, float] = {"runs_ok": float(len(fitted)),
                                 "runs_skipped": float((part["status"] == "skipped").sum()),
                                 "runs_not_converged": float((~fitted["converged"].astype(bool)).sum())}
    for metric in METRICS:
        summary = protocol_summary(part, metric)
        if len(summary):
            metrics[metric] = PERCENT * float(summary["mean"].iloc[0])
            metrics[f"{metric}_sd"] = PERCENT * float(summary["sd"].iloc[0])
            metrics[f"{metric}_low"] = PERCENT * float(summary["low"].iloc[0])
            metrics[f"{metric}_high"] = PERCENT * float(summary["high"].iloc[0])
            metrics["n_units"] = float(summary["n_units"].iloc[0])
    for row in unit_scores(part, "macro_f1").itertuples():
        metrics[metric_key("unit", row.unit, "macro_f1")] = PERCENT * float(row.score)
    return metrics


def comparison_metrics(runs: pd.DataFrame, summaries: dict[str, pd.DataFrame],
                       magnifications: list[str]) -> dict[str, dict[str, float]]:
    """Per condition name, what needs every model: significant wins per metric (``wins_macro_f1``,
    …; Wilcoxon over paired units, out of the other models), for IS the CRA of its magnification
    and taxonomy (``cra_macro_f1``, pp, and ``cra_wins``), and CRT on the headline condition's
    cross-domain protocols (Tfine, Nuc, headline magnification)."""
    out: dict[str, dict[str, float]] = {}
    keys = ["model", "protocol", "magnification", "readout", "taxonomy"]
    for row in runs[keys].drop_duplicates().itertuples(index=False):
        out[" ".join(map(str, row))] = {}
    wins = summaries["wins"]
    for row in wins.itertuples():
        name = " ".join(str(getattr(row, key)) for key in keys)
        if name in out:
            out[name][f"wins_{row.metric}"] = float(row.wins)
            out[name][f"wins_holm_{row.metric}"] = float(row.wins_holm)
    cra = summaries["cra"]
    for row in cra[cra["metric"] == "macro_f1"].itertuples():
        name = f"{row.model} is {row.magnification} Nuc {row.taxonomy}"
        if name in out:
            out[name] |= {"cra_macro_f1": PERCENT * float(row.cra), "cra_wins": float(row.wins)}
    headline = headline_magnification(magnifications)
    for row in summaries["crt"].itertuples():
        for protocol in CROSS_DOMAIN_PROTOCOLS:
            name = f"{row.model} {protocol} {headline} Nuc fine"
            if name in out and np.isfinite(row.crt):
                out[name]["crt"] = float(row.crt)
    return {name: metrics for name, metrics in out.items() if metrics}


def summarise(runs: pd.DataFrame, magnifications: list[str], panels: dict[str, list[str]]) -> dict[str, pd.DataFrame]:
    """The paper's summaries of a run table (stats.py), computed on the fitted runs; ``panels``: the
    nested panels within the evaluated one (name → section ids) for the IS tables."""
    from cellpath.probing import stats

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
        {"protocol": p, "readout": "Nuc", "magnification": headline,
         "spearman": stats.taxonomy_rank_agreement(summary[summary["metric"] == "macro_f1"], protocol=p,
                                                   magnification=headline)}
        for p in sorted(ok["protocol"].unique())])
    return {"summary": summary, "wins": wins, "crt": crt, "cra": cra, "cra_pooled": cra_pooled,
            "rank_agreement": agreement, "is_panels": is_panels, "cra_panels": cra_panels}


def nested_panels(data_dir: Path, panel: str) -> dict[str, list[str]]:
    """The evaluated panel and every smaller panel of data/panels.csv (nested in it): name → sections."""
    size = int(panel[1:])
    built = pd.read_csv(panels_csv(data_dir), nrows=0).columns
    names = sorted((c for c in built if re.fullmatch(r"S\d+", c) and int(c[1:]) <= size), key=lambda c: int(c[1:]))
    return {name: panel_sections(data_dir, name)["section_id"].tolist() for name in names}


def run_counts(runs: pd.DataFrame, unavailable: dict[str, int]) -> dict:
    counts = {}
    for protocol in unavailable:
        part = runs[runs["protocol"] == protocol]
        fitted = part[part["status"] == "ok"]
        counts[protocol] = {"ok": len(fitted), "skipped": int((part["status"] == "skipped").sum()),
                            "unavailable": unavailable[protocol],
                            "not_converged": int((~fitted["converged"].astype(bool)).sum())}
    counts["total"] = {k: sum(c[k] for c in counts.values()) for k in ("ok", "skipped", "unavailable", "not_converged")}
    return counts


def _points(value: float) -> float | None:
    """A fraction as percentage points, 2 decimals, as the report shows it (None when undefined)."""
    return None if value is None or not np.isfinite(value) else round(PERCENT * float(value), 2)


def headline_metrics(runs: pd.DataFrame, summaries: dict[str, pd.DataFrame], magnifications: list[str]) -> dict:
    """``reports/metrics.json`` for ``dvc metrics show`` / ``dvc exp show``: the report's headline
    table without its SDs. Per model: Tfine Nuc Macro-F1 (pp) per protocol at the headline
    magnification (``IS``, ``IOCD``, ``MOCV``, ``LOOO``), ``CRA`` (pp, Eq. 4, taxonomies pooled) and
    ``CRT``, and each mean's 95% bootstrap interval as a ``[low, high]`` list (``IS_ci95``, …,
    ``CRA_ci95``; DVC shows no lists, so they add no columns to ``dvc exp show``). Keys of what was
    not computed are left out. Run counts are in ``probe/counts.json``."""
    headline = headline_magnification(magnifications)
    summary = summaries["summary"]
    chosen = summary[(summary["readout"] == "Nuc") & (summary["taxonomy"] == "fine")
                     & (summary["magnification"] == headline) & (summary["metric"] == "macro_f1")]
    cra = summaries["cra_pooled"]
    cra = cra[(cra["magnification"] == headline) & (cra["metric"] == "macro_f1")].set_index("model")
    crt = summaries["crt"].set_index("model")["crt"] if len(summaries["crt"]) else pd.Series(dtype=float)
    metrics: dict = {"magnification": headline}
    for model in sorted(runs["model"].unique()):
        mine = chosen[chosen["model"] == model].set_index("protocol")
        entry = {PROTOCOL_LABELS[p]: _points(mine.at[p, "mean"]) for p in PROTOCOLS if p in mine.index}
        entry |= {"CRA": _points(cra["cra"].get(model)), "CRT": None if not np.isfinite(crt.get(model, np.nan))
                  else round(float(crt[model]), 2)}
        intervals = {f"{PROTOCOL_LABELS[p]}_ci95": _interval(mine.at[p, "low"], mine.at[p, "high"])
                     for p in PROTOCOLS if p in mine.index}
        if model in cra.index:
            intervals["CRA_ci95"] = _interval(cra.at[model, "low"], cra.at[model, "high"])
        metrics[model] = {key: value for key, value in (entry | intervals).items() if value is not None}
    return metrics


def _interval(low: float, high: float) -> list[float] | None:
    """A [low, high] interval in percentage points (None when undefined)."""
    ends = [_points(low), _points(high)]
    return None if None in ends else ends


def stage_params(params: Params, magnifications: list[str]) -> dict:
    cfg = params.probe
    return {"panel": params.panel, "protocol": params.protocol, "encoders": ",".join(params.extract.encoders),
            "magnifications": ",".join(magnifications), "readouts": ",".join(cfg.readouts),
            "taxonomies": ",".join(cfg.taxonomies), "seeds": json.dumps(cfg.seeds, sort_keys=True),
            "c_grid": ",".join(map(str, cfg.c_grid)), "max_iter": cfg.max_iter,
            "max_train_cells": cfg.max_train_cells, "min_train_cells": cfg.min_train_cells.model_dump_json(),
            "min_test_cells": cfg.min_test_cells.model_dump_json(), "device": cfg.device}


def write_outputs(reports: Path, runs: pd.DataFrame, errors: pd.DataFrame, summaries: dict[str, pd.DataFrame],
                  counts: dict, metrics: dict) -> None:
    """The probe folder (run table, IS confident errors, summaries, counts) and metrics.json, each
    written atomically."""
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(probe_reports(reports)) as out:
        out.mkdir()
        runs.to_parquet(out / probe_runs_parquet(reports).name, index=False)
        errors.to_parquet(out / probe_is_errors_parquet(reports).name, index=False)
        for name, frame in summaries.items():
            frame.to_csv(out / f"{name}.csv", index=False)
        (out / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    with atomic_output(probe_metrics_json(reports)) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
