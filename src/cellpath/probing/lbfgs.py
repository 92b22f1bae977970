"""L-BFGS for many independent smooth problems at once, each stopping on its own criterion.

Why not ``torch.optim.LBFGS`` or scipy: torch's L-BFGS minimises one objective, so a batch of probes
would share one line search, one curvature history and one stopping rule — a problem's result
would depend on the problems it was batched with. scipy's ``fmin_l_bfgs_b`` (scikit-learn's lbfgs)
solves one problem per call, with Python-level work per iteration, which is what batching removes.
Here everything is per problem: its own history (the last ``history`` (s, y) pairs), its own
backtracking line search and its own stopping test, so a problem's iterates are the same whatever
else is in the batch. The batch only shares the tensor operations; problems that have stopped are
dropped from them.

Layout: the parameters are one tensor ``(T, L, D, K)`` holding T·L problems; problem ``(t, l)``
owns the contiguous block ``[t, l]`` (for the probe: task t at candidate C number l, so one matrix
product serves all of a task's candidates). Per-problem sums run over a contiguous block, so
their rounding does not depend on how many problems sit beside it. The objective returns values
``(T, L)`` and the gradient in the parameters' layout; ``objective.subset(rows, columns)`` is the
same objective on those tasks and candidates. When half of the batch's rows, or of its columns,
hold only stopped problems, they are dropped from the arithmetic.

Stopping, as scipy's L-BFGS-B under scikit-learn: the largest absolute gradient entry at or below
``tol`` (``gtol``), or a relative reduction of the objective at or below ``ftol``
(``(f_k − f_{k+1}) / max(|f_k|, |f_{k+1}|, 1)``, scipy's ``factr·eps``); otherwise the problem runs
until ``max_iter`` iterations or until its line search finds no decrease (not converged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

FTOL = 64 * torch.finfo(torch.float64).eps  # scikit-learn's lbfgs: ftol = 64·eps (scipy's factr·eps)
ARMIJO = 1e-4
MAX_LINE_SEARCH = 30
HISTORY = 10  # (s, y) pairs kept per problem, scipy's default (maxcor)


class BatchObjective(Protocol):
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def subset(self, rows: torch.Tensor, columns: torch.Tensor) -> "BatchObjective": ...


@dataclass
class BatchedSolution:
    """Minimisers and how each problem ended."""

    x: torch.Tensor              # (T, L, D, K)
    value: torch.Tensor          # (T, L) objective at x
    grad_max: torch.Tensor       # (T, L) largest |gradient entry| at x
    iterations: torch.Tensor     # (T, L) L-BFGS iterations taken
    converged: torch.Tensor      # (T, L) bool: met gtol or ftol before max_iter or a failed line search


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-problem inner products (T, L) of two (T, L, D, K) tensors."""
    return (a * b).sum(dim=(2, 3))


def _largest(a: torch.Tensor) -> torch.Tensor:
    """Per-problem largest absolute entry (T, L)."""
    return a.abs().amax(dim=(2, 3))


def _scaled(values: torch.Tensor) -> torch.Tensor:
    """(T, L) → (T, L, 1, 1), to scale each problem's block."""
    return values[:, :, None, None]


