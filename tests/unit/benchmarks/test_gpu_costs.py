"""From the GPU run's JSON to the plan: benchmarks/gpu/merge_costs.py writes devices.cuda of a cost
model (leaving the cpu entry as it was), and `cellpath plan --preset paper` prices every stage on cuda
from it: GPU-hours per stage and the days on one 8-GPU node, checked against the formulas worked
out here from the synthetic figures."""

from __future__ import annotations

import copy
import json

import pytest

from cellpath.commands.plan import run as plan_text
from cellpath.config import load_params
from cellpath.features.encoders.registry import load_registry
from cellpath.planning.build import build_plan
from cellpath.planning.paper import paper_params
from cellpath.planning.workload import expression_workload, panel_summary, probe_workload, robustness_workload
from cellpath.probing.fit import probe_budget_mb
from cellpath.runtime.costs import (CostModel, DeviceCosts, ExtractCosts, Iterations, ProbeCosts, RobustnessCosts,
                                    parameter_count, save_costs)
from cellpath.runtime.planning import this_machine
from helpers.benchmark_scripts import load_benchmark_file
from helpers.project import PROJECT_ROOT

READ_PER_S = 1_500.0  # part (b)'s best read rate: a floor of 1/1,500 s per 224-px patch
FORWARD = {"Kaiko ViT-S/16": ("fp32", 8.274, 2_000.0, 2_000.0), "UNI": ("bf16", 119.776, 1_000.0, 200.0),
           "H-Optimus-0": ("fp16", 574.2, 250.0, 40.0)}  # precision, GFLOP per patch, autocast and fp32 img/s
PROBE = {"seconds_per_iteration": {"in_memory": 2e-11, "streamed": 5e-11},
         "seconds_per_pass": {"in_memory": 1e-10, "streamed": 3e-10}, "source": "synthetic probe part",
         "equality": {"tasks": 3, "chosen_c_equal": True, "max_macro_f1_difference_points": 0.0, "agrees": True}}
PAIR_FULL, PAIR_ANCHOR = 1e-13, 2e-13
RIDGE_ROW, RIDGE_CUBE = 1e-12, 5e-12  # the expression part's timings follow n · w² · a + w³ · b exactly


@pytest.fixture
def merge():
    return load_benchmark_file("gpu/merge_costs.py", "gpu_merge_costs")


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)


@pytest.fixture
def costs(tmp_path):
    """A CPU-only cost model with round numbers (a test file, not the measured one)."""
    model = CostModel(machine={"cpus": 2, "memory_gb": 24}, devices={"cpu": DeviceCosts(
        probe=ProbeCosts(seconds_per_iteration={"in_memory": 1e-9, "streamed": 2e-9},
                         seconds_per_pass={"in_memory": 1e-9, "streamed": 2e-9},
                         iterations=Iterations((1_000.0,), (100.0,), (50.0,), (200.0,), "test"), heap_base_bytes=5e8,
                         heap_bytes_per_cell=1000, source="test probe"),
        robustness=RobustnessCosts(seconds_per_pair_full=1e-10, seconds_per_pair_anchor=1e-10, heap_base_bytes=0,
                                   heap_bytes_per_query_feature=8, heap_bytes_per_cell=100, cores=2,
                                   source="test robustness"),
        extract=ExtractCosts(seconds_per_gflop=0.01, patches_per_cell_224={"40x": 0.06, "20x": 0.015, "10x": 0.00375},
                             cores=2, source="test extract"))})
    path = tmp_path / "costs.json"
    save_costs(model, path)
    return path


def _record() -> dict:
    """What benchmarks/gpu/run.sh writes on a GPU, with round synthetic figures."""
    models = [{"label": label, "name": name, "precision": p, "gflop_per_patch": g, "depth": None,
               "autocast": {"img_per_s": a}, "fp32": {"img_per_s": f}}
              for label, (name, (p, g, a, f)) in zip(("ViT-S", "ViT-L", "ViT-g"), FORWARD.items())]
    robustness = {"k": 91, "m": 5, "tolerance": 1e-4, "compare": {"agrees": True, "against_numpy": {}},
                  "full": {"cells": 100_000, "queries": 100_000, "width": 1_280, "seconds_per_pair_feature": PAIR_FULL},
                  "anchors": {"cells": 1_000_000, "queries": 20_000, "width": 1_280,
                              "seconds_per_pair_feature": PAIR_ANCHOR}}
    return {"date": "2026-12-05", "commit": "abc1234", "device": "cuda", "device_name": "NVIDIA H200",
            "preset": "device",
            "parts": {"encoders": {"status": "ok", "result": {"models": models}},
                      "extraction": {"status": "ok", "result": {"input_size": 224}},
                      "probe": {"status": "ok", "result": copy.deepcopy(PROBE)},
                      "robustness": {"status": "ok", "result": robustness},
                      "expression": {"status": "ok", "result": {
                          "equality": {"agrees": True}, "source": "one design's ridge",
                          "timings": [{"rows": n, "width": w, "seconds": n * w**2 * RIDGE_ROW + w**3 * RIDGE_CUBE}
                                      for n, w in ((100_000, 1_280), (100_000, 2_560), (400_000, 1_280))]}}},
            "extraction_summary": {"read_patches_per_s": READ_PER_S, "read_workers": 14,
                                   "delivered_patches_per_s": 900.0, "forward_alone_patches_per_s": 1_000.0}}


