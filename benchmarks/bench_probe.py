"""Probe: agreement with scikit-learn run to convergence, speed against a scikit-learn loop doing the
same fits, distance from the arithmetic floor on a large task, and MLflow's share of the stage.

Tasks: every planned run of the default panel (both taxonomies, every protocol, the IS split as the
stage plans it), one encoder's Nuc features at one magnification, params.yaml's C grid.

1. Agreement. Ours: ``probe.fit_tasks`` (the engine) with params.yaml's tol / max_iter. Reference:
   ``LogisticRegression(C, tol=1e-8, max_iter=10000)`` on the same standardised training cells. Per
   (run, C): |Δ test Macro-F1| ≤ 0.1 pp on ≥ 99 % of fits; per run: the same C chosen on ≥ 95 %.
2. Speed, in two settings: params.yaml's (training sets capped at ``max_train_cells``) and the
   paper's (no cap: the MOCV and LOOO runs train on 1,500–8,300 cells). A: ``fit_tasks``; B: a
   scikit-learn loop doing the same fits (same tol and max_iter, same selection and scoring). A and B
   alternate ``--repeats`` times, each timing fresh fits; reported: the median B/A ratio and its
   range, and how far the two sides' chosen C and test Macro-F1 differ. Both sides run in this
   process on one thread (numpy's BLAS through threadpoolctl, torch through ``set_num_threads``;
   both reports recorded); environment variables that slow numpy's BLAS on some machines here
   (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE) are removed by re-executing without them.
3. Floor. One large task (the largest training set of the panel, no cap): wall time of its fits
   against the matrix products the engine made × the time of one such product at that shape on this
   machine (target ≤ 2×).
4. MLflow. The probe stage at one magnification (Nuc and Mean), with and without tracking, alternated
   after one untimed round, each in a fresh work folder (no shard reuse): the difference as a share
   of the tracked time.

Needs the default pipeline's data up to ``extract`` (``dvc repro extract concordance``).
Usage: python benchmarks/bench_probe.py [--encoder random-vit-t16] [--magnification 20x] [--repeats 3]
       [--max-runs N]
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
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from cellpath.config import load_params, parse_params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import PanelFeatures, load_panel_cells, panel_matrix
from cellpath.probing import engine
from cellpath.probing.fit import ProbeTask, fit_tasks
from cellpath.probing.plan import class_codes
from cellpath.probing.scores import macro_f1
from cellpath.runtime.tracking import Tracker
from cellpath.probing.tasks import plan_magnification
from cellpath.stages.probe import run as run_probe_stage

from blas_conditions import blas_report, restart_without_slow_blas
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = {"tol": 1e-8, "max_iter": 10000}
F1_POINTS, FIT_SHARE, SELECTION_SHARE, SPEEDUP_GOAL, FLOOR_RATIO = 0.1, 0.99, 0.95, 5.0, 2.0


def _scaled(scaler: StandardScaler, rows: np.ndarray) -> np.ndarray:
    """Rows standardised in float64 with a training scaler."""
    return scaler.transform(np.asarray(rows, dtype=np.float64))


def sklearn_fits(x, y, task: ProbeTask, c_grid, tol: float, max_iter: int) -> tuple[list[float], list[float], int]:
    """scikit-learn per C: test and validation Macro-F1 over the task's classes; fits not converged."""
    scaler = StandardScaler().fit(np.asarray(x[task.train], dtype=np.float64))
    test_f1, val_f1, unconverged = [], [], 0
    for c in c_grid:
        # one BLAS thread, as our scipy solver runs: numpy's and scipy's two OpenBLAS pools spin
        # against each other with two threads each (docs/decisions/0019), which would slow this side only
        with warnings.catch_warnings(record=True) as caught, threadpool_limits(limits=1, user_api="blas"):
            warnings.simplefilter("always", ConvergenceWarning)
            model = LogisticRegression(C=c, tol=tol, max_iter=max_iter).fit(_scaled(scaler, x[task.train]),
                                                                               y[task.train])
        unconverged += any(issubclass(w.category, ConvergenceWarning) for w in caught)
        val_f1.append(macro_f1(y[task.val], model.predict(_scaled(scaler, x[task.val])), task.classes))
        test_f1.append(macro_f1(y[task.test], model.predict(_scaled(scaler, x[task.test])), task.classes))
    return test_f1, val_f1, unconverged


