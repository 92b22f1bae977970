"""The executor layer: every backend gives the same outputs, finished tasks are kept, lost workers are survived.

The stages run on a copy of the tiny panel in which the filterbank's 10× features are also filed as
20× (a stand-in second shard, so that two tasks run in parallel). Every stage runs with one thread
per pool (restored afterwards): results depend on thread counts, and two workers on a small
machine would otherwise oversubscribe it. The stage tests on Dask share one LocalCluster (reached
through ``executor.address``), so its workers import cellpath once; the cluster the executor starts
itself is tested with light tasks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pandas as pd
import pytest
import torch
from threadpoolctl import threadpool_limits

import cellpath.probing.tasks as probe_tasks_module
from cellpath.config import parse_params
from cellpath.errors import ConfigError
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import load_panel_cells
from cellpath.runtime.executor import ExecutorError, Task, oversubscription_guard, run_tasks, thread_settings
from cellpath.probing.tasks import plan_magnification, probe_tasks
from cellpath.stages.probe import run as run_probe_stage
from cellpath.stages.robustness import run as run_robustness_stage
from helpers.executor_tasks import die_once, write_value
from helpers.project import HANG_GUARD_S, PROJECT_ROOT, TINY_SECTIONS

DASK_2 = {"backend": "dask", "workers": 2}


@pytest.fixture(scope="module")
def dask_at():
    """An executor block for a running LocalCluster of two single-threaded worker processes."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        yield {"backend": "dask", "address": cluster.scheduler_address}


@pytest.fixture(scope="module")
def data_dir(tiny_features, tmp_path_factory):
    data = tmp_path_factory.mktemp("executor") / "data"
    for sub in ("sections", "labels", "features"):
        shutil.copytree(tiny_features["data_dir"] / sub, data / sub)
    shutil.copy(tiny_features["data_dir"] / "panels.csv", data)
    shutil.copytree(data / "features" / "filterbank-dense" / "10x", data / "features" / "filterbank-dense" / "20x")
    return data


@pytest.fixture
def one_thread():
    """One thread per pool in this process (and so in every worker); the previous counts afterwards."""
    saved = torch.get_num_threads()
    with threadpool_limits(1):
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(saved)


def _params(base, executor: dict | None = None, **probe):
    data = base.model_dump(mode="json")
    data["extract"].update(encoders=["filterbank-dense"], magnifications=["10x", "20x"])
    data["probe"] = {"seeds": {"is": 1, "iocd": 1, "mocv": 1, "looo": 1}, "mocv_folds": 3, "taxonomies": ["coarse"],
                     "min_train_cells": {"fine": 10, "coarse": 10}, "min_test_cells": {"fine": 5, "coarse": 5},
                     "readouts": ["Nuc", "Mean"], "max_iter": 10, "torch_threads": 1} | probe
    data["robustness"] = {"taxonomies": ["coarse"], "readouts": ["Nuc", "Mean"], "scopes": ["panel"], "group": "tile",
                          "tile_um": 40.0, "shortcut": {"confounder": "section_id", "pool_size": 90, "n_runs": 1,
                                                        "train_levels": ["breast_a", "tonsil_a", "breast_b"]}}
    data["mlflow"] = {"enabled": False}
    data["executor"] = executor or {}
    return parse_params(data)


def _run(params, data_dir, reports, fresh: bool = True, robustness: bool = True) -> dict:
    """The probe (and robustness) stage; ``fresh`` first drops earlier shards, so that every task runs."""
    if fresh:
        shutil.rmtree(data_dir / ".work", ignore_errors=True)
    runs = run_probe_stage(params, data_dir, reports / "reports", root=reports)
    result = {"runs": runs.drop(columns="fit_seconds"),
              "timing": json.loads((reports / "reports" / "probe" / "timing.json").read_text())}
    if robustness:
        result["summary"] = run_robustness_stage(params, data_dir, reports / "reports", root=reports)
        result["margins"] = pd.read_parquet(reports / "reports" / "robustness" / "margins.parquet")
        result["shortcut"] = pd.read_csv(reports / "reports" / "robustness" / "shortcut_summary.csv")
    return result


def _assert_same(a: dict, b: dict) -> None:
    for name in ("runs", "summary", "margins", "shortcut"):
        if name in b:
            pd.testing.assert_frame_equal(a[name], b[name], check_exact=True)


