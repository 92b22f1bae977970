"""Exact nearest neighbours with faiss, excluding each anchor's own group.

Conventions: features are L2-normalised float32 rows (``x / (||x|| + 1e-12)``, as croma does);
similarity is the inner product on ``faiss.IndexFlatIP`` and the cosine distance is
``d = 1 - <x_i, x_j>``, clipped to ``[0, 2]`` as scikit-learn clips it. A *group* is the physical
unit a sample was cut from (image patch, spatial tile, slide); candidates sharing the anchor's group
(the anchor included) are never its neighbours. Searches over-fetch, drop same-group hits, and
re-query only the anchors that lost too many with the exact fetch they need, so results are exact.
Candidates are read ``candidate_rows`` at a time (from memory or a memory-mapped :class:`RowSource`)
and each chunk's exact hits merged into the running best; queries are processed ``chunk_size`` at a
time. A search holds the anchors' rows, one candidate chunk with its indexes and the
``anchors x k`` results, never the whole candidate matrix or an n x n one. faiss's GPU
flat index is used when faiss sees a GPU (``faiss.get_num_gpus() > 0``), the CPU one otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache

import faiss
import numpy as np

#: Queries per faiss call: bounds the (chunk x k) result buffers.
DEFAULT_CHUNK_SIZE = 16384
#: Candidate rows read, normalised and indexed at a time: 335 MB of float32 at d = 1,280.
DEFAULT_CANDIDATE_ROWS = 65536
#: float32 copies of a candidate chunk alive at once: as read, normalised, a type's subset, its index.
_CHUNK_COPIES = 4
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
    anchor's own group. ``so_index`` / ``os_index``: the row positions of those neighbours (-1
    where a distance is inf), for showing which cells decided a margin.
    """

    so: np.ndarray
    os: np.ndarray
    so_index: np.ndarray
    os_index: np.ndarray


class RowSource(ABC):
    """Rows of an (n, d) feature matrix read on demand: ``take(rows)`` → float (len(rows), d). A
    memory-mapped store subclasses it so that searches read it chunk by chunk."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def take(self, rows: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class ArrayRows(RowSource):
    """An in-memory matrix as a :class:`RowSource` (``ndarray.take`` flattens, so it is wrapped)."""

    array: np.ndarray

    def __len__(self) -> int:
        return len(self.array)

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.array[rows]


@dataclass(frozen=True)
class NormalisedRows(RowSource):
    """A :class:`RowSource` whose rows are L2-normalised as they are read (:func:`l2_normalise`)."""

    source: RowSource

    def __len__(self) -> int:
        return len(self.source)

    def take(self, rows: np.ndarray) -> np.ndarray:
        return l2_normalise(self.source.take(rows))


def candidate_rows_for(budget_mb: float, width: int) -> int:
    """Candidate rows per chunk so that a chunk's float32 copies fit ``budget_mb`` MiB (at least 1,024)."""
    return max(1024, int(budget_mb * 1024**2) // (_CHUNK_COPIES * 4 * max(1, width)))


def as_row_source(features: np.ndarray | RowSource) -> RowSource:
    """An in-memory array wrapped as :class:`ArrayRows`; a row source as it is."""
    return ArrayRows(features) if isinstance(features, np.ndarray) else features


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
    unit: np.ndarray | RowSource,
    groups: np.ndarray,
    k: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    anchors: np.ndarray | None = None,
    candidate_rows: int = DEFAULT_CANDIDATE_ROWS,
) -> Neighbours:
    """The k nearest neighbours of every row of ``unit`` (L2-normalised float32) among all
    rows of other groups, for RI, MaRI and the k-NN probes.

    ``anchors`` (row positions) restricts the queries to those rows, searched against all rows;
    the result's rows then follow ``anchors``. See :func:`scan_neighbours` for ``candidate_rows``.
    """
    return scan_neighbours(unit, groups, k=k, anchors=anchors, chunk_size=chunk_size,
                           candidate_rows=candidate_rows)[1]


def typed_neighbours(
    unit: np.ndarray | RowSource,
    biology: np.ndarray,
    confounder: np.ndarray,
    groups: np.ndarray,
    m: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    anchors: np.ndarray | None = None,
    candidate_rows: int = DEFAULT_CANDIDATE_ROWS,
) -> TypedNeighbours:
    """Distances to the m nearest SO and m nearest OS neighbours of every sample.

    ``anchors`` (row positions) restricts the anchors to those rows, still searched against all
    candidates; the result's rows then follow ``anchors``. See :func:`scan_neighbours`.
    """
    return scan_neighbours(unit, groups, biology, confounder, m=m, anchors=anchors, chunk_size=chunk_size,
                           candidate_rows=candidate_rows)[0]


