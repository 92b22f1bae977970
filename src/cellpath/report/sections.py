"""The page's tables, section by section: headline, within-section (CRA, IS per readout and nested
panel), cross-domain (CRT, landscape, effects, panel robustness), robustness and data.

Each builder returns ``{file name: (display table, numeric frame)}``; scores are fractions in the
inputs and percentage points (pp) on the page.
"""

from __future__ import annotations

import pandas as pd

from cellpath.report import tables
from cellpath.report.expression import expression_table
from cellpath.report.inputs import ReportInputs, protocols_run
from cellpath.report.published import published_tables
from cellpath.report.render import Table, display_table
from cellpath.vocabulary import CROSS_DOMAIN_PROTOCOLS, PROTOCOLS, TAXONOMIES, TAXONOMY_LABELS, headline_magnification

Built = dict[str, tuple[Table, pd.DataFrame]]

IS_CAPTION = ("Organ-balanced Macro-F1 per readout (pp) ± SD across sections; CRA of this taxonomy (pp); Wins: "
              "CRA significant wins, paired Wilcoxon over the common (section, seed) differences. Rows by wins, "
              "then the unrounded CRA (Supplementary C).")
INTERVAL_NOTE = ("[low, high]: 95% bootstrap interval of the mean, resampling the balanced units (organs or folds) "
                 "and the seeds within them (2,000 replicates; beyond the paper, which reports mean ± SD).")


def build_tables(inputs: ReportInputs, magnifications: list[str], panel: str) -> Built:
    """Every table of the page, keyed by file name, as (display table, numeric frame); ``panel``: the
    evaluated panel (params.yaml ``panel``). Tables a protocol that was not run leaves empty say so."""
    headline = headline_magnification(magnifications)
    built = (_probe_tables(inputs, magnifications, panel) | _cross_domain_tables(inputs, magnifications)
             | published_tables(inputs, headline) | _expression_tables(inputs, headline) | _robustness_tables(inputs, headline)
             | _data_tables(inputs))
    _explain_empty(built, protocols_run(inputs.runs))
    return built


def _explain_empty(built: Built, protocols: list[str]) -> None:
    """Set why the IS, cross-domain and landscape tables are empty when their protocols were not run."""
    ran = ", ".join(p.upper() for p in protocols) or "none"
    for name, (table, _) in built.items():
        if name.startswith(("cra_", "is_")) and "is" not in protocols:
            table.empty_reason = f"IS was not run: protocols run {ran} (params: protocol)"
        elif name.startswith("cross_domain") and not set(protocols) & set(CROSS_DOMAIN_PROTOCOLS):
            table.empty_reason = f"no cross-domain protocol was run: protocols run {ran} (params: protocol)"
        elif name == "landscape" and set(protocols) != set(PROTOCOLS):
            table.empty_reason = f"CRA needs IS and CRT all three cross-domain protocols: protocols run {ran}"


def _expression_tables(inputs: ReportInputs, headline: str) -> Built:
    """The label-free expression probes' table (none when the run has no expression outputs)."""
    if inputs.expression is None:
        return {}
    numeric = expression_table(inputs.expression["summary"], inputs.expression["cra"], inputs.expression["wins"],
                               headline)
    return {"expression": display_table(
        "expression", f"Measured expression decoded at the nucleus — Nuc, {headline}",
        "Per model and protocol: mean Pearson r over the run's genes (its 50 most variable on its training cells) "
        "between the predicted and the measured log-normalised expression of the test cells, mean ± SD across the "
        "balanced units [95% interval]; r(type): the same ridge from the cell's transferred Tfine label alone (no "
        "model); r(type+features): each type's mean plus the ridge of the features on the cell's deviation from "
        "it; gain: r(type+features) − r(type), what the features decode beyond the type; wins: paired Wilcoxon on "
        "mean r over (unit, seed); CRA r: IS Nuc − Mean (docs/decisions/0049).",
        numeric, percent_pairs=False, percent_columns=())}


