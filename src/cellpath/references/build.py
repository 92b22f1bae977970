"""Build the ``<name>.h5ad`` annotate reads from a reference's public files.

The output holds raw integer counts in X (cells × genes, CSR), gene symbols as var_names (Ensembl
ids in ``var["gene_ids"]``), the label in ``obs[label_column_out]`` (default ``cell_type``, the
annotate default) and the sample in ``obs["sample"]``, and in ``uns["reference"]`` the label
vocabulary annotate maps the labels with, the source (citation, accession, files) and what was left
out. Each manifest ``builder`` is one public shape (cellpath.references.readers); ``tpm-refused``
(Tirosh 2016) is refused: transfer normalises raw counts per cell, which TPM values are not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
from scipy import sparse

from cellpath.annotation.assignment import CAVEATS
from cellpath.annotation.ontology import resolve_reference_labels
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.references.annotations import join_labels, read_annotation_table
from cellpath.references.manifest import ReferenceEntry
from cellpath.references.readers import CountTable, mtx_groups, read_10x_h5, read_dense, read_h5ad, read_mtx


@dataclass(frozen=True)
class BuildOptions:
    """What the command line may set beyond the manifest row (None: the manifest's value)."""

    label_column: str | None = None
    annotations: tuple[Path, ...] = ()  # cell annotation tables (default: the tables among the files)
    barcode_column: str | None = None
    vocabulary: str | None = None
    counts: str = "auto"
    gene_symbols: str | None = None
    label_column_out: str = "cell_type"


@dataclass(frozen=True)
class BuiltReference:
    """The reference's AnnData and a summary of what was read, left out and how its labels map."""

    adata: ad.AnnData
    summary: tuple[str, ...]


def refuse_unbuildable(entry: ReferenceEntry) -> None:
    """InputError for a reference whose published values are not counts (``tpm-refused``)."""
    if entry.builder == "tpm-refused":
        raise InputError(
            f"{entry.name} ({entry.citation}, {entry.accession}) cannot be built: it publishes {entry.counts_location}. "
            "Label transfer normalises each cell's raw counts (counts per cell scaled to a common total, then "
            "log1p) and refuses values that are not whole numbers; TPM has lost the counts and their per-cell "
            f"totals. Instead, put a {entry.tissue_state.lower()} reference with raw UMI counts in data/references/ "
            "under a name of your own (an h5ad with the counts in X or layers['counts'], or built with `cellpath "
            "references build` from a manifest row of your own, --manifest) and map those sections to it in "
            "annotate.references")


def _split_files(entry: ReferenceEntry, files: list[Path], options: BuildOptions) -> tuple[list[Path], list[Path]]:
    """The count files of ``entry``'s shape among ``files``, and the other (table) files."""
    named = {a.resolve() for a in options.annotations}
    files = [f for f in files if f.resolve() not in named]
    if entry.builder == "10x-mtx":
        data = [f for group in mtx_groups(files) for f in group]
    elif entry.builder == "10x-h5":
        data = [f for f in files if f.name.endswith(".h5")]
    elif entry.builder == "cellxgene-h5ad":
        data = [f for f in files if f.name.endswith(".h5ad")]
    else:  # dense-table
        if entry.labels_from == "annotation" and not options.annotations and len(files) > 1:
            raise InputError(f"{entry.name}: several tables given ({', '.join(f.name for f in files)}); name the "
                             "cell annotation table with --annotations, the others are read as counts")
        data = files
    if not data:
        raise InputError(f"{entry.name}: no {entry.builder} file among {', '.join(f.name for f in files)} "
                         f"(the manifest lists: {entry.files})")
    return data, [f for f in files if f not in data]


def _combine(tables: list[CountTable]) -> CountTable:
    """Several samples' tables as one, on the genes every sample has (those dropped are noted)."""
    if len(tables) == 1:
        return tables[0]
    common = set(tables[0].symbols).intersection(*(t.symbols for t in tables[1:]))
    genes = [g for g in tables[0].symbols if g in common]
    blocks, notes = [], [n for t in tables for n in t.notes]
    for table in tables:
        index = {g: j for j, g in enumerate(table.symbols)}
        blocks.append(table.counts[:, [index[g] for g in genes]])
        if len(table.symbols) > len(genes):
            notes.append(f"sample {table.samples[0]}: {len(table.symbols) - len(genes)} gene(s) absent from another "
                         "sample dropped")
    ids = dict(zip(tables[0].symbols, tables[0].gene_ids))
    labels = None if any(t.labels is None for t in tables) else np.concatenate([t.labels for t in tables])
    return CountTable(sparse.vstack(blocks, format="csr"), tuple(genes), tuple(ids[g] for g in genes),
                      tuple(b for t in tables for b in t.barcodes), tuple(s for t in tables for s in t.samples),
                      labels, tuple(notes))


def read_counts(entry: ReferenceEntry, data: list[Path], options: BuildOptions, label_column: str | None) -> CountTable:
    """Every sample among ``data`` read with ``entry``'s shape, as one table."""
    if entry.builder == "10x-mtx":
        tables = [read_mtx(*group) for group in mtx_groups(data)]
    elif entry.builder == "10x-h5":
        tables = [read_10x_h5(path) for path in data]
    elif entry.builder == "cellxgene-h5ad":
        obs_column = label_column if entry.labels_from == "obs" else None
        tables = [read_h5ad(path, options.counts, options.gene_symbols, obs_column) for path in data]
    else:
        tables = [read_dense(path, labels_from_header=entry.labels_from == "header") for path in data]
    table = _combine(tables)
    ids = table.cell_ids
    if len(set(ids)) < len(ids):
        repeated = pd.Series(ids)[pd.Series(ids).duplicated()].iloc[0]
        raise InputError(f"{entry.name}: cell id {repeated!r} occurs twice: pass each sample's files once")
    return table


def _annotation_table(entry: ReferenceEntry, tables: list[Path], options: BuildOptions) -> tuple[pd.DataFrame, Path]:
    """The cell annotation tables (``--annotations``, else the tables among the files) as one frame,
    and the file to name in messages."""
    paths = list(options.annotations) or tables
    if not paths:
        raise InputError(f"{entry.name}: its labels are in a cell annotation table ({entry.files}); pass it with "
                         "--from or --annotations")
    frames = [read_annotation_table(path) for path in paths]
    columns = set(frames[0].columns)
    if any(set(f.columns) != columns for f in frames[1:]):
        raise InputError(f"{entry.name}: the annotation tables {', '.join(p.name for p in paths)} have different "
                         "columns; pass only the tables of this reference", path=paths[1])
    return pd.concat(frames, ignore_index=True), paths[0]


def cell_labels(entry: ReferenceEntry, table: CountTable, tables: list[Path], options: BuildOptions,
                label_column: str) -> tuple[np.ndarray, dict[str, int], str]:
    """Each cell's label (None: left out), the cells left out by reason, and where labels came from."""
    if entry.labels_from in ("header", "obs"):
        labels = np.array([None if v is None or str(v) in ("", "nan") else str(v) for v in table.labels], dtype=object)
        where = "the column header" if entry.labels_from == "header" else f"obs[{label_column!r}]"
        return labels, {"empty label": int(sum(v is None for v in labels))}, where
    frame, path = _annotation_table(entry, tables, options)
    joined = join_labels(table.cell_ids, table.barcodes, frame, options.barcode_column or entry.annotation_key
                         or None, label_column, path)
    left_out = {"no row in the annotation table": joined.cells_without_row, "empty label": joined.cells_with_empty_label}
    where = (f"{path.name} column {label_column!r}, matched on the {joined.matched_on} ({joined.rows_without_cell} "
             "row(s) of the table match no cell)")
    return joined.labels, left_out, where


def _vocabulary_lines(labels: np.ndarray, vocabulary: str | None) -> list[str]:
    """How the labels map in ``vocabulary``: mapped cells, cells annotate will leave out, unknown labels."""
    if not vocabulary:
        return ["no label vocabulary: annotate maps the labels with annotate.label_vocabulary (or takes them as "
                "ontology names)"]
    resolution = resolve_reference_labels(list(labels), vocabulary)
    counts = pd.Series(labels).value_counts()
    lines = [f"vocabulary {vocabulary}: {len(resolution.mapped)} label(s) map to "
             f"{len(set(resolution.mapped.values()))} ontology type(s) ({int(counts[list(resolution.mapped)].sum())} "
             "cells)"]
    if resolution.unmapped:
        lines.append("recorded as no cell type, left out by annotate: " + "; ".join(
            f"{label!r} ({int(counts[label])} cells: {reason})" for label, reason in resolution.unmapped.items()))
    if resolution.unknown:
        lines.append(f"WARNING: {len(resolution.unknown)} label(s) have no row in the vocabulary and annotate will "
                     f"stop on them: {', '.join(map(repr, resolution.unknown))}; add rows to "
                     "cellpath/annotation/data/label_aliases.csv")
    return lines


def reference_anndata(entry: ReferenceEntry, table: CountTable, labels: np.ndarray, options: BuildOptions,
                      meta: dict) -> ad.AnnData:
    """The AnnData annotate reads: integer counts, symbols, the label column, provenance in uns."""
    counts = table.counts
    dtype = np.int32 if counts.nnz == 0 or counts.data.max() < 2**31 else np.int64
    obs = pd.DataFrame({options.label_column_out: pd.Categorical(labels.astype(str)),
                        "sample": pd.Categorical(table.samples)}, index=pd.Index(table.cell_ids, name="cell_id"))
    var = pd.DataFrame({"gene_ids": list(table.gene_ids)}, index=pd.Index(table.symbols, name="gene_symbol"))
    uns = {"reference": {"name": entry.name, "citation": entry.citation, "accession": entry.accession,
                         "counts": "raw", **meta}}
    if options.vocabulary or entry.label_vocabulary:
        uns["reference"]["label_vocabulary"] = options.vocabulary or entry.label_vocabulary
    return ad.AnnData(X=sparse.csr_matrix(counts, dtype=dtype), obs=obs, var=var, uns=uns)


def build_reference(entry: ReferenceEntry, files: list[Path], options: BuildOptions) -> BuiltReference:
    """Read ``files`` (the reference's downloads) with ``entry``'s shape into the reference AnnData."""
    refuse_unbuildable(entry)
    label_column = options.label_column or entry.label_column
    if entry.labels_from == "" and not options.annotations:
        raise InputError(f"{entry.name}: the manifest knows no cell-type labels for it ({entry.notes}); pass the "
                         "labels with --annotations FILE --label-column COLUMN")
    if options.annotations:
        entry = replace(entry, labels_from="annotation")
    if entry.labels_from == "annotation" and not label_column:
        raise InputError(f"{entry.name}: name the annotation table's label column with --label-column")
    missing = [f for f in [*files, *options.annotations] if not f.is_file()]
    if missing:
        raise InputError(f"{entry.name}: file(s) not found: {', '.join(map(str, missing))}")
    data, tables = _split_files(entry, files, options)
    table = read_counts(entry, data, options, label_column)
    labels, left_out, where = cell_labels(entry, table, tables, options, label_column)
    keep = np.array([v is not None for v in labels], dtype=bool)
    kept = replace(table, counts=table.counts[keep], barcodes=tuple(np.array(table.barcodes)[keep]),
                   samples=tuple(np.array(table.samples)[keep]), labels=None)
    meta = {"label_source": where, "built_from": sorted(f.name for f in [*data, *tables, *options.annotations]),
            "cells_read": len(labels), "cells_left_out": {k: v for k, v in left_out.items() if v}}
    adata = reference_anndata(entry, kept, labels[keep], options, meta)
    summary = [f"{entry.name}: {adata.n_obs} cells × {adata.n_vars} genes from {len(set(table.samples))} sample(s) "
               f"({', '.join(f.name for f in data)})",
               f"labels from {where}; left out: " + (", ".join(f"{n} cell(s) with {k}" for k, n in left_out.items() if n)
                                                     or "none"),
               *table.notes, *_vocabulary_lines(labels[keep], adata.uns["reference"].get("label_vocabulary"))]
    if entry.name in CAVEATS:
        summary.append(f"CAVEAT: {CAVEATS[entry.name]}")
    return BuiltReference(adata, tuple(summary))


def write_reference(adata: ad.AnnData, out: Path) -> None:
    """Write the reference atomically (a crash leaves the previous file or none)."""
    with atomic_output(out) as tmp:
        adata.write_h5ad(tmp)
