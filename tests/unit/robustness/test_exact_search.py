"""The exact search measures in float64 only what float32 cannot decide, and its result is a function of
the rows alone: every margin and distance is a float64 brute force's (within 1e-9), and neither the
batching of queries, candidates or pairs, nor which engine served a typed search (a faiss index per
block or one dense product per level), nor how far faiss fetched changes a bit (docs/decisions/0039)."""

from __future__ import annotations

import numpy as np
import pytest

from cellpath.robustness import neighbours, score_embeddings
from cellpath.robustness.metrics import croma_margins
from cellpath.robustness.neighbours import l2_normalise_exact, scan_neighbours


#: ``plain``: distinct rows; ``duplicated``: every cell of a patch shares one vector (the Mean readout);
#: ``near``: rows 1e-3 apart around one vector, whose distances (about 1e-6) all lie within float32's
#: error of one another, so that faiss's proposals are fetched wider and then replaced by brute force.
KINDS = ("plain", "duplicated", "near")


def _panel(kind: str = "plain", n: int = 1200, d: int = 48, seed: int = 0):
    """Skewed cell types over 6 sections, patches of 8 inside a section, a section effect as large as
    the type effect (see :data:`KINDS`)."""
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(-(-n // 8)), 8)[:n]
    section = rng.integers(0, 6, group.max() + 1)[group]
    cell_type = rng.choice(5, size=n, p=[0.4, 0.25, 0.2, 0.1, 0.05])
    x = (rng.standard_normal((5, d))[cell_type] + rng.standard_normal((6, d))[section]
         + 0.5 * rng.standard_normal((group.max() + 1, d))[group] + 1.2 * rng.standard_normal((n, d)))
    if kind == "duplicated":
        first = np.r_[0, np.flatnonzero(np.diff(group)) + 1]
        x = x[first][group]
    elif kind == "near":
        x = rng.standard_normal(d) + 1e-3 * x
    return x.astype(np.float32), cell_type, section, group


def _brute_force(x, cell_type, section, group, m: int, k: int):
    """Every float64 distance, own group excluded: the m nearest SO / OS distances and the k nearest
    other-group distances of every row."""
    unit = l2_normalise_exact(x)
    distance = np.clip(1.0 - unit @ unit.T, 0.0, 2.0)
    distance[group[:, None] == group[None, :]] = np.inf
    same_type, same_section = cell_type[:, None] == cell_type[None, :], section[:, None] == section[None, :]
    so = np.sort(np.where(same_type & ~same_section, distance, np.inf), axis=1)[:, :m]
    os_ = np.sort(np.where(~same_type & same_section, distance, np.inf), axis=1)[:, :m]
    return so, os_, np.sort(distance, axis=1)[:, :k]


@pytest.mark.parametrize("kind", KINDS)
def test_margins_and_distances_are_a_float64_brute_force(kind):
    x, cell_type, section, group = _panel(kind)
    so, os_, knn = _brute_force(x, cell_type, section, group, 5, 31)
    typed, neighbours_found = scan_neighbours(x, group, cell_type, section, m=5, k=31)
    np.testing.assert_allclose(typed.so, so, rtol=0, atol=1e-9)
    np.testing.assert_allclose(typed.os, os_, rtol=0, atol=1e-9)
    np.testing.assert_allclose(neighbours_found.distance[:, :31], knn, rtol=0, atol=1e-9)
    margins, reference = croma_margins(typed.so, typed.os).values, croma_margins(so, os_).values
    assert np.isfinite(reference).mean() > 0.9
    np.testing.assert_allclose(margins, reference, rtol=0, atol=1e-9, equal_nan=True)


def _everything(x, cell_type, section, group, **kwargs):
    typed, knn = scan_neighbours(x, group, cell_type, section, m=5, k=21, **kwargs)
    anchors = np.arange(1, len(x), 5)
    typed_a, knn_a = scan_neighbours(x, group, cell_type, section, m=5, k=11, anchors=anchors, **kwargs)
    scores = score_embeddings(x, cell_type, section, group, m=5, **kwargs)
    return [typed.so, typed.os, typed.so_index, typed.os_index, knn.distance, knn.index, typed_a.so, typed_a.os,
            typed_a.so_index, knn_a.distance, knn_a.index, scores.margins, scores.ri_samples, scores.mari_samples,
            np.array([scores.k, scores.ri, scores.mari, scores.bio_bacc, scores.conf_bacc, scores.ltm])]


@pytest.mark.parametrize("kind", KINDS)
def test_no_batching_or_engine_changes_a_bit(monkeypatch, kind):
    x, cell_type, section, group = _panel(kind, n=600, seed=1)
    reference = _everything(x, cell_type, section, group)
    settings = [
        ({"chunk_size": 7}, {}),  # queries per faiss call
        ({"candidate_rows": 97}, {}),  # candidate chunks
        ({"candidate_rows": 400, "chunk_size": 50}, {"_PAIR_BLOCK_BYTES": 40_000, "_BRUTE_BLOCK_BYTES": 60_000}),
        ({}, {"_DENSE_BLOCK_ANCHORS": 0}),  # every typed search a faiss index per block
        ({}, {"_DENSE_BLOCK_ANCHORS": 10**9}),  # every typed search one dense product per level
        ({}, {"_FETCH_MARGIN": 0, "_WIDER_FETCHES": 0}),  # the least fetched: more brute force
        ({}, {"_FETCH_MARGIN": 200}),  # far more fetched than needed
        ({}, {"_SERIAL_SEARCH_WORK": 0}),  # faiss on every thread it has
    ]
    for kwargs, constants in settings:
        with monkeypatch.context() as patch:
            for name, value in constants.items():
                patch.setattr(neighbours, name, value)
            got = _everything(x, cell_type, section, group, **kwargs)
        for position, (a, b) in enumerate(zip(got, reference)):
            assert a.shape == b.shape, (kwargs, constants, position)
            np.testing.assert_array_equal(a, b, err_msg=f"{kwargs} {constants} array {position}")


def test_only_what_float32_cannot_decide_is_measured_in_float64(monkeypatch):
    """Per query and search, about k pairs are measured exactly (the k nearest and the few within
    float32's error of the k-th), not every hit faiss fetched; and the rows are normalised once per
    candidate chunk, not again for every block of pairs."""
    x, cell_type, section, group = _panel(n=1500, seed=2)
    measured, normalised = [], []
    pairs, unit = neighbours.ExactRows.pairs, neighbours.l2_normalise_exact
    monkeypatch.setattr(neighbours.ExactRows, "pairs",
                        lambda self, q, hits: measured.append(((hits >= 0).sum(), len(hits))) or pairs(self, q, hits))
    monkeypatch.setattr(neighbours, "l2_normalise_exact", lambda rows: normalised.append(len(rows)) or unit(rows))
    scan_neighbours(x, group, cell_type, section, m=5, k=21)
    n_pairs, n_queries = np.sum(measured, axis=0)
    assert n_queries == 3 * len(x)  # every anchor once in the SO, the OS and the k-NN search
    assert n_pairs < 1.2 * len(x) * (5 + 5 + 21)
    # the candidate rows once (one chunk), then only the query rows, each once per block of pairs it is in
    assert normalised[0] == len(x) and sum(normalised[1:]) < n_queries + len(normalised)
