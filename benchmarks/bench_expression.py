"""The expression probe's exact ridge (``cellpath.expression.ridge``) against scikit-learn's Ridge.

Both sides do the same job on the same rows: standardise the features and the 50 targets on the
training rows, fit ridge at every penalty of the grid (params.yaml's ``expression.penalties``, α =
λ · n_train), score each penalty on the validation rows and choose one per gene, then predict the
test rows. Ours: one float64 pass accumulating XᵀX and XᵀY, one eigendecomposition for every
penalty and gene (``fit_path``, ``validation_errors``, ``choose_penalties``, ``predict``).
scikit-learn: ``StandardScaler`` and one ``Ridge(alpha, solver="cholesky")`` per penalty on the
held matrix (float64), its validation predictions, the same choice. Recorded per (rows, width): the
median and spread of rows/s of each side over alternated repeats and their ratio, the chosen
penalties equal and the largest coefficient difference relative to scikit-learn's, and each side's
peak memory above what the process held before it (resident set, sampled every 5 ms: torch's CPU
allocator is invisible to tracemalloc). scikit-learn holds the
rows in memory, so it runs only up to ``--sklearn-max-rows``; beyond, ours is timed alone on rows
generated block by block (a streamed source: memory stays at a few blocks).

Rows are real-shaped: a rank-64 signal with a power-law spectrum plus per-column noise of power-law
scale, so the Gram matrix is as ill-conditioned as foundation-model features' (condition numbers
of 10⁷ and more), and targets mixing that signal with noise of varying size.

Writes benchmarks/results/expression.json; ``--calibrate`` also fits the cost model's expression entry
(``seconds = n · w² · a + w³ · b`` through every run's median seconds; ``cellpath.runtime.costs``)
and writes it to ``src/cellpath/data/costs.json``.
Usage: python benchmarks/bench_expression.py [--rows N ...] [--widths D ...] [--sklearn-max-rows N] [--calibrate]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import yaml
from sklearn.linear_model import Ridge
from sklearn.preprocessing import StandardScaler

from cellpath.expression.ridge import ACCUMULATE_ROWS, choose_penalties, fit_path, predict, validation_errors
from cellpath.runtime.costs import COSTS_PATH, fit_expression_costs, load_costs, save_costs

ROOT = Path(__file__).resolve().parents[1]
PENALTIES = tuple(yaml.safe_load((ROOT / "params.yaml").read_text())["expression"]["penalties"])
GENES = 50
RANK = 64
VAL_SHARE, TEST_SHARE = 0.1, 0.1


class GeneratedRows:
    """Real-shaped feature rows made on request, block by block from a seed per block (float32)."""

    def __init__(self, n_rows: int, width: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.n_rows, self._width = n_rows, width
        self.basis = (rng.standard_normal((RANK, width)) * (np.arange(1, RANK + 1) ** -0.7)[:, None]).astype(np.float32)
        self.noise = (0.05 * np.arange(1, width + 1) ** -0.35).astype(np.float32)
        self.offset = rng.normal(0.0, 2.0, width).astype(np.float32)
        self.loadings = rng.standard_normal((RANK, GENES)).astype(np.float32)
        self.target_noise = np.geomspace(0.2, 3.0, GENES).astype(np.float32)
        self.seed = seed

    @property
    def width(self) -> int:
        return self._width

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, block])
        n = min(ACCUMULATE_ROWS, self.n_rows - block * ACCUMULATE_ROWS)
        z = rng.standard_normal((n, RANK), dtype=np.float32)
        x = z @ self.basis + rng.standard_normal((n, self._width), dtype=np.float32) * self.noise + self.offset
        y = z @ self.loadings + rng.standard_normal((n, GENES), dtype=np.float32) * self.target_noise
        return x, y

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.both(rows)[0]

    def both(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Features and targets of contiguous ``rows`` (the benchmark asks for ranges)."""
        first, last = int(rows[0]) // ACCUMULATE_ROWS, int(rows[-1]) // ACCUMULATE_ROWS
        blocks = [self._block(b) for b in range(first, last + 1)]
        x, y = np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])
        offset = rows - first * ACCUMULATE_ROWS
        return x[offset], y[offset]


