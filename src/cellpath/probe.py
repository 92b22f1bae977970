"""The linear probe: multinomial logistic regression on standardised features, L2 chosen on validation.

Written for throughput. A *task* is one probe run (train/val/test rows of one feature matrix and
the classes it scores). Tasks are fitted in batches: the batch's training matrices, each
standardised with its own training mean and SD, are padded into one (T, n, D + 1) tensor, and
the weights of every task and every candidate L2 strength form one (T, D + 1, L·K) tensor, so
each L-BFGS step is a single batched matrix product. One L-BFGS run minimises the sum of the
T·L independent objectives (the sum separates, so its minimum is each one's minimum) — in torch,
on the CPU here and on CUDA where available. Classes a task does not score get a fixed −10⁴
logit offset, so one batch mixes tasks with different gated classes.

Each objective is scikit-learn's scaled by 1/n: mean cross-entropy + ||W||² / (2·C·n) (intercept
unpenalised), so ``C`` means what it means in ``sklearn.linear_model.LogisticRegression``. The
candidate with the best validation Macro-F1 (the strongest regularisation on ties) scores the
test cells: Macro-F1, Macro-AUROC and Macro-AUPRC over the task's classes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata

DEFAULT_C_GRID = (0.01, 0.1, 1.0, 10.0)
_MASKED_LOGIT = -1e4


@dataclass(frozen=True)
class ProbeTask:
    """One probe run: row positions into the feature matrix, and the class indices it scores.

    Rows of ``train``/``val``/``test`` must carry labels in ``classes`` (the caller drops cells of
    classes that fail the gate).
    """

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    classes: np.ndarray


@dataclass(frozen=True)
class ProbeResult:
    """Scores of one probe run on its test cells, over the task's classes."""

    chosen_c: float
    macro_f1: float
    macro_auroc: float
    macro_auprc: float
    val_macro_f1: float
    fit_seconds: float
    test_pred: np.ndarray  # predicted label per test cell (a class index of the taxonomy)


def _penalised_nll(design: torch.Tensor, flat: torch.Tensor, targets: torch.Tensor, sample_weight: torch.Tensor,
                   class_offset: torch.Tensor, penalty: torch.Tensor, n_c: int, n_classes: int) -> torch.Tensor:
    """Σ over tasks and candidates of weighted CE + penalty·||W||² (intercept row unpenalised).

    ``targets``: (T, n, L) class index per row and candidate; ``class_offset``: (T, 1, L·K).
    """
    t, n, d1 = design.shape
    logits = torch.baddbmm(class_offset, design, flat).view(t * n * n_c, n_classes)
    nll = torch.nn.functional.cross_entropy(logits, targets.reshape(-1), reduction="none").view(t, n, n_c)
    data_term = torch.einsum("tnl,tn->tl", nll, sample_weight)
    weights = flat[:, :-1].view(t, d1 - 1, n_c, n_classes)
    return (data_term + penalty * (weights**2).sum(dim=(1, 3))).sum()


def _minimise(design: torch.Tensor, targets: torch.Tensor, sample_weight: torch.Tensor, class_offset: torch.Tensor,
              penalty: torch.Tensor, init: torch.Tensor, n_classes: int, max_iter: int, tol: float) -> torch.Tensor:
    """L-BFGS (strong Wolfe) on the summed objectives from ``init`` (T, D + 1, L·K); returns the weights."""
    n_c = penalty.shape[1]
    flat = init.clone().requires_grad_(True)
    optimiser = torch.optim.LBFGS([flat], lr=1.0, max_iter=max_iter, tolerance_grad=tol, tolerance_change=1e-9,
                                  history_size=20, line_search_fn="strong_wolfe")
    offset = class_offset.repeat(1, n_c)[:, None, :]
    expanded = targets[:, :, None].expand(-1, -1, n_c).contiguous()

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = _penalised_nll(design, flat, expanded, sample_weight, offset, penalty, n_c, n_classes)
        loss.backward()
        return loss

    optimiser.step(closure)
    return flat.detach()


