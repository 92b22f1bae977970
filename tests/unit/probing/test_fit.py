"""The probe engine against scikit-learn's LogisticRegression on small seeded data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.preprocessing import StandardScaler

from cellpath.probing.fit import DEFAULT_C_GRID, fit_tasks
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
    x, y = _data(5, 800, k=3, d=6)
    x = StandardScaler().fit_transform(x)
    fit = fit_logistic_path(x, y, 3, (0.1, 1.0), tol=1e-7)
    assert bool(fit.converged.all())
    for i, c in enumerate((0.1, 1.0)):
        model = LogisticRegression(C=c, max_iter=10000, tol=1e-10).fit(x, y)
        ours = fit.weights[0, i].numpy()
        # Softmax weights are identified up to a per-feature constant across classes: centre both.
        ours_centred = ours - ours.mean(axis=1, keepdims=True)
        theirs = np.vstack([model.coef_.T, model.intercept_[None]])
        np.testing.assert_allclose(ours_centred, theirs - theirs.mean(axis=1, keepdims=True), atol=2e-5)


def test_correlated_features_reach_sklearns_optimum():
    """Features that share a few strong directions (as foundation-model embeddings do: XᵀX/n with a
    condition number near 10⁶) are where the preconditioner acts; the optimum is scikit-learn's."""
    rng = np.random.default_rng(8)
    y = rng.integers(0, 4, 1500)
    mixing = rng.normal(size=(5, 40)) * 30.0
    x = (rng.normal(size=(1500, 5)) @ mixing + rng.normal(size=(1500, 40)) * 0.05
         + np.eye(4)[y] @ rng.normal(size=(4, 40))).astype(np.float32)
    x = StandardScaler().fit_transform(x)
    fit = fit_logistic_path(x, y, 4, (0.01, 1.0), tol=1e-7)
    assert bool(fit.converged.all())
    for i, c in enumerate((0.01, 1.0)):
        model = LogisticRegression(C=c, max_iter=20000, tol=1e-10).fit(x, y)
        ours, theirs = fit.weights[0, i].numpy(), np.vstack([model.coef_.T, model.intercept_[None]])
        logits_ours, logits_theirs = x @ ours[:-1] + ours[-1], x @ theirs[:-1] + theirs[-1]
        np.testing.assert_allclose(logits_ours - logits_ours.mean(axis=1, keepdims=True),
                                   logits_theirs - logits_theirs.mean(axis=1, keepdims=True), atol=1e-3)


