"""The choice of C on validation: exact Macro-F1 from integer counts, the smallest C on exact ties."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from sklearn.metrics import f1_score

from cellpath.probing.fit import DEFAULT_C_GRID, ProbeTask, fit_tasks
from cellpath.probing.scores import exact_macro_f1, macro_f1, select_c

CLASSES = np.array([2, 5, 7])  # class indices of a taxonomy, as a task scores them
Y_VAL = np.repeat(CLASSES, 4)  # four validation cells of each class: classes 2 and 5 are symmetric


def _predictions() -> list[np.ndarray]:
    """Validation predictions per C of DEFAULT_C_GRID: C=0.1 and C=1.0 make mirrored mistakes."""
    everything_two = np.full(12, 2)                       # F1 (1/2, 0, 0): 1/6
    two_as_five = Y_VAL.copy()
    two_as_five[0] = 5                                    # F1 (6/7, 8/9, 1): 173/189
    five_as_two = Y_VAL.copy()
    five_as_two[4] = 2                                    # F1 (8/9, 6/7, 1): 173/189
    two_and_seven_swapped = Y_VAL.copy()
    two_and_seven_swapped[[0, 8]] = [7, 2]                # F1 (3/4, 1, 3/4): 5/6
    return [everything_two, two_as_five, five_as_two, two_and_seven_swapped]


def _probabilities(predictions: list[np.ndarray]) -> np.ndarray:
    """(C, cells, classes) probabilities whose argmax is each prediction: 0.8 on it, 0.1 on the others."""
    hit = np.stack([p[:, None] == CLASSES[None, :] for p in predictions])
    return np.where(hit, 0.8, 0.1)


def test_an_exact_tie_chooses_the_smaller_c_and_counts_both():
    selection = select_c(Y_VAL, _predictions(), CLASSES, DEFAULT_C_GRID)
    assert selection == (1, 2, Fraction(173, 189))
    assert DEFAULT_C_GRID[selection.position] == 0.1


@pytest.mark.parametrize("seed", range(5))
def test_a_tie_survives_float_noise_on_the_probabilities_and_reordered_cells(seed):
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(Y_VAL))
    probabilities = _probabilities(_predictions())[:, order] + rng.normal(scale=1e-12, size=(4, len(Y_VAL), 3))
    predictions = [CLASSES[p.argmax(axis=1)] for p in probabilities]  # as the probe predicts
    assert select_c(Y_VAL[order], predictions, CLASSES, DEFAULT_C_GRID) == (1, 2, Fraction(173, 189))


def test_a_tie_that_float_macro_f1_breaks_by_rounding_is_a_tie():
    """Per-class F1 (1/2, 2/3, 2/5) and (1/2, 2/5, 2/3): one rational Macro-F1, two float sums."""
    y = np.array([0, 0, 1, 1, 2, 2])
    classes = np.arange(3)
    first = np.array([2, 0, 2, 1, 2, 0])
    second = np.array([0, 1, 1, 0, 2, 1])
    assert exact_macro_f1(y, first, classes) == exact_macro_f1(y, second, classes) == Fraction(47, 90)
    assert macro_f1(y, first, classes) < macro_f1(y, second, classes)  # a float argmax would take C=0.1
    assert select_c(y, [first, second], classes, (0.01, 0.1)) == (0, 2, Fraction(47, 90))


def test_a_strict_winner_is_chosen_even_at_the_largest_c():
    predictions = _predictions()
    predictions[3] = Y_VAL.copy()  # every validation cell right at C=10
    assert select_c(Y_VAL, predictions, CLASSES, DEFAULT_C_GRID) == (3, 1, Fraction(1))


@pytest.mark.parametrize("c_grid", [(0.1, 0.01, 1.0, 10.0), (0.01, 0.1, 0.1, 10.0), ()])
def test_a_grid_that_is_not_strictly_ascending_is_refused(c_grid):
    with pytest.raises(ValueError, match="strictly ascending"):
        select_c(Y_VAL, _predictions()[:len(c_grid)], CLASSES, c_grid)


def test_fit_tasks_refuses_a_descending_grid_before_fitting():
    task = ProbeTask(np.arange(6), np.arange(6, 9), np.arange(9, 12), classes=np.arange(2))
    with pytest.raises(ValueError, match="strictly ascending"):
        fit_tasks(np.zeros((12, 3), dtype=np.float32), np.zeros(12, dtype=np.int64), 2, [task], c_grid=(1.0, 0.1))


def test_one_prediction_vector_per_c():
    with pytest.raises(ValueError, match="3 prediction vectors for a C grid of 4"):
        select_c(Y_VAL, _predictions()[:3], CLASSES, DEFAULT_C_GRID)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_macro_f1_is_macro_f1_without_rounding(seed):
    rng = np.random.default_rng(seed)
    classes = np.array([1, 4, 6, 7, 9])  # 9: neither true nor predicted, so F1 0
    y = rng.choice(classes[:4], 200)
    pred = rng.choice(classes[:4], 200)
    exact = exact_macro_f1(y, pred, classes)
    assert float(exact) == pytest.approx(macro_f1(y, pred, classes), abs=1e-15)
    assert float(exact) == pytest.approx(f1_score(y, pred, labels=classes, average="macro", zero_division=0),
                                         abs=1e-15)
    assert exact_macro_f1(y, y, classes) == Fraction(4, 5)


def test_fit_tasks_records_how_many_cs_tied():
    """Classes 8 SD apart: every C classifies every validation cell, so all four tie and C=0.01 is chosen."""
    rng = np.random.default_rng(0)
    y = np.tile(np.arange(3), 60)
    x = (8.0 * np.eye(3)[y] + rng.normal(size=(len(y), 3))).astype(np.float32)
    task = ProbeTask(np.arange(120), np.arange(120, 150), np.arange(150, 180), classes=np.arange(3))
    result = fit_tasks(x, y, 3, [task])[0]
    assert (result.chosen_c, result.tied_cs, result.val_macro_f1) == (0.01, 4, 1.0)
