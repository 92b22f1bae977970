"""The measured expression of the panel's evaluated cells, aligned with the type probes' cell table.

Row ``i`` is row ``i`` of ``PanelCells.cells``: each section's ingested table (cells × panel genes,
raw counts; control probes and codewords are not in it) is read once, log-normalised over its own
genes (:func:`targets.log_normalised`) and cut to the section's evaluated cells, in their order.
Columns are the union of the sections' genes; a gene a section does not measure is absent there
(``section_genes``), never read as a zero: a run scores only the genes every one of its sections
measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import sparse

from cellpath.errors import InputError
from cellpath.expression.targets import counted_cells, log_normalised
from cellpath.features.panel import PanelCells
from cellpath.io.layout import section_zarr
from cellpath.io.sections import read_section_table


@dataclass(frozen=True)
class PanelExpression:
    """Log-normalised expression (cells × ``genes``, float32 sparse), each cell's total count and
    whether it reaches ``expression.min_counts``, and the genes each section measures."""

    matrix: sparse.csr_matrix
    genes: tuple[str, ...]
    totals: np.ndarray
    counted: np.ndarray
    section_genes: dict[str, frozenset[str]]

    def targets(self, rows: np.ndarray, genes: list[str]) -> np.ndarray:
        """Dense float64 (len(rows), len(genes)) of the given cells and genes."""
        index = {gene: i for i, gene in enumerate(self.genes)}
        return self.matrix[rows][:, [index[gene] for gene in genes]].toarray().astype(np.float64)

    def genes_of(self, sections: list[str]) -> list[str]:
        """The genes every one of ``sections`` measures, sorted."""
        shared = frozenset.intersection(*(self.section_genes[s] for s in sections)) if sections else frozenset()
        return sorted(shared)


def _section_counts(data_dir: Path, section_id: str) -> tuple[sparse.csr_matrix, list[str]]:
    """One section's raw counts (cells in stored order × its genes) and its gene names."""
    table = read_section_table(data_dir, section_id)
    genes = [str(g) for g in table.var_names]
    if "feature_types" in table.var:  # a table that kept control features: genes only
        keep = (table.var["feature_types"].astype(str) == "Gene Expression").to_numpy()
        table, genes = table[:, keep], [g for g, k in zip(genes, keep) if k]
    if len(set(genes)) != len(genes):
        repeated = sorted({g for g in genes if genes.count(g) > 1})[:5]
        raise InputError(f"the section's table names a gene more than once ({', '.join(repeated)}); re-ingest it",
                         path=section_zarr(data_dir, section_id), section=section_id)
    return sparse.csr_matrix(table.X), genes


def load_panel_expression(data_dir: Path, panel: PanelCells, min_counts: int) -> PanelExpression:
    """The evaluated cells' expression, section by section in the cell table's order."""
    sections = list(pd.unique(panel.cells["section_id"]))
    blocks, section_genes = [], {}
    for section_id in sections:
        counts, genes = _section_counts(Path(data_dir), section_id)
        rows = panel.rows_in_section[section_id]
        if counts.shape[0] != len(panel.section_order[section_id]):
            raise InputError(f"the section's table has {counts.shape[0]} cells, its labels "
                             f"{len(panel.section_order[section_id])}; rerun `cellpath annotate`",
                             path=section_zarr(data_dir, section_id), section=section_id)
        blocks.append((counts[rows], genes))
        section_genes[section_id] = frozenset(genes)
    union = sorted(set().union(*section_genes.values()))
    column = {gene: i for i, gene in enumerate(union)}
    matrices, totals, counted = [], [], []
    for counts, genes in blocks:
        placed = sparse.csr_matrix(log_normalised(counts) @ _placement(genes, column, len(union)))
        matrices.append(placed)
        totals.append(np.asarray(counts.sum(axis=1)).ravel())
        counted.append(counted_cells(counts, min_counts))
    return PanelExpression(sparse.vstack(matrices, format="csr").astype(np.float32), tuple(union),
                           np.concatenate(totals), np.concatenate(counted), section_genes)


def _placement(genes: list[str], column: dict[str, int], width: int) -> sparse.csr_matrix:
    """The 0/1 matrix (len(genes), width) that puts a section's gene columns at their union columns."""
    return sparse.csr_matrix((np.ones(len(genes), dtype=np.float32), ([*range(len(genes))], [column[g] for g in genes])),
                             shape=(len(genes), width))
