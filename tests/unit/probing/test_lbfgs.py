"""Batched L-BFGS: each problem converges to its own minimiser, on its own criterion, whatever it is batched with."""

from __future__ import annotations

import numpy as np
import scipy.optimize
import torch

from cellpath.probing import lbfgs


class Quadratics:
    """T·L strictly convex quadratics ½ xᵀA x − bᵀx, one per block [t, l] of a (T, L, D, K) tensor."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, d: int, k: int) -> None:
        self.a, self.b, self.d, self.k = a, b, d, k  # a: (T, L, d·k, d·k), b: (T, L, d·k)

    def subset(self, rows: torch.Tensor, columns: torch.Tensor) -> "Quadratics":
        return Quadratics(self.a[rows][:, columns], self.b[rows][:, columns], self.d, self.k)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, n_c = x.shape[:2]
        flat = x.reshape(t, n_c, self.d * self.k)
        ax = torch.matmul(self.a, flat[..., None])[..., 0]  # one product per problem
        value = 0.5 * (flat * ax).sum(-1) - (self.b * flat).sum(-1)
        return value, (ax - self.b).reshape(x.shape)

    def minimiser(self) -> np.ndarray:
        t, n_c = self.b.shape[:2]
        flat = np.linalg.solve(self.a.numpy(), self.b.numpy()[..., None])[..., 0]
        return flat.reshape(t, n_c, self.d, self.k)


def _quadratics(seed: int, t: int, d: int, n_c: int, k: int, max_log_condition: float = 3.0) -> Quadratics:
    """Condition numbers 1 … 10^max_log_condition (at 10⁴, f − f* falls below float64's resolution of f
    before |g| reaches 1e-6)."""
    rng = np.random.default_rng(seed)
    size = d * k
    a = np.empty((t, n_c, size, size))
    for i in range(t):
        for j in range(n_c):
            q, _ = np.linalg.qr(rng.normal(size=(size, size)))
            a[i, j] = q @ np.diag(np.logspace(0, rng.uniform(0, max_log_condition), size)) @ q.T
    return Quadratics(torch.from_numpy(a), torch.from_numpy(rng.normal(size=(t, n_c, size))), d, k)


def _zeros(t: int, d: int, n_c: int, k: int) -> torch.Tensor:
    return torch.zeros(t, n_c, d, k, dtype=torch.float64)


def test_each_problem_reaches_its_minimiser_and_gradient_tolerance():
    problems = _quadratics(0, t=3, d=4, n_c=2, k=2)
    result = lbfgs.minimise(problems, _zeros(3, 4, 2, 2), tol=1e-6, max_iter=500)
    assert result.converged.all() and (result.grad_max <= 1e-6).all()
    np.testing.assert_allclose(result.x.numpy(), problems.minimiser(), atol=1e-6)  # |x − x*| ≤ |g| / λ_min
    value, grad = problems(result.x)
    torch.testing.assert_close(result.value, value)
    torch.testing.assert_close(result.grad_max, grad.abs().amax(dim=(2, 3)))
    assert result.iterations.min() < result.iterations.max()  # each stopped when it was done, not together


def test_a_problem_iterates_the_same_alone_and_in_a_batch():
    """Other problems, and the compaction of the batch as they stop, do not change a problem's iterates."""
    problems = _quadratics(1, t=5, d=3, n_c=3, k=3)
    batch = lbfgs.minimise(problems, _zeros(5, 3, 3, 3), tol=1e-8, max_iter=300)
    assert len(set(batch.iterations.flatten().tolist())) > 5  # stops at many different steps
    for i in range(5):
        for j in range(3):
            alone = lbfgs.minimise(problems.subset(torch.tensor([i]), torch.tensor([j])), _zeros(1, 3, 1, 3),
                                   tol=1e-8, max_iter=300)
            assert alone.iterations.item() == batch.iterations[i, j].item()
            torch.testing.assert_close(alone.x[0, 0], batch.x[i, j], atol=1e-12, rtol=0)


