"""Exact nearest neighbours with faiss, excluding each anchor's own group, ranked by float64 distances.

Conventions: the cosine distance ``d = 1 - <x̂_i, x̂_j>`` of rows normalised as croma does
(``x / (||x|| + 1e-12)``), clipped to ``[0, 2]`` as scikit-learn clips it. A *group* is the physical
unit a sample was cut from (image patch, spatial tile, slide); candidates sharing the anchor's group
(the anchor included) are never its neighbours.

faiss (``IndexFlatIP`` on float32 unit rows) proposes candidates; every proposed hit's distance is
then computed in float64 from the rows as read (:class:`ExactRows`) and the hits ranked by it,
so that near-duplicate rows (the Mean readout: every cell of a patch shares one vector) keep their
true order and bitwise-equal rows tie exactly. A fetch is extended until every row left out is
provably farther (:func:`float32_error_bound`), so results are exact. Distances within
:data:`TIE_TOLERANCE` are tied: a k-NN result lists every neighbour tied with the k-th, and the
metrics share the k-th place among them (``metrics.rank_weights``; docs/decisions/0039).

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
#: Candidate rows read, normalised and indexed at a time: 335 MB per float32 copy at d = 1,280.
DEFAULT_CANDIDATE_ROWS = 65536
#: float32-sized copies of a candidate chunk alive at once: as read, normalised, a type's subset and its
#: faiss index, that subset as read for the float64 distances, and its float64 unit rows (two) when
#: some queries are searched by brute force.
_CHUNK_COPIES = 7
#: faiss's GPU k-selection limit; larger fetches are served by a CPU copy of the index.
_GPU_MAX_K = 2048
#: Quantile of the per-anchor same-group counts added to k on the first fetch.
_OVERFETCH_QUANTILE = 0.9
#: Cosine distances closer than this are tied (a float64 distance is exact to about 1e-15).
TIE_TOLERANCE = 1e-12
#: Bytes of float64 gathered rows or distances formed at a time by :class:`ExactRows`.
_PAIR_BLOCK_BYTES = 32 * 1024**2


@dataclass(frozen=True)
class Neighbours:
    """The k nearest other-group neighbours of every sample, nearest first (equal distances by row).

    ``index`` holds row indices and ``distance`` the float64 cosine distances; a row lists every
    neighbour within :data:`TIE_TOLERANCE` of its k-th distance, so it may hold more than ``k``
    (padding: -1 and inf, also where a sample has fewer than k candidates).
    """

    index: np.ndarray
    distance: np.ndarray
    k: int


@dataclass(frozen=True)
class TypedNeighbours:
    """Cosine distances (float64) to the m nearest SO and m nearest OS neighbours, ascending, inf-padded.

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


def float32_error_bound(width: int) -> float:
    """An upper bound on how far faiss's float32 cosine distance of two rows of ``width`` features
    can be from the float64 one: the float32 inner product's rounding bound for unit vectors,
    ``width · 2⁻²⁴``, plus the float32 normalisation of both rows, with 1 % to spare."""
    return 1.01 * (width + 4) * 2.0**-24


def float64_error_bound(width: int) -> float:
    """An upper bound on how far two float64 evaluations of ``1 - x̂·ŷ`` (unit rows of ``width``
    features, summed in different orders) can be apart: ``(width + 4) · 2⁻⁵²``."""
    return (width + 4) * 2.0**-52


def l2_normalise_exact(features: np.ndarray) -> np.ndarray:
    """Rows (any leading shape) divided by ``norm + 1e-12`` in float64: the rows every distance is
    computed from (croma's convention; a zero row stays zero)."""
    x = np.asarray(features, dtype=np.float64)
    return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-12)


