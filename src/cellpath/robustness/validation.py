"""Input checks and label encoding for the robustness metrics: one clear ValueError per problem.

Labels of any hashable type are encoded as integer codes in sorted order of their values
(``pandas.factorize(sort=True)``), so that a k-NN vote tie goes to the same label whatever the
order of the samples (croma codes labels in order of first appearance; docs/decisions/0039).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from cellpath.robustness.neighbours import DEFAULT_CANDIDATE_ROWS, ArrayRows, RowSource


@dataclass(frozen=True)
class Labels:
    """Integer-coded labels of n samples (codes 0..levels-1 in sorted order of the values).

    ``group`` is the physical unit a sample was cut from (image patch, spatial tile, slide):
    samples sharing a group are never each other's neighbours.
    """

    biology: np.ndarray
    confounder: np.ndarray
    group: np.ndarray

    @property
    def n_confounder(self) -> int:
        return int(self.confounder.max()) + 1


def check_features(features: ArrayLike) -> np.ndarray:
    """The features as a finite 2-D float array; NaN/inf rows are counted in the error."""
    x = np.asarray(features)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"features must be a non-empty 2-D array (n_samples, n_dims), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"features must be numeric, got dtype {x.dtype}")
    bad_rows = int(np.count_nonzero(~np.isfinite(x).all(axis=1)))
    if bad_rows:
        raise ValueError(f"features contain NaN or inf in {bad_rows} of {x.shape[0]} rows")
    return x


def feature_rows(features: ArrayLike | RowSource, candidate_rows: int = DEFAULT_CANDIDATE_ROWS) -> RowSource:
    """The features as a checked row source: an array checked by :func:`check_features`; a
    :class:`RowSource` (a memory-mapped store) checked ``candidate_rows`` at a time (2-D, one width,
    numeric, finite, non-empty; NaN/inf rows counted over every chunk)."""
    if not isinstance(features, RowSource):
        return ArrayRows(check_features(features))
    n, width, bad_rows = len(features), None, 0
    if n == 0:
        raise ValueError("features must be a non-empty 2-D array (n_samples, n_dims), got 0 rows")
    for start in range(0, n, candidate_rows):
        chunk = np.asarray(features.take(np.arange(start, min(n, start + candidate_rows))))
        if chunk.ndim != 2 or chunk.shape[1] == 0 or width not in (None, chunk.shape[1]):
            raise ValueError(f"features must be 2-D with one width, got rows of shape {chunk.shape[1:]} "
                             f"at row {start}")
        if not np.issubdtype(chunk.dtype, np.number):
            raise ValueError(f"features must be numeric, got dtype {chunk.dtype}")
        width = chunk.shape[1]
        bad_rows += int(np.count_nonzero(~np.isfinite(chunk).all(axis=1)))
    if bad_rows:
        raise ValueError(f"features contain NaN or inf in {bad_rows} of {n} rows")
    return features


def check_at_least_one(name: str, value: int) -> int:
    """``value`` as an int, or a ValueError when it is below 1."""
    if int(value) != value or int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_fraction(name: str, value: float) -> float:
    """``value`` as a float, or a ValueError when it is outside (0, 1]."""
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


def encode(name: str, values: ArrayLike, n_samples: int) -> np.ndarray:
    """Integer codes (sorted order of the values) for one label array of length ``n_samples``."""
    array = np.asarray(values)
    if array.ndim != 1 or len(array) != n_samples:
        raise ValueError(f"{name} must be a 1-D array with one entry per sample ({n_samples}), got shape {array.shape}")
    codes, _ = pd.factorize(array, sort=True)
    missing = int(np.count_nonzero(codes < 0))
    if missing:
        raise ValueError(f"{name} has {missing} missing value(s); every sample needs a {name} label")
    return codes.astype(np.int64)


def encode_labels(n_samples: int, biology: ArrayLike, confounder: ArrayLike, group: ArrayLike) -> Labels:
    """Encode and check the three label arrays; at least two confounder levels are required."""
    labels = Labels(
        biology=encode("biology", biology, n_samples),
        confounder=encode("confounder", confounder, n_samples),
        group=encode("group", group, n_samples),
    )
    if labels.n_confounder < 2:
        raise ValueError("confounder has a single level; robustness needs at least two confounder levels")
    return labels


def typed_candidate_counts(labels: Labels) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, how many SO and OS candidates exist once its own group is excluded.

    SO: same biology, other confounder. OS: other biology, same confounder. These depend on
    the labels only, never on the embedding.
    """
    frame = pd.DataFrame({"b": labels.biology, "c": labels.confounder, "g": labels.group})
    n_b = frame.groupby("b")["b"].transform("size").to_numpy()
    n_c = frame.groupby("c")["c"].transform("size").to_numpy()
    n_bc = frame.groupby(["b", "c"])["b"].transform("size").to_numpy()
    g_b = frame.groupby(["g", "b"])["b"].transform("size").to_numpy()
    g_c = frame.groupby(["g", "c"])["c"].transform("size").to_numpy()
    g_bc = frame.groupby(["g", "b", "c"])["b"].transform("size").to_numpy()
    so = (n_b - n_bc) - (g_b - g_bc)
    os_ = (n_c - n_bc) - (g_c - g_bc)
    return so, os_


def check_typed_support(labels: Labels, m: int) -> None:
    """Raise when no sample has ``m`` SO and ``m`` OS candidates, so no margin can exist."""
    so, os_ = typed_candidate_counts(labels)
    if not np.any((so >= m) & (os_ >= m)):
        raise ValueError(
            f"no sample has at least m={m} SO (same biology, other confounder) and m={m} OS "
            f"(other biology, same confounder) candidates outside its own group "
            f"(most SO: {int(so.max())}, most OS: {int(os_.max())}); CRoMa is undefined for every sample"
        )
