"""The ``robustness`` stage: CRoMa, F(0), LTM, RI, MaRI and k-NN probes per encoder, plus the
shortcut probe's APD / nIPD and the low-margin enrichment table.

Biology is the cell's Tfine or Tcoarse label, the confounder its section (``robustness.confounder``),
and the group that is never its own neighbour the encoder patch the cell was read from at that
magnification (``group: patch``, the same tiling as extraction) or a square spatial tile of
``tile_um`` µm (``group: tile``). Scope ``panel`` scores every evaluated cell together; scope
``organ`` scores each organ with at least two confounder levels on its own.

The shared k of RI / MaRI follows the paper: per model, k* maximises the biological k-NN balanced
accuracy over the candidate k's; the shared k is the lower median of the models' k* within each
(magnification, readout, taxonomy, scope, unit). Outputs (under the reports folder):

- ``robustness/summary.csv``: one row per (model, magnification, readout, taxonomy, scope, unit);
  a unit of more than ``robustness.full_max_cells`` cells is scored on ``robustness.anchors``
  stratified anchors, each searched against every cell, and its median, F(0), LTM, RI and MaRI
  carry bootstrap 95 % intervals (``<metric>_low`` / ``_high``; NaN where every cell was scored);
- ``robustness/margins.parquet``: every scored cell's CRoMa margin (NaN where undefined) and its nearest
  SO and OS neighbours (section, cell id, cosine distance), for failure analysis and the gallery;
- ``robustness/low_margin_enrichment.csv``: cell type, organ and section shares of the worst decile;
- ``robustness/shortcut.csv``: the shortcut probe's accuracy curves, ``shortcut_summary.csv`` APD / nIPD;
- ``robustness/agreement.csv``: rank agreement of the metrics across models (and with nIPD);
- ``robustness/sensitivity.csv`` / ``sensitivity_agreement.csv``: the optional α and m sweeps
  (``robustness.sensitivity``) and the rank correlations between their settings;
- ``robustness_metrics.json``: per model, the headline numbers for ``dvc metrics show``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import Params, RobustnessConfig
from cellpath.errors import ConfigError
from cellpath.features.encoders.registry import EncoderSpec, selected_encoders
from cellpath.features.panel import PanelCells, PanelFeatures, ReadoutRows, encoder_patch_ids, load_panel_cells
from cellpath.features.readouts import readout_available
from cellpath.features.store import artifact_dir
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (features_dir, robustness_margins_parquet, robustness_metrics_json, robustness_reports,
                                section_index_csv, section_zarr, stage_log)
from cellpath.robustness.agreement import metric_agreement
from cellpath.robustness.neighbours import RowSource, candidate_rows_for
from cellpath.robustness.sensitivity import SWEEP_COLUMNS, sensitivity_agreement
from cellpath.robustness.shortcut import split_levels, sweep_tables
from cellpath.runtime.code_deps import stage_fingerprint
from cellpath.runtime.executor import Task, run_tasks, thread_settings
from cellpath.runtime.shards import file_fingerprint, prune, read_context, shard_task, work_dir, write_context
from cellpath.runtime.tracking import Tracker
from cellpath.vocabulary import headline_magnification

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("croma_median", "f0", "ltm", "ri", "mari", "bio_bacc", "conf_bacc")
CONDITION_KEYS = ("magnification", "readout", "taxonomy", "scope", "unit")


def cell_groups(data_dir: Path, panel: PanelCells, spec: EncoderSpec, magnification: str,
                cfg: RobustnessConfig) -> np.ndarray:
    """Group label per evaluated cell: "<section>:<patch>" (encoder patch) or "<section>:<col>:<row>" (tile)."""
    cells = panel.cells
    if cfg.group == "tile":
        col = np.floor(cells["x_um"].to_numpy() / cfg.tile_um).astype(int)
        row = np.floor(cells["y_um"].to_numpy() / cfg.tile_um).astype(int)
        return (cells["section_id"] + ":" + pd.Series(col).astype(str) + ":" + pd.Series(row).astype(str)).to_numpy()
    return encoder_patch_ids(data_dir, panel, spec.input_size, magnification)


def scoring_units(cells: pd.DataFrame, scope: str, confounder: str) -> list[tuple[str, np.ndarray]]:
    """(unit name, row positions) per scope: the whole panel, or each organ with ≥ 2 confounder levels."""
    if scope == "panel":
        return [("panel", np.arange(len(cells)))]
    units = []
    for organ, rows in cells.groupby("organ", sort=True).indices.items():
        if cells[confounder].iloc[rows].nunique() >= 2:
            units.append((str(organ), np.asarray(rows)))
    return units


def run(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> pd.DataFrame:
    """robustness: score every (encoder, magnification, readout, taxonomy, scope, unit)."""
    started = time.perf_counter()
    cfg = params.robustness
    magnifications = params.stage_magnifications(cfg.magnifications)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    panel = load_panel_cells(data_dir, params.panel)
    cells = panel.cells
    if cells[cfg.confounder].nunique() < 2:
        raise ConfigError(f"robustness.confounder: {cfg.confounder!r} has a single level in panel {params.panel}; "
                          "robustness needs at least two")
    skipped = len(magnifications) * sum(1 for readout in cfg.readouts for spec in encoders
                                        if not readout_available(spec, readout))
    context, tasks, shortcut_tasks = robustness_tasks(params, data_dir, panel, encoders, magnifications)
    rows, margin_frames, enrichment_frames, sensitivity_frames = [], [], [], []
    with Tracker(params.mlflow, "robustness", root, stage_log(reports, "robustness")) as tracker:
        outcomes = run_tasks(tasks + shortcut_tasks, params.executor)
        shortcut_curves, shortcut_summary = _shortcut(params, outcomes[len(tasks):])
        for outcome in outcomes[:len(tasks)]:  # in task order: the tables do not depend on the executor
            shard_rows = pd.read_parquet(outcome.output / "summary.parquet").to_dict("records")
            if not shard_rows:  # no scoring unit (organ scope without an organ of two sections)
                continue
            margins_shard = pd.read_parquet(outcome.output / "margins.parquet")
            enrichment_frames.append(pd.read_parquet(outcome.output / "enrichment.parquet"))
            sensitivity_frames.append(pd.read_parquet(outcome.output / "sensitivity.parquet"))
            offset = 0
            for row in shard_rows:
                seconds = row.pop("seconds")
                rows.append(row)
                margins = margins_shard.iloc[offset:offset + row["n_samples"]].reset_index(drop=True)
                offset += row["n_samples"]
                margin_frames.append(margins)
                condition = {key: row[key] for key in CONDITION_KEYS}
                tracker.log_child(condition_name(row), {"model": row["model"], **condition, "m": cfg.m, "k": row["k"],
                                                        "group": cfg.group, "confounder": cfg.confounder},
                                  condition_metrics(row, shortcut_summary), {"margins.parquet": margins},
                                  seconds=seconds)
                log.info("robustness %s %s %s %s %s %s: CRoMa median %.3f, F(0) %.3f, LTM %.3f, RI %.3f, MaRI %.3f "
                         "(k=%d; %d of %d margins undefined)", row["model"], *condition.values(), row["croma_median"],
                         row["f0"], row["ltm"], row["ri"], row["mari"], row["k"], row["n_undefined"], row["n_samples"])
        summary = pd.DataFrame(rows)
        metrics = robustness_metrics(summary, shortcut_summary, headline_magnification(magnifications))
        agreement = metric_agreement(summary, shortcut_summary)
        sensitivity = _sensitivity_table(sensitivity_frames)
        _write(reports, summary, pd.concat(margin_frames, ignore_index=True),
               pd.concat(enrichment_frames, ignore_index=True), shortcut_curves, shortcut_summary, agreement, metrics,
               sensitivity, sensitivity_agreement(sensitivity, list(CONDITION_KEYS), cfg.m))
        tracker.finish({"panel": params.panel, "group": cfg.group, "confounder": cfg.confounder, "m": cfg.m,
                        "alpha": cfg.alpha, "k": cfg.k, "scopes": ",".join(cfg.scopes)},
                       {"conditions": float(len(summary)), "skipped_without_cls": float(skipped)},
                       [robustness_reports(reports) / "summary.csv"])
    prune(context.parent, [context, *(task.output for task in tasks + shortcut_tasks)])
    log.info("robustness: %d scored conditions (%d model × readout pairs without a CLS token skipped) in %.1f s; "
             "MLflow %.1f s blocking, %.1f s in the logging thread", len(summary), skipped,
             time.perf_counter() - started, tracker.seconds, tracker.busy_seconds)
    return summary


def condition_name(row: dict) -> str:
    """The MLflow name of one scored condition: model, magnification, readout, taxonomy, then the
    scope and unit where they say more than ``panel``."""
    parts = [row["model"], row["magnification"], row["readout"], row["taxonomy"]]
    return " ".join(parts + ([] if row["scope"] == row["unit"] == "panel" else [row["scope"], row["unit"]]))


#: Summary columns that describe the condition or its settings (MLflow params), not a result.
_SETTING_KEYS = ("model", *CONDITION_KEYS, "confounder", "m", "k", "alpha")


def condition_metrics(row: dict, shortcut_summary: pd.DataFrame) -> dict[str, float]:
    """A scored condition's MLflow metrics, as fractions like the report's robustness table: CRoMa
    median, F(0), LTM, RI, MaRI with their anchor intervals (``<metric>_low`` / ``_high``, absent
    when every cell was scored), the k-NN probes, counts and the model's own k*. On the condition the
    shortcut probe was fitted on (same model, magnification, readout, taxonomy, confounder, panel
    scope; as the report pairs them) also its nIPD with the bootstrap interval and APD per setting
    (``nipd_held_out``, ``nipd_held_out_low``, ``apd_held_out``, …)."""
    metrics = {key: float(value) for key, value in row.items()
               if key not in _SETTING_KEYS and isinstance(value, (int, float, np.number)) and not isinstance(value, bool)}
    if row["scope"] == "panel" and len(shortcut_summary):
        mine = shortcut_summary[np.logical_and.reduce([shortcut_summary[key] == row[key] for key in
                                                       ("model", "magnification", "readout", "taxonomy", "confounder")])]
        for entry in mine.itertuples():  # setting: in_domain or held_out
            metrics |= {f"nipd_{entry.setting}": float(entry.nipd), f"nipd_{entry.setting}_low": float(entry.nipd_low),
                        f"nipd_{entry.setting}_high": float(entry.nipd_high), f"apd_{entry.setting}": float(entry.apd)}
    return {key: value for key, value in metrics.items() if np.isfinite(value)}


def robustness_tasks(params: Params, data_dir: Path, panel: PanelCells, encoders: list[EncoderSpec],
                     magnifications: list[str]) -> tuple[Path, list[Task], list[Task]]:
    """The context file (the panel), one scoring task per (magnification, readout) — every taxonomy,
    scope and unit of it, all models together (RI and MaRI share k across models) — and one
    shortcut-probe task per encoder. Keys as in the probe stage (docs/decisions/0010-executor.md).
    """
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
    shortcut = cfg.shortcut
    if not shortcut.enabled:
        return context, tasks, []
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
    headline = headline_magnification(magnifications)
    shortcut_tasks = [task(f"shortcut {spec.slug} {headline}", shortcut_shard,
                           (spec, headline, cfg, params.seed, train_levels), [spec], headline, seed=params.seed,
                           train_levels=train_levels)
                      for spec in encoders if readout_available(spec, shortcut.readout)]
    return context, tasks, shortcut_tasks


def robustness_shard(out: Path, context: Path, data_dir: Path, specs: list[EncoderSpec], magnification: str,
                     readout: str, cfg: RobustnessConfig) -> None:
    """Task: score every taxonomy, scope and unit of one (magnification, readout) for ``specs``;
    writes ``out/`` with summary, margins (the rows' blocks, in order), enrichment and sensitivity
    Parquet files."""
    from cellpath.robustness import low_margin_enrichment

    panel = read_context(context)
    cells = panel.cells
    groups = {spec.slug: cell_groups(data_dir, panel, spec, magnification, cfg) for spec in specs}
    features = {spec.slug: PanelFeatures(features_dir(data_dir), spec.slug, magnification, panel).readout(readout)
                for spec in specs}  # memory-mapped: read chunk by chunk, one model at a time
    rows, margin_frames, enrichment_frames, sensitivity_frames = [], [], [], []
    for taxonomy in cfg.taxonomies:
        for scope in cfg.scopes:
            for unit, unit_rows in scoring_units(cells, scope, cfg.confounder):
                condition = {"magnification": magnification, "readout": readout, "taxonomy": taxonomy,
                             "scope": scope, "unit": unit}
                biology, confounder = cells[taxonomy].to_numpy()[unit_rows], cells[cfg.confounder].to_numpy()[unit_rows]
                unit_data = _UnitData(
                    {slug: _UnitRows(readout, np.asarray(unit_rows)) for slug, readout in features.items()},
                    biology, confounder,
                    {s.slug: groups[s.slug][unit_rows] for s in specs}, _anchors(biology, confounder, cfg))
                scored = unit_rows if unit_data.anchors is None else np.asarray(unit_rows)[unit_data.anchors]
                scored_models = _score_models(specs, unit_data, cfg)
                log.info("robustness %s: %d model(s) scored on %d of %d cells in %.1f s", " ".join(condition.values()),
                         len(scored_models), len(scored), len(unit_rows), sum(item[3] for item in scored_models))
                for spec, result, own_k, seconds in scored_models:
                    rows.append({"model": spec.name, **condition, "confounder": cfg.confounder,
                                 "n_cells": len(unit_rows), **result.summary(), "k_selected": own_k,
                                 **_intervals(result, unit_data, cfg), "seconds": seconds})
                    margins = _margin_frame(cells.iloc[unit_rows], scored_positions(unit_data), result, spec.name,
                                            condition, taxonomy)
                    margin_frames.append(margins)
                    enrichment = low_margin_enrichment(result.margins, margins,
                                                       columns=("cell_type", "organ", "section_id"),
                                                       fraction=cfg.low_margin_fraction)
                    enrichment_frames.append(enrichment.assign(model=spec.name, **condition))
                    sensitivity_frames += [frame.assign(model=spec.name, **condition)
                                           for frame in _sensitivity(spec, unit_data, result.margins, cfg)]
    out.mkdir()
    pd.DataFrame(rows).to_parquet(out / "summary.parquet", index=False)
    for name, frames in (("margins", margin_frames), ("enrichment", enrichment_frames),
                         ("sensitivity", sensitivity_frames)):
        (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()).to_parquet(out / f"{name}.parquet",
                                                                                        index=False)


@dataclass(frozen=True)
class _UnitData:
    """One scoring unit's rows: the features of a model slug (a row source over the memory-mapped
    store), biology and confounder labels, groups per model slug, and the anchors scored (positions
    in the unit; None: every cell)."""

    features: dict[str, RowSource]
    biology: np.ndarray
    confounder: np.ndarray
    groups: dict[str, np.ndarray]
    anchors: np.ndarray | None


class _UnitRows(RowSource):
    """A readout over some panel rows, read from the memory-mapped store on demand (float32)."""

    def __init__(self, readout: ReadoutRows, rows: np.ndarray):
        self.readout, self.rows = readout, rows

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, positions: np.ndarray) -> np.ndarray:
        return self.readout.take(self.rows[positions])


def _candidate_rows(rows: RowSource, cfg: RobustnessConfig) -> int:
    """Rows per candidate chunk of ``rows`` within ``robustness.batch_memory_mb``."""
    return candidate_rows_for(cfg.batch_memory_mb, rows.take(np.zeros(1, dtype=np.int64)).shape[1])


def _strata(biology: np.ndarray, confounder: np.ndarray) -> np.ndarray:
    """Each cell's (biology, confounder) cell, as one label."""
    return np.char.add(np.char.add(biology.astype(str), "\x1f"), confounder.astype(str))


