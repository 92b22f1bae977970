"""A synthetic panel written straight into the stores the probe and robustness stages read.

The section index, each section's cell table (obs only, no counts), the labels, the panels table
and one encoder's float16 features (Nuc, Mean), at any number of cells and any width. No H&E is
rendered and no encoder runs, so 1–7M-cell stages can be measured on one machine
(``benchmarks/bench_scale.py``). Features are Gaussian: a centre per Tfine class, a shift per
section (the confounder) and unit noise, so probes have something to find and margins are mixed.
Everything is drawn from ``seed`` section by section, so a section's content does not depend on
how many sections are written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
from scipy import sparse

from cellpath.annotation.labels import LABEL_COLUMNS
from cellpath.annotation.ontology import FINE_CLASSES, cell_types
from cellpath.features.store import artifact_dir, expected_sidecar, write_artifact
from cellpath.io.layout import features_dir, labels_dir, panels_csv, section_index_csv, section_labels, section_zarr
from cellpath.vocabulary import MAGNIFICATION_MPP

HE_MPP = 0.2738  # µm per level-0 px, as the simulator's slides
CELL_AREA_UM2 = 100.0  # tissue area per cell: the side of a section's square follows from its cell count


@dataclass(frozen=True)
class SyntheticPanel:
    """What was written: the panel's column name in panels.csv, its sections and cells."""

    panel: str
    sections: list[str]
    n_cells: int


def representative_types() -> dict[str, str]:
    """One eligible ontology type per Tfine class (the first in table order): the label each cell gets."""
    chosen: dict[str, str] = {}
    for t in cell_types():
        if t.eligible and t.fine not in chosen:
            chosen[t.fine] = t.name
    return chosen


def write_feature_panel(data_dir: Path, *, n_sections: int, cells_per_section: int, width: int, encoder: str,
                        magnification: str = "20x", organs: tuple[str, ...] = ("Breast", "Lung", "Colon", "Skin",
                                                                             "Liver"),
                        separation: float = 0.35, seed: int = 0) -> SyntheticPanel:
    """Write ``n_sections`` sections of ``cells_per_section`` cells (organs in turn) with ``width``-wide
    features of ``encoder`` at ``magnification``; the panel is ``S<n_sections>``."""
    data_dir = Path(data_dir)
    types = representative_types()
    centres = np.random.default_rng(seed).normal(size=(len(FINE_CLASSES), width)).astype(np.float32) * separation
    rows, panel_rows = [], []
    labels_dir(data_dir).mkdir(parents=True, exist_ok=True)
    side_um = float(np.sqrt(cells_per_section * CELL_AREA_UM2))
    for k in range(n_sections):
        section_id, organ = f"synthetic_{k:03d}", organs[k % len(organs)]
        rng = np.random.default_rng([seed, k])
        proportions = rng.dirichlet(np.full(len(FINE_CLASSES), 2.0))
        fine = rng.choice(len(FINE_CLASSES), size=cells_per_section, p=proportions)
        cell_ids = np.char.add(f"c{k:03d}-", np.arange(cells_per_section).astype(str))
        xy_um = rng.uniform(0, side_um, size=(cells_per_section, 2))
        _write_obs(data_dir, section_id, cell_ids, xy_um, rng)
        names = np.array([types[FINE_CLASSES[c]] for c in fine], dtype=object)
        _write_labels(data_dir, section_id, cell_ids, names)
        shift = rng.normal(size=width).astype(np.float32) * separation / 2  # the section's confounder
        readouts = {}
        for name in ("Nuc", "Mean"):
            noise = rng.standard_normal(size=(cells_per_section, width), dtype=np.float32)
            readouts[name] = (noise + centres[fine] + shift).astype(np.float16)
            del noise
        sidecar = expected_sidecar(encoder=encoder, revision="synthetic", magnification=magnification,
                                   target_mpp=MAGNIFICATION_MPP[magnification], tiling={"synthetic": True},
                                   code_version="synthetic", cell_ids=cell_ids)
        write_artifact(artifact_dir(features_dir(data_dir), encoder, magnification, section_id), readouts, sidecar)
        side_px = int(np.ceil(side_um / HE_MPP)) + 1
        rows.append({"section_id": section_id, "organ": organ, "status": "synthetic", "he_mpp": HE_MPP,
                     "he_width_px": side_px, "he_height_px": side_px, "n_cells": cells_per_section})
        panel_rows.append({"section_id": section_id, "organ": organ, "score": 1.0 - k / max(n_sections, 1),
                           "rank": k + 1, "cells": cells_per_section, "excluded_by_annotation": False,
                           "reference_unmatched": 0.0, "poor_reference_coverage": False})
    section_index_csv(data_dir).parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(section_index_csv(data_dir), index=False)
    panel = f"S{n_sections}"
    pd.DataFrame(panel_rows).assign(**{panel: True}).to_csv(panels_csv(data_dir), index=False)
    return SyntheticPanel(panel, [r["section_id"] for r in rows], n_sections * cells_per_section)


def _write_obs(data_dir: Path, section_id: str, cell_ids: np.ndarray, xy_um: np.ndarray,
               rng: np.random.Generator) -> None:
    """The section's cell table: obs with the nucleus centre in µm and in H&E level-0 px, and its area
    (µm²); the count matrix is an empty one-gene placeholder (no stage measured here reads it)."""
    obs = pd.DataFrame({"nucleus_x_um": xy_um[:, 0], "nucleus_y_um": xy_um[:, 1],
                        "he_x_px": xy_um[:, 0] / HE_MPP, "he_y_px": xy_um[:, 1] / HE_MPP,
                        "nucleus_area": rng.uniform(20.0, 60.0, len(cell_ids))}, index=pd.Index(cell_ids, name=None))
    table = ad.AnnData(X=sparse.csr_matrix((len(cell_ids), 1), dtype=np.float32), obs=obs,
                       var=pd.DataFrame(index=["placeholder"]))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Writing zarr v2 data")
        table.write_zarr(section_zarr(data_dir, section_id) / "tables" / "table")


def _write_labels(data_dir: Path, section_id: str, cell_ids: np.ndarray, names: np.ndarray) -> None:
    by_name = {t.name: t for t in cell_types()}
    pd.DataFrame({
        "section_id": section_id, "cell_id": cell_ids, "type_68": names, "predicted_type": names,
        "confidence": np.float32(1.0), "fine": [by_name[n].fine for n in names],
        "coarse": [by_name[n].coarse for n in names], "eligible": True,
    }, columns=list(LABEL_COLUMNS)).to_parquet(section_labels(data_dir, section_id), index=False)
