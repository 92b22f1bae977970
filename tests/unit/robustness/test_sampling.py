"""The panel-scale estimator: stratified anchors searched against every candidate, bootstrap intervals."""

from __future__ import annotations

import numpy as np
import pytest

from cellpath.robustness import score_embeddings
from cellpath.robustness.sampling import INTERVAL_METRICS, bootstrap_intervals, stratified_anchors


def _embedding(n: int, seed: int = 0):
    """Three cell types, four sections (a confounder shift), groups of five cells."""
    rng = np.random.default_rng(seed)
    biology = rng.integers(0, 3, n)
    confounder = rng.integers(0, 4, n)
    centres, shifts = rng.normal(size=(3, 16)), rng.normal(size=(4, 16)) * 0.8
    x = centres[biology] + shifts[confounder] + rng.normal(size=(n, 16)) * 1.2
    return x.astype(np.float32), biology, confounder, np.arange(n) // 5


def test_anchors_are_proportional_per_stratum_and_seeded():
    strata = np.repeat(["a", "b", "c", "d"], [700, 200, 95, 5])
    anchors = stratified_anchors(strata, 100, seed=3)
    assert len(anchors) == 100 == len(np.unique(anchors)) and (np.diff(anchors) > 0).all()
    counts = {s: int((strata[anchors] == s).sum()) for s in "abcd"}
    assert counts == {"a": 70, "b": 20, "c": 9, "d": 1}  # 9.5 and 0.5: the larger remainder first, d its floor of 1
    np.testing.assert_array_equal(anchors, stratified_anchors(strata, 100, seed=3))
    assert not np.array_equal(anchors, stratified_anchors(strata, 100, seed=4))
    np.testing.assert_array_equal(stratified_anchors(strata, 5000, seed=0), np.arange(1000))


def test_an_anchor_scores_exactly_as_in_the_full_computation():
    x, biology, confounder, group = _embedding(1500)
    full = score_embeddings(x, biology, confounder, group, k=10)
    anchors = stratified_anchors(biology * 10 + confounder, 300, seed=0)
    sampled = score_embeddings(x, biology, confounder, group, k=10, anchors=anchors)
    np.testing.assert_array_equal(sampled.anchors, anchors)
    np.testing.assert_allclose(sampled.margins, full.margins[anchors], rtol=0, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(sampled.ri_samples, full.ri_samples[anchors], atol=1e-12, equal_nan=True)
    every = score_embeddings(x, biology, confounder, group, k=10, anchors=np.arange(1500))
    for name in ("croma_median", "f0", "ltm", "ri", "mari", "bio_bacc", "conf_bacc"):
        assert every.summary()[name] == pytest.approx(full.summary()[name], abs=1e-12)


def test_the_pooled_ratio_parts_reproduce_ri_and_mari():
    x, biology, confounder, group = _embedding(800, seed=1)
    scores = score_embeddings(x, biology, confounder, group, k=7)
    for value, (so, typed) in ((scores.ri, scores.ri_parts), (scores.mari, scores.mari_parts)):
        assert so.sum() / typed.sum() == pytest.approx(value, rel=1e-12)


def test_intervals_cover_the_full_values():
    """Over 20 anchor draws, each metric's 95 % interval from 400 of 3,000 anchors holds the
    full-panel value at least 17 times (a biased estimator or a too-narrow interval fails this)."""
    x, biology, confounder, group = _embedding(3000, seed=2)
    full = score_embeddings(x, biology, confounder, group, k=10).summary()
    strata = biology * 10 + confounder
    covered = {name: 0 for name in INTERVAL_METRICS}
    widths = {name: [] for name in INTERVAL_METRICS}
    for draw in range(20):
        anchors = stratified_anchors(strata, 400, seed=draw)
        sampled = score_embeddings(x, biology, confounder, group, k=10, anchors=anchors)
        intervals = bootstrap_intervals(sampled, strata[anchors], n_boot=200, seed=draw)
        for name, interval in intervals.items():
            covered[name] += interval.low <= full[name] <= interval.high
            widths[name].append(interval.high - interval.low)
    assert all(count >= 17 for count in covered.values()), covered
    assert all(0 < np.median(w) < 0.3 for w in widths.values()), widths
