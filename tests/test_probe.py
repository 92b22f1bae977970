"""The torch probe against scikit-learn's LogisticRegression on small seeded data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.preprocessing import StandardScaler

from cellpath.probe import DEFAULT_C_GRID, fit_logistic_path, run_probe


def _data(seed: int, n: int, k: int = 5, d: int = 32, separation: float = 0.6, problem: int = 0):
    """Cells of ``problem``'s k Gaussian classes (fixed centres), drawn with ``seed``."""
    centres = np.random.default_rng(1000 + problem).normal(size=(k, d)) * separation
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    return (centres[y] + rng.normal(size=(n, d))).astype(np.float32), y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_macro_f1_as_sklearn_within_half_a_point(seed):
    x_train, y_train = _data(seed, 1500, problem=seed)
    x_val, y_val = _data(seed + 100, 400, problem=seed)
    x_test, y_test = _data(seed + 200, 1000, problem=seed)
    ours = run_probe(x_train, y_train, x_val, y_val, x_test, y_test, 5)
    scaler = StandardScaler().fit(x_train)
    best = None
    for c in DEFAULT_C_GRID:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = LogisticRegression(C=c, max_iter=2000).fit(scaler.transform(x_train), y_train)
        val = f1_score(y_val, model.predict(scaler.transform(x_val)), average="macro")
        if best is None or val > best[0]:
            best = (val, c, model)
    reference = f1_score(y_test, best[2].predict(scaler.transform(x_test)), average="macro")
    assert abs(ours.macro_f1 - reference) <= 0.005
    assert 0.5 < ours.macro_auroc <= 1.0 and 0.0 < ours.macro_auprc <= 1.0


def test_weights_match_sklearn_coefficients():
    import torch

    x, y = _data(5, 800, k=3, d=6)
    x = StandardScaler().fit_transform(x).astype(np.float32)
    weights = fit_logistic_path(torch.from_numpy(x), torch.from_numpy(y), 3, (0.1, 1.0), tol=1e-7)
    for i, c in enumerate((0.1, 1.0)):
        model = LogisticRegression(C=c, max_iter=5000, tol=1e-10).fit(x, y)
        ours = weights[i].numpy()
        # Softmax weights are identified up to a per-feature constant across classes: centre both.
        ours_centred = ours[:-1] - ours[:-1].mean(axis=1, keepdims=True)
        theirs = model.coef_.T - model.coef_.T.mean(axis=1, keepdims=True)
        np.testing.assert_allclose(ours_centred, theirs, atol=2e-3)


def test_validation_picks_the_regularisation():
    x_train, y_train = _data(3, 60, d=200, separation=0.3)  # few cells, many features: needs strong L2
    x_val, y_val = _data(4, 400, d=200, separation=0.3)
    result = run_probe(x_train, y_train, x_val, y_val, x_val, y_val, 5)
    assert result.chosen_c in DEFAULT_C_GRID
    assert result.val_macro_f1 == pytest.approx(result.macro_f1)  # same cells, so the same score
