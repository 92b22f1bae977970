"""The bad-input matrix: every bad input the pipeline is known to meet, one row each.

Each row copies what one step needs from the tiny simulated panel into ``tmp_path``, breaks one
thing, calls the function the stage calls, and expects either a specific error whose message names
the section, file or parameter at fault, or (marked ``RECORDED``) an explicit, counted outcome
instead of an exception. Every row then checks that the failing step left no partial output: its
outputs are absent or byte-identical to before, and no temporary sibling of an atomic write
(``cellpath.io.atomic._temporary_sibling``) remains anywhere under ``tmp_path``.

The row count is the number docs/reliability.md quotes ("N bad inputs are tried, each rejected with a clear
error"); ``test_row_count`` pins it so that adding a row is a conscious change.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tifffile
import yaml

from cellpath.config import load_params, parse_params
from cellpath.errors import CellPathError, ConfigError, InputError, OutputError
from cellpath.io.atomic import _temporary_sibling
from helpers.files import cellvit_cell, mismatch_cell_ids, rewrite_reference, truncate_file
from helpers.project import tiny_params

SECTION = "breast_a"  # 399 cells, Breast: the section every row breaks
ENCODER, MAG = "filterbank-dense", "10x"
RAW_FILES = ("section.json", "experiment.xenium", "cell_feature_matrix.h5", "cells.parquet", "cells.zarr.zip",
             "nucleus_boundaries.parquet", f"{SECTION}_he_image.ome.tif", f"{SECTION}_he_imagealignment.csv")
TEMPORARY = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]{8}$")
RECORDED = None  # a row's error type when the bad input is an explicit, counted outcome, not an exception


@dataclass
class Scenario:
    """A broken input ready to run: ``act`` is the step, ``outputs`` what it must not leave half-written."""

    act: Callable[[], object]
    outputs: list[Path]
    check: Callable[[object], None] | None = None  # more assertions on the error (or on the result)


@dataclass(frozen=True)
class Row:
    build: Callable[[Path, dict, pytest.MonkeyPatch], Scenario]
    error: type[BaseException] | None
    match: str  # regex searched in the message (or, for RECORDED rows, in the recorded reason)


# ---------------------------------------------------------------------------------------------
# Copies of the tiny panel, one step's inputs at a time


def _raw_copy(panel: dict, tmp: Path) -> tuple[Path, Path]:
    """data/raw/<SECTION>/ with the files ingest reads; returns (data_dir, section folder)."""
    data_dir = tmp / "data"
    folder = data_dir / "raw" / SECTION
    folder.mkdir(parents=True)
    for name in RAW_FILES:
        shutil.copy2(panel["data_dir"] / "raw" / SECTION / name, folder / name)
    return data_dir, folder


def _ingest_scenario(panel: dict, tmp: Path, corrupt: Callable[[Path], None]) -> Scenario:
    from cellpath.stages.ingest import run as run_ingest

    data_dir, folder = _raw_copy(panel, tmp)
    corrupt(folder)
    return Scenario(lambda: run_ingest(panel["params"], data_dir),
                    [data_dir / "sections" / f"{SECTION}.zarr", data_dir / "sections" / "sections.csv"])


def _sections_copy(panel: dict, tmp: Path, *, labels: bool = False, references: bool = False) -> Path:
    """data/sections with SECTION only (its zarr and a one-row sections.csv), optionally its labels
    (one-row summary.csv) and the organ's reference."""
    data_dir = tmp / "data"
    source = panel["data_dir"]
    shutil.copytree(source / "sections" / f"{SECTION}.zarr", data_dir / "sections" / f"{SECTION}.zarr")
    index = pd.read_csv(source / "sections" / "sections.csv")
    index[index["section_id"] == SECTION].to_csv(data_dir / "sections" / "sections.csv", index=False)
    if labels:
        (data_dir / "labels").mkdir()
        shutil.copy2(source / "labels" / f"{SECTION}.parquet", data_dir / "labels" / f"{SECTION}.parquet")
        summary = pd.read_csv(source / "labels" / "summary.csv")
        summary[summary["section_id"] == SECTION].to_csv(data_dir / "labels" / "summary.csv", index=False)
    if references:
        (data_dir / "references").mkdir()
        shutil.copy2(source / "references" / "breast.h5ad", data_dir / "references" / "breast.h5ad")
    return data_dir


