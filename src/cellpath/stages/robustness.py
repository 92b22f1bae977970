"""The ``robustness`` stage: CRoMa, F(0), LTM, RI, MaRI and k-NN probes per encoder, plus the
shortcut probe's APD / nIPD and the low-margin enrichment table (``cellpath.robustness``: the
scoring units, groups, anchors and shared k are described in ``robustness/panel.py``).

Outputs (under the reports folder):

- ``robustness/summary.csv``: one row per (model, magnification, readout, taxonomy, scope, unit),
  LTM with ``n_tail`` (how many margins it averages: those at or below ``q_alpha``, ties included);
  a unit scored on anchors carries bootstrap 95 % intervals (``<metric>_low`` / ``_high``; NaN
  where every cell was scored);
- ``robustness/margins.parquet``: every scored cell's CRoMa margin (NaN where undefined), the mean
  SO and OS distances it is made of (``d_so``, ``d_os``) and its nearest SO and OS neighbours
  (section, cell id, cosine distance), for failure analysis and the gallery;
- ``robustness/low_margin_enrichment.csv``: cell type, organ and section shares of the worst decile;
- ``robustness/shortcut.csv``: the shortcut probe's accuracy curves, ``shortcut_summary.csv`` APD / nIPD;
- ``robustness/agreement.csv``: rank agreement of the metrics across models (and with nIPD);
- ``robustness/sensitivity.csv`` / ``sensitivity_agreement.csv``: the optional α and m sweeps
  (``robustness.sensitivity``; LTM with its ``n_tail`` at every setting) and the rank correlations
  between their settings;
- ``robustness_metrics.json``: per model, the headline numbers for ``dvc metrics show`` (with
  ``LTM10 n_tail`` beside ``LTM10``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import ConfigError
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import load_panel_cells
from cellpath.features.readouts import readout_available
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (robustness_margins_parquet, robustness_metrics_json, robustness_reports,
                                robustness_table_csv, stage_lock, stage_log)
from cellpath.io.locks import exclusive
from cellpath.robustness.agreement import metric_agreement
from cellpath.robustness.sensitivity import sensitivity_agreement
from cellpath.robustness.summary import (CONDITION_KEYS, condition_metrics, condition_name, robustness_metrics,
                                         sensitivity_table)
from cellpath.robustness.tasks import read_scoring_shard, read_shortcut_shards, robustness_tasks
from cellpath.runtime.executor import run_tasks
from cellpath.runtime.shards import prune
from cellpath.runtime.tracking import Tracker
from cellpath.vocabulary import headline_magnification

log = logging.getLogger(__name__)


def run(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> pd.DataFrame:
    """robustness: score every (encoder, magnification, readout, taxonomy, scope, unit).

    One robustness stage of a project at a time: it holds its work folder's lock (``data/.work/robustness.lock``),
    so a second one stops at once rather than prune the first one's shards."""
    with exclusive(stage_lock(data_dir, "robustness"), "the robustness stage of this project"):
        return _run(params, data_dir, reports, root)


