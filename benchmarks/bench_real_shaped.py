"""The probe engine on problems shaped like foundation-model features, against scikit-learn's lbfgs,
held in memory and streamed.

A problem (:func:`problem`): D = 1,280 features stored as float16 (the feature store's type), nine
classes with imbalanced priors, the class signal in a random 16-dimensional subspace (centres of SD
1 in whitened units), noise with a power-law covariance spectrum λᵢ ∝ i^−α over all 1,280
directions of a random basis, and feature means away from zero; n training cells and min(n/5, 20,000) validation
and test cells each. Fitted as the probe stage fits a run (``fit_tasks``: C grid 0.01, 0.1, 1,
tol 1e-6, validation Macro-F1 chooses C) on one torch thread, and by scikit-learn's
``LogisticRegression(C, tol=1e-6, max_iter=10000)`` per C on the float64-standardised rows, one BLAS
thread, with the same choice of C (``scores.select_c``) and test Macro-F1.

Recorded per problem: the engine's L-BFGS iterations per C (its float64 gradient at the returned
weights and whether it is ≤ tol), scikit-learn's ``n_iter_`` per C, the wall time of each side
(standardisation, the three fits, scoring: the problem's rows already in memory), their ratio
(median and spread over ``--rounds`` alternations), agreement (same C; test Macro-F1 within 0.1 pp),
the same engine with the 64-eigenpair preconditioner at every size (as before 2026-12-06; up to
``--rank-64-up-to`` rows), and — from ``--stream-from`` rows on — the engine held against streamed
under a budget the design does not fit (a quarter of it: the same iterations, so the time ratio is the ratio per iteration). scikit-learn runs
up to ``--sklearn-up-to`` rows (its float64 copy and hours of fitting bound it).

Each problem records the rounds, date and commit it was measured with; ``--merge`` adds problems
to an existing JSON (the summary is recomputed over all of them).

Usage: python benchmarks/bench_real_shaped.py [--sizes 5000 20000 100000] [--alphas 1 1.5 2]
       [--priors skewed mild] [--rounds 3] [--sklearn-up-to 100000] [--stream-from 100000]
       [--large 1000000:1:skewed] [--merge] [--out benchmarks/results/real_shaped.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from cellpath.probing import engine
from cellpath.probing import fit as fit_module
from cellpath.probing.fit import InMemoryRows, ProbeTask, design_row_bytes, fit_tasks
from cellpath.probing.scores import macro_f1, select_c

from blas_conditions import blas_report, restart_without_slow_blas
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
WIDTH, CLASSES, SIGNAL_RANK = 1280, 9, 16
PRIORS = {"skewed": [0.30, 0.22, 0.15, 0.11, 0.08, 0.06, 0.04, 0.025, 0.015],
          "mild": list(np.linspace(1.6, 0.4, CLASSES) / np.linspace(1.6, 0.4, CLASSES).sum())}
SIGNAL = 1.0               # class centres' SD along the signal subspace, in whitened units
C_GRID, TOL, MAX_ITER = (0.01, 0.1, 1.0), 1e-6, 10000
F1_POINTS = 0.1
HELD_MB = 64 * 1024        # a budget every benchmark size fits in
STREAMED_SHARE = 0.25      # streamed: a budget of a quarter of the problem's design


def problem(n_train: int, alpha: float, priors: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, ProbeTask]:
    """Float16 features (cells × 1,280), class labels and the task (train, validation, test rows)."""
    rng = np.random.default_rng(seed)
    n_eval = min(max(n_train // 5, 1000), 20_000)
    n = n_train + 2 * n_eval
    spectrum = np.arange(1, WIDTH + 1, dtype=np.float64) ** -alpha
    basis = np.linalg.qr(rng.standard_normal((WIDTH, WIDTH)))[0]
    mixing = (np.sqrt(spectrum)[:, None] * basis.T).astype(np.float32)  # noise = z · diag(√λ) · basisᵀ
    signal_basis = np.linalg.qr(rng.standard_normal((WIDTH, SIGNAL_RANK)))[0]
    # The centres' SD is SIGNAL in whitened units (Σ^-1/2): about as separable under every α.
    whitened = SIGNAL / np.sqrt(np.mean(1.0 / spectrum))
    centres = (rng.standard_normal((CLASSES, SIGNAL_RANK)) * whitened) @ signal_basis.T
    offsets = rng.standard_normal(WIDTH) * 2 * np.sqrt(spectrum.mean())
    y = rng.choice(CLASSES, n, p=np.asarray(PRIORS[priors]) / np.sum(PRIORS[priors]))
    x = np.empty((n, WIDTH), dtype=np.float16)
    for start in range(0, n, 65536):
        rows = slice(start, min(start + 65536, n))
        block = rng.standard_normal((rows.stop - rows.start, WIDTH), dtype=np.float32) @ mixing
        block += (centres[y[rows]] + offsets).astype(np.float32)
        x[rows] = block
    order = rng.permutation(n)
    task = ProbeTask(np.sort(order[:n_train]), np.sort(order[n_train:n_train + n_eval]),
                     np.sort(order[n_train + n_eval:]), np.arange(CLASSES))
    return x, y, task


def engine_side(x: np.ndarray, y: np.ndarray, task: ProbeTask, budget_mb: float, small_rank: bool = False) -> dict:
    """The probe stage's fit of one run: time, chosen C, test Macro-F1, and per C the iterations,
    the float64 gradient at the returned weights and whether it met tol. ``small_rank``: with the
    64-eigenpair preconditioner at every size (the engine before 2026-12-06)."""
    groups = []
    real, rank_rows = fit_module.fit_group, engine.RANK_ROWS

    def recording(*args, **kwargs):
        groups.append(real(*args, **kwargs))
        return groups[-1]

    fit_module.fit_group = recording
    engine.RANK_ROWS = 2**62 if small_rank else rank_rows
    try:
        started = time.perf_counter()
        result = fit_tasks(InMemoryRows(x), y, CLASSES, [task], c_grid=C_GRID, tol=TOL, max_iter=MAX_ITER,
                           batch_memory_mb=budget_mb)[0]
        seconds = time.perf_counter() - started
    finally:
        fit_module.fit_group, engine.RANK_ROWS = real, rank_rows
    (group,) = groups
    return {"seconds": seconds, "chosen_c": result.chosen_c, "tied_cs": result.tied_cs, "macro_f1": result.macro_f1,
            "iterations": group.iterations[0].tolist(), "gradient": group.gradient[0].tolist(),
            "converged": group.converged[0].tolist()}


def sklearn_side(x: np.ndarray, y: np.ndarray, task: ProbeTask) -> dict:
    """scikit-learn per C on the float64-standardised rows, one BLAS thread, the same choice of C."""
    started = time.perf_counter()
    with threadpool_limits(limits=1, user_api="blas"):
        scaler = StandardScaler().fit(x[task.train].astype(np.float64))
        train, val, test = (scaler.transform(x[rows].astype(np.float64)) for rows in (task.train, task.val, task.test))
        models, iterations, unconverged = [], [], 0
        for c in C_GRID:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ConvergenceWarning)
                models.append(LogisticRegression(C=c, tol=TOL, max_iter=MAX_ITER).fit(train, y[task.train]))
            unconverged += any(issubclass(w.category, ConvergenceWarning) for w in caught)
            iterations.append(int(models[-1].n_iter_[0]))
        selection = select_c(y[task.val], [m.predict(val) for m in models], task.classes, C_GRID)
        score = macro_f1(y[task.test], models[selection.position].predict(test), task.classes)
    return {"seconds": time.perf_counter() - started, "chosen_c": float(C_GRID[selection.position]),
            "tied_cs": selection.tied, "macro_f1": float(score), "iterations": iterations, "unconverged": unconverged}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(n_train: int, alpha: float, priors: str, rounds: int, with_sklearn: bool, streamed: bool,
            with_small_rank: bool) -> dict:
    x, y, task = problem(n_train, alpha, priors)
    row = {"n_train": n_train, "n_val": len(task.val), "n_test": len(task.test), "alpha": alpha, "priors": priors,
           "design_mb_float32": round(len(task.train) * design_row_bytes(WIDTH, len(C_GRID) * CLASSES) / 1024**2, 1)}
    ours, reference, stream, small = [], [], [], []
    for _ in range(rounds):  # alternated: engine, scikit-learn, streamed engine, the 64-eigenpair engine
        ours.append(engine_side(x, y, task, HELD_MB))
        if with_sklearn:
            reference.append(sklearn_side(x, y, task))
        if streamed:
            stream.append(engine_side(x, y, task, STREAMED_SHARE * row["design_mb_float32"]))
        if with_small_rank:
            small.append(engine_side(x, y, task, HELD_MB, small_rank=True))
    first = ours[0]
    row["engine"] = {k: first[k] for k in ("chosen_c", "tied_cs", "macro_f1", "iterations", "gradient", "converged")} | {
        "seconds": spread([e["seconds"] for e in ours])}
    if with_small_rank:
        row["engine_rank_64"] = {k: small[0][k] for k in ("chosen_c", "macro_f1", "iterations", "converged")} | {
            "seconds": spread([e["seconds"] for e in small])}
    if with_sklearn:
        ref = reference[0]
        row["sklearn"] = {k: ref[k] for k in ("chosen_c", "tied_cs", "macro_f1", "iterations", "unconverged")} | {
            "seconds": spread([r["seconds"] for r in reference])}
        row["speedup"] = spread([r["seconds"] / e["seconds"] for r, e in zip(reference, ours)])
        row["same_c"] = ref["chosen_c"] == first["chosen_c"]
        row["macro_f1_difference_points"] = round(100 * abs(ref["macro_f1"] - first["macro_f1"]), 6)
        row["agrees"] = row["same_c"] and row["macro_f1_difference_points"] <= F1_POINTS
    if streamed:
        assert all(s["iterations"] == e["iterations"] and s["macro_f1"] == e["macro_f1"]
                   for s, e in zip(stream, ours)), "a streamed fit differs from the held one"
        row["streamed_over_held"] = spread([s["seconds"] / e["seconds"] for s, e in zip(stream, ours)])
        row["streamed_budget_mb"] = round(STREAMED_SHARE * row["design_mb_float32"], 1)
    print(json.dumps({k: v for k, v in row.items() if k not in ("engine", "sklearn")} | {
        "engine_iterations": first["iterations"], "sklearn_iterations": row.get("sklearn", {}).get("iterations"),
        "macro_f1": first["macro_f1"]}),
        flush=True)
    return row


def main() -> None:
    removed = restart_without_slow_blas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[5000, 20000, 100000])
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    parser.add_argument("--priors", nargs="+", default=["skewed", "mild"], choices=sorted(PRIORS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sklearn-up-to", type=int, default=100_000)
    parser.add_argument("--stream-from", type=int, default=100_000)
    parser.add_argument("--rank-64-up-to", type=int, default=100_000)
    parser.add_argument("--large", nargs="*", default=[], metavar="N:ALPHA:PRIORS",
                        help="extra problems outside the grid, e.g. 1000000:1:skewed")
    parser.add_argument("--merge", action="store_true",
                        help="keep the problems of --out that this run does not measure again")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_shaped.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stamp = run_stamp()
    problems = [(n, a, p) for n in args.sizes for a in args.alphas for p in args.priors]
    problems += [(int(n), float(a), p) for n, a, p in (spec.split(":") for spec in args.large)]
    rows = [measure(n, a, p, args.rounds, n <= args.sklearn_up_to, n >= args.stream_from, n <= args.rank_64_up_to)
            for n, a, p in problems]
    for row in rows:
        row |= {"rounds": args.rounds, "date": stamp["date"], "commit": stamp["commit"]}
    if args.merge and args.out.is_file():
        measured = {(r["n_train"], r["alpha"], r["priors"]) for r in rows}
        kept = [r for r in json.loads(args.out.read_text())["problems"]
                if (r["n_train"], r["alpha"], r["priors"]) not in measured]
        rows = sorted(kept + rows, key=lambda r: (r["n_train"], r["alpha"], r["priors"]))
    iterations = [max(r["engine"]["iterations"]) for r in rows]
    before = [max(r["engine_rank_64"]["iterations"]) for r in rows if "engine_rank_64" in r]
    result = {"problems": rows, "c_grid": list(C_GRID), "tol": TOL, "torch_threads": 1,
              "median_iterations_slowest_c": statistics.median(iterations),
              "median_iterations_slowest_c_rank_64": statistics.median(before) if before else None,
              "converged_fits": sum(sum(r["engine"]["converged"]) for r in rows),
              "fits": sum(len(r["engine"]["converged"]) for r in rows),
              "blas": blas_report(), "blas_variables_removed": removed,
              "machine": {"torch": torch.__version__, "torch_threads": 1}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, stamp), indent=2) + "\n")


if __name__ == "__main__":
    main()
