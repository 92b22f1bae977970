"""Exact nearest neighbours with faiss, excluding each anchor's own group, ranked by float64 distances.

Conventions: the cosine distance ``d = 1 - <x̂_i, x̂_j>`` of unit rows ``x̂ = x / ||x||`` (a zero row
stays zero), clipped to ``[0, 2]`` as scikit-learn clips it. croma divides by ``||x|| + 1e-12``
instead, which moves a distance by up to ``1e-12 (1/||x|| + 1/||y||)``, more than
:data:`TIE_TOLERANCE` once norms are below 2 (2e-10 at norms of 0.01); no epsilon is added here,
so scaling a row changes its distances only by float64 rounding. A *group* is the physical
unit a sample was cut from (image patch, spatial tile, slide); candidates sharing the anchor's group
(the anchor included) are never its neighbours.

float32 proposes candidates — faiss (``IndexFlatIP`` on float32 unit rows), or for the typed
searches of small anchor blocks on the CPU one dense float32 product per biology or confounder
level — and the candidates float32 cannot rule out (those within twice
:func:`float32_error_bound` of the k-th float32 distance, and the tie tolerance) are measured in
float64 (:class:`ExactRows`: ``1 - x̂·ŷ`` of unit rows normalised once per candidate chunk) and
ranked by it, so that near-duplicate rows (the Mean readout: every cell of a patch shares one
vector) keep their true order and bitwise-equal rows tie exactly. A fetch is extended until every
row left out is provably farther, else the query is searched by brute force in float64, so
results are exact and the same whichever way they were found. Distances within
:data:`TIE_TOLERANCE` are tied: a k-NN result lists every neighbour tied with the k-th, and the
metrics share the k-th place among them (``metrics.rank_weights``; docs/decisions/0039).

Candidates are read ``candidate_rows`` at a time (from memory or a memory-mapped :class:`RowSource`)
and each chunk's exact hits merged into the running best; queries are processed ``chunk_size`` at a
time. A search holds the anchors' rows, one candidate chunk with its indexes and the
``anchors x k`` results, never the whole candidate matrix or an n x n one. faiss's GPU
flat index is used when faiss sees a GPU (``faiss.get_num_gpus() > 0``), for every search; the CPU
one otherwise, on one thread for small searches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import faiss
import numpy as np

#: Queries per faiss call: bounds the (chunk x k) result buffers.
DEFAULT_CHUNK_SIZE = 16384
#: Candidate rows read, normalised and indexed at a time: 335 MB per float32 copy at d = 1,280.
DEFAULT_CANDIDATE_ROWS = 65536
#: float32-sized copies of a candidate chunk alive at once: its float64 unit rows (two; the rows as read
#: are let go once normalised), their float32 copy, a type's subset of that and its faiss index, and the
#: subset's float64 unit rows (two) when some queries are searched by brute force.
_CHUNK_COPIES = 7
#: faiss's GPU k-selection limit; larger fetches are served by a CPU copy of the index.
_GPU_MAX_K = 2048
#: Multiply-adds (queries x rows x width) below which a CPU search runs on one thread.
_SERIAL_SEARCH_WORK = 2**27
#: Mean anchors per (biology, confounder) block below which a level's typed search is one dense product.
_DENSE_BLOCK_ANCHORS = 256
#: Quantile of the per-anchor same-group counts added to k on the first fetch.
_OVERFETCH_QUANTILE = 0.9
#: Hits fetched beyond k and the same-group allowance, so that the last one is usually provably
#: farther than the k-th (at least this many, or k / 2).
_FETCH_MARGIN = 8
#: Wider fetches (each this many times the last) tried for the queries still unsure, before brute force.
_WIDER_FETCHES, _WIDER_FACTOR = 2, 4
#: Cosine distances closer than this are tied (a float64 distance is exact to about 1e-15).
TIE_TOLERANCE = 1e-12
#: Bytes of float64 gathered candidate rows measured at a time by :meth:`ExactRows.pairs` (small enough
#: to stay in cache while they are multiplied and summed).
_PAIR_BLOCK_BYTES = 2 * 1024**2
#: Bytes of float64 distances formed at a time by the brute force (:meth:`ExactRows.nearest`).
_BRUTE_BLOCK_BYTES = 32 * 1024**2


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


def _unit(x: np.ndarray, axis: int) -> np.ndarray:
    """``x / ||x||`` along ``axis``. Nothing is added to a norm; a zero norm is replaced by 1, so a
    zero vector stays zero."""
    norm = np.linalg.norm(x, axis=axis, keepdims=True)
    return x / np.where(norm > 0.0, norm, 1.0)


def l2_normalise(features: np.ndarray) -> np.ndarray:
    """Rows divided by their norm (a zero row stays zero), normalised in float64 and returned as
    C-contiguous float32: the rows faiss searches."""
    return np.ascontiguousarray(l2_normalise_exact(features), dtype=np.float32)


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


@contextmanager
def _omp_threads(threads: int | None) -> Iterator[None]:
    """faiss's OpenMP threads set to ``threads`` in this thread for the block (None: unchanged)."""
    before = faiss.omp_get_max_threads()
    if threads is not None:
        faiss.omp_set_num_threads(threads)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def _search(index: faiss.Index, queries: np.ndarray, k: int, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inner products and positions of the k best hits, one chunk of queries at a time. A small search
    on the CPU runs on one thread: OpenMP's start and barriers cost it more than a second thread saves,
    many times more when another process holds a core."""
    gpu = faiss.get_num_gpus() > 0
    if k > _GPU_MAX_K and gpu:
        index = faiss.index_gpu_to_cpu(index)
        gpu = False
    scores = np.empty((len(queries), k), dtype=np.float32)
    positions = np.empty((len(queries), k), dtype=np.int64)
    serial = not gpu and len(queries) * int(index.ntotal) * index.d < _SERIAL_SEARCH_WORK
    with _omp_threads(1 if serial else None):
        for start in range(0, len(queries), chunk_size):
            stop = start + chunk_size
            scores[start:stop], positions[start:stop] = index.search(queries[start:stop], k)
    return scores, positions


def float32_error_bound(width: int) -> float:
    """An upper bound on how far faiss's float32 cosine distance of two rows of ``width`` features
    can be from the float64 one: the float32 inner product's rounding bound for unit vectors,
    ``width · 2⁻²⁴``, plus the rounding of both unit rows to float32, with 1 % to spare."""
    return 1.01 * (width + 4) * 2.0**-24


def float64_error_bound(width: int) -> float:
    """An upper bound on how far two float64 evaluations of ``1 - x̂·ŷ`` (unit rows of ``width``
    features, summed in different orders) can be apart: ``(width + 4) · 2⁻⁵²``."""
    return (width + 4) * 2.0**-52


def l2_normalise_exact(features: np.ndarray) -> np.ndarray:
    """Rows (any leading shape) divided by their norm in float64, a zero row staying zero: the rows
    every distance is computed from. No epsilon is added to a norm, so scaling a row (by 1e-9, say)
    moves its distances only by float64 rounding."""
    return _unit(np.asarray(features, dtype=np.float64), -1)


@dataclass(frozen=True)
class ExactRows:
    """Float64 cosine distances between query rows and candidate rows: ``d = 1 - x̂·ŷ`` clipped to
    [0, 2], exact to about 1e-15, so that near-duplicate rows keep their true order and rows that
    are bitwise equal lie within :data:`TIE_TOLERANCE` of each other.

    ``queries``: the query rows as read (normalised here, a block of pairs at a time, so that the
    anchors are never held in float64). ``candidates``: the float64 unit rows of a candidate chunk,
    normalised once (:func:`l2_normalise_exact`) for every search over it; ``rows``: the positions
    in it of this search's candidates (None: all of them), whose groups are ``groups``."""

    queries: np.ndarray
    candidates: np.ndarray
    groups: np.ndarray
    rows: np.ndarray | None = None

    def _candidate_rows(self, hits: np.ndarray) -> np.ndarray:
        return self.candidates[hits if self.rows is None else self.rows[hits]]

    def pairs(self, query_positions: np.ndarray, hits: np.ndarray) -> np.ndarray:
        """(n, W) distances of query ``query_positions[i]`` to candidates ``hits[i]`` (-1: inf),
        measured only where a hit is given. Each is one pairwise sum over the row's features, so a
        distance has the same bits whatever else is measured with it."""
        out = np.full(hits.shape, np.inf)
        row, column = np.nonzero(hits >= 0)
        block = max(1, _PAIR_BLOCK_BYTES // (8 * self.candidates.shape[1]))
        for start in range(0, row.size, block):
            rows, columns = row[start:start + block], column[start:start + block]
            new = np.r_[True, rows[1:] != rows[:-1]]  # rows ascend: each query normalised once per block
            query = l2_normalise_exact(self.queries[query_positions[rows[new]]])
            product = self._candidate_rows(hits[rows, columns])
            product *= query[np.cumsum(new) - 1]
            cosine = product.sum(axis=1)
            out[rows, columns] = np.clip(1.0 - cosine, 0.0, 2.0)
        return out

    def nearest(self, query_positions: np.ndarray, query_groups: np.ndarray, k: int,
                with_ties: bool) -> tuple[np.ndarray, np.ndarray]:
        """Brute force: every candidate's distance to each query by float64 matrix products (a block
        of queries at a time), own group excluded; the candidates within the k-th distance (and its
        ties), widened by the products' rounding bound, are then measured again by :meth:`pairs`
        and cut by :func:`_sorted_hits`, so a distance never depends on the block it came in."""
        candidates = self.candidates if self.rows is None else self.candidates[self.rows]
        take = min(k, len(candidates))
        block = max(1, _BRUTE_BLOCK_BYTES // (8 * max(1, len(candidates))))
        slack = 2 * float64_error_bound(candidates.shape[1]) + (TIE_TOLERANCE if with_ties else 0.0)
        parts = []
        for start in range(0, len(query_positions), block):
            queries = l2_normalise_exact(self.queries[query_positions[start:start + block]])
            distance = np.clip(1.0 - queries @ candidates.T, 0.0, 2.0)
            distance[query_groups[start:start + block, None] == self.groups[None, :]] = np.inf
            kth = np.partition(distance, take - 1, axis=1)[:, take - 1:take]
            positions = _packed(np.isfinite(distance) & (distance <= kth + slack), take)
            found = self.pairs(query_positions[start:start + block], positions)
            parts.append(_sorted_hits(found, positions, k, with_ties))
        return _stack_padded(parts, len(query_positions), k)


def _packed(chosen: np.ndarray, width: int) -> np.ndarray:
    """The column positions of each row's True entries, in order, as a -1-padded (rows, ≥ width) matrix."""
    row, column = np.nonzero(chosen)
    counts = np.bincount(row, minlength=len(chosen))
    slot = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.full((len(chosen), max(width, int(counts.max(initial=0)))), -1, dtype=np.int64)
    positions[row, slot] = column
    return positions


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

    faiss proposes in float32 and ``exact`` measures in float64 only the proposals float32 cannot
    rule out: those within twice :func:`float32_error_bound` (and, ``with_ties``, the tie tolerance)
    of the query's k-th float32 distance; every other proposal is provably farther than the k-th
    exact distance and everything tied with it. ``same_group_counts[q]`` is how many indexed rows
    share query q's group: the first fetch adds their 90th percentile and a margin to k, and queries
    left with fewer than k other-group hits are re-fetched with ``k + same_group_counts`` and the
    margin. A query's proposals are complete when every row not fetched is provably farther than its
    k-th exact distance (and, ``with_ties``, than everything tied with it): its last float32 distance
    less :func:`float32_error_bound` exceeds it. Queries where that is not shown are fetched again,
    wider (``_WIDER_FETCHES`` times); those still unsure (distances within float32's error of each
    other: near-duplicate rows) are searched by brute force in float64 (:meth:`ExactRows.nearest`). Returns (distances inf-padded, positions -1-padded), (n_queries, k),
    or wider ``with_ties`` to hold every hit tied with the k-th: the same whichever way a query was
    settled, since every distance returned is measured by :meth:`ExactRows.pairs`.
    """
    n_index = int(index.ntotal)
    error, tolerance = float32_error_bound(index.d), TIE_TOLERANCE if with_ties else 0.0
    margin = max(_FETCH_MARGIN, k // 2)
    first = int(min(n_index, k + margin + np.quantile(same_group_counts, _OVERFETCH_QUANTILE, method="higher")))
    distance, hits, last = _proposals(index, index_groups, queries, query_groups, np.arange(len(queries)), first,
                                      exact, k, with_ties, chunk_size)
    fetched = np.full(len(queries), first)

    def refetch(rows: np.ndarray, fetch: int) -> None:
        nonlocal distance, hits
        again = _proposals(index, index_groups, queries[rows], query_groups[rows], rows, fetch, exact, k, with_ties,
                           chunk_size)
        distance, hits = _replace_rows(distance, hits, rows, *again[:2])
        last[rows], fetched[rows] = again[2], fetch

    def unsettled() -> np.ndarray:
        return np.flatnonzero(~((last >= n_index) | (last - error > distance[:, k - 1] + tolerance)))

    needed = np.minimum(n_index, k + margin + same_group_counts)
    short = np.flatnonzero(~np.isfinite(distance[:, k - 1]) & (needed > fetched))
    if short.size:
        refetch(short, int(needed[short].max()))
    for _ in range(_WIDER_FETCHES):
        unsure = unsettled()
        if not unsure.size:
            break
        refetch(unsure, int(min(n_index, _WIDER_FACTOR * fetched[unsure].max())))
    unsure = unsettled()
    if unsure.size:
        distance, hits = _replace_rows(distance, hits, unsure,
                                       *exact.nearest(unsure, query_groups[unsure], k, with_ties))
    return distance, hits


def _proposals(index: faiss.Index, index_groups: np.ndarray, queries: np.ndarray, query_groups: np.ndarray,
               query_positions: np.ndarray, fetch: int, exact: ExactRows, k: int, with_ties: bool,
               chunk_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """faiss's ``fetch`` best hits of other groups, of which those float32 cannot rule out are measured
    exactly and ranked (:func:`_sorted_hits`), and per query the float32 distance of the last hit
    fetched (``n_index`` — a sentinel above any distance — when every row was).

    A hit j is left out when its float32 distance f_j exceeds the query's k-th float32 distance f_k by
    more than twice :func:`float32_error_bound` (plus, ``with_ties``, the tie tolerance): each exact
    distance lies within the bound of its float32 one, so the k-th exact distance is at most f_k plus
    the bound, and hit j's exceeds it by more than the tie tolerance."""
    scores, positions = _search(index, queries, fetch, chunk_size)
    found = positions >= 0
    other = found & (index_groups[np.where(found, positions, 0)] != query_groups[:, None])
    approximate = np.where(other, 1.0 - scores.astype(np.float64), np.inf)
    kth = (np.partition(approximate, k - 1, axis=1)[:, k - 1] if approximate.shape[1] >= k
           else np.full(len(queries), np.inf))
    window = 2 * float32_error_bound(index.d) + (TIE_TOLERANCE if with_ties else 0.0)
    hits = np.where(other & (approximate <= (kth + window)[:, None]), positions, -1)
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
    != c) and one over its OS candidates (confounder c, biology != b) — on the CPU, where a level's
    blocks are small (:func:`_dense_levels`), its anchors instead take one dense product against the
    chunk's rows of that level (:func:`_typed_chunk_dense`); the k-NN search uses one index over the
    whole chunk. Each chunk's hits are exact (:func:`search_excluding_groups`) and merged into the
    running best, so the result is the exact search's whatever the chunking. The k-NN lists every
    neighbour tied with the k-th (:class:`Neighbours`).
    """
    rows = as_row_source(unit)
    n = len(rows)
    groups = np.asarray(groups)
    anchor_rows, anchor_features, anchor_unit, queries = _read_anchors(rows, anchors, candidate_rows)
    query_groups = groups[anchor_rows]
    n_groups = int(groups.max()) + 1 if n else 0
    blocks, dense = ([], {}) if m is None else _typed_plan(biology[anchor_rows], confounder[anchor_rows])
    typed = None if m is None else {kind: _no_hits(len(anchor_rows), m) for kind in ("so", "os")}
    knn_distance, knn_index = (None, None) if k is None else _no_hits(len(anchor_rows), k)
    for start in range(0, n, candidate_rows):
        chunk = np.arange(start, min(n, start + candidate_rows))
        # the chunk's float64 unit rows, normalised once for every search over it, and their float32 copy
        unit_rows = l2_normalise_exact(rows.take(chunk)) if anchor_unit is None else anchor_unit
        vectors = np.ascontiguousarray(unit_rows, dtype=np.float32) if anchor_unit is None else queries
        chunk_groups = groups[chunk]
        if any(dense.values()):
            _typed_chunk_dense(typed, dense, biology[anchor_rows], confounder[anchor_rows], query_groups, queries,
                               anchor_features, chunk, biology[chunk], confounder[chunk], chunk_groups, vectors,
                               unit_rows, m)
        for b, c, in_block in blocks:
            kinds = [kind for kind, level in (("so", b), ("os", c)) if level not in dense[kind]]
            if kinds:
                _typed_chunk(typed, kinds, in_block, biology[chunk] == b, confounder[chunk] == c, chunk, vectors,
                             chunk_groups, n_groups, queries[in_block], query_groups[in_block],
                             anchor_features[in_block], unit_rows, m, chunk_size)
        if k is not None:
            distance, hits = _search_subset(vectors, unit_rows, np.arange(len(chunk)), chunk_groups, n_groups,
                                            queries, anchor_features, query_groups, k, True, chunk_size)
            knn_distance, knn_index = _merge_hits(knn_distance, knn_index, distance,
                                                  np.where(hits >= 0, chunk[hits], -1), k, True)
    return (None if m is None else TypedNeighbours(so=typed["so"][0], os=typed["os"][0], so_index=typed["so"][1],
                                                   os_index=typed["os"][1]),
            None if k is None else Neighbours(index=knn_index, distance=knn_distance, k=k))


def _read_anchors(rows: RowSource, anchors: np.ndarray | None, candidate_rows: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """The anchors' row positions, their rows as stored, their float64 unit rows when every row is an
    anchor and one candidate chunk holds them all (normalised once for both roles, else None) and
    their float32 unit rows for faiss."""
    positions = np.arange(len(rows)) if anchors is None else np.asarray(anchors, dtype=np.int64)
    whole = anchors is None and isinstance(rows, ArrayRows)  # every row a query: read the array once
    features = rows.array if whole else rows.take(positions)
    unit = l2_normalise_exact(features) if anchors is None and len(rows) <= candidate_rows else None
    queries = l2_normalise(features) if unit is None else np.ascontiguousarray(unit, np.float32)
    return positions, features, unit, queries


def _typed_plan(biology: np.ndarray, confounder: np.ndarray
                ) -> tuple[list[tuple[object, object, np.ndarray]], dict[str, set]]:
    """The anchors' (biology, confounder) blocks (:func:`_anchor_blocks`) and, per kind (SO, OS), the
    levels searched by one dense product instead (:func:`_dense_levels`)."""
    return (_anchor_blocks(biology, confounder),
            {"so": _dense_levels(biology, confounder), "os": _dense_levels(confounder, biology)})


def _no_hits(n_queries: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Running best hits before any chunk: distances inf, row positions -1, (n_queries, width)."""
    return np.full((n_queries, width), np.inf), np.full((n_queries, width), -1, dtype=np.int64)


def _typed_chunk(typed: dict[str, tuple[np.ndarray, np.ndarray]], kinds: list[str], in_block: np.ndarray,
                 same_biology: np.ndarray, same_confounder: np.ndarray, chunk: np.ndarray, vectors: np.ndarray,
                 chunk_groups: np.ndarray, n_groups: int, queries: np.ndarray, query_groups: np.ndarray,
                 query_features: np.ndarray, unit_rows: np.ndarray, m: int, chunk_size: int) -> None:
    """Merge one candidate chunk's m nearest SO and OS hits (``kinds``) of the anchors ``in_block`` (one
    biology × confounder block) into ``typed`` (kind → running distances and rows), by faiss."""
    subsets = {"so": same_biology & ~same_confounder, "os": same_confounder & ~same_biology}
    for kind in kinds:
        candidates = subsets[kind]
        distance, hits = _search_subset(vectors, unit_rows, np.flatnonzero(candidates), chunk_groups, n_groups,
                                        queries, query_features, query_groups, m, False, chunk_size)
        best_distance, best_index = typed[kind]
        best_distance[in_block], best_index[in_block] = _merge_hits(
            best_distance[in_block], best_index[in_block], distance, np.where(hits >= 0, chunk[hits], -1), m, False)


def _dense_levels(level: np.ndarray, other: np.ndarray) -> set:
    """The levels (of biology for SO, of confounder for OS) whose typed search is one dense product
    (:func:`_typed_chunk_dense`) rather than a faiss search per anchor block: on the CPU, those whose
    anchors number fewer than :data:`_DENSE_BLOCK_ANCHORS` per block (per level of ``other``) on
    average, where a faiss search per block is a thin product and an index copy each. Both give the
    same hits; on a GPU every search is faiss's."""
    if faiss.get_num_gpus() > 0:
        return set()
    chosen = set()
    for value in np.unique(level):
        mine = level == value
        if np.count_nonzero(mine) < _DENSE_BLOCK_ANCHORS * len(np.unique(other[mine])):
            chosen.add(value)
    return chosen


def _typed_chunk_dense(typed: dict[str, tuple[np.ndarray, np.ndarray]], dense: dict[str, set],
                       anchor_biology: np.ndarray, anchor_confounder: np.ndarray, query_groups: np.ndarray,
                       queries: np.ndarray, query_features: np.ndarray, chunk: np.ndarray,
                       chunk_biology: np.ndarray, chunk_confounder: np.ndarray, chunk_groups: np.ndarray,
                       vectors: np.ndarray, unit_rows: np.ndarray, m: int) -> None:
    """Merge one candidate chunk's m nearest SO and OS hits of the anchors of the ``dense`` levels
    (kind → levels) into ``typed``: the SO search of biology b takes its anchors against the chunk's
    rows of biology b, leaving out those of the anchor's confounder; the OS search of confounder c
    its anchors against the rows of confounder c, leaving out those of the anchor's biology (both
    leave out the anchor's group). The same hits as the per-block faiss searches of
    :func:`_typed_chunk`, in a few large products."""
    searches = (("so", anchor_biology, chunk_biology, anchor_confounder, chunk_confounder),
                ("os", anchor_confounder, chunk_confounder, anchor_biology, chunk_biology))
    for kind, anchor_level, chunk_level, anchor_other, chunk_other in searches:
        best_distance, best_index = typed[kind]
        for level in sorted(dense[kind]):
            anchors, subset = np.flatnonzero(anchor_level == level), np.flatnonzero(chunk_level == level)
            if not subset.size:
                continue
            exact = ExactRows(query_features, unit_rows, chunk_groups[subset], subset)
            distance, hits = _dense_search(queries, anchors, vectors[subset], exact, m,
                                           (anchor_other[anchors], chunk_other[subset]),
                                           (query_groups[anchors], chunk_groups[subset]))
            best_distance[anchors], best_index[anchors] = _merge_hits(
                best_distance[anchors], best_index[anchors], distance,
                np.where(hits >= 0, chunk[subset[np.maximum(hits, 0)]], -1), m, False)


def _dense_search(queries: np.ndarray, anchors: np.ndarray, candidates: np.ndarray, exact: ExactRows, k: int,
                  *excluding: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest ``candidates`` (float32 unit rows) of the queries ``queries[anchors]`` by exact
    distance, leaving out every candidate that shares a label with the query in any ``excluding``
    pair (the queries' labels, the candidates' labels). Every candidate's float32 distance is formed
    (a float32 matrix product, a block of queries at a time), so only those float32 cannot rule out —
    within twice :func:`float32_error_bound` of the query's k-th float32 distance — are measured by
    ``exact`` (:meth:`ExactRows.pairs`). Returns (distances inf-padded, positions in ``candidates``
    -1-padded), (len(anchors), k)."""
    error = float32_error_bound(candidates.shape[1])
    n_candidates = len(candidates)
    take = min(k, n_candidates)
    block = max(1, _BRUTE_BLOCK_BYTES // (4 * max(1, n_candidates)))
    parts = []
    for start in range(0, len(anchors), block):
        rows = anchors[start:start + block]
        similarity = queries[rows] @ candidates.T
        left_out = np.zeros(similarity.shape, dtype=bool)
        for query_labels, candidate_labels in excluding:
            left_out |= query_labels[start:start + block, None] == candidate_labels[None, :]
        similarity[left_out] = -np.inf
        # the take-th largest similarity: the k-th float32 distance is 1 - kth (exact in float64)
        kth = np.partition(similarity, n_candidates - take, axis=1)[:, n_candidates - take].astype(np.float64)
        positions = _packed(~left_out & (similarity >= (kth - 2 * error)[:, None]), take)
        parts.append(_sorted_hits(exact.pairs(rows, positions), positions, k, False))
    return _stack_padded(parts, len(anchors), k)


def _anchor_blocks(biology: np.ndarray, confounder: np.ndarray) -> list[tuple[object, object, np.ndarray]]:
    """(biology b, confounder c, positions of the anchors in that block) for every block present."""
    blocks = np.unique(np.stack([biology, confounder]), axis=1).T
    return [(b, c, np.flatnonzero((biology == b) & (confounder == c))) for b, c in blocks]


def _search_subset(vectors: np.ndarray, unit_rows: np.ndarray, subset: np.ndarray, subset_groups: np.ndarray,
                   n_groups: int, queries: np.ndarray, query_features: np.ndarray, query_groups: np.ndarray, k: int,
                   with_ties: bool, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest other-group hits among the chunk's rows ``subset`` (``vectors``: the chunk's
    float32 unit rows for faiss, ``unit_rows`` its float64 ones; ``queries`` float32 unit rows,
    ``query_features`` the same rows as read): (distances inf-padded, positions in the chunk
    -1-padded)."""
    if subset.size == 0 or len(queries) == 0:
        return np.full((len(queries), k), np.inf), np.full((len(queries), k), -1, dtype=np.int64)
    candidate_groups = subset_groups[subset]
    same_group = np.bincount(candidate_groups, minlength=n_groups)[query_groups]
    whole = subset.size == len(vectors)  # subsets are sorted and unique
    indexed = vectors if whole else vectors[subset]
    exact = ExactRows(query_features, unit_rows, candidate_groups, None if whole else subset)
    distance, hits = search_excluding_groups(_flat_index(indexed), candidate_groups, queries, query_groups, k,
                                             same_group, exact, with_ties=with_ties, chunk_size=chunk_size)
    return distance, np.where(hits >= 0, subset[hits], -1)


def _merge_hits(distance: np.ndarray, index: np.ndarray, new_distance: np.ndarray, new_index: np.ndarray, k: int,
                with_ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of two hit lists per row (equal distances by row index), and — ``with_ties`` —
    every hit tied with the k-th."""
    return _sorted_hits(np.concatenate([distance, new_distance], axis=1), np.concatenate([index, new_index], axis=1),
                        k, with_ties)