def sklearn_loop(x, y, tasks, c_grid, tol: float, max_iter: int) -> list[float]:
    """The baseline: per task every C, the best validation Macro-F1 (earliest on ties) scores the test
    cells: (test Macro-F1, chosen C) per task."""
    scores = []
    for task in tasks:
        test_f1, val_f1, _ = sklearn_fits(x, y, task, c_grid, tol, max_iter)
        best = int(np.argmax(val_f1))
        scores.append((test_f1[best], float(c_grid[best])))
    return scores


def our_fits(x, y, n_classes: int, task: ProbeTask, c_grid, tol: float, max_iter: int):
    """Ours per C (each candidate as a grid of one: the same fit as inside the grid): test and val Macro-F1."""
    test_f1, val_f1, unconverged = [], [], 0
    for c in c_grid:
        result = fit_tasks(x, y, n_classes, [task], c_grid=(c,), tol=tol, max_iter=max_iter)[0]
        test_f1.append(result.macro_f1)
        val_f1.append(result.val_macro_f1)
        unconverged += not result.converged
    return test_f1, val_f1, unconverged


def agreement(x, taxonomies, c_grid, tol, max_iter) -> dict:
    fits = within = same_c = runs = ours_unconverged = ref_unconverged = 0
    worst = 0.0
    for y, n_classes, tasks in taxonomies.values():
        for task in tasks:
            ours_test, ours_val, bad = our_fits(x, y, n_classes, task, c_grid, tol, max_iter)
            ref_test, ref_val, ref_bad = sklearn_fits(x, y, task, c_grid, **REFERENCE)
            ours_unconverged, ref_unconverged = ours_unconverged + bad, ref_unconverged + ref_bad
            diffs = 100 * np.abs(np.array(ours_test) - np.array(ref_test))
            fits, within = fits + len(diffs), within + int((diffs <= F1_POINTS).sum())
            worst = max(worst, float(diffs.max()))
            runs, same_c = runs + 1, same_c + int(np.argmax(ours_val) == np.argmax(ref_val))
    return {"runs": runs, "fits": fits, "fit_share_within_0.1pp": round(within / fits, 4),
            "selection_share_equal": round(same_c / runs, 4), "max_abs_difference_points": round(worst, 3),
            "fits_not_converged": ours_unconverged, "reference_fits_not_converged": ref_unconverged,
            "meets_criteria": within / fits >= FIT_SHARE and same_c / runs >= SELECTION_SHARE}


def speed(x, taxonomies, c_grid, tol, max_iter, repeats: int) -> dict:
    seconds = {"ours": [], "sklearn_loop": []}
    ours, theirs = [], []
    for _ in range(repeats):  # alternate A / B: machine drift hits both sides alike
        for side in seconds:
            started = time.perf_counter()
            for y, n_classes, tasks in taxonomies.values():
                if side == "sklearn_loop":
                    theirs.append(sklearn_loop(x, y, tasks, c_grid, tol, max_iter))
                else:
                    ours.append(fit_tasks(x, y, n_classes, tasks, c_grid=c_grid, tol=tol, max_iter=max_iter))
            seconds[side].append(round(time.perf_counter() - started, 2))
    ratio = [b / a for a, b in zip(seconds["ours"], seconds["sklearn_loop"])]
    n_tax = len(taxonomies)
    f1_ours = np.array([r.macro_f1 for results in ours[:n_tax] for r in results])
    f1_theirs = np.array([f1 for scores in theirs[:n_tax] for f1, _ in scores])
    c_ours = np.array([r.chosen_c for results in ours[:n_tax] for r in results])
    c_theirs = np.array([c for scores in theirs[:n_tax] for _, c in scores])
    return {"runs": int(len(f1_ours)),
            "training_cells": {"min": int(min(len(t.train) for _, _, ts in taxonomies.values() for t in ts)),
                               "max": int(max(len(t.train) for _, _, ts in taxonomies.values() for t in ts))},
            "seconds": seconds, "speedup_vs_sklearn_loop": {"median": round(float(np.median(ratio)), 3),
                                                            "min": round(min(ratio), 3), "max": round(max(ratio), 3)},
            "chosen_c_equal_share": round(float((c_ours == c_theirs).mean()), 4),
            "max_abs_macro_f1_difference_points": round(float(100 * np.abs(f1_ours - f1_theirs).max()), 3),
            "ours_not_converged": int(sum(not r.converged for results in ours for r in results))}