def _params(**changes) -> object:
    data = tiny_params().model_dump(mode="json")
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = data
        for parent in parents:
            node = node[parent]
        node[key] = value
    return parse_params(data)


def _section_cells(panel: dict) -> tuple[np.ndarray, np.ndarray]:
    """SECTION's cell ids (stored order) and which are eligible (a Tfine and a Tcoarse label)."""
    labels = pd.read_parquet(panel["data_dir"] / "labels" / f"{SECTION}.parquet")
    return labels["cell_id"].to_numpy(), labels["eligible"].to_numpy(bool)


# ---------------------------------------------------------------------------------------------
# Ingest: the raw bundle


def _rewrite_he(folder: Path, *, size: int | None = None, mpp: float | None = None) -> None:
    """Replace the registered H&E by a flat one-level OME-TIFF (level 0 of the original, or a
    ``size`` px square), with PhysicalSizeX/Y = ``mpp`` or no pixel size at all."""
    path = folder / f"{SECTION}_he_image.ome.tif"
    image = tifffile.imread(path, level=0) if size is None else np.full((size, size, 3), 230, np.uint8)
    path.unlink()
    metadata = {"axes": "YXS"} | ({"PhysicalSizeX": mpp, "PhysicalSizeY": mpp} if mpp is not None else {})
    tifffile.imwrite(path, image, photometric="rgb", metadata=metadata)


def _zarr_ids_mismatch(folder: Path) -> None:
    """cells.zarr.zip from another run: its cell_id prefixes shifted by one (same count, other ids)."""
    import zipfile

    import zarr

    work = folder.parent / "cells.zarr"
    with zipfile.ZipFile(folder / "cells.zarr.zip") as zf:
        zf.extractall(work)
    cell_id = zarr.open_array(store=str(work / "cell_id"), mode="r+")
    values = cell_id[:]
    values[:, 0] += 1
    cell_id[:] = values
    (folder / "cells.zarr.zip").unlink()
    with zipfile.ZipFile(folder / "cells.zarr.zip", "w") as zf:
        for member in sorted(p for p in work.rglob("*") if p.is_file()):
            zf.write(member, member.relative_to(work).as_posix())
    shutil.rmtree(work)


def _zarr_chunk_missing(folder: Path) -> None:
    """cells.zarr.zip without the first chunk of cell_summary (an archive that lost a member)."""
    import zipfile

    path = folder / "cells.zarr.zip"
    with zipfile.ZipFile(path) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    chunk = next(name for name in sorted(members) if name.startswith("cell_summary/") and name[-1].isdigit())
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            if name != chunk:
                zf.writestr(name, data)


def _repeat_cell_ids(folder: Path) -> None:
    """The first cell's id given to the second too, in cells.parquet and the matrix alike (same order)."""
    table = pq.read_table(folder / "cells.parquet")
    ids = table.column("cell_id").to_pylist()
    ids[1] = ids[0]
    pq.write_table(table.set_column(table.column_names.index("cell_id"), "cell_id",
                                    pa.array(ids, type=table.schema.field("cell_id").type)), folder / "cells.parquet")
    with h5py.File(folder / "cell_feature_matrix.h5", "r+") as f:
        barcodes = f["matrix/barcodes"][:]
        barcodes[1] = barcodes[0]
        f["matrix/barcodes"][:] = barcodes


def _bad_count(value: float) -> Callable[[Path], None]:
    """One stored count of the matrix replaced by ``value`` (NaN, or a negative number)."""
    def corrupt(folder: Path) -> None:
        with h5py.File(folder / "cell_feature_matrix.h5", "r+") as f:
            data = f["matrix/data"]
            if not np.issubdtype(data.dtype, np.floating) and np.isnan(value):
                values = data[:].astype(np.float32)
                del f["matrix/data"]
                f["matrix/data"] = values
                data = f["matrix/data"]
            values = data[:]
            values[3] = value
            data[:] = values
    return corrupt


