"""Expression probe runs: the type probes' splits → each run's cells and genes → three ridge fits.

A run is a (protocol, unit, seed) of the type probes (``probing.protocols.make_splits`` with the same
``probe`` settings, the same training cap): the same units, seeds and cells, so that the type
probes' paired statistics apply. Cells below ``expression.min_counts`` transcripts leave every part
of the split (counted per run). The run's genes are the most variable of those every section of the
run measures, ranked on its **training** cells alone (``targets.variable_genes``); targets are
standardised by the training cells alone (``ridge.fit_path``): nothing the run is scored on moves
either (tested).

Each run is fitted from three designs (``DESIGNS``): the model's ``features``; the cell's transferred
Tfine ``type`` (one-hot), which no model changes; and ``type+features``: each type's training mean,
unpenalised, plus the ridge of the features on each cell's deviation from its type's mean
(``ridge.fit_path``'s absorbed groups). r(type+features) − r(type), the gain, is what the features
decode beyond what the type label carries; r(features) against r(type) compares them alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cellpath.config import ExpressionConfig, ProbeConfig
from cellpath.errors import ConfigError
from cellpath.expression.panel import PanelExpression
from cellpath.expression.ridge import choose_penalties, fit_path, predict, validation_errors
from cellpath.expression.scores import pearson_columns, run_scores, spearman_columns
from cellpath.expression.targets import variable_genes
from cellpath.probing.engine import RowSource
from cellpath.probing.fit import InMemoryRows
from cellpath.probing.plan import capped_training
from cellpath.probing.protocols import make_splits

DESIGNS = ("features", "type", "type+features")
#: the run table's metric columns per design: "<metric>" for the features, "<metric>_type", "<metric>_type_features"
DESIGN_SUFFIX = {"features": "", "type": "_type", "type+features": "_type_features"}
SCORE_NAMES = ("mean_pearson", "mean_spearman", "share_r_above", "n_genes_scored", "n_genes_undefined")
RUN_KEYS = ["protocol", "unit", "organ", "seed"]
RUN_COLUMNS = [*RUN_KEYS, "status", "skip_reason", "n_train", "n_val", "n_test", "n_excluded_low_counts", "n_genes",
               *(f"{name}{DESIGN_SUFFIX[d]}" for d in DESIGNS for name in SCORE_NAMES),
               "gain_features_over_type", "gain_type_features_over_type", "fit_seconds"]
GENE_COLUMNS = [*RUN_KEYS, "gene", "rank", "dispersion_norm",
                *(f"{name}{DESIGN_SUFFIX[d]}" for d in DESIGNS for name in ("pearson", "spearman", "penalty"))]


@dataclass(frozen=True)
class ExpressionRun:
    """One (protocol, unit, seed): its cells (panel rows) and genes (rank order); none when skipped."""

    protocol: str
    unit: str
    organ: str
    seed: int
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    genes: pd.DataFrame  # variable_genes' table: gene, mean, dispersion_norm, rank
    n_excluded_low_counts: int
    skip_reason: str = ""

    @property
    def keys(self) -> dict:
        return {"protocol": self.protocol, "unit": self.unit, "organ": self.organ, "seed": self.seed}


def plan_expression_runs(cells: pd.DataFrame, expression: PanelExpression, protocol: str, probe: ProbeConfig,
                         cfg: ExpressionConfig, patch_groups: tuple[np.ndarray, ...] = ()) -> list[ExpressionRun]:
    """Every run of one protocol: the type probes' splits, low-count cells out, genes from training cells."""
    try:
        splits = make_splits(cells, protocol, probe.seeds[protocol], n_folds=probe.mocv_folds,
                             roi_fraction=probe.is_roi_fraction, buffer_um=probe.is_buffer_um,
                             val_fraction=probe.val_fraction, patch_groups=patch_groups)
    except ValueError as exc:
        raise ConfigError(f"expression ({protocol}): {exc}; adjust probe.mocv_folds or the panel") from None
    sections = cells["section_id"].to_numpy()
    runs = []
    for split in splits:
        parts = [capped_training(split.train, probe.max_train_cells, split), split.val, split.test]
        kept = [rows[expression.counted[rows]] for rows in parts]
        excluded = sum(len(rows) - len(k) for rows, k in zip(parts, kept))
        shared = expression.genes_of(sorted(set(sections[np.concatenate(kept)])))
        train, val, test = kept
        reason = ("fewer than 2 training cells" if len(train) < 2 else "no validation cell" if not len(val)
                  else "no test cell" if not len(test) else "no gene measured in every section of the run"
                  if not shared else "")
        genes = (variable_genes(expression.targets(train, shared), shared, cfg.genes) if not reason
                 else pd.DataFrame(columns=["gene", "mean", "dispersion_norm", "rank"]))
        if not reason and genes.empty:
            reason = "no gene varies over the training cells"
        runs.append(ExpressionRun(split.protocol, split.unit, split.organ, split.seed, train, val, test, genes,
                                  excluded, reason))
    return runs


