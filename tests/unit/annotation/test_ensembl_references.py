"""annotate's reference reader: Ensembl-indexed references (CELLxGENE) are read by their symbol column,
genes sharing a symbol summed; a missing symbol column is named; labels recorded as mapping to no
type are left out of the reference, counted and reported with their vocabulary."""

from __future__ import annotations

import logging

import anndata as ad
import numpy as np
import pandas as pd
import pytest
from scipy import sparse

from cellpath.annotation.genes import collapse_to_symbols, looks_like_ensembl
from cellpath.annotation.transfer import load_reference
from cellpath.errors import InputError

IDS = [f"ENSG{i:011d}" for i in range(4)]
COUNTS = np.array([[3, 0, 1, 2], [0, 4, 0, 1], [2, 2, 0, 0]])
LABELS = ["T cells CD4+", "Plasmablasts", "Cancer Cycling"]


def _reference(path, symbols=("CD4", "MZB1", "EPCAM", "CD4"), labels=LABELS, raw=False, var_column="feature_name"):
    var = pd.DataFrame({var_column: list(symbols)} if var_column else {}, index=IDS)
    obs = pd.DataFrame({"cell_type": labels}, index=[f"c{i}" for i in range(len(labels))])
    counts = sparse.csr_matrix(COUNTS[:len(labels)], dtype=np.float32)
    if raw:  # CELLxGENE: X normalised, counts in raw.X, whose var has no symbol column
        adata = ad.AnnData(X=sparse.csr_matrix(np.log1p(counts.toarray() / 7)), obs=obs, var=var,
                           uns={"reference": {"label_vocabulary": "wu2021_breast.celltype_minor/1"}})
        adata.raw = ad.AnnData(X=counts, var=pd.DataFrame(index=IDS))
    else:
        adata = ad.AnnData(X=counts, obs=obs, var=var,
                           uns={"reference": {"label_vocabulary": "wu2021_breast.celltype_minor/1"}})
    adata.write_h5ad(path)
    return path


def test_ensembl_ids_are_recognised():
    assert looks_like_ensembl(IDS) and looks_like_ensembl(["ENSG00000141510.17", "ENSMUSG00000059552"])
    assert not looks_like_ensembl(["CD4", "ENSG00000141510"])


def test_genes_sharing_a_symbol_are_summed_and_counted():
    mapping = collapse_to_symbols(sparse.csr_matrix(COUNTS), ["CD4", "MZB1", "", "CD4"], IDS)
    assert mapping.symbols == ("CD4", "MZB1") and mapping.counts.toarray().tolist() == [[5, 0], [1, 4], [2, 2]]
    assert mapping.dropped_without_symbol == 1 and mapping.merged_duplicates == 1
    assert mapping.gene_ids == (f"{IDS[0]};{IDS[3]}", IDS[1])


@pytest.mark.parametrize("raw", [False, True])
def test_an_ensembl_reference_is_read_by_its_feature_name(tmp_path, raw, caplog):
    path = _reference(tmp_path / "ts.h5ad", raw=raw)
    with caplog.at_level(logging.INFO, logger="cellpath.annotation.transfer"):
        reference = load_reference(path, "cell_type", None, counts_source="raw" if raw else "auto")
    assert reference.genes == ("CD4", "MZB1", "EPCAM")
    assert reference.counts.toarray().tolist() == [[5, 0, 1], [1, 4, 0], [2, 2, 0]]
    assert "1 gene(s) sharing a symbol summed" in caplog.text


def test_the_symbol_column_can_be_named_and_a_missing_one_is_named(tmp_path):
    path = _reference(tmp_path / "ref.h5ad", var_column="symbol")
    with pytest.raises(InputError, match=r"ref.h5ad: the reference's genes are Ensembl ids \(e.g. ENSG00000000000\) "
                                         r"and var has none of the columns feature_name, gene_symbols, gene_symbol "
                                         r"\(var columns: symbol\).*set annotate.gene_symbols"):
        load_reference(path, "cell_type", None)
    assert load_reference(path, "cell_type", None, gene_symbols="symbol").genes == ("CD4", "MZB1", "EPCAM")
    with pytest.raises(InputError, match=r"annotate.gene_symbols names var column 'gene_name', which the reference lacks"):
        load_reference(path, "cell_type", None, gene_symbols="gene_name")


def test_labels_recorded_as_no_type_are_left_out_counted_and_reported(tmp_path, caplog):
    labels = ["T cells CD4+", "Plasmablasts", "Cancer Cycling"]
    path = _reference(tmp_path / "ma.h5ad", labels=labels)
    adata = ad.read_h5ad(path)
    adata.obs["cell_type"] = ["T cell", "unclassified", "unclassified"]
    adata.uns["reference"]["label_vocabulary"] = "ma2019_liver.Type/1"
    adata.write_h5ad(path)
    with caplog.at_level(logging.WARNING, logger="cellpath.annotation.transfer"):
        reference = load_reference(path, "cell_type", None)
    assert list(reference.labels) == ["CD4 T cell"] and reference.counts.shape[0] == 1
    assert reference.excluded == {"unclassified": 2} and reference.vocabulary == "ma2019_liver.Type/1"
    assert ("ma.h5ad (vocabulary 'ma2019_liver.Type/1', obs['cell_type']): 2 of 3 cells left out" in caplog.text
            and "'unclassified' (2 cells: no cell type assigned by the authors)" in caplog.text)


def test_labels_the_vocabulary_lacks_stop_annotate_naming_the_vocabulary(tmp_path):
    path = _reference(tmp_path / "wu.h5ad", labels=["T cells CD4+", "Mystery", "Cancer Cycling"])
    with pytest.raises(InputError, match=r"wu.h5ad: 1 reference label\(s\) have no ontology mapping in vocabulary "
                                         r"'wu2021_breast.celltype_minor/1': 'Mystery'.*annotate.label_vocabulary"):
        load_reference(path, "cell_type", None)
