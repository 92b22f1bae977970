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
from sklearn.decomposition import PCA
from sklearn.neighbors import NearestNeighbors

#: principal components of the section the smoothing neighbours are searched in
PCA_COMPONENTS = 30


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
        components = min(PCA_COMPONENTS, n_genes, n_cells - 1)
        space = PCA(components, svd_solver="covariance_eigh").fit_transform(query.astype(np.float64))
        neighbours = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(space).kneighbors(
            space[scored], return_distance=False)
        smoothed = query[neighbours].mean(axis=1)
    else:
        smoothed = query[scored]
    return best_correlation(smoothed, centroids)


def coverage(similarity: np.ndarray, min_similarity: float) -> Coverage:
    """The count of unmatched cells (similarity below ``min_similarity``) and the interval on their share."""
    n, unmatched = len(similarity), int((similarity < min_similarity).sum())
    if n == 0:
        return Coverage(0, 0, float("nan"), float("nan"))
    interval = binomtest(unmatched, n).proportion_ci(confidence_level=0.95, method="wilson")
    return Coverage(n, unmatched, float(interval.low), float(interval.high))
