"""One section's annotation from a fitted transfer: its labels, summary (with the reference's
coverage of it) and marker QC. Pure: counts and a fitted model in, tables out."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import sparse

from cellpath.annotation.coverage import coverage, neighbourhood_similarity, scored_cells
from cellpath.annotation.labels import label_frame, section_summary
from cellpath.annotation.marker_qc import marker_enrichment
from cellpath.annotation.transfer import UNCERTAIN, reference_space, transfer_labels
from cellpath.config import AnnotateConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SectionAnnotation:
    """A section's per-cell labels (``labels.LABEL_COLUMNS``), its summary row and its marker QC rows."""

    labels: pd.DataFrame
    summary: dict
    marker_qc: pd.DataFrame


def annotate_section(model, reference_name: str, counts: sparse.spmatrix, genes: tuple[str, ...],
                     cell_ids: np.ndarray, section_id: str, organ: str, cfg: AnnotateConfig) -> SectionAnnotation:
    """Transfer labels to one section's cells (``counts``: cells × ``genes``, raw integers), measure
    how well the reference covers them, and check each type's markers."""
    projected = reference_space(model, counts, genes)
    labels = label_frame(section_id, cell_ids, transfer_labels(model, projected, cfg.confidence_threshold))
    covered = coverage(neighbourhood_similarity(projected, model.centroids,
                                                scored_cells(len(labels), cfg.coverage_max_cells),
                                                n_neighbours=cfg.coverage_neighbours),
                       cfg.coverage_min_similarity)
    summary = section_summary(labels, organ=organ, reference=reference_name,
                              min_cells_per_coarse_class=cfg.min_cells_per_coarse_class, coverage=covered,
                              max_unmatched=cfg.coverage_max_unmatched)
    if summary["poor_reference_coverage"]:
        log.warning("annotate %s: POOR REFERENCE COVERAGE: %.1f%% of %d scored cells (95%% CI %.1f–%.1f%%) "
                    "resemble no type of reference %r (similarity < %.2f; flagged above %.0f%%); types the "
                    "reference lacks are labelled as its nearest types. Review the section or use a "
                    "reference that covers it", section_id, 100 * covered.share_unmatched, covered.n_scored,
                    100 * covered.share_low, 100 * covered.share_high, reference_name,
                    cfg.coverage_min_similarity, 100 * cfg.coverage_max_unmatched)
    qc = marker_enrichment(labels["type_68"].to_numpy(), counts, genes, min_cells=cfg.marker_min_cells,
                           min_log_fold_change=cfg.marker_min_log_fold_change, skip=(UNCERTAIN,))
    log.info("annotate %s: %d cells, %d eligible, %d uncertain, %.1f%% unmatched by the reference, mapping %s%s",
             section_id, summary["n_cells"], summary["n_eligible"], summary["n_uncertain"],
             100 * covered.share_unmatched, summary["mapping"],
             f", EXCLUDED: {summary['exclusion_reason']}" if summary["excluded"] else "")
    return SectionAnnotation(labels, summary, qc.assign(section_id=section_id))


def marker_qc_table(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Every section's marker QC rows in one table, ``section_id`` first."""
    frame = pd.concat(tables, ignore_index=True)
    return frame[["section_id", *[c for c in frame.columns if c != "section_id"]]]
