"""The probe stage's work as executor tasks: the plan at each magnification, one task per
(encoder, magnification), and the task body that fits every planned run of it.

A task's shard (``data/.work/probe/``) holds its run rows, IS confident errors and per-C validation
scores; its key covers the panel, the plan, the probe parameters, the encoder, the feature files, the
code and the thread counts, so a shard is reused only for exactly these inputs
(docs/decisions/0010-executor.md).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd

from cellpath.config import Params, ProbeConfig
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.panel import PanelCells, PanelFeatures, encoder_patch_ids, feature_block_tasks
from cellpath.features.readouts import readout_available
from cellpath.io.layout import shard_table
from cellpath.probing.plan import (C_SCORE_COLUMNS, ERROR_COLUMNS, RUN_COLUMNS, PlannedRun, c_score_frame,
                                   fit_condition, plan_runs)
from cellpath.probing.protocols import IS_EXCLUSION_RULES
from cellpath.runtime.code_deps import stage_fingerprint
from cellpath.runtime.executor import Task, thread_settings
from cellpath.runtime.shards import read_context, work_dir, write_context

log = logging.getLogger(__name__)

#: ``probe/is_errors.parquet``'s columns: the model keys, then the run's and the cell's.
ERROR_KEYS = ["model", "magnification", "readout", *ERROR_COLUMNS]
#: ``probe/c_scores.parquet``'s columns: the model keys, then the run's, each C and its validation Macro-F1.
C_SCORE_KEYS = ["model", "magnification", "readout", *C_SCORE_COLUMNS]
#: The tables a probe task writes into its shard folder.
RUNS_SHARD, ERRORS_SHARD, C_SCORES_SHARD = "runs", "is_errors", "c_scores"


def plan_magnification(params: Params, data_dir: Path, panel: PanelCells, encoders: list[EncoderSpec],
                       magnification: str) -> dict[str, list[PlannedRun]]:
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


def unavailable_runs(params: Params, encoders: list[EncoderSpec], plans: dict[str, dict[str, list]]) -> dict[str, int]:
    """Per protocol, the runs that cannot exist: Cls readouts of encoders without a CLS token
    (counted, never fitted)."""
    unavailable = {p: 0 for p in params.protocols}
    for spec in encoders:
        missing = sum(1 for readout in params.probe.readouts if not readout_available(spec, readout))
        for by_taxonomy in plans.values():
            for runs in by_taxonomy.values():
                for run in runs:
                    unavailable[run.protocol] += missing
    return unavailable


def probe_tasks(params: Params, data_dir: Path, panel: PanelCells, plans: dict[str, dict[str, list]],
                encoders: list[EncoderSpec], magnifications: list[str]) -> tuple[Path, list[Task]]:
    """The context file (the panel and the plan, which every task reads) and one task per
    (encoder, magnification) with a usable readout: all its readouts × taxonomies."""
    cfg = params.probe
    work = work_dir(data_dir, "probe")
    basis = {"code": stage_fingerprint("probe"), "threads": thread_settings(), "panel": params.panel,
             "cells": panel.digest(), "protocols": params.protocols, "probe": cfg.model_dump(mode="json"),
             "is_patch_grids": sorted({spec.input_size for spec in encoders})}  # they shape the IS test sets
    context = write_context(work, "probe", basis, (panel, plans))
    tasks = feature_block_tasks("probe", basis, context, data_dir, panel, encoders, magnifications, cfg.readouts,
                                probe_shard, cfg, work, gpu=cfg.device == "cuda")
    return context, tasks


def probe_shard(out: Path, context: Path, features: Path, spec: EncoderSpec, magnification: str,
                cfg: ProbeConfig) -> None:
    """Task: fit every planned run of one encoder at one magnification; writes ``out/`` with its run
    rows, IS confident errors and per-C validation scores. Features are read from the memory-mapped
    store as each fit needs them (``probe.batch_memory_mb``)."""
    panel, plans = read_context(context)
    base = PanelFeatures(features, spec.slug, magnification, panel)
    frames, error_frames, c_frames = [], [], []
    for readout in cfg.readouts:
        if not readout_available(spec, readout):
            continue
        x = base.readout(readout)
        for taxonomy, runs in plans[magnification].items():
            started = time.perf_counter()
            frame, errors, c_scores = fit_condition(x, panel.cells, runs, cfg)
            log.info("probe %s %s %s %s: %d runs fitted in %.1f s", spec.name, magnification, readout, taxonomy,
                     int((frame["status"] == "ok").sum()), time.perf_counter() - started)
            frames.append(frame.assign(model=spec.name, magnification=magnification, readout=readout)[RUN_COLUMNS])
            error_frames.append(errors.assign(model=spec.name, magnification=magnification, readout=readout))
            keys = {"model": spec.name, "magnification": magnification, "readout": readout}
            c_frames.append(c_scores.assign(**keys)[C_SCORE_KEYS])
    out.mkdir()
    pd.concat(frames, ignore_index=True).to_parquet(shard_table(out, RUNS_SHARD), index=False)
    errors = pd.concat(error_frames, ignore_index=True) if error_frames else pd.DataFrame()
    errors.reindex(columns=ERROR_KEYS).to_parquet(shard_table(out, ERRORS_SHARD), index=False)
    c_scores = pd.concat(c_frames, ignore_index=True) if c_frames else empty_c_scores()
    c_scores.to_parquet(shard_table(out, C_SCORES_SHARD), index=False)


def empty_c_scores() -> pd.DataFrame:
    """An empty ``probe/c_scores.parquet`` table: its columns (``C_SCORE_KEYS``) and their types."""
    keys = {key: pd.Series(dtype=object) for key in ("model", "magnification", "readout")}
    return c_score_frame([]).assign(**keys)[C_SCORE_KEYS]


def read_shard(shard: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A finished probe task's run rows, IS confident errors and per-C validation scores."""
    return (pd.read_parquet(shard_table(shard, RUNS_SHARD)), pd.read_parquet(shard_table(shard, ERRORS_SHARD)),
            pd.read_parquet(shard_table(shard, C_SCORES_SHARD)))