@pytest.fixture(scope="module")
def in_process(tiny_features, data_dir, tmp_path_factory):
    saved = torch.get_num_threads()
    with threadpool_limits(1):
        torch.set_num_threads(1)
        result = _run(_params(tiny_features["params"]), data_dir, tmp_path_factory.mktemp("in_process"))
    torch.set_num_threads(saved)
    return result


def test_in_process_runs_two_probe_shards(in_process):
    assert in_process["timing"]["executor"] == {"backend": "local", "workers": 1, "tasks": 2, "tasks_computed": 2}
    assert set(in_process["runs"]["magnification"]) == {"10x", "20x"}
    assert (in_process["runs"]["status"] == "ok").sum() > 0


def test_finished_tasks_are_not_redone(tiny_features, data_dir, in_process, tmp_path, one_thread):
    params = _params(tiny_features["params"])
    _run(params, data_dir, tmp_path, fresh=False)  # computes only what the in-process run did not leave
    shards = {p: p.stat().st_mtime_ns for p in (data_dir / ".work").rglob("*") if p.is_file()}
    again = _run(params, data_dir, tmp_path, fresh=False)
    assert again["timing"]["executor"]["tasks_computed"] == 0
    assert {p: p.stat().st_mtime_ns for p in (data_dir / ".work").rglob("*") if p.is_file()} == shards
    _assert_same(in_process, again)


def test_two_local_workers_give_identical_results(tiny_features, data_dir, in_process, tmp_path, one_thread):
    result = _run(_params(tiny_features["params"], {"workers": 2}), data_dir, tmp_path)
    assert result["timing"]["executor"]["tasks_computed"] == 2
    _assert_same(in_process, result)


def test_dask_local_cluster_gives_identical_results(tiny_features, data_dir, in_process, dask_at, tmp_path,
                                                    one_thread):
    result = _run(_params(tiny_features["params"], dask_at), data_dir, tmp_path)
    assert result["timing"]["executor"] == {"backend": "dask", "workers": 1, "tasks": 2, "tasks_computed": 2}
    _assert_same(in_process, result)


