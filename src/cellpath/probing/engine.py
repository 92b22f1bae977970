"""The probe engine: every (task, C) fit of a group of tasks in one pass over the group's rows.

A *group* is T tasks with the same number of classes K: each task's training rows standardised
with its own scaler into one float32 design block ``(T, n, D + 1)`` (a ones column last; rows past
a task's own count are zero and weigh nothing), held in memory or — for one task larger than the
memory budget — read in chunks at every product. The weights of every task and candidate C are
one ``(T, L, D + 1, K)`` tensor, so one batched matrix product serves all T·L fits.

Each fit minimises its own objective — mean cross-entropy + ||W[:D]||²/(2·C·n_t), doubled for two
classes (``binary_factor``), so ``C`` means scikit-learn's ``C`` — from zero, with its own L-BFGS
history, line search and stopping test, as ``scipy.optimize``'s L-BFGS-B under scikit-learn's lbfgs:
largest |gradient entry| ≤ ``tol`` or relative reduction ≤ ``FTOL``. What differs is how it gets there:

- **Two products per iteration, in float32**: the logit step ΔZ = X ΔW of the search directions
  and the gradient Xᵀ R. The line search needs no product: its trials are Z + t·ΔZ, evaluated in
  float64 from the kept logits Z (float32's rounding of the objective, ~1e-7 relative, would stop a
  line search long before a gradient tolerance of 1e-6). Z is recomputed from the weights every
  ``REFRESH`` iterations so that float32 steps do not accumulate.
- **Preconditioned** (L-BFGS in the coordinates where the objective's curvature is about even):
  foundation-model features are strongly correlated (condition numbers of XᵀX/n of 10⁷–10⁸), which
  is what makes plain L-BFGS take hundreds of iterations. Each task's top ``RANK`` eigenpairs of
  XᵀX/n (randomised subspace iteration, seeded, on at most ``SAMPLE_ROWS`` of its rows) give the
  initial inverse Hessian H₀ = γ·(c·XᵀX/n + 2·penalty)⁻¹ (the remaining eigenvalues taken as their
  mean; c = 0.5/K, the softmax's curvature scale; γ = s·y / yᵀH₀y as scipy scales its identity).
  This changes the path, not the optimum: 3–5× fewer iterations on the default's features.
- Fits leave the arithmetic when they stop (a task when all its Cs have, a C when all tasks' have).

The same code runs on the CPU and on CUDA (torch). A task's iterates depend on its group only
through float32 rounding in the batched products, far below the tolerance (tests: chosen C and
Macro-F1 equal alone and in a full run).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

FTOL = 64 * float(np.finfo(np.float64).eps)  # scikit-learn's lbfgs: ftol = 64·eps (scipy's factr·eps)
ARMIJO = 1e-4
MAX_LINE_SEARCH = 30
HISTORY = 10          # (s, y) pairs kept per fit, scipy's default (maxcor)
REFRESH = 10          # iterations between recomputing the logits from the weights
RANK = 64             # eigenpairs of XᵀX/n in the preconditioner
SAMPLE_ROWS = 16384   # rows of a task the preconditioner is estimated from (evenly spaced)
POWER_STEPS = 2       # subspace iterations of the randomised eigensolver
BUILD_ROWS = 16384    # rows read from the source at a time while a design block is built
STANDARDISE_ROWS = 1024  # rows standardised at a time through design_block's float64 buffer


class RowSource(Protocol):
    """Feature rows by position: ``take(rows)`` → float32 ``(len(rows), width)``."""

    @property
    def width(self) -> int: ...

    def take(self, rows: np.ndarray) -> np.ndarray: ...


def binary_factor(n_classes: int) -> float:
    """Penalty multiplier: 2 for a two-class task (scikit-learn fits one binary weight vector v with
    ||v||²/(2·C·n); the two-column softmax has the same optimum with its penalty doubled, its
    minimum-norm columns being ±v/2), else 1."""
    return 2.0 if n_classes == 2 else 1.0


def chunks(rows: np.ndarray, chunk_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, rows[start:start + chunk_rows]) over ``rows``."""
    for start in range(0, len(rows), chunk_rows):
        yield start, rows[start:start + chunk_rows]