class StreamedTargets:
    """The targets of a generated source, aligned with a row range, read as ridge reads them."""

    def __init__(self, source: GeneratedRows, rows: np.ndarray) -> None:
        self.source, self.rows = source, rows

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), GENES

    def __getitem__(self, part: slice) -> np.ndarray:
        return self.source.both(self.rows[part])[1]


def _splits(n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_val, n_test = int(VAL_SHARE * n_rows), int(TEST_SHARE * n_rows)
    n_train = n_rows - n_val - n_test
    return np.arange(n_train), np.arange(n_train, n_train + n_val), np.arange(n_train + n_val, n_rows)


def ours(source: GeneratedRows, targets, splits) -> dict:
    train, val, test = splits
    started = time.perf_counter()
    path = fit_path(source, train, targets(train))
    errors = validation_errors(path, source, val, targets(val), PENALTIES)
    chosen = choose_penalties(errors, PENALTIES)
    coefficients = path.coefficients(chosen)
    predict(path, coefficients, source, test)
    return {"seconds": time.perf_counter() - started, "chosen": chosen, "coefficients": coefficients}


def sklearn_side(x: np.ndarray, y: np.ndarray, splits) -> dict:
    train, val, test = splits
    started = time.perf_counter()
    xs, ys = StandardScaler().fit(x[train]), StandardScaler().fit(y[train])
    x_train, y_train = xs.transform(x[train]), ys.transform(y[train])
    x_val, y_val = xs.transform(x[val]), ys.transform(y[val])
    models, errors = [], []
    for lam in PENALTIES:
        model = Ridge(alpha=lam * len(train), solver="cholesky").fit(x_train, y_train)
        errors.append(((model.predict(x_val) - y_val) ** 2).sum(axis=0))
        models.append(model)
    chosen_index = len(PENALTIES) - 1 - np.argmin(np.asarray(errors)[::-1], axis=0)
    coefficients = np.stack([models[i].coef_[g] for g, i in enumerate(chosen_index)], axis=1)
    x_test = xs.transform(x[test])
    _ = np.column_stack([x_test @ coefficients[:, g] for g in range(GENES)])
    return {"seconds": time.perf_counter() - started, "chosen": np.asarray(PENALTIES)[chosen_index],
            "coefficients": coefficients}


def _peak(call) -> tuple[dict, float]:
    """``call()`` and the peak resident memory (MiB) above the process's at the start, sampled every 5 ms."""
    process, done = psutil.Process(), threading.Event()
    start = process.memory_info().rss
    peak = [start]

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = call()
    finally:
        done.set()
        sampler.join()
    return result, (max(peak[0], process.memory_info().rss) - start) / 2**20


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_size(n_rows: int, width: int, with_sklearn: bool, repeats: int) -> dict:
    """One (rows, width): ours and scikit-learn alternated ``repeats`` times (ours alone when too big)."""
    source = GeneratedRows(n_rows, width)
    splits = _splits(n_rows)
    record: dict = {"rows": n_rows, "width": width, "genes": GENES, "n_train": len(splits[0]),
                    "n_val": len(splits[1]), "n_test": len(splits[2]), "sklearn_run": with_sklearn}
    if with_sklearn:
        x, y = source.both(np.arange(n_rows))
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        ours_runs, theirs_runs, ours_peaks, theirs_peaks = [], [], [], []
        for _ in range(repeats):
            mine, peak = _peak(lambda: ours(_Held(x, width), lambda rows: y64[rows], splits))
            ours_runs.append(mine)
            ours_peaks.append(peak)
            theirs, peak = _peak(lambda: sklearn_side(x64, y64, splits))
            theirs_runs.append(theirs)
            theirs_peaks.append(peak)
        ratios = [t["seconds"] / o["seconds"] for o, t in zip(ours_runs, theirs_runs)]
        scale = np.abs(theirs_runs[0]["coefficients"]).max()
        record |= {
            "ours_rows_per_second": _spread([n_rows / r["seconds"] for r in ours_runs]),
            "sklearn_rows_per_second": _spread([n_rows / r["seconds"] for r in theirs_runs]),
            "speedup_vs_sklearn": _spread(ratios),
            "ours_seconds_each": [r["seconds"] for r in ours_runs],
            "sklearn_seconds_each": [r["seconds"] for r in theirs_runs],
            "chosen_penalties_equal": bool(np.array_equal(ours_runs[0]["chosen"], theirs_runs[0]["chosen"])),
            "coefficients_max_relative_difference": float(
                np.abs(ours_runs[0]["coefficients"] - theirs_runs[0]["coefficients"]).max() / scale),
            "ours_peak_mib": max(ours_peaks), "sklearn_peak_mib": max(theirs_peaks),
            "sklearn_matrix_mib": x64.nbytes / 2**20,
        }
    else:
        def targets(rows: np.ndarray) -> StreamedTargets:
            return StreamedTargets(source, rows)

        mine, peak = _peak(lambda: ours(source, targets, splits))
        record |= {"ours_rows_per_second": _spread([n_rows / mine["seconds"]]), "ours_seconds_each": [mine["seconds"]],
                   "ours_peak_mib": peak, "streamed": True}
    print(json.dumps({k: v for k, v in record.items() if not isinstance(v, list)}), flush=True)
    return record


class _Held:
    """A held float32 matrix as a row source."""

    def __init__(self, x: np.ndarray, width: int) -> None:
        self.x, self.width = x, width

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.x[rows]


def main() -> None:
    from blas_conditions import blas_report, restart_without_slow_blas
    from provenance import run_stamp, with_provenance

    removed = restart_without_slow_blas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--widths", type=int, nargs="+", default=[1280, 2560])
    parser.add_argument("--sklearn-max-rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "expression.json")
    parser.add_argument("--calibrate", action="store_true", help="write the fitted costs to the cost model")
    parser.add_argument("--costs", type=Path, default=COSTS_PATH, help="the cost model --calibrate writes")
    args = parser.parse_args()
    stamp = run_stamp()
    runs = [run_size(n, d, n <= args.sklearn_max_rows, args.repeats) for d in args.widths for n in args.rows]
    compared = [r for r in runs if r["sklearn_run"]]
    report = with_provenance({
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "numpy": np.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "blas": {"libraries": blas_report(), "removed_environment_variables": removed,
                 "conditions": "ours (torch float64) and scikit-learn (numpy/scipy float64) in one process, "
                               "alternated, every thread pool at its default"},
        "settings": {"rows": args.rows, "widths": args.widths, "genes": GENES, "penalties": list(PENALTIES),
                     "sklearn_max_rows": args.sklearn_max_rows, "repeats": args.repeats, "rank": RANK},
        "runs": runs,
        "summary": {"speedup_vs_sklearn_median": {f"{r['rows']}x{r['width']}": r["speedup_vs_sklearn"]["median"]
                                                  for r in compared},
                    "chosen_penalties_equal_everywhere": all(r["chosen_penalties_equal"] for r in compared),
                    "coefficients_max_relative_difference": max(
                        (r["coefficients_max_relative_difference"] for r in compared), default=None)},
    }, stamp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    if args.calibrate:
        shapes = ", ".join(f"{r['rows']:,} × {r['width']}" for r in runs)
        calibrate(runs, args.costs,
                  f"benchmarks/results/expression.json ({stamp['date']}, {stamp['commit']}, "
                  f"{report['machine']['description']}): ours at {shapes}")


def calibrate(runs: list[dict], path: Path, source: str) -> None:
    """Fit the expression costs to the runs' median seconds and store them in the cost model."""
    costs = fit_expression_costs([(r["rows"], r["width"], statistics.median(r["ours_seconds_each"])) for r in runs],
                                 cores=torch.get_num_threads(), source=source)
    model = load_costs(path)
    cpu = dataclasses.replace(model.costs("cpu"), expression=costs)
    save_costs(dataclasses.replace(model, devices={**model.devices, "cpu": cpu}), path)
    print(f"wrote {path}: {costs}")


if __name__ == "__main__":
    main()
