"""Part (c): the probe engine (``cellpath.probing.fit``) on the device.

The driver (``gpu.run``) calls ``measure(device, sizes, budget_s)`` with ``sizes = SIZES[...]["probe"]``
of ``gpu.run`` and records what it returns as ``parts.probe.result``; ``benchmarks/gpu/merge_costs.py``
turns that into the cost model's ``devices.cuda.probe``. It returns (JSON types):

* ``seconds_per_iteration``: ``{"in_memory": s, "streamed": s}`` — seconds per training row, design
  column (features + 1) and L-BFGS iteration of one fit: the difference between one task fitted to
  ``max_iter[1]`` and to ``max_iter[0]`` iterations (its three Cs together), so setup and scoring cancel;
* ``seconds_per_pass``: ``{"in_memory": s, "streamed": s}`` — seconds per row (train + val + test)
  and design column of the rest of the ``max_iter[0]`` run (scalers, design, preconditioner, scoring);
* ``floor``: per size of ``floor_rows``, the engine's time per iteration (two products of the
  float32 design, the line search, the L-BFGS update) against one read of the design block from
  device memory (a reduction over it), the floor of a product;
* ``equality``: a small task set fitted on ``device`` and on the CPU: chosen C equal on every task,
  the largest test Macro-F1 difference (tolerance 0.1 pp: both converge to ``tol``);
* ``source``: one line saying what was measured.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import yaml

from cellpath.probing.engine import Design
from cellpath.probing.fit import InMemoryRows, ProbeTask, fit_tasks

F1_TOLERANCE_POINTS = 0.1
# params.yaml's probe.c_grid: a run's Cs iterate together, as bench_scale measures them on the CPU
C_GRID = tuple(yaml.safe_load((Path(__file__).resolve().parents[2] / "params.yaml").read_text())["probe"]["c_grid"])


def _panel(n_cells: int, width: int, n_classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded Gaussian classes with correlated features (a few strong shared directions, as embeddings have)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, n_cells)
    centres = rng.normal(size=(n_classes, width)).astype(np.float32) * 0.3
    shared = rng.normal(size=(8, width)).astype(np.float32) * 3.0
    x = rng.standard_normal((n_cells, width), dtype=np.float32)
    x += rng.standard_normal((n_cells, 8), dtype=np.float32) @ shared
    x += centres[y]
    return x, y


def _task(n_cells: int, n_classes: int, seed: int = 1) -> ProbeTask:
    order = np.random.default_rng(seed).permutation(n_cells)
    train, val = int(0.7 * n_cells), int(0.8 * n_cells)
    return ProbeTask(np.sort(order[:train]), np.sort(order[train:val]), np.sort(order[val:]), np.arange(n_classes))


def _synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_fit(x, y, k, tasks, device: str, budget_mb: float, max_iter: int) -> float:
    _synchronise(device)
    started = time.perf_counter()
    fit_tasks(x, y, k, tasks, c_grid=C_GRID, max_iter=max_iter, tol=1e-12, device=device, batch_memory_mb=budget_mb)
    _synchronise(device)
    return time.perf_counter() - started


def _rates(x, y, k, device: str, budget_mb: float, caps: list[int]) -> tuple[float, float]:
    """(seconds per training row × column × iteration, seconds per row × column of the rest)."""
    task = _task(len(x), k)
    columns = x.shape[1] + 1
    low, high = (_timed_fit(x, y, k, [task], device, budget_mb, cap) for cap in caps)
    per_iteration = max(high - low, 1e-9) / ((caps[1] - caps[0]) * len(task.train) * columns)
    rest = max(low - caps[0] * per_iteration * len(task.train) * columns, 1e-9)
    return per_iteration, rest / (len(x) * columns)


def _floor(x: np.ndarray, device: str, per_iteration: float) -> dict:
    """One read of the held design against the engine's measured time per iteration at that size."""
    rows = np.arange(len(x))
    design = Design(InMemoryRows(x), [rows], device)
    block = design.stored
    times = []
    for _ in range(5):
        _synchronise(device)
        started = time.perf_counter()
        block.sum()
        _synchronise(device)
        times.append(time.perf_counter() - started)
    read_s = float(np.median(times))
    iteration_s = per_iteration * int(0.7 * len(x)) * x.shape[1]
    return {"rows": len(x), "design_bytes": int(block.numel() * block.element_size()), "read_seconds": read_s,
            "iteration_seconds": iteration_s, "iteration_over_two_reads": iteration_s / (2 * read_s)}


def _equality(device: str, width: int, n_classes: int) -> dict:
    x, y = _panel(3_000, width, n_classes, seed=5)
    tasks = [_task(3_000, n_classes, seed=s) for s in (2, 3, 4)]
    here = fit_tasks(x, y, n_classes, tasks, c_grid=C_GRID, device=device, tol=1e-6)
    cpu = fit_tasks(x, y, n_classes, tasks, c_grid=C_GRID, device="cpu", tol=1e-6)
    worst = max(100 * abs(a.macro_f1 - b.macro_f1) for a, b in zip(here, cpu))
    same_c = all(a.chosen_c == b.chosen_c for a, b in zip(here, cpu))
    return {"tasks": len(tasks), "chosen_c_equal": same_c, "max_macro_f1_difference_points": worst,
            "tolerance_points": F1_TOLERANCE_POINTS, "agrees": same_c and worst <= F1_TOLERANCE_POINTS}


def measure(device: str, sizes: dict, budget_s: float) -> dict:
    n, width, k, caps = sizes["n_cells"], sizes["width"], sizes["n_classes"], sizes["max_iter"]
    started = time.perf_counter()
    x, y = _panel(n, width, k)
    per_iteration, per_pass = {}, {}
    for mode in ("in_memory", "streamed"):
        per_iteration[mode], per_pass[mode] = _rates(x, y, k, device, sizes["budget_mb"][mode], caps)
    floors = [_floor(x, device, per_iteration["in_memory"])]
    for rows in sizes.get("floor_rows", []):
        if rows != n and time.perf_counter() - started < budget_s / 2:
            big_x, big_y = _panel(rows, width, k, seed=7)
            rate, _ = _rates(big_x, big_y, k, device, sizes["budget_mb"]["in_memory"], caps)
            floors.append(_floor(big_x, device, rate))
            del big_x, big_y
    return {"seconds_per_iteration": per_iteration, "seconds_per_pass": per_pass, "floor": floors,
            "equality": _equality(device, min(width, 64), min(k, 6)),
            "peak_gpu_bytes": int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None,
            "source": f"one task of {n:,} cells × {width} features, {k} classes, one C, fitted to {caps[0]} and "
                      f"{caps[1]} L-BFGS iterations by the probe engine on {device}, held and streamed "
                      f"({sizes['budget_mb']['in_memory']} MB and {sizes['budget_mb']['streamed']} MB budgets)"}
