"""The linear probe: multinomial logistic regression on standardised features, L2 chosen on validation.

A *task* is one probe run (train/val/test rows of one feature matrix and the classes it scores).
``fit_tasks`` groups the tasks (:func:`task_groups`: the same number of classes, training rows that
mostly coincide), fits every (task, C) of a group in one pass over its rows with the engine
(``cellpath.probing.engine``: float32 products, float64 line searches, each fit to its own stopping
test), then selects C on validation Macro-F1 and scores the test cells: Macro-F1, Macro-AUROC and
Macro-AUPRC over the task's classes.

The choice of C (``scores.select_c``): each C's validation Macro-F1 is computed exactly, a rational
number from its integer confusion counts; of the Cs whose Macro-F1 equals the maximum exactly, the
smallest is chosen (the strongest regularisation; the grid must be strictly ascending), and how many
reach the maximum is recorded (``ProbeResult.tied_cs``). No float comparison decides a tie, so the
same validation predictions choose the same C on any CPU. Every C's exact Macro-F1 — the very
fractions the rule compared — is kept (``ProbeResult.val_scores``), so the choice can be checked.

Each objective is scikit-learn's scaled by 1/n: mean cross-entropy + ||W||² / (2·C·n) (intercept
unpenalised; doubled for two classes, ``engine.binary_factor``), so ``C`` means what it means in
``sklearn.linear_model.LogisticRegression``; every fit starts from zero and is converged when its
largest |gradient entry|, recomputed in float64 at its returned weights, is ≤ ``tol``, so a task's
result does not depend on the tasks beside it beyond float32 rounding (docs/decisions/0038, 0040).

Memory: the features come from a row source (``take(rows)``, e.g. the memory-mapped feature store),
never as one panel matrix. A group's training rows are stored once (``engine.Design``) and held in
memory when they fit the memory budget (``batch_memory_mb``; ``design_row_bytes`` per padded row),
else written to a file in the work folder and streamed from there, with the same result; validation
and test rows are scored ``SCORE_ROWS`` at a time.

What a result may depend on: the tasks, the features and the settings — never the memory or the
threads the fits found. Groups are formed within a fixed design size (``group_budget_mb``: the
number ``batch_memory_mb`` sets, or ``AUTO_GROUP_MB`` for ``"auto"``), so the same tasks form the
same groups on any machine; the available memory only decides whether a group is held or streamed,
which changes no bit. Scoring chunks are a fixed number of rows, and the preconditioner's LAPACK
calls run on one thread (``engine``), so one thread or many give the same bits (docs/decisions/0047).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import psutil
import torch

from cellpath.probing.engine import (BUILD_ROWS, Design, GroupProblem, RowSource, binary_factor, chunks, design_block,
                                     fit_group)
from cellpath.probing.scores import check_c_grid, choose_c, macro_scores, validation_scores

DEFAULT_C_GRID = (0.01, 0.1, 1.0, 10.0)
DEFAULT_TOL = 1e-8        # largest |gradient entry| of the 1/n-scaled objective at a converged fit
DEFAULT_MAX_ITER = 10000  # L-BFGS iterations per fit; a fit that reaches it is recorded as not converged
MAX_PADDING = 0.25        # a group pads its smallest task by at most this share of the largest
AUTO_MEMORY_SHARE = 0.5   # probe.batch_memory_mb: auto holds a group's design within this share of available memory
AUTO_GROUP_MB = 1024      # probe.batch_memory_mb: auto groups tasks within this design size (MiB), on any machine
SCORE_ROWS = 4096         # validation/test rows scored per product (a fixed chunking: the same bits on any machine)


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
    tied_cs: int           # Cs whose exact validation Macro-F1 equals the best (1: no tie); the smallest is chosen
    macro_f1: float
    macro_auroc: float
    macro_auprc: float
    val_macro_f1: float    # the chosen C's exact validation Macro-F1, rounded once to a float
    iterations: int        # L-BFGS iterations of the slowest C of the grid
    converged: bool        # every C of the grid met the tolerance
    fit_seconds: float
    test_pred: np.ndarray  # predicted label per test cell (a class index of the taxonomy)
    test_confidence: np.ndarray  # its probability under the chosen C (softmax over the task's classes)
    val_scores: tuple[Fraction, ...]  # each C's exact validation Macro-F1, in grid order: what chose C


def state_row_bytes(n_columns: int) -> int:
    """Fit-state bytes per training row: the float64 logits, logit steps, line-search trials,
    log-probabilities, weights and residuals of ``n_columns`` fit columns (Cs × classes), held for
    every row even when the design is streamed."""
    return 48 * n_columns


def design_row_bytes(width: int, n_columns: int) -> int:
    """Working bytes per training row of a task: its stored design row (float32 and a column at most:
    float16 where the rows are float16 values) and its fit state (:func:`state_row_bytes`)."""
    return 4 * (width + 1) + state_row_bytes(n_columns)


def task_groups(tasks: list[ProbeTask], row_bytes: int, budget_bytes: int,
                max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Task positions in groups fitted together: the same number of classes, sorted by training size;
    a group closes when the next task would take it over ``budget_bytes`` (``row_bytes`` per padded
    row of each task) or pad its smallest task by more than ``max_padding`` of the largest. The same
    tasks always give the same groups, whatever their order."""
    order = sorted(range(len(tasks)), key=lambda i: (len(tasks[i].classes), len(tasks[i].train), i))
    groups: list[list[int]] = []
    for i in order:
        current = groups[-1] if groups else None
        if current is not None:
            first, n = tasks[current[0]], len(tasks[i].train)
            if (len(first.classes) == len(tasks[i].classes) and len(first.train) >= (1 - max_padding) * n
                    and (len(current) + 1) * n * row_bytes <= budget_bytes):
                current.append(i)
                continue
        groups.append([i])
    return groups


