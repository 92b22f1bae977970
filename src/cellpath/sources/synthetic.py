"""The embedded default source: a seeded simulator writing a multi-organ Xenium + H&E panel.

Per section it paints a tissue layout from the organ's program, draws nuclear morphology, renders
an H&E image through a section-specific stain and scan, simulates Xenium expression, and writes a
bundle in 10x's own formats (:mod:`cellpath.simulation.xenium_bundle`) to ``data/raw/<section_id>/``.
Beside the 10x files it writes ``section.json`` (section metadata, as the 10x source does) and the
simulator's ground truth (``simulation_truth.parquet``, ``simulation.json``), which no reader of
real data relies on. One scRNA-seq reference per organ goes to ``data/references/<organ>.h5ad``.

Determinism: every random draw comes from generators seeded by (seed, section_id), so the same
params give byte-identical files whatever the order or parallelism of sections. Across machines:
the coordinate transforms are written out element-wise (no BLAS or LAPACK kernel, whose choice
depends on the CPU, decides their rounding), and `cellpath fetch` pins numpy's SIMD dispatch
(:data:`cellpath.cli.PORTABLE_NUMPY_DISPATCH`), so every x86-64-v3 machine writes the same bytes
(docs/decisions/0015-reproducible-across-machines.md).
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

from cellpath.annotation.ontology import inverse_aliases
from cellpath.config import SimulatedSection, SyntheticConfig
from cellpath.io.atomic import atomic_output, prune_other_folders, remove_stale_temporaries
from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM, write_alignment_csv
from cellpath.io.layout import SIMULATION_TRUTH_NAME
from cellpath.io.xenium import LAYOUTS
from cellpath.simulation import xenium_bundle as xb
from cellpath.simulation.expression import (GenePanel, build_panel, proliferation_scores, reference_counts,
                                            type_programs, xenium_counts)
from cellpath.simulation.morphology import draw_nuclei, proliferating
from cellpath.simulation.programs import organ_cell_types, program_for
from cellpath.simulation.render import draw_acquisition, render_section
from cellpath.simulation.tissue import layout_cells

log = logging.getLogger(__name__)

HE_MARGIN_UM = 30.0
BIOLOGY_STREAM = 0  # generator stream for what all sections share (expression programs)
REFERENCE_STREAM = 1
REFERENCE_VOCABULARY = "cellpath-simulated-atlas/1"


def _rng(seed: int, *keys: int | str) -> np.random.Generator:
    words = [seed] + [zlib.crc32(k.encode()) if isinstance(k, str) else k for k in keys]
    return np.random.default_rng(words)


@dataclass(frozen=True)
class Registration:
    """H&E placement: ``he_to_morph`` 3×3 (H&E px → morphology px) and the image shape (rows, cols)."""

    he_to_morph: np.ndarray
    shape: tuple[int, int]

    @property
    def he_to_um(self) -> np.ndarray:
        """3×3 affine H&E px → tissue µm (morphology px scaled by the Xenium pixel size)."""
        return self.he_to_morph * np.array([[XENIUM_PIXEL_SIZE_UM], [XENIUM_PIXEL_SIZE_UM], [1.0]])

    def um_to_he(self, xy_um: np.ndarray) -> np.ndarray:
        """Tissue µm (n, 2) → H&E level-0 px (n, 2)."""
        linear = _inverse_2x2(self.he_to_um[:2, :2])
        return _apply_linear(xy_um, linear) - _apply_linear(self.he_to_um[None, :2, 2], linear)


def _apply_linear(xy: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``xy @ matrix.T`` for points (n, 2) and a 2×2 matrix, element-wise (the same bits on any CPU)."""
    return np.column_stack([xy[:, 0] * matrix[0, 0] + xy[:, 1] * matrix[0, 1],
                            xy[:, 0] * matrix[1, 0] + xy[:, 1] * matrix[1, 1]])


def _inverse_2x2(matrix: np.ndarray) -> np.ndarray:
    """The inverse of a 2×2 matrix by its closed form (the same bits on any CPU)."""
    det = matrix[0, 0] * matrix[1, 1] - matrix[0, 1] * matrix[1, 0]
    return np.array([[matrix[1, 1], -matrix[0, 1]], [-matrix[1, 0], matrix[0, 0]]]) / det


