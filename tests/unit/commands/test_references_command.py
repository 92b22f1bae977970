"""`cellpath references list` and `cellpath references build`: the manifest's references and whether
they are built; a build from downloaded files that annotate can read; refusals exit 2 with one message."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
from scipy import sparse
from scipy.io import mmwrite

from cellpath.cli import main

GENES = ["CD3E", "MS4A1", "COL1A1"]
BARCODES = ["AAAC-1", "AAAG-1", "AACT-1"]


def _downloads(folder):
    """Wu 2021's files, small: count_matrix_* (genes × cells) and metadata.csv keyed by barcode."""
    folder.mkdir()
    mmwrite(folder / "count_matrix_sparse.mtx", sparse.coo_matrix(np.array([[4, 0, 0], [0, 6, 1], [0, 0, 5]])))
    pd.Series(GENES).to_csv(folder / "count_matrix_genes.tsv", header=False, index=False)
    pd.Series(BARCODES).to_csv(folder / "count_matrix_barcodes.tsv", header=False, index=False)
    pd.DataFrame({"celltype_minor": ["T cells CD4+", "B cells Naive", "CAFs myCAF-like"]},
                 index=BARCODES).to_csv(folder / "metadata.csv")
    return sorted(str(p) for p in folder.iterdir())


def test_list_shows_the_fourteen_references_and_which_are_built(capsys, tmp_path):
    (tmp_path / "references").mkdir()
    (tmp_path / "references" / "wu2021_breast.h5ad").write_bytes(b"")
    assert main(["references", "list", "--data-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 15
    wu = next(line for line in lines if line.startswith("wu2021_breast"))
    assert "yes" in wu and "10x-mtx" in wu and "annotation:celltype_minor" in wu
    assert "tpm-refused" in next(line for line in lines if line.startswith("tirosh2016_melanoma"))


def test_build_writes_the_reference_annotate_reads(capsys, tmp_path):
    files = _downloads(tmp_path / "downloads")
    assert main(["references", "build", "wu2021_breast", "--data-dir", str(tmp_path / "data"), "--from", *files]) == 0
    out = capsys.readouterr().out
    assert "wu2021_breast: 3 cells × 3 genes from 1 sample(s)" in out
    assert "vocabulary wu2021_breast.celltype_minor/1: 3 label(s) map to 3 ontology type(s) (3 cells)" in out
    adata = ad.read_h5ad(tmp_path / "data" / "references" / "wu2021_breast.h5ad")
    assert list(adata.obs["cell_type"]) == ["T cells CD4+", "B cells Naive", "CAFs myCAF-like"]
    assert adata.uns["reference"]["label_vocabulary"] == "wu2021_breast.celltype_minor/1"
    assert adata.uns["reference"]["accession"].startswith("GEO GSE176078")
    assert adata.X.toarray().tolist() == [[4, 0, 0], [0, 6, 0], [0, 1, 5]]


def test_build_to_another_file_and_with_another_label_column(capsys, tmp_path):
    files = _downloads(tmp_path / "downloads")
    out = tmp_path / "elsewhere.h5ad"
    assert main(["references", "build", "wu2021_breast", "--from", *files, "--out", str(out),
                 "--label-column", "celltype_minor", "--vocabulary", "wu2021_breast.celltype_minor/1"]) == 0
    assert out.is_file() and f"written: {out}" in capsys.readouterr().out


def test_refusals_exit_2_with_one_message(capsys, tmp_path):
    assert main(["references", "build", "tirosh2016_melanoma", "--from", str(tmp_path / "x.txt.gz")]) == 2
    assert "cannot be built: it publishes only log2(TPM/10+1)" in capsys.readouterr().err
    assert main(["references", "build", "nowhere", "--from", str(tmp_path / "x")]) == 2
    assert "no reference 'nowhere' in the manifest (it lists wu2021_breast" in capsys.readouterr().err
    assert main(["references", "build", "wu2021_breast"]) == 2
    assert "name the reference and its downloaded files" in capsys.readouterr().err
    assert main(["references", "build", "wu2021_breast", "--from", str(tmp_path / "missing.mtx")]) == 2
    assert "file(s) not found" in capsys.readouterr().err
