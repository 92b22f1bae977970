"""The probe plan: how many runs a configuration implies, and protocol splits → gated probe tasks →
fitted runs, one table row per run.

One run is a (model, magnification, readout, taxonomy, protocol, unit, seed); :func:`count_runs`
counts them (Table 3 of the paper), those whose readout needs a CLS token the model lacks being
structurally unavailable: counted, not run. Tasks depend only on the cells, the protocol and the
taxonomy, so they are built once and reused for every (encoder, magnification, readout). A run
whose unit has fewer than two classes passing the gates is recorded with ``status = "skipped"``
and its reason, never dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cellpath.config import ProbeConfig
from cellpath.errors import ConfigError
from cellpath.probing.fit import ProbeTask, RowSource, fit_tasks
from cellpath.probing.protocols import (IS_EXCLUSION_RULES, Split, gate_classes, make_splits, mocv_manifest,
                                       protocol_units)
from cellpath.probing.scores import fraction_text
from cellpath.vocabulary import CLS_READOUTS, PROTOCOLS, READOUTS

log = logging.getLogger(__name__)

EXCLUSION_COLUMNS = [f"n_test_excluded_{rule}" for rule in IS_EXCLUSION_RULES]  # IS test cells each rule removed
RUN_COLUMNS = ["model", "magnification", "readout", "taxonomy", "protocol", "unit", "organ", "seed", "status",
               "skip_reason", "n_train", "n_val", "n_test", *EXCLUSION_COLUMNS, "n_classes", "classes", "chosen_c",
               "c_tied", "val_macro_f1", "macro_f1", "macro_auroc", "macro_auprc", "lbfgs_iterations", "converged",
               "fit_seconds"]


@dataclass(frozen=True)
class PlannedRun:
    """One (protocol, unit, seed, taxonomy) run; ``task`` is None when the unit is skipped."""

    protocol: str
    unit: str
    organ: str
    seed: int
    taxonomy: str
    task: ProbeTask | None
    skip_reason: str = ""
    excluded: tuple[tuple[str, int], ...] = ()  # test cells removed per rule before gating (IS)

    def row(self, class_names: list[str]) -> dict:
        task = self.task
        classes = [] if task is None else [class_names[c] for c in task.classes]
        return {"protocol": self.protocol, "unit": self.unit, "organ": self.organ, "seed": self.seed,
                "taxonomy": self.taxonomy, "status": "ok" if task is not None else "skipped",
                "skip_reason": self.skip_reason,
                "n_train": 0 if task is None else len(task.train), "n_val": 0 if task is None else len(task.val),
                "n_test": 0 if task is None else len(task.test),
                **{f"n_test_excluded_{rule}": 0 for rule in IS_EXCLUSION_RULES},
                **{f"n_test_excluded_{rule}": count for rule, count in self.excluded},
                "n_classes": len(classes), "classes": "|".join(classes)}


def class_codes(labels: pd.Series) -> tuple[np.ndarray, list[str]]:
    """Class index per cell and the (sorted) class names of a taxonomy column."""
    names = sorted(labels.unique())
    codes = pd.Categorical(labels, categories=names).codes.astype(np.int64)
    return codes, names


def capped_training(train: np.ndarray, cap: int | None, split: Split) -> np.ndarray:
    """At most ``cap`` training cells, a seeded uniform subsample (the same for every model)."""
    if cap is None or len(train) <= cap:
        return train
    rng = np.random.default_rng([split.seed, 7919, *map(ord, f"{split.protocol}:{split.unit}")])
    return np.sort(rng.choice(train, cap, replace=False))


def plan_runs(cells: pd.DataFrame, protocol: str, taxonomy: str, cfg: ProbeConfig,
              patch_groups: tuple[np.ndarray, ...] = ()) -> list[PlannedRun]:
    """Every run of one protocol and taxonomy on the cell table, gated as ``cfg`` says; IS test cells
    share no patch of ``patch_groups`` (the evaluated encoders' grids at one magnification) with the ROI."""
    try:
        splits = make_splits(cells, protocol, cfg.seeds[protocol], n_folds=cfg.mocv_folds,
                             roi_fraction=cfg.is_roi_fraction, buffer_um=cfg.is_buffer_um,
                             val_fraction=cfg.val_fraction, patch_groups=patch_groups)
    except ValueError as exc:
        raise ConfigError(f"probe ({protocol}): {exc}; adjust probe.mocv_folds or the panel") from None
    codes, names = class_codes(cells[taxonomy])
    min_train = getattr(cfg.min_train_cells, taxonomy)
    min_test = getattr(cfg.min_test_cells, taxonomy)
    runs = []
    for split in splits:
        train = capped_training(split.train, cfg.max_train_cells, split)
        gated = gate_classes(codes[train], codes[split.test], min_train, min_test)
        key = (split.protocol, split.unit, split.organ, split.seed, taxonomy)
        if len(gated) < 2:
            runs.append(PlannedRun(*key, None, f"{len(gated)} class(es) with ≥{min_train} train and ≥{min_test} "
                                               "test cells", split.excluded))
            continue
        classes = np.array(sorted(gated), dtype=np.int64)
        keep = [rows[np.isin(codes[rows], classes)] for rows in (train, split.val, split.test)]
        if len(keep[1]) == 0:
            runs.append(PlannedRun(*key, None, "no validation cell of a scored class", split.excluded))
            continue
        runs.append(PlannedRun(*key, ProbeTask(*keep, classes=classes), excluded=split.excluded))
    return runs


#: Columns of the confident-error table (:func:`fit_condition`; ``probe/is_errors.parquet`` adds the model keys).
ERROR_COLUMNS = ["taxonomy", "protocol", "unit", "seed", "section_id", "cell_id", "true_class", "predicted_class",
                 "confidence"]


#: Columns of the per-C validation table (:func:`fit_condition`; ``probe/c_scores.parquet`` adds the model
#: keys): one row per fitted run and C of the grid, in grid order. ``val_macro_f1_exact`` is the exact
#: Macro-F1 the tie rule compared (``scores.choose_c``), as ``"p/q"`` (``fractions.Fraction`` reads it);
#: ``val_macro_f1`` is that fraction rounded once to a float.
C_SCORE_COLUMNS = ["taxonomy", "protocol", "unit", "seed", "c", "val_macro_f1", "val_macro_f1_exact"]


def fit_condition(x: np.ndarray | RowSource, cells: pd.DataFrame, runs: list[PlannedRun],
                  cfg: ProbeConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Fit every planned run of one taxonomy on one feature matrix or row source: one row per run
    (skipped ones too); per fitted IS run its ``cfg.is_errors`` most confidently misclassified
    test cells (``ERROR_COLUMNS``; highest predicted-class probability first, ties in test order);
    and per fitted run every C of the grid with its validation Macro-F1 (``C_SCORE_COLUMNS``), from
    which the run's ``chosen_c`` and ``c_tied`` follow."""
    taxonomy = runs[0].taxonomy
    codes, names = class_codes(cells[taxonomy])
    active = [run for run in runs if run.task is not None]
    results = fit_tasks(x, codes, len(names), [run.task for run in active], c_grid=tuple(cfg.c_grid),
                        max_iter=cfg.max_iter, tol=cfg.tol, device=cfg.device, batch_memory_mb=cfg.batch_memory_mb)
    by_run = {id(run): result for run, result in zip(active, results)}
    rows, errors, c_scores = [], [], []
    for run in runs:
        row = run.row(names)
        result = by_run.get(id(run))
        if result is not None:
            row |= {"chosen_c": result.chosen_c, "c_tied": result.tied_cs, "val_macro_f1": result.val_macro_f1,
                    "macro_f1": result.macro_f1, "macro_auroc": result.macro_auroc, "macro_auprc": result.macro_auprc,
                    "lbfgs_iterations": result.iterations, "converged": result.converged,
                    "fit_seconds": result.fit_seconds}
            if run.protocol == "is" and cfg.is_errors:
                errors.append(confident_errors(cells, run, result, codes, names, cfg.is_errors))
            c_scores.extend({"taxonomy": run.taxonomy, "protocol": run.protocol, "unit": run.unit, "seed": run.seed,
                             "c": float(c), "val_macro_f1": float(score), "val_macro_f1_exact": fraction_text(score)}
                            for c, score in zip(cfg.c_grid, result.val_scores, strict=True))
        rows.append(row)
    columns = [c for c in RUN_COLUMNS if c not in ("model", "magnification", "readout")]  # the caller's keys
    frame = pd.DataFrame(rows).reindex(columns=columns)  # every column, even when every run is skipped
    error_frame = (pd.concat(errors, ignore_index=True) if errors else pd.DataFrame()).reindex(columns=ERROR_COLUMNS)
    c_frame = c_score_frame(c_scores)
    return (frame.astype({"c_tied": "Int64", "lbfgs_iterations": "Int64", "converged": "boolean"}), error_frame,
            c_frame)


def c_score_frame(rows: list[dict]) -> pd.DataFrame:
    """``C_SCORE_COLUMNS`` rows as a table with fixed dtypes (the same columns and types when empty)."""
    return pd.DataFrame(rows).reindex(columns=C_SCORE_COLUMNS).astype(
        {"taxonomy": object, "protocol": object, "unit": object, "seed": "int64", "c": "float64",
         "val_macro_f1": "float64", "val_macro_f1_exact": object})


def confident_errors(cells: pd.DataFrame, run: PlannedRun, result, codes: np.ndarray, names: list[str],
                     limit: int) -> pd.DataFrame:
    """The ``limit`` misclassified test cells of one fitted run with the highest predicted-class
    probability (``ERROR_COLUMNS``)."""
    test = run.task.test
    wrong = np.flatnonzero(result.test_pred != codes[test])
    chosen = wrong[np.argsort(-result.test_confidence[wrong], kind="stable")[:limit]]
    rows = test[chosen]
    return pd.DataFrame({"taxonomy": run.taxonomy, "protocol": run.protocol, "unit": run.unit, "seed": run.seed,
                         "section_id": cells["section_id"].to_numpy()[rows], "cell_id": cells["cell_id"].to_numpy()[rows],
                         "true_class": np.asarray(names, dtype=object)[codes[rows]],
                         "predicted_class": np.asarray(names, dtype=object)[result.test_pred[chosen]],
                         "confidence": result.test_confidence[chosen].astype(float)})


@dataclass(frozen=True)
class PlanCounts:
    """Runs per protocol, and how many of them are unavailable (no CLS token)."""

    runs: dict[str, int]
    unavailable: dict[str, int]
    units: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.runs.values())


def count_runs(sections: pd.DataFrame, *, models_with_cls: list[bool], n_magnifications: int, n_taxonomies: int,
               readouts: tuple[str, ...] = READOUTS, seeds: dict[str, int], protocols: tuple[str, ...] = PROTOCOLS,
               n_folds: int = 5) -> PlanCounts:
    """Count runs for a section list (section_id, organ), one bool per model (has a CLS token)."""
    runs, unavailable, units = {}, {}, {}
    n_cls = sum(1 for r in readouts if r in CLS_READOUTS)
    for protocol in protocols:
        n_units = len(protocol_units(sections, protocol, n_folds))
        per_model_readout = n_magnifications * n_taxonomies * n_units * seeds[protocol]
        units[protocol] = n_units
        runs[protocol] = len(models_with_cls) * len(readouts) * per_model_readout
        unavailable[protocol] = sum(1 for has_cls in models_with_cls if not has_cls) * n_cls * per_model_readout
    return PlanCounts(runs, unavailable, units)


@dataclass(frozen=True)
class SplitSize:
    """Cells of one protocol unit's split: training, validation (choosing C) and test."""

    unit: str
    n_train: int
    n_val: int
    n_test: int


def split_sizes(sections: pd.DataFrame, protocol: str, *, n_folds: int = 5, roi_fraction: float = 0.5,
                val_fraction: float = 0.2) -> list[SplitSize]:
    """Split sizes per unit from a section list's cell counts (section_id, organ, cells), for a plan
    with no cells to split: every cell counted (no class gates, no eligibility filter) and IS's test
    side taken as the whole complement of the ROI (the buffer's loss ignored): upper bounds."""
    def held_out(unit: str, test: int, pool: int) -> SplitSize:
        val = int(round(val_fraction * pool))
        return SplitSize(unit, pool - val, val, test)

    cells = sections.set_index("section_id")["cells"].astype(int)
    organ = sections.set_index("section_id")["organ"]
    if protocol == "is":
        return [held_out(s, n - int(round(roi_fraction * n)), int(round(roi_fraction * n)))
                for s, n in cells.sort_index().items()]
    if protocol == "iocd":
        return [held_out(s, int(cells[s]), int(cells[organ == organ[s]].sum() - cells[s]))
                for s in protocol_units(sections, "iocd", n_folds)]
    if protocol == "mocv":
        fold = pd.Series(mocv_manifest(sections, n_folds))
        return [held_out(f"fold{k}", int(cells[fold[fold == k].index].sum()), int(cells[fold[fold != k].index].sum()))
                for k in range(n_folds)]
    if protocol == "looo":
        return [held_out(o, int(cells[organ == o].sum()), int(cells[organ != o].sum()))
                for o in protocol_units(sections, "looo", n_folds)]
    raise ConfigError(f"protocol: {protocol!r} is not one of {', '.join(PROTOCOLS)}")
