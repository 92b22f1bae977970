"""One probe from separate arrays: the tests' entry to the engine of cellpath.probing.fit."""

from __future__ import annotations

import numpy as np

from cellpath.probing.engine import Design, GroupFit, fit_group
from cellpath.probing.fit import (DEFAULT_C_GRID, DEFAULT_MAX_ITER, DEFAULT_TOL, InMemoryRows, ProbeResult, ProbeTask,
                                  fit_tasks, group_problem)


def fit_logistic_path(x: np.ndarray, y: np.ndarray, n_classes: int, c_grid: tuple[float, ...],
                      max_iter: int = DEFAULT_MAX_ITER, tol: float = DEFAULT_TOL) -> GroupFit:
    """One task's fits, on all rows of ``x`` (standardised again by the probe: already standardised
    rows stay as they are), minimising mean CE + ||W||²/(2·C·n) for every C of ``c_grid``."""
    task = ProbeTask(np.arange(len(x)), np.arange(0), np.arange(0), np.arange(n_classes))
    design = Design(InMemoryRows(np.asarray(x, dtype=np.float32)), [task.train], "cpu")
    return fit_group(design, group_problem(design, np.asarray(y), [task], c_grid), n_classes, tol=tol,
                     max_iter=max_iter)


def fit_one(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, x_test: np.ndarray,
            y_test: np.ndarray, n_classes: int, *, c_grid: tuple[float, ...] = DEFAULT_C_GRID,
            max_iter: int = DEFAULT_MAX_ITER, tol: float = DEFAULT_TOL, device: str = "cpu") -> ProbeResult:
    """One probe from separate train/val/test arrays (labels 0..n_classes-1, all classes scored)."""
    x = np.concatenate([x_train, x_val, x_test])
    y = np.concatenate([y_train, y_val, y_test])
    bounds = np.cumsum([0, len(x_train), len(x_val), len(x_test)])
    task = ProbeTask(*(np.arange(bounds[i], bounds[i + 1]) for i in range(3)), classes=np.arange(n_classes))
    return fit_tasks(x, y, n_classes, [task], c_grid=c_grid, max_iter=max_iter, tol=tol, device=device)[0]
