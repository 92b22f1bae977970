"""Reference-guided label transfer: scRNA-seq reference → Xenium cells, on the genes they share.

Both sides are normalised the same way — counts per cell scaled to a common total, then log1p
(scanpy) — and then z-scored with the *reference's* per-gene mean and SD, i.e. the query is
projected into the reference's space, as scanpy's ``ingest`` does. Centring each dataset on its
own mean was tried and rejected: a section that is 80 % hepatocytes has a high mean ALB, so its
hepatocytes lose their marker signal (see docs/decisions/0005). A multinomial logistic regression
(scikit-learn, class-balanced, L2) fitted on the reference predicts every Xenium cell; its
highest class probability is the cell's confidence.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from scipy import sparse
from sklearn.linear_model import LogisticRegression

from cellpath.annotation.coverage import type_centroids
from cellpath.annotation.genes import SYMBOL_COLUMNS, collapse_to_symbols, describe, looks_like_ensembl, symbol_column
from cellpath.annotation.ontology import (ONTOLOGY_VOCABULARY, LabelResolution, resolve_reference_labels,
                                          unknown_labels_message)
from cellpath.errors import InputError

log = logging.getLogger(__name__)

UNCERTAIN = "Uncertain cell"
#: cells per block of a section's normalisation, z-scoring and prediction: scikit-learn's product with
#: the float64 coefficients would otherwise hold a float64 copy of the whole section (11 GB at
#: 283,000 cells × 5,000 genes)
SECTION_BLOCK_ROWS = 16_384


@dataclass(frozen=True)
class Reference:
    """A labelled reference: raw counts (cells × genes) and ontology labels per cell."""

    name: str
    path: Path
    counts: sparse.csr_matrix
    genes: tuple[str, ...]
    labels: np.ndarray  # ontology names
    #: reference cells left out because their label is recorded as mapping to no type: label → cells
    excluded: dict[str, int] = field(default_factory=dict)
    vocabulary: str = ONTOLOGY_VOCABULARY


@dataclass
class CountAudit:
    """Running tallies of what makes stored values not raw counts, over a matrix read whole or in row
    blocks (:meth:`add` per block): non-finite, negative and fractional values, the first fractional
    one and the largest value. Integer values are whole by their type and only checked for sign."""

    values: int = 0
    nonfinite: int = 0
    negative: int = 0
    fractional: int = 0
    example: float | None = None
    maximum: float = float("-inf")

    def add(self, data: np.ndarray) -> None:
        self.values += len(data)
        if len(data) == 0:
            return
        if np.issubdtype(data.dtype, np.integer):
            self.negative += int((data < 0).sum())
            self.maximum = max(self.maximum, float(data.max()))
            return
        finite = np.isfinite(data)
        self.nonfinite += int(len(data) - finite.sum())
        self.negative += int((data < 0).sum())
        fractional = np.abs(data - np.rint(data)) > 1e-6
        self.fractional += int(fractional.sum())
        if self.example is None and fractional.any():
            self.example = float(data[np.argmax(fractional)])
        if finite.any():
            self.maximum = max(self.maximum, float(data[finite].max()))

    def raise_if_not_counts(self, what: str, path: Path, section: str | None, hint: str = "") -> None:
        """One InputError naming the file, the first kind of offending value and ``hint`` (where
        counts may be); nothing when every value was a finite, non-negative whole number."""
        if self.nonfinite:
            raise InputError(f"{what} contains {self.nonfinite} NaN or infinite counts", path=path, section=section)
        if self.negative:
            raise InputError(f"{what} contains {self.negative} negative counts; raw counts are required" + hint,
                             path=path, section=section)
        if self.fractional:
            raise InputError(f"{what} are not raw counts: {self.fractional} of {self.values} non-zero values are not "
                             f"whole numbers (e.g. {self.example:.4g}; max {self.maximum:.4g}) — normalised or "
                             f"log-transformed data, which label transfer would normalise a second time" + hint,
                             path=path, section=section)


def check_counts(matrix: sparse.spmatrix | np.ndarray, what: str, path: Path, section: str | None,
                 hint: str = "") -> sparse.csr_matrix:
    """``matrix`` as CSR if it holds raw counts: finite, non-negative whole numbers; else one
    InputError naming the file, the first offending value and ``hint`` (where counts may be)."""
    matrix = sparse.csr_matrix(matrix)
    audit = CountAudit()
    audit.add(matrix.data)
    audit.raise_if_not_counts(what, path, section, hint)
    return matrix


def counts_at(adata: ad.AnnData, source: str, path: Path, hint: str) -> tuple[object, pd.DataFrame]:
    """The matrix at ``source`` (``X``, ``raw`` or ``layers/<name>``) and the var frame of its genes."""
    if source == "raw":
        if adata.raw is None:
            raise InputError("annotate.reference_counts is 'raw' but the reference has no .raw" + hint, path=path)
        var = adata.raw.var.copy()
        for column in adata.var.columns.difference(var.columns):  # raw.var often lacks the symbol column
            var[column] = adata.var[column].reindex(var.index)
        return adata.raw.X, var
    if source.startswith("layers/"):
        name = source.removeprefix("layers/")
        if name not in adata.layers:
            raise InputError(f"annotate.reference_counts names layers/{name}, which the reference lacks" + hint,
                             path=path)
        return adata.layers[name], adata.var
    return adata.X, adata.var


def reference_counts(adata: ad.AnnData, source: str, path: Path,
                     gene_symbols: str | None = None) -> tuple[sparse.csr_matrix, tuple[str, ...]]:
    """The reference's raw counts and their genes, from ``source`` (see
    ``vocabulary.REFERENCE_COUNT_SOURCE_PATTERN``); InputError naming the file and the layers it has
    when they are not counts. Genes are symbols: see :func:`symbol_genes`."""
    layers = sorted(map(str, adata.layers.keys()))
    available = ", ".join([*(f"layers/{name}" for name in layers), *(["raw"] if adata.raw is not None else [])])
    hint = (f". Set annotate.reference_counts to where this file keeps its raw counts (it has "
            f"{available or 'no layers and no .raw'}; auto reads layers/counts, else X)")
    if source == "auto":
        source = "layers/counts" if "counts" in adata.layers else "X"
    matrix, var = counts_at(adata, source, path, hint)
    counts = check_counts(matrix, f"reference counts ({source})", path, None, hint)
    return symbol_genes(counts, var, gene_symbols, path)


def symbol_genes(counts: sparse.csr_matrix, var: pd.DataFrame, requested: str | None,
                 path: Path) -> tuple[sparse.csr_matrix, tuple[str, ...]]:
    """The genes as symbols. var_names are used as they are unless they are Ensembl ids or
    ``requested`` (``annotate.gene_symbols``) names a var column; then symbols come from that column
    (default: the first of feature_name, gene_symbols, gene_symbol) and genes sharing one are summed."""
    names = tuple(map(str, var.index))
    if requested is None and not looks_like_ensembl(names):
        return counts, names
    column = symbol_column(var, requested)
    columns = ", ".join(map(str, var.columns)) or "none"
    if column is None and requested is not None:
        raise InputError(f"annotate.gene_symbols names var column {requested!r}, which the reference lacks (var "
                         f"columns: {columns}); set it to the column that holds the gene symbols", path=path)
    if column is None:
        raise InputError(
            f"the reference's genes are Ensembl ids (e.g. {names[0]}) and var has none of the columns "
            f"{', '.join(SYMBOL_COLUMNS)} (var columns: {columns}); the Xenium panel names genes by symbol, so set "
            "annotate.gene_symbols to the var column that holds the gene symbols", path=path)
    mapping = collapse_to_symbols(counts, var[column].to_numpy(), names)
    if not mapping.symbols:
        raise InputError(f"var[{column!r}] holds no gene symbols; set annotate.gene_symbols to the column that "
                         "does", path=path)
    log.info("reference %s: %s", path.name, describe(mapping, f"var[{column!r}]"))
    return mapping.counts, mapping.symbols


def _resolved_labels(raw_labels: np.ndarray, vocabulary: str, path: Path) -> LabelResolution:
    """The labels resolved in ``vocabulary``; InputError naming the file when the vocabulary lacks some."""
    resolution = resolve_reference_labels(list(raw_labels), vocabulary)
    if resolution.unknown:
        raise InputError(unknown_labels_message(resolution), path=path)
    if not resolution.mapped:
        raise InputError(f"every label of the reference is recorded as mapping to no cell type in vocabulary "
                         f"{vocabulary!r}: nothing to transfer", path=path)
    return resolution


def _read_h5ad(path: Path) -> ad.AnnData:
    if not path.is_file():
        raise InputError("reference file not found", path=path)
    try:
        return ad.read_h5ad(path)
    except Exception as exc:  # h5py/anndata raise several types for corrupt files
        raise InputError(f"cannot read the reference ({type(exc).__name__}: {exc})", path=path) from None


def load_reference(path: Path, label_column: str, vocabulary: str | None, counts_source: str = "auto",
                   gene_symbols: str | None = None) -> Reference:
    """Read a reference .h5ad (raw counts from ``counts_source``, see :func:`reference_counts`) and
    map its labels onto the ontology (InputError names the file). Cells whose label the vocabulary
    records as mapping to no type are left out, counted and logged."""
    path = Path(path)
    adata = _read_h5ad(path)
    if label_column not in adata.obs:
        raise InputError(f"reference has no label column {label_column!r} in obs (columns: "
                         f"{', '.join(map(str, adata.obs.columns))}); set annotate.label_column", path=path)
    counts, genes = reference_counts(adata, counts_source, path, gene_symbols)
    meta = adata.uns.get("reference")
    declared = meta.get("label_vocabulary") if isinstance(meta, dict) else None
    vocabulary = vocabulary or declared or ONTOLOGY_VOCABULARY
    raw_labels = adata.obs[label_column].astype(str).to_numpy()
    resolution = _resolved_labels(raw_labels, vocabulary, path)
    keep = np.array([label in resolution.mapped for label in raw_labels], dtype=bool)
    excluded = {label: int((raw_labels == label).sum()) for label in resolution.unmapped}
    if excluded:
        log.warning("reference %s (vocabulary %r, obs[%r]): %d of %d cells left out, their labels map to no cell "
                    "type: %s", path.name, vocabulary, label_column, int((~keep).sum()), len(raw_labels),
                    "; ".join(f"{label!r} ({n} cells: {resolution.unmapped[label]})" for label, n in excluded.items()))
    labels = np.array([resolution.mapped[label] for label in raw_labels[keep]], dtype=object)
    return Reference(path.stem, path, counts[keep] if not keep.all() else counts, genes, labels, excluded, vocabulary)


def log_normalise(counts: sparse.spmatrix, target_sum: float = 1e3) -> np.ndarray:
    """Counts per cell scaled to ``target_sum``, then log1p (dense float32, cells × genes)."""
    adata = ad.AnnData(X=sparse.csr_matrix(counts, dtype=np.float32))
    sc.pp.normalize_total(adata, target_sum=target_sum)
    sc.pp.log1p(adata)
    return adata.X.toarray()


@dataclass(frozen=True)
class GeneScaler:
    """Per-gene mean and SD of the reference's log-normalised expression."""

    mean: np.ndarray
    sd: np.ndarray

    @classmethod
    def fit(cls, logged: np.ndarray) -> "GeneScaler":
        sd = logged.std(axis=0)
        return cls(logged.mean(axis=0), np.where(sd > 1e-6, sd, 1.0))

    def transform(self, logged: np.ndarray) -> np.ndarray:
        """z-scores clipped to ±10, float32, computed in one buffer beside ``logged`` (a section's
        cells × genes is 5.7 GB at 283,000 × 5,000)."""
        scaled = np.subtract(logged, self.mean, dtype=np.float32)
        scaled /= self.sd
        return np.clip(scaled, -10.0, 10.0, out=scaled)


