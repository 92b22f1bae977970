"""Features read in chunks from a row source (the memory-mapped store): the same exact search, margin
sweep and shortcut probe as in memory, never more than one chunk read at a time, bad rows counted
across chunks (docs/decisions/0027)."""

from __future__ import annotations

import numpy as np
import pytest

from cellpath.robustness import score_embeddings, shortcut_sweep
from cellpath.robustness.neighbours import RowSource, l2_normalise, scan_neighbours
from cellpath.robustness.sensitivity import margin_sweep


def _panel(n: int = 1500, d: int = 24, seed: int = 0):
    """Cell types x sections with patches of 6 cells inside a section (float16, as the store holds them)."""
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(-(-n // 6)), 6)[:n]
    section = rng.integers(0, 4, group.max() + 1)[group]
    cell_type = rng.integers(0, 5, n)
    x = (rng.standard_normal((5, d))[cell_type] + 0.9 * rng.standard_normal((4, d))[section]
         + 0.4 * rng.standard_normal((group.max() + 1, d))[group] + 1.2 * rng.standard_normal((n, d)))
    return x.astype(np.float16), cell_type, section, group


class MemmapRows(RowSource):
    """A float16 file on disk read through np.memmap, recording the size of every read."""

    def __init__(self, path, array: np.ndarray):
        array.tofile(path)
        self.store = np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.store)

    def take(self, rows: np.ndarray) -> np.ndarray:
        self.reads.append(len(rows))
        return np.asarray(self.store[rows], dtype=np.float32)


@pytest.mark.parametrize("candidate_rows", [97, 500, 4096])
def test_chunked_scan_is_the_in_memory_search(candidate_rows):
    x, cell_type, section, group = _panel()
    unit = l2_normalise(x.astype(np.float32))
    whole_typed, whole_knn = scan_neighbours(unit, group, cell_type, section, m=5, k=15, candidate_rows=len(x))
    typed, knn = scan_neighbours(unit, group, cell_type, section, m=5, k=15, candidate_rows=candidate_rows)
    np.testing.assert_array_equal(typed.so, whole_typed.so)
    np.testing.assert_array_equal(typed.os, whole_typed.os)
    np.testing.assert_array_equal(knn.distance, whole_knn.distance)
    # equal distances may swap positions between chunkings; every distance above is equal already
    assert (knn.index == whole_knn.index).mean() > 0.999


def test_scores_from_a_memory_mapped_source_equal_the_array(tmp_path):
    x, cell_type, section, group = _panel()
    anchors = np.sort(np.random.default_rng(1).choice(len(x), 300, replace=False))
    source = MemmapRows(tmp_path / "features.f16", x)
    streamed = score_embeddings(source, cell_type, section, group, m=5, k=11, anchors=anchors, candidate_rows=256)
    in_memory = score_embeddings(x.astype(np.float32), cell_type, section, group, m=5, k=11, anchors=anchors)
    np.testing.assert_allclose(streamed.margins, in_memory.margins, rtol=0, atol=1e-6)
    for name in ("median", "f0", "ltm", "ri", "mari", "bio_bacc", "conf_bacc"):
        assert getattr(streamed, name) == pytest.approx(getattr(in_memory, name), abs=1e-6), name
    # bounded: the anchors once, then candidate chunks of at most 256 rows (the checks, then the scan)
    assert max(source.reads) == 300 and sorted(source.reads)[-2] <= 256
    assert sum(r for r in source.reads if r <= 256) == 2 * len(x)


def test_margin_sweep_reads_a_source_like_an_array(tmp_path):
    x, cell_type, section, group = _panel(900, seed=2)
    source = MemmapRows(tmp_path / "features.f16", x)
    streamed = margin_sweep(source, cell_type, section, group, [1, 5, 9], candidate_rows=128)
    in_memory = margin_sweep(x.astype(np.float32), cell_type, section, group, [1, 5, 9])
    np.testing.assert_allclose(streamed[["croma_median", "f0", "ltm"]], in_memory[["croma_median", "f0", "ltm"]],
                               atol=1e-6)


def test_non_finite_rows_are_counted_across_every_chunk(tmp_path):
    x, cell_type, section, group = _panel(600, seed=3)
    x[[5, 250, 599]] = np.nan
    with pytest.raises(ValueError, match="NaN or inf in 3 of 600 rows"):
        score_embeddings(MemmapRows(tmp_path / "bad.f16", x), cell_type, section, group, m=3, k=5,
                         candidate_rows=100)


def test_shortcut_sweep_from_a_source_equals_the_array_and_reads_held_out_rows_in_chunks(tmp_path):
    rng = np.random.default_rng(4)
    n = 1200
    section = np.repeat([0, 1, 2, 3], n // 4)
    cell_type = rng.integers(0, 2, n)
    x = (rng.standard_normal((n, 6)) + np.c_[0.9 * cell_type, 3.0 * (section == 1)]
         .repeat(3, axis=1)).astype(np.float16)
    groups = np.arange(n) // 4
    kwargs = dict(pool_size=160, train_confounders=[0, 1], n_runs=2, seed=1, c_grid=(0.1, 1.0))
    source = MemmapRows(tmp_path / "features.f16", x)
    streamed = shortcut_sweep(source, cell_type, section, groups, chunk_rows=150, **kwargs)
    in_memory = shortcut_sweep(x.astype(np.float32), cell_type, section, groups, **kwargs)
    np.testing.assert_array_equal(streamed.in_domain, in_memory.in_domain)
    np.testing.assert_array_equal(streamed.held_out, in_memory.held_out)
    assert streamed.held_out.shape == (len(streamed.cramers_v), 2)
    held_out_reads = source.reads[-(n // 2 // 150):]  # sections 2 and 3, after every fit
    assert held_out_reads == [150] * (n // 2 // 150)


@pytest.mark.parametrize("candidate_rows", [97, 4096])
def test_typed_neighbour_rows_are_the_brute_force_nearest_of_their_type(candidate_rows):
    """The rows a margin was decided by: for every anchor, the m nearest SO (same type, other section)
    and OS (other type, same section) candidates outside its patch, as a dense n x n search finds them."""
    x, cell_type, section, group = _panel(n=600)
    unit = l2_normalise(x.astype(np.float32))
    typed, _ = scan_neighbours(unit, group, cell_type, section, m=5, candidate_rows=candidate_rows)
    distance = np.clip(1.0 - unit.astype(np.float64) @ unit.T.astype(np.float64), 0.0, 2.0)
    for i in range(len(x)):
        other_group = group != group[i]
        for kind, allowed in (("so", (cell_type == cell_type[i]) & (section != section[i])),
                              ("os", (cell_type != cell_type[i]) & (section == section[i]))):
            rows, distances = getattr(typed, f"{kind}_index")[i], getattr(typed, kind)[i]
            candidates = np.flatnonzero(allowed & other_group)
            expected = np.sort(distance[i, candidates])[:5]
            np.testing.assert_allclose(distances, expected, atol=1e-5)
            assert np.isin(rows, candidates).all()  # the right type, never the anchor's own patch
            np.testing.assert_allclose(distance[i, rows], distances, atol=1e-5)  # each row is at its distance