def _write(tmp_path, record: dict, name: str = "gpu.json"):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def test_the_merge_writes_cuda_and_leaves_the_cpu_entry_as_it_was(merge, costs, tmp_path):
    before = costs.read_text()
    notes = merge.merge(_write(tmp_path, _record()), costs)
    assert notes == ["probe: from part probe", "robustness: from part robustness", "extract: from part encoders",
                     "expression: from part expression"]
    after = json.loads(costs.read_text())
    cuda = after["devices"].pop("cuda")
    assert json.dumps(after, indent=2) + "\n" == before  # byte for byte
    extract = cuda["extract"]
    slowest_fp32 = max(1 / (fp32 * gflop) for _, gflop, _, fp32 in FORWARD.values())
    assert extract["seconds_per_gflop_by_precision"] == pytest.approx(
        {"fp32": slowest_fp32, "bf16": 1 / (1_000 * 119.776), "fp16": 1 / (250 * 574.2)}, rel=1e-12)
    assert slowest_fp32 == pytest.approx(1 / (2_000 * 8.274))  # the ViT-S is the slowest in fp32 here
    assert extract["seconds_per_gflop"] == extract["seconds_per_gflop_by_precision"]["fp32"]
    assert extract["seconds_per_patch_read"] == pytest.approx(1 / READ_PER_S)
    assert extract["cores"] == 1 and extract["patches_per_cell_224"]["20x"] == 0.015
    assert cuda["probe"]["seconds_per_iteration"] == PROBE["seconds_per_iteration"]
    assert cuda["probe"]["iterations"]["median"] == [100.0] and "the cpu entry" in cuda["probe"]["source"]
    assert cuda["robustness"]["seconds_per_pair_full"] == PAIR_FULL and cuda["robustness"]["cores"] == 1
    assert cuda["expression"]["seconds_per_row_width2"] == pytest.approx(RIDGE_ROW, rel=1e-9)
    assert cuda["expression"]["seconds_per_width3"] == pytest.approx(RIDGE_CUBE, rel=1e-9)
    assert cuda["expression"]["cores"] == 1
    for part in cuda.values():
        assert part["source"].startswith("gpu.json (2026-12-05, abc1234, NVIDIA H200)")


def test_a_part_that_failed_keeps_what_the_file_has_and_bad_runs_are_refused(merge, costs, tmp_path):
    merge.merge(_write(tmp_path, _record()), costs)
    first = json.loads(costs.read_text())["devices"]["cuda"]
    later = _record()
    later["parts"]["probe"] = {"status": "error", "error": "RuntimeError: CUDA error: out of memory"}
    later["parts"]["encoders"]["result"]["models"][1]["autocast"]["img_per_s"] = 500.0
    notes = merge.merge(_write(tmp_path, later, "later.json"), costs)
    assert "probe: part probe error; kept the file's" in notes
    second = json.loads(costs.read_text())["devices"]["cuda"]
    assert second["probe"] == first["probe"] and second["extract"]["source"].startswith("later.json")
    assert second["extract"]["seconds_per_gflop_by_precision"]["bf16"] == pytest.approx(1 / (500 * 119.776))
    refusals = {"a dry run": lambda r: r.update(preset="tiny"),
                "not a CUDA device": lambda r: r.update(device="cpu"),
                "differs from the CPU": lambda r: r["parts"]["robustness"]["result"]["compare"].update(agrees=False),
                "fits on the device differ": lambda r: r["parts"]["probe"]["result"]["equality"].update(agrees=False),
                "no seconds_per_pass for streamed": lambda r: r["parts"]["probe"]["result"]["seconds_per_pass"].pop(
                    "streamed")}
    for message, change in refusals.items():
        record = _record()
        change(record)
        with pytest.raises(merge.MergeError, match=message):
            merge.merge(_write(tmp_path, record, "bad.json"), costs)
    assert json.loads(costs.read_text())["devices"]["cuda"] == second  # a refused merge writes nothing
    assert merge.main([str(_write(tmp_path, record, "bad.json")), "--costs", str(costs)]) == 1