def test_a_design_stores_rows_as_read_and_standardises_each_product_chunk(tmp_path):
    """Rows that are float16 values (the feature store's) are stored as float16, others as float32,
    nothing rounded; each product standardises its chunk in float32 (within float32 rounding of the
    float64 standardisation), the float64 products within 1e-12 of it; held and streamed (a file in
    the work folder, removed on close) give the same bits."""
    import torch

    from cellpath.probing.engine import PRODUCT_ROWS, Design
    from cellpath.probing.fit import InMemoryRows

    rng = np.random.default_rng(4)
    raw = (rng.normal(size=(2 * PRODUCT_ROWS + 37, 24)) * 5 + 3).astype(np.float16).astype(np.float32)
    rows = np.arange(len(raw))[::-1].copy()  # any order
    exact = (raw[rows].astype(np.float64) - raw.mean(axis=0, dtype=np.float64)) / raw.std(axis=0, dtype=np.float64)
    v = torch.from_numpy(rng.normal(size=(1, 25, 6)))
    reference = exact @ v[0, :-1].numpy() + v[0, -1].numpy()
    for stored, values in ((torch.float16, raw), (torch.float32, raw + np.float32(1e-3) * (np.arange(24) == 5))):
        design = Design(InMemoryRows(values), [rows], "cpu")
        assert design.stored.dtype == stored and np.array_equal(design.stored[0].float().numpy(), values[rows])
    design = Design(InMemoryRows(raw), [rows], "cpu")
    mean, sd = design.scalers[0]
    np.testing.assert_allclose(mean, raw.mean(axis=0, dtype=np.float64), rtol=1e-13)
    np.testing.assert_allclose(sd, raw.std(axis=0, dtype=np.float64), rtol=1e-12)
    np.testing.assert_allclose(design.times(v)[0].numpy(), reference, rtol=0, atol=2e-5)
    np.testing.assert_allclose(design.exact_times(v, torch.tensor([0]))[0].numpy(), reference, rtol=0, atol=1e-11)
    r = torch.from_numpy(rng.normal(size=(1, len(rows), 3)))
    exact_t = np.vstack([exact.T @ r[0].numpy(), r[0].numpy().sum(axis=0)])
    np.testing.assert_allclose(design.exact_transpose_times(r, torch.tensor([0]))[0].numpy(), exact_t, atol=1e-10)
    np.testing.assert_allclose(design.transpose_times(r)[0].numpy(), exact_t, atol=2e-3)
    with Design(InMemoryRows(raw), [rows], "cpu", stream=True, work_dir=tmp_path) as streamed:
        assert streamed.streamed and len(list(tmp_path.iterdir())) == 1
        assert torch.equal(streamed.times(v), design.times(v))
        assert torch.equal(streamed.transpose_times(r), design.transpose_times(r))
        assert all(torch.equal(a, b) for a, b in zip(streamed.sample(), design.sample()))
    assert list(tmp_path.iterdir()) == []


def test_the_preconditioner_finds_the_leading_eigenpairs():
    import torch

    from cellpath.probing import engine
    from cellpath.probing.engine import Design, preconditioner
    from cellpath.probing.fit import InMemoryRows

    RANK = engine.rank_for(3000, 120)  # of 120 features: the others are taken as their mean
    assert RANK == engine.SMALL_RANK == 64

    rng = np.random.default_rng(9)
    x = (rng.normal(size=(3000, 8)) @ (rng.normal(size=(8, 120)) * np.linspace(10, 1, 8)[:, None])
         + rng.normal(size=(3000, 120))).astype(np.float32)
    rows = np.arange(3000)
    design = Design(InMemoryRows(x), [rows], "cpu")
    found = preconditioner(design, n_classes=4)
    standardised = (x - x.mean(axis=0, dtype=np.float64)) / x.std(axis=0, dtype=np.float64)
    exact = np.linalg.eigvalsh(standardised.T @ standardised / 3000)[::-1]
    np.testing.assert_allclose(found.top[0].numpy()[::-1][:8], exact[:8], rtol=1e-4)
    assert float(found.rest[0]) == pytest.approx(exact[RANK:].mean(), rel=0.15)  # the tail: an estimate
    basis = found.basis[0].numpy()
    np.testing.assert_allclose(basis.T @ basis, np.eye(RANK), atol=1e-6)  # a float32 subspace, rotated in float64
    assert found.curvature == 0.5 / 4 and torch.is_tensor(found.top)


def test_every_fit_records_its_iterations_and_convergence():
    x, y = _data(6, 500, k=4, d=10)
    x = StandardScaler().fit_transform(x)
    fit = fit_logistic_path(x, y, 4, (0.01, 10.0), tol=1e-6)
    assert fit.converged.all()
    assert fit.iterations[0, 0] < fit.iterations[0, 1]  # weak regularisation takes longer
    capped = fit_logistic_path(x, y, 4, (0.01, 10.0), tol=1e-6, max_iter=3)
    assert capped.iterations.tolist() == [[3, 3]] and not capped.converged.any()
    result = fit_one(x[:400], y[:400], x[400:], y[400:], x[400:], y[400:], 4, max_iter=3)
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


