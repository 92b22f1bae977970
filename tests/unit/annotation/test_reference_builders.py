"""`cellpath references build`'s readers: each public shape, written small in a tmp folder, becomes
the h5ad annotate reads (integer counts, symbols, the label column); TPM and non-integer values
are refused; what is left out is counted."""

from __future__ import annotations

import gzip
from dataclasses import replace
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
from scipy import sparse
from scipy.io import mmwrite

from cellpath.annotation.transfer import load_reference
from cellpath.errors import InputError
from cellpath.references.build import BuildOptions, build_reference, write_reference
from cellpath.references.manifest import ReferenceEntry, read_reference_manifest

MANIFEST = read_reference_manifest()
GENES = ["CD3E", "MS4A1", "COL1A1", "EPCAM", "PECAM1"]
IDS = [f"ENSG{i:011d}" for i in range(len(GENES))]
BARCODES = ["AAAC-1", "AAAG-1", "AACT-1", "AAGT-1"]
COUNTS = np.array([[5, 0, 1, 0, 0], [0, 7, 0, 0, 2], [0, 0, 9, 1, 0], [1, 0, 0, 8, 0]])  # cells × genes


def _entry(builder: str, labels_from: str = "annotation", label_column: str = "celltype", **changes) -> ReferenceEntry:
    """A manifest row of ``builder``'s shape whose labels are ontology names (no vocabulary needed)."""
    base = MANIFEST["wu2021_breast"]
    fields = {"annotation_key": "", "label_vocabulary": ""} | changes
    return replace(base, name="toy", builder=builder, labels_from=labels_from, label_column=label_column, **fields)


def _annotations(path: Path, keys=BARCODES, labels=("CD4 T cell", "B cell", "Fibroblast", "Normal epithelial general"),
                 sep=",", label_name="celltype") -> Path:
    pd.DataFrame({"barcode": list(keys), label_name: list(labels)}).to_csv(path, sep=sep, index=False)
    return path


def _write_mtx(folder: Path, prefix: str, counts=COUNTS, genes=(IDS, GENES), barcodes=BARCODES, gz=True) -> list[Path]:
    """A 10x Matrix Market triplet (genes × cells), ``<prefix>matrix.mtx(.gz)``, genes and barcodes."""
    suffix = ".gz" if gz else ""
    matrix = folder / f"{prefix}matrix.mtx"
    mmwrite(matrix, sparse.coo_matrix(np.asarray(counts).T))
    if gz:
        matrix.with_name(matrix.name + ".gz").write_bytes(gzip.compress(matrix.read_bytes()))
        matrix.unlink()
    genes_path, barcodes_path = folder / f"{prefix}genes.tsv{suffix}", folder / f"{prefix}barcodes.tsv{suffix}"
    pd.DataFrame(list(zip(*genes))).to_csv(genes_path, sep="\t", header=False, index=False)
    pd.Series(list(barcodes)).to_csv(barcodes_path, sep="\t", header=False, index=False)
    return [folder / f"{prefix}matrix.mtx{suffix}", genes_path, barcodes_path]


def _write_10x_h5(path: Path, counts=COUNTS) -> Path:
    """A Cell Ranger 3 HDF5 matrix with one antibody feature beside the genes."""
    matrix = sparse.csc_matrix(np.hstack([counts, np.full((len(counts), 1), 3)]).T)  # features × cells
    with h5py.File(path, "w") as handle:
        group = handle.create_group("matrix")
        group["data"], group["indices"], group["indptr"] = matrix.data.astype(np.int32), matrix.indices, matrix.indptr
        group["shape"] = np.array(matrix.shape, dtype=np.int32)
        group["barcodes"] = np.array(BARCODES, dtype="S")
        features = group.create_group("features")
        features["id"] = np.array([*IDS, "CD3_TotalSeqB"], dtype="S")
        features["name"] = np.array([*GENES, "CD3"], dtype="S")
        features["feature_type"] = np.array(["Gene Expression"] * len(GENES) + ["Antibody Capture"], dtype="S")
        features["genome"] = np.array(["GRCh38"] * (len(GENES) + 1), dtype="S")
    return path