def _empty_section(folder: Path) -> None:
    """A section with 0 cells: a 0-barcode matrix and a cells.parquet with its columns but no rows."""
    with h5py.File(folder / "cell_feature_matrix.h5", "r+") as f:
        m = f["matrix"]
        n_features = int(m["shape"][0])
        empty = {"barcodes": np.array([], dtype="S16"), "data": np.array([], dtype=m["data"].dtype),
                 "indices": np.array([], dtype=m["indices"].dtype), "indptr": np.zeros(1, dtype=m["indptr"].dtype),
                 "shape": np.array([n_features, 0], dtype=m["shape"].dtype)}
        for key, value in empty.items():
            del m[key]
            m[key] = value
    table = pq.read_table(folder / "cells.parquet")
    pq.write_table(table.slice(0, 0), folder / "cells.parquet")


def _ingest_row(corrupt: Callable[[Path], None]) -> Callable:
    return lambda tmp, panel, _mp: _ingest_scenario(panel, tmp, corrupt)


HE = rf"{SECTION}_he_image\.ome\.tif"
ALIGNMENT = rf"{SECTION}_he_imagealignment\.csv"
IN_SECTION = rf"^section {SECTION}: \S+/raw/{SECTION}/"  # InputError's prefix: the section, then the file

INGEST_ROWS = {
    "h5-truncated": Row(_ingest_row(lambda f: truncate_file(f / "cell_feature_matrix.h5", 0.6)), InputError,
                        IN_SECTION + r"cell_feature_matrix\.h5: cannot read the HDF5 matrix .*truncated or corrupt"),
    "cells-parquet-truncated": Row(_ingest_row(lambda f: truncate_file(f / "cells.parquet", 0.9)), InputError,
                                   IN_SECTION + r"cells\.parquet: cannot read parquet .*truncated or corrupt"),
    "nucleus-boundaries-truncated": Row(
        _ingest_row(lambda f: truncate_file(f / "nucleus_boundaries.parquet", 0.9)), InputError,
        IN_SECTION + r"nucleus_boundaries\.parquet: cannot read parquet .*truncated or corrupt"),
    "cells-zarr-zip-truncated": Row(_ingest_row(lambda f: truncate_file(f / "cells.zarr.zip", 0.9)), InputError,
                                    IN_SECTION + r"cells\.zarr\.zip: cannot read cell_id / cell_summary"),
    "he-truncated-in-tags": Row(_ingest_row(lambda f: truncate_file(f / f"{SECTION}_he_image.ome.tif", 0.1)),
                                InputError,
                                IN_SECTION + HE + r": cannot open the H&E image \(TiffFileError"),
    "he-truncated-in-pyramid": Row(_ingest_row(lambda f: truncate_file(f / f"{SECTION}_he_image.ome.tif", 0.95)),
                                   InputError, IN_SECTION + HE + r": the H&E image is incomplete: pyramid level 1 "
                                   r"needs \d+ bytes but the file has \d+; it is truncated"),
    "ids-parquet-vs-h5": Row(_ingest_row(mismatch_cell_ids), InputError,
                             IN_SECTION + r"cells\.parquet: cell ids of cells\.parquet \(399\) do not match the "
                             r"barcodes of cell_feature_matrix\.h5 \(399; 2 ids in only one"),
    "ids-zarr-zip-vs-parquet": Row(_ingest_row(_zarr_ids_mismatch), InputError,
                                   IN_SECTION + r"cells\.zarr\.zip: cell ids of cells\.zarr\.zip do not match "
                                   r"cells\.parquet"),
    "alignment-nan": Row(_ingest_row(lambda f: (f / f"{SECTION}_he_imagealignment.csv").write_text(
        "1.1,0.1,nan\n-0.1,1.1,5\n0,0,1\n")), InputError,
        IN_SECTION + ALIGNMENT + r": H&E alignment matrix contains NaN or infinite values"),
    "alignment-singular": Row(_ingest_row(lambda f: (f / f"{SECTION}_he_imagealignment.csv").write_text(
        "1,2,10\n2,4,20\n0,0,1\n")), InputError,
        IN_SECTION + ALIGNMENT + r": H&E alignment matrix is singular \(det = 0\)"),
    "he-without-mpp": Row(_ingest_row(lambda f: _rewrite_he(f, mpp=None)), InputError,
                          IN_SECTION + HE + r": the H&E image has no pixel size \(mpp\): neither OME-XML "
                          r"PhysicalSizeX/Y nor TIFF resolution tags"),
    "cells-outside-he": Row(_ingest_row(lambda f: _rewrite_he(f, size=300, mpp=0.2738)), InputError,
                            IN_SECTION + ALIGNMENT + r": \d+ of 399 cells map outside the 300×300 px H&E image"),
    "empty-section": Row(_ingest_row(_empty_section), InputError,
                         IN_SECTION + r"cells\.parquet: cells\.parquet has no cells"),
    "cells-zarr-zip-chunk-missing": Row(_ingest_row(_zarr_chunk_missing), InputError,
                                        IN_SECTION + r"cells\.zarr\.zip: cell_summary: 1 of its 1 chunks \(\d+ cells "
                                        r"each\) are missing from the archive, and would read as 0\.0 \(cells at 0 µm\)"),
    "ids-repeated-in-every-file": Row(_ingest_row(_repeat_cell_ids), InputError,
                                      IN_SECTION + r"cells\.parquet: 1 cell ids repeat \(e\.g\. \S+\); every later "
                                      r"step joins on cell_id"),
    "counts-nan": Row(_ingest_row(_bad_count(float("nan"))), InputError,
                      IN_SECTION + r"cell_feature_matrix\.h5: 1 counts are NaN, infinite or negative \(e\.g\. "
                      r"nan\)"),
    "counts-negative": Row(_ingest_row(_bad_count(-2)), InputError,
                           IN_SECTION + r"cell_feature_matrix\.h5: 1 counts are NaN, infinite or negative"),
}


