"""annotate: labels per section (68 types, Tfine, Tcoarse, eligibility), the per-section summary
(with the reference's coverage of the section), marker QC, and for simulated sections the
transfer's accuracy against the simulator's truth."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import annotation_reports, labels_dir, raw_dir, reference_h5ad, references_dir, section_zarr
from cellpath.io.sections import read_section_index, read_section_table

log = logging.getLogger(__name__)


def _reference_path(params: Params, data_dir: Path, section_id: str, organ: str) -> Path:
    name = params.annotate.references.get(section_id, organ.lower())
    path = reference_h5ad(data_dir, name)
    if not path.is_file():
        available = sorted(p.stem for p in references_dir(data_dir).glob("*.h5ad"))
        raise InputError(
            f"no reference {name!r} for organ {organ!r} (available: {', '.join(available) or 'none'}); "
            f"add one to {references_dir(data_dir)} or map the section in annotate.references",
            path=path, section=section_id)
    return path


def run(params: Params, data_dir: Path, reports: Path) -> pd.DataFrame:
    """annotate: labels per section, the per-section summary, marker QC, and (simulated) accuracy."""
    from cellpath.annotation.coverage import coverage, neighbourhood_similarity, scored_cells
    from cellpath.annotation.labels import against_truth, label_frame, section_summary
    from cellpath.annotation.marker_qc import marker_enrichment
    from cellpath.annotation.transfer import (UNCERTAIN, check_counts, fit_transfer, load_reference, reference_space,
                                              transfer_labels)

    cfg = params.annotate
    index = read_section_index(data_dir)
    models: dict[tuple[str, tuple[str, ...]], object] = {}
    references: dict[Path, object] = {}
    summaries, qc_tables, truth_rows = [], [], []
    with atomic_output(labels_dir(data_dir)) as out:
        out.mkdir()
        for row in index.itertuples():
            section_id = row.section_id
            table = read_section_table(data_dir, section_id)
            counts = check_counts(table.X, "Xenium counts", section_zarr(data_dir, section_id), section_id)
            genes = tuple(map(str, table.var_names))
            ref_path = _reference_path(params, data_dir, section_id, row.organ)
            if ref_path not in references:
                references[ref_path] = load_reference(ref_path, cfg.label_column, cfg.label_vocabulary,
                                                      cfg.reference_counts)
            reference = references[ref_path]
            key = (reference.name, genes)
            if key not in models:
                models[key] = fit_transfer(reference, genes, regularisation_c=cfg.regularisation_c,
                                           min_shared_genes=cfg.min_shared_genes, section=section_id)
            projected = reference_space(models[key], counts, genes)
            transferred = transfer_labels(models[key], projected, cfg.confidence_threshold)
            labels = label_frame(section_id, table.obs_names.to_numpy(), transferred)
            labels.to_parquet(out / f"{section_id}.parquet", index=False)
            scored = scored_cells(len(labels), cfg.coverage_max_cells)
            covered = coverage(neighbourhood_similarity(projected, models[key].centroids, scored,
                                                        n_neighbours=cfg.coverage_neighbours),
                               cfg.coverage_min_similarity)
            summary = section_summary(labels, organ=row.organ, reference=reference.name,
                                      min_cells_per_coarse_class=cfg.min_cells_per_coarse_class, coverage=covered,
                                      max_unmatched=cfg.coverage_max_unmatched)
            summaries.append(summary)
            if summary["poor_reference_coverage"]:
                log.warning("annotate %s: POOR REFERENCE COVERAGE: %.1f%% of %d scored cells (95%% CI %.1f–%.1f%%) "
                            "resemble no type of reference %r (similarity < %.2f; flagged above %.0f%%); types the "
                            "reference lacks are labelled as its nearest types. Review the section or use a "
                            "reference that covers it", section_id, 100 * covered.share_unmatched, covered.n_scored,
                            100 * covered.share_low, 100 * covered.share_high, reference.name,
                            cfg.coverage_min_similarity, 100 * cfg.coverage_max_unmatched)
            qc = marker_enrichment(labels["type_68"].to_numpy(), counts, genes, min_cells=cfg.marker_min_cells,
                                   min_log_fold_change=cfg.marker_min_log_fold_change, skip=(UNCERTAIN,))
            qc_tables.append(qc.assign(section_id=section_id))
            truth_path = raw_dir(data_dir) / section_id / "simulation_truth.parquet"
            if truth_path.is_file():
                truth_rows.append(against_truth(labels, pd.read_parquet(truth_path)))
            log.info("annotate %s: %d cells, %d eligible, %d uncertain, %.1f%% unmatched by the reference, "
                     "mapping %s%s", section_id, summary["n_cells"], summary["n_eligible"], summary["n_uncertain"],
                     100 * covered.share_unmatched, summary["mapping"],
                     f", EXCLUDED: {summary['exclusion_reason']}" if summary["excluded"] else "")
        summary_frame = pd.DataFrame(summaries)
        summary_frame.to_csv(out / "summary.csv", index=False)
        qc_frame = pd.concat(qc_tables, ignore_index=True)
        qc_frame = qc_frame[["section_id", *[c for c in qc_frame.columns if c != "section_id"]]]
        qc_frame.to_csv(out / "marker_qc.csv", index=False)
    flagged = qc_frame[qc_frame["status"] == "not_enriched"]
    log.info("annotate: %d sections (%d excluded, %d with poor reference coverage), %d type(s) flagged by marker QC",
             len(summary_frame), int(summary_frame["excluded"].sum()),
             int(summary_frame["poor_reference_coverage"].sum()), len(flagged))
    _write_truth_report(truth_rows, annotation_reports(reports))
    return summary_frame


def _write_truth_report(rows: list[dict], folder: Path) -> None:
    """reports/annotation/: transfer quality against the simulator's truth (empty for real data)."""
    frame = pd.DataFrame(rows)
    with atomic_output(folder) as out:
        out.mkdir()
        frame.to_csv(out / "against_truth.csv", index=False)
        metrics = {"sections_with_truth": len(frame)}
        if len(frame):
            metrics |= {f"mean_{k}": round(float(frame[k].mean()), 4)
                        for k in ("accuracy_68", "tfine_accuracy", "tfine_macro_f1", "uncertain_fraction")}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
