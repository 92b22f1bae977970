"""Where everything lives under the data folder (``data/``) and the reports folder (``reports/``).

One place for every path the stages share: each helper takes the data folder (``data_dir``) or the
reports folder (``reports``) and returns a path inside it; the ``*_NAME`` constants name the files a
stage writes inside a folder it replaces atomically. No other module joins a path onto ``data_dir``
or ``reports`` (``tests/unit/io/test_layout.py`` fails on one that does).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA_DIR = Path("data")  # the data folder, relative to the project root (``--data-dir``)
DEFAULT_REPORTS_DIR = Path("reports")  # the reports folder (``--reports-dir``)
DEFAULT_MANIFEST = DEFAULT_DATA_DIR / "manifests" / "xenium_datasets.csv"  # the 10x section manifest (tenx.manifest)
SECTION_INDEX_NAME = "sections.csv"
LABEL_SUMMARY_NAME = "summary.csv"
TIMING_NAME = "timing.json"
COUNTS_NAME = "counts.json"
METRICS_NAME = "metrics.json"  # a stage's own metrics inside its reports folder
MARKER_QC_NAME = "marker_qc.csv"  # data/labels/: marker enrichment per (section, type)
AGAINST_TRUTH_NAME = "against_truth.csv"  # reports/annotation/: labels against the simulator's truth
CONCORDANCE_NAME = "concordance.csv"  # reports/concordance/: AGR-BAcc per section
SIMULATION_TRUTH_NAME = "simulation_truth.parquet"  # a simulated section's true types (never read by ingest)


# --------------------------------------------------------------------------- data/
def raw_dir(data_dir: Path) -> Path:
    """Raw section bundles as fetched: ``data/raw/<section folder>/`` (Xenium outputs + H&E)."""
    return Path(data_dir) / "raw"


def downloads_dir(data_dir: Path) -> Path:
    """Partial and verified downloads of the 10x fetch: ``data/.downloads/`` (no DVC output)."""
    return Path(data_dir) / ".downloads"


def references_dir(data_dir: Path) -> Path:
    """scRNA-seq references for label transfer: ``data/references/<name>.h5ad``."""
    return Path(data_dir) / "references"


def reference_h5ad(data_dir: Path, name: str) -> Path:
    """One reference: ``data/references/<name>.h5ad``."""
    return references_dir(data_dir) / f"{name}.h5ad"


def sections_dir(data_dir: Path) -> Path:
    """Ingested sections: ``data/sections/<section_id>.zarr`` (SpatialData) and ``sections.csv``."""
    return Path(data_dir) / "sections"


def section_index_csv(data_dir: Path) -> Path:
    """The section index (one row per ingested section, with its H&E geometry): ``data/sections/sections.csv``."""
    return sections_dir(data_dir) / SECTION_INDEX_NAME


def section_zarr(data_dir: Path, section_id: str) -> Path:
    """One ingested section: ``data/sections/<section_id>.zarr``."""
    return sections_dir(data_dir) / f"{section_id}.zarr"


def labels_dir(data_dir: Path) -> Path:
    """Per-section labels and their summary: ``data/labels/<section_id>.parquet``, ``summary.csv``."""
    return Path(data_dir) / "labels"


def section_labels(data_dir: Path, section_id: str) -> Path:
    """One section's labels: ``data/labels/<section_id>.parquet``."""
    return labels_dir(data_dir) / f"{section_id}.parquet"


def label_summary_csv(data_dir: Path) -> Path:
    """Per-section annotation summary (exclusions among it): ``data/labels/summary.csv``."""
    return labels_dir(data_dir) / LABEL_SUMMARY_NAME


def features_dir(data_dir: Path) -> Path:
    """Feature artifacts: ``data/features/<encoder slug>/<magnification>/<section_id>/``."""
    return Path(data_dir) / "features"


def panels_csv(data_dir: Path) -> Path:
    """The concordance ranking and nested panel membership: ``data/panels.csv``."""
    return Path(data_dir) / "panels.csv"


def exports_dir(data_dir: Path) -> Path:
    """What ``cellpath export`` writes for scverse tools: ``data/exports/`` (no DVC output, git-ignored)."""
    return Path(data_dir) / "exports"


def export_section_zarr(data_dir: Path, section_id: str) -> Path:
    """One section for napari-spatialdata (H&E, nucleus boundaries, labelled table):
    ``data/exports/sections/<section_id>.zarr``."""
    return exports_dir(data_dir) / "sections" / f"{section_id}.zarr"


def export_embeddings_h5ad(data_dir: Path, encoder: str, magnification: str, section_id: str) -> Path:
    """One section's features of one encoder as AnnData (obsm, keyed by cell_id):
    ``data/exports/embeddings/<encoder slug>/<magnification>/<section_id>.h5ad``."""
    return exports_dir(data_dir) / "embeddings" / encoder / magnification / f"{section_id}.h5ad"


def work_root(data_dir: Path) -> Path:
    """Task outputs (shards) kept between runs: ``data/.work/<stage>/`` (no DVC output, git-ignored)."""
    return Path(data_dir) / ".work"


def stage_lock(data_dir: Path, stage: str) -> Path:
    """The lock a stage holds on its work folder while it runs: ``data/.work/<stage>.lock``."""
    return work_root(data_dir) / f"{stage}.lock"


# --------------------------------------------------------------------------- reports/
def stage_log(reports: Path, stage: str) -> Path:
    """The log of a stage's last run (``reports/logs/<stage>.log``; ignored by git, attached to MLflow)."""
    return reports / "logs" / f"{stage}.log"


def annotation_reports(reports: Path) -> Path:
    """Label transfer against the simulator's truth: ``reports/annotation/``."""
    return Path(reports) / "annotation"