def _probe_tables(inputs: ReportInputs, magnifications: list[str], panel: str) -> Built:
    """The headline, within-section (CRA, IS per readout and nested panel) tables."""
    probe, headline = inputs.probe, headline_magnification(magnifications)
    out: Built = {}
    out["headline"] = display_table(
        "headline", "Headline", f"Tfine, Nuc readout, {headline}: Macro-F1 per protocol (mean ± SD, pp), CRA (pp), "
        "CRT and the robustness summary (CRoMa median, LTM10, RI) of the same readout and magnification. "
        + INTERVAL_NOTE,
        tables.headline(probe["summary"], probe["cra_pooled"], probe["crt"], inputs.robustness["summary"], headline))
    for magnification in magnifications:
        out[f"cra_{magnification}"] = display_table(
            f"cra_{magnification}", f"Table 4 — within-section CRA at {magnification}",
            "IS organ-balanced Macro-F1 (mean ± SD across organs, pp) of Nuc and Mean under both taxonomies; CRA "
            "(Eq. 4, taxonomies pooled) ± SD across organs; CRA wins: paired Wilcoxon over (section, taxonomy, seed) "
            "differences; Holm wins: the same after Holm's correction over the opponents. Bold: best, underlined: "
            "second best. " + INTERVAL_NOTE,
            tables.cra_table(probe["summary"], probe["cra_pooled"], magnification))
        for taxonomy in TAXONOMIES:
            numeric = tables.is_readout_table(probe["is_panels"], probe["cra_panels"], panel, magnification, taxonomy)
            out[f"is_{taxonomy}_{magnification}"] = display_table(
                f"is_{taxonomy}_{magnification}",
                f"IS, all readouts — {panel}, {TAXONOMY_LABELS[taxonomy]}, {magnification}", IS_CAPTION, numeric)
    for smaller in sorted(set(probe["is_panels"]["panel"]) - {panel}, key=lambda name: -int(name[1:])):
        for taxonomy in TAXONOMIES:
            name = f"is_{taxonomy}_{headline}_{smaller}"
            out[name] = display_table(
                name, f"IS, all readouts — nested panel {smaller}, {TAXONOMY_LABELS[taxonomy]}, {headline}",
                IS_CAPTION + " Computed from this panel's sections alone (IS needs no refit).",
                tables.is_readout_table(probe["is_panels"], probe["cra_panels"], smaller, headline, taxonomy))
    out["is_panels_all"] = display_table(
        "is_panels_all", "IS tables of every nested panel, magnification and metric",
        "Long form of the supplement's IS tables: organ-balanced mean and SD across sections per readout.",
        probe["is_panels"].set_index("model"), percent_pairs=False, percent_columns=())
    return out


def _cross_domain_tables(inputs: ReportInputs, magnifications: list[str]) -> Built:
    """Cross-domain transfer, the CRA–CRT landscape, rank agreement, magnification and panel effects."""
    probe, headline = inputs.probe, headline_magnification(magnifications)
    out: Built = {}
    for taxonomy in TAXONOMIES:
        out[f"cross_domain_{taxonomy}"] = display_table(
            f"cross_domain_{taxonomy}", f"Table 5 — cross-domain transfer, {TAXONOMY_LABELS[taxonomy]}, {headline}",
            "Nuc Macro-F1 and Macro-AUROC (mean ± SD, pp) per protocol; wins: Macro-F1 significant wins (the "
            "paper's, uncorrected); Holm wins: those left after Holm's correction over the opponents (beyond the "
            "paper); CRT: mean of the three Tfine uncorrected win counts (Eq. 5). " + INTERVAL_NOTE,
            tables.cross_domain_table(probe["summary"], probe["wins"], probe["crt"], headline, taxonomy))
    out["landscape"] = display_table(
        "landscape", "CRA–CRT landscape data", "CRA in pp; pretraining scale and parameters as in the registry.",
        tables.landscape(probe["cra_pooled"], probe["crt"], inputs.registry, headline).set_index("model"),
        percent_columns=("cra",), shown=["cra", "cra_wins", "crt", "type", "pretraining (WSI eq.)",
                                         "parameters (registry)"])
    out["rank_agreement"] = display_table(
        "rank_agreement", "Taxonomy rank agreement",
        "Spearman ρ of model means under Tfine and Tcoarse (Nuc); undefined (–) with fewer than three models.",
        probe["rank_agreement"].set_index("protocol"), percent_pairs=False)
    retention = tables.magnification_effect(probe["summary"], magnifications)
    retention_columns = [c for c in retention.columns if c.endswith("retention")]
    out["magnification_retention"] = display_table(
        "magnification_retention", "Magnification retention",
        "Tfine Nuc Macro-F1 relative to the highest magnification, mean over models (the paper: 99.6 % at 20×, "
        "92.9 % at 10× under IS).",
        retention.groupby("protocol")[retention_columns].mean().reindex(
            [p for p in tables.PROTOCOLS if p in set(retention["protocol"])]), percent_columns=retention_columns)
    panel = tables.panel_robustness(inputs.runs, inputs.panels, headline)
    out["panel_robustness"] = display_table(
        "panel_robustness", "Panel robustness",
        f"IS Tfine Nuc Macro-F1 (pp) at {headline} on each nested panel (organ-balanced over the panel's sections), "
        "the model's rank and Spearman ρ of the ranking against the largest panel. IS units are single sections, "
        "so smaller panels are read from the same runs; cross-domain protocols need a run per panel "
        "(`dvc exp run -S panel=S10`).",
        panel.set_index("model").rename(columns={"macro_f1": "IS Nuc F1"}), percent_columns=("IS Nuc F1",))
    return out


