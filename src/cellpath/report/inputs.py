"""What the report is made from: the stage outputs it reads (named here, read by the stage) and what
the run was, as far as the published reference's comparability goes."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from cellpath.config import Params
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.published.reference import RunConfiguration
from cellpath.vocabulary import PROTOCOLS

#: The probe's summary tables the report reads (``reports/probe/<name>.csv``).
PROBE_TABLES = ["summary", "wins", "crt", "cra", "cra_pooled", "rank_agreement", "is_panels", "cra_panels"]
#: The robustness tables the report reads (``reports/robustness/<name>.csv``).
ROBUSTNESS_TABLES = ["summary", "low_margin_enrichment", "shortcut", "shortcut_summary", "agreement",
                     "sensitivity_agreement"]
#: The expression probes' tables the report reads (``reports/expression/<name>.csv``).
EXPRESSION_TABLES = ["summary", "wins", "cra", "gene_summary"]
#: The margins.parquet columns the CRoMa distributions are drawn from.
MARGIN_COLUMNS = ["model", "magnification", "readout", "taxonomy", "scope", "unit", "margin"]


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
    expression: dict[str, pd.DataFrame] | None = None  # reports/expression/*.csv (EXPRESSION_TABLES)


def protocols_run(runs: pd.DataFrame) -> list[str]:
    """The protocols this run's probe table holds, in the vocabulary's order."""
    return [p for p in PROTOCOLS if p in set(runs["protocol"])]


def evaluated_panel(panels: pd.DataFrame, panel: str) -> pd.DataFrame:
    """The rows of ``panels`` (data/panels.csv) in the evaluated panel and not excluded by annotation."""
    return panels[panels[panel].astype(bool) & ~panels["excluded_by_annotation"].astype(bool)]


def run_configuration(params: Params, panels: pd.DataFrame, manifest: pd.DataFrame) -> RunConfiguration:
    """What this run evaluated (params, the evaluated panel's sections) against the paper's S25 (the
    10x manifest's ``panel_s25`` rows; an empty ``manifest`` when there is none)."""
    paper = frozenset(manifest.loc[manifest["panel_s25"].astype(bool), "section_id"]) if "panel_s25" in manifest \
        else frozenset()
    cfg = params.probe
    return RunConfiguration(
        source=params.source, panel=params.panel, panel_sizes=tuple(params.concordance.panel_sizes),
        panel_sections=frozenset(evaluated_panel(panels, params.panel)["section_id"]), paper_panel_sections=paper,
        seeds=dict(cfg.seeds), mocv_folds=cfg.mocv_folds, min_train_cells=cfg.min_train_cells.model_dump(),
        min_test_cells=cfg.min_test_cells.model_dump(), max_train_cells=cfg.max_train_cells)


def registry_table(encoders: list[EncoderSpec]) -> pd.DataFrame:
    """The selected encoders' registry rows the report shows (slug, name, type, parameters, pretraining
    scale, architecture)."""
    return pd.DataFrame([{"slug": s.slug, "name": s.name, "type": s.type, "params": s.params,
                          "pretrain_wsi_equivalent": s.pretrain_wsi_equivalent, "architecture": s.architecture}
                         for s in encoders])