class RosenbrockAndQuadratic:
    """Column 0: Rosenbrock's function of x[t, 0, 0:2, 0]; column 1: (u − 3)² + (v + 2)² of x[t, 1, 0:2, 0]."""

    def __init__(self, kinds: tuple[str, ...] = ("rosenbrock", "quadratic")) -> None:
        self.kinds = kinds

    def subset(self, rows: torch.Tensor, columns: torch.Tensor) -> "RosenbrockAndQuadratic":
        return RosenbrockAndQuadratic(tuple(self.kinds[c] for c in columns.tolist()))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, grad = [], torch.zeros_like(x)
        for column, kind in enumerate(self.kinds):
            u, v = x[:, column, 0, 0], x[:, column, 1, 0]
            if kind == "rosenbrock":
                values.append((1 - u) ** 2 + 100 * (v - u**2) ** 2)
                grad[:, column, 0, 0], grad[:, column, 1, 0] = -2 * (1 - u) - 400 * u * (v - u**2), 200 * (v - u**2)
            else:
                values.append((u - 3) ** 2 + (v + 2) ** 2)
                grad[:, column, 0, 0], grad[:, column, 1, 0] = 2 * (u - 3), 2 * (v + 2)
        return torch.stack(values, dim=1), grad


def test_rosenbrock_beside_a_quadratic_matches_scipy():
    """A non-convex problem needs many iterations; the quadratic beside it stops early."""
    start = _zeros(1, 2, 2, 1)
    start[0, 0, :, 0] = torch.tensor([-1.2, 1.0])
    result = lbfgs.minimise(RosenbrockAndQuadratic(), start, tol=1e-8, max_iter=1000)
    assert result.converged.all()
    np.testing.assert_allclose(result.x[0, 0, :, 0].numpy(), [1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(result.x[0, 1, :, 0].numpy(), [3.0, -2.0], atol=1e-8)
    reference = scipy.optimize.minimize(scipy.optimize.rosen, [-1.2, 1.0], jac=scipy.optimize.rosen_der,
                                        method="L-BFGS-B", options={"gtol": 1e-8, "maxiter": 1000})
    assert result.iterations[0, 0] <= 3 * reference.nit  # the same order of work as scipy's L-BFGS-B
    assert result.iterations[0, 1] < result.iterations[0, 0]


def test_the_iteration_limit_is_reported_as_not_converged():
    problems = _quadratics(2, t=2, d=5, n_c=1, k=2)
    result = lbfgs.minimise(problems, _zeros(2, 5, 1, 2), tol=1e-12, max_iter=4)
    assert result.iterations.tolist() == [[4], [4]] and not result.converged.any()
    assert (result.grad_max > 1e-12).all()


def test_a_problem_already_at_its_minimum_takes_no_step():
    problems = _quadratics(3, t=2, d=2, n_c=1, k=1)
    start = _zeros(2, 2, 1, 1)
    start[0] = torch.from_numpy(problems.minimiser()[0])
    result = lbfgs.minimise(problems, start, tol=1e-6, max_iter=100)
    assert result.iterations[0, 0] == 0 and result.converged.all()
    assert result.iterations[1, 0] > 0
    torch.testing.assert_close(result.x[0], start[0])


class EdgeOfTheDomain:
    """f = −x on x ≤ 1 and NaN beyond, started at 1: no step along the descent direction is accepted."""

    def subset(self, rows: torch.Tensor, columns: torch.Tensor) -> "EdgeOfTheDomain":
        return self

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(x[:, :, 0, 0] <= 1.0, -x[:, :, 0, 0], torch.nan), torch.full_like(x, -1.0)


def test_a_line_search_that_finds_no_decrease_stops_the_problem_unconverged():
    result = lbfgs.minimise(EdgeOfTheDomain(), torch.ones(1, 1, 1, 1, dtype=torch.float64), tol=1e-6, max_iter=50)
    assert not result.converged.any() and result.iterations.item() == 0
    assert result.x.item() == 1.0


def test_a_precision_floor_stops_on_ftol_as_scipy_does():
    """At condition 10⁶ |g| cannot reach 1e-12 in float64: the problem stops when f no longer decreases
    (converged by scipy's ftol rule, or a failed line search), never running to max_iter."""
    problems = _quadratics(4, t=1, d=3, n_c=1, k=2, max_log_condition=6.0)
    result = lbfgs.minimise(problems, _zeros(1, 3, 1, 2), tol=1e-12, max_iter=5000)
    assert result.iterations.item() < 5000
    np.testing.assert_allclose(result.x.numpy(), problems.minimiser(), rtol=1e-6, atol=1e-6)