def _robustness_tables(inputs: ReportInputs, headline: str) -> Built:
    """The robustness summary, shortcut probe, metric agreement, sensitivity and low-margin enrichment."""
    out: Built = {}
    rob = tables.robustness_table(inputs.robustness["summary"], inputs.robustness["shortcut_summary"])
    out["robustness"] = display_table(
        "robustness", "Robustness summary",
        "Per condition: cells scored (undefined margins counted, never dropped), CRoMa median, F(0), LTM10, RI, MaRI "
        "with support, k, k-NN balanced accuracy for biology and for the confounder, the median–LTM10 Pareto "
        "flag among the models of the condition, and the shortcut probe's nIPD.",
        rob.set_index("model"), percent_pairs=False, percent_columns=())
    shortcut = inputs.robustness["shortcut_summary"]
    out["shortcut"] = display_table(
        "shortcut", "Shortcut probe",
        "APD and nIPD per model and evaluation setting, nIPD with its 95 % percentile bootstrap interval over the "
        "resampling runs (n_runs); the confounder the training pools were biased by.",
        tables.shortcut_table(shortcut).set_index("model"), percent_pairs=False, percent_columns=())
    out["agreement"] = display_table(
        "agreement", "Rank agreement of the robustness metrics",
        "Spearman ρ across models per condition: RI, MaRI and median CRoMa with each other (CRoMa paper, Table "
        "S4); each representation metric with the shortcut probe's nIPD and median CRoMa with APD on the probe's "
        "own condition (Table S8; positive: more robust, less degradation); confounder k-NN accuracy with median "
        "CRoMa. Undefined (–) with fewer than three models.",
        inputs.robustness["agreement"].set_index("x"), percent_pairs=False, percent_columns=())
    out["sensitivity"] = display_table(
        "sensitivity", "Sensitivity to m and α",
        "Spearman ρ across models between the rankings at two settings (CRoMa paper, Tables S1 and S2): median "
        "CRoMa at the headline m against each extreme of the m sweep and the extremes against each other; LTM at "
        "each pair of tail fractions α. '< 0': models whose ranked statistic is negative (for m: confounder-"
        "dominant), at the two settings and the fewest–most over the whole sweep. Undefined (–) with fewer than "
        "three models; empty unless robustness.sensitivity is set.",
        tables.sensitivity_table(inputs.robustness["sensitivity_agreement"]), percent_pairs=False,
        percent_columns=())
    enrichment = inputs.robustness["low_margin_enrichment"].sort_values("enrichment", ascending=False)
    out["low_margin_enrichment"] = display_table(
        "low_margin_enrichment", "Low-margin enrichment",
        "Cells in the worst margin decile by cell type, organ and section: share among low-margin cells over share "
        "among all scored cells (> 1: over-represented among the failures). The 15 most enriched are shown; every "
        "row is in reports/tables/low_margin_enrichment.csv.",
        enrichment.set_index("model"), percent_pairs=False, percent_columns=(), max_rows=15)
    return out


def _data_tables(inputs: ReportInputs) -> Built:
    """What was evaluated: cells per class and section, candidate sections and panels."""
    out: Built = {}
    counts = tables.class_counts(inputs.label_summary)
    out["class_counts"] = (Table("class_counts", "Cells per Tfine class and section",
                                 "Eligible labelled cells; the last rows give the panel total and each class's share.",
                                 tables.display_counts(counts)), counts)
    out["panels"] = display_table(
        "panels", "Candidate sections and panels",
        " ".join(filter(None, ["Sections ranked by AGR-BAcc; membership of each nested panel; sections excluded by "
                               "annotation are listed, not dropped.", _registration_caption(inputs.panels)])),
        tables.panel_table(inputs.panels).set_index("section_id"), percent_pairs=False, percent_columns=())
    out["probe_runs"] = display_table(
        "probe_runs", "Every probe run",
        "One row per planned run, fitted or skipped: its training cells, the C chosen on validation (the "
        "smallest of the c_tied Cs whose validation Macro-F1 is exactly the best), the test Macro-F1 (a "
        "fraction), the L-BFGS iterations of its slowest C and whether every C converged. The first 15 are "
        "shown; every run is in reports/tables/probe_runs.csv, the readable copy of reports/probe/runs.parquet.",
        tables.run_table(inputs.runs), percent_pairs=False, percent_columns=(), max_rows=15)
    return out


def _registration_caption(panels: pd.DataFrame) -> str:
    """What the registration columns mean and which sections are flagged (empty before registration QC)."""
    if "registration_flagged" not in panels.columns:
        return ""
    flagged = sorted(panels.loc[panels["registration_flagged"].astype(bool), "section_id"].astype(str))
    return ("alignment_source: the alignment that placed the nuclei — the section's own file (given), or the one "
            "ingest registered from the nuclei (docs/decisions/0051). "
            "Registration QC (reg_*): H&E nuclei matched to the Xenium nuclei placed on the H&E by the alignment; "
            "median and 90th percentile of their distances (µm), the residual affine H&E → Xenium (translation µm, "
            "rotation °, scale, shear °) and the RMS distance left after it (µm). Per-cell misregistration leaves "
            "the affine near the identity; a global one shows in the affine and a small residual. "
            "registration_flagged: median or 90th percentile above concordance.registration_max_median_um / "
            "registration_max_p90_um; informational, the section stays in the ranking. "
            + (f"Flagged: {', '.join(flagged)}." if flagged else "No section is flagged."))
