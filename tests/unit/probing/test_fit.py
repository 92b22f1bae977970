"""The probe (both solvers) against scikit-learn's LogisticRegression on small seeded data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.preprocessing import StandardScaler

from cellpath.probing.fit import DEFAULT_C_GRID, fit_logistic_scipy, fit_tasks, resolve_solver
from helpers.probes import fit_logistic_path, fit_one


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
    ours = fit_one(x_train, y_train, x_val, y_val, x_test, y_test, 5)
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
    x = StandardScaler().fit_transform(x)
    fit = fit_logistic_path(torch.from_numpy(x), torch.from_numpy(y), 3, (0.1, 1.0), tol=1e-9)
    assert bool(fit.converged.all()) and float(fit.grad_max.max()) <= 1e-8  # or stopped on ftol, as scipy
    for i, c in enumerate((0.1, 1.0)):
        model = LogisticRegression(C=c, max_iter=10000, tol=1e-10).fit(x, y)
        ours = fit.weights[0, i].numpy()
        # Softmax weights are identified up to a per-feature constant across classes: centre both.
        ours_centred = ours - ours.mean(axis=1, keepdims=True)
        theirs = np.vstack([model.coef_.T, model.intercept_[None]])
        np.testing.assert_allclose(ours_centred, theirs - theirs.mean(axis=1, keepdims=True), atol=1e-6)


def test_every_fit_records_its_iterations_and_convergence():
    import torch

    x, y = _data(6, 500, k=4, d=10)
    x = StandardScaler().fit_transform(x)
    fit = fit_logistic_path(torch.from_numpy(x), torch.from_numpy(y), 4, (0.01, 10.0), tol=1e-6)
    assert fit.converged.all() and (fit.grad_max <= 1e-6).all()
    assert fit.iterations[0, 0] < fit.iterations[0, 1]  # weak regularisation takes longer
    capped = fit_logistic_path(torch.from_numpy(x), torch.from_numpy(y), 4, (0.01, 10.0), tol=1e-6, max_iter=3)
    assert capped.iterations.tolist() == [[3, 3]] and not capped.converged.any()
    result = fit_one(x[:400], y[:400], x[400:], y[400:], x[400:], y[400:], 4, max_iter=3, solver="torch")
    assert result.iterations == 3 and result.converged is False


def test_validation_picks_the_regularisation():
    x_train, y_train = _data(3, 60, d=200, separation=0.3)  # few cells, many features: needs strong L2
    x_val, y_val = _data(4, 400, d=200, separation=0.3)
    result = fit_one(x_train, y_train, x_val, y_val, x_val, y_val, 5)
    assert result.chosen_c in DEFAULT_C_GRID
    assert result.val_macro_f1 == pytest.approx(result.macro_f1)  # same cells, so the same score


# --- metrics: cross-checked against scikit-learn ----------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_macro_metrics_equal_sklearn(seed):
    from sklearn.metrics import average_precision_score, roc_auc_score

    from cellpath.probing.scores import average_precision, binary_auroc, macro_f1, macro_scores

    rng = np.random.default_rng(seed)
    classes = np.array([1, 4, 6, 7])
    y = rng.choice(classes, 300)
    prob = rng.dirichlet(np.ones(4), 300)
    prob[:40] = np.round(prob[:40], 1)  # ties between cells
    pred = classes[prob.argmax(axis=1)]
    assert macro_f1(y, pred, classes) == pytest.approx(
        f1_score(y, pred, labels=classes, average="macro", zero_division=0), abs=1e-12)
    for k, c in enumerate(classes):
        assert binary_auroc(y == c, prob[:, k]) == pytest.approx(roc_auc_score(y == c, prob[:, k]), abs=1e-12)
        assert average_precision(y == c, prob[:, k]) == pytest.approx(
            average_precision_score(y == c, prob[:, k]), abs=1e-12)
    f1, auroc, auprc = macro_scores(y, prob, classes)
    onehot = (y[:, None] == classes[None, :]).astype(int)
    assert auroc == pytest.approx(roc_auc_score(onehot, prob, average="macro"), abs=1e-12)
    assert auprc == pytest.approx(average_precision_score(onehot, prob, average="macro"), abs=1e-12)


def test_macro_f1_counts_a_never_seen_never_predicted_class_as_zero():
    from cellpath.probing.scores import macro_f1

    y = np.array([0, 0, 1, 1])
    assert macro_f1(y, y, np.array([0, 1, 2])) == pytest.approx(2 / 3)


def test_metrics_golden_values():
    from cellpath.probing.scores import average_precision, binary_auroc

    positive = np.array([True, False, True, False, True])
    score = np.array([0.9, 0.8, 0.7, 0.7, 0.1])
    # Pairs (pos, neg): (0.9,0.8)=1 (0.9,0.7)=1 (0.7,0.8)=0 (0.7,0.7)=0.5 (0.1,·)=0 → 2.5 / 6.
    assert binary_auroc(positive, score) == pytest.approx(2.5 / 6)
    # Thresholds 0.9 (P=1, R=1/3), 0.8 (P=1/2, R=1/3), 0.7 (P=2/4, R=2/3), 0.1 (P=3/5, R=1).
    assert average_precision(positive, score) == pytest.approx(1 / 3 * 1 + 1 / 3 * 0.5 + 1 / 3 * 0.6)


# --- batches: a task's result does not depend on the tasks fitted with it --------------------------
def _tasks(y: np.ndarray, sizes, class_sets, seed: int = 0):
    from cellpath.probing.fit import ProbeTask

    rng = np.random.default_rng(seed)
    tasks = []
    for n, classes in zip(sizes, class_sets):
        rows = rng.permutation(np.flatnonzero(np.isin(y, classes)))
        tasks.append(ProbeTask(np.sort(rows[:n]), np.sort(rows[n:n + 200]), np.sort(rows[n + 200:n + 700]),
                               np.array(classes)))
    return tasks


def test_a_task_scores_the_same_alone_and_in_two_different_batches():
    x, y = _data(11, 4000, k=5, d=24)
    tasks = _tasks(y, (400, 450, 480, 500, 1200), ([0, 1, 2, 3, 4], [1, 3], [0, 2, 4], [0, 1, 2, 3, 4], [2, 3, 4]))
    alone = [fit_tasks(x, y, 5, [task], solver="torch")[0] for task in tasks]
    together = fit_tasks(x, y, 5, tasks, solver="torch")  # padded to 500 rows beside tasks of other classes
    reversed_ = fit_tasks(x, y, 5, tasks[::-2], solver="torch")[::-1]  # tasks 4, 2, 0: other company, padding
    for a, b in [*zip(alone, together), *zip(alone[::2], reversed_)]:
        assert (a.chosen_c, a.iterations, a.converged) == (b.chosen_c, b.iterations, True)
        for metric in ("macro_f1", "val_macro_f1", "macro_auroc", "macro_auprc"):
            assert abs(getattr(a, metric) - getattr(b, metric)) <= 1e-6
    for result, task in zip(together, tasks):
        assert set(np.unique(result.test_pred)) <= set(task.classes)  # never predicts an unscored class


def test_batch_weights_equal_single_fits():
    import torch

    from cellpath.probing.fit import fit_logistic_batch

    x, y = _data(12, 700, k=4, d=12)
    x = StandardScaler().fit_transform(x)
    sizes, masks = (700, 520), ([True] * 4, [True, False, True, True])
    design = torch.zeros(2, 700, 13, dtype=torch.float64)
    labels = torch.zeros(2, 700, dtype=torch.int64)
    weight = torch.zeros(2, 700, dtype=torch.float64)
    singles = []
    for b, (n, mask) in enumerate(zip(sizes, masks)):
        keep = np.flatnonzero(np.isin(y, np.flatnonzero(mask)))[:n]
        rows = torch.cat([torch.from_numpy(x[keep]), torch.ones(len(keep), 1, dtype=torch.float64)], dim=1)
        design[b, :len(keep)], labels[b, :len(keep)] = rows, torch.from_numpy(y[keep])
        weight[b, :len(keep)] = 1.0 / len(keep)
        singles.append(fit_logistic_batch(rows[None], torch.from_numpy(y[keep])[None],
                                          weight[b:b + 1, :len(keep)], torch.tensor([mask]), (0.1, 10.0)))
    batch = fit_logistic_batch(design, labels, weight, torch.tensor(masks), (0.1, 10.0))
    for b, single in enumerate(singles):
        torch.testing.assert_close(batch.weights[b], single.weights[0], atol=1e-9, rtol=0)
        assert batch.iterations[b].tolist() == single.iterations[0].tolist()


def test_batches_respect_memory_and_padding():
    from cellpath.probing.fit import ProbeTask, _batches

    sizes = [100, 110, 120, 400, 420, 2000]
    tasks = [ProbeTask(np.arange(n), np.arange(1), np.arange(1), np.arange(2)) for n in sizes]
    groups = _batches(tasks, row_bytes=80, task_bytes=1000, budget_bytes=10**9)
    assert [[sizes[i] for i in g] for g in groups] == [[100, 110, 120], [400, 420], [2000]]
    small_budget = _batches(tasks, row_bytes=80, task_bytes=1000, budget_bytes=2 * (120 * 80 + 1000))
    assert [[sizes[i] for i in g] for g in small_budget] == [[100, 110], [120], [400], [420], [2000]]


def _design(x):
    return np.concatenate([x, np.ones((len(x), 1))], axis=1)


@pytest.mark.parametrize("solver", ["scipy", "torch"])
def test_two_class_fits_are_scikit_learns_binary_model(solver):
    """scikit-learn fits one vector v with ||v||²/(2C) for two classes; the probe's two columns must give
    the same logit difference (a two-column softmax penalised as for K > 2 is scikit-learn's model at 2C)."""
    import torch

    x, y = _data(7, 600, k=2, d=8, separation=0.8)
    x = StandardScaler().fit_transform(x)
    for c in (0.05, 1.0):
        if solver == "scipy":
            w = fit_logistic_scipy(_design(x), y, 2, (c,), tol=1e-10)[0][0]
        else:
            w = fit_logistic_path(torch.from_numpy(x), torch.from_numpy(y), 2, (c,), tol=1e-10).weights[0, 0].numpy()
        model = LogisticRegression(C=c, tol=1e-10, max_iter=10000).fit(x, y)
        np.testing.assert_allclose(w[:-1, 1] - w[:-1, 0], model.coef_[0], atol=1e-6)
        np.testing.assert_allclose(w[-1, 1] - w[-1, 0], model.intercept_[0], atol=1e-6)


def test_scipy_weights_match_sklearn_coefficients():
    x, y = _data(5, 800, k=3, d=6)
    x = StandardScaler().fit_transform(x)
    weights, iterations, converged = fit_logistic_scipy(_design(x), y, 3, (0.1, 1.0), tol=1e-10)
    assert converged.all() and (iterations > 0).all()
    for i, c in enumerate((0.1, 1.0)):
        theirs = LogisticRegression(C=c, max_iter=10000, tol=1e-10).fit(x, y)
        theirs = np.vstack([theirs.coef_.T, theirs.intercept_[None]])
        ours = weights[i]
        np.testing.assert_allclose(ours - ours.mean(axis=1, keepdims=True),
                                   theirs - theirs.mean(axis=1, keepdims=True), atol=1e-6)


def test_the_two_solvers_give_the_same_runs():
    x, y = _data(13, 3000, k=5, d=16)
    tasks = _tasks(y, (400, 600, 900), ([0, 1, 2, 3, 4], [1, 3], [0, 2, 4]))
    scipy_runs = fit_tasks(x, y, 5, tasks, solver="scipy", tol=1e-10)
    torch_runs = fit_tasks(x, y, 5, tasks, solver="torch", tol=1e-10)
    for a, b in zip(scipy_runs, torch_runs):
        assert a.chosen_c == b.chosen_c and a.converged and b.converged
        assert (a.test_pred == b.test_pred).all()
        for metric in ("macro_f1", "val_macro_f1", "macro_auroc", "macro_auprc"):
            assert abs(getattr(a, metric) - getattr(b, metric)) <= 1e-6


def test_scipy_fits_record_iterations_and_the_limit():
    x, y = _data(6, 500, k=4, d=10)
    x = StandardScaler().fit_transform(x)
    _, iterations, converged = fit_logistic_scipy(_design(x), y, 4, (0.01, 10.0), tol=1e-6)
    assert converged.all() and iterations[0] < iterations[1]
    _, capped, capped_converged = fit_logistic_scipy(_design(x), y, 4, (0.01, 10.0), tol=1e-6, max_iter=3)
    assert capped.tolist() == [3, 3] and not capped_converged.any()
    result = fit_one(x[:400], y[:400], x[400:], y[400:], x[400:], y[400:], 4, max_iter=3, solver="scipy")
    assert result.iterations == 3 and result.converged is False


def test_solver_choice():
    assert resolve_solver("auto", "cpu") == "scipy" and resolve_solver("auto", "cuda") == "torch"
    assert resolve_solver("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="probe solver 'newton'"):
        resolve_solver("newton", "cpu")


# ---------------------------------------------------------------------------------------------
# Streaming: a training set larger than the memory budget is read in chunks at every evaluation


def test_the_streamed_objective_is_the_in_memory_one():
    from cellpath.probing.fit import (InMemoryRows, _design, _StreamedTaskObjective, _TaskObjective, standardiser,
                                      streamed_standardiser)

    x, y = _data(20, 1000, k=4, d=12)
    rows = np.sort(np.random.default_rng(0).permutation(1000)[:700])
    source = InMemoryRows(x)
    scaler = standardiser(x[rows])
    np.testing.assert_allclose(streamed_standardiser(source, rows, 64), scaler, rtol=1e-12)
    whole = _TaskObjective(_design(x[rows], scaler), y[rows], 4, c=0.1)
    chunked = _StreamedTaskObjective(source, rows, y[rows], scaler, 4, c=0.1, chunk_rows=64)  # 11 chunks
    weights = np.random.default_rng(1).normal(size=13 * 4)
    (value, grad), (value_chunked, grad_chunked) = whole(weights), chunked(weights)
    assert value_chunked == pytest.approx(value, rel=1e-13)
    np.testing.assert_allclose(grad_chunked, grad, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("solver", ["scipy", "torch"])
def test_a_streamed_fit_equals_the_in_memory_fit(solver):
    from cellpath.probing.fit import design_row_bytes

    x, y = _data(21, 4000, k=4, d=24)
    tasks = _tasks(y, (2500,), ([0, 1, 2, 3],))
    in_memory = fit_tasks(x, y, 4, tasks, solver=solver, tol=1e-10)[0]
    budget_mb = 100 * design_row_bytes(24, 4) / 1024**2  # 100-row chunks: the 2,500 training rows in 25
    streamed = fit_tasks(x, y, 4, tasks, solver=solver, tol=1e-10, batch_memory_mb=budget_mb)[0]
    assert in_memory.converged and streamed.converged and in_memory.chosen_c == streamed.chosen_c
    assert (in_memory.test_pred == streamed.test_pred).all()
    for metric in ("macro_f1", "val_macro_f1", "macro_auroc", "macro_auprc"):
        assert abs(getattr(in_memory, metric) - getattr(streamed, metric)) <= 1e-9


def test_streaming_bounds_the_memory_of_a_fit():
    import tracemalloc

    from cellpath.probing.fit import design_row_bytes

    x, y = _data(22, 24000, k=3, d=64)
    tasks = _tasks(y, (20000,), ([0, 1, 2],))
    design_bytes = 20000 * 65 * 8

    def peak(budget_mb: float) -> int:
        tracemalloc.start()
        fit_tasks(x, y, 3, tasks, solver="scipy", c_grid=(1.0,), tol=1e-6, batch_memory_mb=budget_mb)
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak_bytes

    budget_mb = 500 * design_row_bytes(64, 3) / 1024**2
    assert peak(64) > design_bytes  # in memory: the (20,000 × 65) float64 design and more
    assert peak(budget_mb) < design_bytes / 4  # streamed: chunks of 500 rows (~0.3 MB each)