def concordance_reports(reports: Path) -> Path:
    """Per-section concordance scores: ``reports/concordance/``."""
    return Path(reports) / "concordance"


def probe_reports(reports: Path) -> Path:
    """The probe's summary tables, counts and timing: ``reports/probe/``."""
    return Path(reports) / "probe"


def probe_runs_parquet(reports: Path) -> Path:
    """Every probe run, one row each: ``reports/probe/runs.parquet`` (inside the stage's one output folder)."""
    return probe_reports(reports) / "runs.parquet"


def probe_is_errors_parquet(reports: Path) -> Path:
    """The IS test cells each run misclassified most confidently: ``reports/probe/is_errors.parquet``."""
    return probe_reports(reports) / "is_errors.parquet"


def robustness_margins_parquet(reports: Path) -> Path:
    """Every scored cell's CRoMa margin and nearest SO / OS neighbours: ``reports/robustness/margins.parquet``."""
    return robustness_reports(reports) / "margins.parquet"


def gallery_dir(reports: Path) -> Path:
    """The failure gallery: ``reports/gallery/`` (a page per model and its crops)."""
    return Path(reports) / "gallery"


def gallery_index_json(reports: Path) -> Path:
    """The gallery's pages per model and their counts: ``reports/gallery/index.json``."""
    return gallery_dir(reports) / "index.json"


def probe_metrics_json(reports: Path) -> Path:
    """The probe's DVC metrics: ``reports/metrics.json``."""
    return Path(reports) / "metrics.json"


def expression_reports(reports: Path) -> Path:
    """The expression probes' run table, per-gene table, gene lists and summaries: ``reports/expression/``."""
    return Path(reports) / "expression"


def expression_metrics_json(reports: Path) -> Path:
    """The expression stage's DVC metrics: ``reports/expression_metrics.json``."""
    return Path(reports) / "expression_metrics.json"


def robustness_reports(reports: Path) -> Path:
    """The robustness tables and per-cell margins: ``reports/robustness/``."""
    return Path(reports) / "robustness"


def robustness_metrics_json(reports: Path) -> Path:
    """The robustness stage's DVC metrics: ``reports/robustness_metrics.json``."""
    return Path(reports) / "robustness_metrics.json"


def placement_metrics_json(reports: Path) -> Path:
    """The report stage's DVC metrics, this run's models against the paper's 30:
    ``reports/placement_metrics.json``."""
    return Path(reports) / "placement_metrics.json"


def report_html(reports: Path) -> Path:
    """The HTML report: ``reports/index.html``."""
    return Path(reports) / "index.html"


def report_tables(reports: Path) -> Path:
    """The report's tables as CSV and Markdown: ``reports/tables/``."""
    return Path(reports) / "tables"


def report_figures(reports: Path) -> Path:
    """The report's figures: ``reports/figures/``."""
    return Path(reports) / "figures"


def probe_table_csv(reports: Path, name: str) -> Path:
    """One of the probe's summary tables (``summary``, ``wins``, ``cra``, …): ``reports/probe/<name>.csv``."""
    return probe_reports(reports) / f"{name}.csv"


def probe_counts_json(reports: Path) -> Path:
    """Runs fitted, skipped and unavailable per protocol: ``reports/probe/counts.json``."""
    return probe_reports(reports) / COUNTS_NAME


def robustness_table_csv(reports: Path, name: str) -> Path:
    """One of the robustness tables (``summary``, ``shortcut``, …): ``reports/robustness/<name>.csv``."""
    return robustness_reports(reports) / f"{name}.csv"


def simulation_truth_parquet(data_dir: Path, section_id: str) -> Path:
    """The simulator's true cell types of one section (simulated sections only):
    ``data/raw/<section>/simulation_truth.parquet``."""
    return raw_dir(data_dir) / section_id / SIMULATION_TRUTH_NAME


# --------------------------------------------------------------------------- work/ shards


def extract_timing_json(data_dir: Path, encoder_slug: str, magnification: str) -> Path:
    """Patch rates of one extraction, for the cost model: ``data/.work/extract/<slug>-<magnification>.timing.json``."""
    return work_root(data_dir) / "extract" / f"{encoder_slug}-{magnification}.{TIMING_NAME}"


def shard_table(shard: Path, name: str) -> Path:
    """One table a finished task wrote into its shard folder (``runs``, ``margins``, …): ``<shard>/<name>.parquet``."""
    return Path(shard) / f"{name}.parquet"


# --------------------------------------------------------------------------- reports/: report and gallery files
def report_table_csv(reports: Path, name: str) -> Path:
    """One report table's numbers: ``reports/tables/<name>.csv``."""
    return report_tables(reports) / f"{name}.csv"


def report_table_md(reports: Path, name: str) -> Path:
    """One report table as the page shows it: ``reports/tables/<name>.md``."""
    return report_tables(reports) / f"{name}.md"


def report_figure_png(reports: Path, name: str) -> Path:
    """One report figure: ``reports/figures/<name>.png``."""
    return report_figures(reports) / f"{name}.png"


def report_pareto_png(reports: Path, number: int) -> Path:
    """The report's ``number``-th median–LTM10 Pareto plane (from 0): ``reports/figures/pareto_<number>.png``."""
    return report_figure_png(reports, f"pareto_{number}")


def report_thumbnail_png(reports: Path, section_id: str) -> Path:
    """The report's H&E thumbnail of one section: ``reports/figures/he_<section_id>.png``."""
    return report_figure_png(reports, f"he_{section_id}")


def gallery_cells_csv(reports: Path) -> Path:
    """Every crop of the gallery's pages, one row each: ``reports/gallery/cells.csv``."""
    return gallery_dir(reports) / "cells.csv"