def scan_neighbours(
    unit: np.ndarray | RowSource,
    groups: np.ndarray,
    biology: np.ndarray | None = None,
    confounder: np.ndarray | None = None,
    *,
    m: int | None = None,
    k: int | None = None,
    anchors: np.ndarray | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    candidate_rows: int = DEFAULT_CANDIDATE_ROWS,
) -> tuple[TypedNeighbours | None, Neighbours | None]:
    """The typed SO/OS distances (when ``m`` is given) and the k-NN (when ``k`` is given) of the
    anchors (default: every row), in one pass over the candidates.

    ``unit``: L2-normalised float32 rows, in memory or a :class:`RowSource` (a memory-mapped store):
    the anchors' rows are read once, the candidates ``candidate_rows`` at a time, so a search holds
    the anchors, one candidate chunk and its indexes, never the whole matrix. Per chunk, the anchors
    of each (biology b, confounder c) block search one flat index over the chunk's SO candidates
    (biology b, confounder != c) and one over its OS candidates (confounder c, biology != b); the
    k-NN search uses one index over the whole chunk. Each chunk's hits are exact
    (:func:`search_excluding_groups`) and merged into the running best, so the result is the exact
    search's whatever the chunking.
    """
    rows = as_row_source(unit)
    n = len(rows)
    groups = np.asarray(groups)
    anchor_rows = np.arange(n) if anchors is None else np.asarray(anchors, dtype=np.int64)
    whole = anchors is None and isinstance(rows, ArrayRows)  # every row a query: search the array itself
    queries = rows.array if whole else rows.take(anchor_rows)
    query_groups = groups[anchor_rows]
    n_groups = int(groups.max()) + 1 if n else 0
    blocks = [] if m is None else _anchor_blocks(biology[anchor_rows], confounder[anchor_rows])
    typed = None if m is None else {kind: (np.full((len(anchor_rows), m), np.inf),
                                           np.full((len(anchor_rows), m), -1, dtype=np.int64)) for kind in ("so", "os")}
    knn_distance = None if k is None else np.full((len(anchor_rows), k), np.inf)
    knn_index = None if k is None else np.full((len(anchor_rows), k), -1, dtype=np.int64)
    for start in range(0, n, candidate_rows):
        chunk = np.arange(start, min(n, start + candidate_rows))
        vectors = queries if anchors is None and len(chunk) == n else rows.take(chunk)
        chunk_groups = groups[chunk]
        for b, c, in_block in blocks:
            block_biology, block_confounder = biology[chunk] == b, confounder[chunk] == c
            for kind, candidates in (("so", block_biology & ~block_confounder), ("os", block_confounder & ~block_biology)):
                distance, hits = _search_subset(vectors, np.flatnonzero(candidates), chunk_groups, n_groups,
                                                queries[in_block], query_groups[in_block], m, chunk_size)
                best_distance, best_index = typed[kind]
                best_distance[in_block], best_index[in_block] = _merge_hits(
                    best_distance[in_block], best_index[in_block], distance, np.where(hits >= 0, chunk[hits], -1))
        if k is not None:
            distance, hits = _search_subset(vectors, np.arange(len(chunk)), chunk_groups, n_groups, queries,
                                            query_groups, k, chunk_size)
            knn_distance, knn_index = _merge_hits(knn_distance, knn_index, distance, np.where(hits >= 0, chunk[hits], -1))
    return (None if m is None else TypedNeighbours(so=typed["so"][0], os=typed["os"][0], so_index=typed["so"][1],
                                                   os_index=typed["os"][1]),
            None if k is None else Neighbours(index=knn_index, distance=knn_distance))


def _anchor_blocks(biology: np.ndarray, confounder: np.ndarray) -> list[tuple[object, object, np.ndarray]]:
    """(biology b, confounder c, positions of the anchors in that block) for every block present."""
    blocks = np.unique(np.stack([biology, confounder]), axis=1).T
    return [(b, c, np.flatnonzero((biology == b) & (confounder == c))) for b, c in blocks]


def _search_subset(vectors: np.ndarray, subset: np.ndarray, subset_groups: np.ndarray, n_groups: int,
                   queries: np.ndarray, query_groups: np.ndarray, k: int,
                   chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest other-group hits among ``vectors[subset]``: (distances inf-padded, positions
    in ``vectors`` -1-padded)."""
    if subset.size == 0 or len(queries) == 0:
        return np.full((len(queries), k), np.inf), np.full((len(queries), k), -1, dtype=np.int64)
    candidate_groups = subset_groups[subset]
    same_group = np.bincount(candidate_groups, minlength=n_groups)[query_groups]
    indexed = vectors if subset.size == len(vectors) else vectors[subset]  # subsets are sorted and unique
    distance, hits = search_excluding_groups(_flat_index(indexed), candidate_groups, queries,
                                             query_groups, k, same_group, chunk_size)
    return distance, np.where(hits >= 0, subset[hits], -1)


def _merge_hits(distance: np.ndarray, index: np.ndarray, new_distance: np.ndarray,
                new_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of two hit lists per row (ties: the earlier list first, then its order)."""
    k = distance.shape[1]
    both = np.concatenate([distance, new_distance], axis=1)
    order = np.argsort(both, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(both, order, axis=1), np.take_along_axis(np.concatenate([index, new_index], axis=1),
                                                                      order, axis=1)