def floor(x, y, n_classes: int, task: ProbeTask, c_grid, tol, max_iter) -> dict:
    """Our large-task wall time against the engine's products × the time of one at that shape here."""
    shapes = []
    original_times, original_transpose = engine.Design.times, engine.Design.transpose_times

    def times(self, v):
        shapes.append(("X V", self.n, v.shape[1], v.shape[2]))
        return original_times(self, v)

    def transpose_times(self, r):
        shapes.append(("X' R", self.n, self.source.width + 1, r.shape[2]))
        return original_transpose(self, r)

    engine.Design.times, engine.Design.transpose_times = times, transpose_times
    try:
        started = time.perf_counter()
        result = fit_tasks(x, y, n_classes, [task], c_grid=c_grid, tol=tol, max_iter=max_iter)[0]
        wall = time.perf_counter() - started
    finally:
        engine.Design.times, engine.Design.transpose_times = original_times, original_transpose
    n, width = shapes[0][1], shapes[0][2]
    design = torch.randn(1, n, width)
    floor_seconds = 0.0
    per_columns = {}
    for columns in sorted({shape[3] for shape in shapes}):
        v, r = torch.randn(1, width, columns, dtype=torch.float64), torch.randn(1, n, columns, dtype=torch.float64)
        times_ = []
        for _ in range(7):
            begun = time.perf_counter()
            for _ in range(10):
                torch.bmm(design, v.to(torch.float32)).to(torch.float64)
                torch.bmm(design.transpose(1, 2), r.to(torch.float32)).to(torch.float64)
            times_.append((time.perf_counter() - begun) / 20)
        per_columns[columns] = float(np.median(times_))
    floor_seconds = sum(per_columns[shape[3]] for shape in shapes)
    return {"training_cells": n, "width": width, "classes": len(task.classes), "products": len(shapes),
            "wall_seconds": round(wall, 3), "seconds_per_product_by_columns": per_columns,
            "floor_seconds": round(floor_seconds, 3), "wall_over_floor": round(wall / floor_seconds, 3),
            "target": FLOOR_RATIO, "converged": result.converged, "iterations": result.iterations}


def mlflow_share(params, magnification: str, repeats: int) -> dict:
    """The probe stage (Nuc, Mean) with and without MLflow, alternated, in fresh work folders."""
    seconds = {"without_mlflow": [], "with_mlflow": []}
    for repeat in range(repeats + 1):  # the first, untimed: imports and first calls warm up
        for side in seconds:
            with tempfile.TemporaryDirectory() as tmp:
                data = Path(tmp) / "data"
                data.mkdir()
                for entry in (ROOT / "data").iterdir():  # the inputs, but an empty work folder
                    if entry.name != "work":
                        (data / entry.name).symlink_to(entry)
                config = params.model_dump(mode="json")
                config["probe"] |= {"magnifications": [magnification], "readouts": ["Nuc", "Mean"]}
                config["mlflow"] = {"enabled": side == "with_mlflow", "tracking_uri": f"sqlite:///{tmp}/mlflow.db",
                                    "artifact_location": f"{tmp}/art", "experiment": "bench"}
                config = parse_params(config)
                if side == "with_mlflow":  # a project's store exists after its first run
                    Tracker(config.mlflow, "setup", Path(tmp)).finish({}, {})
                started = time.perf_counter()
                run_probe_stage(config, data, Path(tmp) / "reports", root=Path(tmp))
                if repeat:
                    seconds[side].append(round(time.perf_counter() - started, 2))
    share = [(w - wo) / w for w, wo in zip(seconds["with_mlflow"], seconds["without_mlflow"])]
    return {"seconds": seconds, "mlflow_share": {"median": round(float(np.median(share)), 4),
                                                 "min": round(min(share), 4), "max": round(max(share), 4)},
            "target": 0.10}


