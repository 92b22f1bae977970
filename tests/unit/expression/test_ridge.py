"""The exact ridge path against scikit-learn's Ridge and StandardScaler on seeded problems."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge
from sklearn.preprocessing import StandardScaler

from cellpath.expression.ridge import (ACCUMULATE_ROWS, choose_penalties, fit_path, predict, standardised,
                                       validation_errors)
from cellpath.probing.fit import InMemoryRows

GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


def _problem(seed: int, n: int = 3000, d: int = 48, g: int = 6, offset: float = 40.0):
    """Correlated features far from zero (a mean 40 SDs out: cancellation would show) and targets of
    mixed signal strength: some genes best fitted with little shrinkage, some with much."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((d, d)) / np.sqrt(d)
    x = (rng.standard_normal((n, d)) @ mixing + offset).astype(np.float32)
    weights = rng.standard_normal((d, g)) * np.geomspace(1.0, 0.01, g)[None, :]
    y = x.astype(np.float64) @ weights + rng.standard_normal((n, g)) * np.linspace(0.2, 3.0, g)
    return x, y


def _sklearn(x: np.ndarray, y: np.ndarray, train: np.ndarray, lam: float) -> tuple[Ridge, StandardScaler, StandardScaler]:
    xs, ys = StandardScaler().fit(x[train].astype(np.float64)), StandardScaler().fit(y[train])
    model = Ridge(alpha=lam * len(train), solver="cholesky").fit(xs.transform(x[train].astype(np.float64)),
                                                                  ys.transform(y[train]))
    return model, xs, ys


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coefficients_and_scaler_match_sklearn(seed):
    x, y = _problem(seed)
    train = np.random.default_rng(seed).permutation(len(x))[:2000]
    path = fit_path(InMemoryRows(x), train, y[train])
    for lam in GRID:
        model, xs, ys = _sklearn(x, y, train, lam)
        ours = path.coefficients(np.full(y.shape[1], lam))
        np.testing.assert_allclose(ours, model.coef_.T, rtol=1e-6, atol=1e-9 * np.abs(model.coef_).max())
        np.testing.assert_allclose(model.intercept_, 0.0, atol=1e-9)  # centred on both sides: no intercept
    np.testing.assert_allclose(path.standardiser.feature_mean, xs.mean_, rtol=1e-12)
    np.testing.assert_allclose(path.standardiser.feature_sd, xs.scale_, rtol=1e-9)
    np.testing.assert_allclose(path.standardiser.target_sd, ys.scale_, rtol=1e-9)


@pytest.mark.parametrize("seed", [3, 4])
def test_penalties_chosen_per_gene_as_sklearn_would(seed):
    x, y = _problem(seed)
    order = np.random.default_rng(seed).permutation(len(x))
    train, val = order[:1500], order[1500:2200]
    path = fit_path(InMemoryRows(x), train, y[train])
    errors = validation_errors(path, InMemoryRows(x), val, y[val], GRID)
    reference = np.empty_like(errors)
    for i, lam in enumerate(GRID):
        model, xs, ys = _sklearn(x, y, train, lam)
        predicted = model.predict(xs.transform(x[val].astype(np.float64)))
        reference[i] = ((predicted - ys.transform(y[val])) ** 2).sum(axis=0)
    np.testing.assert_allclose(errors, reference, rtol=1e-9)
    chosen = choose_penalties(errors, GRID)
    np.testing.assert_array_equal(chosen, np.asarray(GRID)[reference.argmin(axis=0)])
    assert len(set(chosen)) > 1  # the problem is built so that genes want different penalties


def test_the_larger_penalty_wins_a_tie_and_a_bad_grid_is_refused():
    errors = np.array([[1.0, 2.0], [1.0, 3.0], [4.0, 2.0]])
    np.testing.assert_array_equal(choose_penalties(errors, (0.1, 1.0, 10.0)), [1.0, 10.0])
    for grid in [(1.0, 0.1, 10.0), (0.0, 1.0, 2.0), (1.0, 1.0, 2.0)]:
        with pytest.raises(ValueError, match="strictly ascending"):
            choose_penalties(errors, grid)


def test_predictions_are_the_standardised_fit():
    x, y = _problem(5)
    train, test = np.arange(2000), np.arange(2000, 3000)
    path = fit_path(InMemoryRows(x), train, y[train])
    coefficients = path.coefficients(np.full(y.shape[1], 0.1))
    model, xs, ys = _sklearn(x, y, train, 0.1)
    expected = model.predict(xs.transform(x[test].astype(np.float64)))
    np.testing.assert_allclose(predict(path, coefficients, InMemoryRows(x), test), expected, rtol=1e-6, atol=1e-9)
    assert standardised(path, x[test], y[test])[1].shape == (1000, y.shape[1])