def fit_tasks(x: np.ndarray | RowSource, y: np.ndarray, n_classes: int, tasks: list[ProbeTask], *,
              c_grid: tuple[float, ...] = DEFAULT_C_GRID, max_iter: int = DEFAULT_MAX_ITER,
              tol: float = DEFAULT_TOL, device: str = "cpu", batch_memory_mb: float | str = 512,
              work_dir: str | os.PathLike | None = None) -> list[ProbeResult]:
    """Fit, select and score every task on one feature matrix or row source ``x`` (cells × D) with labels ``y``.

    ``y`` holds class indices 0..n_classes-1 (any value on rows no task uses). Every (task, C) fit
    stops on its own test (``engine.fit_group``); ``ProbeResult.converged`` says whether every C's
    largest |gradient entry|, recomputed in float64 at its returned weights, is ≤ ``tol``.
    ``batch_memory_mb`` (MiB): tasks are grouped within :func:`group_budget_mb` of it, and a group's
    design (``design_row_bytes`` per padded row) is held in memory within :func:`probe_budget_mb` of
    it — for ``"auto"``, half the memory this worker has available now (psutil's ``available``,
    which counts reclaimable page cache) — else stored once in a file in ``work_dir`` (default: the
    system's temporary folder) and streamed from there; held or streamed, its fits are the same to
    the bit. ``fit_seconds``: the group's wall time shared equally by its tasks. ``c_grid`` must be
    strictly ascending (ValueError before any fit).
    """
    check_c_grid(c_grid)
    source = InMemoryRows(x) if isinstance(x, np.ndarray) else x
    y = np.asarray(y, dtype=np.int64)
    group_budget = int(group_budget_mb(batch_memory_mb) * 1024**2)
    memory_budget = int(probe_budget_mb(batch_memory_mb, psutil.virtual_memory().available) * 1024**2)
    results: list[ProbeResult | None] = [None] * len(tasks)
    by_classes: dict[int, list[int]] = {}
    for i, task in enumerate(tasks):
        by_classes.setdefault(len(task.classes), []).append(i)
    for k, positions in sorted(by_classes.items()):
        row_bytes = design_row_bytes(source.width, len(c_grid) * k)
        for group in task_groups([tasks[i] for i in positions], row_bytes, group_budget):
            started = time.perf_counter()
            members = [tasks[positions[g]] for g in group]
            padded_rows = len(members) * max(len(task.train) for task in members)
            with Design(source, [task.train for task in members], device,
                        stream=padded_rows * row_bytes > memory_budget, work_dir=work_dir,
                        read_rows=min(max(1, memory_budget // (len(members) * row_bytes)), BUILD_ROWS)) as design:
                problem = group_problem(design, y, members, tuple(c_grid))
                fit = fit_group(design, problem, k, tol=tol, max_iter=max_iter)
                scalers = design.scalers
            scored = []
            for t, task in enumerate(members):
                weights = torch.zeros(len(c_grid), source.width + 1, n_classes, dtype=torch.float64)
                weights[:, :, torch.from_numpy(task.classes)] = fit.weights[t].cpu()
                scored.append((_score_task(source, y, task, weights, scalers[t], c_grid),
                               int(fit.iterations[t].max()), bool(fit.converged[t].all())))
            share = (time.perf_counter() - started) / len(members)
            for g, (selected, iterations, converged) in zip(group, scored):
                chosen, tied, val_f1, scores, pred, confidence, per_c = selected
                results[positions[g]] = ProbeResult(chosen, tied, *scores, val_f1, iterations, converged, share, pred,
                                                    confidence, per_c)
    return results  # type: ignore[return-value]


def probe_budget_mb(setting: int | str, available_bytes: float) -> float:
    """Memory a group's design may take in MiB (held within it, else streamed): ``probe.batch_memory_mb``'s
    number, or for ``"auto"`` ``AUTO_MEMORY_SHARE`` of ``available_bytes`` (at least 16)."""
    return float(setting) if setting != "auto" else max(16.0, AUTO_MEMORY_SHARE * available_bytes / 1024**2)


def group_budget_mb(setting: int | str) -> float:
    """Design size a group of tasks is formed within, in MiB: ``probe.batch_memory_mb``'s number, or
    ``AUTO_GROUP_MB`` for ``"auto"`` — never the memory available, so that the same tasks form the
    same groups, and give the same results, on any machine."""
    return float(setting) if setting != "auto" else float(AUTO_GROUP_MB)


def group_problem(design: Design, y: np.ndarray, tasks: list[ProbeTask], c_grid: tuple[float, ...]) -> GroupProblem:
    """The objectives of a group's tasks on ``design`` (each task's training rows, padded to the largest)."""
    k, n = len(tasks[0].classes), design.n
    labels = np.zeros((len(tasks), n), dtype=np.int64)
    weight = np.zeros((len(tasks), n))
    penalty = np.zeros((len(tasks), len(c_grid)))
    for t, task in enumerate(tasks):
        position = np.full(int(max(y[task.train].max(), task.classes.max())) + 1, -1, dtype=np.int64)
        position[task.classes] = np.arange(k)
        labels[t, :len(task.train)] = position[y[task.train]]
        if (labels[t] < 0).any():
            raise ValueError("a probe task's training rows carry a class the task does not score")
        weight[t, :len(task.train)] = 1.0 / len(task.train)
        penalty[t] = [binary_factor(k) / (2.0 * c * len(task.train)) for c in c_grid]
    return GroupProblem(*(torch.from_numpy(a).to(design.device) for a in (labels, weight, penalty)))


def _class_probabilities(source: RowSource, rows: np.ndarray, scaler: tuple[np.ndarray, np.ndarray],
                         weights: torch.Tensor, classes: np.ndarray) -> np.ndarray:
    """(L, n, len(classes)) softmax over the task's classes for every candidate, ``SCORE_ROWS`` rows at a time."""
    columns = weights[:, :, torch.as_tensor(classes, device=weights.device)]
    parts = []
    for _, chunk in chunks(rows, SCORE_ROWS):
        design = torch.from_numpy(design_block(source.take(chunk), scaler, np.float64)).to(weights.device)
        parts.append(torch.softmax(design @ columns, dim=-1).cpu().numpy())
    return np.concatenate(parts, axis=1) if parts else np.zeros((weights.shape[0], 0, len(classes)))


def _score_task(source: RowSource, y: np.ndarray, task: ProbeTask, weights: torch.Tensor,
                scaler: tuple[np.ndarray, np.ndarray],
                c_grid: tuple[float, ...]) -> tuple[float, int, float, tuple, np.ndarray, np.ndarray,
                                                    tuple[Fraction, ...]]:
    """Select C on validation Macro-F1 (``scores.choose_c`` on each C's exact ``validation_scores``)
    and score the test cells: (C, how many Cs tied, its validation Macro-F1 as a float, the test
    scores, each test cell's predicted class index and that class's probability, every C's exact
    validation Macro-F1 in grid order)."""
    with torch.no_grad():
        val_prob = _class_probabilities(source, task.val, scaler, weights, task.classes)
        per_c = tuple(validation_scores(y[task.val], [task.classes[p.argmax(axis=1)] for p in val_prob],
                                        task.classes))
        selection = choose_c(per_c, c_grid)
        best = selection.position
        test_prob = _class_probabilities(source, task.test, scaler, weights[best:best + 1], task.classes)[0]
    scores = macro_scores(y[task.test], test_prob, task.classes)
    return (float(c_grid[best]), selection.tied, float(selection.macro_f1), scores,
            task.classes[test_prob.argmax(axis=1)], test_prob.max(axis=1), per_c)
