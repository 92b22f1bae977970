"""concordance: H&E nuclei (CellViT++ output or the built-in detector) against the Xenium labels:
AGR-BAcc per section, the ranking, and the nested panels (``data/panels.csv``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import Params
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (CONCORDANCE_NAME, METRICS_NAME, concordance_reports, label_summary_csv, panels_csv,
                                raw_dir, section_labels)
from cellpath.io.sections import read_section_index, read_section_table

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


def run(params: Params, data_dir: Path, reports: Path) -> pd.DataFrame:
    """concordance: AGR-BAcc per section, the ranking, and the nested panels (data/panels.csv)."""
    from cellpath.concordance.scoring import agr_bacc, mutual_nearest_neighbours, nested_panels, rank_sections

    cfg = params.concordance
    index = read_section_index(data_dir)
    summary = pd.read_csv(label_summary_csv(data_dir)).set_index("section_id")
    rows = []
    for row in index.itertuples():
        table = read_section_table(data_dir, row.section_id)
        labels = pd.read_parquet(section_labels(data_dir, row.section_id)).set_index("cell_id")
        coarse = labels.loc[table.obs_names, "coarse"].to_numpy()
        detections = _detections_for(params, data_dir, row)
        cap_px = cfg.max_match_distance_um / float(row.he_mpp)
        pairs, pred_unmatched, ref_unmatched = mutual_nearest_neighbours(
            detections.xy, table.obs[["he_x_px", "he_y_px"]].to_numpy(), cap_px)
        truth = coarse[pairs[:, 1]]
        scored = np.array([c is not None and c == c for c in truth], dtype=bool)
        excluded = bool(summary.loc[row.section_id, "excluded"])
        poor_coverage = bool(summary.loc[row.section_id, "poor_reference_coverage"])
        score = None if excluded else agr_bacc(truth[scored], detections.coarse[pairs[scored, 0]])
        rows.append({"section_id": row.section_id, "organ": row.organ, "score": score,
                     "n_detected": len(detections), "n_dropped_detections": detections.n_dropped,
                     "n_xenium": table.n_obs, "n_matched": len(pairs), "n_matched_scored": int(scored.sum()),
                     "n_detected_unmatched": pred_unmatched, "n_xenium_unmatched": ref_unmatched,
                     "excluded_by_annotation": excluded, "cells": table.n_obs,
                     "reference_unmatched": float(summary.loc[row.section_id, "coverage_unmatched"]),
                     "poor_reference_coverage": poor_coverage})
        log.info("concordance %s: %d detected, %d matched (%d with a Tcoarse label), AGR-BAcc %s", row.section_id,
                 len(detections), len(pairs), int(scored.sum()), "undefined" if score is None else f"{score:.3f}")
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
                   "panel": params.panel, "panel_sections": int(panels[params.panel].sum())}
        (out / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("concordance: %d sections ranked; %s", metrics["sections_ranked"],
             ", ".join(f"{c}={int(panels[c].sum())}" for c in panels.columns if c.startswith("S")))
    return panels
