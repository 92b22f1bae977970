"""A probe run's scores: Macro-F1, Macro-AUROC and Macro-AUPRC over the classes it scores, and the
choice of C on validation Macro-F1.

Written from the definitions (rank-sum AUROC, step-wise average precision) so a run table needs
no scikit-learn at scoring time; ``tests/unit/probing/test_fit.py`` checks each against
scikit-learn, ``tests/unit/probing/test_c_selection.py`` the choice of C.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

import numpy as np
from scipy.stats import rankdata


def _f1_counts(y_true: np.ndarray, y_pred: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per class of ``classes``: true positives TP and the F1 denominator 2TP + FP + FN (true + predicted cells)."""
    true_hit = y_true[:, None] == classes[None, :]
    pred_hit = y_pred[:, None] == classes[None, :]
    return (true_hit & pred_hit).sum(axis=0), true_hit.sum(axis=0) + pred_hit.sum(axis=0)


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, classes: np.ndarray) -> float:
    """Unweighted mean over ``classes`` of per-class F1 (0 where a class is neither true nor predicted).

    The same as ``sklearn.metrics.f1_score(..., labels=classes, average="macro", zero_division=0)``.
    """
    tp, denominator = _f1_counts(y_true, y_pred, classes)
    f1 = np.divide(2.0 * tp, denominator, out=np.zeros(len(classes)), where=denominator > 0)
    return float(f1.mean()) if len(classes) else float("nan")


def exact_macro_f1(y_true: np.ndarray, y_pred: np.ndarray, classes: np.ndarray) -> Fraction:
    """:func:`macro_f1` as an exact fraction of the integer counts: the mean over ``classes`` of
    2TP / (2TP + FP + FN), 0 where a class is neither true nor predicted."""
    if not len(classes):
        raise ValueError("Macro-F1 needs at least one class")
    tp, denominator = _f1_counts(y_true, y_pred, classes)
    total = sum((Fraction(2 * int(t), int(d)) for t, d in zip(tp, denominator) if d), Fraction(0))
    return total / len(classes)


def check_c_grid(c_grid: Sequence[float]) -> None:
    """Raise ValueError unless ``c_grid`` holds at least one C, strictly ascending (strongest
    regularisation first), as :func:`select_c` needs."""
    if not len(c_grid) or any(a >= b for a, b in zip(c_grid, c_grid[1:])):
        raise ValueError(f"the C grid must hold at least one C, strictly ascending (strongest regularisation "
                         f"first); got {list(c_grid)}")


class CSelection(NamedTuple):
    """The C chosen on validation: its position in the grid, how many Cs tied at the best Macro-F1
    (1: no tie) and that Macro-F1, exact."""

    position: int
    tied: int
    macro_f1: Fraction


def validation_scores(y_true: np.ndarray, predictions: Sequence[np.ndarray], classes: np.ndarray) -> list[Fraction]:
    """Each C's exact validation Macro-F1 (:func:`exact_macro_f1` of ``predictions[i]`` over ``classes``):
    the values :func:`choose_c` decides on, and that the probe stores per C (``probe/c_scores.parquet``)."""
    return [exact_macro_f1(y_true, y_pred, classes) for y_pred in predictions]


def choose_c(scores: Sequence[Fraction], c_grid: Sequence[float]) -> CSelection:
    """The tie rule: of the Cs of ``c_grid`` (strictly ascending, :func:`check_c_grid`) whose exact
    validation Macro-F1 ``scores[i]`` equals the maximum, the smallest (the strongest
    regularisation), and how many reach it. Equality of rational numbers, never of floats."""
    check_c_grid(c_grid)
    if len(scores) != len(c_grid):
        raise ValueError(f"{len(scores)} scores for a C grid of {len(c_grid)}")
    best = max(scores)
    tied = [i for i, score in enumerate(scores) if score == best]
    return CSelection(tied[0], len(tied), best)


def select_c(y_true: np.ndarray, predictions: Sequence[np.ndarray], classes: np.ndarray,
             c_grid: Sequence[float]) -> CSelection:
    """The C of ``c_grid`` (strictly ascending, :func:`check_c_grid`) whose validation predictions
    (``predictions[i]``: the predicted class of each cell of ``y_true`` under ``c_grid[i]``) score the
    highest :func:`exact_macro_f1` over ``classes``; among Cs whose exact Macro-F1 equals that
    maximum, the smallest (the strongest regularisation): :func:`choose_c` on
    :func:`validation_scores`. Ties are equality of rational numbers, never of floats, so the choice
    does not depend on rounding or on the order of the cells."""
    check_c_grid(c_grid)
    if len(predictions) != len(c_grid):
        raise ValueError(f"{len(predictions)} prediction vectors for a C grid of {len(c_grid)}")
    return choose_c(validation_scores(y_true, predictions, classes), c_grid)


def fraction_text(value: Fraction) -> str:
    """An exact fraction as ``"p/q"`` (always both parts: ``"1/1"``, ``"0/1"``); ``Fraction(text)`` reads it back."""
    return f"{value.numerator}/{value.denominator}"


def binary_auroc(positive: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U; tied scores share their mean rank)."""
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(score)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_precision(positive: np.ndarray, score: np.ndarray) -> float:
    """Average precision Σ (R_k − R_{k−1}) P_k over distinct score thresholds (sklearn's definition)."""
    n_pos = int(positive.sum())
    if n_pos == 0:
        return float("nan")
    order = np.argsort(-score, kind="mergesort")
    ordered_score, hits = score[order], positive[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(ordered_score)), len(ordered_score) - 1]
    tps = np.cumsum(hits)[last_of_tie]
    precision = tps / (last_of_tie + 1.0)
    recall_step = np.diff(np.r_[0, tps]) / n_pos
    return float((recall_step * precision).sum())


def macro_scores(y_true: np.ndarray, probabilities: np.ndarray, classes: np.ndarray) -> tuple[float, float, float]:
    """Macro-F1, Macro-AUROC and Macro-AUPRC over ``classes`` (probabilities: one column per class).

    AUROC and AUPRC are one-vs-rest, averaged over the classes present in ``y_true`` (AUROC needs
    at least two present classes, else NaN) — as scikit-learn's macro averages on those columns.
    """
    f1 = macro_f1(y_true, classes[probabilities.argmax(axis=1)], classes)
    present = [k for k, c in enumerate(classes) if (y_true == c).any()]
    if len(present) < 2:
        return f1, float("nan"), float("nan")
    auroc = np.mean([binary_auroc(y_true == classes[k], probabilities[:, k]) for k in present])
    auprc = np.mean([average_precision(y_true == classes[k], probabilities[:, k]) for k in present])
    return f1, float(auroc), float(auprc)
