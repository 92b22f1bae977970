"""Inputs written or broken by hand: CellViT++ documents, rewritten references, damaged Xenium files."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import pyarrow as pa
import pyarrow.parquet as pq

# A CellViT++ cells.json: the PanNuke type map, five cells (centre in level-0 px, type id) and the slide's mpp.
TYPE_MAP = {"0": "Background", "1": "Neoplastic", "2": "Inflammatory", "3": "Connective", "4": "Dead",
            "5": "Epithelial"}
CELLS = [((10.5, 20.0), 1), ((30.0, 40.25), 2), ((50.0, 60.0), 3), ((70.0, 80.0), 4), ((90.0, 15.0), 5),
         ((12.0, 95.0), 2)]
MPP = 0.2738




def cellvit_cell(xy, type_id, full=True) -> dict:
    x, y = xy
    cell = {"bbox": [[int(y) - 3, int(x) - 3], [int(y) + 3, int(x) + 3]], "centroid": [x, y], "type": type_id}
    if full:
        cell |= {"contour": [[x - 3, y - 3], [x + 3, y - 3], [x + 3, y + 3], [x - 3, y + 3]],
                 "type_prob": 0.9, "cell_status": 0, "offset_global": [0, 0]}
    return cell


def cellvit_document(cells=CELLS, full=True, **metadata) -> dict:
    wsi_metadata = {"base_mpp": MPP, "target_patch_mpp": MPP, "magnification": 40} | metadata
    return {"wsi_metadata": wsi_metadata, "type_map": TYPE_MAP, "cells": [cellvit_cell(xy, t, full) for xy, t in cells]}


def rewrite_reference(path, mutate) -> None:
    adata = ad.read_h5ad(path)
    adata = mutate(adata)
    path.unlink()
    adata.write_h5ad(path)


def mismatch_cell_ids(folder: Path) -> None:
    table = pq.read_table(folder / "cells.parquet").to_pandas()
    table.loc[0, "cell_id"] = "zzzzzzzz-1"
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), folder / "cells.parquet")


def truncate_file(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