def _expected_seconds(tmp_path) -> dict[str, float]:
    """Seconds on one GPU per stage, worked out from the synthetic figures and the paper's workload."""
    params = paper_params(load_params("params.yaml"))
    specs = [s for s in load_registry("models/encoders.yaml").values() if s.type != "control"]
    panel = panel_summary(params, tmp_path, "paper", None)
    per_gflop = {"fp32": 1 / (2_000 * 8.274), "bf16": 1 / (1_000 * 119.776), "fp16": 1 / (250 * 574.2)}
    plan = build_plan(load_params("params.yaml"), tmp_path, preset="paper", costs_path=tmp_path / "costs.json")
    extract, bound = 0.0, set()
    for spec in specs:
        patches = sum(r["patches"] for r in plan["features"] if r["encoder"] == spec.slug)
        gflop = 2 * parameter_count(spec.params) * ((spec.input_size // spec.patch_size) ** 2
                                                     + spec.num_prefix_tokens) / 1e9
        compute, read = gflop * per_gflop[spec.precision], (spec.input_size / 224) ** 2 / READ_PER_S
        bound.add("read" if read > compute else "compute")
        extract += patches * max(compute, read)
    assert bound == {"read", "compute"}  # both sides of the floor are exercised
    probe = 0.0
    budget_mb = probe_budget_mb(params.probe.batch_memory_mb, this_machine()["memory_bytes"])  # the plan's worker
    for row in probe_workload(params, specs, params.stage_magnifications(params.probe.magnifications), panel, None):
        mode = "in_memory" if row["n_train"] <= int(budget_mb * 1024**2) // row["row_bytes"] else "streamed"
        iterations = 100  # the cpu entry's iterations of a run's slowest C: its Cs iterate together
        probe += row["runs"] * (row["width"] + 1) * (
            row["n_train"] * iterations * PROBE["seconds_per_iteration"][mode]
            + (row["n_train"] + row["n_val"] + row["n_test"]) * PROBE["seconds_per_pass"][mode])
    robustness = 0.0
    for row in robustness_workload(params, specs, panel):
        n, width = row["n_cells"], row["width"]
        robustness += row["scorings"] * (n * n * width * PAIR_FULL if n <= params.robustness.full_max_cells
                                         else min(params.robustness.anchors, n) * n * width * PAIR_ANCHOR)
    expression = sum(row["fits"] * (row["n_rows"] * row["width"] ** 2 * RIDGE_ROW + row["width"] ** 3 * RIDGE_CUBE)
                     for row in expression_workload(params, specs, panel, None))
    return {"extract": extract, "probe": probe, "robustness": robustness, "expression": expression}


def test_the_paper_plan_prints_gpu_hours_and_the_days_on_one_8_gpu_node(merge, costs, tmp_path, at_root):
    merge.merge(_write(tmp_path, _record()), costs)
    expected = _expected_seconds(tmp_path)
    plan = build_plan(load_params("params.yaml"), tmp_path, preset="paper", costs_path=costs)
    assert {stage: plan["not_estimated"][stage] for stage in ("extract", "probe", "robustness")} == {
        "extract": [], "probe": [], "robustness": []}
    assert plan["not_estimated"]["expression"] == ["cpu"]  # the test's CPU costs have none
    for stage, seconds in expected.items():
        cuda = [e for e in plan["estimates"] if e["stage"] == stage and e["device"] == "cuda"]
        assert sum(e["seconds"] for e in cuda) == pytest.approx(seconds, rel=1e-9), stage
    node = plan["gpu_node"]
    assert node["node_gpus"] == 8 and node["not_measured"] == []
    assert {row["stage"]: row["gpu_hours"] for row in node["stages"]} == pytest.approx(
        {stage: seconds / 3600 for stage, seconds in expected.items()}, rel=1e-9)
    total_hours = sum(expected.values()) / 3600
    assert node["gpu_hours"] == pytest.approx(total_hours, rel=1e-9)
    assert node["days"] == pytest.approx(total_hours / 8 / 24, rel=1e-9)
    text = plan_text(load_params("params.yaml"), tmp_path, preset="paper", costs_path=costs)
    assert "on one 8-GPU node (cuda; ideal packing, so a lower bound):" in text
    assert f"{total_hours:,.1f} GPU-hours   → {total_hours / 8 / 24:>8,.2f} days" in text
    probe_line = next(line for line in text.splitlines() if line.startswith("probe") and "cuda" in line)
    assert f"{expected['probe'] / 3600:,.1f}" in probe_line  # the GPU-hours column of the cost table
    assert "  source: gpu.json (2026-12-05, abc1234, NVIDIA H200): torch exact search" in text
    assert ("not measured, so not estimated: ingest (cpu); annotate (cpu); concordance (cpu); expression (cpu)\n"
            in text)  # the test's CPU costs price no per-section or expression stage
    four = plan_text(load_params("params.yaml"), tmp_path, preset="paper", costs_path=costs, node_gpus=4)
    assert "on one 4-GPU node" in four and f"{total_hours / 4 / 24:>8,.2f} days" in four
