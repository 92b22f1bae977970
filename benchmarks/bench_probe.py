"""Probe throughput: cellpath's batched torch probe against a loop of scikit-learn LogisticRegression.

Both fit the same planned runs (default params: every protocol, both taxonomies, one encoder's Nuc
features at one magnification of the default panel), choose C from the same grid by validation
Macro-F1 and score the same test cells. Reported: runs per second for each, the speed-up, and the
mean test Macro-F1 of each (the bar: ≥ 20× at a mean Macro-F1 within 0.5 points). Named baseline:
``LogisticRegression(C=c)`` with scikit-learn's defaults (lbfgs, max_iter=100, tol=1e-4) on the
training cells standardised as ours are. A converged variant (max_iter=1000) is reported beside it.

Then the probe stage itself runs at one magnification without and with MLflow tracking (into a
temporary SQLite store); MLflow's cost is the difference as a share of the tracked stage's time
(the bar: ≤ 10 %), beside the time the stage was blocked on MLflow and the logging thread's work.
The store is created before the timed run, as it exists in a project after its first run; the
one-off schema creation of a new SQLite store is reported separately.

Needs the default pipeline's data up to `extract` (`dvc repro extract` or `make run`).
Usage: python benchmarks/bench_probe.py [--encoder random-vit-t16] [--magnification 20x] [--skip-converged]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from cellpath.config import load_params, parse_params
from cellpath.panel_cells import load_base_readouts, load_panel_cells, readout_matrix
from cellpath.probe import fit_tasks, macro_f1, standardised, standardiser
from cellpath.probe_stage import run_probe_stage
from cellpath.probing import class_codes, plan_runs
from cellpath.tracking import Tracker

ROOT = Path(__file__).resolve().parents[1]


def sklearn_loop(x, y, tasks, c_grid, max_iter: int) -> list[float]:
    """Test Macro-F1 per task from scikit-learn fits, C chosen by validation Macro-F1."""
    scores = []
    for task in tasks:
        scaler = standardiser(x[task.train])
        scale = lambda a: standardised(a, scaler)  # noqa: E731
        best = None
        for c in c_grid:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                model = LogisticRegression(C=c, max_iter=max_iter).fit(scale(x[task.train]), y[task.train])
            val = macro_f1(y[task.val], model.predict(scale(x[task.val])), task.classes)
            if best is None or val > best[0]:
                best = (val, model)
        scores.append(macro_f1(y[task.test], best[1].predict(scale(x[task.test])), task.classes))
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="random-vit-t16")
    parser.add_argument("--magnification", default="20x")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe.json"))
    parser.add_argument("--skip-converged", action="store_true", help="skip the max_iter=1000 scikit-learn loop")
    args = parser.parse_args()
    os.chdir(ROOT)
    params = load_params("params.yaml")
    cfg = params.probe
    panel = load_panel_cells(Path("data"), params.panel)
    base = load_base_readouts(Path("data/features"), args.encoder, args.magnification, panel)
    x = readout_matrix(base, "Nuc")
    ours_time = ours_runs = 0.0
    rows = []
    for taxonomy in cfg.taxonomies:
        y, names = class_codes(panel.cells[taxonomy])
        tasks = [r.task for p in params.protocols for r in plan_runs(panel.cells, p, taxonomy, cfg) if r.task]
        fit_tasks(x, y, len(names), tasks[:1], c_grid=tuple(cfg.c_grid), max_iter=2)  # warm-up (imports)
        started = time.perf_counter()
        ours = fit_tasks(x, y, len(names), tasks, c_grid=tuple(cfg.c_grid), max_iter=cfg.max_iter,
                         batch_memory_mb=cfg.batch_memory_mb)
        ours_time += time.perf_counter() - started
        ours_runs += len(tasks)
        timings = {}
        f1 = {"ours": [r.macro_f1 for r in ours]}
        variants = (("sklearn_default", 100),) + (() if args.skip_converged else (("sklearn_converged", 1000),))
        for label, iterations in variants:
            started = time.perf_counter()
            f1[label] = sklearn_loop(x, y, tasks, cfg.c_grid, iterations)
            timings[label] = time.perf_counter() - started
        rows.append({"taxonomy": taxonomy, "runs": len(tasks), "f1": f1, "sklearn_seconds": timings})
        print(f"{taxonomy}: {len(tasks)} runs; ours {ours_time:.1f} s so far; sklearn {timings}")
    total_runs = sum(r["runs"] for r in rows)
    f1_all = {k: float(np.mean([v for r in rows for v in r["f1"][k]])) for k in rows[0]["f1"]}
    seconds = {"ours": ours_time} | {k: sum(r["sklearn_seconds"][k] for r in rows) for k in rows[0]["sklearn_seconds"]}
    per_run_abs = float(np.mean([abs(a - b) for r in rows for a, b in zip(r["f1"]["ours"], r["f1"]["sklearn_default"])]))

    stage = {}
    for tracking in (False, True):  # the stage without and with MLflow: the difference is its cost
        with tempfile.TemporaryDirectory() as tmp:
            stage_params = params.model_dump(mode="json")
            stage_params["probe"]["magnifications"] = [args.magnification]
            stage_params["mlflow"] = {"enabled": tracking, "tracking_uri": f"sqlite:///{tmp}/mlflow.db",
                                      "artifact_location": f"{tmp}/art", "experiment": "bench"}
            stage_params = parse_params(stage_params)
            if tracking:  # a project's store exists after its first run: create it (schema, experiment) first
                started = time.perf_counter()
                Tracker(stage_params.mlflow, "setup", Path(tmp)).finish({}, {})
                stage["new_store_setup_seconds"] = round(time.perf_counter() - started, 2)
            run_probe_stage(stage_params, Path("data"), Path(tmp) / "reports", root=Path(tmp))
            stage["with_mlflow" if tracking else "without_mlflow"] = json.loads(
                (Path(tmp) / "reports" / "probe" / "timing.json").read_text())
    with_s, without_s = stage["with_mlflow"]["stage_seconds"], stage["without_mlflow"]["stage_seconds"]
    stage["mlflow_cost_fraction"] = round((with_s - without_s) / with_s, 4)

    result = {
        "benchmark": "probe",
        "data": f"default panel {params.panel}, {len(panel.cells)} cells; {args.encoder} {args.magnification} Nuc; "
                f"protocols {','.join(params.protocols)}; taxonomies {','.join(cfg.taxonomies)}",
        "runs": total_runs,
        "ours": {"max_iter": cfg.max_iter, "seconds": round(seconds["ours"], 2),
                 "runs_per_s": round(total_runs / seconds["ours"], 2), "mean_macro_f1": round(f1_all["ours"], 4)},
        "baseline_sklearn_default": {"max_iter": 100, "seconds": round(seconds["sklearn_default"], 2),
                                     "runs_per_s": round(total_runs / seconds["sklearn_default"], 2),
                                     "mean_macro_f1": round(f1_all["sklearn_default"], 4)},
        "sklearn_converged": None if args.skip_converged else {
            "max_iter": 1000, "seconds": round(seconds["sklearn_converged"], 2),
            "runs_per_s": round(total_runs / seconds["sklearn_converged"], 2),
            "mean_macro_f1": round(f1_all["sklearn_converged"], 4)},
        "speedup_vs_sklearn_default": round(seconds["sklearn_default"] / seconds["ours"], 2),
        "speedup_vs_sklearn_converged": None if args.skip_converged else round(
            seconds["sklearn_converged"] / seconds["ours"], 2),
        "mean_macro_f1_difference_points": round(100 * (f1_all["ours"] - f1_all["sklearn_default"]), 3),
        "mean_abs_per_run_difference_points": round(100 * per_run_abs, 3),
        "target": {"speedup": 20.0, "max_mean_f1_difference_points": 0.5},
        "stage_at_one_magnification": stage,
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg()), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    result["meets_target"] = bool(result["speedup_vs_sklearn_default"] >= 20.0
                                  and abs(result["mean_macro_f1_difference_points"]) <= 0.5
                                  and stage["mlflow_cost_fraction"] <= 0.10)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
