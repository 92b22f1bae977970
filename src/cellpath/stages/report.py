"""report: the HTML page, Markdown/CSV tables and PNG figures from the probe, expression and
robustness outputs.

Reads only what earlier stages wrote (``reports/probe/*.csv``, ``reports/probe/runs.parquet``,
``reports/expression/*.csv``, ``reports/robustness/*``, ``data/labels/summary.csv``, ``data/panels.csv``, the encoder registry
and, for the H&E thumbnails, the ingested sections), so every number on the page comes from the
run tables. Writes ``reports/index.html`` (images inlined), ``reports/tables/`` (one CSV with the
numbers and one Markdown file with what the page shows, per table) and ``reports/figures/`` (PNG),
each folder replaced atomically, and ``reports/placement_metrics.json`` (this run's models against
the paper's 30: DVC metrics, and the metrics of the stage's MLflow run). Domain code:
:mod:`cellpath.report`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.features.encoders.registry import selected_encoders
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (expression_reports, gallery_index_json, label_summary_csv, panels_csv, placement_metrics_json,
                                probe_counts_json, probe_runs_parquet, probe_table_csv, raw_dir, report_figure_png,
                                report_figures, report_html, report_pareto_png, report_table_csv, report_table_md,
                                report_tables, report_thumbnail_png, robustness_margins_parquet,
                                robustness_table_csv, stage_log)
from cellpath.io.sections import read_section_index
from cellpath.published import load_published
from cellpath.published.reference import comparability
from cellpath.report import figures
from cellpath.report.inputs import (EXPRESSION_TABLES, MARGIN_COLUMNS, PROBE_TABLES, ROBUSTNESS_TABLES, ReportInputs, evaluated_panel,
                                    registry_table, run_configuration)
from cellpath.report.page import PageImages, page_context
from cellpath.report.page_figures import build_figures, pareto_figures
from cellpath.report.published import placement_metrics
from cellpath.report.render import render_html
from cellpath.report.sections import Built, build_tables
from cellpath.report.thumbnails import section_thumbnail
from cellpath.runtime.tracking import Tracker, flat_metrics, provenance_tags

log = logging.getLogger(__name__)


def _read(path: Path, stage: str, reader=pd.read_csv, **kwargs):
    if not path.is_file():
        raise InputError(f"missing; run `dvc repro {stage}` (or `cellpath {stage}`) first", path=path)
    return reader(path, **kwargs)


def load_inputs(params: Params, data_dir: Path, reports: Path) -> ReportInputs:
    """Read the probe, robustness, annotation and concordance outputs the report is made from."""
    probe = {name: _read(probe_table_csv(reports, name), "probe") for name in PROBE_TABLES}
    counts = json.loads(_read(probe_counts_json(reports), "probe", reader=Path.read_text))
    runs = _read(probe_runs_parquet(reports), "probe", reader=pd.read_parquet)
    robustness = {name: _read(robustness_table_csv(reports, name), "robustness") for name in ROBUSTNESS_TABLES}
    margins = _read(robustness_margins_parquet(reports), "robustness", reader=pd.read_parquet, columns=MARGIN_COLUMNS)
    expression = {name: _read(expression_reports(reports) / f"{name}.csv", "expression") for name in EXPRESSION_TABLES}
    label_summary = _read(label_summary_csv(data_dir), "annotate")
    panels = _read(panels_csv(data_dir), "concordance")
    registry = registry_table(selected_encoders(params.extract.registry, params.extract.encoders))
    manifest = pd.read_csv(params.tenx.manifest) if Path(params.tenx.manifest).is_file() else pd.DataFrame()
    index = gallery_index_json(reports)
    gallery = json.loads(index.read_text()) if index.is_file() else None
    return ReportInputs(probe, counts, runs, robustness, margins, label_summary, panels, registry, load_published(),
                        run_configuration(params, panels, manifest), gallery, expression)


def thumbnails(params: Params, data_dir: Path, panels: pd.DataFrame, colours: dict) -> list[dict]:
    """H&E crops of the best-ranked evaluated sections, one per organ, up to ``report.thumbnails``."""
    if params.report.thumbnails == 0:
        return []
    index = read_section_index(data_dir).set_index("section_id", drop=False)
    panel = evaluated_panel(panels, params.panel)
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
    """report: read the stage outputs, write index.html, tables/ and figures/, and the placement among
    the paper's 30 as DVC metrics (``reports/placement_metrics.json``) and on the stage's MLflow run;
    returns the page's path."""
    data_dir, reports = Path(data_dir), Path(reports)
    magnifications = params.stage_magnifications(params.probe.magnifications)
    with Tracker(params.mlflow, "report", root, stage_log(reports, "report")) as tracker:
        inputs = load_inputs(params, data_dir, reports)
        built = build_tables(inputs, magnifications, params.panel)
        numeric = {name: frame for name, (_, frame) in built.items()}
        colours = figures.class_colours(list(numeric["class_counts"].columns))
        images = PageImages(build_figures(inputs, magnifications, numeric, colours),
                            pareto_figures(numeric["robustness"]), thumbnails(params, data_dir, inputs.panels, colours))
        html = render_html(page_context(params, inputs, built, magnifications, images,
                                        provenance_tags(root or Path.cwd())))
        placed = placement_metrics(built, dict(zip(inputs.registry["name"], inputs.registry["slug"])),
                                   comparability(inputs.run_configuration))
        write_report(reports, html, built, images)
        with atomic_output(placement_metrics_json(reports)) as tmp:
            tmp.write_text(json.dumps(placed, indent=2) + "\n")
        tracker.finish({"placement.comparable": placed["comparable"],
                        "placement.not_comparable": "; ".join(placed["not_comparable"])},
                       flat_metrics({k: v for k, v in placed.items() if isinstance(v, dict)}, "placement/"))
    log.info("report: %s (%d tables, %d figures, %d thumbnails, %.1f MB)", report_html(reports), len(built),
             len(images.figures) + len(images.paretos), len(images.thumbnails), len(html) / 1e6)
    return report_html(reports)


def write_report(reports: Path, html: str, built: Built, images: PageImages) -> None:
    """index.html, tables/ and figures/, each replaced atomically."""
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(report_tables(reports)) as folder:
        folder.mkdir()
        for name, (table, numeric) in built.items():
            numeric.to_csv(folder / report_table_csv(reports, name).name)
            (folder / report_table_md(reports, name).name).write_text(table.markdown())
    with atomic_output(report_figures(reports)) as folder:
        folder.mkdir()
        for name, png in images.figures.items():
            if png is not None:
                (folder / report_figure_png(reports, name).name).write_bytes(png)
        for i, (_, png) in enumerate(images.paretos):
            (folder / report_pareto_png(reports, i).name).write_bytes(png)
        for thumb in images.thumbnails:
            (folder / report_thumbnail_png(reports, thumb["section_id"]).name).write_bytes(thumb["png"])
    with atomic_output(report_html(reports)) as tmp:
        tmp.write_text(html)