def draw_registration(field_um: float, he_mpp: float, rng: np.random.Generator, *, angle_deg: float | None = None,
                      flipped: bool = False) -> Registration:
    """A non-identity affine: rotation of 2-8° either way (or ``angle_deg``), mirrored (y → −y on the
    H&E) when ``flipped``, scale to ``he_mpp``, random offset. The same draws from ``rng`` either way."""
    angle = np.deg2rad(rng.uniform(2.0, 8.0) * rng.choice([-1.0, 1.0]))
    if angle_deg is not None:
        angle = np.deg2rad(angle_deg)
    scale = he_mpp / XENIUM_PIXEL_SIZE_UM
    linear = scale * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    if flipped:
        linear = linear @ np.diag([1.0, -1.0])
    corners_um = np.array([[0, 0], [field_um, 0], [0, field_um], [field_um, field_um]], dtype=float)
    corners_he = _apply_linear(corners_um / XENIUM_PIXEL_SIZE_UM, _inverse_2x2(linear))
    margin_px = (HE_MARGIN_UM + rng.uniform(0, 40.0)) / he_mpp
    low = corners_he.min(axis=0) - margin_px
    translation = _apply_linear(low[None], linear)[0]  # morph = linear·he + t: H&E px `low` maps to morph px 0
    extent = corners_he.max(axis=0) - low + margin_px
    matrix = np.eye(3)
    matrix[:2, :2] = linear
    matrix[:2, 2] = translation
    return Registration(matrix, (int(np.ceil(extent[1])), int(np.ceil(extent[0]))))


def _direction_angles_on_he(angles_um: np.ndarray, registration: Registration) -> np.ndarray:
    inverse = _inverse_2x2(registration.he_to_um[:2, :2])
    directions = _apply_linear(np.column_stack([np.cos(angles_um), np.sin(angles_um)]), inverse)
    return np.arctan2(directions[:, 1], directions[:, 0])


def _write_bundle(out_dir: Path, section_id: str, prefix: str, cells: xb.BundleCells, panel: GenePanel,
                  rgb: np.ndarray, he_mpp: float, he_to_morphology_px: np.ndarray | None) -> None:
    """The section's Xenium outputs and registered H&E (µm/px ``he_mpp``), as a 10x download names them;
    no alignment file where ``he_to_morphology_px`` is None."""
    xb.write_experiment(out_dir / "experiment.xenium", run_name=f"simulated {section_id}",
                        region_name=section_id, n_cells=len(cells.cell_ids), panel_name=cells.layout.panel_name,
                        n_targets=len(panel.genes), pixel_size_um=XENIUM_PIXEL_SIZE_UM,
                        median_transcripts=float(np.median(np.asarray(cells.counts.sum(axis=1)))),
                        layout=cells.layout)
    xb.write_feature_matrix(out_dir / "cell_feature_matrix.h5", cells)
    xb.write_cells_parquet(out_dir / "cells.parquet", cells)
    xb.write_cells_zarr_zip(out_dir / "cells.zarr.zip", cells)
    xb.write_nucleus_boundaries(out_dir / "nucleus_boundaries.parquet", cells)
    xb.write_he_ome_tiff(out_dir / f"{prefix}he_image.ome.tif", rgb, he_mpp)
    if he_to_morphology_px is not None:
        write_alignment_csv(out_dir / f"{prefix}he_imagealignment.csv", he_to_morphology_px)


