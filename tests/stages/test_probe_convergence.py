"""Every fit of a whole condition, planned as the probe stage plans it with the default's probe
parameters, recomputed outside the engine: a fit recorded as converged has max |gradient| ≤ tol at
the weights it returned (numpy, float64, from the raw feature rows)."""

from __future__ import annotations

import numpy as np
import yaml

from cellpath.config import parse_params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import PanelFeatures, load_panel_cells
from cellpath.io.layout import features_dir
from cellpath.probing import fit as fit_module
from cellpath.probing.engine import binary_factor
from cellpath.probing.plan import class_codes
from cellpath.probing.tasks import plan_magnification
from helpers.project import PROJECT_ROOT as ROOT


def _independent_gradient(x: np.ndarray, labels: np.ndarray, w: np.ndarray, c: float) -> np.ndarray:
    """The gradient of mean cross-entropy + binary_factor·||W[:D]||²/(2·C·n) at ``w`` (D + 1, K), from
    raw rows ``x`` standardised in float64 (numpy's mean and SD, an SD below 1e-8 taken as 1)."""
    sd = x.std(axis=0)
    z = (x - x.mean(axis=0)) / np.where(sd < 1e-8, 1.0, sd)
    logits = z @ w[:-1] + w[-1]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    n, k = len(x), w.shape[1]
    residual = (p - np.eye(k)[labels]) / n
    grad = np.vstack([z.T @ residual, residual.sum(axis=0)])
    grad[:-1] += binary_factor(k) * w[:-1] / (c * n)
    return grad


def test_every_converged_fit_of_a_condition_meets_tol(tiny_features, monkeypatch):
    default = yaml.safe_load((ROOT / "params.yaml").read_text())["probe"]
    data = tiny_features["params"].model_dump(mode="json")
    data["extract"].update(encoders=["filterbank-dense"], magnifications=["10x"])
    # The default's fitting parameters; the tiny panel's three sections need the small gates.
    data["probe"] = {key: default[key] for key in ("c_grid", "tol", "max_iter", "max_train_cells", "seeds")} | {
        "min_train_cells": {"fine": 10, "coarse": 10}, "min_test_cells": {"fine": 5, "coarse": 5}, "mocv_folds": 3}
    params = parse_params(data)
    cfg, data_dir = params.probe, tiny_features["data_dir"]
    panel = load_panel_cells(data_dir, params.panel)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    runs = [run for run in plan_magnification(params, data_dir, panel, encoders, "10x")["fine"] if run.task]
    source = PanelFeatures(features_dir(data_dir), "filterbank-dense", "10x", panel).readout("N||M")
    codes, names = class_codes(panel.cells["fine"])

    fitted = []
    real_fit_group = fit_module.fit_group

    def recording(design, problem, n_classes, **kwargs):
        fit = real_fit_group(design, problem, n_classes, **kwargs)
        fitted.append((design.rows, fit))
        return fit

    monkeypatch.setattr(fit_module, "fit_group", recording)
    results = fit_module.fit_tasks(source, codes, len(names), [run.task for run in runs], c_grid=tuple(cfg.c_grid),
                                   tol=cfg.tol, max_iter=cfg.max_iter)
    by_rows = {run.task.train.tobytes(): run.task for run in runs}
    checked = converged = 0
    for rows, fit in fitted:
        for t, train in enumerate(rows):
            task = by_rows[train.tobytes()]
            labels = np.searchsorted(task.classes, codes[train])
            x = source.take(train).astype(np.float64)
            for position, c in enumerate(cfg.c_grid):
                grad = _independent_gradient(x, labels, fit.weights[t, position].numpy(), c)
                largest = np.abs(grad).max()
                assert abs(float(fit.gradient[t, position]) - largest) <= 1e-9, (task, c)
                assert bool(fit.converged[t, position]) == (largest <= cfg.tol), (task, c, largest)
                checked += 1
                converged += bool(fit.converged[t, position])
    assert checked == len(runs) * len(cfg.c_grid) > 30
    assert converged == checked  # the default's tolerance is met by every fit of this condition
    assert all(result.converged for result in results)
