"""What the expression probes predict: each cell's measured expression, and the genes a unit scores.

Per cell: log1p of its counts per 10,000 (``TARGET_SUM``), the total taken over every gene of its
section's panel (control probes and codewords are not genes: they are not in the matrix); cells
whose total is below ``expression.min_counts`` are excluded and counted.

Per probe unit: the genes measured in every section whose cells the unit's runs use, ranked by
scanpy's ``highly_variable_genes`` (flavour ``cell_ranger``: dispersion normalised by median and
MAD within equal-count bins of mean expression; docs/decisions/0049) computed on the unit's
**training** cells only, the top ``n_genes`` kept. scanpy ranks; the cut is made here, by
normalised dispersion descending and then gene name, so that ties at the cut never keep more or
fewer than ``n_genes`` and the same genes are kept on any machine.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from scipy import sparse

TARGET_SUM = 1e4          # counts per 10,000, scanpy's normalize_total(target_sum=1e4)
HVG_FLAVOR = "cell_ranger"


def log_normalised(counts: sparse.spmatrix | np.ndarray) -> sparse.csr_matrix:
    """log1p(counts / total · 1e4) per cell (float32, sparse), the total over all the matrix's genes;
    a cell with no counts stays all zero (it is excluded by :func:`counted_cells` before use)."""
    matrix = sparse.csr_matrix(counts, dtype=np.float64)
    totals = np.asarray(matrix.sum(axis=1)).ravel()
    scale = np.divide(TARGET_SUM, totals, out=np.zeros_like(totals), where=totals > 0)
    out = sparse.diags(scale) @ matrix
    out.data = np.log1p(out.data)
    return sparse.csr_matrix(out, dtype=np.float32)


def counted_cells(counts: sparse.spmatrix | np.ndarray, min_counts: int) -> np.ndarray:
    """Whether each cell's total count reaches ``min_counts`` (bool, one per row)."""
    return np.asarray(sparse.csr_matrix(counts).sum(axis=1)).ravel() >= min_counts


def shared_genes(panels: Iterable[Iterable[str]]) -> list[str]:
    """The genes measured in every one of ``panels`` (each a section's gene list), sorted by name."""
    sets = [set(panel) for panel in panels]
    return sorted(set.intersection(*sets)) if sets else []


def variable_genes(train_expression: sparse.spmatrix | np.ndarray, genes: list[str], n_genes: int) -> pd.DataFrame:
    """The ``n_genes`` most variable of ``genes`` over the training cells' log-normalised expression
    (cells × genes, aligned with ``genes``): one row per kept gene, in rank order, with its training
    ``mean`` and ``dispersion_norm`` (scanpy's). A gene constant over the training cells is never
    kept (scanpy gives one a finite dispersion); fewer than ``n_genes`` come back only where fewer
    genes vary."""
    if n_genes < 1:
        raise ValueError(f"expression.genes must be at least 1, got {n_genes}")
    matrix = sparse.csc_matrix(train_expression, dtype=np.float32)
    varies = (matrix.max(axis=0).toarray().ravel() > matrix.min(axis=0).toarray().ravel())
    adata = ad.AnnData(X=matrix.tocsr(), var=pd.DataFrame(index=pd.Index(genes, name="gene")))
    with warnings.catch_warnings():  # scanpy warns about bins of one gene; their genes get no dispersion
        warnings.simplefilter("ignore")
        table = sc.pp.highly_variable_genes(adata, flavor=HVG_FLAVOR, n_top_genes=min(n_genes, len(genes)),
                                            inplace=False)
    table = pd.DataFrame({"gene": genes, "mean": np.asarray(table["means"], dtype=np.float64),
                          "dispersion_norm": np.asarray(table["dispersions_norm"], dtype=np.float64)})
    table = table[np.isfinite(table["dispersion_norm"]) & varies]
    table = table.sort_values(["dispersion_norm", "gene"], ascending=[False, True], kind="mergesort")
    return table.head(n_genes).reset_index(drop=True).assign(rank=lambda t: np.arange(1, len(t) + 1))
