"""The expression stage's work as executor tasks: the runs at each magnification, one task per
(encoder, magnification), and the task body that fits every run of it for each readout.

A task's shard (``data/.work/expression/``) holds its run rows and per-gene rows; its key covers the
panel's cells and expression, the runs, the expression and probe settings, the encoder, the feature
files, the code and the thread counts (docs/decisions/0010-executor.md).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import Params
from cellpath.expression.panel import PanelExpression
from cellpath.expression.plan import (GENE_COLUMNS, RUN_COLUMNS, CellTypes, ExpressionRun, fit_runs,
                                      plan_expression_runs)
from cellpath.expression.summary import expression_runs
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.panel import PanelCells, PanelFeatures, encoder_patch_ids, feature_block_tasks
from cellpath.features.readouts import readout_available
from cellpath.io.layout import shard_table
from cellpath.probing.plan import class_codes
from cellpath.runtime.code_deps import stage_fingerprint
from cellpath.runtime.executor import Task, thread_settings
from cellpath.runtime.shards import read_context, work_dir, write_context

log = logging.getLogger(__name__)

RUNS_SHARD, GENES_SHARD = "runs", "genes"
MODEL_KEYS = ["model", "magnification", "readout", "taxonomy"]


def plan_magnification(params: Params, data_dir: Path, panel: PanelCells, expression: PanelExpression,
                       encoders: list[EncoderSpec], magnification: str) -> list[ExpressionRun]:
    """Every run at one magnification. Only IS depends on it: its test cells share no patch with the
    ROI under any evaluated encoder's grid there, as for the type probes (the same test cells)."""
    sizes = sorted({spec.input_size for spec in encoders})
    groups = tuple(encoder_patch_ids(data_dir, panel, size, magnification) for size in sizes) \
        if "is" in params.protocols else ()
    runs = [run for protocol in params.protocols
            for run in plan_expression_runs(panel.cells, expression, protocol, params.probe, params.expression, groups)]
    skipped = sum(bool(run.skip_reason) for run in runs)
    log.info("expression plan %s: %d runs, %d skipped, %d cells below %d transcripts left out", magnification,
             len(runs), skipped, sum(run.n_excluded_low_counts for run in runs), params.expression.min_counts)
    return runs


def expression_tasks(params: Params, data_dir: Path, panel: PanelCells, expression: PanelExpression,
                     plans: dict[str, list[ExpressionRun]], encoders: list[EncoderSpec],
                     magnifications: list[str]) -> tuple[Path, list[Task]]:
    """The context file (cells, expression, runs) and one task per (encoder, magnification) with a
    usable readout."""
    cfg = params.expression
    work = work_dir(data_dir, "expression")
    basis = {"code": stage_fingerprint("expression"), "threads": thread_settings(), "panel": params.panel,
             "cells": panel.digest(), "protocols": params.protocols, "probe": params.probe.model_dump(mode="json"),
             "expression": cfg.model_dump(mode="json"), "expression_data": _expression_digest(expression),
             "is_patch_grids": sorted({spec.input_size for spec in encoders})}
    context = write_context(work, "expression", basis, (panel, expression, plans))
    tasks = feature_block_tasks("expression", basis, context, data_dir, panel, encoders, magnifications,
                                cfg.readouts, expression_shard, cfg, work, gpu=cfg.device == "cuda")
    return context, tasks


def _expression_digest(expression: PanelExpression) -> str:
    """A digest of the measured expression the runs score (part of every shard key)."""
    hashed = hashlib.sha256()
    for array in (expression.matrix.indptr, expression.matrix.indices, expression.matrix.data, expression.counted):
        hashed.update(np.ascontiguousarray(array).tobytes())
    hashed.update("\n".join(expression.genes).encode())
    return hashed.hexdigest()[:16]


def expression_shard(out: Path, context: Path, features: Path, spec: EncoderSpec, magnification: str, cfg) -> None:
    """Task: fit every run of one encoder at one magnification for each of its readouts; writes ``out/``."""
    panel, expression, plans = read_context(context)
    base = PanelFeatures(features, spec.slug, magnification, panel)
    codes, names = class_codes(panel.cells["fine"])
    types = CellTypes(codes, len(names))
    run_frames, gene_frames = [], []
    for readout in cfg.readouts:
        if not readout_available(spec, readout):
            continue
        started = time.perf_counter()
        rows, genes = fit_runs(base.readout(readout), types, expression, plans[magnification], cfg)
        log.info("expression %s %s %s: %d runs fitted in %.1f s", spec.name, magnification, readout,
                 int((rows["status"] == "ok").sum()), time.perf_counter() - started)
        run_frames.append(expression_runs(rows, spec.name, magnification, readout)[MODEL_KEYS + RUN_COLUMNS])
        gene_frames.append(genes.assign(model=spec.name, magnification=magnification, readout=readout)
                           [MODEL_KEYS[:3] + GENE_COLUMNS])
    out.mkdir()
    pd.concat(run_frames, ignore_index=True).to_parquet(shard_table(out, RUNS_SHARD), index=False)
    pd.concat(gene_frames, ignore_index=True).to_parquet(shard_table(out, GENES_SHARD), index=False)


def read_shard(shard: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A finished expression task's run rows and per-gene rows."""
    return pd.read_parquet(shard_table(shard, RUNS_SHARD)), pd.read_parquet(shard_table(shard, GENES_SHARD))


def gene_lists(plans: dict[str, list[ExpressionRun]]) -> pd.DataFrame:
    """Per magnification and run, its genes in rank order with their training mean and dispersion."""
    frames = [run.genes.assign(magnification=magnification, **run.keys)
              for magnification, runs in plans.items() for run in runs if not run.genes.empty]
    columns = ["magnification", "protocol", "unit", "organ", "seed", "rank", "gene", "mean", "dispersion_norm"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)
