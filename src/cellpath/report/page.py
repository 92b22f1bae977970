"""The page's assembly: the template's variables from the built tables and figures, its header,
the "where results live" list, the glossary and the gallery's links."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.io.layout import gallery_dir
from cellpath.report.inputs import ReportInputs, evaluated_panel, protocols_run
from cellpath.report.render import Table
from cellpath.vocabulary import TAXONOMIES, headline_magnification

GLOSSARY = [
    ("Macro-F1, Macro-AUROC, Macro-AUPRC",
     "Of a linear probe on frozen features, averaged with equal weight per class; reported as mean ± SD over the "
     "protocol's balanced units (organs for IS, IOCD and LOOO; folds for MOCV), in percentage points "
     "(CellPath-Bench, Sec. Evaluation)."),
    ("Readouts", "Nuc: the token under the nucleus centroid (bilinear); Mean: the patch's mean token; Cls: the class "
     "token; N+M, N+C: sums; N||M, N||C: concatenations (CellPath-Bench, Sec. Readouts)."),
    ("IS, IOCD, MOCV, LOOO", "Within-section spatial split; intra-organ cross-dataset transfer (train on the other "
     "sections of the organ); multi-organ cross-validation; leave-one-organ-out."),
    ("CRA", "Cell Representation Advantage (Eq. 4): IS Nuc − Mean per section and taxonomy, averaged within organ, "
     "then across organs. Positive: the nucleus token carries cell-type information the patch average loses."),
    ("Significant wins", "How many other models a model beats on paired per-unit scores by a two-sided Wilcoxon "
     "signed-rank test at p < 0.05 with a positive median difference."),
    ("CRT", "Cell Representation Transferability (Eq. 5): the mean of a model's IOCD, MOCV and LOOO win counts."),
    ("CRoMa", "Cross-confounder Robustness Margin of a cell: (d_OS − d_SO) / (d_OS + d_SO) from the mean cosine "
     "distances to its m nearest same-type/other-section (SO) and other-type/same-section (OS) neighbours, never "
     "from its own patch. > 0: biology dominates its neighbourhood (CRoMa paper, Sec. 2.3)."),
    ("F(0), LTM10", "The fraction of cells with margin ≤ 0, and the mean of the worst 10 % of margins."),
    ("RI, MaRI", "Robustness Index: the share of SO among typed neighbours within a fixed k; MaRI weights them by "
     "distance. Support: the fraction of cells with any typed neighbour within k."),
    ("nIPD", "Normalised integrated performance drop of the shortcut probe as the training label–confounder "
     "dependence (Cramér's V) grows; more negative: more shortcut learning (CRoMa paper, Sec. 2.5)."),
    ("AGR-BAcc", "Morphology–annotation concordance of a section: balanced accuracy of H&E nucleus predictions "
     "(CellViT++ or the built-in detector) against the Xenium-derived Tcoarse labels; ranks sections into panels."),
]

#: The "where results live" section: what, where, and the command or file to look at.
WHERE = [
    {"what": "This page and its tables", "text": "reports/index.html; every table as CSV (numbers) and Markdown "
     "(as shown) in reports/tables/, figures in reports/figures/.", "command": "dvc repro report"},
    {"what": "Headline metrics (DVC)", "text": "the headline table's numbers under its names (Macro-F1 per protocol "
     "and CRA in pp, CRT; CRoMa median, F(0), LTM10, RI, MaRI, nIPD); across experiments:",
     "command": "dvc metrics show; dvc exp show --only-changed; dvc plots show"},
    {"what": "Every probe run", "text": "one row per run (model, magnification, readout, taxonomy, protocol, "
     "unit, seed, scores):", "command": "reports/probe/runs.parquet"},
    {"what": "MLflow", "text": "a parent run per stage execution with its log, a child run per condition (model, "
     "magnification, readout, taxonomy, protocol as params; scores in pp) to filter and compare models:",
     "command": "make ui  # http://127.0.0.1:5000"},
    {"what": "Expression probes", "text": "one row per run (r from the features, the type and both), per gene "
     "r and penalty, each run's genes, their summaries; headline numbers for DVC:",
     "command": "reports/expression/; reports/expression_metrics.json"},
    {"what": "Per-cell robustness", "text": "every scored cell's CRoMa margin and the nearest SO / OS neighbours "
     "that decided it:", "command": "reports/robustness/margins.parquet"},
    {"what": "Where models fail", "text": "a page per model of H&E crops (below); the IS test cells each run "
     "misclassified most confidently:", "command": "reports/gallery/; reports/probe/is_errors.parquet"},
]



@dataclass(frozen=True)
class PageImages:
    """The page's images as PNG bytes: ``figures`` by name (None: no data), the Pareto planes
    (title, png) and the H&E thumbnails (section_id, caption, png)."""

    figures: dict[str, bytes | None]
    paretos: list[tuple[str, bytes]]
    thumbnails: list[dict]


def page_context(params: Params, inputs: ReportInputs, built: dict[str, tuple[Table, pd.DataFrame]],
                 magnifications: list[str], images: PageImages, tags: dict[str, str]) -> dict:
    """The template's variables; ``tags``: the run's provenance (git commit, dirty flag, DVC experiment)."""
    by_name = {name: table for name, (table, _) in built.items()}
    landscape = built["landscape"][1]
    missing_scale = landscape.index[landscape["pretrain_wsi"].isna()].tolist()
    return {
        "meta": page_meta(params, inputs, magnifications, tags), "headline": by_name["headline"],
        "cra_tables": [by_name[f"cra_{m}"] for m in magnifications],
        "is_tables": [by_name[f"is_{t}_{m}"] for m in magnifications for t in TAXONOMIES]
        + [table for name, table in by_name.items() if re.fullmatch(r"is_(fine|coarse)_\d+x_S\d+", name)],
        "cross_tables": [by_name["cross_domain_fine"], by_name["cross_domain_coarse"]],
        "published_ranked": "published_this_run" not in by_name,  # a run not comparable is shown beside, unranked
        "published_tables": [by_name[name] for name in ("published_this_run", "published_placement",
                                                        "published_rank_intervals", "published_reproduction")
                             if name in by_name],
        "landscape_table": by_name["landscape"],
        "landscape_note": (f"Without a pretraining scale in the registry (drawn at the left, off the scale): "
                           f"{', '.join(missing_scale)}." if missing_scale else ""),
        "effect_tables": [by_name["rank_agreement"], by_name["magnification_retention"]],
        "expression_table": by_name.get("expression"),
        "panel_table": by_name["panel_robustness"], "robustness_table": by_name["robustness"],
        "shortcut_table": by_name["shortcut"], "agreement_table": by_name["agreement"],
        "sensitivity_table": by_name["sensitivity"],
        "enrichment_table": by_name["low_margin_enrichment"],
        "class_table": by_name["class_counts"], "candidates_table": by_name["panels"],
        "figures": images.figures, "pareto_figures": images.paretos, "thumbnails": images.thumbnails,
        "where": WHERE, "glossary": GLOSSARY, "gallery": gallery_links(inputs.gallery),
    }


def page_meta(params: Params, inputs: ReportInputs, magnifications: list[str], tags: dict[str, str]) -> dict:
    """The header: panel, sections, organs and cells evaluated, encoders, magnifications, protocols and
    probe runs, the source and the provenance."""
    panel = evaluated_panel(inputs.panels, params.panel)
    counts = inputs.counts.get("total", {})
    return {
        "title": params.report.title, "panel": params.panel, "n_sections": len(panel),
        "n_organs": panel["organ"].nunique(), "n_cells": evaluated_cells(inputs.label_summary, panel),
        "encoders": sorted(inputs.runs["model"].unique()), "magnifications": magnifications,
        "headline": headline_magnification(magnifications), "source": params.source,
        "git_commit": tags.get("mlflow.source.git.commit", "unknown")[:10],
        "git_dirty": tags.get("git.dirty") == "true", "experiment": tags.get("dvc.experiment", "workspace"),
        "protocols": [p.upper() for p in protocols_run(inputs.runs)],
        "runs": {k: counts.get(k, 0) for k in ("ok", "skipped", "unavailable", "not_converged")},
        "notes": header_notes(inputs.panels),
    }


def gallery_links(index: dict | None) -> list[dict] | None:
    """Per model, its gallery page (relative to the report) and what it shows; None without a gallery."""
    if index is None:
        return None
    return [{"model": model, "href": f"{gallery_dir(Path('.')).name}/{entry['page']}",
             "lists": [f"{item['title']} ({item['cells']})" for item in entry["lists"]]}
            for model, entry in sorted(index["models"].items())]


def header_notes(panels: pd.DataFrame) -> list[str]:
    """What the header must say about the sections: exclusions, and sections flagged for poor reference
    coverage or registration."""
    notes = []
    excluded = int(panels["excluded_by_annotation"].sum())
    if excluded:
        notes.append(f"{excluded} section(s) excluded by annotation are listed in the data section, not evaluated.")
    flagged = sorted(panels.loc[panels["poor_reference_coverage"].astype(bool), "section_id"].astype(str))
    if flagged:
        notes.append(f"Poor reference coverage (annotate.coverage_max_unmatched exceeded: many cells resemble no "
                     f"reference type and carry the label of the nearest one): {', '.join(flagged)}. They are "
                     "evaluated; review them as the paper's manual review would.")
    if "registration_flagged" in panels.columns:
        misregistered = sorted(panels.loc[panels["registration_flagged"].astype(bool), "section_id"].astype(str))
        if misregistered:
            notes.append(f"Registration QC flagged {', '.join(misregistered)}: their H&E nuclei lie farther from the "
                         "Xenium nuclei than concordance.registration_max_median_um / _p90_um allow (see the data "
                         "section). They are evaluated; check their alignment before trusting their cells.")
    return notes


def evaluated_cells(label_summary: pd.DataFrame, panel: pd.DataFrame) -> int:
    """Eligible labelled cells (every Tfine class) of the evaluated panel's sections."""
    chosen = label_summary[label_summary["section_id"].isin(panel["section_id"])]
    fine = [c for c in chosen.columns if c.startswith("fine:")]
    return int(chosen[fine].to_numpy().sum())
