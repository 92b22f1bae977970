"""Exact multi-output ridge regression of standardised targets on standardised features.

One pass over the training rows accumulates, in float64, the sufficient statistics of the whole
problem: the sums and the cross-products XᵀX and XᵀY of the rows less a fixed shift (the mean of the
first block: sums of rows near their mean lose no digits to cancellation). From them come the
training means and SDs of every feature and target (population SD; an SD below 1e-8 → 1, the type
probes' scaler, :meth:`cellpath.probing.engine.Design._scaler`, to float64 rounding) and the
standardised Gram matrix G = XₛᵀXₛ and XₛᵀYₛ. One eigendecomposition G = V Λ Vᵀ then serves every
penalty α and every gene: the coefficients are W(α) = V diag(1/(Λ + α)) Vᵀ XₛᵀYₛ, the minimiser of
‖Yₛ − XₛW‖² + α‖W‖² — ``sklearn.linear_model.Ridge(alpha=α)`` on the standardised rows (their
intercept is zero: both sides are centred). Penalties are given per training cell (α = λ·n), so one
grid means the same on a unit of 500 cells and one of 500,000.

The penalty is chosen per gene on the validation rows: the λ of least squared error of the
standardised predictions (ties, equal in float64, go to the larger λ: the stronger shrinkage).

Determinism: every product is of a block of ``ACCUMULATE_ROWS`` rows, added in row order, whatever
number of rows is read at a time (``read_rows``, rounded to a multiple of the block), so the memory a
run is given changes no bit; the eigendecomposition runs on one CPU thread (LAPACK's rounding follows
the thread count). The same code runs on CUDA (torch, float64).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cellpath.probing.engine import RowSource, one_cpu_thread

ACCUMULATE_ROWS = 1024   # rows per float64 block product, summed in row order (the same bits for any read size)
DEFAULT_READ_ROWS = 16384
MIN_SD = 1e-8            # an SD below this is taken as 1 (a constant column standardises to 0), as the type probes


@dataclass(frozen=True)
class Standardiser:
    """Training means and SDs (float64) of the features (D,) and the targets (G,)."""

    feature_mean: np.ndarray
    feature_sd: np.ndarray
    target_mean: np.ndarray
    target_sd: np.ndarray


@dataclass(frozen=True)
class RidgePath:
    """Every ridge fit of one training set: G = V Λ Vᵀ and B = Vᵀ XₛᵀYₛ (torch float64 on ``device``)."""

    n_train: int
    standardiser: Standardiser
    eigenvalues: torch.Tensor   # Λ, (D,), clipped at 0
    eigenvectors: torch.Tensor  # V, (D, D)
    projected: torch.Tensor     # B = Vᵀ XₛᵀYₛ, (D, G)

    def coefficients(self, penalties: np.ndarray) -> np.ndarray:
        """W (D, G) in the standardised space, gene g fitted with α = ``penalties[g]`` · n_train."""
        alpha = torch.as_tensor(np.asarray(penalties, dtype=np.float64) * self.n_train, device=self.projected.device)
        shrunk = self.projected / (self.eigenvalues[:, None] + alpha[None, :])
        return (self.eigenvectors @ shrunk).cpu().numpy()


def _blocks(source: RowSource, rows: np.ndarray, targets: np.ndarray | None,
            read_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """(features float64, targets float64) of ``rows`` in ``ACCUMULATE_ROWS`` blocks, read
    ``read_rows`` (a multiple of the block) at a time; ``targets`` is aligned with ``rows``."""
    step = max(1, read_rows // ACCUMULATE_ROWS) * ACCUMULATE_ROWS
    for start in range(0, len(rows), step):
        features = np.asarray(source.take(rows[start:start + step]), dtype=np.float64)
        for offset in range(0, len(features), ACCUMULATE_ROWS):
            block = slice(offset, offset + ACCUMULATE_ROWS)
            yield features[block], None if targets is None else np.asarray(
                targets[start + offset:start + offset + ACCUMULATE_ROWS], dtype=np.float64)


def _sd(centred_squares: torch.Tensor, n: int) -> np.ndarray:
    sd = np.sqrt(np.clip(centred_squares.cpu().numpy() / n, 0.0, None))
    sd[sd < MIN_SD] = 1.0
    return sd


def fit_path(source: RowSource, rows: np.ndarray, targets: np.ndarray, *, device: str = "cpu",
             read_rows: int = DEFAULT_READ_ROWS) -> RidgePath:
    """The ridge path of the training ``rows`` of ``source`` against ``targets`` (n, G), aligned with
    ``rows``: one float64 pass for the statistics, one eigendecomposition."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) < 2:
        raise ValueError(f"a ridge fit needs at least 2 training rows, got {len(rows)}")
    width, n_targets = source.width, targets.shape[1]
    xx = torch.zeros((width, width), dtype=torch.float64, device=device)
    xy = torch.zeros((width, n_targets), dtype=torch.float64, device=device)
    x_sum = torch.zeros(width, dtype=torch.float64, device=device)
    y_sum = torch.zeros(n_targets, dtype=torch.float64, device=device)
    y_squares = torch.zeros(n_targets, dtype=torch.float64, device=device)
    x_shift = y_shift = None
    for features, values in _blocks(source, rows, targets, read_rows):
        if x_shift is None:  # the first block's mean: the shift every row is taken from
            x_shift, y_shift = features.mean(axis=0), values.mean(axis=0)
        x = torch.from_numpy(features - x_shift).to(device)
        y = torch.from_numpy(values - y_shift).to(device)
        xx += x.T @ x
        xy += x.T @ y
        x_sum += x.sum(dim=0)
        y_sum += y.sum(dim=0)
        y_squares += y.square().sum(dim=0)
    n = len(rows)
    xx -= torch.outer(x_sum, x_sum) / n  # centred cross-products
    xy -= torch.outer(x_sum, y_sum) / n
    feature_sd, target_sd = _sd(torch.diagonal(xx), n), _sd(y_squares - y_sum.square() / n, n)
    standardiser = Standardiser(x_shift + x_sum.cpu().numpy() / n, feature_sd, y_shift + y_sum.cpu().numpy() / n,
                                target_sd)
    scale_x = torch.from_numpy(1.0 / feature_sd).to(device)
    gram = xx * scale_x[:, None] * scale_x[None, :]
    gram = (gram + gram.T) / 2  # exactly symmetric for the eigensolver
    cross = xy * scale_x[:, None] * torch.from_numpy(1.0 / target_sd).to(device)[None, :]
    with one_cpu_thread():
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    return RidgePath(n, standardiser, eigenvalues.clamp(min=0.0), eigenvectors, eigenvectors.T @ cross)