def _anchors(biology: np.ndarray, confounder: np.ndarray, cfg: RobustnessConfig) -> np.ndarray | None:
    """None (score every cell) up to ``robustness.full_max_cells``; above, the stratified anchors
    (the same for every model of the unit, so their scores stay paired)."""
    from cellpath.robustness.sampling import stratified_anchors

    if len(biology) <= cfg.full_max_cells:
        return None
    return stratified_anchors(_strata(biology, confounder), cfg.anchors, seed=0)


def _intervals(result, unit: _UnitData, cfg: RobustnessConfig) -> dict[str, float]:
    """``<metric>_low`` / ``<metric>_high``: the anchors' bootstrap 95 % interval (NaN when every cell was scored)."""
    from cellpath.robustness.sampling import INTERVAL_METRICS, bootstrap_intervals

    if unit.anchors is None:
        return {f"{name}_{end}": float("nan") for name in INTERVAL_METRICS for end in ("low", "high")}
    strata = _strata(unit.biology, unit.confounder)[unit.anchors]
    intervals = bootstrap_intervals(result, strata, n_boot=cfg.bootstrap, seed=0)
    return {f"{name}_{end}": getattr(intervals[name], end) for name in INTERVAL_METRICS for end in ("low", "high")}


def _score_models(specs: list[EncoderSpec], unit: _UnitData, cfg: RobustnessConfig) -> list[tuple]:
    """Score each model of one condition: (spec, result, the model's own k*, seconds spent scoring
    it). RI/MaRI are at the shared k (the lower median of the models' k*) unless ``robustness.k``
    is set; k* is each model's own maximiser of its biological k-NN accuracy, whatever k the scores use."""
    from cellpath.robustness import score_embeddings, shared_k

    seconds = {spec.slug: 0.0 for spec in specs}

    def score(spec, k):
        started = time.perf_counter()
        rows = unit.features[spec.slug]
        result = score_embeddings(rows, unit.biology, unit.confounder, unit.groups[spec.slug], m=cfg.m, k=k,
                                  alpha=cfg.alpha, anchors=unit.anchors, candidate_rows=_candidate_rows(rows, cfg))
        seconds[spec.slug] += time.perf_counter() - started
        return result

    first = [(spec, score(spec, None)) for spec in specs]  # k=None: each model at its own k*
    own = {spec.slug: int(result.k) for spec, result in first}
    k = cfg.k if cfg.k is not None else int(shared_k(list(own.values())))
    scored = [(spec, result if result.k == k else score(spec, k), own[spec.slug]) for spec, result in first]
    return [(spec, result, own_k, seconds[spec.slug]) for spec, result, own_k in scored]


