"""One probe from separate arrays: the tests' entry to the batched fits of cellpath.probing.fit."""

from __future__ import annotations

import numpy as np
import torch

from cellpath.probing.fit import (DEFAULT_C_GRID, DEFAULT_MAX_ITER, DEFAULT_TOL, BatchFit, ProbeResult, ProbeTask,
                                  fit_logistic_batch, fit_tasks)


def fit_logistic_path(x: torch.Tensor, y: torch.Tensor, n_classes: int, c_grid: tuple[float, ...],
                      max_iter: int = DEFAULT_MAX_ITER, tol: float = DEFAULT_TOL) -> BatchFit:
    """One task's fits (a batch of one) minimising mean CE + ||W||²/(2·C·n) for every C of ``c_grid``."""
    n = len(x)
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype, device=x.device)], dim=1)[None]
    weight = torch.full((1, n), 1.0 / n, dtype=x.dtype, device=x.device)
    mask = torch.ones(1, n_classes, dtype=torch.bool, device=x.device)
    return fit_logistic_batch(design, y[None], weight, mask, c_grid, max_iter, tol)




def fit_one(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, x_test: np.ndarray,
              y_test: np.ndarray, n_classes: int, *, c_grid: tuple[float, ...] = DEFAULT_C_GRID,
              max_iter: int = DEFAULT_MAX_ITER, tol: float = DEFAULT_TOL, device: str = "cpu",
              solver: str = "auto") -> ProbeResult:
    """One probe from separate train/val/test arrays (labels 0..n_classes-1, all classes scored)."""
    x = np.concatenate([x_train, x_val, x_test])
    y = np.concatenate([y_train, y_val, y_test])
    bounds = np.cumsum([0, len(x_train), len(x_val), len(x_test)])
    task = ProbeTask(*(np.arange(bounds[i], bounds[i + 1]) for i in range(3)), classes=np.arange(n_classes))
    return fit_tasks(x, y, n_classes, [task], c_grid=c_grid, max_iter=max_iter, tol=tol, device=device,
                     solver=solver)[0]