@dataclass(frozen=True)
class ExactRows:
    """Float64 cosine distances between query rows and candidate rows, from the rows as read
    (``queries``; ``candidates`` with their ``groups``), normalised here in float64:
    ``d = 1 - x̂·ŷ`` clipped to [0, 2]. Exact to about 1e-15, so that near-duplicate rows keep their
    true order, and rows that are bitwise equal lie within :data:`TIE_TOLERANCE` of each other."""

    queries: np.ndarray
    candidates: np.ndarray
    groups: np.ndarray

    def pairs(self, query_positions: np.ndarray, hits: np.ndarray) -> np.ndarray:
        """(n, W) distances of query ``query_positions[i]`` to candidates ``hits[i]`` (-1: inf)."""
        out = np.full(hits.shape, np.inf)
        if hits.size == 0:
            return out
        block = max(1, _PAIR_BLOCK_BYTES // (8 * self.queries.shape[1] * hits.shape[1]))
        for start in range(0, len(hits), block):
            rows = hits[start:start + block]
            query = l2_normalise_exact(self.queries[query_positions[start:start + block]])[:, None, :]
            candidate = l2_normalise_exact(self.candidates[np.where(rows >= 0, rows, 0)])
            cosine = (query * candidate).sum(axis=2)  # one pairwise sum per pair: the same bits in any batch
            out[start:start + block] = np.where(rows >= 0, np.clip(1.0 - cosine, 0.0, 2.0), np.inf)
        return out

    def nearest(self, query_positions: np.ndarray, query_groups: np.ndarray, k: int,
                with_ties: bool) -> tuple[np.ndarray, np.ndarray]:
        """Brute force: every candidate's distance to each query by float64 matrix products (a block
        of queries at a time), own group excluded; the candidates within the k-th distance (and its
        ties), widened by the products' rounding bound, are then measured again by :meth:`pairs`
        and cut by :func:`_sorted_hits`, so a distance never depends on the block it came in."""
        candidates = l2_normalise_exact(self.candidates)
        take = min(k, len(candidates))
        block = max(1, _PAIR_BLOCK_BYTES // (8 * max(1, len(candidates))))
        slack = 2 * float64_error_bound(candidates.shape[1]) + (TIE_TOLERANCE if with_ties else 0.0)
        parts = []
        for start in range(0, len(query_positions), block):
            queries = l2_normalise_exact(self.queries[query_positions[start:start + block]])
            distance = np.clip(1.0 - queries @ candidates.T, 0.0, 2.0)
            distance[query_groups[start:start + block, None] == self.groups[None, :]] = np.inf
            kth = np.partition(distance, take - 1, axis=1)[:, take - 1:take]
            chosen = np.isfinite(distance) & (distance <= kth + slack)
            row, column = np.nonzero(chosen)
            counts = np.bincount(row, minlength=len(distance))
            slot = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
            positions = np.full((len(distance), max(take, int(counts.max(initial=0)))), -1, dtype=np.int64)
            positions[row, slot] = column
            found = self.pairs(query_positions[start:start + block], positions)
            parts.append(_sorted_hits(found, positions, k, with_ties))
        return _stack_padded(parts, len(query_positions), k)


def _stack_padded(parts: list[tuple[np.ndarray, np.ndarray]], n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row blocks of (distances, positions) of differing widths as one inf / -1-padded pair."""
    width = max([k, *(part[0].shape[1] for part in parts)])
    distance, index = np.full((n, width), np.inf), np.full((n, width), -1, dtype=np.int64)
    start = 0
    for part_distance, part_index in parts:
        stop = start + len(part_distance)
        distance[start:stop, :part_distance.shape[1]], index[start:stop, :part_index.shape[1]] = part_distance, part_index
        start = stop
    return distance, index


def _sorted_hits(distance: np.ndarray, index: np.ndarray, k: int, with_ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's hits by ascending distance (then index), cut after the k-th, or — ``with_ties`` —
    after every hit within :data:`TIE_TOLERANCE` of the k-th distance (rows padded with inf / -1)."""
    order = np.lexsort((index, distance), axis=1)
    distance, index = np.take_along_axis(distance, order, axis=1), np.take_along_axis(index, order, axis=1)
    if distance.shape[1] < k:
        pad = k - distance.shape[1]
        distance = np.pad(distance, ((0, 0), (0, pad)), constant_values=np.inf)
        index = np.pad(index, ((0, 0), (0, pad)), constant_values=-1)
    if not with_ties:
        return distance[:, :k], index[:, :k]
    within = np.isfinite(distance) & (distance <= (distance[:, k - 1] + TIE_TOLERANCE)[:, None])
    width = max(k, int(within.sum(axis=1).max(initial=0)))
    return (np.where(within, distance, np.inf)[:, :width],
            np.where(within, index, -1)[:, :width])


def search_excluding_groups(
    index: faiss.Index,
    index_groups: np.ndarray,
    queries: np.ndarray,
    query_groups: np.ndarray,
    k: int,
    same_group_counts: np.ndarray,
    exact: ExactRows,
    *,
    with_ties: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest hits in ``index`` whose group differs from the query's, by exact distance.

    faiss proposes in float32 and ``exact`` (the same rows, as read) ranks the proposals in float64.
    ``same_group_counts[q]`` is how many indexed rows share query q's group: the first fetch adds
    their 90th percentile to k, and queries left with fewer than k other-group hits are re-fetched
    with ``k + same_group_counts``. A query's proposals are complete when every row not fetched is
    provably farther than its k-th exact distance (and, ``with_ties``, than everything tied with it):
    its last float32 distance less :func:`float32_error_bound` exceeds it. Queries where that cannot
    be shown (distances all within float32's error of each other, as for near-duplicate rows) are
    searched by brute force in float64 (:meth:`ExactRows.nearest`). Returns (distances inf-padded,
    positions -1-padded), (n_queries, k), or wider ``with_ties`` to hold every hit tied with the k-th.
    """
    n_index = int(index.ntotal)
    positions_all = np.arange(len(queries))
    first_k = int(min(n_index, k + np.quantile(same_group_counts, _OVERFETCH_QUANTILE, method="higher")))
    distance, hits, last = _proposals(index, index_groups, queries, query_groups, positions_all, first_k, exact, k,
                                      with_ties, chunk_size)
    needed = np.minimum(n_index, k + same_group_counts)
    short = (~np.isfinite(distance[:, k - 1])) & (needed > first_k)
    if short.any():
        rows = np.flatnonzero(short)
        refetched = _proposals(index, index_groups, queries[rows], query_groups[rows], rows, int(needed[rows].max()),
                               exact, k, with_ties, chunk_size)
        distance, hits = _replace_rows(distance, hits, rows, *refetched[:2])
        last[rows] = refetched[2]
    bound = distance[:, k - 1] + (TIE_TOLERANCE if with_ties else 0.0)
    unsure = np.flatnonzero(~((last >= n_index) | (last - float32_error_bound(index.d) > bound)))
    if unsure.size:
        distance, hits = _replace_rows(distance, hits, unsure,
                                       *exact.nearest(unsure, query_groups[unsure], k, with_ties))
    return distance, hits


def _proposals(index: faiss.Index, index_groups: np.ndarray, queries: np.ndarray, query_groups: np.ndarray,
               query_positions: np.ndarray, fetch: int, exact: ExactRows, k: int, with_ties: bool,
               chunk_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """faiss's ``fetch`` best hits of other groups ranked by exact distance, and per query the float32
    distance of the last hit fetched (``n_index`` — a sentinel above any distance — when every row was)."""
    scores, positions = _search(index, queries, fetch, chunk_size)
    found = positions >= 0
    hits = np.where(found & (index_groups[np.where(found, positions, 0)] != query_groups[:, None]), positions, -1)
    distance, hits = _sorted_hits(exact.pairs(query_positions, hits), hits, k, with_ties)
    exhausted = fetch >= int(index.ntotal)
    last = np.full(len(queries), float(index.ntotal)) if exhausted else 1.0 - scores[:, -1].astype(np.float64)
    return distance, hits, last


def _replace_rows(distance: np.ndarray, hits: np.ndarray, rows: np.ndarray, new_distance: np.ndarray,
                  new_hits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``distance`` / ``hits`` with ``rows`` replaced, widened (inf / -1) where the new rows are wider."""
    width = max(distance.shape[1], new_distance.shape[1])
    if width > distance.shape[1]:
        pad = width - distance.shape[1]
        distance = np.pad(distance, ((0, 0), (0, pad)), constant_values=np.inf)
        hits = np.pad(hits, ((0, 0), (0, pad)), constant_values=-1)
    distance[rows], hits[rows] = np.inf, -1
    distance[rows, :new_distance.shape[1]], hits[rows, :new_hits.shape[1]] = new_distance, new_hits
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

    ``unit``: the feature rows as stored (normalised here: float32 for faiss, float64 for the
    distances), in memory or a :class:`RowSource` (a memory-mapped store): the anchors' rows are read
    once, the candidates ``candidate_rows`` at a time, so a search holds the anchors, one candidate
    chunk and its indexes, never the whole matrix. Per chunk, the anchors of each (biology b,
    confounder c) block search one flat index over the chunk's SO candidates (biology b, confounder
    != c) and one over its OS candidates (confounder c, biology != b); the k-NN search uses one
    index over the whole chunk. Each chunk's hits are exact (:func:`search_excluding_groups`) and
    merged into the running best, so the result is the exact search's whatever the chunking. The
    k-NN lists every neighbour tied with the k-th (:class:`Neighbours`).
    """
    rows = as_row_source(unit)
    n = len(rows)
    groups = np.asarray(groups)
    anchor_rows = np.arange(n) if anchors is None else np.asarray(anchors, dtype=np.int64)
    whole = anchors is None and isinstance(rows, ArrayRows)  # every row a query: read the array once
    anchor_features = rows.array if whole else rows.take(anchor_rows)
    queries = l2_normalise(anchor_features)
    query_groups = groups[anchor_rows]
    n_groups = int(groups.max()) + 1 if n else 0
    blocks = [] if m is None else _anchor_blocks(biology[anchor_rows], confounder[anchor_rows])
    typed = None if m is None else {kind: (np.full((len(anchor_rows), m), np.inf),
                                           np.full((len(anchor_rows), m), -1, dtype=np.int64)) for kind in ("so", "os")}
    knn_distance = None if k is None else np.full((len(anchor_rows), k), np.inf)
    knn_index = None if k is None else np.full((len(anchor_rows), k), -1, dtype=np.int64)
    for start in range(0, n, candidate_rows):
        chunk = np.arange(start, min(n, start + candidate_rows))
        one_chunk = anchors is None and len(chunk) == n
        chunk_features = anchor_features if one_chunk else rows.take(chunk)
        vectors = queries if one_chunk else l2_normalise(chunk_features)
        chunk_groups = groups[chunk]
        for b, c, in_block in blocks:
            _typed_chunk(typed, in_block, biology[chunk] == b, confounder[chunk] == c, chunk, vectors, chunk_groups,
                         n_groups, queries[in_block], query_groups[in_block],
                         anchor_features[in_block], chunk_features, m, chunk_size)
        if k is not None:
            distance, hits = _search_subset(vectors, chunk_features, np.arange(len(chunk)), chunk_groups, n_groups,
                                            queries, anchor_features, query_groups, k, True, chunk_size)
            knn_distance, knn_index = _merge_hits(knn_distance, knn_index, distance,
                                                  np.where(hits >= 0, chunk[hits], -1), k, True)
    return (None if m is None else TypedNeighbours(so=typed["so"][0], os=typed["os"][0], so_index=typed["so"][1],
                                                   os_index=typed["os"][1]),
            None if k is None else Neighbours(index=knn_index, distance=knn_distance, k=k))


def _typed_chunk(typed: dict[str, tuple[np.ndarray, np.ndarray]], in_block: np.ndarray, same_biology: np.ndarray,
                 same_confounder: np.ndarray, chunk: np.ndarray, vectors: np.ndarray, chunk_groups: np.ndarray,
                 n_groups: int, queries: np.ndarray, query_groups: np.ndarray, query_features: np.ndarray,
                 chunk_features: np.ndarray, m: int, chunk_size: int) -> None:
    """Merge one candidate chunk's m nearest SO and OS hits of the anchors ``in_block`` (one
    biology × confounder block) into ``typed`` (kind → running distances and rows)."""
    for kind, candidates in (("so", same_biology & ~same_confounder), ("os", same_confounder & ~same_biology)):
        distance, hits = _search_subset(vectors, chunk_features, np.flatnonzero(candidates), chunk_groups, n_groups,
                                        queries, query_features, query_groups, m, False, chunk_size)
        best_distance, best_index = typed[kind]
        best_distance[in_block], best_index[in_block] = _merge_hits(
            best_distance[in_block], best_index[in_block], distance, np.where(hits >= 0, chunk[hits], -1), m, False)


def _anchor_blocks(biology: np.ndarray, confounder: np.ndarray) -> list[tuple[object, object, np.ndarray]]:
    """(biology b, confounder c, positions of the anchors in that block) for every block present."""
    blocks = np.unique(np.stack([biology, confounder]), axis=1).T
    return [(b, c, np.flatnonzero((biology == b) & (confounder == c))) for b, c in blocks]


def _search_subset(vectors: np.ndarray, chunk_features: np.ndarray, subset: np.ndarray, subset_groups: np.ndarray,
                   n_groups: int, queries: np.ndarray, query_features: np.ndarray, query_groups: np.ndarray, k: int,
                   with_ties: bool, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest other-group hits among the chunk's rows ``subset`` (``vectors``: float32 unit
    rows for faiss; ``chunk_features`` / ``query_features``: the rows as read, for the float64
    distances): (distances inf-padded, positions in the chunk -1-padded)."""
    if subset.size == 0 or len(queries) == 0:
        return np.full((len(queries), k), np.inf), np.full((len(queries), k), -1, dtype=np.int64)
    candidate_groups = subset_groups[subset]
    same_group = np.bincount(candidate_groups, minlength=n_groups)[query_groups]
    whole = subset.size == len(vectors)  # subsets are sorted and unique
    indexed = vectors if whole else vectors[subset]
    exact = ExactRows(query_features, chunk_features if whole else chunk_features[subset], candidate_groups)
    distance, hits = search_excluding_groups(_flat_index(indexed), candidate_groups, queries, query_groups, k,
                                             same_group, exact, with_ties=with_ties, chunk_size=chunk_size)
    return distance, np.where(hits >= 0, subset[hits], -1)


def _merge_hits(distance: np.ndarray, index: np.ndarray, new_distance: np.ndarray, new_index: np.ndarray, k: int,
                with_ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of two hit lists per row (equal distances by row index), and — ``with_ties`` —
    every hit tied with the k-th."""
    return _sorted_hits(np.concatenate([distance, new_distance], axis=1), np.concatenate([index, new_index], axis=1),
                        k, with_ties)
