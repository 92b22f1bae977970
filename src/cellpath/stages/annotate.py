"""annotate: labels per section (68 types, Tfine, Tcoarse, eligibility), the per-section summary
(with the reference's coverage of the section), marker QC, and for simulated sections the
transfer's accuracy against the simulator's truth."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from cellpath.annotation.assignment import reference_caveat, reference_name
from cellpath.annotation.labels import against_truth
from cellpath.annotation.section import annotate_section, marker_qc_table
from cellpath.annotation.transfer import check_counts, fit_transfer, load_reference
from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (AGAINST_TRUTH_NAME, LABEL_SUMMARY_NAME, MARKER_QC_NAME, METRICS_NAME,
                                annotation_reports, labels_dir, reference_h5ad, references_dir, section_zarr,
                                simulation_truth_parquet)
from cellpath.io.sections import read_section_index, read_section_table

log = logging.getLogger(__name__)


def _reference_path(params: Params, data_dir: Path, section_id: str, organ: str, status: str) -> Path:
    try:
        name = reference_name(params.annotate.references, params.source, section_id, organ, str(status))
    except InputError as exc:
        raise InputError(str(exc), section=section_id) from None
    path = reference_h5ad(data_dir, name)
    if not path.is_file():
        available = sorted(p.stem for p in references_dir(data_dir).glob("*.h5ad"))
        raise InputError(
            f"no reference {name!r} for organ {organ!r} (available: {', '.join(available) or 'none'}); "
            f"add one to {references_dir(data_dir)} (`cellpath references build {name}`) or map the section in "
            f"annotate.references{reference_caveat(name)}", path=path, section=section_id)
    return path


def run(params: Params, data_dir: Path, reports: Path) -> pd.DataFrame:
    """annotate: labels per section, the per-section summary, marker QC, and (simulated) accuracy."""
    cfg = params.annotate
    models: dict[tuple[str, tuple[str, ...]], object] = {}
    references: dict[Path, object] = {}
    summaries, qc_tables, truth_rows = [], [], []
    with atomic_output(labels_dir(data_dir)) as out:
        out.mkdir()
        for row in read_section_index(data_dir).itertuples():
            section_id = row.section_id
            table = read_section_table(data_dir, section_id)
            counts = check_counts(table.X, "Xenium counts", section_zarr(data_dir, section_id), section_id)
            genes = tuple(map(str, table.var_names))
            ref_path = _reference_path(params, data_dir, section_id, row.organ, row.status)
            if ref_path not in references:
                references[ref_path] = load_reference(ref_path, cfg.label_column, cfg.label_vocabulary,
                                                      cfg.reference_counts, cfg.gene_symbols)
            key = (references[ref_path].name, genes)
            if key not in models:
                models[key] = fit_transfer(references[ref_path], genes, regularisation_c=cfg.regularisation_c,
                                           min_shared_genes=cfg.min_shared_genes, section=section_id)
            section = annotate_section(models[key], references[ref_path].name, counts, genes,
                                       table.obs_names.to_numpy(), section_id, row.organ, cfg)
            section.labels.to_parquet(out / f"{section_id}.parquet", index=False)
            summaries.append(section.summary)
            qc_tables.append(section.marker_qc)
            truth_path = simulation_truth_parquet(data_dir, section_id)
            if truth_path.is_file():
                truth_rows.append(against_truth(section.labels, pd.read_parquet(truth_path)))
        summary_frame = pd.DataFrame(summaries)
        summary_frame.to_csv(out / LABEL_SUMMARY_NAME, index=False)
        qc_frame = marker_qc_table(qc_tables)
        qc_frame.to_csv(out / MARKER_QC_NAME, index=False)
    log.info("annotate: %d sections (%d excluded, %d with poor reference coverage), %d type(s) flagged by marker QC",
             len(summary_frame), int(summary_frame["excluded"].sum()),
             int(summary_frame["poor_reference_coverage"].sum()), int((qc_frame["status"] == "not_enriched").sum()))
    _write_truth_report(truth_rows, annotation_reports(reports))
    return summary_frame


def _write_truth_report(rows: list[dict], folder: Path) -> None:
    """reports/annotation/: transfer quality against the simulator's truth (empty for real data)."""
    frame = pd.DataFrame(rows)
    with atomic_output(folder) as out:
        out.mkdir()
        frame.to_csv(out / AGAINST_TRUTH_NAME, index=False)
        metrics = {"sections_with_truth": len(frame)}
        if len(frame):
            metrics |= {f"mean_{k}": round(float(frame[k].mean()), 4)
                        for k in ("accuracy_68", "tfine_accuracy", "tfine_macro_f1", "uncertain_fraction")}
        (out / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