def _check_output(adata: ad.AnnData, labels=("CD4 T cell", "B cell", "Fibroblast", "Normal epithelial general")):
    assert list(adata.var_names) == GENES
    assert adata.X.dtype == np.int32 and (adata.X.toarray() == COUNTS).all()
    assert list(adata.obs["cell_type"]) == list(labels)


def test_10x_matrix_market_with_a_prefix_and_an_annotation_csv(tmp_path):
    files = _write_mtx(tmp_path, "GSM1_tumour_")
    built = build_reference(_entry("10x-mtx"), [*files, _annotations(tmp_path / "cells.csv")], BuildOptions())
    _check_output(built.adata)
    assert list(built.adata.var["gene_ids"]) == IDS and list(built.adata.obs_names) == BARCODES
    assert "matched on the cell id" in "\n".join(built.summary)


def test_wu_2021_count_matrix_files_one_column_of_symbols_cells_by_genes(tmp_path):
    mmwrite(tmp_path / "count_matrix_sparse.mtx", sparse.coo_matrix(COUNTS.T))
    pd.Series(GENES).to_csv(tmp_path / "count_matrix_genes.tsv", header=False, index=False)
    pd.Series(BARCODES).to_csv(tmp_path / "count_matrix_barcodes.tsv", header=False, index=False)
    meta = pd.DataFrame({"orig.ident": "CID1", "celltype": ["CD4 T cell", "B cell", "Fibroblast",
                                                             "Normal epithelial general"]}, index=BARCODES)
    meta.to_csv(tmp_path / "metadata.csv")  # the barcode is the unnamed first column
    files = sorted(tmp_path.iterdir())
    _check_output(build_reference(_entry("10x-mtx"), files, BuildOptions()).adata)


def test_10x_hdf5_drops_and_counts_other_features(tmp_path):
    h5 = _write_10x_h5(tmp_path / "S1_filtered_feature_bc_matrix.h5")
    built = build_reference(_entry("10x-h5"), [h5, _annotations(tmp_path / "anno.tsv", sep="\t")], BuildOptions())
    _check_output(built.adata)
    assert any("1 feature(s) other than gene expression dropped" in line for line in built.summary)


@pytest.mark.parametrize(("sep", "gene_column_named", "suffix"), [("\t", False, ".txt.gz"), (",", True, ".csv"),
                                                                   (" ", True, ".txt")])
def test_dense_genes_by_cells_tables_with_an_annotation_table(tmp_path, sep, gene_column_named, suffix):
    frame = pd.DataFrame(COUNTS.T, index=pd.Index(GENES, name="Index"), columns=BARCODES)
    path = tmp_path / f"GSE1_raw_UMI_matrix{suffix}"
    frame.to_csv(path, sep=sep, index_label="Index" if gene_column_named else False)
    annotation = _annotations(tmp_path / "cell_annotation.txt", sep="\t")
    built = build_reference(_entry("dense-table", annotation_key="barcode"), [path],
                            BuildOptions(annotations=(annotation,)))
    _check_output(built.adata)


def test_dense_table_whose_column_header_is_the_label(tmp_path):
    labels = ["CD4 T cell", "B cell", "Fibroblast", "Normal epithelial general"]
    path = tmp_path / "GSE2_PDAC-A-indrop-filtered-expMat.txt.gz"
    pd.DataFrame(COUNTS.T, index=pd.Index(GENES, name="Genes"), columns=labels).to_csv(path, sep="\t")
    built = build_reference(_entry("dense-table", labels_from="header", label_column=""), [path], BuildOptions())
    _check_output(built.adata, labels)
    assert list(built.adata.obs_names) == ["1", "2", "3", "4"]


def _cellxgene(path: Path, symbols=GENES) -> Path:
    """CELLxGENE-style: Ensembl var_names, symbols in feature_name, X log-normalised, counts in raw.X."""
    counts = sparse.csr_matrix(COUNTS, dtype=np.float32)
    var = pd.DataFrame({"feature_name": symbols}, index=IDS)
    adata = ad.AnnData(X=sparse.csr_matrix(np.log1p(COUNTS / 3.0).astype(np.float32)), var=var,
                       obs=pd.DataFrame({"cell_type": ["CD4 T cell", "B cell", "Fibroblast",
                                                       "Normal epithelial general"]}, index=BARCODES))
    adata.raw = ad.AnnData(X=counts, var=var)
    adata.write_h5ad(path)
    return path