def _sensitivity(spec: EncoderSpec, unit: _UnitData, margins: np.ndarray, cfg: RobustnessConfig) -> list[pd.DataFrame]:
    """The model's rows of the optional α and m sweeps (``robustness.sensitivity``) on one unit."""
    from cellpath.robustness.sensitivity import margin_sweep, tail_sweep

    frames = []
    if cfg.sensitivity.alphas:
        frames.append(tail_sweep(margins, cfg.sensitivity.alphas))
    if cfg.sensitivity.m_max is not None:
        rows = unit.features[spec.slug]
        frames.append(margin_sweep(rows, unit.biology, unit.confounder, unit.groups[spec.slug],
                                   range(1, cfg.sensitivity.m_max + 1), alpha=cfg.alpha, anchors=unit.anchors,
                                   candidate_rows=_candidate_rows(rows, cfg)))
    return frames


def scored_positions(unit: _UnitData) -> np.ndarray:
    """Positions in the unit of the cells scored: every cell, or the anchors."""
    return np.arange(len(unit.biology)) if unit.anchors is None else unit.anchors


def _margin_frame(unit_cells: pd.DataFrame, scored: np.ndarray, result, model: str, condition: dict,
                  taxonomy: str) -> pd.DataFrame:
    """One row per scored cell: its CRoMa margin and the nearest SO and OS neighbours that decided
    it (``so_section_id``, ``so_cell_id``, ``so_distance``, and the same for OS; empty where none)."""
    cells = unit_cells.iloc[scored]
    frame = pd.DataFrame({"model": model, **condition, "cell_id": cells["cell_id"].to_numpy(),
                          "section_id": cells["section_id"].to_numpy(), "organ": cells["organ"].to_numpy(),
                          "cell_type": cells[taxonomy].to_numpy(), "margin": result.margins})
    for kind, nearest, distance in (("so", result.nearest_so, result.nearest_so_distance),
                                    ("os", result.nearest_os, result.nearest_os_distance)):
        found = nearest >= 0
        for column in ("section_id", "cell_id"):
            values = np.full(len(nearest), None, dtype=object)
            values[found] = unit_cells[column].to_numpy()[nearest[found]]
            frame[f"{kind}_{column}"] = values
        frame[f"{kind}_distance"] = np.where(found, distance, np.nan)
    return frame


