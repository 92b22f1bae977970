"""benchmarks/README.md is the table benchmarks/results_table.py makes of benchmarks/results/*.json, and
every measurement there says when (date), on what code (commit) and where (machine) it was taken."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from helpers.benchmark_scripts import load_benchmark_script
from helpers.project import PROJECT_ROOT

BENCHMARKS = PROJECT_ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"[0-9a-f]{7,40}")


@pytest.fixture(scope="module")
def results_table():
    return load_benchmark_script("results_table")


def _json_files() -> list:
    return sorted(RESULTS.glob("*.json"))


def test_the_committed_table_is_what_the_script_makes_of_the_jsons(results_table):
    generated = results_table.render(results_table.load_results(RESULTS))
    committed = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    assert committed == generated, "benchmarks/README.md is stale: run python benchmarks/results_table.py"
    assert results_table.main(["--check"]) == 0


def test_a_changed_number_changes_the_table(results_table, tmp_path):
    for path in _json_files():
        shutil.copy(path, tmp_path / path.name)
    probe = json.loads((tmp_path / "probe.json").read_text(encoding="utf-8"))
    before = results_table.render(results_table.load_results(tmp_path))
    speedup = probe["speed"]["paper_uncapped"]["speedup_vs_sklearn_loop"]
    spread = f"({speedup['min']:.3f}–{speedup['max']:.3f})"
    assert f"{speedup['median']:.3f}× {spread}" in before
    speedup["median"] = round(speedup["median"] + 0.011, 3)
    (tmp_path / "probe.json").write_text(json.dumps(probe), encoding="utf-8")
    after = results_table.render(results_table.load_results(tmp_path))
    assert after != before and f"{speedup['median']:.3f}× {spread}" in after


def test_a_json_without_a_row_builder_is_an_error(results_table, tmp_path):
    (tmp_path / "new.json").write_text(json.dumps({"benchmark": "new", "date": "2026-12-05", "commit": "abcdef0",
                                                   "machine": "x"}), encoding="utf-8")
    with pytest.raises(SystemExit, match="no row builder"):
        results_table.render(results_table.load_results(tmp_path))


@pytest.mark.parametrize("path", _json_files(), ids=lambda p: p.name)
def test_every_measurement_has_its_date_commit_and_machine(results_table, path):
    data = json.loads(path.read_text(encoding="utf-8"))
    records = results_table.records(data)
    assert records, f"{path.name}: no measurements"
    for record in records:
        where = f"{path.name} {record.get('id', '')}".strip()
        assert DATE.fullmatch(str(record.get("date", ""))), f"{where}: date as YYYY-MM-DD"
        assert COMMIT.fullmatch(str(record.get("commit", ""))), f"{where}: the commit's short hash"
        machine = record.get("machine")
        described = machine.get("description") if isinstance(machine, dict) else machine
        assert isinstance(described, str) and described.strip(), f"{where}: the machine, in words"


def test_there_are_the_benchmarks_the_docs_point_to():
    names = {path.stem for path in _json_files()}
    assert {"pipeline", "probe", "robustness", "scale", "extract", "executor"} <= names
