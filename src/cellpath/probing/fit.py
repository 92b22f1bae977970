"""The linear probe: multinomial logistic regression on standardised features, L2 chosen on validation.

A *task* is one probe run (train/val/test rows of one feature matrix and the classes it scores).
Every (task, C) fit minimises its own objective from zero to its own stopping test (``tol`` on the
largest |gradient entry|, ``max_iter`` iterations), so a task's result does not depend on which
tasks were fitted beside it. Two solvers minimise the same objective (``solver``):

- ``scipy`` (the default on the CPU): one ``scipy.optimize`` L-BFGS-B call per fit — scikit-learn's
  lbfgs, with its gtol/ftol/maxls. For the probe's sizes it runs at the CPU's matrix-product rate,
  which no batching can beat for the same iterations (docs/decisions/0019-per-fit-lbfgs.md).
- ``torch`` (the default on CUDA): tasks in batches — their standardised training matrices padded
  into one (T, n, D + 1) tensor and the weights of every task and candidate C one (T, L, D + 1, K)
  tensor, so each evaluation is one batched matrix product for all of them, with a per-fit L-BFGS
  state (``cellpath.probing.lbfgs``). Classes a task does not score get a fixed −10⁴ logit offset, so one
  batch mixes tasks with different gated classes.

Memory: the features come from a row source (``take(rows)``, e.g. the memory-mapped feature store),
never as one panel matrix. A scipy fit whose design fits ``memory_mb`` is built in memory; a
larger one is streamed — its objective and gradient summed over chunks of training rows read
from the source at every evaluation (the same sums in another order, so the same optimum to the
fit's tolerance) — and validation and test rows are scored in chunks too.

Both run in float64. Each objective is scikit-learn's scaled by 1/n: mean cross-entropy +
||W||² / (2·C·n) (intercept unpenalised), so ``C`` means what it means in
``sklearn.linear_model.LogisticRegression``. For a task that scores two classes scikit-learn fits
one binary weight vector v with ||v||²/(2·C·n); the two-column softmax has the same optimum when
its penalty is doubled (its minimum-norm columns are ±v/2), so two-class fits use 2/(2·C·n): the
same C means the same model as in scikit-learn for every number of classes. The candidate with the
best validation Macro-F1 (the strongest regularisation on ties) scores the test cells: Macro-F1,
Macro-AUROC and Macro-AUPRC over the task's classes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from scipy.optimize import minimize
from scipy.special import log_softmax
from threadpoolctl import threadpool_limits

from cellpath.probing import lbfgs
from cellpath.probing.scores import macro_f1, macro_scores

DEFAULT_C_GRID = (0.01, 0.1, 1.0, 10.0)
DEFAULT_TOL = 1e-8        # largest |gradient entry| of the 1/n-scaled objective at a converged fit
DEFAULT_MAX_ITER = 10000  # L-BFGS iterations per fit; a fit that reaches it is recorded as not converged
SOLVERS = ("auto", "scipy", "torch")  # auto: scipy on the CPU, torch on CUDA
SCIPY_MAX_LINE_SEARCH = 50  # scikit-learn's maxls for lbfgs
_MASKED_LOGIT = -1e4


class RowSource(Protocol):
    """Feature rows by position: ``take(rows)`` → float32 ``(len(rows), width)``."""

    @property
    def width(self) -> int: ...

    def take(self, rows: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class InMemoryRows:
    """A feature matrix (cells × D) already in memory, as a row source."""

    matrix: np.ndarray

    @property
    def width(self) -> int:
        return self.matrix.shape[1]

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.matrix[rows]


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
    iterations: int        # L-BFGS iterations of the slowest C of the grid
    converged: bool        # every C of the grid met the tolerance
    fit_seconds: float
    test_pred: np.ndarray  # predicted label per test cell (a class index of the taxonomy)
    test_confidence: np.ndarray  # its probability under the chosen C (softmax over the task's classes)


def binary_factor(n_classes: int) -> float:
    """Penalty multiplier: 2 for a two-class task (scikit-learn's binary model, see the module docstring), else 1."""
    return 2.0 if n_classes == 2 else 1.0


class _ProbeObjective:
    """Mean cross-entropy + ||W||²/(2·C·n) of T tasks × L candidate C values, and its gradient.

    ``design``: (T, n, D + 1) standardised rows with a ones column, zero on padding; ``labels``:
    (T, n); ``sample_weight``: (T, n), 1/n_t on a task's rows and 0 on padding; ``class_offset``:
    (T, K), 0 for a scored class and −10⁴ for the others; ``penalty``: (T, L) = 1/(2·C·n_t)
    (doubled for two-class tasks, ``binary_factor``).
    Weights are (T, L, D + 1, K), the intercept in the last row (unpenalised); one matrix product
    serves every candidate of a task. The gradient is analytic (no autograd graph).
    """

    def __init__(self, design: torch.Tensor, labels: torch.Tensor, sample_weight: torch.Tensor,
                 class_offset: torch.Tensor, penalty: torch.Tensor) -> None:
        self.design, self.labels, self.sample_weight = design, labels, sample_weight
        self.class_offset, self.penalty = class_offset, penalty
        self.onehot = torch.nn.functional.one_hot(labels, class_offset.shape[1]).to(design.dtype)[:, :, None, :]
        self.penalised = torch.ones(design.shape[2], 1, dtype=design.dtype, device=design.device)
        self.penalised[-1] = 0.0

    def subset(self, rows: torch.Tensor, columns: torch.Tensor) -> "_ProbeObjective":
        return _ProbeObjective(self.design[rows], self.labels[rows], self.sample_weight[rows],
                               self.class_offset[rows], self.penalty[rows][:, columns])

    def __call__(self, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, n_c, d1, k = weights.shape
        n = self.design.shape[1]
        columns = weights.permute(0, 2, 1, 3).reshape(t, d1, n_c * k)  # (T, D + 1, L·K)
        logits = torch.bmm(self.design, columns).view(t, n, n_c, k)
        log_p = torch.log_softmax(logits + self.class_offset[:, None, None, :], dim=-1)
        data = -(self.sample_weight[:, :, None] * (log_p * self.onehot).sum(dim=-1)).sum(dim=1)  # (T, L)
        penalised = weights * self.penalised
        value = data + self.penalty * (penalised**2).sum(dim=(2, 3))
        residual = (torch.exp(log_p) - self.onehot) * self.sample_weight[:, :, None, None]
        grad = torch.bmm(self.design.transpose(1, 2), residual.view(t, n, n_c * k)).view(t, d1, n_c, k)
        return value, grad.permute(0, 2, 1, 3) + 2.0 * self.penalty[:, :, None, None] * penalised


@dataclass(frozen=True)
class BatchFit:
    """Weights (T, L, D + 1, K) of T tasks × L candidate C values and how each fit ended (T, L)."""

    weights: torch.Tensor
    iterations: torch.Tensor
    converged: torch.Tensor
    grad_max: torch.Tensor


def fit_logistic_batch(design: torch.Tensor, labels: torch.Tensor, sample_weight: torch.Tensor,
                       class_mask: torch.Tensor, c_grid: tuple[float, ...], max_iter: int = DEFAULT_MAX_ITER,
                       tol: float = DEFAULT_TOL) -> BatchFit:
    """Fit T tasks × L candidate C values from zero, each to its own convergence (``cellpath.probing.lbfgs``).

    ``design``: (T, n, D + 1) standardised features with a ones column (padding rows are zero);
    ``labels``: (T, n) class indices; ``sample_weight``: (T, n), 1/n_t on a task's training rows
    and 0 on padding; ``class_mask``: (T, K) bool, the classes each task scores. ``tol`` bounds the
    largest absolute gradient entry of each objective, as scikit-learn's ``tol`` for lbfgs. Fits run
    in float64 (inputs are converted): in float32 the objective's rounding (~1e-7 relative) stops
    the line search long before a gradient tolerance of 1e-6 is reached.
    """
    design, sample_weight = design.to(torch.float64), sample_weight.to(torch.float64)
    t, n, d1 = design.shape
    n_classes = class_mask.shape[1]
    n_train = (sample_weight > 0).sum(dim=1).to(design.dtype)  # (T,)
    c_values = torch.tensor(c_grid, dtype=design.dtype, device=design.device)
    scale = torch.tensor([binary_factor(int(k)) for k in class_mask.sum(dim=1)], dtype=design.dtype,
                         device=design.device)
    penalty = scale[:, None] / (2.0 * c_values[None, :] * n_train[:, None])  # (T, L)
    class_offset = torch.where(class_mask, 0.0, _MASKED_LOGIT).to(design.dtype)
    objective = _ProbeObjective(design, labels.clamp(min=0), sample_weight, class_offset, penalty)
    init = torch.zeros(t, len(c_grid), d1, n_classes, dtype=design.dtype, device=design.device)
    solution = lbfgs.minimise(objective, init, tol=tol, max_iter=max_iter)
    return BatchFit(solution.x, solution.iterations, solution.converged, solution.grad_max)


class _TaskObjective:
    """One task's mean cross-entropy + ||W||²/(2·C·n) over its own classes (doubled for two, ``binary_factor``),
    for scipy (flat float64 weights).

    ``design``: (n, D + 1) standardised rows with a ones column; ``labels``: (n,) positions 0..k-1 in
    the task's classes; weights (D + 1, k), the intercept in the last row (unpenalised).
    """

    def __init__(self, design: np.ndarray, labels: np.ndarray, n_classes: int, c: float) -> None:
        self.design, self.labels, self.n_classes = design, labels, n_classes
        self.rows = np.arange(len(labels))
        self.penalty = binary_factor(n_classes) / (2.0 * c * len(labels))

    def __call__(self, flat: np.ndarray) -> tuple[float, np.ndarray]:
        weights = flat.reshape(self.design.shape[1], self.n_classes)
        log_p = log_softmax(self.design @ weights, axis=1)
        n = len(self.labels)
        value = -log_p[self.rows, self.labels].sum() / n + self.penalty * float((weights[:-1] ** 2).sum())
        residual = np.exp(log_p)
        residual[self.rows, self.labels] -= 1.0
        grad = self.design.T @ (residual / n)
        grad[:-1] += 2.0 * self.penalty * weights[:-1]
        return float(value), grad.ravel()


def fit_logistic_scipy(design: np.ndarray, labels: np.ndarray, n_classes: int, c_grid: tuple[float, ...],
                       max_iter: int = DEFAULT_MAX_ITER,
                       tol: float = DEFAULT_TOL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fit one task at every C of ``c_grid`` with scipy's L-BFGS-B, each from zero (scikit-learn's lbfgs).

    ``design``: (n, D + 1) float64 with a ones column; ``labels``: (n,) in 0..n_classes-1. Returns the
    weights (L, D + 1, n_classes), the iterations (L,) and whether each fit met ``tol`` (or scipy's
    relative-reduction test, 64·eps, as scikit-learn sets it) before ``max_iter`` or a failed line search.
    """
    return _minimise_grid(lambda c: _TaskObjective(design, labels, n_classes, c), design.shape[1], n_classes, c_grid,
                          max_iter, tol)


def _minimise_grid(objective_for: Callable[[float], Callable], width: int, n_classes: int,
                   c_grid: tuple[float, ...], max_iter: int, tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scipy's L-BFGS-B from zero at every C (``objective_for(C)`` → flat value-and-gradient function)."""
    weights = np.zeros((len(c_grid), width, n_classes))
    iterations = np.zeros(len(c_grid), dtype=np.int64)
    converged = np.zeros(len(c_grid), dtype=bool)
    for i, c in enumerate(c_grid):
        result = minimize(objective_for(c), np.zeros(width * n_classes), jac=True,
                          method="L-BFGS-B", options={"maxiter": max_iter, "maxfun": 100 * max_iter + 100,
                                                      "gtol": tol, "ftol": lbfgs.FTOL, "maxcor": lbfgs.HISTORY,
                                                      "maxls": SCIPY_MAX_LINE_SEARCH})
        weights[i] = result.x.reshape(width, n_classes)
        iterations[i], converged[i] = result.nit, result.status == 0
    return weights, iterations, converged


class _StreamedTaskObjective:
    """:class:`_TaskObjective` with the training rows read from ``source`` in chunks at every
    evaluation: the same value and gradient (sums over chunks), in memory bounded by the chunk."""

    def __init__(self, source: RowSource, rows: np.ndarray, labels: np.ndarray, scaler: tuple[np.ndarray, np.ndarray],
                 n_classes: int, c: float, chunk_rows: int) -> None:
        self.source, self.rows, self.labels, self.scaler = source, rows, labels, scaler
        self.n_classes, self.chunk_rows = n_classes, chunk_rows
        self.penalty = binary_factor(n_classes) / (2.0 * c * len(labels))

    def __call__(self, flat: np.ndarray) -> tuple[float, np.ndarray]:
        weights = flat.reshape(-1, self.n_classes)
        n = len(self.labels)
        value, grad = 0.0, np.zeros_like(weights)
        for start, rows in _chunks(self.rows, self.chunk_rows):
            design = _design(self.source.take(rows), self.scaler)
            labels = self.labels[start:start + len(rows)]
            log_p = log_softmax(design @ weights, axis=1)
            at = np.arange(len(rows))
            value -= log_p[at, labels].sum()
            residual = np.exp(log_p)
            residual[at, labels] -= 1.0
            grad += design.T @ residual
        value, grad = value / n, grad / n
        value += self.penalty * float((weights[:-1] ** 2).sum())
        grad[:-1] += 2.0 * self.penalty * weights[:-1]
        return float(value), grad.ravel()


def _chunks(rows: np.ndarray, chunk_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, rows[start:start + chunk_rows]) over ``rows``."""
    for start in range(0, len(rows), chunk_rows):
        yield start, rows[start:start + chunk_rows]


def streamed_standardiser(source: RowSource, rows: np.ndarray, chunk_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`standardiser` of ``source``'s ``rows`` in two chunked passes (mean, then squared deviations)."""
    total = np.zeros(source.width)
    for _, chunk in _chunks(rows, chunk_rows):
        total += source.take(chunk).sum(axis=0, dtype=np.float64)
    mean = total / len(rows)
    squares = np.zeros(source.width)
    for _, chunk in _chunks(rows, chunk_rows):
        squares += ((source.take(chunk) - mean) ** 2).sum(axis=0)
    sd = np.sqrt(squares / len(rows))
    sd[sd < 1e-8] = 1.0
    return mean, sd


def design_row_bytes(width: int, n_classes: int) -> int:
    """Working bytes per training row of a scipy fit: the float32 rows read, the float64 design row
    (with the ones column) and the logits, probabilities and residuals."""
    return 4 * width + 8 * (width + 1) + 3 * 8 * n_classes


def standardiser(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and SD (float64) of a task's training rows; an SD below 1e-8 becomes 1."""
    mean = x_train.mean(axis=0, dtype=np.float64)
    sd = x_train.std(axis=0, dtype=np.float64)
    sd[sd < 1e-8] = 1.0
    return mean, sd


def standardised(x: np.ndarray, scaler: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Rows of ``x`` standardised with a task's training ``scaler``, float64: what every fit sees."""
    mean, sd = scaler
    return (np.asarray(x, dtype=np.float64) - mean) / sd


def _batches(tasks: list[ProbeTask], row_bytes: int, task_bytes: int, budget_bytes: int,
             max_padding: float = 0.25) -> list[list[int]]:
    """Task positions grouped by training size under a memory budget.

    Tasks are sorted by training size; a group closes when the next task would exceed the budget
    (``row_bytes`` per padded training row plus ``task_bytes`` per task) or pad the group's
    smallest task by more than ``max_padding`` of the largest.
    """
    order = sorted(range(len(tasks)), key=lambda i: len(tasks[i].train))
    groups, current = [], []
    for i in order:
        n_max = len(tasks[i].train)  # the largest so far in this sorted group
        too_big = (len(current) + 1) * (n_max * row_bytes + task_bytes) > budget_bytes
        too_uneven = current and len(tasks[current[0]].train) < (1 - max_padding) * n_max
        if current and (too_big or too_uneven):
            groups.append(current)
            current = []
        current.append(i)
    return groups + ([current] if current else [])


def _batch_bytes(width: int, n_candidates: int, n_classes: int) -> tuple[int, int]:
    """float64 bytes per padded training row (the design row; logits, probabilities, residuals and
    one-hot targets) and per task (the optimiser's history and working copies of the weights)."""
    outputs = n_candidates * n_classes
    return 8 * (width + 4 * outputs), 8 * (2 * lbfgs.HISTORY + 8) * width * outputs


def resolve_solver(solver: str, device: str) -> str:
    """``auto`` → ``scipy`` on the CPU, ``torch`` elsewhere (CUDA)."""
    if solver not in SOLVERS:
        raise ValueError(f"probe solver {solver!r}: expected one of {', '.join(SOLVERS)}")
    return ("scipy" if device == "cpu" else "torch") if solver == "auto" else solver


def fit_tasks(x: np.ndarray | RowSource, y: np.ndarray, n_classes: int, tasks: list[ProbeTask], *,
              c_grid: tuple[float, ...] = DEFAULT_C_GRID, max_iter: int = DEFAULT_MAX_ITER,
              tol: float = DEFAULT_TOL, device: str = "cpu", batch_memory_mb: float = 512,
              solver: str = "auto") -> list[ProbeResult]:
    """Fit, select and score every task on one feature matrix or row source ``x`` (cells × D) with labels ``y``.

    ``y`` holds class indices 0..n_classes-1 (any value on rows no task uses). Every (task, C) fit
    stops on its own test (``tol`` or ``max_iter``), so a task's result does not depend on the
    tasks fitted beside it; ``ProbeResult.converged`` says whether every C met ``tol``.
    ``batch_memory_mb``: the working memory of one fit (scipy; larger training sets are streamed)
    or one batch of fits (torch; a task too large for a batch of its own is fitted streamed, by scipy
    on the CPU). ``fit_seconds``: the task's own wall time (scipy), or its batch's
    shared equally (torch).
    """
    source = InMemoryRows(x) if isinstance(x, np.ndarray) else x
    y = np.asarray(y, dtype=np.int64)
    budget = int(batch_memory_mb * 1024**2)
    if resolve_solver(solver, device) == "scipy":
        # One BLAS thread: numpy's and scipy's OpenBLAS each keep a pool that spins after its work; with
        # two threads each they fight over the cores (measured: 17× slower fits of a (600, 385) design).
        with threadpool_limits(limits=1, user_api="blas"):
            return [_fit_task_scipy(source, y, n_classes, task, tuple(c_grid), max_iter, tol, budget)
                    for task in tasks]
    width = source.width + 1
    chunk_rows = max(1, budget // design_row_bytes(source.width, n_classes))
    results: list[ProbeResult | None] = [None] * len(tasks)
    row_bytes, task_bytes = _batch_bytes(width, len(c_grid), n_classes)
    batched = [i for i, task in enumerate(tasks) if len(task.train) * row_bytes + task_bytes <= budget]
    for i in sorted(set(range(len(tasks))) - set(batched)):  # too large for one batch: streamed, on the CPU
        with threadpool_limits(limits=1, user_api="blas"):
            results[i] = _fit_task_scipy(source, y, n_classes, tasks[i], tuple(c_grid), max_iter, tol, budget)
    for group in _batches([tasks[i] for i in batched], row_bytes, task_bytes, budget):
        group = [batched[b] for b in group]
        started = time.perf_counter()
        batch = [tasks[i] for i in group]
        n_max = max(len(task.train) for task in batch)
        design = np.zeros((len(batch), n_max, width), dtype=np.float64)
        labels = np.zeros((len(batch), n_max), dtype=np.int64)
        weight = np.zeros((len(batch), n_max), dtype=np.float64)
        mask = np.zeros((len(batch), n_classes), dtype=bool)
        scalers = []
        for b, task in enumerate(batch):
            rows = source.take(task.train)
            scalers.append(standardiser(rows))
            n = len(task.train)
            design[b, :n] = _design(rows, scalers[-1])
            labels[b, :n] = y[task.train]
            weight[b, :n] = 1.0 / n
            mask[b, task.classes] = True
        fit = fit_logistic_batch(*(torch.from_numpy(a).to(device) for a in (design, labels, weight, mask)),
                                 tuple(c_grid), max_iter=max_iter, tol=tol)
        iterations = fit.iterations.amax(dim=1).cpu().numpy()
        converged = fit.converged.all(dim=1).cpu().numpy()
        scored = [_score_task(source, y, task, fit.weights[b], scalers[b], c_grid, chunk_rows)
                  for b, task in enumerate(batch)]
        share = (time.perf_counter() - started) / len(batch)
        for b, (i, (chosen, val_f1, scores, pred, confidence)) in enumerate(zip(group, scored)):
            results[i] = ProbeResult(chosen, *scores, val_f1, int(iterations[b]), bool(converged[b]), share, pred,
                                     confidence)
    return results  # type: ignore[return-value]


def _design(rows: np.ndarray, scaler: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """(n, D + 1) float64: the standardised rows and a ones column (the intercept), built in place
    (the values of :func:`standardised`, without its intermediate copy)."""
    mean, sd = scaler
    out = np.empty((len(rows), len(mean) + 1))
    np.subtract(rows, mean, out=out[:, :-1])
    out[:, :-1] /= sd
    out[:, -1] = 1.0
    return out


def _fit_task_scipy(source: RowSource, y: np.ndarray, n_classes: int, task: ProbeTask, c_grid: tuple[float, ...],
                    max_iter: int, tol: float, budget_bytes: int) -> ProbeResult:
    """One task: scipy fits over its own classes, placed in the taxonomy's columns, then selected and
    scored. The design is built in memory when it fits ``budget_bytes``, else streamed in chunks."""
    started = time.perf_counter()
    position = np.full(n_classes, -1, dtype=np.int64)
    position[task.classes] = np.arange(len(task.classes))
    labels = position[y[task.train]]
    if (labels < 0).any():
        raise ValueError("a probe task's training rows carry a class the task does not score")
    k, width = len(task.classes), source.width
    chunk_rows = max(1, budget_bytes // design_row_bytes(width, k))
    if len(task.train) <= chunk_rows:
        rows = source.take(task.train)
        scaler = standardiser(rows)
        own, iterations, converged = fit_logistic_scipy(_design(rows, scaler), labels, k, c_grid, max_iter, tol)
    else:
        scaler = streamed_standardiser(source, task.train, chunk_rows)
        own, iterations, converged = _minimise_grid(
            lambda c: _StreamedTaskObjective(source, task.train, labels, scaler, k, c, chunk_rows), width + 1, k,
            c_grid, max_iter, tol)
    weights = np.zeros((len(c_grid), width + 1, n_classes))
    weights[:, :, task.classes] = own
    chosen, val_f1, scores, pred, confidence = _score_task(source, y, task, torch.from_numpy(weights), scaler,
                                                           c_grid, chunk_rows)
    return ProbeResult(chosen, *scores, val_f1, int(iterations.max()), bool(converged.all()),
                       time.perf_counter() - started, pred, confidence)


def _class_probabilities(source: RowSource, rows: np.ndarray, scaler: tuple[np.ndarray, np.ndarray],
                         weights: torch.Tensor, classes: np.ndarray, chunk_rows: int) -> np.ndarray:
    """(L, n, len(classes)) softmax over the task's classes for every candidate, read in chunks of rows."""
    columns = weights[:, :, torch.as_tensor(classes, device=weights.device)]
    parts = []
    for _, chunk in _chunks(rows, chunk_rows):
        design = torch.from_numpy(_design(source.take(chunk), scaler)).to(weights.device)
        parts.append(torch.softmax(design @ columns, dim=-1).cpu().numpy())
    return np.concatenate(parts, axis=1) if parts else np.zeros((weights.shape[0], 0, len(classes)))


def _score_task(source: RowSource, y: np.ndarray, task: ProbeTask, weights: torch.Tensor,
                scaler: tuple[np.ndarray, np.ndarray], c_grid,
                chunk_rows: int) -> tuple[float, float, tuple, np.ndarray, np.ndarray]:
    """Select C on validation Macro-F1 and score the test cells: (C, its validation Macro-F1, the test
    scores, each test cell's predicted class index and that class's probability)."""
    with torch.no_grad():
        val_prob = _class_probabilities(source, task.val, scaler, weights, task.classes, chunk_rows)
        val_f1 = [macro_f1(y[task.val], task.classes[p.argmax(axis=1)], task.classes) for p in val_prob]
        best = int(np.argmax(val_f1))  # earliest (strongest regularisation) on ties
        test_prob = _class_probabilities(source, task.test, scaler, weights[best:best + 1], task.classes,
                                         chunk_rows)[0]
    scores = macro_scores(y[task.test], test_prob, task.classes)
    return (float(c_grid[best]), float(val_f1[best]), scores, task.classes[test_prob.argmax(axis=1)],
            test_prob.max(axis=1))
