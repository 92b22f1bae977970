"""Executor overhead and speed-up: the probe stage on the default panel with three executors.

The probe stage (default params: every protocol, both taxonomies, seven readouts, every encoder and
magnification of params.yaml — one task per encoder × magnification) runs with the local executor
at 1 and 2 workers and with Dask (a LocalCluster started by the stage) at 2 workers, each from
scratch (no shard of an earlier run), MLflow off, on a copy of the data so the project's work
folder is untouched. Every pool runs one thread (OMP/BLAS/torch), so 2 workers use 2 CPUs and the
three run tables must be identical (checked, fit_seconds aside). Reported: wall time, speed-up over
local-1, and Dask's overhead per task: N no-op tasks (touch a file) through a running 2-worker
LocalCluster against the same tasks in process, and the time to start a cluster for one task.

Needs the default pipeline's data up to `extract` (`dvc repro extract` or `make run`).
Usage: python benchmarks/bench_executor.py [--noop-tasks 200]
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # before numpy / torch load: one thread per pool, in this process and its workers

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from cellpath.config import load_params, parse_params  # noqa: E402
from cellpath.runtime.executor import Task, run_tasks  # noqa: E402
from cellpath.stages.probe import run as run_probe_stage  # noqa: E402

from provenance import run_stamp, with_provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXECUTORS = {"local-1": {"backend": "local", "workers": 1}, "local-2": {"backend": "local", "workers": 2},
             "dask-2": {"backend": "dask", "workers": 2}}


def probe_runs(params_data: dict, data_dir: Path, out: Path) -> dict:
    """Wall time and run table of the probe stage under each executor, each from scratch."""
    results, tables = {}, {}
    for name, executor in EXECUTORS.items():
        params = parse_params(params_data | {"executor": executor})
        shutil.rmtree(data_dir / ".work", ignore_errors=True)
        started = time.perf_counter()
        runs = run_probe_stage(params, data_dir, out / name, root=out)
        seconds = time.perf_counter() - started
        timing = json.loads((out / name / "probe" / "timing.json").read_text())
        tables[name] = runs.drop(columns="fit_seconds")
        results[name] = {"seconds": round(seconds, 2), "tasks": timing["executor"]["tasks"],
                         "fit_seconds": timing["fit_seconds"]}
        print(f"{name}: {seconds:.1f} s", flush=True)
    for name in results:
        results[name]["speedup_vs_local_1"] = round(results["local-1"]["seconds"] / results[name]["seconds"], 3)
    identical = all(tables["local-1"].equals(table) for table in tables.values())
    return {"runs": results, "identical_run_tables": identical}


def dask_overhead(n_tasks: int, folder: Path) -> dict:
    """Seconds per no-op task in process and through a running LocalCluster, and a cluster's start-up."""
    from distributed import LocalCluster

    def tasks(tag: str) -> list[Task]:
        (folder / tag).mkdir(parents=True)
        return [Task(f"noop-{tag}-{i}", Path.touch, (), folder / tag / f"{i}") for i in range(n_tasks)]

    def executor(**block):
        return parse_params({"synthetic": {"sections": [{"section_id": "a", "organ": "Breast", "status": "Normal"}]},
                             "executor": block}).executor

    started = time.perf_counter()
    run_tasks(tasks("in_process"), executor())
    in_process = (time.perf_counter() - started) / n_tasks
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        running = executor(backend="dask", address=cluster.scheduler_address)
        run_tasks(tasks("warm-up")[:2], running)  # the workers import cellpath.runtime.executor and torch once
        started = time.perf_counter()
        run_tasks(tasks("dask"), running)
        through_dask = (time.perf_counter() - started) / n_tasks
    started = time.perf_counter()
    run_tasks(tasks("start")[:1], executor(backend="dask", workers=2))
    start_up = time.perf_counter() - started
    return {"no_op_tasks": n_tasks, "in_process_ms_per_task": round(1000 * in_process, 2),
            "dask_ms_per_task": round(1000 * through_dask, 2),
            "overhead_ms_per_task": round(1000 * (through_dask - in_process), 2),
            "cluster_start_and_one_task_s": round(start_up, 2),
            "note": "per-task times through a running cluster (client connect included); start-up separately"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noop-tasks", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "executor.json"))
    args = parser.parse_args()
    stamp = run_stamp()
    os.chdir(ROOT)
    params = load_params("params.yaml")
    data = params.model_dump(mode="json")
    data["mlflow"] = {"enabled": False}
    data["probe"]["torch_threads"] = 1
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp:
        tmp = Path(tmp)
        data_dir = tmp / "data"
        for sub in ("sections", "labels", "features"):
            shutil.copytree(ROOT / "data" / sub, data_dir / sub)
        shutil.copy(ROOT / "data" / "panels.csv", data_dir)
        probe = probe_runs(data, data_dir, tmp / "reports")
        overhead = dask_overhead(args.noop_tasks, tmp / "noop")
    encoders, mags = params.extract.encoders, params.extract.magnifications
    result = {"benchmark": "executor",
              "data": f"default panel {params.panel}; probe stage, params.yaml with probe.torch_threads 1 and MLflow off; "
                      f"{len(encoders)} encoders × {len(mags)} magnifications = {len(encoders) * len(mags)} tasks",
              "probe_stage": probe, "dask_overhead": overhead,
              "machine": {"cpus": os.cpu_count(), "threads_per_worker": 1, "python": platform.python_version(),
                          "load_average_at_start": list(load_start), "load_average_at_end": list(os.getloadavg())}}
    result = with_provenance(result, stamp)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
