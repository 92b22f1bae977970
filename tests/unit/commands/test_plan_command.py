"""`cellpath plan`: counts from the data or the params, the paper's Table 3, and costs from the stored cost model."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import yaml

from cellpath.cli import main
from cellpath.commands.plan import run as plan_text
from cellpath.config import load_params, parse_params
from cellpath.errors import ConfigError
from cellpath.features.encoders.registry import load_registry
from cellpath.features.readouts import readout_available, readout_width
from cellpath.planning.build import build_plan
from cellpath.planning.paper import PAPER_RUNS, PAPER_TABLE_3, paper_params
from cellpath.runtime.costs import (CostModel, DeviceCosts, ExpressionCosts, ExtractCosts, Iterations, ProbeCosts, RobustnessCosts,
                                    SectionCosts, StorageCosts, load_costs, parameter_count, patch_gflop, save_costs)
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


@pytest.fixture
def costs(tmp_path):
    """A cost model with round numbers (CPU only): a test file, not the measured one."""
    model = CostModel(machine={"cpus": 2, "memory_gb": 24}, devices={"cpu": DeviceCosts(
        probe=ProbeCosts(seconds_per_iteration={"in_memory": 0.0, "streamed": 0.0},
                         seconds_per_pass={"in_memory": 1e-9, "streamed": 2e-9},
                         iterations=Iterations((1_000.0,), (100.0,), (50.0,), (200.0,), "test"), heap_base_bytes=5e8,
                         heap_bytes_per_cell=1000, source="test probe"),
        robustness=RobustnessCosts(seconds_per_pair_full=1e-10, seconds_per_pair_anchor=1e-10, heap_base_bytes=0,
                                   heap_bytes_per_query_feature=8, heap_bytes_per_cell=100, cores=2, source="test robustness"),
        extract=ExtractCosts(seconds_per_gflop=0.01, patches_per_cell_224={"40x": 0.06, "20x": 0.015, "10x": 0.00375},
                             cores=2, source="test extract"),
        sections={stage: SectionCosts(seconds_base=base, seconds_per_cell=1e-4, heap_base_bytes=1e9,
                                      heap_bytes_per_cell=1e4, cells=(10_000, 40_000), cores=1, source=f"test {stage}")
                  for stage, base in (("ingest", 1.0), ("annotate", 2.0), ("concordance", 3.0), ("extract", 4.0))},
        expression=ExpressionCosts(seconds_per_row_width2=1e-10, seconds_per_width3=0.0, cores=2,
                                   source="test expression"))})
    path = tmp_path / "costs.json"
    save_costs(model, path)
    return path


def test_paper_preset_derives_table_3_and_prices_every_stage_without_data(at_root, tmp_path, costs):
    plan = build_plan(load_params("params.yaml"), tmp_path / "data", preset="paper", costs_path=costs,
                      worker_cores=8, worker_memory_gb=64)
    probe = plan["probe"]
    assert {p: row["runs"] for p, row in probe["protocols"].items()} == PAPER_TABLE_3
    assert probe["total"]["runs"] == PAPER_RUNS and probe["paper"]["matches"]
    assert probe["total"]["unavailable"] == 4_356  # CTransPath has no CLS token
    assert {p: row["units"] for p, row in probe["protocols"].items()} == {"is": 25, "iocd": 23, "mocv": 5, "looo": 11}
    assert plan["panel"] | {"source": None} == {"name": "S25", "sections": 25, "organs": 11, "cells": 7_079_283,
                                                "evaluated_cells": None, "source": None}
    assert plan["encoders"] == 30 and len(plan["features"]) == 90
    # no slides: patches from the model's patches per cell (× (224 / input size)²)
    row = next(r for r in plan["features"] if r["magnification"] == "20x")
    assert row["patches"] > 0 and row["bytes"] > 0
    by_stage = {e["stage"]: e for e in plan["estimates"] if e["stage"] != "extract"}
    assert by_stage["probe"]["units"] == PAPER_RUNS - 4_356
    # per-pass cost only: seconds = 1 ns × Σ runs × (width + 1) × cells of the split (≤ the panel each)
    assert 0 < by_stage["probe"]["seconds"] < 1e-9 * PAPER_RUNS * (2 * 1_536 + 1) * 7_079_283
    assert by_stage["probe"]["core_seconds_range"][0] == by_stage["probe"]["seconds"]  # no per-iteration cost
    assert plan["not_estimated"] == {"ingest": [], "annotate": [], "concordance": [], "extract": ["cuda"],
                                     "probe": ["cuda"], "expression": ["cuda"], "robustness": ["cuda"]}
    # expression: 30 encoders × Nuc, Mean × 3 magnifications × the runs (units × seeds) × 3 designs
    runs = 25 * 5 + 23 * 3 + 5 * 3 + 11 * 3
    assert by_stage["expression"]["units"] == 30 * 2 * 3 * runs * 3
    assert 0 < by_stage["expression"]["core_seconds"] == 2 * by_stage["expression"]["seconds"]
    # at most every panel cell in each fit, at most 1,536 + 9 columns (UNI2's Nuc and the Tfine one-hot)
    assert by_stage["expression"]["seconds"] < 1e-10 * 30 * 2 * 3 * runs * 3 * 7_079_283 * (1_536 + 9) ** 2
    # ingest, annotate and concordance: every manifest row with a download (concordance ranks them all)
    manifest = pd.read_csv("data/manifests/xenium_datasets.csv").dropna(subset=["bundle_url"])
    assert plan["staged_sections"]["sections"] == len(manifest) == 51
    for stage, base in (("ingest", 1.0), ("annotate", 2.0), ("concordance", 3.0)):
        assert by_stage[stage]["units"] == 51
        assert by_stage[stage]["seconds"] == pytest.approx(51 * base + 1e-4 * manifest["cells"].sum())
        assert by_stage[stage]["peak_memory_bytes"] == pytest.approx(1e9 + 1e4 * manifest["cells"].max())
    # extraction: GFLOP, plus its reading, placing and writing per S25 section and magnification
    spec = load_registry("models/encoders.yaml")["UNI"]
    vit = next(e for e in plan["estimates"] if e["stage"] == "extract" and e["what"] == spec.slug)
    s25 = manifest[manifest["panel_s25"] == 1]
    forward = vit["units"] * patch_gflop(parameter_count(spec.params), spec.input_size, spec.patch_size,
                                         spec.num_prefix_tokens) * 0.01
    assert vit["seconds"] == pytest.approx(forward + 3 * (25 * 4.0 + 1e-4 * s25["cells"].sum()))
    assert vit["peak_memory_bytes"] == pytest.approx(parameter_count(spec.params) * 4 + 1e9 + 1e4 * s25["cells"].max())
    week = plan["week"]
    assert week["worker_cores"] == 8 and week["worker_memory_bytes"] == 64e9
    core_seconds = sum(e["core_seconds"] for e in plan["estimates"])
    assert week["core_hours"] == pytest.approx(core_seconds / 3600)
    assert week["workers"] == -(-core_seconds // (8 * 7 * 86400))
    extract = [e for e in plan["estimates"] if e["stage"] == "extract"]
    assert len(extract) == 30 and all(e["disk_bytes"] > 0 for e in extract)
    # the shared patch store holds one copy per (magnification, input size), not one per encoder
    sizes = {spec.input_size for spec in load_registry("models/encoders.yaml").values() if spec.type != "control"}
    per_cell = {"40x": 0.06, "20x": 0.015, "10x": 0.00375}
    assert plan["patch_cache_bytes"] == sum(round(7_079_283 * share * (224 / size) ** 2) * size * size * 3
                                            for share in per_cell.values() for size in sizes)
    raw = load_params("params.yaml").model_dump(mode="json")
    raw["extract"]["patch_cache"] = False
    assert build_plan(parse_params(raw), tmp_path / "data", preset="paper", costs_path=costs)["patch_cache_bytes"] == 0


def test_plan_of_the_tiny_panel_counts_from_the_data(at_root, tiny_features, tmp_path, costs):
    params = parse_params(_tiny(tiny_features["params"]))
    data_dir = tiny_features["data_dir"]
    plan = build_plan(params, data_dir, costs_path=costs)

    # The same units as the probe stage's run table (tests/stages/test_probe_stage.py), × 4 readouts × 2 taxonomies.
    protocols = plan["probe"]["protocols"]
    assert {p: row["runs"] for p, row in protocols.items()} == {"is": 48, "iocd": 16, "mocv": 24, "looo": 16}
    assert {p: row["unavailable"] for p, row in protocols.items()} == {"is": 12, "iocd": 4, "mocv": 6, "looo": 4}
    total = plan["probe"]["total"]
    assert total["fitted"] + total["skipped"] + total["unavailable"] == total["runs"] and total["fitted"] > 0

    (row,) = plan["features"]
    sidecars = [json.loads(p.read_text())
                for p in (data_dir / "features" / "filterbank-dense" / "10x").glob("*/sidecar.json")]
    assert row["patches"] == sum(s["n_patches"] for s in sidecars) and row["sections"] == 3
    assert row["bytes"] == sum(p.stat().st_size for p in (data_dir / "features" / "filterbank-dense" / "10x").rglob("*")
                               if p.is_file())

    by_stage = {e["stage"]: e for e in plan["estimates"]}
    assert "extract" not in by_stage  # the weight-free control has no ViT cost: not priced, not guessed
    assert by_stage["probe"]["units"] == total["fitted"]  # the gated tasks, not the section counts
    n = plan["panel"]["evaluated_cells"]
    # panel scope (all cells) + organ scope (Breast: its two sections) per readout, exact below the threshold
    assert by_stage["robustness"]["units"] == 4
    assert by_stage["robustness"]["seconds"] > 2 * 1e-10 * n**2 * 150
    assert by_stage["robustness"]["peak_memory_bytes"] == pytest.approx(8 * n * 150 + 100 * n)  # every cell a query


def test_cli_plan_prints_a_table_and_json(at_root, tiny_features, tmp_path, costs, capsys):
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(_tiny(tiny_features["params"])))
    args = ["plan", "--params", str(params_file), "--data-dir", str(tiny_features["data_dir"]), "--costs", str(costs)]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["preset"] == "current" and plan["probe"]["total"]["runs"] == 104
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "filterbank-dense" in table and "not measured, so not estimated: extract (cpu, cuda); probe (cuda)" in table
    assert main([*args, "--preset", "paper", "--worker-cores", "16", "--worker-memory-gb", "128"]) == 0
    table = capsys.readouterr().out
    assert "derived 304,920: matches" in table and "workers of 16 cores and 128.0 GB" in table


def test_cli_plan_without_a_cost_model_names_the_file(at_root, tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert main(["plan", "--preset", "paper", "--costs", str(missing)]) != 0
    assert "nowhere.json: not a readable cost model" in capsys.readouterr().err


def test_one_model_of_the_paper_is_its_share_of_every_stage(at_root, tmp_path):
    """`--models uni`: UNI's extraction as priced among all 30, and its share of the probe and robustness
    work. Iteration and pass costs are the same in both modes here, and every encoder runs the same
    splits, so a run's cost is proportional to its design columns (width + 1) and a scoring's to its
    width: UNI's share is worked out from the registry's widths and the readouts."""
    per_mode = {"in_memory": 1e-10, "streamed": 1e-10}
    model = CostModel(machine={"cpus": 2}, devices={"cpu": DeviceCosts(
        probe=ProbeCosts(seconds_per_iteration=per_mode, seconds_per_pass={m: 1e-9 for m in per_mode},
                         iterations=Iterations((1_000.0,), (100.0,), (50.0,), (200.0,), "test"),
                         heap_base_bytes=0, heap_bytes_per_cell=0, source="test probe"),
        robustness=RobustnessCosts(seconds_per_pair_full=1e-10, seconds_per_pair_anchor=1e-10, heap_base_bytes=0,
                                   heap_bytes_per_query_feature=8, heap_bytes_per_cell=100, cores=2, source="test"),
        extract=ExtractCosts(seconds_per_gflop=0.01, patches_per_cell_224={"40x": 0.06, "20x": 0.015, "10x": 0.00375},
                             cores=2, source="test extract"))})
    costs = tmp_path / "costs.json"
    save_costs(model, costs)
    full = build_plan(load_params("params.yaml"), tmp_path / "data", preset="paper", costs_path=costs)
    one = build_plan(load_params("params.yaml"), tmp_path / "data", preset="paper", costs_path=costs, models=["uni"])
    assert one["models"] == ["uni"] and one["encoders"] == 1 and one["configured_encoders"] == 30
    assert "paper" not in one["probe"] and one["panel"] == full["panel"]

    def stage(plan, name):
        return [e for e in plan["estimates"] if e["stage"] == name and e["device"] == "cpu"]

    assert stage(one, "extract") == [e for e in stage(full, "extract") if e["what"] == "uni"]
    params = paper_params(load_params("params.yaml"))
    specs = [s for s in load_registry("models/encoders.yaml").values() if s.type != "control"]
    uni = next(s for s in specs if s.slug == "uni")

    def columns(spec, readouts, extra):
        return sum(readout_width(spec.embed_dim, r) + extra for r in readouts if readout_available(spec, r))

    probe_share = columns(uni, params.probe.readouts, 1) / sum(columns(s, params.probe.readouts, 1) for s in specs)
    runs_share = (sum(readout_available(uni, r) for r in params.probe.readouts)
                  / sum(readout_available(s, r) for s in specs for r in params.probe.readouts))
    robustness_share = (columns(uni, params.robustness.readouts, 0)
                        / sum(columns(s, params.robustness.readouts, 0) for s in specs))
    (probe_one,), (probe_all,) = stage(one, "probe"), stage(full, "probe")
    assert probe_one["core_seconds"] == pytest.approx(probe_all["core_seconds"] * probe_share, rel=1e-12)
    assert probe_one["units"] == pytest.approx(probe_all["units"] * runs_share, rel=1e-12)
    assert probe_one["units"] == one["probe"]["total"]["runs"] == 10_164  # 304,920 runs / 30, UNI has a CLS token
    (rob_one,), (rob_all,) = stage(one, "robustness"), stage(full, "robustness")
    assert rob_one["core_seconds"] == pytest.approx(rob_all["core_seconds"] * robustness_share, rel=1e-12)
    assert one["week"]["core_hours"] == pytest.approx(
        (stage(one, "extract")[0]["core_seconds"] + probe_one["core_seconds"] + rob_one["core_seconds"]) / 3600)


def test_cli_plan_of_one_model_and_an_unknown_slug(at_root, tmp_path, costs, capsys):
    assert main(["plan", "--preset", "paper", "--models", "uni", "--costs", str(costs)]) == 0
    table = capsys.readouterr().out
    assert "cellpath plan (paper; uni: 1 of its 30 encoders, their runs only)" in table
    assert "probe runs (1 encoder × 3 magnifications)" in table and "uni " in table and "virchow2 " not in table
    assert main(["plan", "--preset", "paper", "--models", "unii", "--costs", str(costs)]) != 0
    error = capsys.readouterr().err
    assert "--models: no encoder 'unii' in the paper configuration (did you mean 'uni'?)" in error
    assert "its 30 slugs: h-optimus-1, h-optimus-0, prov-gigapath" in error and "dinov3-vit-b-16" in error


def test_the_plan_takes_its_iterations_from_a_pilot_on_real_features(at_root, tmp_path, costs):
    """A pilot run table (``--pilot``, or the project's own when ``source: 10x``) replaces the cost
    model's iterations; on simulated sections the project's own table is never used."""
    from cellpath.io.layout import probe_runs_parquet

    params = load_params("params.yaml")
    model = load_costs(costs)  # with a cost per iteration, so that the iterations show in the core-hours
    probe_costs = dataclasses.replace(model.costs("cpu").probe, seconds_per_iteration={"in_memory": 1e-9,
                                                                                        "streamed": 1e-9})
    save_costs(CostModel(model.machine, {"cpu": dataclasses.replace(model.costs("cpu"), probe=probe_costs)}), costs)
    runs = pd.DataFrame({"status": ["ok", "ok", "ok", "skipped", "ok"], "n_train": [5_000, 7_000, 9_000, None, 8_000],
                         "lbfgs_iterations": [300, 400, 500, None, 10_000],
                         "converged": [True, True, True, None, False]})
    pilot = tmp_path / "pilot.parquet"
    runs.to_parquet(pilot)
    (tmp_path / "reports" / "probe").mkdir(parents=True)
    runs.to_parquet(probe_runs_parquet(tmp_path / "reports"))

    def probe(plan):
        return next(e for e in plan["estimates"] if e["stage"] == "probe")

    benchmark = probe(build_plan(params, tmp_path / "data", preset="paper", costs_path=costs))
    assert benchmark["source"].startswith("L-BFGS iterations of a run's slowest C by training size (median 100 at")
    assert ": test" in benchmark["source"]
    piloted = probe(build_plan(params, tmp_path / "data", preset="paper", costs_path=costs, pilot=pilot))
    assert str(pilot) in piloted["source"] and "3 converged runs on real features" in piloted["source"]
    printed = plan_text(params, tmp_path / "data", preset="paper", costs_path=costs, pilot=pilot)
    assert f"source: {piloted['source']}" in printed  # the plan names where its iterations come from
    assert piloted["core_seconds_range"][0] > 5 * benchmark["core_seconds_range"][0]  # p25 350 against 50
    own = parse_params(params.model_dump(mode="json") | {"source": "10x"})
    assert probe(build_plan(own, tmp_path / "data", preset="paper", costs_path=costs,
                            reports_dir=tmp_path / "reports"))["source"] == piloted["source"].replace(
        str(pilot), str(probe_runs_parquet(tmp_path / "reports")))
    assert probe(build_plan(params, tmp_path / "data", preset="paper", costs_path=costs,
                            reports_dir=tmp_path / "reports"))["source"] == benchmark["source"]  # synthetic: not used
    (tmp_path / "broken.parquet").write_text("not a table")
    with pytest.raises(ConfigError, match="broken.parquet: not a probe run table"):
        build_plan(params, tmp_path / "data", preset="paper", costs_path=costs, pilot=tmp_path / "broken.parquet")


def test_the_paper_plan_prints_the_disk_per_place_and_dvc_time(at_root, tmp_path, costs):
    """Workspace, DVC cache (none extra with the project's links; twice with copies), remote, patch
    store, and DVC's hours on the features at the cost model's measured rates."""
    model = load_costs(costs)
    storage = StorageCosts(hash_bytes_per_second=250e6, add_bytes_per_second={"links": 200e6, "copy": 100e6},
                           checkout_bytes_per_second={"links": 2e9, "copy": 150e6},
                           push_bytes_per_second={"links": 125e6, "copy": 250e6},
                           source="test storage")
    save_costs(dataclasses.replace(model, storage=storage), costs)
    plan = build_plan(load_params("params.yaml"), tmp_path / "data", preset="paper", costs_path=costs)
    disk = plan["disk"]
    features = sum(row["bytes"] for row in plan["features"])
    assert disk["features_bytes"] == features > 3e12
    assert disk["raw"]["sections"] == 25 and 0 < disk["raw"]["known_sections"] <= 25
    assert disk["workspace_bytes"] == features + disk["raw"]["bytes"] == disk["remote_bytes"]
    assert disk["links"] and disk["cache_type"] == "hardlink,symlink"  # the project's .dvc/config
    assert disk["cache_extra_bytes"] == {"links": 0, "copy": disk["workspace_bytes"]}
    assert disk["patch_store_bytes"] == plan["patch_cache_bytes"] > 0
    assert disk["seconds"]["hash"] == pytest.approx(features / 250e6)
    assert disk["seconds"]["add"]["copy"] == pytest.approx(2 * disk["seconds"]["add"]["links"])
    text = plan_text(load_params("params.yaml"), tmp_path / "data", preset="paper", costs_path=costs)
    assert "DVC cache" in text and "no extra bytes: outputs are links into it" in text
    assert f"with cache.type copy {disk['workspace_bytes'] / 1e12:,.1f} TB more, every output twice" in text
    assert "hash every byte" in text and f"{features / 250e6 / 3600:,.1f} h at 250 MB/s" in text
    assert "source: test storage" in text
    save_costs(model, costs)
    assert "DVC's time on the features: not measured" in plan_text(
        load_params("params.yaml"), tmp_path / "data", preset="paper", costs_path=costs)


def test_placement_is_the_paper_at_its_headline_condition_and_its_dvc_line_makes_it(at_root, tmp_path):
    """The placement configuration keeps the paper's panel, seeds, folds, gates and no cap, for the
    listed encoders and the default anchors (after them, once) at 20×, Nuc, Tfine (probe and
    robustness); its `-S` arguments applied to params.yaml give exactly that configuration."""
    from cellpath.planning.paper import overrides, placement_params

    params = load_params("params.yaml")
    placement = placement_params(params, ["uni2"])
    paper = paper_params(params)
    assert placement.extract.encoders == ["uni2", "kaiko-vit-s-16", "phikon"]
    assert placement_params(params, ["phikon", "uni2"], ["kaiko-vit-s-16", "phikon"]).extract.encoders == [
        "phikon", "uni2", "kaiko-vit-s-16"]
    assert placement_params(params, ["uni2"], []).extract.encoders == ["uni2"]
    assert placement.extract.magnifications == ["20x"]
    assert placement.probe.readouts == ["Nuc"] and placement.probe.taxonomies == ["fine"]
    assert placement.robustness.readouts == ["Nuc"] and placement.robustness.taxonomies == ["fine"]
    for same in ("panel", "source", "protocol"):
        assert getattr(placement, same) == getattr(paper, same)
    assert placement.probe.seeds == paper.probe.seeds and placement.probe.max_train_cells is None
    assert placement.probe.min_train_cells == paper.probe.min_train_cells

    data = params.model_dump(mode="json")
    for argument in overrides(params, placement):  # as `dvc exp run -S key=value` sets them
        key, value = argument.split("=", 1)
        *path, leaf = key.split(".")
        target = data
        for name in path:
            target = target[name]
        target[leaf] = yaml.safe_load(value)
    assert parse_params(data) == placement
    assert overrides(placement, placement) == []


def test_cli_placement_prices_one_model_as_a_fraction_of_its_paper_share(at_root, tmp_path, costs, capsys):
    """`cellpath plan --preset placement --models uni2`: the same cost model prices the placement and
    uni2's share of the paper's configuration; the placement is a small fraction of it (one of 3
    magnifications, 1 of 7 readouts, 1 of 2 taxonomies), and the line that runs it is printed. With
    the default anchors, they are priced and run too (on both sides)."""
    plan = json.loads(plan_text(load_params("params.yaml"), tmp_path, preset="placement", models=["uni2"],
                                costs_path=costs, as_json=True, anchors=[]))
    share = plan["placement"]
    assert share["models"] == ["uni2"] and plan["probe"]["total"]["runs"] == sum(
        row["runs"] for row in plan["probe"]["protocols"].values())
    paper = json.loads(plan_text(load_params("params.yaml"), tmp_path, preset="paper", models=["uni2"],
                                 costs_path=costs, as_json=True))
    anchored = json.loads(plan_text(load_params("params.yaml"), tmp_path, preset="placement", models=["uni2"],
                                    costs_path=costs, as_json=True))
    assert anchored["placement"]["models"] == ["uni2", "kaiko-vit-s-16", "phikon"]
    assert anchored["probe"]["total"]["runs"] == 3 * plan["probe"]["total"]["runs"]
    paper_cpu = sum(e["core_seconds"] for e in paper["estimates"] if e["device"] == "cpu") / 3600
    assert share["paper"]["cpu_total"] == pytest.approx(paper_cpu)
    assert 0 < share["cpu_fraction"] < 0.25
    # one magnification of three: a third of the paper's patches; one readout and taxonomy: 1/14 of the runs
    assert plan["features"][0]["magnification"] == "20x" and len(plan["features"]) == 1
    assert plan["probe"]["total"]["runs"] * 14 * 3 == paper["probe"]["total"]["runs"]
    assert main(["plan", "--preset", "placement", "--models", "uni2", "--anchors", "--costs", str(costs),
                 "--data-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "placement of uni2: the paper's configuration at its headline condition" in text
    assert f"({100 * share['cpu_fraction']:.1f} %)" in text
    assert "to run it: dvc exp run -S source=10x" in text and "-S 'probe.readouts=[Nuc]'" in text