def _shortcut(params: Params, outcomes: list) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The shortcut probe's curves and APD / nIPD, from its tasks' outputs (in encoder order)."""
    cfg = params.robustness.shortcut
    if not cfg.enabled:
        return (pd.DataFrame(columns=["model", "setting", "cramers_v", "balanced_accuracy_mean", "balanced_accuracy_sd"]),
                pd.DataFrame(columns=["model", "setting", "readout", "taxonomy", "magnification", "confounder",
                                      "n_runs", "apd", "nipd", "nipd_low", "nipd_high"]))
    curves = [r for o in outcomes for r in pd.read_parquet(o.output / "curves.parquet").to_dict("records")]
    summaries = [r for o in outcomes for r in pd.read_parquet(o.output / "summary.parquet").to_dict("records")]
    return pd.DataFrame(curves), pd.DataFrame(summaries)


def shortcut_shard(out: Path, context: Path, data_dir: Path, spec: EncoderSpec, magnification: str,
                   robustness: RobustnessConfig, seed: int, train_levels: list[str]) -> None:
    """Task: the shortcut probe of one encoder; writes ``out/`` with curves and summary Parquet files."""
    from cellpath.robustness import apd, nipd, nipd_interval, shortcut_sweep

    cfg = robustness.shortcut
    panel = read_context(context)
    cells = panel.cells
    readout = PanelFeatures(features_dir(data_dir), spec.slug, magnification, panel).readout(cfg.readout)
    x = _UnitRows(readout, np.arange(len(readout)))  # memory-mapped: only the rows a fit needs, held out in chunks
    groups = cell_groups(data_dir, panel, spec, magnification, robustness)
    try:
        sweep = shortcut_sweep(x, cells[cfg.taxonomy].to_numpy(), cells[cfg.confounder].to_numpy(), groups,
                               pool_size=cfg.pool_size, train_confounders=train_levels, n_runs=cfg.n_runs, seed=seed,
                               chunk_rows=_candidate_rows(x, robustness))
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
    pd.DataFrame(curves).to_parquet(out / "curves.parquet", index=False)
    pd.DataFrame(summaries).to_parquet(out / "summary.parquet", index=False)


#: ``robustness_metrics.json`` keys: the report's names for the summary columns.
METRIC_LABELS = {"croma_median": "CRoMa median", "f0": "F(0)", "ltm": "LTM10", "ri": "RI", "mari": "MaRI",
                 "bio_bacc": "k-NN BAcc biology", "conf_bacc": "k-NN BAcc confounder"}


def robustness_metrics(summary: pd.DataFrame, shortcut: pd.DataFrame, magnification: str) -> dict:
    """``robustness_metrics.json`` for ``dvc metrics show``: per model, panel-scope Tfine Nuc
    summaries at the headline magnification and the shortcut probe's nIPD, under the report's names
    (``CRoMa median``, ``F(0)``, ``LTM10``, ``RI``, ``MaRI``, ``nIPD held out``, …), as fractions
    like the report's robustness table, 4 decimals."""
    chosen = summary[(summary["scope"] == "panel") & (summary["magnification"] == magnification)
                     & (summary["readout"] == "Nuc") & (summary["taxonomy"] == "fine")]
    metrics: dict = {"magnification": magnification}
    for row in chosen.itertuples():
        metrics[row.model] = {METRIC_LABELS[key]: round(float(getattr(row, key)), 4) for key in SUMMARY_KEYS
                              if np.isfinite(getattr(row, key))}
    for row in shortcut.itertuples() if len(shortcut) else []:
        if np.isfinite(row.nipd):
            metrics.setdefault(row.model, {})[f"nIPD {row.setting.replace('_', ' ')}"] = round(float(row.nipd), 4)
    return metrics