def fit_logistic_batch(design: torch.Tensor, labels: torch.Tensor, sample_weight: torch.Tensor,
                       class_mask: torch.Tensor, c_grid: tuple[float, ...], max_iter: int = 100,
                       tol: float = 1e-5) -> torch.Tensor:
    """Weights (T, L, D + 1, K) for T tasks × L candidate C values, fitted jointly from zero.

    ``design``: (T, n, D + 1) standardised features with a ones column (padding rows are zero);
    ``labels``: (T, n) class indices; ``sample_weight``: (T, n), 1/n_t on a task's training rows
    and 0 on padding; ``class_mask``: (T, K) bool, the classes each task scores.
    """
    t, n, d1 = design.shape
    n_classes = class_mask.shape[1]
    n_train = (sample_weight > 0).sum(dim=1).to(design.dtype)  # (T,)
    c_values = torch.tensor(c_grid, dtype=design.dtype, device=design.device)
    penalty = 1.0 / (2.0 * c_values[None, :] * n_train[:, None])  # (T, L)
    class_offset = torch.where(class_mask, 0.0, _MASKED_LOGIT).to(design.dtype)
    init = torch.zeros(t, d1, len(c_grid) * n_classes, dtype=design.dtype, device=design.device)
    flat = _minimise(design, labels.clamp(min=0), sample_weight, class_offset, penalty, init, n_classes, max_iter, tol)
    return flat.view(t, d1, len(c_grid), n_classes).permute(0, 2, 1, 3).contiguous()


def fit_logistic_path(x: torch.Tensor, y: torch.Tensor, n_classes: int, c_grid: tuple[float, ...],
                      max_iter: int = 150, tol: float = 1e-5) -> torch.Tensor:
    """One task's weights (L, D + 1, K) minimising mean CE + ||W||²/(2·C·n) for every C of ``c_grid``."""
    n = len(x)
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype, device=x.device)], dim=1)[None]
    weight = torch.full((1, n), 1.0 / n, dtype=x.dtype, device=x.device)
    mask = torch.ones(1, n_classes, dtype=torch.bool, device=x.device)
    return fit_logistic_batch(design, y[None], weight, mask, c_grid, max_iter, tol)[0]


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


def _standardiser(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x_train.mean(axis=0, dtype=np.float64)
    sd = x_train.std(axis=0, dtype=np.float64)
    sd[sd < 1e-8] = 1.0
    return mean.astype(np.float32), sd.astype(np.float32)


def _batches(tasks: list[ProbeTask], width: int, budget_bytes: int, max_padding: float = 0.25) -> list[list[int]]:
    """Task positions grouped by training size under a memory budget.

    Tasks are sorted by training size; a group closes when the next task would exceed the budget
    or pad the group's smallest task by more than ``max_padding`` of the largest.
    """
    order = sorted(range(len(tasks)), key=lambda i: len(tasks[i].train))
    groups, current = [], []
    for i in order:
        n_max = len(tasks[i].train)  # the largest so far in this sorted group
        too_big = (len(current) + 1) * n_max * width * 4 * 3 > budget_bytes
        too_uneven = current and len(tasks[current[0]].train) < (1 - max_padding) * n_max
        if current and (too_big or too_uneven):
            groups.append(current)
            current = []
        current.append(i)
    return groups + ([current] if current else [])


def fit_tasks(x: np.ndarray, y: np.ndarray, n_classes: int, tasks: list[ProbeTask], *,
              c_grid: tuple[float, ...] = DEFAULT_C_GRID, max_iter: int = 100, device: str = "cpu",
              batch_memory_mb: int = 512) -> list[ProbeResult]:
    """Fit, select and score every task on one feature matrix ``x`` (cells × D) with labels ``y``.

    ``y`` holds class indices 0..n_classes-1 (any value on rows no task uses). ``fit_seconds`` of
    each result is its batch's wall time shared equally among the batch's tasks.
    """
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int64)
    results: list[ProbeResult | None] = [None] * len(tasks)
    for group in _batches(tasks, x.shape[1] + 1, batch_memory_mb * 1024**2):
        started = time.perf_counter()
        batch = [tasks[i] for i in group]
        n_max = max(len(task.train) for task in batch)
        design = np.zeros((len(batch), n_max, x.shape[1] + 1), dtype=np.float32)
        labels = np.zeros((len(batch), n_max), dtype=np.int64)
        weight = np.zeros((len(batch), n_max), dtype=np.float32)
        mask = np.zeros((len(batch), n_classes), dtype=bool)
        scalers = []
        for b, task in enumerate(batch):
            mean, sd = _standardiser(x[task.train])
            scalers.append((mean, sd))
            n = len(task.train)
            design[b, :n, :-1] = (x[task.train] - mean) / sd
            design[b, :n, -1] = 1.0
            labels[b, :n] = y[task.train]
            weight[b, :n] = 1.0 / n
            mask[b, task.classes] = True
        weights = fit_logistic_batch(torch.from_numpy(design).to(device), torch.from_numpy(labels).to(device),
                                     torch.from_numpy(weight).to(device), torch.from_numpy(mask).to(device),
                                     tuple(c_grid), max_iter=max_iter)
        scored = [_score_task(x, y, task, weights[b], scalers[b], c_grid) for b, task in enumerate(batch)]
        share = (time.perf_counter() - started) / len(batch)
        for i, (chosen, val_f1, scores, pred) in zip(group, scored):
            results[i] = ProbeResult(chosen, *scores, val_f1, share, pred)
    return results  # type: ignore[return-value]


