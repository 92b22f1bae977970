"""concordance: H&E nuclei (CellViT++ output or the built-in detector) against the Xenium labels:
AGR-BAcc per section, the ranking, registration QC (informational) and the nested panels (``data/panels.csv``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from cellpath.config import ConcordanceConfig, Params
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (CONCORDANCE_NAME, METRICS_NAME, concordance_reports, label_summary_csv, panels_csv,
                                raw_dir, section_labels)
from cellpath.io.sections import read_section_index, read_section_table

if TYPE_CHECKING:
    from cellpath.concordance.detections import Detections

log = logging.getLogger(__name__)


def _detections_for(params: Params, data_dir: Path, row) -> object:
    """CellViT++ detections when concordance.cellvit_dir is set, else the built-in detector's."""
    slide = raw_dir(data_dir) / row.raw_folder / row.he_image
    cellvit_dir = params.concordance.cellvit_dir
    if cellvit_dir is not None:
        from cellpath.concordance.cellvit import find_cellvit_output, read_cellvit

        path = find_cellvit_output(cellvit_dir, row.section_id, wsi_name=row.he_image)
        return read_cellvit(path, slide_mpp=float(row.he_mpp),
                            slide_dimensions=(int(row.he_width_px), int(row.he_height_px)))
    from cellpath.concordance.detector import detect_nuclei

    return detect_nuclei(slide, mpp=float(row.he_mpp))


def _registration_columns(cfg: ConcordanceConfig, detections: Detections, placed_px: np.ndarray, row) -> dict:
    """Registration QC columns of one section (concordance/registration.py; positions in H&E level-0 px);
    a warning when flagged."""
    from cellpath.concordance.registration import registration_flagged, registration_qc

    qc = registration_qc(detections.xy, placed_px, float(row.he_mpp), cfg.registration_radius_um)
    flagged = registration_flagged(qc, cfg.registration_max_median_um, cfg.registration_max_p90_um)
    if flagged:
        log.warning("concordance %s: registration flagged: matched H&E-to-Xenium distances median %.2f µm, "
                    "p90 %.2f µm (limits %.1f, %.1f µm); residual affine shift (%.2f, %.2f) µm, rotation %.3f°, "
                    "RMS %.2f → %.2f µm after it. Informational: the section stays in the ranking",
                    row.section_id, qc.reg_median_um, qc.reg_p90_um, cfg.registration_max_median_um,
                    cfg.registration_max_p90_um, qc.reg_translation_x_um, qc.reg_translation_y_um,
                    qc.reg_rotation_deg, qc.reg_rms_um, qc.reg_residual_rms_um)
    return {**qc.as_columns(), "registration_flagged": flagged}


def _section_row(params: Params, data_dir: Path, row, summary: pd.DataFrame) -> dict:
    """One section's panels-table row: AGR-BAcc, match counts, coverage and registration QC."""
    from cellpath.concordance.scoring import agr_bacc, mutual_nearest_neighbours

    cfg = params.concordance
    table = read_section_table(data_dir, row.section_id)
    labels = pd.read_parquet(section_labels(data_dir, row.section_id)).set_index("cell_id")
    coarse = labels.loc[table.obs_names, "coarse"].to_numpy()
    detections = _detections_for(params, data_dir, row)
    placed_px = table.obs[["he_x_px", "he_y_px"]].to_numpy()
    cap_px = cfg.max_match_distance_um / float(row.he_mpp)
    pairs, pred_unmatched, ref_unmatched = mutual_nearest_neighbours(detections.xy, placed_px, cap_px)
    truth = coarse[pairs[:, 1]]
    scored = np.array([c is not None and c == c for c in truth], dtype=bool)
    excluded = bool(summary.loc[row.section_id, "excluded"])
    poor_coverage = bool(summary.loc[row.section_id, "poor_reference_coverage"])
    score = None if excluded else agr_bacc(truth[scored], detections.coarse[pairs[scored, 0]])
    log.info("concordance %s: %d detected, %d matched (%d with a Tcoarse label), AGR-BAcc %s", row.section_id,
             len(detections), len(pairs), int(scored.sum()), "undefined" if score is None else f"{score:.3f}")
    return {"section_id": row.section_id, "organ": row.organ, "score": score,
            "n_detected": len(detections), "n_dropped_detections": detections.n_dropped,
            "n_xenium": table.n_obs, "n_matched": len(pairs), "n_matched_scored": int(scored.sum()),
            "n_detected_unmatched": pred_unmatched, "n_xenium_unmatched": ref_unmatched,
            "excluded_by_annotation": excluded, "cells": table.n_obs,
            "reference_unmatched": float(summary.loc[row.section_id, "coverage_unmatched"]),
            "poor_reference_coverage": poor_coverage,
            "alignment_source": getattr(row, "alignment_source", "given"),  # ingest: given or registered
            **_registration_columns(cfg, detections, placed_px, row)}


def run(params: Params, data_dir: Path, reports: Path) -> pd.DataFrame:
    """concordance: AGR-BAcc per section, the ranking, registration QC and the nested panels (data/panels.csv)."""
    from cellpath.concordance.scoring import nested_panels, rank_sections

    cfg = params.concordance
    index = read_section_index(data_dir)
    summary = pd.read_csv(label_summary_csv(data_dir)).set_index("section_id")
    rows = [_section_row(params, data_dir, row, summary) for row in index.itertuples()]
    ranked = rank_sections(pd.DataFrame(rows))
    try:
        panels = nested_panels(ranked, list(cfg.panel_sizes))
    except ValueError as exc:  # more panel sections than ranked ones (annotation excluded some)
        from cellpath.errors import ConfigError

        raise ConfigError(f"concordance.panel_sizes: {exc} (sections excluded by annotation have no score)") from None
    with atomic_output(panels_csv(data_dir)) as tmp:
        panels.to_csv(tmp, index=False)
    with atomic_output(concordance_reports(reports)) as out:
        out.mkdir()
        panels.to_csv(out / CONCORDANCE_NAME, index=False)
        metrics = {"sections_ranked": int(panels["rank"].notna().sum()),
                   "mean_agr_bacc": round(float(panels["score"].mean()), 4),
                   "panel": params.panel, "panel_sections": int(panels[params.panel].sum()),
                   "registration_flagged": int(panels["registration_flagged"].sum())}
        (out / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("concordance: %d sections ranked; %s", metrics["sections_ranked"],
             ", ".join(f"{c}={int(panels[c].sum())}" for c in panels.columns if c.startswith("S")))
    return panels