def test_no_bit_depends_on_how_many_rows_are_read_at_a_time():
    x, y = _problem(6, n=5000)
    train = np.arange(4500)
    paths = [fit_path(InMemoryRows(x), train, y[train], read_rows=r)
             for r in (ACCUMULATE_ROWS, 3 * ACCUMULATE_ROWS, 100_000)]
    errors = [validation_errors(p, InMemoryRows(x), np.arange(4500, 5000), y[4500:], GRID, read_rows=r)
              for p, r in zip(paths, (ACCUMULATE_ROWS, 2 * ACCUMULATE_ROWS, 100_000))]
    for other, error in zip(paths[1:], errors[1:]):
        assert torch.equal(other.eigenvectors, paths[0].eigenvectors)
        assert np.array_equal(other.coefficients(np.full(6, 0.1)), paths[0].coefficients(np.full(6, 0.1)))
        assert np.array_equal(error, errors[0])


def test_the_thread_count_changes_no_choice_and_no_coefficient_beyond_rounding():
    x, y = _problem(7)
    train, val = np.arange(2000), np.arange(2000, 3000)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            path = fit_path(InMemoryRows(x), train, y[train])
            errors = validation_errors(path, InMemoryRows(x), val, y[val], GRID)
            results.append((choose_penalties(errors, GRID), path.coefficients(choose_penalties(errors, GRID))))
    finally:
        torch.set_num_threads(saved)
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-10, atol=1e-13)


def test_a_constant_feature_standardises_to_zero_and_gets_no_weight():
    x, y = _problem(8)
    x[:, 3] = 7.25
    path = fit_path(InMemoryRows(x), np.arange(2000), y[:2000])
    assert path.standardiser.feature_sd[3] == 1.0
    np.testing.assert_allclose(path.coefficients(np.full(y.shape[1], 0.01))[3], 0.0, atol=1e-12)


def test_too_few_rows_are_refused():
    x, y = _problem(9, n=10)
    with pytest.raises(ValueError, match="at least 2 training rows"):
        fit_path(InMemoryRows(x), np.array([0]), y[:1])



def _partially_penalised(xs: np.ndarray, ys: np.ndarray, groups: np.ndarray, n_groups: int, alpha: float
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(W, A) of min ‖Y − TA − XW‖² + α‖W‖² with the one-hot groups T unpenalised, by scipy's least
    squares on the stacked system [[X, T], [√α I, 0]] (no Frisch–Waugh–Lovell, no within-group centring)."""
    from scipy.linalg import lstsq

    one_hot = np.eye(n_groups)[groups]
    d = xs.shape[1]
    design = np.block([[xs, one_hot], [np.sqrt(alpha) * np.eye(d), np.zeros((d, n_groups))]])
    solution = lstsq(design, np.vstack([ys, np.zeros((d, ys.shape[1]))]))[0]
    return solution[:d], solution[d:]


@pytest.mark.parametrize("seed", [5, 6])
def test_absorbed_groups_are_the_partially_penalised_least_squares(seed):
    """Each group's mean unpenalised, the features penalised: coefficients, validation errors and
    predictions equal scipy's least squares of the whole problem, streamed or not; a group without
    training rows is predicted from the overall mean."""
    x, y = _problem(seed, n=2500, d=24, g=4)
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, 5, len(x))
    groups[groups == 4] = 3  # group 4 has no rows at all
    y = y + 3.0 * np.array([0.0, 1.0, -2.0, 0.5, 9.0])[groups, None]  # group means the features do not carry
    order = rng.permutation(len(x))
    train, val = order[:1500], order[1500:]
    xs, ys = StandardScaler().fit(x[train].astype(np.float64)), StandardScaler().fit(y[train])
    x_train, y_train = xs.transform(x[train].astype(np.float64)), ys.transform(y[train])
    for read_rows in (ACCUMULATE_ROWS, 8 * ACCUMULATE_ROWS):
        path = fit_path(InMemoryRows(x), train, y[train], groups=groups[train], n_groups=5, read_rows=read_rows)
        errors = validation_errors(path, InMemoryRows(x), val, y[val], GRID, groups=groups[val], read_rows=read_rows)
        for i, lam in enumerate(GRID):
            weights, means = _partially_penalised(x_train, y_train, groups[train], 4, lam * len(train))
            ours = path.coefficients(np.full(y.shape[1], lam))
            np.testing.assert_allclose(ours, weights, rtol=1e-6, atol=1e-9 * np.abs(weights).max())
            expected = xs.transform(x[val].astype(np.float64)) @ weights + means[groups[val]]
            np.testing.assert_allclose(errors[i], ((expected - ys.transform(y[val])) ** 2).sum(axis=0), rtol=1e-8)
            predicted = predict(path, ours, InMemoryRows(x), val, groups=groups[val], read_rows=read_rows)
            np.testing.assert_allclose(predicted, expected, rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(path.group_targets[4], 0.0)  # no training rows: the overall mean
    unseen = predict(path, path.coefficients(np.full(y.shape[1], 1.0)), InMemoryRows(x), val[:3],
                     groups=np.full(3, 4))
    scaler = path.standardiser
    overall = (x[val[:3]].astype(np.float64) - scaler.feature_mean) / scaler.feature_sd
    np.testing.assert_allclose(unseen, overall @ path.coefficients(np.full(y.shape[1], 1.0)), rtol=1e-9)
    with pytest.raises(ValueError, match="group codes"):
        standardised(path, x[val[:3]])
