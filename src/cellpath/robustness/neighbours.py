"""Exact nearest neighbours with faiss, excluding each anchor's own group.

Conventions: features are L2-normalised float32 rows (``x / (||x|| + 1e-12)``, as croma does);
similarity is the inner product on ``faiss.IndexFlatIP`` and the cosine distance is
``d = 1 - <x_i, x_j>``, clipped to ``[0, 2]`` as scikit-learn clips it. A *group* is the physical
unit a sample was cut from (image patch, spatial tile, slide); candidates sharing the anchor's group
(the anchor included) are never its neighbours. Searches over-fetch, drop same-group hits, and
re-query only the anchors that lost too many with the exact fetch they need, so results are exact.
Queries are processed in chunks, so a search holds one copy of its candidate rows plus
``chunk_size x k`` results, never an n x n matrix. faiss's GPU
flat index is used when faiss sees a GPU (``faiss.get_num_gpus() > 0``), the CPU one otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import faiss
import numpy as np

#: Queries per faiss call: bounds the (chunk x k) result buffers.
DEFAULT_CHUNK_SIZE = 16384
#: faiss's GPU k-selection limit; larger fetches are served by a CPU copy of the index.
_GPU_MAX_K = 2048
#: Quantile of the per-anchor same-group counts added to k on the first fetch.
_OVERFETCH_QUANTILE = 0.9


@dataclass(frozen=True)
class Neighbours:
    """The k nearest other-group neighbours of every sample, nearest first.

    ``index`` holds row indices (-1 where a sample has fewer than k candidates) and ``distance``
    the cosine distances (inf there).
    """

    index: np.ndarray
    distance: np.ndarray


@dataclass(frozen=True)
class TypedNeighbours:
    """Cosine distances to the m nearest SO and m nearest OS neighbours, ascending, inf-padded.

    SO: same biology, other confounder. OS: other biology, same confounder. Both exclude the
    anchor's own group.
    """

    so: np.ndarray
    os: np.ndarray


def l2_normalise(features: np.ndarray) -> np.ndarray:
    """Rows divided by ``norm + 1e-12`` (croma's convention, in the input's float precision),
    returned as C-contiguous float32."""
    x = np.asarray(features)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    return np.ascontiguousarray(x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-12), dtype=np.float32)


@lru_cache(maxsize=1)
def _gpu_resources() -> faiss.StandardGpuResources:
    return faiss.StandardGpuResources()


def _flat_index(vectors: np.ndarray) -> faiss.Index:
    """An exact inner-product index over ``vectors``: on the GPU when faiss has one."""
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    if faiss.get_num_gpus() > 0:
        return faiss.index_cpu_to_gpu(_gpu_resources(), 0, index)
    return index


def _search(index: faiss.Index, queries: np.ndarray, k: int, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inner products and positions of the k best hits, one chunk of queries at a time."""
    if k > _GPU_MAX_K and faiss.get_num_gpus() > 0:
        index = faiss.index_gpu_to_cpu(index)
    scores = np.empty((len(queries), k), dtype=np.float32)
    positions = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), chunk_size):
        stop = start + chunk_size
        scores[start:stop], positions[start:stop] = index.search(queries[start:stop], k)
    return scores, positions


