"""The report: table builders against hand values, and the page regenerated from a constructed run table."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from cellpath.config import parse_params
from cellpath.expression.summary import headline_metrics as expression_headline
from cellpath.expression.summary import summarise as expression_summarise
from cellpath.probing.summary import headline_metrics, run_counts, summarise
from cellpath.probing.tasks import ERROR_KEYS
from cellpath.report import tables
from cellpath.report.thumbnails import crop_bounds, section_thumbnail
from cellpath.stages.expression import write_outputs as write_expression_outputs
from cellpath.stages.probe import write_outputs
from cellpath.stages.report import load_inputs
from cellpath.stages.report import run as run_report_stage
from helpers.browser import CHROMIUM, dump_dom, screenshot
from helpers.project import PROJECT_ROOT

MODELS = {"filterbank-dense": 0.5, "random-vit-t16": 0.4, "random-vit-s16": 0.3}  # base Macro-F1
SECTIONS = {"s1": ("O1", 0.00), "s2": ("O1", 0.04), "s3": ("O2", 0.02), "s4": ("O2", 0.06),
            "s5": ("O3", 0.01), "s6": ("O3", 0.03)}  # section → (organ, score offset)
CLASSES = ["Neoplastic", "Lymphocyte", "Fibroblast/Stromal cell"]


def _units(protocol: str) -> list[tuple[str, str, float]]:
    """(unit, organ, offset) per protocol: sections (IS, IOCD), folds (MOCV), organs (LOOO)."""
    if protocol in ("is", "iocd"):
        return [(s, organ, offset) for s, (organ, offset) in SECTIONS.items()]
    if protocol == "mocv":
        return [(f"fold{i}", "", offset) for i, offset in enumerate([0.0, 0.03, 0.06])]
    return [(organ, organ, offset) for organ, offset in (("O1", 0.02), ("O2", 0.04), ("O3", 0.02))]


NESTED = {"S4": list(SECTIONS)[:4], "S6": list(SECTIONS)}  # as panels.csv below: the first four ranked


def constructed_runs() -> pd.DataFrame:
    """Scores = model base + 0.1 (Nuc) + 0.2 (Tcoarse) + unit offset ± 0.01 (two seeds that cancel)."""
    rows = []
    for model, base in MODELS.items():
        for readout in ("Nuc", "Mean"):
            for taxonomy in ("fine", "coarse"):
                for protocol in ("is", "iocd", "mocv", "looo"):
                    for unit, organ, offset in _units(protocol):
                        for seed, noise in enumerate((-0.01, 0.01)):
                            score = base + 0.1 * (readout == "Nuc") + 0.2 * (taxonomy == "coarse") + offset + noise
                            rows.append({"model": model, "magnification": "20x", "readout": readout,
                                         "taxonomy": taxonomy, "protocol": protocol, "unit": unit, "organ": organ,
                                         "seed": seed, "status": "ok", "skip_reason": "", "macro_f1": score,
                                         "macro_auroc": score + 0.3, "macro_auprc": score,
                                         "lbfgs_iterations": 30, "converged": seed == 0, "n_train": 400,
                                         "chosen_c": 0.1, "c_tied": 1})
    return pd.DataFrame(rows)


def _robustness_outputs(folder: Path) -> None:
    folder.mkdir(parents=True)
    condition = {"magnification": "20x", "readout": "Nuc", "taxonomy": "fine", "scope": "panel", "unit": "panel"}
    medians = {"filterbank-dense": (0.10, -0.30), "random-vit-t16": (0.20, -0.50), "random-vit-s16": (0.05, -0.60)}
    pd.DataFrame([{"model": m, **condition, "n_samples": 100, "n_undefined": 2, "n_unresolved": 0,
                   "n_zero_distance": 0, "m": 5, "k": 11, "alpha": 0.1, "croma_median": med, "f0": 0.4, "ltm": ltm,
                   "q_alpha": ltm, "ri": 0.6, "mari": 0.55, "support": 0.9, "tau": 0.01, "bio_bacc": 0.5,
                   "conf_bacc": 0.4, "k_selected": 11, "confounder": "section_id"} for m, (med, ltm) in medians.items()]
                 ).to_csv(folder / "summary.csv", index=False)
    rng = np.random.default_rng(0)
    pd.DataFrame([{"model": m, **condition, "cell_id": f"c{i}", "section_id": "s1", "organ": "O1",
                   "cell_type": CLASSES[i % 3], "margin": float(v)}
                  for m in medians for i, v in enumerate(rng.uniform(-1, 1, 50))]
                 ).to_parquet(folder / "margins.parquet", index=False)
    pd.DataFrame([{"column": "cell_type", "category": "Lymphocyte", "n_low": 8, "n_defined": 30, "share_low": 0.8,
                   "share_all": 0.3, "enrichment": 2.67, "model": "random-vit-t16", **condition}]
                 ).to_csv(folder / "low_margin_enrichment.csv", index=False)
    pd.DataFrame([{"model": m, "setting": s, "cramers_v": v, "balanced_accuracy_mean": 0.6 - 0.1 * v,
                   "balanced_accuracy_sd": 0.01} for m in medians for s in ("in_domain", "held_out")
                  for v in (0.0, 0.5, 1.0)]).to_csv(folder / "shortcut.csv", index=False)
    pd.DataFrame([{"model": m, "setting": s, "readout": "Nuc", "taxonomy": "coarse", "magnification": "20x",
                   "confounder": "section_id", "n_runs": 20, "apd": -0.05, "nipd": -0.1, "nipd_low": -0.15,
                   "nipd_high": -0.05} for m in medians for s in ("in_domain", "held_out")]
                 ).to_csv(folder / "shortcut_summary.csv", index=False)
    from cellpath.robustness.agreement import metric_agreement

    metric_agreement(pd.read_csv(folder / "summary.csv"), pd.read_csv(folder / "shortcut_summary.csv")
                     ).to_csv(folder / "agreement.csv", index=False)
    from cellpath.robustness.sensitivity import sensitivity_agreement

    # m sweep: at m = 1 the models' order reverses (ρ = -1 against m = 5), m = 20 keeps it (ρ = 1).
    sweep = pd.DataFrame([{"model": model, **condition, "parameter": "m", "value": float(m),
                           "croma_median": med * (-1 if m == 1 else 1), "ltm": ltm}
                          for model, (med, ltm) in medians.items() for m in (1, 5, 20)])
    sensitivity_agreement(sweep, list(condition), headline_m=5).to_csv(folder / "sensitivity_agreement.csv",
                                                                       index=False)


def _expression_outputs(reports: Path, protocols: tuple[str, ...] = ("is", "iocd", "mocv", "looo"),
                        models: tuple[str, ...] = tuple(MODELS)) -> None:
    """The expression stage's outputs, written by its own writer from a constructed run table: mean r =
    model base / 2 + 0.05 (Nuc) + unit offset ± 0.01; r(type) = 0.2 everywhere; genes g0 (r + 0.1), g1 (r − 0.1)."""
    rows, genes = [], []
    for model in models:
        base = MODELS[model]
        for readout in ("Nuc", "Mean"):
            for protocol in protocols:
                for unit, organ, offset in _units(protocol):
                    for seed, noise in enumerate((-0.01, 0.01)):
                        r = base / 2 + 0.05 * (readout == "Nuc") + offset + noise
                        keys = {"model": model, "magnification": "20x", "readout": readout, "protocol": protocol,
                                "unit": unit, "organ": organ, "seed": seed}
                        rows.append(keys | {"taxonomy": "expression", "status": "ok", "skip_reason": "",
                                            "n_excluded_low_counts": 3, "mean_pearson": r, "mean_pearson_type": 0.2,
                                            "mean_pearson_type_features": r + 0.05, "gain_features_over_type": r - 0.2,
                                            "gain_type_features_over_type": r - 0.15, "mean_spearman": r,
                                            "share_r_above": 0.5, "fit_seconds": 0.1})
                        genes += [keys | {"gene": g, "pearson": r + d, "pearson_type": 0.2,
                                          "pearson_type_features": r + d + 0.05} for g, d in (("g0", 0.1), ("g1", -0.1))]
    runs, per_gene = pd.DataFrame(rows), pd.DataFrame(genes)
    summaries = expression_summarise(runs, per_gene, ["20x"])
    write_expression_outputs(reports, runs, per_gene, pd.DataFrame(), summaries, {},
                             expression_headline(summaries, ["20x"]))


def _data_outputs(data: Path) -> None:
    (data / "labels").mkdir(parents=True)
    counts = {"s1": [10, 20, 30], "s2": [5, 5, 5], "s3": [1, 2, 3], "s4": [0, 4, 4], "s5": [7, 0, 1], "s6": [2, 2, 2]}
    pd.DataFrame([{"section_id": s, "organ": SECTIONS[s][0], "excluded": False,
                   **{f"fine:{c}": n for c, n in zip(CLASSES, values)}} for s, values in counts.items()]
                 ).to_csv(data / "labels" / "summary.csv", index=False)
    pd.DataFrame([{"section_id": s, "organ": organ, "score": 0.9 - 0.1 * i, "cells": 100, "n_matched": 80,
                   "excluded_by_annotation": False, "reference_unmatched": 0.05,
                   "poor_reference_coverage": i == 5, "rank": i + 1, "S4": i < 4, "S6": True}
                  for i, (s, (organ, _)) in enumerate(SECTIONS.items())]).to_csv(data / "panels.csv", index=False)


@pytest.fixture(scope="module")
def constructed(tmp_path_factory):
    """Probe outputs written by the probe stage's own writer from a constructed run table, plus
    robustness, annotation and concordance outputs with the stages' columns."""
    root = tmp_path_factory.mktemp("report")
    project = PROJECT_ROOT
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw.update({"panel": "S6", "report": {"thumbnails": 0}})
    raw["concordance"]["panel_sizes"] = [4, 6]
    raw["extract"].update({"encoders": list(MODELS), "magnifications": ["20x"],
                           "registry": str(project / "models" / "encoders.yaml")})
    raw["robustness"]["magnifications"] = None
    params = parse_params(raw)
    runs = constructed_runs()
    summaries = summarise(runs, ["20x"], NESTED)
    counts = run_counts(runs, {p: 0 for p in ("is", "iocd", "mocv", "looo")})
    write_outputs(root / "reports", runs, pd.DataFrame(columns=ERROR_KEYS), summaries, counts,
                  headline_metrics(runs, summaries, ["20x"]))
    _robustness_outputs(root / "reports" / "robustness")
    _expression_outputs(root / "reports")
    _data_outputs(root / "data")
    return {"root": root, "params": params, "runs": runs}