def standardised(path: RidgePath, features: np.ndarray, values: np.ndarray | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows and targets standardised with the training scaler (float64 on the path's device)."""
    scaler, device = path.standardiser, path.projected.device
    x = torch.from_numpy((np.asarray(features, dtype=np.float64) - scaler.feature_mean) / scaler.feature_sd)
    y = None if values is None else torch.from_numpy(
        (np.asarray(values, dtype=np.float64) - scaler.target_mean) / scaler.target_sd).to(device)
    return x.to(device), y


def validation_errors(path: RidgePath, source: RowSource, rows: np.ndarray, targets: np.ndarray,
                      penalties: Sequence[float], *, read_rows: int = DEFAULT_READ_ROWS) -> np.ndarray:
    """Sum of squared errors of the standardised predictions, (L penalties, G genes), over ``rows``."""
    alpha = torch.as_tensor(np.asarray(penalties, dtype=np.float64) * path.n_train, device=path.projected.device)
    shrunk = path.projected[None, :, :] / (path.eigenvalues[None, :, None] + alpha[:, None, None])  # (L, D, G)
    errors = torch.zeros((len(alpha), path.projected.shape[1]), dtype=torch.float64, device=path.projected.device)
    for features, values in _blocks(source, np.asarray(rows, dtype=np.int64), targets, read_rows):
        x, y = standardised(path, features, values)
        rotated = x @ path.eigenvectors  # (n, D): the rows in the eigenbasis, once for every penalty
        errors += (torch.matmul(rotated[None], shrunk) - y[None]).square().sum(dim=1)
    return errors.cpu().numpy()


def choose_penalties(errors: np.ndarray, penalties: Sequence[float]) -> np.ndarray:
    """Per gene, the penalty of least validation error; of equal errors, the larger penalty.

    ``penalties`` must be strictly ascending; returns the chosen penalty per gene (G,)."""
    grid = np.asarray(penalties, dtype=np.float64)
    if grid.ndim != 1 or not len(grid) or np.any(np.diff(grid) <= 0) or grid[0] <= 0:
        raise ValueError(f"expression penalties must be positive and strictly ascending, got {list(penalties)}")
    flipped = errors[::-1]  # argmin takes the first minimum: the largest penalty among equal errors
    return grid[len(grid) - 1 - np.argmin(flipped, axis=0)]


def predict(path: RidgePath, coefficients: np.ndarray, source: RowSource, rows: np.ndarray, *,
            read_rows: int = DEFAULT_READ_ROWS) -> np.ndarray:
    """Standardised predictions (n, G) float64 of ``rows`` with ``coefficients`` (:meth:`RidgePath.coefficients`)."""
    weights = torch.from_numpy(np.asarray(coefficients, dtype=np.float64)).to(path.projected.device)
    out = [(standardised(path, features)[0] @ weights).cpu().numpy()
           for features, _ in _blocks(source, np.asarray(rows, dtype=np.int64), None, read_rows)]
    return np.concatenate(out) if out else np.empty((0, weights.shape[1]))