# ---------------------------------------------------------------------------------------------
# Annotate: references and exclusion


def _annotate_with_reference(tmp: Path, panel: dict, mutate: Callable[[ad.AnnData], ad.AnnData]) -> Scenario:
    from cellpath.stages.annotate import run as run_annotate

    data_dir = _sections_copy(panel, tmp, references=True)
    rewrite_reference(data_dir / "references" / "breast.h5ad", mutate)
    reports = tmp / "reports"
    return Scenario(lambda: run_annotate(panel["params"], data_dir, reports),
                    [data_dir / "labels", reports / "annotation"])


def _rename_genes(adata: ad.AnnData) -> ad.AnnData:
    adata.var_names = [f"ENSG{i:011d}" for i in range(adata.n_vars)]  # another gene identifier system
    return adata


IMMUNE_ONLY = ["T cells CD4+", "T cells CD8+", "B cells", "Macrophages", "Plasma cells"]


def _one_class_section(tmp: Path, panel: dict, _mp) -> Scenario:
    """A reference holding only immune types: every confident cell becomes Immune, one Tcoarse class."""
    scenario = _annotate_with_reference(
        tmp, panel, lambda a: a[a.obs["cell_type"].astype(str).isin(IMMUNE_ONLY)].copy())
    data_dir = scenario.outputs[0].parent

    def check(summary: pd.DataFrame) -> None:
        from cellpath.io.sections import sections_to_extract

        assert summary["excluded"].tolist() == [True]  # counted in the stage's summary ...
        assert summary.loc[0, "n_valid_coarse"] == 1
        on_disk = pd.read_csv(data_dir / "labels" / "summary.csv")  # ... and in labels/summary.csv
        assert on_disk["excluded"].tolist() == [True]
        assert on_disk.loc[0, "exclusion_reason"] == summary.loc[0, "exclusion_reason"]
        assert sections_to_extract(data_dir).empty  # and no later stage sees the section

    scenario.check = check
    scenario.outputs = []  # the stage succeeds: its outputs are the point
    return scenario


