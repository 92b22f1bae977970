"""The robustness stage's work as executor tasks: one scoring task per (magnification, readout) —
every taxonomy, scope and unit of it, all models together (RI and MaRI share k across models) —
and one shortcut-probe task per encoder. Keys as in the probe stage (docs/decisions/0010-executor.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import Params, RobustnessConfig
from cellpath.errors import ConfigError
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.panel import PanelCells, PanelFeatures
from cellpath.features.readouts import readout_available
from cellpath.features.store import artifact_dir
from cellpath.io.layout import features_dir, section_index_csv, section_zarr, shard_table
from cellpath.robustness.panel import (UnitData, UnitRows, anchor_intervals, candidate_rows, cell_groups, margin_table,
                                       score_models, scoring_units, sensitivity_rows, unit_anchors)
from cellpath.robustness.shortcut import apd, nipd, nipd_interval, shortcut_sweep, split_levels, sweep_tables
from cellpath.robustness.summary import SHORTCUT_CURVE_COLUMNS, SHORTCUT_SUMMARY_COLUMNS
from cellpath.robustness.table import low_margin_enrichment
from cellpath.runtime.code_deps import stage_fingerprint
from cellpath.runtime.executor import Task, thread_settings
from cellpath.runtime.shards import file_fingerprint, read_context, shard_task, work_dir, write_context
from cellpath.vocabulary import headline_magnification

log = logging.getLogger(__name__)

#: The tables a scoring task writes into its shard folder; a shortcut task writes ``curves`` and ``summary``.
SCORING_SHARD_TABLES = ("summary", "margins", "enrichment", "sensitivity")


def robustness_tasks(params: Params, data_dir: Path, panel: PanelCells, encoders: list[EncoderSpec],
                     magnifications: list[str]) -> tuple[Path, list[Task], list[Task]]:
    """The context file (the panel), the scoring tasks and the shortcut-probe tasks."""
    import faiss

    cfg = params.robustness
    data_dir = Path(data_dir).resolve()
    work = work_dir(data_dir, "robustness")
    basis = {"code": stage_fingerprint("robustness"), "threads": thread_settings(), "panel": params.panel,
             "cells": panel.digest(), "robustness": cfg.model_dump(mode="json"),
             "sections": file_fingerprint([section_index_csv(data_dir),
                                           *(section_zarr(data_dir, s) for s in panel.rows_in_section)])}
    context = write_context(work, "robustness", basis, panel)
    gpu = faiss.get_num_gpus() > 0

    def task(name: str, fn, args: tuple, specs: list[EncoderSpec], magnification: str, **material) -> Task:
        features = file_fingerprint([artifact_dir(features_dir(data_dir), spec.slug, magnification, section_id)
                                     for spec in specs for section_id in panel.rows_in_section])
        material = basis | material | {"magnification": magnification, "features": features,
                                        "encoders": [s.model_dump(mode="json") for s in specs]}
        return shard_task("robustness", name, material, fn, (context, data_dir, *args), work, gpu=gpu)

    tasks = []
    for magnification in magnifications:
        for readout in cfg.readouts:
            usable = [s for s in encoders if readout_available(s, readout)]
            if usable:
                tasks.append(task(f"{magnification} {readout}", robustness_shard, (usable, magnification, readout, cfg),
                                  usable, magnification, readout=readout))
    if not cfg.shortcut.enabled:
        return context, tasks, []
    train_levels = shortcut_train_levels(params, panel)
    headline = headline_magnification(magnifications)
    shortcut_tasks = [task(f"shortcut {spec.slug} {headline}", shortcut_shard,
                           (spec, headline, cfg, params.seed, train_levels), [spec], headline, seed=params.seed,
                           train_levels=train_levels)
                      for spec in encoders if readout_available(spec, cfg.shortcut.readout)]
    return context, tasks, shortcut_tasks


def shortcut_train_levels(params: Params, panel: PanelCells) -> list[str]:
    """The confounder levels the shortcut probe trains on; a ConfigError naming the setting when the
    levels or the pool size do not fit the panel."""
    shortcut = params.robustness.shortcut
    try:
        train_levels, held_levels = split_levels(panel.cells[shortcut.confounder].unique().tolist(),
                                                 shortcut.train_levels, shortcut.held_out_levels)
    except ValueError as exc:
        raise ConfigError(f"robustness.shortcut ({shortcut.confounder} of panel {params.panel}): {exc}") from None
    trained = panel.cells[panel.cells[shortcut.confounder].isin(train_levels)]
    try:
        sweep_tables(len(train_levels), trained[shortcut.taxonomy].nunique(), shortcut.pool_size)
    except ValueError as exc:
        raise ConfigError(f"robustness.shortcut.pool_size: {exc}; raise pool_size or train on fewer "
                          f"{shortcut.confounder} levels (train_levels, held_out)") from None
    log.info("shortcut probe: trained on %s, held out %s", ", ".join(train_levels), ", ".join(held_levels))
    return train_levels


def _unit_data(panel: PanelCells, features: dict[str, object], groups: dict[str, np.ndarray], unit_rows: np.ndarray,
               taxonomy: str, cfg: RobustnessConfig) -> UnitData:
    """One scoring unit's features, labels, groups and anchors."""
    cells = panel.cells
    biology, confounder = cells[taxonomy].to_numpy()[unit_rows], cells[cfg.confounder].to_numpy()[unit_rows]
    return UnitData({slug: UnitRows(readout, np.asarray(unit_rows)) for slug, readout in features.items()},
                    biology, confounder, {slug: group[unit_rows] for slug, group in groups.items()},
                    unit_anchors(biology, confounder, cfg))


