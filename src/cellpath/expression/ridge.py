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

Groups absorbed (``groups``: a code per row, the cell's type): each group's training mean is fitted
unpenalised and the ridge acts on the deviations from it — the minimiser of ‖Yₛ − TA − XₛW‖² +
α‖W‖² with T the rows' one-hot groups and A free, which by Frisch–Waugh–Lovell is the ridge above on
rows and targets centred within their group. The within-group cross-products come from the same
pass (per-group sums), and a row is predicted as its group's training mean plus W on its deviation
(a group without training rows: the overall training mean). So features can only add to what the
group means predict, whatever penalty their own noise needs.

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
    group_features: np.ndarray | None = None  # absorbed groups: each group's standardised training mean (K, D)
    group_targets: np.ndarray | None = None   # ... and its targets' (K, G); a group without training rows: 0

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


def fit_path(source: RowSource, rows: np.ndarray, targets: np.ndarray, *, groups: np.ndarray | None = None,
             n_groups: int = 0, device: str = "cpu", read_rows: int = DEFAULT_READ_ROWS) -> RidgePath:
    """The ridge path of the training ``rows`` of ``source`` against ``targets`` (n, G), aligned with
    ``rows``: one float64 pass for the statistics, one eigendecomposition. ``groups`` (n,), codes in
    0..``n_groups``-1 aligned with ``rows``: each group's mean absorbed, unpenalised (module text)."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) < 2:
        raise ValueError(f"a ridge fit needs at least 2 training rows, got {len(rows)}")
    sums = _accumulate(source, rows, targets, groups, n_groups, device, read_rows)
    n = len(rows)
    xx = sums["xx"] - torch.outer(sums["x"], sums["x"]) / n  # centred cross-products
    xy = sums["xy"] - torch.outer(sums["x"], sums["y"]) / n
    feature_sd, target_sd = _sd(torch.diagonal(xx), n), _sd(sums["yy"] - sums["y"].square() / n, n)
    standardiser = Standardiser(sums["x_shift"] + sums["x"].cpu().numpy() / n, feature_sd,
                                sums["y_shift"] + sums["y"].cpu().numpy() / n, target_sd)
    scale_x = torch.from_numpy(1.0 / feature_sd).to(device)
    scale_y = torch.from_numpy(1.0 / target_sd).to(device)
    group_features = group_targets = None
    if groups is not None:  # centred within each group instead: xx − Σ_g S_g S_gᵀ / n_g, on the shifted rows
        count = sums["group_n"].clamp(min=1.0)[:, None]
        xx = sums["xx"] - (sums["group_x"] / count).T @ sums["group_x"]
        xy = sums["xy"] - (sums["group_x"] / count).T @ sums["group_y"]
        present = (sums["group_n"] > 0)[:, None]
        group_features = torch.where(present, (sums["group_x"] / count - sums["x"] / n) * scale_x, 0.0).cpu().numpy()
        group_targets = torch.where(present, (sums["group_y"] / count - sums["y"] / n) * scale_y, 0.0).cpu().numpy()
    gram = xx * scale_x[:, None] * scale_x[None, :]
    gram = (gram + gram.T) / 2  # exactly symmetric for the eigensolver
    cross = xy * scale_x[:, None] * scale_y[None, :]
    with one_cpu_thread():
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    return RidgePath(n, standardiser, eigenvalues.clamp(min=0.0), eigenvectors, eigenvectors.T @ cross,
                     group_features, group_targets)


def _accumulate(source: RowSource, rows: np.ndarray, targets: np.ndarray, groups: np.ndarray | None,
                n_groups: int, device: str, read_rows: int) -> dict:
    """One float64 pass: sums and cross-products of the rows and targets less the first block's mean
    (``x_shift``, ``y_shift``), and with ``groups`` the per-group sums and counts."""
    width, n_targets = source.width, targets.shape[1]
    zeros = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
    sums = {"xx": zeros(width, width), "xy": zeros(width, n_targets), "x": zeros(width), "y": zeros(n_targets),
            "yy": zeros(n_targets), "group_x": zeros(n_groups, width), "group_y": zeros(n_groups, n_targets),
            "group_n": zeros(n_groups), "x_shift": None, "y_shift": None}
    group_codes = None if groups is None else torch.from_numpy(np.asarray(groups, dtype=np.int64)).to(device)
    done = 0
    for features, values in _blocks(source, rows, targets, read_rows):
        if sums["x_shift"] is None:  # the first block's mean: the shift every row is taken from
            sums["x_shift"], sums["y_shift"] = features.mean(axis=0), values.mean(axis=0)
        x = torch.from_numpy(features - sums["x_shift"]).to(device)
        y = torch.from_numpy(values - sums["y_shift"]).to(device)
        sums["xx"] += x.T @ x
        sums["xy"] += x.T @ y
        sums["x"] += x.sum(dim=0)
        sums["y"] += y.sum(dim=0)
        sums["yy"] += y.square().sum(dim=0)
        if group_codes is not None:
            codes = group_codes[done:done + len(x)]
            sums["group_x"].index_add_(0, codes, x)
            sums["group_y"].index_add_(0, codes, y)
            sums["group_n"].index_add_(0, codes, torch.ones(len(x), dtype=torch.float64, device=device))
        done += len(x)
    return sums


def standardised(path: RidgePath, features: np.ndarray, values: np.ndarray | None = None,
                 groups: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows and targets standardised with the training scaler (float64 on the path's device); on a
    path with absorbed groups, less their group's standardised training mean (``groups``: codes)."""
    scaler, device = path.standardiser, path.projected.device
    x = (np.asarray(features, dtype=np.float64) - scaler.feature_mean) / scaler.feature_sd
    y = None if values is None else (np.asarray(values, dtype=np.float64) - scaler.target_mean) / scaler.target_sd
    if path.group_features is not None:
        if groups is None:
            raise ValueError("this ridge path absorbs group means: give the rows' group codes")
        x = x - path.group_features[groups]
        y = None if y is None else y - path.group_targets[groups]
    return torch.from_numpy(x).to(device), None if y is None else torch.from_numpy(y).to(device)


def validation_errors(path: RidgePath, source: RowSource, rows: np.ndarray, targets: np.ndarray,
                      penalties: Sequence[float], *, groups: np.ndarray | None = None,
                      read_rows: int = DEFAULT_READ_ROWS) -> np.ndarray:
    """Sum of squared errors of the standardised predictions, (L penalties, G genes), over ``rows``
    (``groups``: their codes, on a path with absorbed groups)."""
    alpha = torch.as_tensor(np.asarray(penalties, dtype=np.float64) * path.n_train, device=path.projected.device)
    shrunk = path.projected[None, :, :] / (path.eigenvalues[None, :, None] + alpha[:, None, None])  # (L, D, G)
    errors = torch.zeros((len(alpha), path.projected.shape[1]), dtype=torch.float64, device=path.projected.device)
    for start, features, values in _numbered(_blocks(source, np.asarray(rows, dtype=np.int64), targets, read_rows)):
        x, y = standardised(path, features, values, _slice(groups, start, len(features)))
        rotated = x @ path.eigenvectors  # (n, D): the rows in the eigenbasis, once for every penalty
        errors += (torch.matmul(rotated[None], shrunk) - y[None]).square().sum(dim=1)
    return errors.cpu().numpy()


def _numbered(blocks: Iterator[tuple[np.ndarray, np.ndarray | None]]
              ) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
    """(position of the block's first row, features, targets) of :func:`_blocks`."""
    start = 0
    for features, values in blocks:
        yield start, features, values
        start += len(features)


def _slice(groups: np.ndarray | None, start: int, n: int) -> np.ndarray | None:
    return None if groups is None else np.asarray(groups, dtype=np.int64)[start:start + n]


def choose_penalties(errors: np.ndarray, penalties: Sequence[float]) -> np.ndarray:
    """Per gene, the penalty of least validation error; of equal errors, the larger penalty.

    ``penalties`` must be strictly ascending; returns the chosen penalty per gene (G,)."""
    grid = np.asarray(penalties, dtype=np.float64)
    if grid.ndim != 1 or not len(grid) or np.any(np.diff(grid) <= 0) or grid[0] <= 0:
        raise ValueError(f"expression penalties must be positive and strictly ascending, got {list(penalties)}")
    flipped = errors[::-1]  # argmin takes the first minimum: the largest penalty among equal errors
    return grid[len(grid) - 1 - np.argmin(flipped, axis=0)]


def predict(path: RidgePath, coefficients: np.ndarray, source: RowSource, rows: np.ndarray, *,
            groups: np.ndarray | None = None, read_rows: int = DEFAULT_READ_ROWS) -> np.ndarray:
    """Standardised predictions (n, G) float64 of ``rows`` with ``coefficients``
    (:meth:`RidgePath.coefficients`); on a path with absorbed groups, plus each row's group mean
    (``groups``: the rows' codes)."""
    weights = torch.from_numpy(np.asarray(coefficients, dtype=np.float64)).to(path.projected.device)
    out = []
    for start, features, _ in _numbered(_blocks(source, np.asarray(rows, dtype=np.int64), None, read_rows)):
        codes = _slice(groups, start, len(features))
        predicted = (standardised(path, features, None, codes)[0] @ weights).cpu().numpy()
        out.append(predicted if path.group_targets is None else predicted + path.group_targets[codes])
    return np.concatenate(out) if out else np.empty((0, weights.shape[1]))