def _nan_reference_count(adata: ad.AnnData) -> ad.AnnData:
    from scipy import sparse

    counts = sparse.csr_matrix(adata.X, dtype=np.float32)
    counts.data[0] = np.nan
    adata.X = counts
    return adata


ANNOTATE_ROWS = {
    "reference-counts-nan": Row(lambda tmp, panel, _mp: _annotate_with_reference(tmp, panel, _nan_reference_count),
                                InputError, r"^\S+/references/breast\.h5ad: reference counts \(X\) contains 1 NaN or "
                                r"infinite counts$"),
    "reference-without-panel-genes": Row(
        lambda tmp, panel, _mp: _annotate_with_reference(tmp, panel, _rename_genes), InputError,
        r"^\S+/references/breast\.h5ad: the reference's genes are Ensembl ids \(e\.g\. ENSG00000000000\) and var has "
        r"none of the columns feature_name, gene_symbols, gene_symbol .* set annotate\.gene_symbols to the var column "
        r"that holds the gene symbols$"),
    "one-class-section": Row(_one_class_section, RECORDED,
                             r"^1 valid Tcoarse class\(es\) \(< 2 with ≥ 10 eligible cells\)$"),
}


# ---------------------------------------------------------------------------------------------
# Concordance: CellViT++ detections and the panels


PANNUKE_ID = {"Epithelial/Tumor": 1, "Immune/Inflammatory": 2, "Stromal/Structural": 3}  # test_cellvit.TYPE_MAP


def _cellvit_document(panel: dict, type_map: dict) -> dict:
    """CellViT++ cells.json whose nuclei are SECTION's Xenium nuclei with their Tcoarse class (4 = Dead)."""
    from cellpath.io.sections import read_section_table

    obs = read_section_table(panel["data_dir"], SECTION).obs
    labels = pd.read_parquet(panel["data_dir"] / "labels" / f"{SECTION}.parquet").set_index("cell_id")
    coarse = labels.loc[obs.index, "coarse"]
    cells = [cellvit_cell((float(x), float(y)), PANNUKE_ID.get(c, 4), full=False)
             for x, y, c in zip(obs["he_x_px"], obs["he_y_px"], coarse)]
    return {"wsi_metadata": {"base_mpp": 0.2738}, "type_map": type_map, "cells": cells}


def _concordance_scenario(tmp: Path, panel: dict, document: dict | None, changes: dict | None = None) -> Scenario:
    from cellpath.stages.concordance import run as run_concordance

    data_dir = _sections_copy(panel, tmp, labels=True)
    cellvit = tmp / "cellvit"
    cellvit.mkdir()
    if document is not None:
        (cellvit / f"{SECTION}_cells.json").write_text(json.dumps(document))
    chosen = _params(**{"concordance.cellvit_dir": str(cellvit), "concordance.panel_sizes": [1], "panel": "S1"}
                     | (changes or {}))
    reports = tmp / "reports"
    return Scenario(lambda: run_concordance(chosen, data_dir, reports),
                    [data_dir / "panels.csv", reports / "concordance"])


TYPE_MAP = {"0": "Background", "1": "Neoplastic", "2": "Inflammatory", "3": "Connective", "4": "Dead",
            "5": "Epithelial"}


def _unknown_class_name(tmp: Path, panel: dict, _mp) -> Scenario:
    # A model fine-tuned on another taxonomy: class id 2 is "Lymphocyte", not PanNuke's "Inflammatory".
    return _concordance_scenario(tmp, panel, _cellvit_document(panel, TYPE_MAP | {"2": "Lymphocyte"}))


def _unknown_class_id(tmp: Path, panel: dict, _mp) -> Scenario:
    document = _cellvit_document(panel, TYPE_MAP)
    document["cells"][7]["type"] = 9  # an id type_map does not list
    return _concordance_scenario(tmp, panel, document)


def _panel_too_large(tmp: Path, panel: dict, _mp) -> Scenario:
    return _concordance_scenario(tmp, panel, _cellvit_document(panel, TYPE_MAP),
                                 {"concordance.panel_sizes": [1, 2], "panel": "S2"})