def robustness_shard(out: Path, context: Path, data_dir: Path, specs: list[EncoderSpec], magnification: str,
                     readout: str, cfg: RobustnessConfig) -> None:
    """Task: score every taxonomy, scope and unit of one (magnification, readout) for ``specs``;
    writes ``out/`` with the summary rows, margins (the rows' blocks, in order), enrichment and
    sensitivity tables."""
    panel = read_context(context)
    cells = panel.cells
    groups = {spec.slug: cell_groups(data_dir, panel, spec, magnification, cfg) for spec in specs}
    features = {spec.slug: PanelFeatures(features_dir(data_dir), spec.slug, magnification, panel).readout(readout)
                for spec in specs}  # memory-mapped: read chunk by chunk, one model at a time
    rows: list[dict] = []  # one summary row per (taxonomy, scope, unit, model)
    tables: dict[str, list[pd.DataFrame]] = {name: [] for name in SCORING_SHARD_TABLES[1:]}
    for taxonomy in cfg.taxonomies:
        for scope in cfg.scopes:
            for unit, unit_rows in scoring_units(cells, scope, cfg.confounder):
                condition = {"magnification": magnification, "readout": readout, "taxonomy": taxonomy,
                             "scope": scope, "unit": unit}
                unit_data = _unit_data(panel, features, groups, unit_rows, taxonomy, cfg)
                scored = score_models(specs, unit_data, cfg)
                log.info("robustness %s: %d model(s) scored on %d of %d cells in %.1f s", " ".join(condition.values()),
                         len(scored), len(unit_data.scored_positions()), len(unit_rows), sum(s[3] for s in scored))
                for spec, result, own_k, seconds in scored:
                    rows.append({"model": spec.name, **condition, "confounder": cfg.confounder,
                                 "n_cells": len(unit_rows), **result.summary(), "k_selected": own_k,
                                 **anchor_intervals(result, unit_data, cfg), "seconds": seconds})
                    margins = margin_table(cells.iloc[unit_rows], unit_data.scored_positions(), result, spec.name,
                                           condition, taxonomy)
                    tables["margins"].append(margins)
                    enrichment = low_margin_enrichment(result.margins, margins,
                                                       columns=("cell_type", "organ", "section_id"),
                                                       fraction=cfg.low_margin_fraction)
                    tables["enrichment"].append(enrichment.assign(model=spec.name, **condition))
                    tables["sensitivity"] += [frame.assign(model=spec.name, **condition)
                                              for frame in sensitivity_rows(spec, unit_data, result.margins, cfg)]
    out.mkdir()
    pd.DataFrame(rows).to_parquet(shard_table(out, "summary"), index=False)
    for name, frames in tables.items():
        (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()).to_parquet(shard_table(out, name),
                                                                                        index=False)


