"""The expression ridge benchmark on a tiny size: both sides agree, and its row renders."""

from __future__ import annotations

import json
import sys

from helpers.benchmark_scripts import BENCHMARKS, load_benchmark_script


def test_a_tiny_run_agrees_with_sklearn_and_streams_beyond_its_limit(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its imports of provenance and blas_conditions, as when run
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):  # else it restarts the interpreter without them
        monkeypatch.delenv(name, raising=False)
    bench = load_benchmark_script("bench_expression")
    out = tmp_path / "expression.json"
    monkeypatch.setattr(sys, "argv", ["bench_expression.py", "--rows", "3000", "6000", "--widths", "48",
                                      "--sklearn-max-rows", "3000", "--repeats", "1", "--out", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    compared, streamed = report["runs"]
    assert compared["sklearn_run"] and compared["chosen_penalties_equal"]
    assert compared["coefficients_max_relative_difference"] < 1e-6
    assert not streamed["sklearn_run"] and streamed["streamed"] and streamed["ours_rows_per_second"]["median"] > 0
    assert report["blas"]["libraries"] and report["commit"] is not None
    table = load_benchmark_script("results_table")
    row = table.BUILDERS["expression"](report)[0]
    assert ") at 3,000 × 48" in row.headline and "chosen penalties equal: yes" in row.headline