CELLVIT = rf"^\S+/cellvit/{SECTION}_cells\.json: "

CONCORDANCE_ROWS = {
    "cellvit-unknown-class-name": Row(_unknown_class_name, InputError,
                                      CELLVIT + r"class 'Lymphocyte' is not a PanNuke class \(Neoplastic, Epithelial, "
                                      r"Inflammatory, Connective, Dead\)"),
    "cellvit-unknown-class-id": Row(_unknown_class_id, InputError,
                                    CELLVIT + r"cell 7 has class id 9, which type_map does not list"),
    "panel-larger-than-ranked-sections": Row(_panel_too_large, ConfigError,
                                             r"^concordance\.panel_sizes: panel size 2 is larger than the 1 ranked "
                                             r"sections"),
}


# ---------------------------------------------------------------------------------------------
# Feature artifacts


def _features_scenario(tmp: Path, panel: dict, *, revision: str = "weight-free") -> tuple[Path, dict]:
    """A stored artifact of SECTION (random finite Nuc and Mean) and the sidecar it was written with."""
    from cellpath.features.store import artifact_dir, expected_sidecar, write_artifact

    ids, _ = _section_cells(panel)
    folder = artifact_dir(tmp / "data" / "features", ENCODER, MAG, SECTION)
    sidecar = expected_sidecar(encoder=ENCODER, revision=revision, magnification=MAG, target_mpp=1.0,
                               tiling={"input_size": 224}, code_version="test", cell_ids=ids)
    rng = np.random.default_rng(0)
    write_artifact(folder, {"Nuc": rng.normal(size=(len(ids), 8)), "Mean": rng.normal(size=(len(ids), 8))}, sidecar)
    return folder, sidecar


def _panel_cells(panel: dict):
    from cellpath.features.panel import PanelCells

    ids, eligible = _section_cells(panel)
    rows = np.flatnonzero(eligible)
    cells = pd.DataFrame({"section_id": SECTION, "organ": "Breast", "cell_id": ids[rows]})
    return PanelCells(cells, {SECTION: ids}, {SECTION: rows}, {"ineligible_or_uncertain": int((~eligible).sum())})


def _nan_on_read(tmp: Path, panel: dict, _mp) -> Scenario:
    from cellpath.features.panel import PanelFeatures, panel_matrix

    folder, _ = _features_scenario(tmp, panel)
    cells = _panel_cells(panel)
    nuc = np.load(folder / "Nuc.npy")
    nuc[cells.rows_in_section[SECTION][3], 5] = np.nan  # one evaluated cell
    np.save(folder / "Nuc.npy", nuc)
    return Scenario(lambda: panel_matrix(PanelFeatures(tmp / "data" / "features", ENCODER, MAG, cells).readout("Nuc")),
                    [folder])


def _nan_on_write(tmp: Path, panel: dict, _mp) -> Scenario:
    from cellpath.features.store import artifact_dir, expected_sidecar, write_artifact

    ids, _ = _section_cells(panel)
    folder = artifact_dir(tmp / "data" / "features", ENCODER, MAG, SECTION)
    sidecar = expected_sidecar(encoder=ENCODER, revision="weight-free", magnification=MAG, target_mpp=1.0,
                               tiling={}, code_version="test", cell_ids=ids)
    nuc = np.ones((len(ids), 8))
    nuc[[4, 9], 0] = [np.nan, np.inf]  # what an fp16 overflow in an encoder produces
    return Scenario(lambda: write_artifact(folder, {"Nuc": nuc, "Mean": np.ones((len(ids), 8))}, sidecar), [folder])


def _other_revision(tmp: Path, panel: dict, _mp) -> Scenario:
    """An artifact written by an earlier revision of the encoder's weights."""
    from cellpath.features.store import is_complete, read_artifact

    folder, stored = _features_scenario(tmp, panel, revision="sha256:0ld")
    expected = stored | {"revision": "sha256:new"}

    def check(_error) -> None:
        # What extract does with it (documented in docs/decisions/0007): not complete, so recomputed.
        assert not is_complete(folder, expected)
        assert is_complete(folder, stored)

    return Scenario(lambda: read_artifact(folder, expected), [folder], check)


