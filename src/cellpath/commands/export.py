"""export: the pipeline's outputs for scverse tools, under ``data/exports/`` (not a DVC stage).

Per section, ``sections/<section_id>.zarr``: a SpatialData with the H&E image (aligned to Xenium µm),
the nucleus boundaries and the cell table with its labels, for napari-spatialdata. Per encoder,
magnification and section, ``embeddings/<slug>/<mag>/<section_id>.h5ad``: the stored features as
AnnData ``obsm`` keyed by cell_id. It duplicates the H&E (``--he-downsample`` shrinks it), so it runs
on request rather than in ``dvc repro``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (
    export_embeddings_h5ad,
    export_section_zarr,
    exports_dir,
    features_dir,
    raw_dir,
    section_labels,
)
from cellpath.io.sections import read_section_index, read_section_table

log = logging.getLogger(__name__)


def _section_rows(data_dir: Path, sections: list[str] | None) -> pd.DataFrame:
    """The ingested sections to export (all when ``sections`` is None), unknown names refused."""
    index = read_section_index(data_dir)
    if not sections:
        return index
    unknown = sorted(set(sections) - set(index["section_id"]))
    if unknown:
        raise InputError(f"--sections names {', '.join(unknown)}, which were not ingested (ingested: "
                         f"{', '.join(index['section_id'])})")
    return index[index["section_id"].isin(sections)].reset_index(drop=True)


def _read_labels(data_dir: Path, section_id: str) -> pd.DataFrame:
    path = section_labels(data_dir, section_id)
    if not path.is_file():
        raise InputError("no labels; run `cellpath annotate` (or `dvc repro annotate`) first", path=path,
                         section=section_id)
    return pd.read_parquet(path)


def export_section(data_dir: Path, row, *, he_downsample: int) -> dict:
    """Write one section's SpatialData; return what it holds (counts of cells, boundaries, image levels)."""
    from cellpath.io.scverse import (
        he_image_element,
        he_px_to_um,
        labelled_table,
        nucleus_shapes,
        write_section_sdata,
    )

    section = row.section_id
    table = read_section_table(data_dir, section)
    meta = table.uns["section"]
    raw_folder = raw_dir(data_dir) / row.raw_folder
    shapes = nucleus_shapes(raw_folder, table.obs, section)
    labelled = labelled_table(table, _read_labels(data_dir, section), section)
    # level 0 of the export is the slide's level 0 coarsened by he_downsample: its pixel i (centre) is the
    # centre of slide pixels i·f … i·f + f − 1
    f = float(he_downsample)
    level0_to_um = (he_px_to_um(meta["alignment_he_to_morphology_px"], meta["pixel_size_um"])
                    @ np.array([[f, 0.0, (f - 1) / 2], [0.0, f, (f - 1) / 2], [0.0, 0.0, 1.0]]))
    image = he_image_element(raw_folder / row.he_image, section, level0_to_um, downsample=he_downsample)
    out = export_section_zarr(data_dir, section)
    with atomic_output(out) as tmp:
        write_section_sdata(tmp, table=labelled, shapes=shapes, he_image=image)
    if shapes.n_without_polygon:
        log.warning("%s: %d of %d cells have no nucleus polygon; exported as circles of their nucleus area",
                    section, shapes.n_without_polygon, table.n_obs)
    n_levels = len(image.children) if hasattr(image, "children") else 1
    log.info("exported %s: %d cells, boundaries from %s, H&E in %d levels at %.4f µm/px → %s", section,
             table.n_obs, shapes.source, n_levels, float(meta["he_mpp"]) * he_downsample, out)
    return {"section_id": section, "cells": int(table.n_obs), "without_polygon": shapes.n_without_polygon,
            "he_levels": n_levels, "path": str(out)}


def export_embeddings(data_dir: Path, row, encoder_slug: str, magnification: str) -> Path | None:
    """Write one section's features of one encoder as AnnData; None when the section has none
    (annotation excluded it, or extract has not run for this encoder and magnification)."""
    from cellpath.features.store import artifact_dir, cell_order_digest, open_artifact, read_sidecar
    from cellpath.io.scverse import embeddings_anndata

    section = row.section_id
    folder = artifact_dir(features_dir(data_dir), encoder_slug, magnification, section)
    sidecar = read_sidecar(folder)
    if sidecar is None:
        return None
    labels = _read_labels(data_dir, section)
    if sidecar.get("cell_order_sha256") != cell_order_digest(labels["cell_id"].to_numpy()):
        raise InputError("the features were written for another cell order than the labels; rerun `dvc repro`",
                         path=folder, section=section)
    adata = embeddings_anndata(section, labels, open_artifact(folder), sidecar)
    out = export_embeddings_h5ad(data_dir, encoder_slug, magnification, section)
    with atomic_output(out) as tmp:
        adata.write_h5ad(tmp)
    return out


def run(params: Params, data_dir: Path, *, sections: list[str] | None = None, encoders: list[str] | None = None,
        magnifications: list[str] | None = None, he_downsample: int = 1, images: bool = True) -> dict:
    """export: SpatialData per section (unless ``images`` is False) and AnnData embeddings per
    (encoder, magnification, section) of the extracted features; returns counts of what was written
    and of the (section, encoder, magnification) combinations that had no features."""
    from cellpath.features.encoders.registry import load_registry, resolve_encoder
    from cellpath.vocabulary import MAGNIFICATION_MPP

    if he_downsample < 1:
        raise InputError(f"--he-downsample must be a positive integer, got {he_downsample}")
    registry = load_registry(params.extract.registry)
    slugs = [resolve_encoder(registry, name, where="--encoder", source=params.extract.registry,
                             accept_names=True).slug for name in (encoders or params.extract.encoders)]
    magnifications = magnifications or params.extract.magnifications
    bad = [m for m in magnifications if m not in MAGNIFICATION_MPP]
    if bad:
        raise InputError(f"unknown magnification {', '.join(bad)}; valid: {', '.join(MAGNIFICATION_MPP)}")
    rows = _section_rows(data_dir, sections)
    written = {"sections": [], "embeddings": 0, "without_features": []}
    for row in rows.itertuples():
        if images:
            written["sections"].append(export_section(data_dir, row, he_downsample=he_downsample))
        for slug in slugs:
            for magnification in magnifications:
                if export_embeddings(data_dir, row, slug, magnification) is None:
                    written["without_features"].append(f"{row.section_id} {slug} {magnification}")
                else:
                    written["embeddings"] += 1
    if written["without_features"]:
        log.warning("export: %d (section, encoder, magnification) have no features (excluded by annotation or "
                    "not extracted), no AnnData written: %s", len(written["without_features"]),
                    "; ".join(written["without_features"]))
    log.info("export: %d section SpatialData, %d embedding AnnData under %s", len(written["sections"]),
             written["embeddings"], exports_dir(data_dir))
    return written