class _Tables(HTMLParser):
    """Cell texts of every <table id=...> of a page: {id: [[cells of row], ...]}."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table = self._row = self._cell = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("id", ""), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _cell(page: dict, table: str, row: str, column: str) -> str:
    header, *rows = page[table]
    by_row = {r[0]: r for r in rows}
    return by_row[row][header.index(column)]


@pytest.fixture(scope="module")
def page(constructed):
    root = constructed["root"]
    html_path = run_report_stage(constructed["params"], root / "data", root / "reports", root=root)
    parser = _Tables()
    parser.feed(html_path.read_text())
    return {"tables": parser.tables, "path": html_path, "reports": root / "reports"}


def _interval(cell: str) -> tuple[float, float]:
    """The '[low, high]' at the end of a table cell."""
    low, high = cell[cell.index("[") + 1:cell.index("]")].split(",")
    return float(low), float(high)


def test_the_expression_table_has_the_hand_values(page):
    t = page["tables"]
    # filterbank-dense Nuc IS: 0.25 + 0.05 + organ means of the section offsets (0.02, 0.04, 0.02) → 0.32667
    assert _cell(t, "expression", "filterbank-dense", "IS r").startswith("0.33 ± 0.01 [")
    assert _cell(t, "expression", "filterbank-dense", "IS r(type)") == "0.20"
    assert _cell(t, "expression", "filterbank-dense", "IS r(type+features)") == "0.38"  # r + 0.05
    assert _cell(t, "expression", "filterbank-dense", "IS gain") == "0.18"  # r(type+features) − r(type)
    # MOCV folds 0, 0.03, 0.06 → 0.33 ± 0.03; Nuc − Mean is 0.05 everywhere
    assert _cell(t, "expression", "random-vit-t16", "MOCV r").startswith("0.28 ± 0.03 [")
    assert _cell(t, "expression", "random-vit-t16", "CRA r") == "0.05 [0.05, 0.05]"
    # every pair differs by a constant: the better model wins against each other under every protocol
    assert _cell(t, "expression", "filterbank-dense", "LOOO wins") == "2"
    assert (page["reports"] / "figures" / "expression_genes.png").is_file()


def test_headline_cells_are_the_hand_values(page):
    t = page["tables"]
    # IS Tfine Nuc of filterbank-dense: 0.5 + 0.1 + organ means (0.02, 0.04, 0.02) → 0.62667 ± 0.01155.
    assert _cell(t, "headline", "filterbank-dense", "IS").startswith("62.67 ± 1.15 [")
    # MOCV: folds 0, 0.03, 0.06 → 0.63 ± 0.03; CRA (Nuc − Mean) is 0.1 everywhere → 10.00 pp.
    mocv = _cell(t, "headline", "filterbank-dense", "MOCV")
    assert mocv.startswith("63.00 ± 3.00 [")
    # its 95% interval: a resample's mean lies between every fold's lower seed (0.59) and upper (0.67)
    low, high = _interval(mocv)
    assert 59.0 <= low < 63.0 < high <= 67.0
    # identical differences everywhere: the interval is the point
    assert _cell(t, "headline", "random-vit-t16", "CRA") == "10.00 [10.00, 10.00]"
    assert _cell(t, "headline", "random-vit-t16", "CRoMa median") == "0.20"


def test_win_and_crt_cells(page):
    t = page["tables"]
    # The IS tables' Wins are CRA wins: every model's Nuc − Mean is the same 0.1, so nobody wins.
    assert [_cell(t, "is_fine_20x", m, "Wins") for m in MODELS] == ["0", "0", "0"]
    # Cross-domain wins pair (unit, seed): IOCD 6 sections × 2 seeds, MOCV 3 folds × 2, LOOO 3 organs × 2,
    # each with constant differences → p ≤ 2/2^6 < 0.05: the best model beats both others everywhere, CRT 2.
    # (Seed-averaged units gave MOCV and LOOO three pairs, p ≥ 0.25, and CRT 2/3.)
    for protocol in ("IOCD", "MOCV", "LOOO"):
        assert _cell(t, "cross_domain_fine", "filterbank-dense", f"{protocol} wins") == "2"
        assert _cell(t, "cross_domain_fine", "random-vit-s16", f"{protocol} wins") == "0"
    assert _cell(t, "cross_domain_fine", "filterbank-dense", "CRT") == "2.00"
    # Holm over the 2 opponents: IOCD's 12 pairs give p = 2/2^12, ×2 still < 0.05: both wins stay;
    # MOCV's and LOOO's 6 pairs give p = 2/2^6 = 0.03125 for both opponents, ×2 = 0.0625: none stays.
    assert _cell(t, "cross_domain_fine", "filterbank-dense", "IOCD Holm wins") == "2"
    assert _cell(t, "cross_domain_fine", "filterbank-dense", "MOCV Holm wins") == "0"
    assert _cell(t, "cross_domain_fine", "filterbank-dense", "LOOO Holm wins") == "0"
    assert _cell(t, "cross_domain_fine", "random-vit-t16", "CRT") == "1.00"
    # Table 4: pooled CRA 0.1 with zero spread across organs; no CRA wins (equal differences).
    assert _cell(t, "cra_20x", "random-vit-t16", "CRA") == "10.00 ± 0.00 [10.00, 10.00]"
    assert _cell(t, "cra_20x", "random-vit-t16", "CRA Holm wins") == "0"
    assert _cell(t, "cra_20x", "random-vit-t16", "Tcoarse Nuc").startswith("72.67 ± 1.15 [")


def test_rows_are_sorted_by_wins_and_best_values_are_marked(page):
    rows = [r[0] for r in page["tables"]["cross_domain_fine"][1:]]
    assert rows == ["filterbank-dense", "random-vit-t16", "random-vit-s16"]
    html = page["path"].read_text()
    assert '<td class="best">62.67 ± 1.15 [' in html


def test_panel_robustness_reads_smaller_panels_from_the_same_is_runs(page):
    panel = pd.read_csv(page["reports"] / "tables" / "panel_robustness.csv")
    s4 = panel[(panel["panel"] == "S4") & (panel["model"] == "filterbank-dense")].iloc[0]
    # S4 = s1..s4: organ means 0.02, 0.04 → 0.6 + 0.03.
    assert s4["IS Nuc F1"] == pytest.approx(0.63)
    assert s4["n_sections"] == 4 and s4["rank"] == 1
    assert panel["spearman_vs_largest"].dropna().eq(1.0).all()


def test_every_section_and_output_is_present(page):
    html = page["path"].read_text()
    for anchor in ("headline", "within", "cross", "landscape", "effects", "panels", "robustness", "data",
                   "where", "glossary"):
        assert f'<section id="{anchor}">' in html
    assert html.count("data:image/png;base64,") >= 9
    reports = page["reports"]
    for name in ("headline", "cra_20x", "cross_domain_fine", "robustness", "class_counts", "panels"):
        assert (reports / "tables" / f"{name}.csv").is_file() and (reports / "tables" / f"{name}.md").is_file()
    assert {p.name for p in (reports / "figures").iterdir()} >= {"landscape.png", "croma.png", "classes.png"}
    # The Pareto flag: random-vit-t16 (0.20, −0.50) and filterbank-dense (0.10, −0.30) are undominated.
    robustness = pd.read_csv(reports / "tables" / "robustness.csv").set_index("model")
    assert robustness["pareto"].to_dict() == {"random-vit-t16": True, "filterbank-dense": True,
                                              "random-vit-s16": False}
    # s6 is flagged for poor reference coverage: named in the header and marked in the panels table.
    assert "Poor reference coverage (annotate.coverage_max_unmatched exceeded" in html
    assert "nearest one): s6. They are evaluated" in html
    assert _cell(page["tables"], "panels", "s6", "poor_reference_coverage") == "yes"
    assert _cell(page["tables"], "panels", "s1", "poor_reference_coverage") == ""
    sensitivity = pd.read_csv(reports / "tables" / "sensitivity.csv").set_index("comparison")
    assert sensitivity["ρ"].to_dict() == {"m 5 vs 1": -1.0, "m 5 vs 20": 1.0, "m 1 vs 20": -1.0}
    assert sensitivity.loc["m 5 vs 1", "< 0 at x / y"] == "0 / 3" and "Sensitivity to m and α" in html


def test_the_failure_gallery_is_linked_when_it_exists_and_its_absence_said(constructed, page, tmp_path):
    assert 'id="gallery-missing"' in page["path"].read_text()  # the constructed run has no gallery
    root = tmp_path / "project"
    shutil.copytree(constructed["root"] / "data", root / "data")
    shutil.copytree(constructed["root"] / "reports", root / "reports", ignore=shutil.ignore_patterns("index.html"))
    (root / "reports" / "gallery").mkdir()
    (root / "reports" / "gallery" / "index.json").write_text(json.dumps({"crop_um": 40.0, "models": {
        "random-vit-t16": {"page": "random-vit-t16.html", "lists": [
            {"kind": "margins", "title": "Lowest CRoMa margins · 20x Nuc Tfine", "cells": 12}]}},
        "nuclei_drawn_as_circles": 0}))
    html = run_report_stage(constructed["params"], root / "data", root / "reports", root=root).read_text()
    assert '<a href="gallery/random-vit-t16.html">random-vit-t16</a>' in html
    assert "Lowest CRoMa margins · 20x Nuc Tfine (12)" in html and 'id="gallery-missing"' not in html


def test_missing_input_names_the_file_and_the_stage(constructed, tmp_path):
    shutil.copytree(constructed["root"] / "reports", tmp_path / "reports")
    (tmp_path / "reports" / "probe" / "cra_pooled.csv").unlink()
    with pytest.raises(Exception, match=r"cra_pooled\.csv.*dvc repro probe"):
        load_inputs(constructed["params"], constructed["root"] / "data", tmp_path / "reports")


def test_a_condition_with_one_balanced_unit_keeps_its_mean_without_an_sd():
    is_panels = pd.DataFrame([
        {"panel": "S2", "metric": "macro_f1", "model": "m", "magnification": "20x", "readout": r, "taxonomy": "fine",
         "mean": 0.5, "sd": np.nan if r == "Mean" else 0.1, "n_sections": 1 if r == "Mean" else 2}
        for r in ("Nuc", "Mean")])
    cra_panels = pd.DataFrame(columns=["panel", "metric", "model", "magnification", "taxonomy", "cra", "wins"])
    table = tables.is_readout_table(is_panels, cra_panels, "S2", "20x", "fine")
    assert tables.display(table).loc["m"].tolist() == ["50.00 ± 10.00", "50.00", "–", "0"]


def test_parse_count_and_pareto_frontier_golden():
    assert tables.parse_count("350K (converted)") == 350_000
    assert tables.parse_count("1100M") == 1.1e9
    assert tables.parse_count("1007") == 1007
    assert tables.parse_count(None) is None and tables.parse_count("n/a") is None
    median, tail = np.array([0.1, 0.2, 0.05, 0.2]), np.array([-0.3, -0.5, -0.6, -0.4])
    assert tables.pareto_frontier(median, tail).tolist() == [True, False, False, True]


def test_display_formats_pairs_wins_and_missing_values():
    frame = pd.DataFrame({"Nuc mean": [0.5, np.nan], "Nuc sd": [0.1, np.nan], "Wins": [2.0, np.nan],
                          "CRA": [0.123, 0.0], "flag": [True, False]}, index=["a", "b"])
    shown = tables.display(frame)
    assert shown.loc["a"].tolist() == ["50.00 ± 10.00", "2", "12.30", "yes"]
    assert shown.loc["b"].tolist() == ["–", "–", "0.00", ""]


def test_thumbnail_crop_is_inside_the_slide_and_points_fall_in_it(tiny_panel):
    assert crop_bounds(np.array([[5.0, 5.0]]), (100, 80), 40) == (0, 0, 40, 40)
    assert crop_bounds(np.array([[95.0, 70.0]]), (100, 80), 40) == (60, 40, 100, 80)
    from cellpath.io.sections import read_section_index

    data_dir = tiny_panel["data_dir"]
    row = read_section_index(data_dir).iloc[0]
    thumb = section_thumbnail(data_dir, data_dir / "raw", row, side_um=60.0, mpp=1.0)
    assert thumb.image.shape == (60, 60, 3)
    assert len(thumb.points) > 0
    assert thumb.points["x_px"].between(0, 60).all() and thumb.points["y_px"].between(0, 60).all()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_page_renders_in_headless_chromium(page, tmp_path):
    dom = dump_dom(page["path"].as_uri(), tmp_path / "profile")
    assert 'id="headline"' in dom and "62.67 ± 1.15 [" in dom
    shot = screenshot(page["path"].as_uri(), tmp_path / "profile", tmp_path / "page.png", (1200, 2000))
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.shape == (2000, 1200) and pixels.std() > 10  # not blank


def test_a_one_protocol_one_model_run_still_gives_a_page(constructed, tmp_path):
    """A `dvc exp run -S protocol=mocv` workspace: no IS, no cross-organ wins, shortcut disabled."""
    runs = constructed["runs"]
    runs = runs[(runs["protocol"] == "mocv") & (runs["model"] == "filterbank-dense")]
    summaries = summarise(runs, ["20x"], NESTED)
    counts = run_counts(runs, {"mocv": 0})
    root = tmp_path
    write_outputs(root / "reports", runs, pd.DataFrame(columns=ERROR_KEYS), summaries, counts,
                  headline_metrics(runs, summaries, ["20x"]))
    shutil.copytree(constructed["root"] / "reports" / "robustness", root / "reports" / "robustness")
    for name in ("shortcut", "shortcut_summary"):
        header = (root / "reports" / "robustness" / f"{name}.csv").read_text().splitlines()[0]
        (root / "reports" / "robustness" / f"{name}.csv").write_text(header + "\n")
    shutil.copytree(constructed["root"] / "data", root / "data")
    _expression_outputs(root / "reports", protocols=("mocv",), models=("filterbank-dense",))
    page = run_report_stage(constructed["params"], root / "data", root / "reports", root=root).read_text()
    parser = _Tables()
    parser.feed(page)
    assert _cell(parser.tables, "headline", "filterbank-dense", "MOCV").startswith("63.00 ± 3.00 [")
    assert _cell(parser.tables, "expression", "filterbank-dense", "MOCV r").startswith("0.33 ± 0.03 [")
    assert "IS r" not in parser.tables["expression"][0]
    assert _cell(parser.tables, "headline", "filterbank-dense", "IS") == "–"
    assert "panel robustness: no data in this run" in page and "shortcut probe: no data in this run" in page
    # the header says what was run; the IS tables say why they are empty instead of showing bare headers
    assert "Protocols run: <b>MOCV</b>" in page
    assert 'id="cra_20x-empty"' in page and "IS was not run: protocols run MOCV" in page


def test_nipd_joins_only_the_robustness_rows_of_its_own_condition():
    """The shortcut probe ran on Tcoarse with the section confounder: its nIPD belongs beside the
    Tcoarse section-confounder panel row, never beside Tfine or an organ-confounder row."""
    base = {"model": "m", "magnification": "20x", "readout": "Nuc", "scope": "panel", "unit": "panel", "n_samples": 10,
            "n_undefined": 0, "croma_median": 0.1, "f0": 0.3, "ltm": -0.2, "ri": 0.5, "mari": 0.5, "support": 1.0,
            "k": 5, "k_selected": 7, "bio_bacc": 0.6, "conf_bacc": 0.3}
    summary = pd.DataFrame([base | {"taxonomy": t, "confounder": c} for t in ("fine", "coarse")
                            for c in ("section_id", "organ")])
    shortcut = pd.DataFrame([{"model": "m", "setting": "in_domain", "readout": "Nuc", "taxonomy": "coarse",
                              "magnification": "20x", "confounder": "section_id", "n_runs": 20, "apd": -0.1,
                              "nipd": -0.25, "nipd_low": -0.3, "nipd_high": -0.2}])
    table = tables.robustness_table(summary, shortcut).set_index(["taxonomy", "confounder"])
    assert table.loc[("coarse", "section_id"), "nipd in_domain"] == -0.25
    assert table.loc[("coarse", "section_id"), "nipd low in_domain"] == -0.3
    for other in (("fine", "section_id"), ("fine", "organ"), ("coarse", "organ")):
        assert np.isnan(table.loc[other, "nipd in_domain"]), other
    assert (table["k_selected"] == 7).all()


def test_a_run_that_is_not_comparable_is_shown_beside_the_paper_and_never_ranked(page):
    """The constructed run is simulated with its own panel, seeds and gates: its models sit beside the
    paper's 30 with their means and the reasons, and no rank of theirs appears anywhere."""
    ranked = page["tables"]["published_placement"]
    header, rows = ranked[0], {row[0]: row for row in ranked[1:]}
    assert len(rows) == 30 and {"UNI2", "H-Optimus-1"} <= set(rows) and not set(MODELS) & set(rows)
    assert {row[header.index("source")] for row in rows.values()} == {"paper"}
    beside = page["tables"]["published_this_run"]
    assert [row[0] for row in beside[1:]] == list(MODELS)  # best first
    assert not [c for c in beside[0] if "rank" in c.lower()]
    assert _cell(page["tables"], "published_this_run", "filterbank-dense", "IS") == "62.67"
    # the files say the same: no row of this run among the ranked, no rank column beside
    placed = pd.read_csv(page["reports"] / "tables" / "published_placement.csv")
    assert set(placed["source"]) == {"paper"} and not set(MODELS) & set(placed["model"])
    assert not [c for c in pd.read_csv(page["reports"] / "tables" / "published_this_run.csv").columns if "rank" in c]
    html = page["path"].read_text()
    section = html[html.index('<section id="published">'):]
    section = section[:section.index("</section>")]
    assert "among the paper" not in section and "this run beside them (not comparable, not ranked)" in section
    assert "Not comparable, so not ranked" in section and "simulated panel (source: synthetic)" in section
    for table in re.findall(r"<table id=.*?</table>", section, flags=re.S):
        parser = _Tables()
        parser.feed(table)
        (name, cells), = parser.tables.items()
        ours = [row for row in cells[1:] if row[0] in MODELS]
        assert not ours or not [c for c in cells[0] if "rank" in c.lower()], name
    # the reproduction check needs the paper's configuration: its table says why it is empty
    assert "the run is not the paper&#39;s configuration" in html or "the run is not the paper's configuration" in html


def test_the_run_table_shows_skipped_runs():
    from cellpath.report.tables import display, run_table

    runs = constructed_runs().head(3).astype({"converged": "boolean", "lbfgs_iterations": "Int64", "c_tied": "Int64"})
    runs.loc[0, ["status", "chosen_c", "c_tied", "macro_f1", "n_train", "converged", "lbfgs_iterations"]] = \
        ["skipped", None, pd.NA, None, None, pd.NA, pd.NA]
    shown = display(run_table(runs), percent_pairs=False, percent_columns=())
    assert list(shown["status"]).count("skipped") == 1 and "" in list(shown["converged"])
    assert list(shown.loc[shown["status"] == "ok", "c_tied"]) == ["1", "1"]