FEATURES = rf"\S+/features/{ENCODER}/{MAG}/{SECTION}"

FEATURE_ROWS = {
    "features-nan-on-read": Row(_nan_on_read, InputError,
                                rf"^section {SECTION}: {FEATURES}/Nuc\.npy: 1 cells have NaN or infinite Nuc features "
                                rf"\(encoder {ENCODER}, {MAG}\); rerun the extract stage"),
    "features-nan-on-write": Row(_nan_on_write, ValueError,
                                 rf"^{FEATURES}: Nuc: 2 cells have NaN or infinite features \(encoder {ENCODER}\); "
                                 "nothing was written"),
    "sidecar-other-encoder-revision": Row(_other_revision, InputError,
                                          rf"^{FEATURES}/sidecar\.json: stale feature artifact: revision is "
                                          r"'sha256:0ld', expected 'sha256:new'; rerun `cellpath extract`"),
}


# ---------------------------------------------------------------------------------------------
# params.yaml


def _params_file(tmp: Path, change: Callable[[dict], None]) -> Scenario:
    data = tiny_params().model_dump(mode="json")
    change(data)
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return Scenario(lambda: load_params(path), [])  # validation comes before any stage writes anything


PARAMS_ROWS = {
    "params-unknown-key": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["annotate"].update(confidence=0.4)),
                              ConfigError, r"^\S+/params\.yaml: unknown key `annotate\.confidence`: did you mean "
                              r"`confidence_threshold`\? allowed keys here: "
                              r"references, label_column, label_vocabulary, reference_counts, gene_symbols, "
                              r"regularisation_c, confidence_threshold"),
    "params-out-of-range": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["probe"].update(val_fraction=1.5)),
                               ConfigError,
                               r"^\S+/params\.yaml: key `probe\.val_fraction`: Input should be less than 1 \(got 1\.5\)$"),
    "params-true-for-an-integer": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["tenx"].update(retries=True)),
                                      ConfigError, r"^\S+/params\.yaml: key `tenx\.retries`: Input should be a valid "
                                      r"integer \(got True\); write a whole number"),
    "params-true-for-the-seed": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d.update(seed=True)),
                                    ConfigError, r"^\S+/params\.yaml: key `seed`: Input should be a valid integer"),
    "params-infinite-c": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["probe"].update(c_grid=[float("inf")])),
                             ConfigError, r"^\S+/params\.yaml: key `probe\.c_grid\[0\]`: Input should be a finite "
                             r"number \(got inf\); write a finite number"),
    "params-past-the-bound": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["tenx"].update(
        max_file_bytes=2**60)), ConfigError, r"^\S+/params\.yaml: key `tenx\.max_file_bytes`: Input should be less "
        r"than or equal to 1125899906842624"),
    "params-float-for-an-integer": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["tenx"].update(
        max_file_bytes=1e30)), ConfigError, r"^\S+/params\.yaml: key `tenx\.max_file_bytes`: Input should be a valid "
        r"integer"),
    "params-password-in-a-url": Row(lambda tmp, _p, _mp: _params_file(tmp, lambda d: d["mlflow"].update(
        tracking_uri="http://alice:s3cret@mlflow.lab:5000")), ConfigError,
        r"^\S+/params\.yaml: key `mlflow\.tracking_uri`: holds a password or token, .* MLFLOW_TRACKING_PASSWORD"),
    "params-not-utf-8": Row(lambda tmp, _p, _mp: _latin1_params(tmp), ConfigError,
                            r"^\S+/params\.yaml: not UTF-8 text: byte 0xe9 on line \d+ \(invalid continuation byte\); "
                            r"save it as UTF-8"),
}


def _latin1_params(tmp: Path) -> Scenario:
    scenario = _params_file(tmp, lambda d: d["report"].update(title="Résumé"))
    path = tmp / "params.yaml"
    path.write_bytes(path.read_text(encoding="utf-8").encode("latin-1"))
    return scenario


# ---------------------------------------------------------------------------------------------
# A full disk while an output is written


