"""report: the HTML page, Markdown/CSV tables and PNG figures from the probe and robustness outputs.

Reads only what earlier stages wrote (``reports/probe/*.csv``, ``reports/probe/runs.parquet``,
``reports/robustness/*``, ``data/labels/summary.csv``, ``data/panels.csv``, the encoder registry
and, for the H&E thumbnails, the ingested sections), so every number on the page comes from the
run tables. Writes ``reports/index.html`` (images inlined), ``reports/tables/`` (one CSV with the
numbers and one Markdown file with what the page shows, per table) and ``reports/figures/`` (PNG),
each folder replaced atomically.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.features.encoders.registry import selected_encoders
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (COUNTS_NAME, gallery_dir, gallery_index_json, label_summary_csv, panels_csv, probe_reports, probe_runs_parquet, raw_dir,
                                report_figures, report_html, report_tables, robustness_margins_parquet,
                                robustness_reports)
from cellpath.io.sections import read_section_index
from cellpath.published import load_published
from cellpath.published.reference import (RunConfiguration, comparability, placement, published_condition,
                                         reproduction)
from cellpath.report import figures, tables
from cellpath.report.render import Table, render_html
from cellpath.report.thumbnails import section_thumbnail
from cellpath.runtime.tracking import provenance_tags
from cellpath.vocabulary import (CROSS_DOMAIN_PROTOCOLS, PROTOCOL_LABELS, PROTOCOLS, TAXONOMIES, TAXONOMY_LABELS,
                                 headline_magnification)

log = logging.getLogger(__name__)

PROBE_FILES = ["summary", "wins", "crt", "cra", "cra_pooled", "rank_agreement", "is_panels", "cra_panels"]
ROBUSTNESS_FILES = ["summary", "low_margin_enrichment", "shortcut", "shortcut_summary", "agreement",
                    "sensitivity_agreement"]

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
IS_CAPTION = ("Organ-balanced Macro-F1 per readout (pp) ± SD across sections; CRA of this taxonomy (pp); Wins: "
              "CRA significant wins, paired Wilcoxon over the common (section, seed) differences. Rows by wins, "
              "then the unrounded CRA (Supplementary C).")


@dataclass(frozen=True)
class ReportInputs:
    """Everything the report reads, loaded at the edge."""

    probe: dict[str, pd.DataFrame]
    counts: dict
    runs: pd.DataFrame
    robustness: dict[str, pd.DataFrame]
    margins: pd.DataFrame
    label_summary: pd.DataFrame
    panels: pd.DataFrame
    registry: pd.DataFrame
    published: pd.DataFrame  # the paper's results (cellpath.published)
    run_configuration: RunConfiguration
    gallery: dict | None  # reports/gallery/index.json (None: the gallery stage has not run)


def _read(path: Path, stage: str, reader=pd.read_csv, **kwargs):
    if not path.is_file():
        raise InputError(f"missing; run `dvc repro {stage}` (or `cellpath {stage}`) first", path=path)
    return reader(path, **kwargs)


def load_inputs(params: Params, data_dir: Path, reports: Path) -> ReportInputs:
    """Read the probe, robustness, annotation and concordance outputs the report is made from."""
    probe = {name: _read(probe_reports(reports) / f"{name}.csv", "probe") for name in PROBE_FILES}
    counts = json.loads(_read(probe_reports(reports) / COUNTS_NAME, "probe", reader=Path.read_text))
    runs = _read(probe_runs_parquet(reports), "probe", reader=pd.read_parquet)
    robustness = {name: _read(robustness_reports(reports) / f"{name}.csv", "robustness") for name in ROBUSTNESS_FILES}
    margins = _read(robustness_margins_parquet(reports), "robustness", reader=pd.read_parquet,
                    columns=["model", "magnification", "readout", "taxonomy", "scope", "unit", "margin"])
    label_summary = _read(label_summary_csv(data_dir), "annotate")
    panels = _read(panels_csv(data_dir), "concordance")
    registry = pd.DataFrame([{"slug": s.slug, "name": s.name, "type": s.type, "params": s.params,
                              "pretrain_wsi_equivalent": s.pretrain_wsi_equivalent, "architecture": s.architecture}
                             for s in selected_encoders(params.extract.registry, params.extract.encoders)])
    index = gallery_index_json(reports)
    gallery = json.loads(index.read_text()) if index.is_file() else None
    return ReportInputs(probe, counts, runs, robustness, margins, label_summary, panels, registry, load_published(),
                        run_configuration(params, panels), gallery)


def run_configuration(params: Params, panels: pd.DataFrame) -> RunConfiguration:
    """What this run evaluated (params, the evaluated panel's sections) against the paper's S25 (the
    10x manifest's ``panel_s25`` rows)."""
    manifest = pd.read_csv(params.tenx.manifest) if Path(params.tenx.manifest).is_file() else pd.DataFrame()
    paper = frozenset(manifest.loc[manifest["panel_s25"].astype(bool), "section_id"]) if "panel_s25" in manifest \
        else frozenset()
    evaluated = panels[panels[params.panel].astype(bool) & ~panels["excluded_by_annotation"].astype(bool)]
    cfg = params.probe
    return RunConfiguration(
        source=params.source, panel=params.panel, panel_sizes=tuple(params.concordance.panel_sizes),
        panel_sections=frozenset(evaluated["section_id"]), paper_panel_sections=paper, seeds=dict(cfg.seeds),
        mocv_folds=cfg.mocv_folds, min_train_cells=cfg.min_train_cells.model_dump(),
        min_test_cells=cfg.min_test_cells.model_dump(), max_train_cells=cfg.max_train_cells)


def _table(name: str, title: str, caption: str, numeric: pd.DataFrame, percent_pairs: bool = True,
           percent_columns: tuple[str, ...] = ("CRA",), shown: list[str] | None = None,
           max_rows: int | None = None) -> tuple[Table, pd.DataFrame]:
    """A display table (``shown`` columns, first ``max_rows`` rows) and the full numeric frame."""
    visible = numeric if shown is None else numeric[shown]
    visible = visible if max_rows is None else visible.head(max_rows)
    frame = tables.display(visible, percent_pairs=percent_pairs, percent_columns=percent_columns)
    return Table(name, title, caption, frame, tables.best_two(visible)), numeric


def build_tables(inputs: ReportInputs, magnifications: list[str], panel: str) -> dict[str, tuple[Table, pd.DataFrame]]:
    """Every table of the page, keyed by file name, as (display table, numeric frame); ``panel``: the
    evaluated panel (params.yaml ``panel``)."""
    headline = headline_magnification(magnifications)
    return (_probe_tables(inputs, magnifications, panel) | _cross_domain_tables(inputs, magnifications)
            | _published_tables(inputs, headline) | _robustness_tables(inputs, headline) | _data_tables(inputs))


def _published_tables(inputs: ReportInputs, headline: str) -> dict[str, tuple[Table, pd.DataFrame]]:
    """This run's models among the paper's 30 (Tfine, Nuc, Macro-F1 at the headline magnification,
    S25), and — when the run is the paper's configuration — ours − published per model and condition."""
    names = dict(zip(inputs.registry["slug"], inputs.registry["name"]))
    protocols = [p for p in PROTOCOLS if p in set(inputs.runs["protocol"])]
    summary = inputs.probe["summary"]
    placed = placement(inputs.published, summary, names, protocols=protocols, magnification=headline)
    sources = sorted({int(t) for p in protocols for t in published_condition(
        inputs.published, protocol=p, magnification=headline, readout="Nuc", taxonomy="fine")["table"]})
    numeric = placed.set_index("model") if len(placed) else pd.DataFrame(index=pd.Index([], name="model"))
    shown = numeric.copy()
    for column in [c for c in shown.columns if c.endswith(" rank")]:
        shown[column] = ["–" if pd.isna(v) else str(int(v)) for v in shown[column]]
    shown = shown.rename(columns={p: PROTOCOL_LABELS[p] for p in protocols}
                         | {f"{p} rank": f"{PROTOCOL_LABELS[p]} rank" for p in protocols})
    reasons = comparability(inputs.run_configuration)
    verdict = ("Not comparable: " + "; ".join(reasons) + ". The paper's values are context only."
               if reasons else "Comparable: this run is the paper's configuration (S25, seeds, class gates).")
    out = {"published_placement": _table(
        "published_placement", f"Published reference — Tfine, Nuc, Macro-F1, {headline}, S25",
        f"{verdict} The paper's 30 models (its Tables {', '.join(map(str, sources)) or '–'}; pp) with this run's "
        "models placed among them; rank: 1 + the number of the paper's models with a higher mean.",
        shown, percent_pairs=False, percent_columns=())}
    published_models = set(inputs.published["model"])
    ours_published = {slug: name for slug, name in names.items() if name in published_models}
    checked = reproduction(inputs.published, summary, ours_published) if not reasons and ours_published \
        else pd.DataFrame(columns=["model"])
    table = _table("published_reproduction", "Reproduction check — ours − published",
                   "Per model and condition both have: the paper's mean, ours, the difference (pp) and the tolerance "
                   "its SD implies for a mean over the same balanced units (±1.96·SD/√n); flagged outside it.",
                   checked.set_index("model") if len(checked) else pd.DataFrame(index=pd.Index([], name="model")),
                   percent_pairs=False, percent_columns=())
    if reasons:
        table[0].empty_reason = "the run is not the paper's configuration: " + "; ".join(reasons)
    elif not ours_published:
        table[0].empty_reason = "none of this run's encoders is one of the paper's 30"
    out["published_reproduction"] = table
    return out


INTERVAL_NOTE = ("[low, high]: 95% bootstrap interval of the mean, resampling the balanced units (organs or folds) "
                 "and the seeds within them (2,000 replicates; beyond the paper, which reports mean ± SD).")


def _probe_tables(inputs: ReportInputs, magnifications: list[str], panel: str) -> dict[str, tuple[Table, pd.DataFrame]]:
    """The headline, within-section (CRA, IS per readout and nested panel) tables."""
    probe, headline = inputs.probe, headline_magnification(magnifications)
    out: dict[str, tuple[Table, pd.DataFrame]] = {}
    out["headline"] = _table(
        "headline", "Headline", f"Tfine, Nuc readout, {headline}: Macro-F1 per protocol (mean ± SD, pp), CRA (pp), "
        "CRT and the robustness summary (CRoMa median, LTM10, RI) of the same readout and magnification. "
        + INTERVAL_NOTE,
        tables.headline(probe["summary"], probe["cra_pooled"], probe["crt"], inputs.robustness["summary"], headline))
    for magnification in magnifications:
        out[f"cra_{magnification}"] = _table(
            f"cra_{magnification}", f"Table 4 — within-section CRA at {magnification}",
            "IS organ-balanced Macro-F1 (mean ± SD across organs, pp) of Nuc and Mean under both taxonomies; CRA "
            "(Eq. 4, taxonomies pooled) ± SD across organs; CRA wins: paired Wilcoxon over (section, taxonomy, seed) "
            "differences; Holm wins: the same after Holm's correction over the opponents. Bold: best, underlined: "
            "second best. " + INTERVAL_NOTE,
            tables.cra_table(probe["summary"], probe["cra_pooled"], magnification))
        for taxonomy in TAXONOMIES:
            numeric = tables.is_readout_table(probe["is_panels"], probe["cra_panels"], panel, magnification, taxonomy)
            out[f"is_{taxonomy}_{magnification}"] = _table(
                f"is_{taxonomy}_{magnification}",
                f"IS, all readouts — {panel}, {TAXONOMY_LABELS[taxonomy]}, {magnification}", IS_CAPTION, numeric)
    for smaller in sorted(set(probe["is_panels"]["panel"]) - {panel}, key=lambda name: -int(name[1:])):
        for taxonomy in TAXONOMIES:
            name = f"is_{taxonomy}_{headline}_{smaller}"
            out[name] = _table(name, f"IS, all readouts — nested panel {smaller}, {TAXONOMY_LABELS[taxonomy]}, {headline}",
                               IS_CAPTION + " Computed from this panel's sections alone (IS needs no refit).",
                               tables.is_readout_table(probe["is_panels"], probe["cra_panels"], smaller, headline,
                                                       taxonomy))
    out["is_panels_all"] = _table(
        "is_panels_all", "IS tables of every nested panel, magnification and metric",
        "Long form of the supplement's IS tables: organ-balanced mean and SD across sections per readout.",
        probe["is_panels"].set_index("model"), percent_pairs=False, percent_columns=())
    return out


def _cross_domain_tables(inputs: ReportInputs, magnifications: list[str]) -> dict[str, tuple[Table, pd.DataFrame]]:
    """Cross-domain transfer, the CRA–CRT landscape, rank agreement, magnification and panel effects."""
    probe, headline = inputs.probe, headline_magnification(magnifications)
    out: dict[str, tuple[Table, pd.DataFrame]] = {}
    for taxonomy in TAXONOMIES:
        out[f"cross_domain_{taxonomy}"] = _table(
            f"cross_domain_{taxonomy}", f"Table 5 — cross-domain transfer, {TAXONOMY_LABELS[taxonomy]}, {headline}",
            "Nuc Macro-F1 and Macro-AUROC (mean ± SD, pp) per protocol; wins: Macro-F1 significant wins (the "
            "paper's, uncorrected); Holm wins: those left after Holm's correction over the opponents (beyond the "
            "paper); CRT: mean of the three Tfine uncorrected win counts (Eq. 5). " + INTERVAL_NOTE,
            tables.cross_domain_table(probe["summary"], probe["wins"], probe["crt"], headline, taxonomy))
    out["landscape"] = _table(
        "landscape", "CRA–CRT landscape data", "CRA in pp; pretraining scale and parameters as in the registry.",
        tables.landscape(probe["cra_pooled"], probe["crt"], inputs.registry, headline).set_index("model"),
        percent_columns=("cra",), shown=["cra", "cra_wins", "crt", "type", "pretraining (WSI eq.)",
                                         "parameters (registry)"])
    out["rank_agreement"] = _table(
        "rank_agreement", "Taxonomy rank agreement",
        "Spearman ρ of model means under Tfine and Tcoarse (Nuc); undefined (–) with fewer than three models.",
        probe["rank_agreement"].set_index("protocol"), percent_pairs=False)
    retention = tables.magnification_effect(probe["summary"], magnifications)
    retention_columns = [c for c in retention.columns if c.endswith("retention")]
    out["magnification_retention"] = _table(
        "magnification_retention", "Magnification retention",
        "Tfine Nuc Macro-F1 relative to the highest magnification, mean over models (the paper: 99.6 % at 20×, "
        "92.9 % at 10× under IS).",
        retention.groupby("protocol")[retention_columns].mean().reindex(
            [p for p in tables.PROTOCOLS if p in set(retention["protocol"])]), percent_columns=retention_columns)
    panel = tables.panel_robustness(inputs.runs, inputs.panels, headline)
    out["panel_robustness"] = _table(
        "panel_robustness", "Panel robustness",
        f"IS Tfine Nuc Macro-F1 (pp) at {headline} on each nested panel (organ-balanced over the panel's sections), "
        "the model's rank and Spearman ρ of the ranking against the largest panel. IS units are single sections, "
        "so smaller panels are read from the same runs; cross-domain protocols need a run per panel "
        "(`dvc exp run -S panel=S10`).",
        panel.set_index("model").rename(columns={"macro_f1": "IS Nuc F1"}), percent_columns=("IS Nuc F1",))
    return out


def _robustness_tables(inputs: ReportInputs, headline: str) -> dict[str, tuple[Table, pd.DataFrame]]:
    """The robustness summary, shortcut probe, metric agreement, sensitivity and low-margin enrichment."""
    out: dict[str, tuple[Table, pd.DataFrame]] = {}
    rob = tables.robustness_table(inputs.robustness["summary"], inputs.robustness["shortcut_summary"])
    out["robustness"] = _table(
        "robustness", "Robustness summary",
        "Per condition: cells scored (undefined margins counted, never dropped), CRoMa median, F(0), LTM10, RI, MaRI "
        "with support, k, k-NN balanced accuracy for biology and for the confounder, the median–LTM10 Pareto "
        "flag among the models of the condition, and the shortcut probe's nIPD.",
        rob.set_index("model"), percent_pairs=False, percent_columns=())
    shortcut = inputs.robustness["shortcut_summary"]
    out["shortcut"] = _table("shortcut", "Shortcut probe",
                             "APD and nIPD per model and evaluation setting, nIPD with its 95 % percentile bootstrap "
                             "interval over the resampling runs (n_runs); the confounder the training pools were "
                             "biased by.", tables.shortcut_table(shortcut).set_index("model"), percent_pairs=False,
                             percent_columns=())
    out["agreement"] = _table(
        "agreement", "Rank agreement of the robustness metrics",
        "Spearman ρ across models per condition: RI, MaRI and median CRoMa with each other (CRoMa paper, Table "
        "S4); each representation metric with the shortcut probe's nIPD and median CRoMa with APD on the probe's "
        "own condition (Table S8; positive: more robust, less degradation); confounder k-NN accuracy with median "
        "CRoMa. Undefined (–) with fewer than three models.",
        inputs.robustness["agreement"].set_index("x"), percent_pairs=False, percent_columns=())
    out["sensitivity"] = _table(
        "sensitivity", "Sensitivity to m and α",
        "Spearman ρ across models between the rankings at two settings (CRoMa paper, Tables S1 and S2): median "
        "CRoMa at the headline m against each extreme of the m sweep and the extremes against each other; LTM at "
        "each pair of tail fractions α. '< 0': models whose ranked statistic is negative (for m: confounder-"
        "dominant), at the two settings and the fewest–most over the whole sweep. Undefined (–) with fewer than "
        "three models; empty unless robustness.sensitivity is set.",
        tables.sensitivity_table(inputs.robustness["sensitivity_agreement"]), percent_pairs=False,
        percent_columns=())
    enrichment = inputs.robustness["low_margin_enrichment"].sort_values("enrichment", ascending=False)
    out["low_margin_enrichment"] = _table(
        "low_margin_enrichment", "Low-margin enrichment",
        "Cells in the worst margin decile by cell type, organ and section: share among low-margin cells over share "
        "among all scored cells (> 1: over-represented among the failures). The 15 most enriched are shown; every "
        "row is in reports/tables/low_margin_enrichment.csv.",
        enrichment.set_index("model"), percent_pairs=False, percent_columns=(), max_rows=15)
    return out


def _data_tables(inputs: ReportInputs) -> dict[str, tuple[Table, pd.DataFrame]]:
    """What was evaluated: cells per class and section, candidate sections and panels."""
    out: dict[str, tuple[Table, pd.DataFrame]] = {}
    counts = tables.class_counts(inputs.label_summary)
    out["class_counts"] = (Table("class_counts", "Cells per Tfine class and section",
                                 "Eligible labelled cells; the last rows give the panel total and each class's share.",
                                 tables.display_counts(counts)), counts)
    out["panels"] = _table("panels", "Candidate sections and panels",
                           "Sections ranked by AGR-BAcc; membership of each nested panel; sections excluded by "
                           "annotation are listed, not dropped.",
                           tables.panel_table(inputs.panels).set_index("section_id"), percent_pairs=False,
                           percent_columns=())
    return out


def build_figures(inputs: ReportInputs, magnifications: list[str], numeric: dict[str, pd.DataFrame],
                  colours: dict) -> dict[str, bytes | None]:
    """Every figure of the page as PNG bytes; None where this run has no data for it (for example
    the IS figures of a MOCV-only experiment)."""
    probe, headline = inputs.probe, headline_magnification(magnifications)
    readouts = tables.readout_effect(probe["summary"], headline)
    by_mag = tables.magnification_effect(probe["summary"], magnifications)
    mag_columns = [m for m in by_mag.columns if not m.endswith("retention") and m not in ("protocol", "model")]
    taxonomy = tables.taxonomy_effect(probe["summary"], headline)
    landscape = numeric["landscape"].reset_index()
    panel = numeric["panel_robustness"].reset_index().rename(columns={"IS Nuc F1": "macro_f1"})
    margins = inputs.margins.assign(condition=lambda f: f["model"] + " · " + f["readout"] + " · " + f["magnification"]
                                    + " · " + f["taxonomy"] + " · " + f["unit"])
    shortcut = inputs.robustness["shortcut"]

    def drawn(data: pd.DataFrame, draw):
        return draw() if len(data) else None

    return {
        "landscape": drawn(landscape.dropna(subset=["cra_wins", "crt"], how="all"),
                           lambda: figures.landscape(landscape)),
        "taxonomy": drawn(taxonomy.dropna(subset=["fine", "coarse"]), lambda: figures.taxonomy_effect(taxonomy)),
        "readouts": drawn(readouts, lambda: figures.per_protocol_lines(
            readouts, [r for r in tables.READOUTS if r in readouts.columns], "Macro-F1 (pp)",
            f"Readouts (Tfine, {headline})")),
        "magnifications": drawn(by_mag, lambda: figures.per_protocol_lines(
            by_mag, mag_columns, "Nuc Macro-F1 (pp)", "Magnifications (Tfine, Nuc)")),
        "panels": drawn(panel, lambda: figures.panel_ranks(panel)),
        "croma": drawn(margins, lambda: figures.croma_distributions(margins, sorted(margins["condition"].unique()))),
        "classes": figures.class_abundance(numeric["class_counts"], colours),
        "shortcut": drawn(shortcut, lambda: figures.shortcut_curves(shortcut)),
    }


def pareto_figures(robustness: pd.DataFrame) -> list[tuple[str, bytes]]:
    """One median–LTM10 plane per (magnification, taxonomy, scope, unit), models × readouts as points."""
    out = []
    for keys, group in robustness.reset_index().groupby(["magnification", "taxonomy", "scope", "unit"], sort=True):
        title = " · ".join(str(k) for k in keys)
        out.append((title, figures.pareto_plane(group.assign(label=group["model"] + " " + group["readout"]))))
    return out


def thumbnails(params: Params, data_dir: Path, inputs: ReportInputs, colours: dict) -> list[dict]:
    """H&E crops of the best-ranked evaluated sections, one per organ, up to ``report.thumbnails``."""
    if params.report.thumbnails == 0:
        return []
    index = read_section_index(data_dir).set_index("section_id", drop=False)
    panel = inputs.panels[inputs.panels[params.panel].astype(bool) & ~inputs.panels["excluded_by_annotation"]]
    chosen = panel.sort_values("rank").drop_duplicates("organ").head(params.report.thumbnails)
    out = []
    for section_id in chosen["section_id"]:
        row = index.loc[section_id]
        thumb = section_thumbnail(data_dir, raw_dir(data_dir), row, params.report.thumbnail_um,
                                  params.report.thumbnail_mpp)
        caption = (f"{section_id} ({row['organ']}): {len(thumb.points)} labelled nuclei"
                   + (f", {thumb.n_unlabelled} without a Tfine label not drawn" if thumb.n_unlabelled else ""))
        out.append({"section_id": section_id, "caption": caption,
                    "png": figures.thumbnail(thumb.image, thumb.points, colours, section_id, thumb.mpp)})
    return out


def run(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> Path:
    """report: read the stage outputs, write index.html, tables/ and figures/; returns the page's path."""
    data_dir, reports = Path(data_dir), Path(reports)
    magnifications = params.stage_magnifications(params.probe.magnifications)
    inputs = load_inputs(params, data_dir, reports)
    built = build_tables(inputs, magnifications, params.panel)
    numeric = {name: frame for name, (_, frame) in built.items()}
    fine_classes = list(numeric["class_counts"].columns)
    colours = figures.class_colours(fine_classes)
    pngs = build_figures(inputs, magnifications, numeric, colours)
    paretos = pareto_figures(numeric["robustness"])
    thumbs = thumbnails(params, data_dir, inputs, colours)
    context = page_context(params, inputs, built, magnifications, pngs, paretos, thumbs, root or Path.cwd())
    html = render_html(context)
    write_report(reports, html, built, pngs, paretos, thumbs)
    log.info("report: %s (%d tables, %d figures, %d thumbnails, %.1f MB)", report_html(reports), len(built),
             len(pngs) + len(paretos), len(thumbs), len(html) / 1e6)
    return report_html(reports)


def page_context(params: Params, inputs: ReportInputs, built: dict, magnifications: list[str], pngs: dict,
                 paretos: list, thumbs: list, root: Path) -> dict:
    """The template's variables."""
    cells = inputs.label_summary
    panel = inputs.panels[inputs.panels[params.panel].astype(bool) & ~inputs.panels["excluded_by_annotation"]]
    tags = provenance_tags(root)
    commit = tags.get("mlflow.source.git.commit", "unknown")[:10]
    protocols = [p for p in PROTOCOLS if p in set(inputs.runs["protocol"])]
    landscape = built["landscape"][1]
    missing_scale = landscape.index[landscape["pretrain_wsi"].isna()].tolist()
    counts = inputs.counts.get("total", {})
    meta = {
        "title": params.report.title, "panel": params.panel, "n_sections": len(panel),
        "n_organs": panel["organ"].nunique(), "n_cells": _evaluated_cells(cells, panel),
        "encoders": sorted(inputs.runs["model"].unique()), "magnifications": magnifications,
        "headline": headline_magnification(magnifications), "source": params.source, "git_commit": commit,
        "git_dirty": tags.get("git.dirty") == "true", "experiment": tags.get("dvc.experiment", "workspace"),
        "protocols": [p.upper() for p in protocols],
        "runs": {k: counts.get(k, 0) for k in ("ok", "skipped", "unavailable", "not_converged")},
        "notes": _header_notes(inputs.panels),
    }
    where = [
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
        {"what": "Per-cell robustness", "text": "every scored cell's CRoMa margin and the nearest SO / OS neighbours "
         "that decided it:", "command": "reports/robustness/margins.parquet"},
        {"what": "Where models fail", "text": "a page per model of H&E crops (below); the IS test cells each run "
         "misclassified most confidently:", "command": "reports/gallery/; reports/probe/is_errors.parquet"},
    ]
    by_name = {name: table for name, (table, _) in built.items()}
    ran = ", ".join(p.upper() for p in protocols) or "none"
    for name, table in by_name.items():
        if name.startswith(("cra_", "is_")) and "is" not in protocols:
            table.empty_reason = f"IS was not run: protocols run {ran} (params: protocol)"
        elif name.startswith("cross_domain") and not set(protocols) & set(CROSS_DOMAIN_PROTOCOLS):
            table.empty_reason = f"no cross-domain protocol was run: protocols run {ran} (params: protocol)"
        elif name == "landscape" and set(protocols) != set(PROTOCOLS):
            table.empty_reason = f"CRA needs IS and CRT all three cross-domain protocols: protocols run {ran}"
    return {
        "meta": meta, "headline": by_name["headline"],
        "cra_tables": [by_name[f"cra_{m}"] for m in magnifications],
        "is_tables": [by_name[f"is_{t}_{m}"] for m in magnifications for t in ("fine", "coarse")]
        + [table for name, table in by_name.items() if re.fullmatch(r"is_(fine|coarse)_\d+x_S\d+", name)],
        "cross_tables": [by_name["cross_domain_fine"], by_name["cross_domain_coarse"]],
        "published_tables": [by_name["published_placement"], by_name["published_reproduction"]],
        "landscape_table": by_name["landscape"],
        "landscape_note": (f"Without a pretraining scale in the registry (drawn at the left, off the scale): "
                           f"{', '.join(missing_scale)}." if missing_scale else ""),
        "effect_tables": [by_name["rank_agreement"], by_name["magnification_retention"]],
        "panel_table": by_name["panel_robustness"], "robustness_table": by_name["robustness"],
        "shortcut_table": by_name["shortcut"], "agreement_table": by_name["agreement"],
        "sensitivity_table": by_name["sensitivity"],
        "enrichment_table": by_name["low_margin_enrichment"],
        "class_table": by_name["class_counts"], "candidates_table": by_name["panels"],
        "figures": pngs, "pareto_figures": paretos, "thumbnails": thumbs, "where": where, "glossary": GLOSSARY,
        "gallery": gallery_links(inputs.gallery),
    }


def gallery_links(index: dict | None) -> list[dict] | None:
    """Per model, its gallery page (relative to the report) and what it shows; None without a gallery."""
    if index is None:
        return None
    return [{"model": model, "href": f"{gallery_dir(Path('.')).name}/{entry['page']}",
             "lists": [f"{item['title']} ({item['cells']})" for item in entry["lists"]]}
            for model, entry in sorted(index["models"].items())]


def _header_notes(panels: pd.DataFrame) -> list[str]:
    """What the header must say about the sections: exclusions, and sections flagged for poor reference coverage."""
    notes = []
    excluded = int(panels["excluded_by_annotation"].sum())
    if excluded:
        notes.append(f"{excluded} section(s) excluded by annotation are listed in the data section, not evaluated.")
    flagged = sorted(panels.loc[panels["poor_reference_coverage"].astype(bool), "section_id"].astype(str))
    if flagged:
        notes.append(f"Poor reference coverage (annotate.coverage_max_unmatched exceeded: many cells resemble no "
                     f"reference type and carry the label of the nearest one): {', '.join(flagged)}. They are "
                     "evaluated; review them as the paper's manual review would.")
    return notes


def _evaluated_cells(label_summary: pd.DataFrame, panel: pd.DataFrame) -> int:
    chosen = label_summary[label_summary["section_id"].isin(panel["section_id"])]
    fine = [c for c in chosen.columns if c.startswith("fine:")]
    return int(chosen[fine].to_numpy().sum())


def write_report(reports: Path, html: str, built: dict, pngs: dict[str, bytes], paretos: list, thumbs: list) -> None:
    """index.html, tables/ and figures/, each replaced atomically."""
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(report_tables(reports)) as folder:
        folder.mkdir()
        for name, (table, numeric) in built.items():
            numeric.to_csv(folder / f"{name}.csv")
            (folder / f"{name}.md").write_text(table.markdown())
    with atomic_output(report_figures(reports)) as folder:
        folder.mkdir()
        for name, png in pngs.items():
            if png is not None:
                (folder / f"{name}.png").write_bytes(png)
        for i, (_, png) in enumerate(paretos):
            (folder / f"pareto_{i}.png").write_bytes(png)
        for thumb in thumbs:
            (folder / f"he_{thumb['section_id']}.png").write_bytes(thumb["png"])
    with atomic_output(report_html(reports)) as tmp:
        tmp.write_text(html)