class _State:
    """The working rows and columns of a batch: each problem's point, value, gradient and history."""

    def __init__(self, objective: BatchObjective, x: torch.Tensor, history: int) -> None:
        t, n_c = x.shape[:2]
        self.objective = objective
        self.rows = torch.arange(t, device=x.device)       # positions in the caller's batch
        self.columns = torch.arange(n_c, device=x.device)
        self.x = x
        self.value, self.grad = objective(x)
        self.s = torch.zeros((history, *x.shape), dtype=x.dtype, device=x.device)
        self.y = torch.zeros_like(self.s)
        self.rho = torch.zeros(history, t, n_c, dtype=x.dtype, device=x.device)  # 0: an empty slot
        self.gamma = torch.ones(t, n_c, dtype=x.dtype, device=x.device)
        self.iterations = torch.zeros(t, n_c, dtype=torch.int64, device=x.device)
        self.converged = torch.zeros(t, n_c, dtype=torch.bool, device=x.device)
        self.active = torch.ones(t, n_c, dtype=torch.bool, device=x.device)

    def keep(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Keep only these rows (tasks) and columns (candidates) in the arithmetic."""
        self.objective = self.objective.subset(rows, columns)
        self.rows, self.columns = self.rows[rows], self.columns[columns]
        for name in ("x", "grad", "value", "gamma", "iterations", "active", "converged"):
            setattr(self, name, getattr(self, name)[rows][:, columns])
        self.s, self.y = self.s[:, rows][:, :, columns], self.y[:, rows][:, :, columns]
        self.rho = self.rho[:, rows][:, :, columns]

    def direction(self, newest: int, count: int) -> torch.Tensor:
        """−H·g by the two-loop recursion over the ring's ``count`` newest slots."""
        m = self.s.shape[0]
        slots = [(newest - i) % m for i in range(count)]
        q = self.grad.clone()
        alphas = []
        for j in slots:
            alpha = self.rho[j] * _dot(self.s[j], q)
            q -= _scaled(alpha) * self.y[j]
            alphas.append(alpha)
        r = _scaled(self.gamma) * q
        for j, alpha in zip(reversed(slots), reversed(alphas)):
            beta = self.rho[j] * _dot(self.y[j], r)
            r += _scaled(alpha - beta) * self.s[j]
        return -r


def _direction(state: _State, step: int, history: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each active problem's search direction, first trial step and slope along it: steepest descent
    (step length 1) at the first iteration and where the L-BFGS direction is not downhill (a
    numerically useless history), the L-BFGS direction with step 1 elsewhere; stopped problems get 0."""
    active, value, grad, x = state.active, state.value, state.grad, state.x
    steepest = grad.norm(dim=(2, 3)).clamp(min=torch.finfo(x.dtype).tiny)
    if step == 0:
        direction, rate = -grad, 1.0 / steepest
    else:
        direction, rate = state.direction((step - 1) % history, min(step, history)), torch.ones_like(value)
    slope = _dot(grad, direction)
    uphill = slope >= 0
    if step > 0 and bool((uphill & active).any()):
        direction = torch.where(_scaled(uphill), -grad, direction)
        slope = torch.where(uphill, -_dot(grad, grad), slope)
        rate = torch.where(uphill, 1.0 / steepest, rate)
    return direction * _scaled(active.to(x.dtype)), rate, slope


def _line_search(state: _State, direction: torch.Tensor, rate: torch.Tensor, slope: torch.Tensor):
    """Backtracking on the Armijo condition with safeguarded quadratic interpolation, at most
    ``MAX_LINE_SEARCH`` trials: (still searching — no step accepted —, new x, value, gradient)."""
    x, value, grad = state.x, state.value, state.grad
    searching = state.active.clone()
    new_x, new_value, new_grad = x, value, grad
    for _ in range(MAX_LINE_SEARCH):
        trial_x = x + _scaled(torch.where(searching, rate, 0.0)) * direction
        trial_value, trial_grad = state.objective(trial_x)
        accept = searching & torch.isfinite(trial_value) & (trial_value <= value + ARMIJO * rate * slope)
        new_x = torch.where(_scaled(accept), trial_x, new_x)
        new_value = torch.where(accept, trial_value, new_value)
        new_grad = torch.where(_scaled(accept), trial_grad, new_grad)
        searching &= ~accept
        if not bool(searching.any()):
            break
        # minimiser of the quadratic through f(0), f'(0) and f(rate), kept within [0.1, 0.5]·rate
        excess = torch.where(torch.isfinite(trial_value), trial_value - value - slope * rate, torch.inf)
        quadratic = -slope * rate**2 / (2 * excess.clamp(min=1e-300))
        rate = torch.where(searching, torch.minimum(torch.maximum(quadratic, 0.1 * rate), 0.5 * rate), rate)
    return searching, new_x, new_value, new_grad


def minimise(objective: BatchObjective, x0: torch.Tensor, *, tol: float, max_iter: int, history: int = HISTORY,
             ftol: float = FTOL) -> BatchedSolution:
    """Minimise T·L independent objectives from ``x0`` (T, L, D, K).

    Each iteration: the L-BFGS direction from the problem's own history (scaled identity
    s·y / y·y as the initial Hessian; the first step has length 1 like scipy's), a backtracking
    line search on the Armijo condition with safeguarded quadratic interpolation (at most
    ``MAX_LINE_SEARCH`` trials), and the history update when the curvature s·y is positive.
    """
    state = _State(objective, x0.clone(), history)
    out_x, out_value = state.x.clone(), state.value.clone()
    out_grad_max = _largest(state.grad)
    out_iterations = torch.zeros_like(state.iterations)
    state.converged = out_grad_max <= tol
    state.active = ~state.converged
    out_converged = state.converged.clone()

    def write_back() -> None:
        """Copy the working problems' state into the outputs (the block they occupy there)."""
        at = (state.rows[:, None], state.columns[None, :])
        out_x[at] = state.x
        out_value[at], out_grad_max[at] = state.value, _largest(state.grad)
        out_iterations[at], out_converged[at] = state.iterations, state.converged

    for step in range(max_iter):
        if not bool(state.active.any()):
            break
        live_rows, live_columns = state.active.any(dim=1), state.active.any(dim=0)
        if 2 * int(live_rows.sum()) <= len(live_rows) or 2 * int(live_columns.sum()) <= len(live_columns):
            write_back()  # drop rows and columns of stopped problems from the arithmetic
            state.keep(torch.nonzero(live_rows)[:, 0], torch.nonzero(live_columns)[:, 0])
        active, value, grad, x = state.active, state.value, state.grad, state.x
        direction, rate, slope = _direction(state, step, history)
        searching, new_x, new_value, new_grad = _line_search(state, direction, rate, slope)
        s = new_x - x
        # a failed line search (no trial accepted, or only steps too short to change x) leaves the
        # problem where it is, and stops it unconverged
        moved = active & ~searching & (_largest(s) > 0)
        y = new_grad - grad
        sy, yy = _dot(s, y), _dot(y, y)
        curved = moved & (sy > torch.finfo(x.dtype).eps * yy)
        slot = step % history
        state.s[slot], state.y[slot] = s, y
        state.rho[slot] = torch.where(curved, 1.0 / torch.where(curved, sy, 1.0), 0.0)
        state.gamma = torch.where(curved, sy / torch.where(curved, yy, 1.0), state.gamma)
        reduction = (value - new_value) / torch.maximum(torch.maximum(value.abs(), new_value.abs()),
                                                        torch.ones_like(value))
        state.x, state.value, state.grad = new_x, new_value, new_grad
        state.iterations += moved.to(torch.int64)
        done = moved & ((_largest(new_grad) <= tol) | (reduction <= ftol))
        state.converged |= done
        state.active = active & moved & ~done
    write_back()
    return BatchedSolution(out_x, out_value, out_grad_max, out_iterations, out_converged)
