"""Gene identifiers of a scRNA-seq reference: Ensembl ids → gene symbols, duplicate symbols summed.

Label transfer matches reference genes to the Xenium panel by symbol. References in the CELLxGENE
schema (Tabula Sapiens, GBmap, ...) are indexed by Ensembl gene ids and keep the symbols in a var
column (``feature_name``); 10x matrices carry both. When several ids share a symbol (read-through
genes, PAR copies, patches of the genome assembly) their counts are **summed**: every molecule of the
symbol is kept, whereas keeping the first id would drop the others' counts (docs/decisions/0036).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import sparse

#: A human or mouse Ensembl gene id, with or without its version: ENSG00000141510, ENSMUSG00000059552.12
ENSEMBL_GENE_ID = re.compile(r"^ENS[A-Z]*G\d{11}(\.\d+)?$")
#: var columns that hold gene symbols, in the order they are looked for (CELLxGENE, scanpy, other loaders)
SYMBOL_COLUMNS = ("feature_name", "gene_symbols", "gene_symbol")


def looks_like_ensembl(names: list[str] | tuple[str, ...] | np.ndarray) -> bool:
    """Whether most (over 90 %) of ``names`` are Ensembl gene ids."""
    names = [str(n) for n in names]
    return bool(names) and sum(bool(ENSEMBL_GENE_ID.match(n)) for n in names) > 0.9 * len(names)


def symbol_column(var: pd.DataFrame, requested: str | None) -> str | None:
    """The var column to read symbols from: ``requested`` if given (None when var lacks it), else
    the first of :data:`SYMBOL_COLUMNS` that var has (None when it has none)."""
    if requested is not None:
        return requested if requested in var.columns else None
    return next((c for c in SYMBOL_COLUMNS if c in var.columns), None)


@dataclass(frozen=True)
class SymbolMapping:
    """Counts re-indexed by symbol: ``counts`` (cells × ``symbols``), how many input genes had no
    symbol (dropped) and how many were summed into a symbol another gene already had (merged)."""

    counts: sparse.csr_matrix
    symbols: tuple[str, ...]
    gene_ids: tuple[str, ...]  # the input ids behind each symbol, ';'-joined where several were summed
    dropped_without_symbol: int
    merged_duplicates: int


def _missing(symbol: object) -> bool:
    text = "" if symbol is None else str(symbol).strip()
    return text in ("", "nan", "None", "NA")


def collapse_to_symbols(counts: sparse.spmatrix, symbols: list[str] | np.ndarray,
                        gene_ids: list[str] | np.ndarray | None = None) -> SymbolMapping:
    """Sum the columns of ``counts`` (cells × genes) that share a symbol; drop genes without one.

    Symbols keep their first-seen order. ``gene_ids`` (default: the symbols) are recorded per symbol.
    """
    symbols = [str(s).strip() if not _missing(s) else "" for s in symbols]
    ids = [str(i) for i in (gene_ids if gene_ids is not None else symbols)]
    keep = [j for j, s in enumerate(symbols) if s]
    order: dict[str, int] = {}
    for j in keep:
        order.setdefault(symbols[j], len(order))
    columns = np.array([order[symbols[j]] for j in keep], dtype=np.int64)
    summing = sparse.csr_matrix((np.ones(len(keep)), (np.array(keep, dtype=np.int64), columns)),
                                shape=(len(symbols), len(order)))
    merged = sparse.csr_matrix(counts) @ summing
    merged = sparse.csr_matrix(merged)
    merged.eliminate_zeros()
    ids_per_symbol: dict[str, list[str]] = {}
    for j in keep:
        ids_per_symbol.setdefault(symbols[j], []).append(ids[j])
    return SymbolMapping(merged, tuple(order), tuple(";".join(ids_per_symbol[s]) for s in order),
                         dropped_without_symbol=len(symbols) - len(keep), merged_duplicates=len(keep) - len(order))


def describe(mapping: SymbolMapping, source: str) -> str:
    """One line on what the mapping did, e.g. for a log: genes kept, dropped and summed."""
    return (f"{len(mapping.symbols)} gene symbols from {source}; {mapping.dropped_without_symbol} gene(s) without "
            f"a symbol dropped, {mapping.merged_duplicates} gene(s) sharing a symbol summed into it")