# --- groups: a task's result does not depend on the tasks fitted with it -----------------------------
def _tasks(y: np.ndarray, sizes, class_sets, seed: int = 0):
    from cellpath.probing.fit import ProbeTask

    rng = np.random.default_rng(seed)
    tasks = []
    for n, classes in zip(sizes, class_sets):
        rows = rng.permutation(np.flatnonzero(np.isin(y, classes)))
        tasks.append(ProbeTask(np.sort(rows[:n]), np.sort(rows[n:n + 200]), np.sort(rows[n + 200:n + 700]),
                               np.array(classes)))
    return tasks


def test_a_task_scores_the_same_alone_and_in_two_different_groups():
    """Alone, beside tasks of its size (padded into one batched product) and in other company, a task's
    fits differ only by float32 rounding: the same C, predictions and scores within 1e-3."""
    x, y = _data(11, 4000, k=5, d=24)
    tasks = _tasks(y, (400, 450, 480, 500, 1200, 470), ([0, 1, 2, 3, 4], [1, 3], [0, 2, 4], [0, 1, 2, 3, 4],
                                                        [2, 3, 4], [0, 1, 3]))
    alone = [fit_tasks(x, y, 5, [task])[0] for task in tasks]
    together = fit_tasks(x, y, 5, tasks)  # tasks 2 and 5 (three classes, 480 and 470 rows) share products
    reversed_ = fit_tasks(x, y, 5, tasks[::-2])[::-1]  # tasks 5, 3, 1
    for a, b in [*zip(alone, together), *zip(alone[1::2], reversed_)]:
        assert a.chosen_c == b.chosen_c and a.converged and b.converged
        assert (a.test_pred != b.test_pred).mean() <= 0.002
        for metric in ("macro_f1", "val_macro_f1", "macro_auroc", "macro_auprc"):
            assert abs(getattr(a, metric) - getattr(b, metric)) <= 1e-3
    for result, task in zip(together, tasks):
        assert set(np.unique(result.test_pred)) <= set(task.classes)  # never predicts an unscored class


def _same_bits(a, b) -> None:
    for p, q in zip(a, b, strict=True):
        assert (p.chosen_c, p.tied_cs, p.iterations, p.converged) == (q.chosen_c, q.tied_cs, q.iterations, q.converged)
        assert p.val_scores == q.val_scores  # every C's exact validation Macro-F1
        for metric in ("macro_f1", "val_macro_f1", "macro_auroc", "macro_auprc"):
            assert getattr(p, metric) == getattr(q, metric), metric
        assert np.array_equal(p.test_pred, q.test_pred) and np.array_equal(p.test_confidence, q.test_confidence)


def test_the_cpu_threads_change_no_bit():
    """One CPU thread or two: the same fits to the bit (LAPACK's QR and eigh, and a whole-tensor sum,
    round differently on two threads: the preconditioner runs them on one)."""
    import torch

    x, y = _data(31, 3000, k=5, d=96)
    tasks = _tasks(y, (700, 800), ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fit_tasks(x, y, 5, tasks)
        torch.set_num_threads(2)
        two = fit_tasks(x, y, 5, tasks)
    finally:
        torch.set_num_threads(saved)
    assert torch.get_num_threads() == saved
    _same_bits(one, two)


def test_the_memory_available_changes_no_bit(monkeypatch, tmp_path):
    """``"auto"`` forms groups within ``AUTO_GROUP_MB`` whatever the memory: with 16 MiB to hold
    designs in, the four tasks' 21 MB group is streamed from a file, not split, and every result
    is the same to the bit as with the memory this machine has."""
    from types import SimpleNamespace

    from cellpath.probing import fit as fit_module
    from cellpath.probing.fit import design_row_bytes

    x, y = _data(32, 14000, k=3, d=256)
    tasks = _tasks(y, (3000, 3100, 3200, 3300), ([0, 1, 2],) * 4)
    assert 4 * 3300 * design_row_bytes(256, 3 * len(DEFAULT_C_GRID)) > 16 * 1024**2
    designs = []

    class Recorded(fit_module.Design):
        def close(self):
            designs.append((len(self.rows), self.streamed))
            super().close()

    monkeypatch.setattr(fit_module, "Design", Recorded)
    plenty = fit_tasks(x, y, 3, tasks, batch_memory_mb="auto", work_dir=tmp_path)
    monkeypatch.setattr(fit_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=1024**2))
    scarce = fit_tasks(x, y, 3, tasks, batch_memory_mb="auto", work_dir=tmp_path)
    assert designs == [(4, False), (4, True)]
    _same_bits(plenty, scarce)
    assert list(tmp_path.iterdir()) == []


