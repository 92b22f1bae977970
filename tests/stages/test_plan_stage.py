"""`cellpath plan`: counts from the data or the params, the paper's Table 3, and costs with their sources."""

from __future__ import annotations

import json

import pytest
import yaml

from cellpath.cli import main
from cellpath.config import load_params, parse_params
from cellpath.stages.plan import PAPER_RUNS, PAPER_TABLE_3, build_plan
from helpers.project import PROJECT_ROOT


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)  # the registry and the manifest are named relative to the project


def _tiny(base) -> dict:
    data = base.model_dump(mode="json")
    data["extract"].update(encoders=["filterbank-dense"], magnifications=["10x"])
    data["probe"] = {"seeds": {"is": 2, "iocd": 1, "mocv": 1, "looo": 1}, "mocv_folds": 3,
                     "min_train_cells": {"fine": 10, "coarse": 10}, "min_test_cells": {"fine": 5, "coarse": 5},
                     "readouts": ["Nuc", "Mean", "Cls", "N||M"]}
    data["robustness"] = {"taxonomies": ["coarse"], "readouts": ["Nuc", "Mean"], "scopes": ["panel", "organ"]}
    data["executor"] = {"workers": 2}
    return data


def test_paper_preset_derives_table_3_without_data(at_root, tmp_path):
    plan = build_plan(load_params("params.yaml"), tmp_path / "data", tmp_path / "reports", tmp_path, preset="paper")
    probe = plan["probe"]
    assert {p: row["runs"] for p, row in probe["protocols"].items()} == PAPER_TABLE_3
    assert probe["total"]["runs"] == PAPER_RUNS and probe["paper"]["matches"]
    assert probe["total"]["unavailable"] == 4_356  # CTransPath has no CLS token
    assert {p: row["units"] for p, row in probe["protocols"].items()} == {"is": 25, "iocd": 23, "mocv": 5, "looo": 11}
    assert plan["panel"] | {"source": None} == {"name": "S25", "sections": 25, "organs": 11, "cells": 7_079_283,
                                                "evaluated_cells": None, "source": None}
    assert plan["encoders"] == 30 and len(plan["features"]) == 90
    assert all(row["patches"] is None and row["bytes"] > 0 for row in plan["features"])
    assert plan["total_seconds"] == 0 and "probe" in plan["missing"]  # no measurement in tmp_path: none invented


def test_plan_of_the_tiny_panel_counts_from_the_data(at_root, tiny_features, tmp_path):
    params = parse_params(_tiny(tiny_features["params"]))
    data_dir = tiny_features["data_dir"]
    reports = tmp_path / "reports"
    (reports / "probe").mkdir(parents=True)
    (reports / "probe" / "timing.json").write_text(json.dumps({"fit_seconds": 12.0}))
    (reports / "probe" / "counts.json").write_text(json.dumps({"total": {"ok": 120}}))
    (tmp_path / "robustness.json").write_text(json.dumps({"settings": {"d": 8}, "runs": [
        {"n": 100, "ours_seconds": 0.5}, {"n": 10_000, "ours_seconds": 50.0}]}))
    plan = build_plan(params, data_dir, reports, tmp_path)

    # The same units as the probe stage's run table (tests/stages/test_probe_stage.py), × 4 readouts × 2 taxonomies.
    protocols = plan["probe"]["protocols"]
    assert {p: row["runs"] for p, row in protocols.items()} == {"is": 48, "iocd": 16, "mocv": 24, "looo": 16}
    assert {p: row["unavailable"] for p, row in protocols.items()} == {"is": 12, "iocd": 4, "mocv": 6, "looo": 4}
    total = plan["probe"]["total"]
    assert total["fitted"] + total["skipped"] + total["unavailable"] == total["runs"] and total["fitted"] > 0

    (row,) = plan["features"]
    sidecars = [json.loads(p.read_text()) for p in (data_dir / "features" / "filterbank-dense" / "10x").glob("*/sidecar.json")]
    assert row["patches"] == sum(s["n_patches"] for s in sidecars) and row["sections"] == 3
    assert row["bytes"] == sum(p.stat().st_size for p in (data_dir / "features" / "filterbank-dense" / "10x").rglob("*")
                               if p.is_file())

    by_what = {e["what"]: e for e in plan["estimates"]}
    assert ".work/extract/filterbank-dense-10x.timing.json" in by_what["extract filterbank-dense"]["source"]
    assert by_what["probe"]["seconds"] == pytest.approx(total["fitted"] * 0.1)
    assert "probe/timing.json" in by_what["probe"]["source"]
    n = plan["panel"]["evaluated_cells"]
    # panel scope (all cells) + organ scope (Breast: its two sections) per readout; n² from the nearest size.
    assert by_what["robustness"]["units"] == 4 and "robustness.json (n = 100" in by_what["robustness"]["source"]
    assert by_what["robustness"]["seconds"] > 2 * 0.5 * (n / 100) ** 2
    assert plan["missing"] == [] and plan["executor"]["ideal_seconds"] == pytest.approx(plan["total_seconds"] / 2)


def test_cli_plan_prints_a_table_and_json(at_root, tiny_features, tmp_path, capsys):
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(_tiny(tiny_features["params"])))
    args = ["plan", "--params", str(params_file), "--data-dir", str(tiny_features["data_dir"]),
            "--reports-dir", str(tmp_path), "--benchmarks-dir", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["preset"] == "current" and plan["probe"]["total"]["runs"] == 104
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "filterbank-dense" in table and "not estimated (no measured cost or size): probe, robustness" in table
    assert main([*args, "--preset", "paper"]) == 0
    assert "derived 304,920: matches" in capsys.readouterr().out


def test_robustness_cost_is_quadratic_up_to_the_anchor_threshold_then_linear(tmp_path):
    from cellpath.stages.plan import robustness_cost

    bench = tmp_path / "robustness.json"
    bench.write_text(json.dumps({"settings": {"d": 8}, "runs": [{"n": 1000, "ours_seconds": 2.0}]}))
    assert robustness_cost(500, bench, full_max_cells=100_000, anchors=20_000)[0] == pytest.approx(0.5)
    # 7M cells above the threshold: 20,000 anchors × 7M candidates at the measured 2 s / 1,000² pairs.
    seconds, source = robustness_cost(7_000_000, bench, full_max_cells=100_000, anchors=20_000)
    assert seconds == pytest.approx(2.0 * 20_000 * 7_000_000 / 1000**2) and "20,000 anchors" in source