def simulate_section(section: SimulatedSection, config: SyntheticConfig, seed: int, panel: GenePanel,
                     programs: dict[str, np.ndarray], out_dir: Path) -> dict:
    """Simulate one section and write its bundle into ``out_dir`` (which must exist). Returns its truth summary."""
    rng = _rng(seed, "section", section.section_id)
    jitter = section.registration_jitter_um
    if jitter is None:
        jitter = float(rng.uniform(*config.registration_jitter_um))
    strength = section.morphology_strength
    if strength is None:
        strength = float(rng.uniform(*config.morphology_strength))
    n_cells = section.n_cells or config.cells_per_section
    program = program_for(section.organ, section.status)

    layout, tmap = layout_cells(program, n_cells, rng)
    n = len(layout.xy_um)
    # the within-type program from a stream of its own: every other draw is what it was without it
    proliferation = proliferation_scores(n, config.proliferation, _rng(seed, "proliferation", section.section_id))
    draws = proliferating(draw_nuclei(layout.cell_type, strength, rng), proliferation)
    acquisition = draw_acquisition(rng, config.stain_variation)
    he_mpp, pose = _he_pose(section, config, seed)
    registration = draw_registration(layout.field_um, he_mpp, rng, **pose)

    nucleus_he = registration.um_to_he(layout.xy_um)
    angle_he = _direction_angles_on_he(layout.orientation, registration)
    rgb = render_section(tmap, registration.he_to_um, registration.shape, nucleus_he, angle_he, draws,
                         he_mpp, acquisition, rng)

    measured_nucleus = layout.xy_um + rng.normal(0.0, jitter / np.sqrt(2.0), size=(n, 2))
    cell_centre = measured_nucleus - draws.offset
    cell_area = np.pi * draws.cytoplasm_radius**2 * np.maximum(draws.minor / draws.major, 0.45)
    cell_area = np.maximum(cell_area, np.pi * draws.vacuole**2)
    counts = xenium_counts(layout.cell_type, layout.xy_um, cell_area, programs, panel, rng,
                           proliferation=proliferation)
    prefixes = np.sort(rng.choice(2**31, size=n, replace=False)).astype(np.uint32)
    cells = xb.BundleCells(
        id_prefix=prefixes, cell_xy_um=cell_centre, nucleus_xy_um=measured_nucleus, cell_area=cell_area,
        nucleus_area=draws.nucleus_area, nucleus_axes_um=np.column_stack([draws.major, draws.minor]),
        nucleus_angle=layout.orientation, counts=counts, feature_names=panel.feature_names,
        feature_types=panel.feature_types, layout=LAYOUTS[section.xenium_layout],
    )
    prefix = f"{section.section_id}_"
    _write_bundle(out_dir, section.section_id, prefix, cells, panel, rgb, he_mpp,
                  registration.he_to_morph if section.alignment_file else None)
    truth = pd.DataFrame({
        "cell_id": cells.cell_ids, "cell_type": layout.cell_type, "compartment": layout.compartment,
        "true_x_um": layout.xy_um[:, 0], "true_y_um": layout.xy_um[:, 1],
        "true_he_x_px": nucleus_he[:, 0], "true_he_y_px": nucleus_he[:, 1],
        "nucleus_major_um": draws.major, "nucleus_minor_um": draws.minor,
        "orientation_rad": layout.orientation, "proliferation": proliferation,
    })
    truth.to_parquet(out_dir / SIMULATION_TRUTH_NAME, index=False)
    summary = {
        "section_id": section.section_id, "organ": section.organ, "status": section.status, "n_cells": n,
        "field_um": layout.field_um, "registration_jitter_um": jitter, "morphology_strength": strength,
        "he_mpp": he_mpp, "he_shape": list(registration.shape), "acquisition": acquisition.as_dict(),
        **_pose_truth(section, pose, registration),
    }
    (out_dir / "simulation.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_section_json(out_dir, section, prefix)
    return summary


def _pose_truth(section: SimulatedSection, pose: dict, registration: Registration) -> dict:
    """For a section in any pose or without an alignment file, its pose and true alignment (kept in
    simulation.json, beside the 10x files); nothing for a scanner-posed section with its file."""
    if section.he_pose == "scanner" and section.alignment_file:
        return {}
    return {"he_pose": {"kind": section.he_pose, **pose},
            "true_alignment_he_px_to_morphology_px": registration.he_to_morph.tolist()}


def _write_section_json(out_dir: Path, section: SimulatedSection, prefix: str) -> None:
    """section.json, as the 10x source writes it; ``registration`` only where it is not "given"."""
    (out_dir / "section.json").write_text(json.dumps({
        "section_id": section.section_id, "dataset": f"Simulated {section.organ} ({section.status})",
        "organ": section.organ, "status": section.status, "source": "synthetic", "prefix": prefix,
        **({"registration": section.registration} if section.registration != "given" else {}),
    }, indent=2) + "\n")


def _he_pose(section: SimulatedSection, config: SyntheticConfig, seed: int) -> tuple[float, dict]:
    """The H&E's µm/px and pose of a section: ``config.he_mpp`` and the scanner's small rotation, or for
    ``he_pose: any`` an mpp of he_mpp × 0.9-1.1, any angle and a mirror half the time, from a stream of
    their own (so every other draw is what it is for a scanner pose)."""
    if section.he_pose == "scanner":
        return config.he_mpp, {}
    rng = _rng(seed, "pose", section.section_id)
    he_mpp = config.he_mpp * float(rng.uniform(0.9, 1.1))
    return he_mpp, {"angle_deg": float(rng.uniform(0.0, 360.0)), "flipped": bool(rng.random() < 0.5)}


def simulate_reference(organ: str, config: SyntheticConfig, seed: int, panel: GenePanel,
                       programs: dict[str, np.ndarray]) -> ad.AnnData:
    """A labelled scRNA-seq reference for one organ: raw counts; obs ``cell_type`` in an atlas-style
    vocabulary of its own (mapped back to the ontology through the alias table, as for a real atlas)."""
    rng = _rng(seed, REFERENCE_STREAM, organ)
    types = organ_cell_types(organ)
    sizes = np.maximum(5, np.round(config.reference_cells_per_type * rng.uniform(0.5, 1.5, len(types)))).astype(int)
    labels = np.repeat(np.array(types, dtype=object), sizes)
    proliferation = proliferation_scores(len(labels), config.proliferation,
                                         _rng(seed, "proliferation", REFERENCE_STREAM, organ))
    counts, genes = reference_counts(labels, programs, panel.genes, rng,
                                     proliferation=proliferation if config.proliferation > 0 else None)
    atlas_names = inverse_aliases(REFERENCE_VOCABULARY)
    obs = pd.DataFrame({
        "cell_type": pd.Categorical([atlas_names[t] for t in labels]),
        "donor": pd.Categorical([f"donor{d}" for d in rng.integers(1, 4, len(labels))]),
        "organ": organ,
    }, index=[f"{organ.lower()}-ref-{i:06d}" for i in range(len(labels))])
    adata = ad.AnnData(X=counts, obs=obs, var=pd.DataFrame(index=list(genes)))
    adata.uns["reference"] = {"organ": organ, "source": "cellpath simulator", "label_column": "cell_type",
                              "label_vocabulary": REFERENCE_VOCABULARY, "counts": "raw",
                              "platform": "simulated scRNA-seq"}
    return adata


def fetch_synthetic(config: SyntheticConfig, seed: int, raw_dir: Path, references_dir: Path) -> dict:
    """Write every simulated section and one reference per organ; return a summary for the logs."""
    panel = build_panel(config.panel_genes)
    programs = type_programs(panel.genes, _rng(seed, BIOLOGY_STREAM), config.proliferation)
    raw_dir.mkdir(parents=True, exist_ok=True)
    references_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(raw_dir)
    remove_stale_temporaries(references_dir)
    organs = sorted({s.organ for s in config.sections})
    removed = _remove_unlisted(raw_dir, references_dir, [s.section_id for s in config.sections], organs)
    summaries = []
    for section in config.sections:
        with atomic_output(raw_dir / section.section_id) as tmp:
            tmp.mkdir()
            summary = simulate_section(section, config, seed, panel, programs, tmp)
        log.info("simulated %s (%s, %s): %d cells, jitter %.2f µm, morphology strength %.2f",
                 section.section_id, section.organ, section.status, summary["n_cells"],
                 summary["registration_jitter_um"], summary["morphology_strength"])
        summaries.append(summary)
    for organ in organs:
        adata = simulate_reference(organ, config, seed, panel, programs)
        with atomic_output(references_dir / f"{organ.lower()}.h5ad") as tmp:
            adata.write_h5ad(tmp)
        log.info("reference %s: %d cells × %d genes, %d types", organ, adata.n_obs, adata.n_vars,
                 adata.obs["cell_type"].nunique())
    return {"sections": summaries, "references": organs, "removed": removed}


def _remove_unlisted(raw_dir: Path, references_dir: Path, section_ids: list[str], organs: list[str]) -> list[str]:
    """Delete sections and references that ``synthetic.sections`` no longer lists (the outputs persist
    across DVC runs); every listed one is simulated again. Returns the removed names."""
    removed = prune_other_folders(raw_dir, set(section_ids))
    wanted = {f"{organ.lower()}.h5ad" for organ in organs}
    for path in sorted(references_dir.glob("*.h5ad")):
        if path.name not in wanted:
            path.unlink()
            removed.append(path.name)
    if removed:
        log.info("removed %d section(s)/reference(s) no longer listed: %s", len(removed), ", ".join(removed))
    return removed
