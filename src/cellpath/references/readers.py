"""Readers of the shapes public scRNA-seq references come in, each to a :class:`CountTable`.

- 10x HDF5 (``filtered_feature_bc_matrix.h5``, Cell Ranger 2 ``*_gene_bc_matrices_h5.h5``): scanpy;
- Matrix Market (``matrix.mtx(.gz)`` + ``genes.tsv``/``features.tsv`` + ``barcodes.tsv``, with any
  prefix, or ``count_matrix_sparse.mtx`` + ``count_matrix_genes.tsv`` + ``count_matrix_barcodes.tsv``):
  scipy's ``mmread`` and pandas;
- dense text tables, genes × cells, tab-, comma- or whitespace-separated, gzip or not: pandas, read in
  row chunks so a 200,000-cell table never sits in memory dense;
- h5ad (CELLxGENE: Ensembl ids as var_names, symbols in ``var["feature_name"]``, raw counts in
  ``raw.X`` while X is normalised): anndata's element readers, the counts in row blocks.

Every reader checks that the counts are whole numbers (non-integer values are refused with their
number) and indexes genes by symbol, summing genes that share one (cellpath.annotation.genes).
"""

from __future__ import annotations

import csv
import gzip
import io
import re
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
from scipy import sparse
from anndata.io import read_elem, sparse_dataset
from scipy.io import mmread

from cellpath.annotation.genes import SYMBOL_COLUMNS, collapse_to_symbols, looks_like_ensembl, symbol_column
from cellpath.annotation.transfer import CountAudit, check_counts
from cellpath.errors import InputError

MATRIX_NAME = re.compile(r"(matrix|sparse)\.mtx(\.gz)?$")
H5_SUFFIXES = re.compile(r"_?(filtered|raw)?_?(feature|gene)_bc_matri(x|ces)(_h5)?\.h5$|\.h5$")
GEO_SAMPLE = re.compile(r"^GSM\d+[_.-]?")
MAX_DENSE_VALUES = 20_000_000  # values per chunk of a dense table (160 MB as float64)
H5AD_BLOCK_VALUES = 20_000_000  # stored values per row block of an h5ad's counts (160 MB as float64)


@dataclass(frozen=True)
class CountTable:
    """Raw counts of one or more samples: cells × genes, genes by symbol (unique), and what was
    dropped or summed on the way (``notes``)."""

    counts: sparse.csr_matrix
    symbols: tuple[str, ...]
    gene_ids: tuple[str, ...]
    barcodes: tuple[str, ...]
    samples: tuple[str, ...]  # one per cell
    labels: np.ndarray | None = None  # per cell, when the file itself carries them (header, obs)
    notes: tuple[str, ...] = ()

    @property
    def cell_ids(self) -> tuple[str, ...]:
        """Barcodes, prefixed ``<sample>_`` when the table holds several samples."""
        if len(set(self.samples)) <= 1:
            return self.barcodes
        return tuple(f"{s}_{b}" for s, b in zip(self.samples, self.barcodes))


def sample_name(path: Path, suffix: re.Pattern) -> str:
    """A sample's name from its file name: the name without ``suffix`` and a leading GEO ``GSM…_``."""
    stem = suffix.sub("", path.name).rstrip("._-")
    return GEO_SAMPLE.sub("", stem) or stem or path.stem


def _symbol_table(counts, symbols, gene_ids, barcodes, sample: str, path: Path, notes: list[str],
                  labels: np.ndarray | None = None) -> CountTable:
    """Counts checked for whole numbers, genes collapsed to unique symbols, as a CountTable."""
    counts = check_counts(counts, f"counts in {path.name}", path, None,
                          hint="; a reference needs raw integer counts (UMIs or reads), not normalised values")
    mapping = collapse_to_symbols(counts, symbols, gene_ids)
    if mapping.dropped_without_symbol or mapping.merged_duplicates:
        notes.append(f"{path.name}: {mapping.dropped_without_symbol} gene(s) without a symbol dropped, "
                     f"{mapping.merged_duplicates} gene(s) sharing a symbol summed into it")
    return CountTable(mapping.counts, mapping.symbols, mapping.gene_ids, tuple(map(str, barcodes)),
                      (sample,) * counts.shape[0], labels, tuple(notes))