def _sensitivity_table(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The α and m sweep rows of every shard (empty, with its columns, when the sweeps are off)."""
    columns = ["model", *CONDITION_KEYS, *SWEEP_COLUMNS]
    frames = [frame for frame in frames if len(frame)]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def _write(reports: Path, summary: pd.DataFrame, margins: pd.DataFrame, enrichment: pd.DataFrame,
           curves: pd.DataFrame, shortcut: pd.DataFrame, agreement: pd.DataFrame, metrics: dict,
           sensitivity: pd.DataFrame, sensitivity_agreement_table: pd.DataFrame) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(robustness_reports(reports)) as out:
        out.mkdir()
        summary.to_csv(out / "summary.csv", index=False)
        margins.to_parquet(out / robustness_margins_parquet(reports).name, index=False)
        enrichment.to_csv(out / "low_margin_enrichment.csv", index=False)
        curves.to_csv(out / "shortcut.csv", index=False)
        shortcut.to_csv(out / "shortcut_summary.csv", index=False)
        agreement.to_csv(out / "agreement.csv", index=False)
        sensitivity.to_csv(out / "sensitivity.csv", index=False)
        sensitivity_agreement_table.to_csv(out / "sensitivity_agreement.csv", index=False)
    with atomic_output(robustness_metrics_json(reports)) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