def test_groups_respect_classes_memory_and_padding():
    from cellpath.probing.fit import ProbeTask, task_groups

    sizes = [100, 110, 120, 400, 420, 2000, 105]
    classes = [2, 2, 2, 2, 2, 2, 3]
    tasks = [ProbeTask(np.arange(n), np.arange(1), np.arange(1), np.arange(k)) for n, k in zip(sizes, classes)]
    groups = task_groups(tasks, row_bytes=80, budget_bytes=10**9)
    assert [[sizes[i] for i in g] for g in groups] == [[100, 110, 120], [400, 420], [2000], [105]]
    small_budget = task_groups(tasks, row_bytes=80, budget_bytes=2 * 120 * 80)
    assert [[sizes[i] for i in g] for g in small_budget] == [[100, 110], [120], [400], [420], [2000], [105]]
    assert task_groups(tasks[::-1], row_bytes=80, budget_bytes=10**9) == [[6 - i for i in g] for g in groups]


def test_two_class_fits_are_scikit_learns_binary_model():
    """scikit-learn fits one vector v with ||v||²/(2C) for two classes; the probe's two columns must give
    the same logit difference (a two-column softmax penalised as for K > 2 is scikit-learn's model at 2C)."""
    x, y = _data(7, 600, k=2, d=8, separation=0.8)
    x = StandardScaler().fit_transform(x)
    for c in (0.05, 1.0):
        w = fit_logistic_path(x, y, 2, (c,), tol=1e-8).weights[0, 0].numpy()
        model = LogisticRegression(C=c, tol=1e-10, max_iter=10000).fit(x, y)
        np.testing.assert_allclose(w[:-1, 1] - w[:-1, 0], model.coef_[0], atol=2e-5)
        np.testing.assert_allclose(w[-1, 1] - w[-1, 0], model.intercept_[0], atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Streaming: a training set larger than the memory budget is read in chunks at every product


def test_a_streamed_fit_equals_the_in_memory_fit(tmp_path):
    """Held or streamed from its file in the work folder, a task's fits read the same chunks in the
    same order: the same results to the bit, and the file is gone afterwards."""
    from cellpath.probing.fit import design_row_bytes

    x, y = _data(21, 4000, k=4, d=24)
    tasks = _tasks(y, (2500,), ([0, 1, 2, 3],))
    in_memory = fit_tasks(x, y, 4, tasks, tol=1e-7)[0]
    budget_mb = 100 * design_row_bytes(24, 4 * len(DEFAULT_C_GRID)) / 1024**2  # 100-row reads: 25 of them
    streamed = fit_tasks(x, y, 4, tasks, tol=1e-7, batch_memory_mb=budget_mb, work_dir=tmp_path)[0]
    assert in_memory.converged and streamed.converged and in_memory.chosen_c == streamed.chosen_c
    assert (in_memory.test_pred == streamed.test_pred).all() and in_memory.iterations == streamed.iterations
    for metric in ("macro_f1", "val_macro_f1", "macro_auroc", "macro_auprc"):
        assert getattr(in_memory, metric) == getattr(streamed, metric)
    assert list(tmp_path.iterdir()) == []


def test_a_task_is_held_exactly_while_its_rows_fit_the_budget(monkeypatch, tmp_path):
    """A task of n training rows is held when n ≤ budget ÷ design_row_bytes(D, Cs × classes), else
    streamed from a file in the work folder; either way its training rows are read from the source once."""
    from cellpath.probing import fit as fit_module
    from cellpath.probing.fit import ProbeTask, design_row_bytes

    width, n_classes = 16, 3
    budget_mb = 200 * design_row_bytes(width, n_classes) / 1024**2  # one C: exactly 200 rows held
    x, y = _data(23, 400, k=n_classes, d=width)
    streamed = []

    class Recorded(fit_module.Design):
        def close(self):
            streamed.append(self.streamed)
            super().close()

    monkeypatch.setattr(fit_module, "Design", Recorded)

    class Counting:
        width = 16

        def __init__(self):
            self.rows_read = 0

        def take(self, rows):
            self.rows_read += len(rows)
            return x[rows]

    for n_train, held in ((200, True), (201, False)):
        source = Counting()
        task = ProbeTask(train=np.arange(n_train), val=np.arange(300, 350), test=np.arange(350, 400),
                         classes=np.arange(n_classes))
        fit_tasks(source, y, n_classes, [task], c_grid=(1.0,), max_iter=5, batch_memory_mb=budget_mb,
                  work_dir=tmp_path)
        assert source.rows_read - 100 == n_train  # validation and test rows are read once each
        assert streamed.pop() == (not held)


def test_streaming_bounds_the_memory_of_a_fit(monkeypatch):
    """Streamed, a fit holds its reads, labels, weights and the preconditioner's sample (``SAMPLE_ROWS``
    rows, whatever the budget: 84 MB at D = 1,280), not its design."""
    import tracemalloc

    from cellpath.probing import engine
    from cellpath.probing.fit import design_row_bytes

    monkeypatch.setattr(engine, "SAMPLE_ROWS", 1000)  # 1,000 of 20,000 rows: 0.26 MB

    x, y = _data(22, 24000, k=3, d=64)
    tasks = _tasks(y, (20000,), ([0, 1, 2],))
    design_bytes = 20000 * 64 * 4  # float32 rows (these are not float16 values)

    def peak(budget_mb: float) -> int:
        tracemalloc.start()
        fit_tasks(x, y, 3, tasks, c_grid=(1.0,), tol=1e-6, batch_memory_mb=budget_mb)
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak_bytes

    budget_mb = 500 * design_row_bytes(64, 3) / 1024**2
    assert peak(64) > design_bytes  # in memory: the (20,000 × 64) float32 design and more
    assert peak(budget_mb) < design_bytes / 3  # streamed (a mapped file): reads of 500 rows, labels, weights


def test_a_streamed_design_widens_in_place_and_leaves_no_file_when_its_source_fails(tmp_path):
    """Rows read 100 at a time: float16 values first, then a row that is not one; the streamed file
    is rewritten as float32 with every row kept, and one file remains until close. A source that
    fails mid-way leaves nothing in the work folder."""
    from cellpath.probing.engine import Design
    from cellpath.probing.fit import InMemoryRows

    rng = np.random.default_rng(12)
    raw = rng.normal(size=(350, 8)).astype(np.float16).astype(np.float32)
    raw[270, 3] = np.float32(0.1)  # not a float16 value
    with Design(InMemoryRows(raw), [np.arange(350)], "cpu", stream=True, work_dir=tmp_path, read_rows=100) as design:
        assert design.stored.dtype == np.float32 and np.array_equal(design.stored[0], raw)
        assert len(list(tmp_path.iterdir())) == 1

    class Failing:
        width = 8

        def take(self, rows):
            if rows[0] >= 200:
                raise OSError("the feature store went away")
            return raw[rows]

    with pytest.raises(OSError, match="went away"):
        Design(Failing(), [np.arange(350)], "cpu", stream=True, work_dir=tmp_path, read_rows=100)
    assert list(tmp_path.iterdir()) == []