def _die_once(out, *args):
    """A probe task whose first execution anywhere kills its own worker process (SIGKILL)."""
    try:
        os.close(os.open(out.parent.parent / "killed-once", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return _REAL_PROBE_SHARD(out, *args)
    os.kill(os.getpid(), signal.SIGKILL)


_REAL_PROBE_SHARD = probe_tasks_module.probe_shard


def test_dask_reruns_the_task_of_a_killed_worker(tiny_features, data_dir, in_process, dask_at, tmp_path,
                                                 monkeypatch, one_thread):
    shutil.rmtree(data_dir / ".work", ignore_errors=True)
    monkeypatch.setattr(probe_tasks_module, "probe_shard", _die_once)
    result = _run(_params(tiny_features["params"], dask_at), data_dir, tmp_path, fresh=False, robustness=False)
    assert (data_dir / ".work" / "killed-once").is_file()
    _assert_same(in_process, result)


@pytest.mark.parametrize("workers", [1, 2])
def test_each_finished_task_is_logged_as_it_finishes_with_what_is_left(tmp_path, caplog, workers):
    """One line per task as it finishes (counted in finishing order, whichever task that is)."""
    tasks = [Task(f"t{i}", write_value, (str(i), delay), tmp_path / f"t{i}.json")
             for i, delay in enumerate([0.6, 0.0, 0.0])]
    executor = parse_params({"synthetic": {"sections": TINY_SECTIONS}, "executor": {"workers": workers}}).executor
    with caplog.at_level("INFO", logger="cellpath.runtime.executor"):
        run_tasks(tasks, executor)
    lines = [r.getMessage() for r in caplog.records if " finished in " in r.getMessage()]
    assert [line.split(" finished")[0] for line in lines] == ["task 1/3", "task 2/3", "task 3/3"]
    assert all("elapsed, about" in line and line.endswith("s left") for line in lines)
    assert lines[-1].endswith("about 0 s left")
    assert sorted(line.split(": ")[1].split(";")[0] for line in lines) == ["t0", "t1", "t2"]


def test_a_dead_local_worker_names_its_task_and_a_rerun_resumes(tmp_path):
    tasks = [Task("dies", die_once, (tmp_path / "killed-once",), tmp_path / "dies.txt"),
             Task("lives", write_value, ("x", 0.0), tmp_path / "lives.json")]
    executor = parse_params({"synthetic": {"sections": TINY_SECTIONS}, "executor": {"workers": 2}}).executor
    with pytest.raises(ExecutorError, match=r"worker process died .* unfinished task\(s\): dies(, lives)?\. "
                                            r"Finished tasks are kept: rerun the stage to resume"):
        run_tasks(tasks, executor)
    finished_before = (tmp_path / "lives.json").exists()
    outcomes = run_tasks(tasks, executor.model_copy(update={"workers": 1}))
    assert [o.computed for o in outcomes] == [True, not finished_before]
    assert (tmp_path / "dies.txt").read_text() == "done"


def _keys(params, data_dir) -> list[str]:
    panel = load_panel_cells(data_dir, params.panel)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    plans = {m: plan_magnification(params, data_dir, panel, encoders, m) for m in ("10x", "20x")}
    _, tasks = probe_tasks(params, data_dir, panel, plans, encoders, ["10x", "20x"])
    return [task.key for task in tasks]


def test_shard_keys_follow_params_and_features_but_not_the_executor(tiny_features, data_dir):
    base = _params(tiny_features["params"])
    keys = _keys(base, data_dir)
    assert len(set(keys)) == 2 and keys[0].startswith("probe-filterbank-dense-10x-")
    assert _keys(_params(tiny_features["params"], DASK_2), data_dir) == keys
    assert _keys(_params(tiny_features["params"], max_iter=11), data_dir)[0] != keys[0]
    assert _keys(_params(tiny_features["params"], seeds={"is": 2, "iocd": 1, "mocv": 1, "looo": 1}),
                 data_dir)[1] != keys[1]
    nuc = data_dir / "features" / "filterbank-dense" / "20x" / "breast_a" / "Nuc.npy"
    nuc.write_bytes(nuc.read_bytes())  # rewritten: same bytes, but nothing proves it without reading them
    changed = _keys(base, data_dir)
    assert changed[0] == keys[0] and changed[1] != keys[1]


@pytest.mark.parametrize("executor", [{"workers": 2}, DASK_2], ids=["local-2", "dask-2"])
def test_outcomes_come_in_task_order_with_the_callers_thread_counts(executor, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    environment = dict(os.environ)
    saved = torch.get_num_threads()
    with threadpool_limits(3):
        torch.set_num_threads(3)
        expected = thread_settings()
        tasks = [Task(f"t{i}", write_value, (str(i), delay), tmp_path / f"t{i}.json")
                 for i, delay in enumerate([1.5, 0.0, 0.5])]
        outcomes = run_tasks(tasks, parse_params({"synthetic": {"sections": TINY_SECTIONS},
                                                  "executor": executor}).executor)
    torch.set_num_threads(saved)
    assert [o.key for o in outcomes] == ["t0", "t1", "t2"] and all(o.computed for o in outcomes)
    written = [json.loads(o.output.read_text()) for o in outcomes]
    assert [w["value"] for w in written] == ["0", "1", "2"]
    # every library a worker has runs at the caller's count; the caller may have loaded more (an OpenMP runtime
    # that scanpy or faiss brought in earlier in this process), which the workers never import
    assert all({"torch", "blas"} <= w["threads"].keys() <= expected.keys() for w in written), (expected, written)
    assert all(w["threads"] == {api: expected[api] for api in w["threads"]} for w in written), (expected, written)
    if executor == DASK_2:  # each LocalCluster spawns fresh workers (the local pool: see the next test)
        passive = "PASSIVE" if 2 * 3 > (os.cpu_count() or 1) else None  # 2 workers x 3 threads
        assert all(w["env"] == {"OMP_WAIT_POLICY": passive, "MALLOC_TRIM_THRESHOLD_": None} for w in written), written
    assert "OMP_WAIT_POLICY" not in os.environ  # restored once the workers are gone
    # Dask's nannies set OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, … here before spawning: not left for this
    # process's later children (a `dvc repro` started after would run on one thread)
    assert dict(os.environ) == environment
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_oversubscribed_local_pool_workers_wait_passively(tmp_path):
    """In a fresh process, as a stage runs: the pool's forkserver starts once per process and its
    workers inherit the environment of that start (the test session's may have started earlier)."""
    script = f"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, {str(PROJECT_ROOT / "tests")!r})
import torch
from cellpath.config import ExecutorConfig
from cellpath.runtime.executor import Task, run_tasks
from helpers.executor_tasks import write_value
os.environ.pop("OMP_WAIT_POLICY", None)
torch.set_num_threads(os.cpu_count())  # 2 workers x all CPUs: oversubscribed on any machine
out = Path({str(tmp_path)!r})
outcomes = run_tasks([Task(f"t{{i}}", write_value, (str(i), 0.0), out / f"t{{i}}.json") for i in range(2)],
                     ExecutorConfig(workers=2))
print(json.dumps([json.loads(o.output.read_text())["env"] for o in outcomes]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
                            env={k: v for k, v in os.environ.items()  # MALLOC_…: left by earlier clusters
                                 if k not in ("OMP_WAIT_POLICY", "MALLOC_TRIM_THRESHOLD_")})
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == [{"OMP_WAIT_POLICY": "PASSIVE", "MALLOC_TRIM_THRESHOLD_": None}] * 2, (seen, result.stderr)
    assert "oversubscribe them (workers wait passively)" in result.stderr


def test_oversubscribed_workers_wait_passively_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with oversubscription_guard(2, {"torch": 2}):
        assert "OMP_WAIT_POLICY" not in os.environ  # 4 threads on 4 CPUs
    with oversubscription_guard(2, {"torch": 4}):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with oversubscription_guard(2, {"torch": 4}):
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize(("executor", "needle"), [
    ({"workers": 0}, "key `executor.workers`: Input should be greater than or equal to 1"),
    ({"backend": "ray"}, "key `executor.backend`: Input should be 'local' or 'dask'"),
    ({"backend": "dask", "address": "10.0.0.5:8786"}, "key `executor.address`: expected a Dask scheduler address"),
    ({"address": "tls://10.0.0.5:8786"}, "key `executor`: address and cluster: slurm are Dask settings"),
    ({"backend": "dask", "address": "tcp://10.0.0.5:8786"},
     "key `executor.address`: a tcp:// scheduler takes unauthenticated connections: anyone who reaches 10.0.0.5 can "
     "run code as you on its workers. Use a tls:// scheduler"),
    ({"backend": "dask", "address": "ws://[fe80::1]:8786"}, "a ws:// scheduler takes unauthenticated connections"),
    ({"backend": "dask", "dashboard_address": "0.0.0.0"}, "key `executor.dashboard_address`: String should match"),
    ({"cluster": "pbs"}, "key `executor.cluster`: Input should be 'local' or 'slurm'"),
    ({"slurm_options": {}}, "unknown key `executor.slurm_options`: allowed keys here: backend, workers, address"),
])
def test_executor_block_is_validated(executor, needle):
    with pytest.raises(ConfigError) as err:
        parse_params({"synthetic": {"sections": TINY_SECTIONS}, "executor": executor})
    assert needle in str(err.value)


@pytest.mark.parametrize("address", ["tls://10.0.0.5:8786", "wss://scheduler.lab:443", "tcp://127.0.0.1:8786",
                                     "tcp://localhost:8786", "tcp://[::1]:8786", "ws://127.0.0.2:8786"])
def test_encrypted_or_loopback_schedulers_are_accepted(address):
    params = parse_params({"synthetic": {"sections": TINY_SECTIONS}, "executor": {"backend": "dask", "address": address}})
    assert params.executor.address == address


def test_slurm_without_dask_jobqueue_says_how_to_install_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_jobqueue(name, *args, **kwargs):
        if name == "dask_jobqueue":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jobqueue)
    cfg = parse_params({"synthetic": {"sections": TINY_SECTIONS},
                        "executor": {"backend": "dask", "cluster": "slurm", "slurm": {"queue": "gpu"}}}).executor
    with pytest.raises(ExecutorError, match=r"pip install dask-jobqueue"):
        run_tasks([Task("t", write_value, ("x", 0.0), tmp_path / "t.json")], cfg)


def test_executor_is_not_a_dvc_parameter_of_any_stage():
    import yaml

    from helpers.project import PROJECT_ROOT

    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    listed = [p for stage in stages.values() for p in stage.get("params", []) if isinstance(p, str)]
    assert listed and not [p for p in listed if p.split(".")[0] == "executor"]
