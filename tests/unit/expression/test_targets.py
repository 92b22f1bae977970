"""Expression targets and gene selection against scanpy's own functions."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
from scipy import sparse

from cellpath.expression.targets import counted_cells, log_normalised, shared_genes, variable_genes


def _counts(seed: int, n_cells: int = 800, n_genes: int = 120) -> sparse.csr_matrix:
    """Negative-binomial-like counts: per-gene means over two orders of magnitude, some genes overdispersed."""
    rng = np.random.default_rng(seed)
    means = rng.gamma(0.6, 3.0, n_genes)
    dispersion = rng.choice([0.5, 5.0], n_genes)
    lam = rng.gamma(dispersion[None, :], means[None, :] / dispersion[None, :], size=(n_cells, n_genes))
    return sparse.csr_matrix(rng.poisson(lam))


def test_log_normalised_is_scanpys_normalize_total_then_log1p():
    counts = _counts(0)
    reference = ad.AnnData(X=counts.astype(np.float64))
    sc.pp.normalize_total(reference, target_sum=1e4)
    sc.pp.log1p(reference)
    ours = log_normalised(counts)
    np.testing.assert_allclose(ours.toarray(), reference.X.toarray(), rtol=1e-6)
    assert ours.dtype == np.float32


def test_a_cell_without_counts_stays_zero_and_cells_below_the_minimum_are_not_counted():
    counts = sparse.csr_matrix(np.array([[0, 0, 0], [1, 2, 3], [9, 0, 1]]))
    assert log_normalised(counts)[0].nnz == 0
    np.testing.assert_array_equal(counted_cells(counts, 6), [False, True, True])
    np.testing.assert_array_equal(counted_cells(counts, 7), [False, False, True])


def test_shared_genes_are_those_of_every_panel():
    assert shared_genes([["A", "B", "C"], ["C", "A", "D"], ["A", "C"]]) == ["A", "C"]
    assert shared_genes([]) == []


@pytest.mark.parametrize("seed", [1, 2])
def test_the_genes_kept_are_scanpys_cell_ranger_top_genes(seed):
    expression = log_normalised(_counts(seed))
    genes = [f"gene{i:03d}" for i in range(expression.shape[1])]
    kept = variable_genes(expression, genes, 20)
    adata = ad.AnnData(X=expression, var=pd.DataFrame(index=genes))
    sc.pp.highly_variable_genes(adata, flavor="cell_ranger", n_top_genes=20)
    assert set(kept["gene"]) == set(adata.var_names[adata.var["highly_variable"]])
    assert list(kept["rank"]) == list(range(1, 21))
    assert kept["dispersion_norm"].is_monotonic_decreasing


def test_ties_at_the_cut_keep_exactly_n_genes_by_name():
    base = _counts(3).toarray()
    counts = sparse.csr_matrix(np.hstack([base, base[:, :10]]))  # ten genes twice: equal dispersions
    expression = log_normalised(counts)
    genes = [f"g{i:03d}" for i in range(base.shape[1])] + [f"dup{i:02d}" for i in range(10)]
    for n in range(1, 40):
        kept = variable_genes(expression, genes, n)
        assert len(kept) == n and kept["gene"].is_unique
        ties = kept.groupby("dispersion_norm")["gene"].apply(list)
        assert all(names == sorted(names) for names in ties)


def test_genes_constant_in_training_are_never_kept():
    counts = _counts(4).toarray()
    counts[:, :5] = 0  # not expressed in any training cell
    kept = variable_genes(log_normalised(counts), [f"g{i}" for i in range(counts.shape[1])], 200)
    assert not {"g0", "g1", "g2", "g3", "g4"} & set(kept["gene"])
    assert len(kept) <= counts.shape[1] - 5
    with pytest.raises(ValueError, match="expression.genes"):
        variable_genes(log_normalised(counts), [f"g{i}" for i in range(counts.shape[1])], 0)
