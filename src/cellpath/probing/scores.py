"""A probe run's test scores: Macro-F1, Macro-AUROC and Macro-AUPRC over the classes it scores.

Written from the definitions (rank-sum AUROC, step-wise average precision) so a run table needs
no scikit-learn at scoring time; ``tests/unit/probing/test_scores.py`` checks each against
scikit-learn.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, classes: np.ndarray) -> float:
    """Unweighted mean over ``classes`` of per-class F1 (0 where a class is neither true nor predicted).

    The same as ``sklearn.metrics.f1_score(..., labels=classes, average="macro", zero_division=0)``.
    """
    true_hit = y_true[:, None] == classes[None, :]
    pred_hit = y_pred[:, None] == classes[None, :]
    tp = (true_hit & pred_hit).sum(axis=0)
    denominator = true_hit.sum(axis=0) + pred_hit.sum(axis=0)
    f1 = np.divide(2.0 * tp, denominator, out=np.zeros(len(classes)), where=denominator > 0)
    return float(f1.mean()) if len(classes) else float("nan")


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