def _class_probabilities(x: np.ndarray, scaler: tuple[np.ndarray, np.ndarray], weights: torch.Tensor,
                         classes: np.ndarray) -> np.ndarray:
    """(L, n, len(classes)) softmax over the task's classes for every candidate."""
    mean, sd = scaler
    design = torch.from_numpy(np.concatenate([(x - mean) / sd, np.ones((len(x), 1), np.float32)], axis=1))
    logits = design.to(weights.device) @ weights[:, :, torch.as_tensor(classes, device=weights.device)]
    return torch.softmax(logits, dim=-1).cpu().numpy()


def _score_task(x: np.ndarray, y: np.ndarray, task: ProbeTask, weights: torch.Tensor,
                scaler: tuple[np.ndarray, np.ndarray], c_grid) -> tuple[float, float, tuple, np.ndarray]:
    with torch.no_grad():
        val_prob = _class_probabilities(x[task.val], scaler, weights, task.classes)
        val_f1 = [macro_f1(y[task.val], task.classes[p.argmax(axis=1)], task.classes) for p in val_prob]
        best = int(np.argmax(val_f1))  # earliest (strongest regularisation) on ties
        test_prob = _class_probabilities(x[task.test], scaler, weights[best:best + 1], task.classes)[0]
    scores = macro_scores(y[task.test], test_prob, task.classes)
    return float(c_grid[best]), float(val_f1[best]), scores, task.classes[test_prob.argmax(axis=1)]


def run_probe(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, x_test: np.ndarray,
              y_test: np.ndarray, n_classes: int, *, c_grid: tuple[float, ...] = DEFAULT_C_GRID,
              max_iter: int = 150, device: str = "cpu") -> ProbeResult:
    """One probe from separate train/val/test arrays (labels 0..n_classes-1, all classes scored)."""
    x = np.concatenate([x_train, x_val, x_test]).astype(np.float32)
    y = np.concatenate([y_train, y_val, y_test])
    bounds = np.cumsum([0, len(x_train), len(x_val), len(x_test)])
    task = ProbeTask(*(np.arange(bounds[i], bounds[i + 1]) for i in range(3)), classes=np.arange(n_classes))
    return fit_tasks(x, y, n_classes, [task], c_grid=c_grid, max_iter=max_iter, device=device)[0]
