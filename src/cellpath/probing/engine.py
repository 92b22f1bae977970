"""The probe engine: every (task, C) fit of a group of tasks in one pass over the group's rows.

A *group* is T tasks with the same number of classes K: each task's training rows, stored once as
read (:class:`Design`: float16 where the rows are float16 values, else float32; held in memory, or
— a group larger than the memory budget — in a memory-mapped file) and standardised with the
task's own scaler chunk by chunk at every product; rows past a task's own count weigh nothing. The
weights of every task and candidate C are one ``(T, L, D + 1, K)`` tensor, so one batched matrix
product serves all T·L fits.

Each fit minimises its own objective — mean cross-entropy + ||W[:D]||²/(2·C·n_t), doubled for two
classes (``binary_factor``), so ``C`` means scikit-learn's ``C`` — from zero, with its own L-BFGS
history, line search and stopping test (:func:`fit_group`). What differs from scikit-learn's lbfgs
is how it gets there:

- **Two products per iteration, in float32**: the logit step ΔZ = X ΔW of the search directions
  and the gradient Xᵀ R. The line search needs no product: its trials are Z + t·ΔZ, evaluated in
  float64 from the kept logits Z (float32's rounding of the objective, ~1e-7 relative, would stop a
  line search long before a gradient tolerance of 1e-6). Z is recomputed from the weights every
  ``REFRESH`` iterations so that float32 steps do not accumulate.
- **Preconditioned** (L-BFGS in the coordinates where the objective's curvature is about even):
  foundation-model features are strongly correlated (condition numbers of XᵀX/n of 10⁷–10⁸), which
  is what makes plain L-BFGS take hundreds of iterations. Each task's top ``RANK`` eigenpairs of
  XᵀX/n (``rank_for``: 256 from 4,096 training rows, else 64; randomised subspace iteration,
  seeded, on at most ``SAMPLE_ROWS`` of its rows) give the
  initial inverse Hessian H₀ = γ·(c·XᵀX/n + 2·penalty)⁻¹ (the remaining eigenvalues taken as their
  mean; c = 0.5/K, the softmax's curvature scale; γ = s·y / yᵀH₀y as scipy scales its identity).
  This changes the path, not the optimum: 3–5× fewer iterations on the default's features.
- **Checked in float64**: a fit is converged only when its largest |gradient entry|, recomputed in
  float64 at the weights it returns, is ≤ tol; a fit that float32 cannot take there goes on with
  float64 products (docs/decisions/0040).
- Fits leave the arithmetic when they stop (a task when all its Cs have, a C when all tasks' have).

The same code runs on the CPU and on CUDA (torch). A task's iterates depend on its group only
through float32 rounding in the batched products, far below the tolerance (tests: chosen C and
Macro-F1 equal alone and in a full run) — groups are formed by a fixed rule, so the same tasks meet
the same company on any machine — and not at all on whether its design is held or streamed, nor
on the CPU threads (the products are the same on any thread count; the preconditioner's LAPACK
calls run on one thread).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
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
RANK = 256            # eigenpairs of XᵀX/n in the preconditioner of a task of RANK_ROWS rows or more
SMALL_RANK = 64       # ... of a smaller task, where applying 256 would cost more than the iterations it saves
RANK_ROWS = 4096
SAMPLE_ROWS = 16384   # rows of a task the preconditioner is estimated from (evenly spaced)
POWER_STEPS = 2       # subspace iterations of the randomised eigensolver
BUILD_ROWS = 16384    # rows read from the source at a time while a design is stored (at most)
PRODUCT_ROWS = 512    # rows per product chunk: stored rows standardised in float32 within the cache, then multiplied
SCALER_ROWS = 1024    # rows per float64 partial sum of a scaler (a fixed order: the same scaler held or streamed)
MAX_RECHECKS = 2      # float64 checks a fit may fail after its float32 gradient met tol before it is stopped


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


def design_block(raw: np.ndarray, scaler: tuple[np.ndarray, np.ndarray], dtype: type = np.float64) -> np.ndarray:
    """(n, D + 1) in ``dtype``: rows standardised with ``scaler`` in float64, and a ones column (scoring)."""
    mean, sd = scaler
    out = np.empty((len(raw), len(mean) + 1), dtype=dtype)
    out[:, :-1] = (np.asarray(raw, dtype=np.float64) - mean) / sd
    out[:, -1] = 1.0
    return out


def exactly_float16(rows: np.ndarray) -> bool:
    """Whether every value of float32 ``rows`` is a float16 value (the feature store's type), so
    that storing them as float16 loses nothing."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(rows.astype(np.float16).astype(np.float32), rows))


class Design:
    """The training rows of a group's T tasks, stored once as read and standardised chunk by chunk
    at every product.

    Storage: ``(T, n, D)`` raw feature rows, float16 where every value is a float16 (the feature
    store's rows: half the memory, nothing lost), else float32; rows past a task's own count are zero
    and weigh nothing. A group within the memory budget is held in memory; a group larger than it
    (``stream``) is written once to a memory-mapped file in ``work_dir`` (the system's temporary
    folder by default: ``TMPDIR``) and read back from there. Every product reads the same
    ``PRODUCT_ROWS`` chunks in the same order whether held or mapped, so a task's fits are bit for
    bit the same either way: a chunk is converted to float32, standardised there ((x − mean)·(1/sd),
    float32, the float64 scaler rounded once) and multiplied. The float64 check
    (:meth:`exact_point`) standardises the stored rows in float64 instead: the objective every fit
    minimises, as scikit-learn sees it.
    """

    def __init__(self, source: RowSource, rows: list[np.ndarray], device: str, *, stream: bool = False,
                 work_dir: str | os.PathLike | None = None, read_rows: int = BUILD_ROWS) -> None:
        self.rows, self.device, self.width = rows, device, source.width
        self.n = max(len(r) for r in rows)
        self.counts = torch.tensor([len(r) for r in rows], dtype=torch.float64, device=device)
        self._file: str | None = None
        self.stored = self._store(source, stream, work_dir, max(1, read_rows))
        self.scalers = [self._scaler(t) for t in range(len(rows))]
        self._shift = torch.from_numpy(np.stack([m for m, _ in self.scalers]).astype(np.float32))[:, None].to(device)
        self._scale = torch.from_numpy(np.stack([1.0 / s for _, s in self.scalers]).astype(np.float32))[:, None]
        self._scale = self._scale.to(device)
        self._mean64 = torch.from_numpy(np.stack([m for m, _ in self.scalers]))[:, None].to(device)
        self._sd64 = torch.from_numpy(np.stack([s for _, s in self.scalers]))[:, None].to(device)

    def _store(self, source: RowSource, stream: bool, work_dir, read_rows: int) -> np.ndarray | torch.Tensor:
        """Read every task's rows once, ``read_rows`` at a time, into float16 storage, widened to
        float32 at the first row that is not a float16 value. A streamed design's file is removed if
        reading fails."""
        shape = (len(self.rows), self.n, self.width)
        stored = self._allocate(np.float16, shape, stream, work_dir)
        try:
            for t, task_rows in enumerate(self.rows):
                for start, part in chunks(task_rows, read_rows):
                    block = np.asarray(source.take(part), dtype=np.float32)
                    if stored.dtype == np.float16 and not exactly_float16(block):
                        narrow_file = self._file
                        wider = self._allocate(np.float32, shape, stream, work_dir)
                        for first in range(0, self.n, read_rows):
                            wider[:, first:first + read_rows] = stored[:, first:first + read_rows]
                        del stored
                        if narrow_file is not None:
                            os.unlink(narrow_file)
                        stored = wider
                    stored[t, start:start + len(part)] = block
        except BaseException:
            del stored
            self.close()
            raise
        if stream:
            stored.flush()
            return stored
        return torch.from_numpy(stored).to(self.device)

    def _allocate(self, dtype: type, shape: tuple[int, int, int], stream: bool, work_dir) -> np.ndarray:
        """Zeroed storage: in memory, or (streamed) a new memory-mapped file in ``work_dir``."""
        if not stream:
            return np.zeros(shape, dtype=dtype)
        handle, path = tempfile.mkstemp(prefix="probe-design-", suffix=".npy", dir=work_dir)
        os.close(handle)
        self._file = path
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    def close(self) -> None:
        """Remove a streamed design's file."""
        if self._file is not None:
            self.stored = None
            os.unlink(self._file)
            self._file = None

    @property
    def streamed(self) -> bool:
        return self._file is not None

    def _raw(self, start: int, stop: int, tasks: torch.Tensor | None) -> torch.Tensor:
        """Stored rows ``start:stop`` of ``tasks`` (None: all), as stored (float16 or float32)."""
        if self.streamed:
            block = torch.from_numpy(np.ascontiguousarray(self.stored[:, start:stop])).to(self.device)
        else:
            block = self.stored[:, start:stop]
        return block if tasks is None or len(tasks) == len(self.rows) else block[tasks]

    def _scaler(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Task ``t``'s training mean and SD (float64, chunked sums in a fixed order; an SD below 1e-8 → 1)."""
        count, total, squares = len(self.rows[t]), np.zeros(self.width), np.zeros(self.width)
        for start in range(0, count, SCALER_ROWS):
            total += self._numpy_rows(t, start, min(start + SCALER_ROWS, count)).sum(axis=0)
        mean = total / count
        for start in range(0, count, SCALER_ROWS):
            squares += ((self._numpy_rows(t, start, min(start + SCALER_ROWS, count)) - mean) ** 2).sum(axis=0)
        sd = np.sqrt(squares / count)
        sd[sd < 1e-8] = 1.0
        return mean, sd

    def _numpy_rows(self, t: int, start: int, stop: int) -> np.ndarray:
        rows = self.stored[t, start:stop]
        return np.asarray(rows.cpu().numpy() if torch.is_tensor(rows) else rows, dtype=np.float64)

    def _blocks(self, tasks: torch.Tensor | None) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, standardised float32 rows (T', c, D)) over the ``PRODUCT_ROWS`` chunks."""
        shift = self._shift if tasks is None else self._shift[tasks]
        scale = self._scale if tasks is None else self._scale[tasks]
        for start in range(0, self.n, PRODUCT_ROWS):
            yield start, torch.sub(self._raw(start, start + PRODUCT_ROWS, tasks), shift).mul_(scale)

    def times(self, v: torch.Tensor, tasks: torch.Tensor | None = None) -> torch.Tensor:
        """X V, float64 (T', n, P), each chunk's product in float32; ``v``: (T', D + 1, P)."""
        v32 = v.to(torch.float32)
        out = torch.empty((v.shape[0], self.n, v.shape[2]), dtype=torch.float64, device=v.device)
        for start, block in self._blocks(tasks):
            out[:, start:start + block.shape[1]] = torch.baddbmm(v32[:, -1:], block, v32[:, :-1])
        return out

    def transpose_times(self, r: torch.Tensor, tasks: torch.Tensor | None = None) -> torch.Tensor:
        """Xᵀ R, float64 (T', D + 1, P): each chunk's product in float32, the chunk sums in float64;
        the ones column's row is R's column sums in float64; ``r``: (T', n, P)."""
        out = r.new_zeros((r.shape[0], self.width + 1, r.shape[2]))
        r32 = r.to(torch.float32)
        for start, block in self._blocks(tasks):
            out[:, :-1] += torch.bmm(block.transpose(1, 2), r32[:, start:start + block.shape[1]])
        out[:, -1] = r.sum(dim=1)
        return out

    def _exact_blocks(self, tasks: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, float64 rows (T', c, D)) standardised as ``design_block`` does: (x − mean)/sd in float64."""
        mean, sd = self._mean64[tasks], self._sd64[tasks]
        for start in range(0, self.n, PRODUCT_ROWS):
            yield start, (self._raw(start, start + PRODUCT_ROWS, tasks).to(torch.float64) - mean) / sd

    def exact_times(self, v: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        """X V in float64 throughout (the check of :func:`fit_group`); ``v``: (T', D + 1, P) float64."""
        out = torch.empty((v.shape[0], self.n, v.shape[2]), dtype=torch.float64, device=v.device)
        for start, block in self._exact_blocks(tasks):
            out[:, start:start + block.shape[1]] = torch.baddbmm(v[:, -1:], block, v[:, :-1])
        return out

    def exact_transpose_times(self, r: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        """Xᵀ R in float64 throughout; ``r``: (T', n, P) float64."""
        out = r.new_zeros((r.shape[0], self.width + 1, r.shape[2]))
        for start, block in self._exact_blocks(tasks):
            out[:, :-1] += torch.bmm(block.transpose(1, 2), r[:, start:start + block.shape[1]])
        out[:, -1] = r.sum(dim=1)
        return out

    def sample(self) -> list[torch.Tensor]:
        """Each task's at most ``SAMPLE_ROWS`` evenly spaced rows, standardised as the products are
        (m_t, D) float32. A task's rows are spaced by its own size and never padded to another's, so its
        sample, and every product made from it, is the same in any group, held or streamed."""
        samples = []
        for t, rows in enumerate(self.rows):
            positions = np.arange(0, len(rows), -(-len(rows) // SAMPLE_ROWS))
            raw = self.stored[t][torch.from_numpy(positions).to(self.device) if torch.is_tensor(self.stored)
                                 else positions]
            raw = raw if torch.is_tensor(raw) else torch.from_numpy(np.asarray(raw)).to(self.device)
            samples.append(torch.sub(raw.to(torch.float32), self._shift[t]).mul_(self._scale[t]))
        return samples

    def __enter__(self) -> "Design":
        return self

    def __exit__(self, *_) -> None:
        self.close()


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


def rank_for(n_rows: int, width: int) -> int:
    """Eigenpairs in a task's preconditioner: ``RANK`` from ``RANK_ROWS`` training rows on (on
    real-shaped problems 46 % fewer iterations than 64, benchmarks/results/real_shaped.json),
    ``SMALL_RANK`` below, at most the width. A task's own size decides it, whatever its group."""
    return min(width, RANK if n_rows >= RANK_ROWS else SMALL_RANK)


def preconditioner(design: Design, n_classes: int) -> Preconditioner:
    """Each task's top :func:`rank_for` eigenpairs of XᵀX/n by seeded randomised subspace iteration
    on its :meth:`Design.sample` (float32 products, float64 eigen-decomposition of the projected
    matrix), a task at a time so that no task's numbers depend on its group (a batched product over
    rows padded to the group's largest task sums in another order on some BLAS kernels); a smaller
    rank's basis is padded with zero columns, which apply nothing."""
    samples = design.sample()
    d = design.width
    ranks = [rank_for(len(rows), d) for rows in design.rows]
    basis = torch.zeros((len(samples), d, max(ranks)), dtype=torch.float64, device=design.device)
    top = torch.zeros((len(samples), max(ranks)), dtype=torch.float64, device=design.device)
    rest = torch.zeros(len(samples), dtype=torch.float64, device=design.device)
    for t, (x, r) in enumerate(zip(samples, ranks)):
        basis[t, :, :r], top[t, :r], rest[t] = _eigenpairs(x, r)
    return Preconditioner(basis, top, rest, 0.5 / n_classes)


def _eigenpairs(x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top ``r`` eigenvectors (D, r) and eigenvalues (r,) of XᵀX/m from a task's sample rows ``x``
    (m, D), and the mean of its other eigenvalues (a scalar). The QR and eigen-decompositions and
    the trace run on one CPU thread: LAPACK's and a whole-tensor sum's rounding change with the
    thread count, and a fit's path with them (the products are the same on any thread count)."""
    m, d = x.shape
    basis = torch.from_numpy(np.random.default_rng(0).standard_normal((d, r)).astype(np.float32)).to(x.device)
    for _ in range(POWER_STEPS + 1):
        product = (x.T @ (x @ basis)).to(torch.float64)
        with one_cpu_thread():
            basis = torch.linalg.qr(product)[0].to(torch.float32)
    projected = (x @ basis).to(torch.float64)
    gram = projected.T @ projected / m
    with one_cpu_thread():
        top, vectors = torch.linalg.eigh(gram)
        trace = x.square().sum(dtype=torch.float64)
    rest = ((trace / m - top.sum()) / max(d - r, 1)).clamp(min=0.0)
    return basis.to(torch.float64) @ vectors, top.clamp(min=0.0), rest


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Torch's CPU work (its own kernels and MKL's) on one thread inside, the thread count restored after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


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

    def objective(self, data: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each fit's objective (T, L): its data term plus penalty·||W[:D]||² (the intercept unpenalised)."""
        return data + self.penalty * (w[:, :, :-1] ** 2).sum(dim=(2, 3))

    def penalty_gradient(self, w: torch.Tensor) -> torch.Tensor:
        """The penalty's gradient (T, L, D + 1, K): 2·penalty·W on the features, 0 on the intercept."""
        out = torch.zeros_like(w)
        out[:, :, :-1] = 2.0 * self.penalty[:, :, None, None] * w[:, :, :-1]
        return out

    def subset(self, tasks: torch.Tensor, cs: torch.Tensor) -> "GroupProblem":
        """These tasks' objectives at these Cs (positions)."""
        return GroupProblem(self.labels[tasks], self.weight[tasks], self.penalty[tasks[:, None], cs[None, :]])


@dataclass
class GroupFit:
    """Per fit (T, L): weights (T, L, D + 1, K) float64, L-BFGS iterations, the largest |gradient
    entry| at the weights computed in float64 (:func:`exact_point`), and whether it is ≤ tol."""

    weights: torch.Tensor
    iterations: torch.Tensor
    gradient: torch.Tensor
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
    """The tasks and Cs still running: weights, logits, value, gradient and L-BFGS history of each.
    ``tasks`` and ``cs`` are their positions in the group (the design's tasks, the grid's Cs);
    ``exact``: every product in float64 (:meth:`Design.exact_times`), else in float32."""

    def __init__(self, design: Design, problem: GroupProblem, precondition: Preconditioner, w: torch.Tensor, *,
                 exact: bool = False, tasks: torch.Tensor | None = None, cs: torch.Tensor | None = None) -> None:
        self.design, self.problem, self.precondition, self.exact = design, problem, precondition, exact
        self.tasks = torch.arange(w.shape[0], device=w.device) if tasks is None else tasks
        self.cs = torch.arange(w.shape[1], device=w.device) if cs is None else cs
        self.w = w
        self.s = torch.zeros((HISTORY, *w.shape), dtype=w.dtype, device=w.device)
        self.y = torch.zeros_like(self.s)
        self.rho = torch.zeros((HISTORY, *w.shape[:2]), dtype=w.dtype, device=w.device)  # 0: an empty slot
        self.gamma = torch.ones(w.shape[:2], dtype=w.dtype, device=w.device)
        self.iterations = torch.zeros(w.shape[:2], dtype=torch.int64, device=w.device)
        self.rechecks = torch.zeros(w.shape[:2], dtype=torch.int64, device=w.device)
        self.active = torch.ones(w.shape[:2], dtype=torch.bool, device=w.device)
        self.refresh()

    def logits(self, w: torch.Tensor) -> torch.Tensor:
        t, n_c, _, k = w.shape
        times = self.design.exact_times if self.exact else self.design.times
        return times(_product(w), self.tasks).view(t, -1, n_c, k)

    def refresh(self) -> None:
        """Logits, value and gradient recomputed from the weights (two products)."""
        z = self.logits(self.w)
        self.set_point(z, *self.problem.data_terms(z))

    def set_point(self, z: torch.Tensor, data: torch.Tensor, log_p: torch.Tensor) -> None:
        t, n_c, d1, k = self.w.shape
        self.z = z
        self.value = self.problem.objective(data, self.w)
        residual = self.problem.residual(log_p)
        transpose_times = self.design.exact_transpose_times if self.exact else self.design.transpose_times
        grad = transpose_times(residual, self.tasks).view(t, d1, n_c, k).permute(0, 2, 1, 3)
        self.grad = grad + self.problem.penalty_gradient(self.w)

    def keep(self, tasks: torch.Tensor, cs: torch.Tensor) -> None:
        """Keep only these tasks and Cs (positions among the current ones) in the arithmetic."""
        at = (tasks[:, None], cs[None, :])
        self.problem = self.problem.subset(tasks, cs)
        self.precondition = self.precondition.subset(tasks)
        self.tasks, self.cs = self.tasks[tasks], self.cs[cs]
        for name in ("w", "value", "grad", "gamma", "iterations", "rechecks", "active"):
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


def exact_point(design: Design, problem: GroupProblem, w: torch.Tensor,
                tasks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (T', n, L', K), value (T', L') and gradient (T', L', D + 1, K) of the objectives ``problem`` at ``w`` (T', L', D + 1, K) for the design's ``tasks``, in float64 throughout:
    the design standardised in float64 from the stored rows, every product and sum in float64."""
    t, n_c, d1, k = w.shape
    z = design.exact_times(_product(w), tasks).view(t, -1, n_c, k)
    data, log_p = problem.data_terms(z)
    residual = problem.residual(log_p)
    grad = design.exact_transpose_times(residual, tasks).view(t, d1, n_c, k).permute(0, 2, 1, 3)
    return z, problem.objective(data, w), grad + problem.penalty_gradient(w)


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
    """Minimise every (task, C) objective of ``problem`` from zero, each to its own stopping test.

    A fit stops when its float32-product gradient meets ``tol`` and the float64 check agrees
    (converged); when its relative reduction is ≤ ``FTOL`` at an iteration that kept its logits (not
    at a refresh, where recomputing them changes the value by rounding alone); when its line search
    finds no step; after ``max_iter`` iterations; or after ``MAX_RECHECKS`` float64 checks that
    disagreed with its float32 gradient (a failed check first replaces the fit's logits, value and
    gradient with the float64 ones, and it goes on). Every fit that stopped unconverged before
    ``max_iter`` then goes on from its weights with float64 products (the float32 products' rounding,
    ~1e-8 on a gradient entry, is what stops a fit short of a tight ``tol``). ``converged`` is the
    float64 check at the returned weights, whatever stopped the fit."""
    t, n_c = problem.penalty.shape
    w = torch.zeros(t, n_c, design.width + 1, n_classes, dtype=torch.float64, device=problem.penalty.device)
    precondition = preconditioner(design, n_classes)
    out = (w.clone(), torch.zeros(t, n_c, dtype=torch.int64, device=w.device),
           torch.full((t, n_c), torch.inf, dtype=torch.float64, device=w.device),
           torch.zeros(t, n_c, dtype=torch.bool, device=w.device))
    fits = _Fits(design, problem, precondition, w)
    fits.active = ~_settle(fits, _largest(fits.grad) <= tol, torch.zeros_like(fits.active), tol, out)
    _iterate(fits, tol, max_iter, out)
    out_w, out_iterations, _, out_converged = out
    unfinished = ~out_converged & (out_iterations < max_iter)
    if bool(unfinished.any()):
        tasks, cs = torch.nonzero(unfinished.any(dim=1))[:, 0], torch.nonzero(unfinished.any(dim=0))[:, 0]
        at = (tasks[:, None], cs[None, :])
        fits = _Fits(design, problem.subset(tasks, cs), precondition.subset(tasks), out_w[at].clone(), exact=True,
                     tasks=tasks, cs=cs)
        fits.iterations = out_iterations[at].clone()
        fits.active = unfinished[at]
        _iterate(fits, tol, max_iter, out)
    return GroupFit(*out)


def _iterate(fits: _Fits, tol: float, max_iter: int, out: tuple[torch.Tensor, ...]) -> None:
    """L-BFGS iterations of the active fits until each has stopped (:func:`fit_group`), the stopped
    ones written to ``out``."""
    for step in range(max_iter):
        tasks, cs = fits.active.any(dim=1), fits.active.any(dim=0)
        if not bool(tasks.any()):
            break
        if not bool(tasks.all() and cs.all()):
            fits.keep(torch.nonzero(tasks)[:, 0], torch.nonzero(cs)[:, 0])
        d, rate = fits.direction(step)
        moved, taken, z, data, log_p = _line_search(fits, d, rate)
        s = taken[:, :, None, None] * d
        moved &= _largest(s) > 0  # a failed line search, or a step too short to change w
        old_value, old_grad, active = fits.value, fits.grad, fits.active
        fits.w = fits.w + s
        refreshed = (step + 1) % REFRESH == 0
        if refreshed:
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
        fits.iterations += moved.to(torch.int64)
        meets = active & moved & (_largest(fits.grad) <= tol)
        stop = active & ~meets & (~moved | (fits.iterations >= max_iter))
        if not refreshed:
            reduction = (old_value - fits.value) / torch.clamp(torch.maximum(old_value.abs(), fits.value.abs()),
                                                               min=1.0)
            stop |= active & ~meets & (reduction <= FTOL)
        fits.active = active & ~_settle(fits, meets, stop, tol, out, max_iter)


def _settle(fits: _Fits, meets: torch.Tensor, stop: torch.Tensor, tol: float, out: tuple[torch.Tensor, ...],
            max_iter: int | None = None) -> torch.Tensor:
    """Check in float64 the fits whose gradient ``meets`` tol and those told to ``stop``; write the
    ones that end here to ``out`` (weights, iterations, float64 gradient, converged) and return them
    (T', L'). A fit that met tol in float32 but not in float64 takes the float64 point and goes on,
    unless it has failed ``MAX_RECHECKS`` checks or reached ``max_iter``."""
    checked = meets | stop
    if not bool(checked.any()):
        return checked
    if fits.exact:  # its gradient is the float64 one already
        largest = _largest(fits.grad)
        return _write(fits, meets | stop, largest, meets, out)
    tasks, cs = checked.any(dim=1), checked.any(dim=0)
    at = (torch.nonzero(tasks)[:, 0][:, None], torch.nonzero(cs)[:, 0][None, :])
    z, value, grad = exact_point(fits.design, fits.problem.subset(*(a.flatten() for a in at)), fits.w[at],
                                        fits.tasks[at[0][:, 0]])
    largest = torch.full_like(fits.value, torch.inf)
    largest[at] = _largest(grad)
    verified = checked & (largest <= tol)
    retry = meets & ~verified
    fits.rechecks += retry.to(torch.int64)
    ended = verified | stop | (retry & (fits.rechecks >= MAX_RECHECKS))
    if max_iter is not None:
        ended |= retry & (fits.iterations >= max_iter)
    going_on = retry & ~ended
    if bool(going_on.any()):  # the float64 point replaces the float32 one
        inside = going_on[at]
        by_fit = fits.z.permute(0, 2, 1, 3)  # a view: writing it writes fits.z
        by_fit[at] = torch.where(inside[:, :, None, None], z.permute(0, 2, 1, 3), by_fit[at])
        fits.value[at] = torch.where(inside, value, fits.value[at])
        fits.grad[at] = torch.where(inside[:, :, None, None], grad, fits.grad[at])
    return _write(fits, ended, largest, verified, out)


def _write(fits: _Fits, ended: torch.Tensor, largest: torch.Tensor, converged: torch.Tensor,
           out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Write the ``ended`` fits' weights, iterations, float64 gradient and convergence to ``out``."""
    if bool(ended.any()):
        out_w, out_iterations, out_gradient, out_converged = out
        place = (fits.tasks[:, None].expand_as(ended)[ended], fits.cs[None, :].expand_as(ended)[ended])
        out_w[place], out_iterations[place] = fits.w[ended], fits.iterations[ended]
        out_gradient[place], out_converged[place] = largest[ended], converged[ended]
    return ended