def _keep_other_groups(
    scores: np.ndarray, positions: np.ndarray, index_groups: np.ndarray, query_groups: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First k hits of another group per row: (distances inf-padded, positions -1-padded, counts)."""
    found = positions >= 0
    valid = found & (index_groups[np.where(found, positions, 0)] != query_groups[:, None])
    take = min(k, positions.shape[1])
    order = np.argsort(~valid, axis=1, kind="stable")[:, :take]
    kept = np.take_along_axis(valid, order, axis=1)
    distance = np.full((len(positions), k), np.inf)
    index = np.full((len(positions), k), -1, dtype=np.int64)
    ip = np.take_along_axis(scores, order, axis=1).astype(np.float64)
    distance[:, :take] = np.where(kept, np.clip(1.0 - ip, 0.0, 2.0), np.inf)
    index[:, :take] = np.where(kept, np.take_along_axis(positions, order, axis=1), -1)
    return distance, index, kept.sum(axis=1)


def search_excluding_groups(
    index: faiss.Index,
    index_groups: np.ndarray,
    queries: np.ndarray,
    query_groups: np.ndarray,
    k: int,
    same_group_counts: np.ndarray,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest hits in ``index`` whose group differs from the query's.

    ``same_group_counts[q]`` is how many indexed rows share query q's group: fetching
    ``k + same_group_counts[q]`` hits is always enough. The first fetch adds the 90th
    percentile of those counts; rows left short are re-queried with their exact bound.
    Returns (cosine distances inf-padded, positions in ``index`` -1-padded), each (n_queries, k).
    """
    n_index = int(index.ntotal)
    needed = np.minimum(n_index, k + same_group_counts)
    first_k = int(min(n_index, k + np.quantile(same_group_counts, _OVERFETCH_QUANTILE, method="higher")))
    scores, positions = _search(index, queries, first_k, chunk_size)
    distance, hits, counts = _keep_other_groups(scores, positions, index_groups, query_groups, k)
    short = (counts < k) & (needed > first_k)
    if short.any():
        rows = np.flatnonzero(short)
        scores, positions = _search(index, queries[rows], int(needed[rows].max()), chunk_size)
        distance[rows], hits[rows], _ = _keep_other_groups(scores, positions, index_groups, query_groups[rows], k)
    return distance, hits


def knn_excluding_groups(
    unit: np.ndarray,
    groups: np.ndarray,
    k: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    anchors: np.ndarray | None = None,
) -> Neighbours:
    """The k nearest neighbours of every row of ``unit`` (L2-normalised float32) among all
    rows of other groups, for RI, MaRI and the k-NN probes.

    ``anchors`` (row positions) restricts the queries to those rows, searched against all rows;
    the result's rows then follow ``anchors``.
    """
    queries = np.arange(len(unit)) if anchors is None else np.asarray(anchors)
    group_sizes = np.bincount(groups)
    distance, hits = search_excluding_groups(
        _flat_index(unit), groups, unit[queries], groups[queries], k, group_sizes[groups[queries]], chunk_size
    )
    return Neighbours(index=hits, distance=distance)


def _nearest_of_type(
    unit: np.ndarray, groups: np.ndarray, candidates: np.ndarray, anchors: np.ndarray, m: int, chunk_size: int
) -> np.ndarray:
    """(len(anchors), m) distances from the anchors to their m nearest other-group candidates."""
    if candidates.size == 0:
        return np.full((len(anchors), m), np.inf)
    same_group = np.bincount(groups[candidates], minlength=int(groups.max()) + 1)[groups[anchors]]
    distance, _ = search_excluding_groups(
        _flat_index(unit[candidates]), groups[candidates], unit[anchors], groups[anchors], m, same_group, chunk_size
    )
    return distance


def typed_neighbours(
    unit: np.ndarray,
    biology: np.ndarray,
    confounder: np.ndarray,
    groups: np.ndarray,
    m: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    anchors: np.ndarray | None = None,
) -> TypedNeighbours:
    """Distances to the m nearest SO and m nearest OS neighbours of every sample.

    Anchors are processed per (biology b, confounder c) block. Each block searches one flat index
    over its SO candidates (biology b, confounder != c) and one over its OS candidates
    (confounder c, biology != b), so an anchor scans only the candidates of the two types it needs.
    ``anchors`` (row positions) restricts the anchors to those rows, still searched against all
    candidates; the result's rows then follow ``anchors``.
    """
    anchor_rows = np.arange(len(unit)) if anchors is None else np.asarray(anchors)
    so = np.empty((len(anchor_rows), m))
    os_ = np.empty((len(anchor_rows), m))
    blocks = np.unique(np.stack([biology[anchor_rows], confounder[anchor_rows]]), axis=1).T
    for b, c in blocks:
        in_block = np.flatnonzero((biology[anchor_rows] == b) & (confounder[anchor_rows] == c))
        block_anchors = anchor_rows[in_block]
        so_candidates = np.flatnonzero((biology == b) & (confounder != c))
        os_candidates = np.flatnonzero((biology != b) & (confounder == c))
        so[in_block] = _nearest_of_type(unit, groups, so_candidates, block_anchors, m, chunk_size)
        os_[in_block] = _nearest_of_type(unit, groups, os_candidates, block_anchors, m, chunk_size)
    return TypedNeighbours(so=so, os=os_)
