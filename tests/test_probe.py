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


# --- metrics: cross-checked against scikit-learn ----------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_macro_metrics_equal_sklearn(seed):
    from sklearn.metrics import average_precision_score, roc_auc_score

    from cellpath.probe import average_precision, binary_auroc, macro_f1, macro_scores

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
    from cellpath.probe import macro_f1

    y = np.array([0, 0, 1, 1])
    assert macro_f1(y, y, np.array([0, 1, 2])) == pytest.approx(2 / 3)


def test_metrics_golden_values():
    from cellpath.probe import average_precision, binary_auroc

    positive = np.array([True, False, True, False, True])
    score = np.array([0.9, 0.8, 0.7, 0.7, 0.1])
    # Pairs (pos, neg): (0.9,0.8)=1 (0.9,0.7)=1 (0.7,0.8)=0 (0.7,0.7)=0.5 (0.1,·)=0 → 2.5 / 6.
    assert binary_auroc(positive, score) == pytest.approx(2.5 / 6)
    # Thresholds 0.9 (P=1, R=1/3), 0.8 (P=1/2, R=1/3), 0.7 (P=2/4, R=2/3), 0.1 (P=3/5, R=1).
    assert average_precision(positive, score) == pytest.approx(1 / 3 * 1 + 1 / 3 * 0.5 + 1 / 3 * 0.6)


# --- batches: many probes at once equal the same probes one by one ------------------------------------
def test_a_batch_of_tasks_with_different_classes_equals_separate_fits():
    from cellpath.probe import ProbeTask, fit_tasks

    x, y = _data(11, 3000, k=5, d=24)
    rng = np.random.default_rng(0)
    tasks = []
    for i, classes in enumerate([[0, 1, 2, 3, 4], [1, 3], [0, 2, 4], [0, 1, 2, 3, 4]]):
        rows = rng.permutation(np.flatnonzero(np.isin(y, classes)))
        n = (400, 700, 900, 1200)[i]
        tasks.append(ProbeTask(np.sort(rows[:n]), np.sort(rows[n:n + 200]), np.sort(rows[n + 200:n + 700]),
                               np.array(classes)))
    together = fit_tasks(x, y, 5, tasks, max_iter=200, batch_memory_mb=64)
    alone = [fit_tasks(x, y, 5, [task], max_iter=200)[0] for task in tasks]
    for a, b, task in zip(together, alone, tasks):
        assert set(np.unique(a.test_pred)) <= set(task.classes)  # never predicts an unscored class
        assert a.chosen_c == b.chosen_c
        assert abs(a.macro_f1 - b.macro_f1) <= 0.01 and abs(a.macro_auroc - b.macro_auroc) <= 0.005


def test_batches_respect_memory_and_padding():
    from cellpath.probe import ProbeTask, _batches

    sizes = [100, 110, 120, 400, 420, 2000]
    tasks = [ProbeTask(np.arange(n), np.arange(1), np.arange(1), np.arange(2)) for n in sizes]
    groups = _batches(tasks, width=10, budget_bytes=10**9)
    assert [[sizes[i] for i in g] for g in groups] == [[100, 110, 120], [400, 420], [2000]]
    small_budget = _batches(tasks, width=10, budget_bytes=2 * 120 * 10 * 4 * 3)
    assert all(len(g) <= 2 for g in small_budget)