def design_block(raw: np.ndarray, scaler: tuple[np.ndarray, np.ndarray], dtype: type = np.float32) -> np.ndarray:
    """(n, D + 1) in ``dtype``: rows standardised with ``scaler`` (computed in float64) and a ones column.

    Standardised ``STANDARDISE_ROWS`` rows at a time through one float64 buffer: the same values as
    one whole-block expression, without its float64 copy of the block (5–6× faster on 64,000 × 1,280
    float16 rows, which matters where a streamed design is re-read at every product)."""
    mean, sd = scaler
    out = np.empty((len(raw), len(mean) + 1), dtype=dtype)
    buffer = np.empty((min(STANDARDISE_ROWS, len(raw)), len(mean)))
    for start in range(0, len(raw), STANDARDISE_ROWS):
        part = raw[start:start + STANDARDISE_ROWS]
        rows = buffer[:len(part)]
        np.subtract(part, mean, out=rows)
        np.divide(rows, sd, out=out[start:start + len(part), :-1], casting="same_kind")
    out[:, -1] = 1.0
    return out


class Design:
    """The float32 designs of a group's tasks, (T, n, D + 1): held on ``device``, or (one task)
    re-read from ``source`` in chunks of ``chunk_rows`` at every product, the same chunks each time."""

    def __init__(self, source: RowSource, rows: list[np.ndarray], scalers: list[tuple[np.ndarray, np.ndarray]],
                 chunk_rows: int, device: str) -> None:
        self.source, self.rows, self.scalers, self.device = source, rows, scalers, device
        self.chunk_rows = max(1, chunk_rows)
        self.n = max(len(r) for r in rows)
        self.counts = torch.tensor([len(r) for r in rows], dtype=torch.float64, device=device)
        self.held = None
        if len(rows) > 1 or self.n <= self.chunk_rows:
            held = np.zeros((len(rows), self.n, source.width + 1), dtype=np.float32)
            for t, (task_rows, scaler) in enumerate(zip(rows, scalers)):
                for start, part in chunks(task_rows, BUILD_ROWS):
                    held[t, start:start + len(part)] = design_block(source.take(part), scaler)
            self.held = torch.from_numpy(held).to(device)

    def _blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        if self.held is not None:
            yield 0, self.held
            return
        for start, part in chunks(self.rows[0], self.chunk_rows):
            yield start, torch.from_numpy(design_block(self.source.take(part), self.scalers[0]))[None].to(self.device)

    def times(self, v: torch.Tensor) -> torch.Tensor:
        """X V, float64 (T, n, P), the product in float32; ``v``: (T, D + 1, P)."""
        v32 = v.to(torch.float32)
        return torch.cat([torch.bmm(block, v32).to(torch.float64) for _, block in self._blocks()], dim=1)

    def transpose_times(self, r: torch.Tensor) -> torch.Tensor:
        """Xᵀ R, float64 (T, D + 1, P), the products in float32, chunk sums in float64; ``r``: (T, n, P)."""
        total = None
        for start, block in self._blocks():
            part = torch.bmm(block.transpose(1, 2), r[:, start:start + block.shape[1]].to(torch.float32))
            total = part.to(torch.float64) if total is None else total + part.to(torch.float64)
        return total

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """At most ``SAMPLE_ROWS`` (streamed: and one chunk) evenly spaced feature rows per task
        (T, m, D) float32, zero past a task's own rows, and how many of them are the task's (T,).
        A task's rows are spaced by its own size, so its sample is the same in any group."""
        if self.held is not None:
            steps = [-(-len(rows) // SAMPLE_ROWS) for rows in self.rows]
            if len(set(steps)) == 1:  # a view, no copy
                return self.held[:, ::steps[0], :-1], torch.ceil(self.counts / steps[0])
            taken = [torch.arange(0, len(rows), step, device=self.held.device) for rows, step in zip(self.rows, steps)]
            x = self.held.new_zeros((len(self.rows), max(len(t) for t in taken), self.held.shape[2] - 1))
            for t, positions in enumerate(taken):
                x[t, :len(positions)] = self.held[t, positions, :-1]
            return x, self.counts.new_tensor([len(t) for t in taken])
        rows = self.rows[0][::-(-self.n // min(SAMPLE_ROWS, self.chunk_rows))]  # within the memory budget
        block = design_block(self.source.take(rows), self.scalers[0])[:, :-1]
        return torch.from_numpy(block)[None].to(self.device), self.counts.new_tensor([len(rows)])


@dataclass
class Preconditioner:
    """Per task: top eigenvectors ``basis`` (T, D, r) and eigenvalues ``top`` (T, r) of XᵀX/n, the
    mean of the others ``rest`` (T,); with ``curvature`` c and a fit's penalty p it applies
    (c·XᵀX/n + 2p)⁻¹ to the feature rows and 1/c to the intercept row."""

    basis: torch.Tensor
    top: torch.Tensor
    rest: torch.Tensor
    curvature: float

    def subset(self, tasks: torch.Tensor) -> "Preconditioner":
        return Preconditioner(self.basis[tasks], self.top[tasks], self.rest[tasks], self.curvature)

    def apply(self, q: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
        """H₀·q for (T, L, D + 1, K) ``q`` and (T, L) ``penalty`` (γ not included)."""
        c, features = self.curvature, q[:, :, :-1]
        t, n_c, d, k = features.shape
        columns = features.permute(0, 2, 1, 3).reshape(t, d, n_c * k)                  # (T, D, L·K)
        projected = torch.bmm(self.basis.transpose(1, 2), columns).view(t, -1, n_c, k)  # (T, r, L, K)
        top = 1.0 / (c * self.top[:, :, None] + 2.0 * penalty[:, None, :])             # (T, r, L)
        rest = 1.0 / (c * self.rest[:, None] + 2.0 * penalty)                           # (T, L)
        back = torch.bmm(self.basis, ((top - rest[:, None, :])[..., None] * projected).flatten(2))
        out = torch.empty_like(q)
        out[:, :, :-1] = rest[:, :, None, None] * features + back.view(t, d, n_c, k).permute(0, 2, 1, 3)
        out[:, :, -1] = q[:, :, -1] / c
        return out


def preconditioner(design: Design, n_classes: int) -> Preconditioner:
    """Each task's top ``RANK`` eigenpairs of XᵀX/n by seeded randomised subspace iteration on
    :meth:`Design.sample` (float32 products, float64 eigen-decomposition of the projected matrix)."""
    x, counts = design.sample()
    t, _, d = x.shape
    r = min(RANK, d)
    omega = np.random.default_rng(0).standard_normal((d, r)).astype(np.float32)
    basis = torch.from_numpy(omega).to(x.device).expand(t, d, r)
    for _ in range(POWER_STEPS + 1):
        basis = torch.linalg.qr(torch.bmm(x.transpose(1, 2), torch.bmm(x, basis)).to(torch.float64))[0]
        basis = basis.to(torch.float32)
    projected = torch.bmm(x, basis).to(torch.float64)
    small = torch.bmm(projected.transpose(1, 2), projected) / counts[:, None, None]
    top, vectors = torch.linalg.eigh(small)
    trace = torch.stack([part.square().sum(dtype=torch.float64) for part in x]) / counts  # a task at a time
    rest = ((trace - top.sum(dim=1)) / max(d - r, 1)).clamp(min=0.0)
    return Preconditioner(torch.bmm(basis.to(torch.float64), vectors), top.clamp(min=0.0), rest, 0.5 / n_classes)


@dataclass
class GroupProblem:
    """The objectives of a group's fits: ``labels`` (T, n) class positions in each task's classes,
    ``weight`` (T, n) 1/n_t on a task's rows and 0 on padding, ``penalty`` (T, L) binary_factor/(2·C·n_t)."""

    labels: torch.Tensor
    weight: torch.Tensor
    penalty: torch.Tensor

    def data_terms(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy (T, L) and log-probabilities (T, n, L, K) of logits ``z`` (T, n, L, K)."""
        log_p = torch.log_softmax(z, dim=3)
        index = self.labels[:, :, None, None].expand(-1, -1, z.shape[2], 1)
        picked = log_p.gather(3, index)[..., 0]
        return -(self.weight[:, :, None] * picked).sum(dim=1), log_p

    def residual(self, log_p: torch.Tensor) -> torch.Tensor:
        """(T, n, L·K) weighted probabilities − one-hot: the data gradient is Xᵀ times it."""
        r = torch.exp(log_p) * self.weight[:, :, None, None]
        index = self.labels[:, :, None, None].expand(-1, -1, log_p.shape[2], 1)
        r.scatter_add_(3, index, -self.weight[:, :, None, None].expand(-1, -1, log_p.shape[2], 1))
        return r.flatten(2)


@dataclass
class GroupFit:
    """Weights (T, L, D + 1, K) float64, L-BFGS iterations (T, L) and whether each fit met the tolerance."""

    weights: torch.Tensor
    iterations: torch.Tensor
    converged: torch.Tensor


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-fit inner products (T, L) of two (T, L, D + 1, K) tensors."""
    return (a * b).sum(dim=(2, 3))


def _largest(a: torch.Tensor) -> torch.Tensor:
    """Per-fit largest absolute entry (T, L)."""
    return a.abs().amax(dim=(2, 3))


def _product(w: torch.Tensor) -> torch.Tensor:
    """(T, L, D + 1, K) weights → (T, D + 1, L·K) columns of the batched product."""
    return w.permute(0, 2, 1, 3).flatten(2)


class _Fits:
    """The tasks and Cs still running: weights, logits, value, gradient and L-BFGS history of each."""

    def __init__(self, design: Design, problem: GroupProblem, precondition: Preconditioner, w: torch.Tensor) -> None:
        self.design, self.problem, self.precondition = design, problem, precondition
        self.tasks = torch.arange(w.shape[0], device=w.device)
        self.cs = torch.arange(w.shape[1], device=w.device)
        self.w = w
        self.s = torch.zeros((HISTORY, *w.shape), dtype=w.dtype, device=w.device)
        self.y = torch.zeros_like(self.s)
        self.rho = torch.zeros((HISTORY, *w.shape[:2]), dtype=w.dtype, device=w.device)  # 0: an empty slot
        self.gamma = torch.ones(w.shape[:2], dtype=w.dtype, device=w.device)
        self.iterations = torch.zeros(w.shape[:2], dtype=torch.int64, device=w.device)
        self.active = torch.ones(w.shape[:2], dtype=torch.bool, device=w.device)
        self.refresh()

    def logits(self, w: torch.Tensor) -> torch.Tensor:
        t, n_c, _, k = w.shape
        return self.design.times(_product(w)).view(t, -1, n_c, k)

    def refresh(self) -> None:
        """Logits, value and gradient recomputed from the weights (two products)."""
        z = self.logits(self.w)
        self.set_point(z, *self.problem.data_terms(z))

    def set_point(self, z: torch.Tensor, data: torch.Tensor, log_p: torch.Tensor) -> None:
        t, n_c, d1, k = self.w.shape
        self.z = z
        self.value = data + self.problem.penalty * (self.w[:, :, :-1] ** 2).sum(dim=(2, 3))
        grad = self.design.transpose_times(self.problem.residual(log_p)).view(t, d1, n_c, k).permute(0, 2, 1, 3)
        penalised = torch.zeros_like(self.w)
        penalised[:, :, :-1] = 2.0 * self.problem.penalty[:, :, None, None] * self.w[:, :, :-1]
        self.grad = grad + penalised

    def keep(self, tasks: torch.Tensor, cs: torch.Tensor) -> None:
        """Keep only these tasks and Cs (positions among the current ones) in the arithmetic."""
        at = (tasks[:, None], cs[None, :])
        self.design = _Subset(self.design, tasks) if len(tasks) < len(self.tasks) else self.design
        self.problem = GroupProblem(self.problem.labels[tasks], self.problem.weight[tasks],
                                    self.problem.penalty[at])
        self.precondition = self.precondition.subset(tasks)
        self.tasks, self.cs = self.tasks[tasks], self.cs[cs]
        for name in ("w", "value", "grad", "gamma", "iterations", "active"):
            setattr(self, name, getattr(self, name)[at])
        self.z = self.z[tasks][:, :, cs]
        self.s, self.y, self.rho = self.s[:, at[0], at[1]], self.y[:, at[0], at[1]], self.rho[:, at[0], at[1]]

    def direction(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each fit's search direction and first trial step: the L-BFGS two-loop recursion with the
        preconditioner as initial inverse Hessian, or (first iteration, or a direction that is not
        downhill) −H₀g with step 1/√(g·H₀g), the preconditioned steepest descent."""
        g, penalty = self.grad, self.problem.penalty
        if step > 0:
            slots = [(step - 1 - i) % HISTORY for i in range(min(step, HISTORY))]
            q, alphas = g.clone(), []
            for j in slots:
                alpha = self.rho[j] * _dot(self.s[j], q)
                q -= alpha[:, :, None, None] * self.y[j]
                alphas.append(alpha)
            q = self.gamma[:, :, None, None] * self.precondition.apply(q, penalty)
            for j, alpha in zip(reversed(slots), reversed(alphas)):
                q += (alpha - self.rho[j] * _dot(self.y[j], q))[:, :, None, None] * self.s[j]
            downhill = _dot(g, q) > 0
            if bool((downhill | ~self.active).all()):
                return -q * self.active[:, :, None, None], torch.ones_like(self.gamma)
        plain = self.precondition.apply(g, penalty)
        rate = 1.0 / _dot(g, plain).clamp(min=torch.finfo(g.dtype).tiny).sqrt()
        if step == 0:
            return -plain * self.active[:, :, None, None], rate
        d = torch.where(downhill[:, :, None, None], -q, -plain) * self.active[:, :, None, None]
        return d, torch.where(downhill, 1.0, rate)


class _Subset:
    """Some tasks of a held design (the tasks still running)."""

    def __init__(self, design: Design | "_Subset", tasks: torch.Tensor) -> None:
        self.held = design.held[tasks]

    def times(self, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.held, v.to(torch.float32)).to(torch.float64)

    def transpose_times(self, r: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.held.transpose(1, 2), r.to(torch.float32)).to(torch.float64)


def _line_search(fits: _Fits, d: torch.Tensor, rate: torch.Tensor):
    """Backtracking on the Armijo condition with safeguarded quadratic interpolation from the kept
    logits: (accepted per fit, step taken, logits, data value, log-probabilities at the step)."""
    problem = fits.problem
    dz = fits.logits(d)
    slope = _dot(fits.grad, d)
    w, dd = fits.w[:, :, :-1], d[:, :, :-1]
    w_sq, w_d, d_sq = (w**2).sum(dim=(2, 3)), (w * dd).sum(dim=(2, 3)), (dd**2).sum(dim=(2, 3))
    searching = fits.active.clone()
    step = torch.zeros_like(rate)
    new_z = new_data = new_log_p = None
    for _ in range(MAX_LINE_SEARCH):
        trial_z = fits.z + rate[:, None, :, None] * dz
        data, log_p = problem.data_terms(trial_z)
        value = data + problem.penalty * (w_sq + 2 * rate * w_d + rate**2 * d_sq)
        accept = searching & torch.isfinite(value) & (value <= fits.value + ARMIJO * rate * slope)
        if new_z is None:
            new_z, new_data, new_log_p = trial_z, data, log_p
        else:
            mask = accept[:, None, :, None]
            new_z, new_log_p = torch.where(mask, trial_z, new_z), torch.where(mask, log_p, new_log_p)
            new_data = torch.where(accept, data, new_data)
        step = torch.where(accept, rate, step)
        searching &= ~accept
        if not bool(searching.any()):
            break
        excess = torch.where(torch.isfinite(value), value - fits.value - slope * rate, torch.inf)
        quadratic = -slope * rate**2 / (2 * excess.clamp(min=1e-300))
        rate = torch.where(searching, torch.minimum(torch.maximum(quadratic, 0.1 * rate), 0.5 * rate), rate)
    return fits.active & ~searching, step, new_z, new_data, new_log_p


def fit_group(design: Design, problem: GroupProblem, n_classes: int, *, tol: float, max_iter: int) -> GroupFit:
    """Minimise every (task, C) objective of ``problem`` from zero, each to its own stopping test."""
    t, n_c = problem.penalty.shape
    w = torch.zeros(t, n_c, design.held.shape[2] if design.held is not None else design.source.width + 1,
                    n_classes, dtype=torch.float64, device=problem.penalty.device)
    fits = _Fits(design, problem, preconditioner(design, n_classes), w)
    out_w, out_iterations = w.clone(), torch.zeros(t, n_c, dtype=torch.int64, device=w.device)
    out_converged = _largest(fits.grad) <= tol
    fits.active = ~out_converged
    for step in range(max_iter):
        tasks, cs = fits.active.any(dim=1), fits.active.any(dim=0)
        if not bool(tasks.any()):
            break
        if not bool(tasks.all() and cs.all()):
            fits.keep(torch.nonzero(tasks)[:, 0], torch.nonzero(cs)[:, 0])
        d, rate = fits.direction(step)
        moved, taken, z, data, log_p = _line_search(fits, d, rate)
        s = taken[:, :, None, None] * d
        moved &= _largest(s) > 0  # a failed line search, or a step too short to change w: stopped unconverged
        old_value, old_grad, active = fits.value, fits.grad, fits.active
        fits.w = fits.w + s
        if (step + 1) % REFRESH == 0:
            fits.refresh()
        else:
            fits.set_point(torch.where(moved[:, None, :, None], z, fits.z), data, log_p)
        y = fits.grad - old_grad
        sy, yy = _dot(s, y), _dot(y, fits.precondition.apply(y, fits.problem.penalty))
        curved = moved & (sy > torch.finfo(torch.float64).eps * yy)
        slot = step % HISTORY
        fits.s[slot], fits.y[slot] = s, y
        fits.rho[slot] = torch.where(curved, 1.0 / torch.where(curved, sy, 1.0), 0.0)
        fits.gamma = torch.where(curved, sy / torch.where(curved, yy, 1.0), fits.gamma)
        reduction = (old_value - fits.value) / torch.clamp(torch.maximum(old_value.abs(), fits.value.abs()), min=1.0)
        fits.iterations += moved.to(torch.int64)
        done = moved & ((_largest(fits.grad) <= tol) | (reduction <= FTOL))
        fits.active = active & moved & ~done & (fits.iterations < max_iter)
        stopped = active & ~fits.active
        if bool(stopped.any()):
            at = (fits.tasks[:, None].expand_as(stopped)[stopped], fits.cs[None, :].expand_as(stopped)[stopped])
            out_w[at], out_iterations[at] = fits.w[stopped], fits.iterations[stopped]
            out_converged[at] = done[stopped]
    return GroupFit(out_w, out_iterations, out_converged)
