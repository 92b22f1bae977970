"""The linear probe: multinomial logistic regression on standardised features, L2 chosen on validation.

Written for throughput: one probe fits every candidate L2 strength at once. The weights of all
candidates form one (L, D + 1, K) tensor and one L-BFGS run minimises the sum of the L independent
objectives (the sum separates, so its minimum is each candidate's minimum) — full-batch, in torch,
on the CPU here and on CUDA where available. The candidate with the best validation Macro-F1 is
scored on the test cells.

Each candidate's objective is scikit-learn's, scaled by 1/n: mean cross-entropy + ||W||² / (2·C·n)
(intercept unpenalised), so ``C`` means what it means in ``sklearn.linear_model.LogisticRegression``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.metrics import average_precision_score, f1_score, roc_auc_score
from sklearn.preprocessing import label_binarize

DEFAULT_C_GRID = (0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class ProbeResult:
    """Scores of one probe run on its test cells, over the gated classes."""

    chosen_c: float
    macro_f1: float
    macro_auroc: float
    macro_auprc: float
    val_macro_f1: float
    fit_seconds: float
    test_pred: np.ndarray  # predicted class index per test cell (into ``classes``)


def _standardise(train: np.ndarray, *others: np.ndarray) -> list[torch.Tensor]:
    mean = train.mean(axis=0)
    sd = train.std(axis=0)
    sd[sd < 1e-8] = 1.0
    return [torch.from_numpy(((x - mean) / sd).astype(np.float32)) for x in (train, *others)]


def fit_logistic_path(x: torch.Tensor, y: torch.Tensor, n_classes: int, c_grid: tuple[float, ...],
                      max_iter: int = 150, tol: float = 1e-5) -> torch.Tensor:
    """Weights (L, D + 1, K) minimising mean CE + ||W||²/(2·C·n) for every C of ``c_grid``.

    All candidates share one design matrix, so each L-BFGS step is one (n × D+1) @ (D+1 × L·K)
    product rather than L separate ones.
    """
    n, d = x.shape
    n_c = len(c_grid)
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype, device=x.device)], dim=1)
    flat = torch.zeros(d + 1, n_c * n_classes, dtype=x.dtype, device=x.device, requires_grad=True)
    penalty = torch.tensor([1.0 / (2.0 * c * n) for c in c_grid], dtype=x.dtype, device=x.device)
    onehot = torch.nn.functional.one_hot(y, n_classes).to(x.dtype)
    optimiser = torch.optim.LBFGS([flat], lr=1.0, max_iter=max_iter, tolerance_grad=tol,
                                  tolerance_change=1e-9, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        logits = (design @ flat).view(n, n_c, n_classes)
        nll = torch.logsumexp(logits, dim=2) - (logits * onehot[:, None, :]).sum(dim=2)  # (n, L)
        weights = flat[:-1].view(d, n_c, n_classes)
        loss = (nll.mean(dim=0) + penalty * (weights**2).sum(dim=(0, 2))).sum()
        loss.backward()
        return loss

    optimiser.step(closure)
    return flat.detach().view(d + 1, n_c, n_classes).permute(1, 0, 2).contiguous()


def _probabilities(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], dim=1)
    return torch.softmax(design @ weights, dim=-1)  # (L, n, K)


def _macro_scores(y_true: np.ndarray, probabilities: np.ndarray, n_classes: int) -> tuple[float, float, float]:
    predicted = probabilities.argmax(axis=1)
    labels = np.arange(n_classes)
    macro_f1 = f1_score(y_true, predicted, labels=labels, average="macro", zero_division=0)
    onehot = label_binarize(y_true, classes=labels)
    if n_classes == 2:
        onehot = np.column_stack([1 - onehot[:, 0], onehot[:, 0]])
    present = onehot.sum(axis=0) > 0
    auroc = roc_auc_score(onehot[:, present], probabilities[:, present], average="macro") if present.sum() > 1 else np.nan
    auprc = average_precision_score(onehot[:, present], probabilities[:, present], average="macro")
    return float(macro_f1), float(auroc), float(auprc)


def run_probe(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, x_test: np.ndarray,
              y_test: np.ndarray, n_classes: int, *, c_grid: tuple[float, ...] = DEFAULT_C_GRID,
              device: str = "cpu") -> ProbeResult:
    """Fit on train for every C, choose C by validation Macro-F1, score the test cells.

    Labels are class indices 0..n_classes-1 (the unit's gated classes).
    """
    started = time.perf_counter()
    train, val, test = (t.to(device) for t in _standardise(x_train, x_val, x_test))
    weights = fit_logistic_path(train, torch.from_numpy(y_train.astype(np.int64)).to(device), n_classes, c_grid)
    with torch.no_grad():
        val_pred = _probabilities(val, weights).argmax(dim=-1).cpu().numpy()  # (L, n_val)
        val_f1 = [f1_score(y_val, p, labels=np.arange(n_classes), average="macro", zero_division=0) for p in val_pred]
        best = int(np.argmax(val_f1))  # earliest (strongest regularisation) on ties
        test_prob = _probabilities(test, weights[best:best + 1])[0].cpu().numpy()
    fit_seconds = time.perf_counter() - started
    macro_f1, auroc, auprc = _macro_scores(y_test, test_prob, n_classes)
    return ProbeResult(float(c_grid[best]), macro_f1, auroc, auprc, float(val_f1[best]), fit_seconds,
                       test_prob.argmax(axis=1))
