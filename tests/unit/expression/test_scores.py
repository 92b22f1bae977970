"""Per-gene and per-run expression scores against scipy."""

from __future__ import annotations

import numpy as np
from scipy import stats

from cellpath.expression.scores import R_THRESHOLD, pearson_columns, run_scores, spearman_columns


def _pairs(seed: int, n: int = 500, g: int = 8):
    rng = np.random.default_rng(seed)
    measured = rng.standard_normal((n, g)) + 100.0
    predicted = measured * np.linspace(0.0, 1.0, g) + rng.standard_normal((n, g))
    measured[:, -1] = np.round(measured[:, -1])  # ties in the ranks
    return predicted, measured


def test_pearson_and_spearman_match_scipy_column_by_column():
    predicted, measured = _pairs(0)
    pearson, spearman = pearson_columns(predicted, measured), spearman_columns(predicted, measured)
    for g in range(predicted.shape[1]):
        assert abs(pearson[g] - stats.pearsonr(predicted[:, g], measured[:, g]).statistic) < 1e-12
        assert abs(spearman[g] - stats.spearmanr(predicted[:, g], measured[:, g]).statistic) < 1e-12


def test_a_constant_column_has_no_r_and_is_counted():
    predicted, measured = _pairs(1)
    predicted[:, 0] = 3.0
    measured[:, 1] = -2.0
    pearson, spearman = pearson_columns(predicted, measured), spearman_columns(predicted, measured)
    assert np.isnan(pearson[:2]).all() and np.isnan(spearman[:2]).all() and np.isfinite(pearson[2:]).all()
    summary = run_scores(pearson, spearman)
    assert summary["n_genes_undefined"] == 2 and summary["n_genes_scored"] == 6
    assert summary["mean_pearson"] == np.mean(pearson[2:])
    assert summary["share_r_above"] == np.mean(pearson[2:] > R_THRESHOLD)


def test_a_run_with_no_defined_gene_reports_nan_not_zero():
    summary = run_scores(np.full(3, np.nan), np.full(3, np.nan))
    assert np.isnan(summary["mean_pearson"]) and summary["n_genes_undefined"] == 3 and summary["n_genes_scored"] == 0