def test_cellxgene_h5ad_reads_raw_counts_and_feature_name(tmp_path):
    path = _cellxgene(tmp_path / "ts_mammary.h5ad")
    built = build_reference(_entry("cellxgene-h5ad", labels_from="obs", label_column="cell_type"), [path],
                            BuildOptions())
    _check_output(built.adata)
    with pytest.raises(InputError, match=r"ts_mammary.h5ad: counts in ts_mammary.h5ad are not raw counts: 8 of 8 "
                                         r"non-zero values are not whole numbers.*--counts"):
        build_reference(_entry("cellxgene-h5ad", labels_from="obs", label_column="cell_type"), [path],
                        BuildOptions(counts="X"))


@pytest.mark.parametrize("layout", ["csr", "csc", "dense"])
def test_h5ad_counts_read_in_row_blocks_equal_the_whole_matrix(tmp_path, monkeypatch, layout):
    """Blocks of 3 stored values (one or two rows each): the counts, their integer type and the
    labels are those of the whole file, for raw.X as CSR, CSC or dense."""
    from cellpath.references import readers

    path = _cellxgene(tmp_path / "ts.h5ad")
    if layout != "csr":
        adata = ad.read_h5ad(path)
        counts = adata.raw.X.toarray() if layout == "dense" else sparse.csc_matrix(adata.raw.X)
        adata.raw = ad.AnnData(X=counts, var=adata.raw.var)
        adata.write_h5ad(path)
    whole = build_reference(_entry("cellxgene-h5ad", labels_from="obs", label_column="cell_type"), [path],
                            BuildOptions())
    monkeypatch.setattr(readers, "H5AD_BLOCK_VALUES", 3)
    blocked = build_reference(_entry("cellxgene-h5ad", labels_from="obs", label_column="cell_type"), [path],
                              BuildOptions())
    assert blocked.adata.X.dtype == np.int32
    np.testing.assert_array_equal(blocked.adata.X.toarray(), COUNTS)
    np.testing.assert_array_equal(blocked.adata.X.toarray(), whole.adata.X.toarray())
    assert list(blocked.adata.obs["cell_type"]) == list(whole.adata.obs["cell_type"])


def test_row_blocks_cover_every_row_once_within_the_value_budget():
    from cellpath.references.readers import _row_blocks

    indptr = np.cumsum([0, 2, 0, 5, 1, 1, 3])  # 6 rows, one of them longer than the budget
    blocks = _row_blocks(indptr, 3)
    assert blocks == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert all(indptr[stop] - indptr[start] <= 3 or stop == start + 1 for start, stop in blocks)


def test_fractional_values_in_later_blocks_are_all_counted(tmp_path, monkeypatch):
    from cellpath.references import readers

    counts = COUNTS.astype(np.float32)
    counts[3, 0] = 1.5  # the last row: a later block than the first
    counts[3, 3] = 0.25
    path = tmp_path / "late.h5ad"
    var = pd.DataFrame({"feature_name": GENES}, index=IDS)
    adata = ad.AnnData(X=sparse.csr_matrix(counts), var=var,
                       obs=pd.DataFrame({"cell_type": ["CD4 T cell"] * 4}, index=BARCODES))
    adata.write_h5ad(path)
    monkeypatch.setattr(readers, "H5AD_BLOCK_VALUES", 2)
    with pytest.raises(InputError, match=r"late.h5ad: counts in late.h5ad are not raw counts: 2 of 8 non-zero values "
                                         r"are not whole numbers \(e.g. 1.5; max 9\).*--counts"):
        build_reference(_entry("cellxgene-h5ad", labels_from="obs", label_column="cell_type"), [path],
                        BuildOptions())


def test_duplicate_symbols_are_summed_and_counted(tmp_path):
    path = _cellxgene(tmp_path / "dup.h5ad", symbols=["CD3E", "MS4A1", "COL1A1", "EPCAM", "CD3E"])
    built = build_reference(_entry("cellxgene-h5ad", labels_from="obs", label_column="cell_type"), [path],
                            BuildOptions())
    assert list(built.adata.var_names) == ["CD3E", "MS4A1", "COL1A1", "EPCAM"]
    assert built.adata.X.toarray()[:, 0].tolist() == [5, 2, 0, 1]
    assert built.adata.var["gene_ids"].iloc[0] == f"{IDS[0]};{IDS[4]}"
    assert any("1 gene(s) sharing a symbol summed" in line for line in built.summary)


