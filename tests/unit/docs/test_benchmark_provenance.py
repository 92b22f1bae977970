"""benchmarks/provenance.py: what every benchmark script stamps on its results JSON (the date, the
commit and the machine), in the shapes benchmarks/results_table.py and its test read."""

from __future__ import annotations

import datetime
import json
import re
import subprocess

import pytest

from helpers.benchmark_scripts import load_benchmark_script
from helpers.project import PROJECT_ROOT

BENCHMARKS = PROJECT_ROOT / "benchmarks"
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"[0-9a-f]{7,40}")
WRITERS = ("bench_executor.py", "bench_extract.py", "bench_fetch_ingest.py", "bench_probe.py", "bench_robustness.py",
           "bench_scale.py", "bench_slide_read.py", "bench_encoder_gpu.py", "gpu/run.py")


@pytest.fixture(scope="module")
def provenance():
    return load_benchmark_script("provenance")


def test_the_stamp_is_todays_date(provenance):
    stamp = provenance.run_stamp()
    assert DATE.fullmatch(stamp["date"])
    assert stamp["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def test_the_stamp_names_the_commit_checked_out_and_whether_the_tree_is_dirty(provenance, tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    clean = provenance.run_stamp(tmp_path)
    assert clean["commit"] == head and COMMIT.fullmatch(clean["commit"]) and clean["dirty"] is False
    (tmp_path / "a.txt").write_text("2\n")
    assert provenance.run_stamp(tmp_path)["dirty"] is True


def test_without_git_the_commit_is_unknown_unless_the_runner_names_it(provenance, tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # tmp_path is no repository
    assert provenance.git_commit(tmp_path) == (None, None)
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "abc1234")
    assert provenance.git_commit(tmp_path) == ("abc1234", None)


def test_the_machine_is_described_in_words_with_its_blas(provenance):
    blas = [{"user_api": "openmp", "internal_api": "openmp", "version": None, "num_threads": 2},
            {"user_api": "blas", "internal_api": "openblas", "version": "0.3.31", "architecture": "SkylakeX",
             "num_threads": 2}]
    machine = provenance.machine({"cpus": 2, "python": "3.11.7", "load_average_at_end": [1.0, 1.0, 1.0]},
                                 blas={"libraries": blas})
    assert machine["description"].startswith("2 CPUs")
    assert "OpenBLAS 0.3.31 (SkylakeX kernels)" in machine["description"]
    assert machine["cpus"] == 2 and machine["load_average_at_end"] == [1.0, 1.0, 1.0]
    assert "cpu_model" in machine and "memory_gb" in machine
    assert provenance.blas_summary([{"internal_api": "openmp", "version": None}]) is None


def test_the_cpu_model_is_read_from_cpuinfo(provenance, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  7B13 64-Core Processor\n")
    assert provenance.cpu_model(cpuinfo) == "AMD EPYC 7B13 64-Core Processor"


def test_a_stamped_result_keeps_every_field_and_passes_the_readme_checks(provenance):
    result = {"benchmark": "probe", "speed": {"median": 1.07}, "blas": [{"internal_api": "openblas",
                                                                         "version": "0.3.29", "num_threads": 1}],
              "machine": {"cpus": 2, "torch": "2.12.1", "torch_threads": 2}}
    stamp = {"date": "2026-12-05", "commit": "abcdef0", "dirty": True}
    stamped = provenance.with_provenance(json.loads(json.dumps(result)), stamp)
    assert list(stamped)[:3] == ["date", "commit", "dirty"]
    assert stamped["date"] == "2026-12-05" and stamped["commit"] == "abcdef0" and stamped["dirty"] is True
    assert {k: v for k, v in stamped.items() if k not in stamp and k != "machine"} == {
        k: v for k, v in result.items() if k != "machine"}
    assert result["machine"].items() <= stamped["machine"].items()
    assert "torch 2.12.1 on 2 threads" in stamped["machine"]["description"]
    json.dumps(stamped)  # writable as it is
    without_machine = provenance.with_provenance({"benchmark": "encoder_gpu"}, stamp)
    assert without_machine["machine"]["description"].strip()


@pytest.mark.parametrize("script", WRITERS)
def test_every_script_that_writes_a_result_stamps_it(script):
    text = (BENCHMARKS / script).read_text(encoding="utf-8")
    assert "run_stamp()" in text and "with_provenance(" in text, f"{script}: its JSON has no date, commit or machine"
