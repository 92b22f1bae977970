"""The cost model: its formulas (golden values), the mode it assumes against the probe's own choice,
the stored model's agreement with the benchmark it was measured by, and its file's errors."""

from __future__ import annotations

import json

import pytest

from cellpath.errors import ConfigError
from cellpath.runtime.costs import (COSTS_PATH, CostModel, DeviceCosts, ExtractCosts, Iterations, ProbeCosts,
                                    RobustnessCosts, SectionCosts, extract_patches, extract_seconds, feature_bytes,
                                    fit_section_costs, load_costs, parameter_count, patch_gflop, pilot_iterations,
                                    probe_fit_seconds, probe_heap_bytes, robustness_heap_bytes, robustness_seconds,
                                    save_costs, section_heap_bytes, section_seconds, workers_needed)
from helpers.project import PROJECT_ROOT

PROBE = ProbeCosts(seconds_per_iteration={"in_memory": 1e-9, "streamed": 3e-9},
                   seconds_per_pass={"in_memory": 2e-9, "streamed": 5e-9},
                   iterations=Iterations((1_000.0,), (300.0,), (200.0,), (400.0,), "test"), heap_base_bytes=5e8,
                   heap_bytes_per_cell=700, source="test")
ROBUSTNESS = RobustnessCosts(seconds_per_pair_full=1e-10, seconds_per_pair_anchor=2e-10, heap_base_bytes=1e8,
                             heap_bytes_per_query_feature=8, heap_bytes_per_cell=100, cores=2, source="test")


def test_probe_fit_seconds_golden():
    # in memory: 1,281 columns × (1,000 rows × 30 iterations × 1 ns + 1,500 rows read × 2 ns)
    row_bytes = 4 * 1_281 + 48 * 27  # the float32 design row and 3 Cs × 9 classes of float64 fit state
    seconds = probe_fit_seconds(PROBE, n_train=1_000, n_val=200, n_test=300, width=1_280, row_bytes=row_bytes,
                                iterations=30, budget_mb=512)
    assert seconds == pytest.approx(1_281 * (1_000 * 30 * 1e-9 + 1_500 * 2e-9))
    # 10M training rows cannot fit 512 MB: the streamed costs apply
    seconds = probe_fit_seconds(PROBE, n_train=10_000_000, n_val=0, n_test=0, width=1_280, row_bytes=row_bytes,
                                iterations=1, budget_mb=512)
    assert seconds == pytest.approx(1_281 * 10_000_000 * (3e-9 + 5e-9))


def test_probe_heap_holds_a_streamed_fits_state_for_every_row_and_one_chunk_of_its_design():
    row_bytes, state = 4 * 1_281 + 48 * 27, 48 * 27
    chunk_rows = 512 * 1024**2 // row_bytes  # 83,623 rows
    assert probe_heap_bytes(PROBE, 1_000_000, 512, n_train=10_000_000, row_bytes=row_bytes, state_bytes=state) \
        == pytest.approx(5e8 + 7e8 + chunk_rows * 4 * 1_281 + 10_000_000 * 1_296)
    # in memory (a smaller task): the whole design and state, for as many tasks of its size as a group
    # stacks within the budget (83 of 1,000 rows; 3 when only 3 are fitted)
    assert probe_heap_bytes(PROBE, 1_000_000, 512, n_train=1_000, row_bytes=row_bytes, state_bytes=state) \
        == pytest.approx(5e8 + 7e8 + 1_000 * 6_420)
    assert probe_heap_bytes(PROBE, 0, 512, n_train=1_000, row_bytes=row_bytes, state_bytes=state, tasks=500) \
        == pytest.approx(5e8 + 83 * 1_000 * 6_420)
    assert probe_heap_bytes(PROBE, 0, 512, n_train=1_000, row_bytes=row_bytes, state_bytes=state, tasks=3) \
        == pytest.approx(5e8 + 3 * 1_000 * 6_420)
    # grouped within 1,024 MiB ("auto" on any machine: 167 tasks, 1.07 GB of designs) but held within
    # 512 MiB: the group is streamed, its 167 tasks' fit state held for every row
    assert probe_heap_bytes(PROBE, 0, 512, n_train=1_000, row_bytes=row_bytes, state_bytes=state, tasks=500,
                            group_mb=1024) == pytest.approx(5e8 + chunk_rows * 4 * 1_281 + 167 * 1_000 * 1_296)


def test_robustness_is_quadratic_to_the_threshold_then_anchors_times_n():
    assert robustness_seconds(ROBUSTNESS, 50_000, 1_280, full_max_cells=100_000, anchors=20_000) == \
        pytest.approx(1e-10 * 50_000**2 * 1_280)
    assert robustness_seconds(ROBUSTNESS, 7_000_000, 1_280, full_max_cells=100_000, anchors=20_000) == \
        pytest.approx(2e-10 * 20_000 * 7_000_000 * 1_280)