@dataclass(frozen=True)
class CellTypes:
    """Each panel cell's transferred Tfine type as a code in 0..``n_types``-1 (the type designs)."""

    codes: np.ndarray
    n_types: int

    def one_hot(self) -> InMemoryRows:
        """One-hot rows (cells × n_types, float32): the design of the type alone."""
        one_hot = np.zeros((len(self.codes), self.n_types), dtype=np.float32)
        one_hot[np.arange(len(self.codes)), self.codes] = 1.0
        return InMemoryRows(one_hot)


def _fit_design(design: RowSource, run: ExpressionRun, targets: dict[str, np.ndarray], cfg: ExpressionConfig,
                types: CellTypes | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One design's chosen penalty, Pearson and Spearman r per gene of the run; with ``types``, each
    type's mean absorbed unpenalised (the type+features design: ``ridge.fit_path``'s groups)."""
    codes = {part: None if types is None else types.codes[getattr(run, part)] for part in ("train", "val", "test")}
    path = fit_path(design, run.train, targets["train"], groups=codes["train"],
                    n_groups=0 if types is None else types.n_types, device=cfg.device, read_rows=cfg.read_rows)
    errors = validation_errors(path, design, run.val, targets["val"], cfg.penalties, groups=codes["val"],
                               read_rows=cfg.read_rows)
    penalties = choose_penalties(errors, cfg.penalties)
    predicted = predict(path, path.coefficients(penalties), design, run.test, groups=codes["test"],
                        read_rows=cfg.read_rows)
    return penalties, pearson_columns(predicted, targets["test"]), spearman_columns(predicted, targets["test"])


def fit_run(features: RowSource, types: CellTypes, expression: PanelExpression, run: ExpressionRun,
            cfg: ExpressionConfig) -> tuple[dict, pd.DataFrame]:
    """A run's row (``RUN_COLUMNS`` less the model keys) and per-gene table (``GENE_COLUMNS``)."""
    base = run.keys | {"n_train": len(run.train), "n_val": len(run.val), "n_test": len(run.test),
                       "n_excluded_low_counts": run.n_excluded_low_counts, "n_genes": len(run.genes)}
    if run.skip_reason:
        return base | {"status": "skipped", "skip_reason": run.skip_reason}, pd.DataFrame(columns=GENE_COLUMNS)
    started = time.perf_counter()
    genes = list(run.genes["gene"])
    targets = {part: expression.targets(getattr(run, part), genes) for part in ("train", "val", "test")}
    designs = {"features": (features, None), "type": (types.one_hot(), None), "type+features": (features, types)}
    row, per_gene = base | {"status": "ok", "skip_reason": ""}, run.genes[["gene", "rank", "dispersion_norm"]].copy()
    for name, (design, absorbed) in designs.items():
        penalties, pearson, spearman = _fit_design(design, run, targets, cfg, absorbed)
        suffix = DESIGN_SUFFIX[name]
        row |= {f"{key}{suffix}": value for key, value in run_scores(pearson, spearman).items()}
        per_gene[f"pearson{suffix}"], per_gene[f"spearman{suffix}"] = pearson, spearman
        per_gene[f"penalty{suffix}"] = penalties
    row["gain_features_over_type"] = row["mean_pearson"] - row["mean_pearson_type"]
    row["gain_type_features_over_type"] = row["mean_pearson_type_features"] - row["mean_pearson_type"]
    row["fit_seconds"] = time.perf_counter() - started
    return row, per_gene.assign(**run.keys)[GENE_COLUMNS]


def fit_runs(features: RowSource, types: CellTypes, expression: PanelExpression, runs: list[ExpressionRun],
             cfg: ExpressionConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every run of one feature source: the run rows and the per-gene rows, in run order."""
    fitted = [fit_run(features, types, expression, run, cfg) for run in runs]
    rows = pd.DataFrame([row for row, _ in fitted]).reindex(columns=RUN_COLUMNS)
    genes = [frame for _, frame in fitted if not frame.empty]
    return rows, (pd.concat(genes, ignore_index=True) if genes else pd.DataFrame(columns=GENE_COLUMNS))