def _run(params: Params, data_dir: Path, reports: Path, root: Path | None) -> pd.DataFrame:
    started = time.perf_counter()
    cfg = params.robustness
    magnifications = params.stage_magnifications(cfg.magnifications)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    panel = load_panel_cells(data_dir, params.panel)
    if panel.cells[cfg.confounder].nunique() < 2:
        raise ConfigError(f"robustness.confounder: {cfg.confounder!r} has a single level in panel {params.panel}; "
                          "robustness needs at least two")
    skipped = len(magnifications) * sum(1 for readout in cfg.readouts for spec in encoders
                                        if not readout_available(spec, readout))
    context, tasks, shortcut_tasks = robustness_tasks(params, data_dir, panel, encoders, magnifications)
    with Tracker(params.mlflow, "robustness", root, stage_log(reports, "robustness")) as tracker:
        outcomes = run_tasks(tasks + shortcut_tasks, params.executor)
        curves, shortcut = read_shortcut_shards([o.output for o in outcomes[len(tasks):]], cfg.shortcut.enabled)
        tables = _collect(outcomes[:len(tasks)], tracker, params, shortcut)
        summary = tables["summary"]
        sensitivity = sensitivity_table(tables["sensitivity"])
        metrics = robustness_metrics(summary, shortcut, headline_magnification(magnifications))
        _write(reports, summary=summary, margins=pd.concat(tables["margins"], ignore_index=True),
               low_margin_enrichment=pd.concat(tables["enrichment"], ignore_index=True), shortcut=curves,
               shortcut_summary=shortcut, agreement=metric_agreement(summary, shortcut), sensitivity=sensitivity,
               sensitivity_agreement=sensitivity_agreement(sensitivity, list(CONDITION_KEYS), cfg.m))
        with atomic_output(robustness_metrics_json(reports)) as tmp:
            tmp.write_text(json.dumps(metrics, indent=2) + "\n")
        tracker.finish({"panel": params.panel, "group": cfg.group, "confounder": cfg.confounder, "m": cfg.m,
                        "alpha": cfg.alpha, "k": cfg.k, "scopes": ",".join(cfg.scopes)},
                       {"conditions": float(len(summary)), "skipped_without_cls": float(skipped)},
                       [robustness_table_csv(reports, "summary")])
    prune(context.parent, [context, *(task.output for task in tasks + shortcut_tasks)])
    log.info("robustness: %d scored conditions (%d model × readout pairs without a CLS token skipped) in %.1f s; "
             "MLflow %.1f s blocking, %.1f s in the logging thread", len(summary), skipped,
             time.perf_counter() - started, tracker.seconds, tracker.busy_seconds)
    return summary


def _collect(outcomes: list, tracker: Tracker, params: Params, shortcut: pd.DataFrame) -> dict:
    """The scoring tasks' tables in task order (so they do not depend on the executor): ``summary``
    (a frame) and lists of ``margins``, ``enrichment`` and ``sensitivity`` frames; one MLflow run per
    scored condition, with its margins as a logged table."""
    cfg = params.robustness
    rows, tables = [], {"margins": [], "enrichment": [], "sensitivity": []}
    for outcome in outcomes:
        shard = read_scoring_shard(outcome.output)
        if not len(shard["summary"]):  # no scoring unit (organ scope without an organ of two sections)
            continue
        tables["enrichment"].append(shard["enrichment"])
        tables["sensitivity"].append(shard["sensitivity"])
        offset = 0
        for row in shard["summary"].to_dict("records"):
            seconds = row.pop("seconds")
            rows.append(row)
            margins = shard["margins"].iloc[offset:offset + row["n_samples"]].reset_index(drop=True)
            offset += row["n_samples"]
            tables["margins"].append(margins)
            condition = {key: row[key] for key in CONDITION_KEYS}
            tracker.log_child(condition_name(row), {"model": row["model"], **condition, "m": cfg.m, "k": row["k"],
                                                    "group": cfg.group, "confounder": cfg.confounder},
                              condition_metrics(row, shortcut), {"margins.parquet": margins}, seconds=seconds)
            log.info("robustness %s %s %s %s %s %s: CRoMa median %.3f, F(0) %.3f, LTM %.3f (%d in the tail), RI %.3f, "
                     "MaRI %.3f (k=%d; %d of %d margins undefined)", row["model"], *condition.values(),
                     row["croma_median"], row["f0"], row["ltm"], row["n_tail"], row["ri"], row["mari"], row["k"],
                     row["n_undefined"], row["n_samples"])
    return {"summary": pd.DataFrame(rows), **tables}


def _write(reports: Path, **tables: pd.DataFrame) -> None:
    """The robustness folder, replaced atomically: ``margins.parquet`` and a CSV per other table."""
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(robustness_reports(reports)) as out:
        out.mkdir()
        for name, frame in tables.items():
            if name == "margins":
                frame.to_parquet(out / robustness_margins_parquet(reports).name, index=False)
            else:
                frame.to_csv(out / robustness_table_csv(reports, name).name, index=False)