def test_robustness_heap_holds_the_queries_not_the_unit_matrix():
    # scored in full, every cell is a query; above the threshold only the anchors are
    assert robustness_heap_bytes(ROBUSTNESS, 50_000, 1_280, full_max_cells=100_000, anchors=20_000) == \
        pytest.approx(1e8 + 8 * 50_000 * 1_280 + 100 * 50_000)
    assert robustness_heap_bytes(ROBUSTNESS, 7_000_000, 1_280, full_max_cells=100_000, anchors=20_000) == \
        pytest.approx(1e8 + 8 * 20_000 * 1_280 + 100 * 7_000_000)


@pytest.mark.parametrize("text, count", [("632M", 6.32e8), ("1.1B", 1.1e9), ("22M", 2.2e7), ("5.7M", 5.7e6),
                                         ("0", 0.0), ("86k", 8.6e4), ("unknown", None), ("", None)])
def test_parameter_counts_of_the_registry(text, count):
    assert parameter_count(text) == count


def test_patch_gflop_and_patches_and_bytes_golden():
    assert patch_gflop(22e6, 224, 16, 1) == pytest.approx(2 * 22e6 * 197 / 1e9)  # ViT-S/16: 196 + CLS tokens
    assert patch_gflop(632e6, 224, 14, 5) == pytest.approx(2 * 632e6 * 261 / 1e9)  # ViT-H/14 with 4 registers
    costs = ExtractCosts(seconds_per_gflop=0.01, patches_per_cell_224={"20x": 0.015}, cores=2, source="test")
    assert extract_patches(costs, 1_000_000, "20x", 224) == pytest.approx(15_000)
    assert extract_patches(costs, 1_000_000, "20x", 448) == pytest.approx(3_750)  # four times the patch area
    assert feature_bytes(7_000_000, 1_280, 3) == 7_000_000 * 1_280 * 3 * 2


def test_extract_seconds_per_precision_with_a_read_floor_golden():
    cpu = ExtractCosts(seconds_per_gflop=0.01, patches_per_cell_224={"20x": 0.015}, cores=2, source="test")
    assert extract_seconds(cpu, 1_000, 8.0, "bf16", 448) == pytest.approx(1_000 * 8.0 * 0.01)  # one rate, no floor
    gpu = ExtractCosts(seconds_per_gflop=1e-4, patches_per_cell_224={"20x": 0.015}, cores=1, source="test",
                       seconds_per_gflop_by_precision={"fp32": 1e-4, "bf16": 1e-5}, seconds_per_patch_read=5e-4)
    assert extract_seconds(gpu, 1_000, 120.0, "bf16", 224) == pytest.approx(1_000 * 120.0 * 1e-5)  # the forward
    assert extract_seconds(gpu, 1_000, 8.0, "bf16", 224) == pytest.approx(1_000 * 5e-4)  # the read floor
    assert extract_seconds(gpu, 1_000, 8.0, "bf16", 448) == pytest.approx(1_000 * 5e-4 * 4)  # four times the area
    assert extract_seconds(gpu, 1_000, 120.0, "fp16", 224) == pytest.approx(1_000 * 120.0 * 1e-4)  # not listed


def test_optional_extract_fields_are_written_only_when_set(tmp_path):
    cpu = ExtractCosts(seconds_per_gflop=0.01, patches_per_cell_224={"20x": 0.015}, cores=2, source="test")
    gpu = ExtractCosts(seconds_per_gflop=1e-4, patches_per_cell_224={"20x": 0.015}, cores=1, source="test",
                       seconds_per_gflop_by_precision={"bf16": 1e-5}, seconds_per_patch_read=5e-4)
    model = CostModel(machine={}, devices={"cpu": DeviceCosts(extract=cpu), "cuda": DeviceCosts(extract=gpu)})
    path = tmp_path / "costs.json"
    save_costs(model, path)
    written = json.loads(path.read_text())["devices"]
    assert set(written["cpu"]["extract"]) == {"seconds_per_gflop", "patches_per_cell_224", "cores", "source"}
    assert written["cuda"]["extract"]["seconds_per_patch_read"] == 5e-4 and written["cpu"]["probe"] is None
    assert load_costs(path) == model


def test_workers_for_a_deadline():
    week = 7 * 86400
    assert workers_needed(0, 8, week) == 0
    assert workers_needed(8 * week, 8, week) == 1
    assert workers_needed(8 * week + 1, 8, week) == 2