def test_tpm_only_reference_is_refused_saying_why_and_what_instead(tmp_path):
    with pytest.raises(InputError, match=r"tirosh2016_melanoma .* cannot be built: it publishes only log2\(TPM/10\+1\) "
                                         r"values.*raw counts.*annotate.references"):
        build_reference(MANIFEST["tirosh2016_melanoma"], [tmp_path / "any.txt.gz"], BuildOptions())


def test_non_integer_counts_are_refused_with_their_number(tmp_path):
    counts = COUNTS.astype(float)
    counts[0, 0], counts[2, 2] = 0.5, 2.25
    files = _write_mtx(tmp_path, "", counts=counts, gz=False)
    with pytest.raises(InputError, match=r"matrix.mtx: counts in matrix.mtx are not raw counts: 2 of 8 non-zero "
                                         r"values are not whole numbers"):
        build_reference(_entry("10x-mtx"), [*files, _annotations(tmp_path / "a.csv")], BuildOptions())


def test_several_samples_are_prefixed_and_cells_without_a_label_are_left_out_and_counted(tmp_path):
    files = [*_write_mtx(tmp_path, "GSE9_Set1_"), *_write_mtx(tmp_path, "GSE9_Set2_")]
    keys = [f"GSE9_Set1_{b}" for b in BARCODES] + [f"GSE9_Set2_{b}" for b in BARCODES[:2]]
    labels = ["CD4 T cell", "B cell", "Fibroblast", "Normal epithelial general", "CD4 T cell", ""]
    annotation = _annotations(tmp_path / "samples.txt", keys=keys, labels=labels, sep="\t")
    built = build_reference(_entry("10x-mtx"), [*files, annotation], BuildOptions())
    assert built.adata.n_obs == 5 and list(built.adata.obs["sample"]).count("GSE9_Set2") == 1
    assert built.adata.uns["reference"]["cells_left_out"] == {"no row in the annotation table": 2, "empty label": 1}
    assert "2 cell(s) with no row in the annotation table, 1 cell(s) with empty label" in "\n".join(built.summary)


def test_annotation_that_matches_no_cell_says_what_it_saw(tmp_path):
    files = _write_mtx(tmp_path, "")
    annotation = _annotations(tmp_path / "a.csv", keys=["x1", "x2", "x3", "x4"])
    with pytest.raises(InputError, match=r"a.csv: no cell of the matrix has a row.*'x1'.*'AAAC-1'.*--barcode-column"):
        build_reference(_entry("10x-mtx"), [*files, annotation], BuildOptions())


def test_a_built_reference_is_what_annotate_reads_with_its_vocabulary(tmp_path):
    """Built with a real vocabulary: annotate maps the labels and leaves out (and counts) the unmapped."""
    files = _write_mtx(tmp_path, "")
    annotation = _annotations(tmp_path / "samples.txt", labels=["T cell", "B cell", "CAF", "unclassified"], sep="\t",
                             label_name="Type")
    entry = replace(MANIFEST["ma2019_liver"], annotation_key="barcode")
    built = build_reference(entry, [*files, annotation], BuildOptions())
    assert built.adata.uns["reference"]["label_vocabulary"] == "ma2019_liver.Type/1"
    assert any("'unclassified' (1 cells: no cell type assigned" in line for line in built.summary)
    out = tmp_path / "ref" / "ma2019_liver.h5ad"
    write_reference(built.adata, out)
    reference = load_reference(out, "cell_type", None)
    assert list(reference.labels) == ["CD4 T cell", "B cell", "Cancer associated fibroblast"]
    assert reference.excluded == {"unclassified": 1} and reference.counts.shape == (3, len(GENES))


def test_a_reference_without_known_labels_asks_for_them(tmp_path):
    with pytest.raises(InputError, match=r"li2021_cervix: the manifest knows no cell-type labels for it \(UNCONFIRMED"
                                         r".*--annotations FILE --label-column COLUMN"):
        build_reference(MANIFEST["li2021_cervix"], _write_mtx(tmp_path, ""), BuildOptions())
