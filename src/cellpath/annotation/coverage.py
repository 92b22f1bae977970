"""Reference coverage: the share of a section's cells that look like no type the reference has.

A classifier always names one of the reference's types, and its confidence stays high for a cell
of an absent type that happens to sit on one side of a decision boundary (a PBMC reference on bone
marrow left only 4–5 % of cells below 0.4). Coverage asks a different question: does the cell's
expression *resemble* any reference type at all?

Per scored cell, its z-scored profile (the reference's gene space, as the transfer uses it) is
averaged over its ``n_neighbours`` nearest query cells in a 30-component PCA of the section — one
Xenium cell is too sparse (~100 transcripts) to correlate on its own — and the cell's similarity is
the highest Pearson correlation of that smoothed profile with a reference type's mean profile. A
cell is *unmatched* below ``min_similarity``. Correlation ignores the per-gene scale and offset
that separate the platforms, which is why it is used rather than a distance (kNN distances to the
reference cells were tried: the platform shift alone puts every query cell far away; see
docs/decisions/0023).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest
from sklearn.neighbors import NearestNeighbors
from sklearn.utils.extmath import svd_flip

#: principal components of the section the smoothing neighbours are searched in
PCA_COMPONENTS = 30
PCA_BLOCK_ROWS = 8_192  # cells per float64 block of the section's PCA (330 MB at 5,000 genes)
SMOOTHING_BLOCK_ROWS = 1_024  # scored cells whose neighbours' profiles are gathered at once (300 MB at 15 × 5,000)


@dataclass(frozen=True)
class Coverage:
    """How many scored cells resemble no reference type, with a 95 % Wilson interval on the share."""

    n_scored: int
    n_unmatched: int
    share_low: float
    share_high: float

    @property
    def share_unmatched(self) -> float:
        return self.n_unmatched / self.n_scored if self.n_scored else float("nan")


def type_centroids(profiles: np.ndarray, labels: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Mean profile of each class in ``classes`` order (classes × genes)."""
    return np.stack([profiles[labels == c].mean(axis=0) for c in classes]).astype(np.float32)


def best_correlation(profiles: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Per row of ``profiles``, its highest Pearson correlation with a row of ``centroids``
    (a constant row correlates 0 with everything)."""
    def standardised(rows: np.ndarray) -> np.ndarray:
        centred = rows - rows.mean(axis=1, keepdims=True)
        norm = np.linalg.norm(centred, axis=1, keepdims=True)
        return np.divide(centred, norm, out=np.zeros_like(centred), where=norm > 0)

    return (standardised(profiles.astype(np.float64)) @ standardised(centroids.astype(np.float64)).T).max(axis=1)


def scored_cells(n_cells: int, max_cells: int, seed: int = 0) -> np.ndarray:
    """Indices (sorted) of the cells a section's coverage is estimated on: all of them up to
    ``max_cells``, else a seeded uniform sample of ``max_cells``."""
    if n_cells <= max_cells:
        return np.arange(n_cells)
    return np.sort(np.random.default_rng(seed).choice(n_cells, size=max_cells, replace=False))


def neighbourhood_similarity(query: np.ndarray, centroids: np.ndarray, scored: np.ndarray, *,
                             n_neighbours: int) -> np.ndarray:
    """Similarity to the reference of each ``scored`` cell of ``query`` (cells × genes, z-scored in
    the reference's space): its profile averaged over its ``n_neighbours`` nearest cells of the
    whole section (itself included) in PCA space, best-correlated with ``centroids``."""
    n_cells, n_genes = query.shape
    k = min(n_neighbours, n_cells)
    if k > 1:
        space = section_pca(query, min(PCA_COMPONENTS, n_genes, n_cells - 1))
        neighbours = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(space).kneighbors(
            space[scored], return_distance=False)
        smoothed = np.concatenate([query[rows].mean(axis=1) for rows in np.array_split(
            neighbours, max(1, -(-len(neighbours) // SMOOTHING_BLOCK_ROWS)))])  # per cell: blocks change no value
    else:
        smoothed = query[scored]
    return best_correlation(smoothed, centroids)


def section_pca(query: np.ndarray, components: int, block_rows: int = PCA_BLOCK_ROWS) -> np.ndarray:
    """The cells' coordinates (float64) on the top ``components`` principal axes of ``query``
    (cells × genes), as scikit-learn's ``PCA(svd_solver="covariance_eigh").fit_transform`` gives them
    — the covariance's eigenvectors, signs by the same rule — but with the covariance accumulated and
    the projection computed ``block_rows`` rows at a time in float64: scikit-learn needs the whole
    matrix in float64 (11 GB for 283,000 cells × 5,000 genes), this one block."""
    n_cells = len(query)
    gram = np.zeros((query.shape[1],) * 2)
    total = np.zeros(query.shape[1])
    for start in range(0, n_cells, block_rows):
        block = query[start:start + block_rows].astype(np.float64)
        gram += block.T @ block
        total += block.sum(axis=0)
    mean = total / n_cells
    covariance = (gram - n_cells * np.outer(mean, mean)) / (n_cells - 1)
    _, vectors = np.linalg.eigh(covariance)
    axes = vectors[:, ::-1][:, :components].T
    _, axes = svd_flip(None, axes, u_based_decision=False)
    offset = mean @ axes.T
    return np.concatenate([query[start:start + block_rows].astype(np.float64) @ axes.T - offset
                           for start in range(0, n_cells, block_rows)]) if n_cells else np.zeros((0, components))


def coverage(similarity: np.ndarray, min_similarity: float) -> Coverage:
    """The count of unmatched cells (similarity below ``min_similarity``) and the interval on their share."""
    n, unmatched = len(similarity), int((similarity < min_similarity).sum())
    if n == 0:
        return Coverage(0, 0, float("nan"), float("nan"))
    interval = binomtest(unmatched, n).proportion_ci(confidence_level=0.95, method="wilson")
    return Coverage(n, unmatched, float(interval.low), float(interval.high))