def test_section_lines_are_least_squares_and_a_falling_cost_is_refused():
    """Three sections on the line 5 s + 1 ms per cell (peak 1 GB + 2 kB per cell) give it back; the
    estimate at 283,171 cells is read off it; a cost that falls with more cells is refused."""
    costs = fit_section_costs([10_000, 20_000, 40_000], [15.0, 25.0, 45.0], [1.02e9, 1.04e9, 1.08e9], cores=1,
                              source="test")
    assert costs.seconds_base == pytest.approx(5.0) and costs.seconds_per_cell == pytest.approx(1e-3)
    assert costs.heap_base_bytes == pytest.approx(1e9) and costs.heap_bytes_per_cell == pytest.approx(2e3)
    assert costs.cells == (10_000, 20_000, 40_000)
    assert section_seconds(costs, 283_171) == pytest.approx(5.0 + 283.171)
    assert section_heap_bytes(costs, 283_171) == pytest.approx(1e9 + 2e3 * 283_171)
    with pytest.raises(ConfigError, match="two sizes at least"):
        fit_section_costs([10_000, 10_000], [1.0, 2.0], [1.0, 2.0], cores=1, source="test")
    with pytest.raises(ConfigError, match="does not fall with more cells"):
        fit_section_costs([10_000, 40_000], [20.0, 10.0], [1e9, 2e9], cores=1, source="test")


def test_a_saved_model_loads_back_and_a_broken_one_names_its_file(tmp_path):
    sections = {"ingest": SectionCosts(1.0, 1e-4, 1e9, 1e4, (10_000, 40_000), 1, "test")}
    model = CostModel(machine={"cpus": 2}, devices={"cpu": DeviceCosts(probe=PROBE, robustness=ROBUSTNESS,
                                                                       sections=sections)})
    path = tmp_path / "costs.json"
    save_costs(model, path)
    assert load_costs(path) == model
    path.write_text(json.dumps({"machine": {}, "devices": {"cpu": {"probe": {"seconds_per_pass": 1}}}}))
    with pytest.raises(ConfigError, match="costs.json.*bench_scale.py --calibrate"):
        load_costs(path)


def test_the_stored_model_agrees_with_the_benchmark_it_was_measured_by():
    """The cost model stored with the code reproduces the estimates bench_scale wrote beside its
    measurements, and every estimate is within 2× of the measured run."""
    from helpers.benchmark_scripts import load_benchmark_script

    bench = load_benchmark_script("bench_scale")
    results = json.loads((PROJECT_ROOT / "benchmarks" / "results" / "scale.json").read_text())
    model = load_costs(COSTS_PATH)
    assert {"probe", "robustness"} <= {part for part in ("probe", "robustness", "extract")
                                       if getattr(model.costs("cpu"), part) is not None}
    again = bench.estimate(results, model)
    assert len(again["rows"]) == len(results["estimates"]["rows"])
    for ours, stored in zip(again["rows"], results["estimates"]["rows"]):
        assert ours.keys() == stored.keys()
        for key, value in ours.items():
            assert value == (stored[key] if value is None or isinstance(value, str) else pytest.approx(stored[key]))
    sizes = {(row["stage"], row["n_cells"]) for row in again["rows"]}
    assert {("probe", 100_000), ("probe", 1_000_000), ("probe", 7_000_000), ("robustness", 100_000),
            ("robustness", 1_000_000)} <= sizes
    for row in again["rows"]:
        for key in ("ratio_s", "ratio_heap"):
            assert row[key] is None or 0.5 <= row[key] <= 2.0, row


def test_iterations_interpolate_in_log_training_size_and_hold_beyond_the_ends():
    table = Iterations((5_000.0, 20_000.0, 100_000.0), (80.0, 130.0, 150.0), (60.0, 100.0, 120.0),
                       (90.0, 160.0, 200.0), "test")
    assert table.at(1_000) == (80.0, 60.0, 90.0) and table.at(5_000) == (80.0, 60.0, 90.0)
    assert table.at(10_000) == pytest.approx((105.0, 80.0, 125.0))  # halfway from 5,000 to 20,000 in log n
    assert table.at(20_000) == pytest.approx((130.0, 100.0, 160.0))
    assert table.at(4_000_000) == (150.0, 120.0, 200.0)
    assert "median 80 at 5,000, 130 at 20,000, 150 at 100,000" in table.describe()


def test_pilot_iterations_are_the_quartiles_of_its_converged_runs():
    table = pilot_iterations([1_000, 3_000, 9_000, 9_000, 12_000], [40, 50, 60, 70, 200], "runs.parquet")
    assert table.at(10) == table.at(10**7) == (60.0, 50.0, 70.0)
    assert table.n_train == (9_000.0,) and "5 converged runs on real features, n_train 1,000–12,000" in table.source
    with pytest.raises(ConfigError, match="runs.parquet: no fitted, converged probe run"):
        pilot_iterations([], [], "runs.parquet")