def read_scoring_shard(shard: Path) -> dict[str, pd.DataFrame]:
    """A finished scoring task's tables (``summary``, ``margins``, ``enrichment``, ``sensitivity``)."""
    return {name: pd.read_parquet(shard_table(shard, name)) for name in SCORING_SHARD_TABLES}


def shortcut_shard(out: Path, context: Path, data_dir: Path, spec: EncoderSpec, magnification: str,
                   robustness: RobustnessConfig, seed: int, train_levels: list[str]) -> None:
    """Task: the shortcut probe of one encoder; writes ``out/`` with its curves and summary tables."""
    cfg = robustness.shortcut
    panel = read_context(context)
    cells = panel.cells
    readout = PanelFeatures(features_dir(data_dir), spec.slug, magnification, panel).readout(cfg.readout)
    x = UnitRows(readout, np.arange(len(readout)))  # memory-mapped: only the rows a fit needs, held out in chunks
    groups = cell_groups(data_dir, panel, spec, magnification, robustness)
    try:
        sweep = shortcut_sweep(x, cells[cfg.taxonomy].to_numpy(), cells[cfg.confounder].to_numpy(), groups,
                               pool_size=cfg.pool_size, train_confounders=train_levels, n_runs=cfg.n_runs, seed=seed,
                               chunk_rows=candidate_rows(x, robustness))
    except ValueError as exc:  # a (confounder x class) cell of the panel too small for the pool asked of it
        raise ConfigError(f"robustness.shortcut ({spec.name}, {magnification}): {exc}, or train on levels with "
                          f"more cells of their aligned class (train_levels)") from None
    curves, summaries = [], []
    for setting, accuracies in (("in_domain", sweep.in_domain), ("held_out", sweep.held_out)):
        if accuracies is None:
            continue
        for v, row in zip(sweep.cramers_v, np.asarray(accuracies)):
            curves.append({"model": spec.name, "setting": setting, "cramers_v": float(v),
                           "balanced_accuracy_mean": float(np.mean(row)), "balanced_accuracy_sd": float(np.std(row))})
        low, high = nipd_interval(accuracies, sweep.cramers_v, sweep.chance, seed=seed)
        summaries.append({"model": spec.name, "setting": setting, "readout": cfg.readout,
                          "taxonomy": cfg.taxonomy, "magnification": magnification, "confounder": cfg.confounder,
                          "n_runs": cfg.n_runs, "apd": apd(accuracies),
                          "nipd": nipd(accuracies, sweep.cramers_v, sweep.chance), "nipd_low": low, "nipd_high": high})
    out.mkdir()
    pd.DataFrame(curves).to_parquet(shard_table(out, "curves"), index=False)
    pd.DataFrame(summaries).to_parquet(shard_table(out, "summary"), index=False)


def read_shortcut_shards(shards: list[Path], enabled: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The shortcut probe's curves and APD / nIPD, from its tasks' shards (in encoder order); empty
    tables with their columns when the probe is off."""
    if not enabled:
        return pd.DataFrame(columns=SHORTCUT_CURVE_COLUMNS), pd.DataFrame(columns=SHORTCUT_SUMMARY_COLUMNS)
    curves = [r for shard in shards for r in pd.read_parquet(shard_table(shard, "curves")).to_dict("records")]
    summaries = [r for shard in shards for r in pd.read_parquet(shard_table(shard, "summary")).to_dict("records")]
    return pd.DataFrame(curves), pd.DataFrame(summaries)