@dataclass(frozen=True)
class TransferModel:
    """A classifier fitted on a reference over a fixed, ordered gene list, and each class's mean
    z-scored profile (``centroids``, classes × genes, in ``classes`` order)."""

    reference: str
    genes: tuple[str, ...]
    scaler: GeneScaler
    classifier: LogisticRegression
    centroids: np.ndarray

    @property
    def classes(self) -> np.ndarray:
        return self.classifier.classes_


def fit_transfer(reference: Reference, panel_genes: tuple[str, ...], *, regularisation_c: float,
                 min_shared_genes: int, section: str | None = None) -> TransferModel:
    """Fit the classifier on the genes shared by the reference and the panel (panel order)."""
    ref_index = {g: i for i, g in enumerate(reference.genes)}
    shared = tuple(g for g in panel_genes if g in ref_index)
    if len(shared) < min_shared_genes:
        raise InputError(
            f"the reference shares {len(shared)} gene(s) with the Xenium panel (at least {min_shared_genes} needed); "
            f"it is the wrong reference for this section or uses other gene identifiers (its genes: "
            f"{', '.join(reference.genes[:3])}, …; the panel's: {', '.join(panel_genes[:3])}, …): set "
            "annotate.gene_symbols to the reference's var column of gene symbols", path=reference.path,
            section=section)
    logged = log_normalise(reference.counts[:, [ref_index[g] for g in shared]])
    scaler = GeneScaler.fit(logged)
    scaled, labels = scaler.transform(logged), reference.labels.astype(str)
    del logged
    classifier = LogisticRegression(C=regularisation_c, class_weight="balanced", max_iter=2000, tol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lbfgs convergence chatter on tiny references
        classifier.fit(scaled, labels)
    return TransferModel(reference.name, shared, scaler, classifier,
                         type_centroids(scaled, labels, classifier.classes_))


def reference_space(model: TransferModel, counts: sparse.spmatrix, panel_genes: tuple[str, ...]) -> np.ndarray:
    """A section's cells (``counts``: cells × ``panel_genes``) log-normalised on the model's genes and
    z-scored with the reference's per-gene mean and SD (cells × model genes, float32)."""
    index = {g: i for i, g in enumerate(panel_genes)}
    counts = sparse.csr_matrix(counts)[:, [index[g] for g in model.genes]]
    projected = np.empty(counts.shape, dtype=np.float32)
    for start in range(0, counts.shape[0], SECTION_BLOCK_ROWS):  # every step is per cell: blocks change no value
        stop = start + SECTION_BLOCK_ROWS
        projected[start:stop] = model.scaler.transform(log_normalise(counts[start:stop]))
    return projected


@dataclass(frozen=True)
class Transferred:
    """Per-cell transfer result: predicted ontology type, its probability, and the final label."""

    predicted: np.ndarray
    confidence: np.ndarray
    label: np.ndarray  # predicted, or "Uncertain cell" below the confidence threshold


def transfer_labels(model: TransferModel, projected: np.ndarray, confidence_threshold: float) -> Transferred:
    """Predict every cell of a section (``projected``: its :func:`reference_space` profiles)."""
    probabilities = np.concatenate([model.classifier.predict_proba(projected[start:start + SECTION_BLOCK_ROWS])
                                    for start in range(0, len(projected), SECTION_BLOCK_ROWS)]
                                   or [np.zeros((0, len(model.classes)))])
    best = probabilities.argmax(axis=1)
    predicted = model.classes[best].astype(object)
    confidence = probabilities[np.arange(len(best)), best]
    label = np.where(confidence >= confidence_threshold, predicted, UNCERTAIN).astype(object)
    return Transferred(predicted, confidence, label)