def planned_tasks(params, panel, spec, magnification: str, max_runs: int | None) -> dict:
    """taxonomy → (labels, number of classes, the fitted runs' tasks) as the probe stage plans them."""
    out = {}
    for taxonomy, runs in plan_magnification(params, Path("data"), panel, [spec], magnification).items():
        y, names = class_codes(panel.cells[taxonomy])
        out[taxonomy] = (y, len(names), [run.task for run in runs if run.task is not None][:max_runs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="random-vit-t16")
    parser.add_argument("--magnification", default="20x")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-runs", type=int, default=None, help="first N runs per taxonomy only (a smoke test)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "probe.json"))
    args = parser.parse_args()
    removed = restart_without_slow_blas()  # the same fast BLAS for every side
    torch.set_num_threads(1)  # one thread, as numpy's BLAS runs under threadpool_limits on the other side
    stamp = run_stamp()
    os.chdir(ROOT)
    params = load_params("params.yaml")
    cfg = params.probe
    c_grid, tol, max_iter = tuple(cfg.c_grid), cfg.tol, cfg.max_iter
    evaluated = selected_encoders(params.extract.registry, params.extract.encoders)
    spec = next(s for s in evaluated if args.encoder in (s.name, s.slug))
    panel = load_panel_cells(Path("data"), params.panel)
    x = panel_matrix(PanelFeatures(Path("data/features"), spec.slug, args.magnification, panel).readout("Nuc"))
    uncapped = params.model_dump(mode="json")
    uncapped["probe"]["max_train_cells"] = None
    settings = {"default": params, "paper_uncapped": parse_params(uncapped)}
    taxonomies = {name: planned_tasks(setting, panel, spec, args.magnification, args.max_runs)
                  for name, setting in settings.items()}

    result = {"benchmark": "probe",
              "data": f"default panel {params.panel}, {len(panel.cells)} cells; {spec.name} {args.magnification} Nuc; "
                      f"protocols {','.join(params.protocols)}; runs per taxonomy "
                      f"{ {t: len(v[2]) for t, v in taxonomies['default'].items()} }",
              "probe": {"c_grid": list(c_grid), "tol": tol, "max_iter": max_iter,
                        "max_train_cells": {"default": cfg.max_train_cells, "paper_uncapped": None}},
              "reference": REFERENCE}
    result["agreement"] = agreement(x, taxonomies["default"], c_grid, tol, max_iter)
    print(json.dumps(result["agreement"], indent=2), flush=True)
    result["speed"] = {name: speed(x, tasks, c_grid, tol, max_iter, args.repeats) for name, tasks in taxonomies.items()}
    result["speed"]["goal"] = {"setting": "paper_uncapped", "median_speedup": SPEEDUP_GOAL,
                               "met": result["speed"]["paper_uncapped"]["speedup_vs_sklearn_loop"]["median"]
                               >= SPEEDUP_GOAL}
    print(json.dumps(result["speed"], indent=2), flush=True)

    y, names = class_codes(panel.cells["fine"])
    largest = max(taxonomies["paper_uncapped"]["fine"][2], key=lambda task: len(task.train))
    result["floor"] = floor(x, y, len(names), largest, c_grid, tol, max_iter)
    print(json.dumps(result["floor"], indent=2), flush=True)
    result["mlflow"] = mlflow_share(params, args.magnification, args.repeats)
    result["blas"] = {"numpy_scipy_sklearn": blas_report(), "torch": torch.__config__.parallel_info().splitlines()[:6],
                      "torch_blas": torch.__config__.show().splitlines()[:12],
                      "removed_environment_variables": removed}
    result["machine"] = {"cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg()),
                         "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                         "torch": torch.__version__}
    result = with_provenance(result, stamp)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
