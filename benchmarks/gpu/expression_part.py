"""Part (e): the expression probes' exact ridge (``cellpath.expression.ridge``) on the device.

The driver (``gpu.run``) calls ``measure(device, sizes, budget_s)`` with ``sizes = SIZES[...]["expression"]``
and records what it returns as ``parts.expression.result``; ``benchmarks/gpu/merge_costs.py`` fits the
cost model's ``devices.cuda.expression`` line to its ``timings``. It returns (JSON types):

* ``timings``: per (rows, width) the seconds of one design's fit, validation over the penalty grid,
  choice and test prediction on ``device`` (train / validation / test 80 / 10 / 10 %, 50 targets);
* ``equality``: a small problem fitted on ``device`` and on the CPU: the same penalty for every gene,
  and the largest coefficient difference relative to the CPU's (tolerance 1e-8: both are float64);
* ``source``: one line saying what was measured.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cellpath.expression.ridge import choose_penalties, fit_path, predict, validation_errors

PENALTIES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # params.yaml's expression.penalties
GENES = 50
COEFFICIENT_TOLERANCE = 1e-8


class _Rows:
    """A held float32 matrix as a row source."""

    def __init__(self, x: np.ndarray) -> None:
        self.x, self.width = x, x.shape[1]

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.x[rows]


def _problem(n: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows with a few strong shared directions (as embeddings have) and targets mixing them with noise."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 32), dtype=np.float32)
    x = z @ rng.standard_normal((32, width), dtype=np.float32) + 0.3 * rng.standard_normal((n, width), dtype=np.float32)
    y = z @ rng.standard_normal((32, GENES)) + rng.standard_normal((n, GENES)) * np.geomspace(0.3, 3.0, GENES)
    return x, y


def _fit(x: np.ndarray, y: np.ndarray, device: str) -> tuple[np.ndarray, np.ndarray]:
    """One design's whole job; returns (chosen penalties, coefficients)."""
    n = len(x)
    train, val, test = np.arange(int(0.8 * n)), np.arange(int(0.8 * n), int(0.9 * n)), np.arange(int(0.9 * n), n)
    source = _Rows(x)
    path = fit_path(source, train, y[train], device=device)
    chosen = choose_penalties(validation_errors(path, source, val, y[val], PENALTIES), PENALTIES)
    coefficients = path.coefficients(chosen)
    predict(path, coefficients, source, test)
    return chosen, coefficients


def _synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(device: str, sizes: dict, budget_s: float) -> dict:
    started, timings = time.perf_counter(), []
    for n, width in sizes["shapes"]:
        if time.perf_counter() - started > budget_s / 2:
            break
        x, y = _problem(n, width)
        _synchronise(device)
        begun = time.perf_counter()
        _fit(x, y, device)
        _synchronise(device)
        timings.append({"rows": n, "width": width, "seconds": time.perf_counter() - begun})
        del x, y
    x, y = _problem(*sizes["equality"], seed=3)
    here, there = _fit(x, y, device), _fit(x, y, "cpu")
    difference = float(np.abs(here[1] - there[1]).max() / np.abs(there[1]).max())
    same = bool(np.array_equal(here[0], there[0]))
    return {"timings": timings,
            "equality": {"rows": sizes["equality"][0], "width": sizes["equality"][1], "chosen_penalties_equal": same,
                         "coefficients_max_relative_difference": difference, "tolerance": COEFFICIENT_TOLERANCE,
                         "agrees": same and difference <= COEFFICIENT_TOLERANCE},
            "peak_gpu_bytes": int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None,
            "source": f"one design's ridge ({len(PENALTIES)} penalties, {GENES} targets, float64) on {device} at "
                      + ", ".join(f"{t['rows']:,} × {t['width']}" for t in timings)}