def read_10x_h5(path: Path) -> CountTable:
    """One 10x HDF5 matrix (any Cell Ranger version); features other than gene expression are counted
    and dropped."""
    import scanpy as sc

    try:
        adata = sc.read_10x_h5(path, gex_only=False)
    except Exception as exc:  # h5py and scanpy raise several types for files of another layout
        raise InputError(f"cannot read as a 10x HDF5 matrix ({type(exc).__name__}: {exc})", path=path) from None
    notes = []
    if "feature_types" in adata.var:
        gex = (adata.var["feature_types"] == "Gene Expression").to_numpy()
        if not gex.all():
            notes.append(f"{path.name}: {int((~gex).sum())} feature(s) other than gene expression dropped")
            adata = adata[:, gex]
    ids = adata.var["gene_ids"].to_numpy() if "gene_ids" in adata.var else adata.var_names.to_numpy()
    return _symbol_table(adata.X, adata.var_names.to_numpy(), ids, adata.obs_names,
                         sample_name(path, H5_SUFFIXES), path, notes)


def _partner(matrix: Path, kinds: tuple[str, ...], files: dict[str, Path]) -> Path:
    """The genes/features or barcodes file beside a matrix file, sharing its prefix."""
    prefix = MATRIX_NAME.sub("", matrix.name)
    for kind in kinds:
        for name in (f"{prefix}{kind}.tsv", f"{prefix}{kind}.tsv.gz"):
            if name in files:
                return files[name]
    raise InputError(f"no {' or '.join(f'{prefix}{k}.tsv(.gz)' for k in kinds)} among the files given for "
                     f"this matrix (given: {', '.join(sorted(files))}); pass it with --from", path=matrix)


def mtx_groups(paths: list[Path]) -> list[tuple[Path, Path, Path]]:
    """(matrix, genes, barcodes) per Matrix Market matrix among ``paths``; InputError without one."""
    files = {p.name: p for p in paths}
    matrices = sorted(p for p in paths if MATRIX_NAME.search(p.name))
    if not matrices:
        raise InputError(f"no Matrix Market file (*matrix.mtx(.gz) or *sparse.mtx) among {', '.join(sorted(files))}")
    return [(m, _partner(m, ("features", "genes"), files), _partner(m, ("barcodes",), files)) for m in matrices]


def _read_tsv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, sep="\t", header=None, dtype=str, keep_default_na=False, quoting=csv.QUOTE_NONE)


def _oriented(matrix: sparse.spmatrix, n_genes: int, n_cells: int, path: Path) -> sparse.csr_matrix:
    """The matrix as cells × genes (10x writes genes × cells; some authors the transpose)."""
    if matrix.shape == (n_genes, n_cells):
        return sparse.csr_matrix(matrix.T)
    if matrix.shape == (n_cells, n_genes):
        return sparse.csr_matrix(matrix)
    raise InputError(f"the matrix is {matrix.shape[0]} × {matrix.shape[1]} but its files list {n_genes} genes and "
                     f"{n_cells} barcodes; the three files are not one matrix's", path=path)


def read_mtx(matrix_path: Path, genes_path: Path, barcodes_path: Path) -> CountTable:
    """One Matrix Market matrix with its genes (1 column: symbols; 2+: id, symbol[, type]) and barcodes."""
    genes, barcodes = _read_tsv(genes_path), _read_tsv(barcodes_path).iloc[:, 0].to_numpy()
    opener = gzip.open if matrix_path.suffix == ".gz" else open
    with opener(matrix_path, "rb") as handle:
        matrix = _oriented(mmread(handle), len(genes), len(barcodes), matrix_path)
    notes = []
    if genes.shape[1] >= 3:
        gex = (genes.iloc[:, 2] == "Gene Expression").to_numpy()
        if not gex.all():
            notes.append(f"{genes_path.name}: {int((~gex).sum())} feature(s) other than gene expression dropped")
            matrix, genes = matrix[:, gex], genes[gex]
    symbols = genes.iloc[:, 1] if genes.shape[1] >= 2 else genes.iloc[:, 0]
    if looks_like_ensembl(symbols.to_numpy()):
        raise InputError("the genes file holds Ensembl ids only; a symbol column is needed to match the Xenium "
                         "panel (10x writes id and symbol: pass the features.tsv / genes.tsv of the same run)",
                         path=genes_path)
    return _symbol_table(matrix, symbols.to_numpy(), genes.iloc[:, 0].to_numpy(), barcodes,
                         sample_name(matrix_path, MATRIX_NAME), matrix_path, notes)


