"""Expression probe runs on a small seeded panel: splits, leak-freedom, and what goes beyond the type."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from scipy import sparse

from cellpath.config import ExpressionConfig, ProbeConfig
from cellpath.expression.panel import PanelExpression
from cellpath.expression.plan import RUN_COLUMNS, CellTypes, fit_run, fit_runs, plan_expression_runs
from cellpath.expression.targets import counted_cells, log_normalised
from cellpath.probing.fit import InMemoryRows
from cellpath.probing.plan import plan_runs

N_TYPE_GENES, N_PROGRAM_GENES, N_NOISE_GENES = 12, 4, 14
PROBE = ProbeConfig(seeds={"is": 1, "iocd": 1, "mocv": 2, "looo": 2}, mocv_folds=2, max_train_cells=500,
                    min_train_cells={"fine": 5, "coarse": 5}, min_test_cells={"fine": 5, "coarse": 5})
CFG = ExpressionConfig(genes=20, min_counts=5)


def _panel(seed: int = 0, n_per_section: int = 400):
    """Four sections of two organs; three types with their own genes; a per-cell program p (whatever the
    type) that raises four genes; features that see the type noisily and p well."""
    rng = np.random.default_rng(seed)
    sections = [("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")]
    cells = pd.DataFrame([{"section_id": s, "organ": o, "cell_id": f"{s}-{i}", "x_um": rng.uniform(0, 500),
                           "y_um": rng.uniform(0, 500), "fine": ["T", "B", "F"][rng.integers(3)], "coarse": "x"}
                          for s, o in sections for i in range(n_per_section)])
    types = pd.Categorical(cells["fine"], categories=["B", "F", "T"]).codes.astype(np.int64)
    program = rng.beta(0.8, 2.4, len(cells))
    type_rates = rng.gamma(2.0, 1.0, (3, N_TYPE_GENES)) * (rng.random((3, N_TYPE_GENES)) < 0.5) + 0.05
    rates = np.hstack([type_rates[types], 0.1 + 2.0 * program[:, None] * np.ones((1, N_PROGRAM_GENES)),
                       np.full((len(cells), N_NOISE_GENES), 0.3)])
    counts = rng.poisson(rates * 6.0 * rng.gamma(4.0, 0.25, rates.shape))
    counts[:7, :] = 0  # cells below min_counts
    genes = [f"type{i}" for i in range(N_TYPE_GENES)] + [f"prog{i}" for i in range(N_PROGRAM_GENES)] + \
        [f"noise{i}" for i in range(N_NOISE_GENES)]
    counts = sparse.csr_matrix(counts)
    expression = PanelExpression(log_normalised(counts), tuple(genes), np.asarray(counts.sum(axis=1)).ravel(),
                                 counted_cells(counts, CFG.min_counts), {s: frozenset(genes) for s, _ in sections})
    noise = rng.standard_normal((len(cells), 16))
    features = np.column_stack([np.eye(3)[types] + 0.9 * noise[:, :3], 3.0 * program + 0.3 * noise[:, 3], noise[:, 4:]])
    return cells, expression, features.astype(np.float32), types


def test_runs_are_the_type_probes_units_seeds_and_cells_less_the_low_count_ones():
    cells, expression, _, _ = _panel()
    for protocol in ("is", "iocd", "mocv", "looo"):
        ours = plan_expression_runs(cells, expression, protocol, PROBE, CFG)
        theirs = plan_runs(cells, protocol, "coarse", PROBE)  # one class: every run skipped, splits kept
        assert [(r.unit, r.seed) for r in ours] == [(r.unit, r.seed) for r in theirs]
        for run in ours:
            assert expression.counted[np.concatenate([run.train, run.val, run.test])].all()
            assert len(run.train) <= PROBE.max_train_cells
            assert not set(run.train) & set(run.test) and not set(run.val) & set(run.test)
    excluded = sum(r.n_excluded_low_counts for r in plan_expression_runs(cells, expression, "looo", PROBE, CFG))
    assert excluded > 0


def test_gene_selection_and_standardisation_see_the_training_cells_only():
    cells, expression, features, types = _panel(1)
    run = next(r for r in plan_expression_runs(cells, expression, "looo", PROBE, CFG) if not r.skip_reason)
    scored = np.concatenate([run.val, run.test])
    rng = np.random.default_rng(5)

    def moved(rows: np.ndarray) -> PanelExpression:
        matrix = expression.matrix.tolil(copy=True)
        matrix[rows] = sparse.csr_matrix(rng.gamma(1.0, 3.0, (len(rows), len(expression.genes))).astype(np.float32))
        return dataclasses.replace(expression, matrix=matrix.tocsr())

    again = plan_expression_runs(cells, moved(scored), "looo", PROBE, CFG)
    same = next(r for r in again if (r.unit, r.seed) == (run.unit, run.seed))
    pd.testing.assert_frame_equal(same.genes, run.genes)  # scored cells moved: the same genes
    trained = plan_expression_runs(cells, moved(run.train), "looo", PROBE, CFG)
    changed = next(r for r in trained if (r.unit, r.seed) == (run.unit, run.seed))
    assert not changed.genes.equals(run.genes)  # training cells moved: the genes follow them
    # the test cells' expression enters the scores only, never the fit: the same chosen penalties
    x, t = InMemoryRows(features), CellTypes(types, 3)
    _, genes = fit_run(x, t, expression, run, CFG)
    _, genes_moved = fit_run(x, t, moved(run.test), run, CFG)
    penalty_columns = [c for c in genes.columns if c.startswith("penalty")]
    pd.testing.assert_frame_equal(genes[penalty_columns], genes_moved[penalty_columns])
    assert not np.allclose(genes["pearson"], genes_moved["pearson"])


def test_features_beat_the_type_on_program_genes_and_not_on_type_genes():
    cells, expression, features, types = _panel(2)
    runs = plan_expression_runs(cells, expression, "looo", PROBE, CFG)
    rows, genes = fit_runs(InMemoryRows(features), CellTypes(types, 3), expression, runs, CFG)
    assert list(rows.columns) == RUN_COLUMNS and (rows["status"] == "ok").all()
    by_gene = genes.groupby(genes["gene"].str.extract(r"^([a-z]+)")[0])[["pearson", "pearson_type"]].mean()
    assert by_gene.loc["prog", "pearson"] > by_gene.loc["prog", "pearson_type"] + 0.2
    assert by_gene.loc["type", "pearson_type"] > by_gene.loc["type", "pearson"]
    assert (rows["gain_type_features_over_type"] > 0).all()
    assert rows["n_genes"].max() == CFG.genes


@pytest.mark.parametrize("read_rows", [1024, 4096])
def test_no_score_depends_on_the_rows_read_at_a_time(read_rows):
    cells, expression, features, types = _panel(3)
    runs = plan_expression_runs(cells, expression, "mocv", PROBE, CFG)
    reference = fit_runs(InMemoryRows(features), CellTypes(types, 3), expression, runs, CFG)
    other = fit_runs(InMemoryRows(features), CellTypes(types, 3), expression, runs,
                     CFG.model_copy(update={"read_rows": read_rows}))
    for ours, theirs in zip(reference, other):
        pd.testing.assert_frame_equal(ours.drop(columns=["fit_seconds"], errors="ignore"),
                                      theirs.drop(columns=["fit_seconds"], errors="ignore"))


def test_a_run_without_a_shared_gene_is_skipped_and_kept():
    cells, expression, features, types = _panel(4)
    split_genes = {s: frozenset({"type0"}) if s.startswith("a") else frozenset({"type1"})
                   for s in expression.section_genes}
    runs = plan_expression_runs(cells, dataclasses.replace(expression, section_genes=split_genes), "mocv", PROBE, CFG)
    rows, _ = fit_runs(InMemoryRows(features), CellTypes(types, 3), expression, runs, CFG)
    assert (rows["status"] == "skipped").any()
    assert rows.loc[rows["status"] == "skipped", "skip_reason"].str.contains("no gene measured").all()
