"""Planning probe runs: gates, skips with reasons, the training cap, and no test cell in fitting."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cellpath.config import ProbeConfig
from cellpath.probing.plan import class_codes, plan_runs
from cellpath.vocabulary import PROTOCOLS


def _cells(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frames = []
    for organ, n_sections in {"Breast": 3, "Colon": 2, "Lymphoid": 1}.items():
        for i in range(n_sections):
            n = 300
            fine = rng.choice(["Lymphocyte", "Neoplastic", "Fibroblast/Stromal cell"], n, p=[0.3, 0.5, 0.2])
            if organ == "Lymphoid":
                fine = np.where(rng.random(n) < 0.9, "Lymphocyte", "Fibroblast/Stromal cell")
            coarse = pd.Series(fine).map({"Lymphocyte": "Immune/Inflammatory", "Neoplastic": "Epithelial/Tumor",
                                          "Fibroblast/Stromal cell": "Stromal/Structural"}).to_numpy()
            frames.append(pd.DataFrame({"section_id": f"{organ.lower()}_{i}", "organ": organ,
                                        "x_um": rng.uniform(0, 500, n), "y_um": rng.uniform(0, 500, n),
                                        "fine": fine, "coarse": coarse}))
    return pd.concat(frames, ignore_index=True)


def _cfg(**overrides) -> ProbeConfig:
    base = {"seeds": {"is": 2, "iocd": 2, "mocv": 1, "looo": 1}, "mocv_folds": 3,
            "min_train_cells": {"fine": 20, "coarse": 20}, "min_test_cells": {"fine": 20, "coarse": 20}}
    return ProbeConfig.model_validate(base | overrides)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tasks_never_fit_on_test_cells_and_score_only_gated_classes(protocol):
    cells = _cells()
    codes, names = class_codes(cells["fine"])
    runs = plan_runs(cells, protocol, "fine", _cfg(max_train_cells=150))
    assert runs
    for run in runs:
        if run.task is None:
            continue
        task = run.task
        test_sections = set(cells.loc[task.test, "section_id"])
        fit = np.concatenate([task.train, task.val])
        assert not set(fit) & set(task.test)
        if protocol != "is":
            assert not test_sections & set(cells.loc[fit, "section_id"])
        assert len(task.train) <= 150
        assert set(codes[np.concatenate([fit, task.test])]) <= set(task.classes)
        for c in task.classes:
            assert (codes[task.train] == c).sum() >= 20 and (codes[task.test] == c).sum() >= 20


def test_units_with_fewer_than_two_gated_classes_are_skipped_with_a_reason():
    cells = _cells()
    runs = plan_runs(cells, "is", "fine", _cfg())
    lymphoid = [r for r in runs if r.unit == "lymphoid_0"]
    assert len(lymphoid) == 2 and all(r.task is None for r in lymphoid)  # 90 % lymphocytes: one class passes
    assert "1 class(es) with ≥20 train and ≥20 test cells" in lymphoid[0].skip_reason
    row = lymphoid[0].row(class_codes(cells["fine"])[1])
    assert row["status"] == "skipped" and row["n_classes"] == 0
    assert sum(r.task is not None for r in runs) == 2 * 5  # the other five sections × two seeds


def test_the_training_cap_is_seeded_and_shared_by_taxonomies():
    cells = _cells()
    first = plan_runs(cells, "looo", "fine", _cfg(max_train_cells=100))
    again = plan_runs(cells, "looo", "fine", _cfg(max_train_cells=100))
    coarse = plan_runs(cells, "looo", "coarse", _cfg(max_train_cells=100))
    for a, b, c in zip(first, again, coarse):
        assert np.array_equal(a.task.train, b.task.train)
        if len(a.task.classes) == len(c.task.classes) == 3:  # every class gated in both: the same cells
            assert np.array_equal(a.task.train, c.task.train)


def test_too_many_folds_is_a_config_error():
    from cellpath.errors import ConfigError

    with pytest.raises(ConfigError, match="mocv_folds"):
        plan_runs(_cells(), "mocv", "fine", _cfg(mocv_folds=10))


def test_unknown_protocol_lists_the_valid_ones():
    from cellpath.config import parse_params
    from cellpath.errors import ConfigError
    from helpers.project import tiny_params

    data = tiny_params().model_dump(mode="json") | {"protocol": "xval"}
    with pytest.raises(ConfigError, match="protocol.*'all', 'is', 'iocd', 'mocv' or 'looo'"):
        parse_params(data)


def test_confident_errors_are_each_is_runs_most_confident_misclassified_test_cells():
    """Checked against an independent fit: scikit-learn's LogisticRegression at the run's chosen C, on the
    run's standardised training rows, predicts the same classes and probabilities."""
    from sklearn.linear_model import LogisticRegression

    from cellpath.probing.plan import ERROR_COLUMNS, fit_condition

    cells = _cells(seed=4).assign(cell_id=lambda f: [f"cell-{i}" for i in range(len(f))])
    rng = np.random.default_rng(5)
    codes, names = class_codes(cells["fine"])
    x = (rng.standard_normal((3, 6))[codes] * 0.6 + rng.standard_normal((len(cells), 6))).astype(np.float32)
    cfg = _cfg(is_errors=4, c_grid=[0.1, 1.0], tol=1e-10)
    runs = [run for run in plan_runs(cells, "is", "fine", cfg) if run.task is not None][:3] \
        + plan_runs(cells, "iocd", "fine", cfg)[:1]
    frame, errors, _ = fit_condition(x, cells, runs, cfg)
    assert list(errors.columns) == ERROR_COLUMNS
    assert set(errors["protocol"]) == {"is"}  # other protocols keep none
    for run, row in zip(runs[:3], frame.itertuples()):
        task = run.task
        mean, sd = x[task.train].mean(axis=0), x[task.train].std(axis=0)
        model = LogisticRegression(C=row.chosen_c, tol=1e-12, max_iter=10000)
        model.fit((x[task.train] - mean) / sd, codes[task.train])
        probabilities = model.predict_proba((x[task.test] - mean) / sd)
        predicted = model.classes_[probabilities.argmax(axis=1)]
        wrong = np.flatnonzero(predicted != codes[task.test])
        expected = wrong[np.argsort(-probabilities.max(axis=1)[wrong], kind="stable")][:4]
        mine = errors[(errors["unit"] == run.unit) & (errors["seed"] == run.seed)]
        assert len(mine) == min(4, len(wrong)) > 0
        assert mine["cell_id"].tolist() == cells["cell_id"].to_numpy()[task.test[expected]].tolist()
        np.testing.assert_allclose(mine["confidence"], probabilities.max(axis=1)[expected], atol=1e-4)
        assert (mine["true_class"] != mine["predicted_class"]).all()
        assert mine["true_class"].tolist() == [names[c] for c in codes[task.test[expected]]]
        assert mine["confidence"].is_monotonic_decreasing