def text_lines(path: Path, n: int) -> list[str]:
    """The first ``n`` lines of a text file, gzip or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="") as handle:
        return [line.rstrip("\r\n") for line, _ in zip(handle, range(n))]


def separator(line: str) -> str | None:
    """The delimiter of a text table from one of its lines: tab, comma, else None (whitespace)."""
    return "\t" if "\t" in line else "," if "," in line else None


def split_fields(line: str, sep: str | None) -> list[str]:
    """One line's fields, quotes removed."""
    if sep is None:
        return [f.strip('"') for f in line.split()]
    return next(csv.reader(io.StringIO(line), delimiter=sep))


def _dense_header(path: Path) -> tuple[str | None, list[str]]:
    """The separator and the cell names of a genes × cells table (its header, with or without a name
    for the gene column)."""
    lines = text_lines(path, 2)
    if len(lines) < 2:
        raise InputError("a dense table needs a header line of cell names and at least one gene row", path=path)
    sep = separator(lines[0])
    header, first = split_fields(lines[0], sep), split_fields(lines[1], sep)
    if len(header) == len(first) - 1:  # R's write.table: no name above the gene column
        return sep, header
    if len(header) == len(first):
        return sep, header[1:]
    raise InputError(f"the header has {len(header)} fields but the first gene row {len(first)}; a dense table is "
                     "one gene per row: the gene name, then one value per cell", path=path)