def _no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _disk_full_folder(tmp: Path, panel: dict, monkeypatch: pytest.MonkeyPatch) -> Scenario:
    """Re-extraction over an existing artifact; the disk fills while the second matrix is saved."""
    import cellpath.features.store as store

    folder, sidecar = _features_scenario(tmp, panel)
    real_save, calls = np.save, []

    def save_until_full(path, array):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"\x93NUMPY")  # a partial file, as a full disk leaves it
            raise _no_space()
        real_save(path, array)

    monkeypatch.setattr(store.np, "save", save_until_full)
    n = sidecar["n_cells"]
    new = {"Nuc": np.zeros((n, 8)), "Mean": np.zeros((n, 8))}
    return Scenario(lambda: store.write_artifact(folder, new, sidecar | {"revision": "new"}), [folder], _is_enospc)


def _disk_full_file(tmp: Path, panel: dict, monkeypatch: pytest.MonkeyPatch) -> Scenario:
    """concordance over an existing data/panels.csv; the disk fills while the new one is written."""
    scenario = _concordance_scenario(tmp, panel, _cellvit_document(panel, TYPE_MAP))
    previous = scenario.outputs[0]
    previous.write_text("section_id,organ,score,rank,S1\nbreast_a,Breast,0.7,1,True\n")  # an earlier run's

    def to_csv_until_full(frame, path, *args, **kwargs):
        Path(path).write_text("section_id,org")
        raise _no_space()

    monkeypatch.setattr(pd.DataFrame, "to_csv", to_csv_until_full)
    scenario.check = _is_enospc
    return scenario


def _is_enospc(error: BaseException) -> None:
    assert isinstance(error, CellPathError)  # the CLI prints it as one line, exit status 2
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC  # and OSError handlers still see it
    assert isinstance(error.__cause__, OSError)


DISK_ROWS = {
    "disk-full-folder-output": Row(_disk_full_folder, OutputError,
                                   rf"^\[Errno {errno.ENOSPC}\] No space left on device while writing {SECTION}; the "
                                   rf"partial output was removed and any previous one is unchanged: free space and "
                                   rf"rerun: '{FEATURES}'$"),
    "disk-full-file-output": Row(_disk_full_file, OutputError,
                                 rf"^\[Errno {errno.ENOSPC}\] No space left on device while writing panels\.csv; .*: "
                                 r"'\S+/data/panels\.csv'$"),
}


ROWS: dict[str, Row] = INGEST_ROWS | ANNOTATE_ROWS | CONCORDANCE_ROWS | FEATURE_ROWS | PARAMS_ROWS | DISK_ROWS


# ---------------------------------------------------------------------------------------------
# The matrix


def _snapshot(path: Path) -> object:
    """None when absent; else every file's SHA-256 under it (or its own)."""
    if not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if TEMPORARY.match(p.name)]


def test_temporary_pattern_matches_the_atomic_writer():
    assert TEMPORARY.match(_temporary_sibling(Path("/x/panels.csv")).name)
    assert TEMPORARY.match(_temporary_sibling(Path("/x/breast_a.zarr")).name)


@pytest.mark.parametrize("row_id", list(ROWS))
def test_bad_input(row_id, tiny_panel, tmp_path, monkeypatch):
    row = ROWS[row_id]
    scenario = row.build(tmp_path, tiny_panel, monkeypatch)
    before = {path: _snapshot(path) for path in scenario.outputs}
    if row.error is RECORDED:
        outcome = scenario.act()
        reasons = outcome.loc[outcome["excluded"], "exclusion_reason"].tolist()
        assert reasons and all(re.search(row.match, r) for r in reasons), reasons
    else:
        with pytest.raises(row.error, match=row.match) as caught:
            scenario.act()
        outcome = caught.value
    if scenario.check is not None:
        scenario.check(outcome)
    monkeypatch.undo()
    for path, snapshot in before.items():
        assert _snapshot(path) == snapshot, f"{path} was changed by a failing step"
    assert _temporaries(tmp_path) == []


def test_row_count():
    """docs/reliability.md quotes this number; change both together."""
    assert len(ROWS) == 37