def _dense_rows(path: Path, sep: str | None, n_cells: int) -> tuple[list[str], sparse.csr_matrix]:
    """The gene names and the (genes × cells) values of a dense table, read in chunks of rows."""
    rows = max(1, MAX_DENSE_VALUES // max(1, n_cells))
    genes, blocks = [], []
    reader = pd.read_csv(path, sep=sep or r"\s+", header=None, skiprows=1, chunksize=rows, low_memory=False)
    for chunk in reader:
        if chunk.shape[1] != n_cells + 1:
            raise InputError(f"a gene row has {chunk.shape[1] - 1} values for {n_cells} cells", path=path)
        try:
            values = chunk.iloc[:, 1:].to_numpy(dtype=np.float64)
        except ValueError as exc:
            raise InputError(f"a value of the table is not a number ({exc}) near gene {chunk.iloc[0, 0]!r}",
                             path=path) from None
        genes += chunk.iloc[:, 0].astype(str).tolist()
        blocks.append(sparse.csr_matrix(values))
    return genes, sparse.vstack(blocks, format="csr") if blocks else sparse.csr_matrix((0, n_cells))


def read_dense(path: Path, labels_from_header: bool) -> CountTable:
    """A dense genes × cells text table. With ``labels_from_header`` the column header is each cell's
    label (as in Moncada 2020) and cells are named ``<sample>_<column number>``."""
    sep, header = _dense_header(path)
    genes, values = _dense_rows(path, sep, len(header))
    sample = sample_name(path, re.compile(r"(\.(txt|tsv|csv|tab))?(\.gz)?$"))
    if labels_from_header:
        barcodes, labels = [f"{i + 1}" for i in range(len(header))], np.array(header, dtype=object)
    else:
        barcodes, labels = header, None
    return _symbol_table(values.T, genes, genes, barcodes, sample, path, [], labels)


def read_h5ad(path: Path, counts_source: str, gene_symbols: str | None, label_column: str | None) -> CountTable:
    """An h5ad (e.g. CELLxGENE): raw counts from ``counts_source`` (auto: raw.X, else layers/counts,
    else X), genes by symbol (Ensembl var_names through ``gene_symbols``, default feature_name …),
    labels from obs[``label_column``] when given.

    Only obs, var and the chosen matrix are read, the matrix in row blocks of about
    ``H5AD_BLOCK_VALUES`` stored values, each checked for whole numbers and kept as integers: a
    whole atlas's normalised X and a float copy of its counts are never held."""
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise InputError(f"cannot read the h5ad ({type(exc).__name__}: {exc})", path=path) from None
    with handle:
        try:
            obs, var = read_elem(handle["obs"]), read_elem(handle["var"])
            raw_var = read_elem(handle["raw/var"]) if "raw/X" in handle else None
        except Exception as exc:  # h5py/anndata raise several types for corrupt files
            raise InputError(f"cannot read the h5ad ({type(exc).__name__}: {exc})", path=path) from None
        layers = list(handle["layers"].keys()) if "layers" in handle else []
        if counts_source == "auto":
            counts_source = "raw" if raw_var is not None else "layers/counts" if "counts" in layers else "X"
        hint = (f"; pass --counts X, raw or layers/<name> (it has X{''.join(', layers/' + k for k in layers)}"
                f"{', raw' if raw_var is not None else ''})")
        element, var = _h5ad_counts_element(handle, counts_source, var, raw_var, path, hint)
        names = var.index.to_numpy()
        symbols = names
        if gene_symbols is not None or looks_like_ensembl(names):
            column = symbol_column(var, gene_symbols)
            if column is None:
                raise InputError(f"the genes are Ensembl ids and var has no symbol column "
                                 f"({gene_symbols or ', '.join(SYMBOL_COLUMNS)}; var columns: "
                                 f"{', '.join(map(str, var.columns)) or 'none'}); pass --gene-symbols COLUMN",
                                 path=path)
            symbols = var[column].to_numpy()
        if label_column is not None and label_column not in obs:
            raise InputError(f"obs has no label column {label_column!r} (columns: "
                             f"{', '.join(map(str, obs.columns))}); pass --label-column", path=path)
        labels = obs[label_column].to_numpy(dtype=object) if label_column else None
        counts = _integer_rows(element, f"counts in {path.name}", path, hint)
    try:
        return _symbol_table(counts, symbols, names, obs.index, path.stem, path, [], labels)
    except InputError as exc:
        raise InputError(f"{exc}{hint}") from None


def _h5ad_counts_element(handle: h5py.File, source: str, var: pd.DataFrame, raw_var: pd.DataFrame | None,
                         path: Path, hint: str) -> tuple[object, pd.DataFrame]:
    """The stored matrix at ``source`` (``X``, ``raw`` or ``layers/<name>``), unread, with its genes'
    var frame (raw.var completed with var's columns, which CELLxGENE keeps the symbols in)."""
    if source == "raw":
        if raw_var is None:
            raise InputError("the h5ad has no raw counts (.raw)" + hint, path=path)
        completed = raw_var.copy()
        for column in var.columns.difference(completed.columns):
            completed[column] = var[column].reindex(completed.index)
        return handle["raw/X"], completed
    key = source if source == "X" else f"layers/{source.removeprefix('layers/')}"
    if key not in handle:
        raise InputError(f"the h5ad has no {source}" + hint, path=path)
    return handle[key], var


def _integer_rows(element: h5py.Dataset | h5py.Group, what: str, path: Path, hint: str) -> sparse.csr_matrix:
    """A stored matrix (dense, CSR or CSC) as integer CSR, read and checked in row blocks of about
    ``H5AD_BLOCK_VALUES`` stored values (a CSC matrix, which cannot be read by rows, is read whole)."""
    audit = CountAudit()
    if isinstance(element, h5py.Dataset):
        shape = element.shape
        step = max(1, H5AD_BLOCK_VALUES // max(1, shape[1]))
        reads = (sparse.csr_matrix(element[start:start + step]) for start in range(0, shape[0], step))
    else:
        matrix = sparse_dataset(element)
        shape = matrix.shape
        if matrix.format != "csr":
            reads = iter([sparse.csr_matrix(matrix.to_memory())])
        else:
            indptr = element["indptr"][:]
            reads = (matrix[start:stop] for start, stop in _row_blocks(indptr, H5AD_BLOCK_VALUES))
    blocks = [sparse.csr_matrix((0, shape[1]), dtype=np.int32)]
    for block in reads:
        audit.add(block.data)
        if not (audit.nonfinite or audit.negative or audit.fractional):  # past the first bad block: count only
            blocks.append(block.astype(np.int64 if audit.maximum >= 2**31 else np.int32))
    audit.raise_if_not_counts(what, path, None, "; a reference needs raw integer counts (UMIs or reads), not "
                              "normalised values" + hint)
    return sparse.vstack(blocks, format="csr")


def _row_blocks(indptr: np.ndarray, values: int) -> list[tuple[int, int]]:
    """Consecutive row ranges of a CSR matrix with about ``values`` stored values each (one row at least)."""
    bounds, start = [], 0
    n_rows = len(indptr) - 1
    while start < n_rows:
        stop = int(np.searchsorted(indptr, indptr[start] + values, side="right")) - 1
        stop = min(max(stop, start + 1), n_rows)
        bounds.append((start, stop))
        start = stop
    return bounds
