"""Every robustness statistic has exactly one value: tied neighbours share the k-th place, distances
are exact where they are tiny, and neither the order of the cells nor the chunking changes a bit
(docs/decisions/0039-tie-rules.md)."""

from __future__ import annotations

import croma
import numpy as np
import pandas as pd
import pytest

from cellpath.robustness import score_embeddings
from cellpath.robustness.metrics import knn_balanced_accuracy, lower_tail, rank_weights, robustness_index
from cellpath.robustness.neighbours import l2_normalise, l2_normalise_exact, scan_neighbours
from cellpath.robustness.sensitivity import margin_sweep, tail_sweep
from cellpath.robustness.summary import (SHORTCUT_SUMMARY_COLUMNS, condition_metrics, robustness_metrics,
                                         sensitivity_table)
from cellpath.vocabulary import HEADLINE_READOUT, HEADLINE_TAXONOMY

SCALARS = ("k", "ri", "mari", "support", "tau", "bio_bacc", "conf_bacc", "median", "f0", "ltm", "q_alpha")


def _duplicated_panel(n: int = 720, seed: int = 0):
    """Patches of 6 cells whose vectors are drawn from 60 prototypes — 10 per cell type, whatever the
    section, and 20 shared by every type — so that many cells of other patches share a cell's vector
    exactly (as every cell of a patch shares the Mean readout)."""
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(n // 6), 6)
    section = rng.integers(0, 3, n // 6)[group]
    cell_type = rng.integers(0, 4, n)
    prototypes = rng.standard_normal((60, 16)).astype(np.float32)
    own = rng.random(n) < 0.6
    x = prototypes[np.where(own, cell_type * 10 + rng.integers(0, 10, n), rng.integers(40, 60, n))]
    return x, cell_type, section, group


def test_rank_weights_share_the_kth_place_among_ties():
    distance = np.array([[0.1, 0.2, 0.2, 0.2, 0.5], [0.1, 0.2, 0.3, np.inf, np.inf], [0.4, np.inf, np.inf, np.inf, np.inf]])
    numerator, denominator = rank_weights(distance, 2)
    np.testing.assert_array_equal(numerator, [[3, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(denominator, [3, 1, 1])
    numerator, denominator = rank_weights(distance, 3)  # two places left for the three tied at 0.2
    np.testing.assert_array_equal(numerator[0], [3, 2, 2, 2, 0])
    assert denominator[0] == 3


def test_ri_and_knn_votes_on_a_hand_tie():
    biology = np.array([0, 0, 1, 0, 1])
    confounder = np.array([0, 1, 0, 1, 1])
    # anchor 0 (b0, c0): 1 SO at 0.1, then 3 (SO) and 2 (OS) tied at 0.3, 4 (OO) at 0.3 too
    index = np.array([[1, 3, 2, 4]])
    distance = np.array([[0.1, 0.3, 0.3, 0.3]])
    ri = robustness_index(index, distance, biology, confounder, 2, anchor_rows=np.array([0]))
    # one place left for three tied: SO 1 + 1/3, OS 1/3
    assert ri.value == pytest.approx((4 / 3) / (5 / 3), abs=1e-15)
    swapped = robustness_index(index[:, [0, 3, 1, 2]], distance, biology, confounder, 2, anchor_rows=np.array([0]))
    assert swapped.value == ri.value
    # votes, anchor 0 of label 0: its nearest is label 0; at k=2 the three tied (all label 1)
    # share one place: 1 against 3 x 1/3 = 1, a tie, to the smaller label 0 -> right
    labels = np.array([0, 0, 1, 1, 1])
    assert knn_balanced_accuracy(index, distance, labels, [1, 2], anchor_rows=np.array([0])) == {1: 1.0, 2: 1.0}
    # anchor 0 of label 1, its nearest label 0, the three tied label 1: at k=2, 1 against 1 -> label 0,
    # wrong; at k=3 they share two places, 1 against 3 x 2/3 = 2 -> label 1, right
    labels = np.array([1, 0, 1, 1, 1])
    assert knn_balanced_accuracy(index, distance, labels, [2, 3], anchor_rows=np.array([0])) == {2: 0.0, 3: 1.0}


def _ri_brute_force(x: np.ndarray, biology, confounder, group, k: int) -> float:
    """An independent RI with the fractional tie rule: every float64 distance, own group excluded,
    the neighbours at the k-th distance sharing the places left."""
    unit = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    distance = np.clip(1.0 - unit @ unit.T, 0.0, 2.0)
    distance[group[:, None] == group[None, :]] = np.inf
    so_total = typed_total = 0.0
    for i in range(len(x)):
        kth = np.sort(distance[i])[k - 1]
        nearer, tied = distance[i] < kth - 1e-12, np.abs(distance[i] - kth) <= 1e-12
        weight = nearer + tied * (k - nearer.sum()) / tied.sum()
        so = (biology == biology[i]) & (confounder != confounder[i])
        os_ = (biology != biology[i]) & (confounder == confounder[i])
        so_total += weight[so].sum()
        typed_total += weight[so | os_].sum()
    return so_total / typed_total


def test_duplicate_vectors_give_one_value_whatever_the_order_and_chunking():
    x, cell_type, section, group = _duplicated_panel()
    whole = score_embeddings(x, cell_type, section, group, m=5)
    typed, knn = scan_neighbours(x, group, cell_type, section, m=5, k=whole.k)
    kth = knn.distance[:, whole.k - 1]
    assert np.mean(knn.distance[:, whole.k] == kth) > 0.5  # ties at the k-th place are common here
    assert whole.ri == pytest.approx(_ri_brute_force(x, cell_type, section, group, whole.k), abs=1e-12)
    rng = np.random.default_rng(7)
    for _ in range(3):
        order = rng.permutation(len(x))
        permuted = score_embeddings(x[order], cell_type[order], section[order], group[order], m=5)
        for name in SCALARS:
            assert getattr(permuted, name) == getattr(whole, name), name
        np.testing.assert_array_equal(permuted.margins, whole.margins[order])
        np.testing.assert_array_equal(permuted.ri_samples, whole.ri_samples[order])
        np.testing.assert_array_equal(permuted.mari_samples, whole.mari_samples[order])
        assert permuted.bio_bacc_by_k == whole.bio_bacc_by_k
    chunked = score_embeddings(x, cell_type, section, group, m=5, candidate_rows=97)
    for name in SCALARS:
        assert getattr(chunked, name) == getattr(whole, name), name
    np.testing.assert_array_equal(chunked.margins, whole.margins)


def test_relabelled_levels_keep_the_vote_tie_rule():
    """Label codes follow the sorted label values, not their first appearance."""
    x, cell_type, section, group = _duplicated_panel()
    names = np.array(["stroma", "immune", "epithelial", "endothelial"])[cell_type]
    order = np.argsort(-cell_type, kind="stable")  # another type appears first
    first = score_embeddings(x, names, section, group, m=5)
    second = score_embeddings(x[order], names[order], section[order], group[order], m=5)
    assert (first.k, first.bio_bacc, first.conf_bacc) == (second.k, second.bio_bacc, second.conf_bacc)


def test_margins_of_near_duplicates_match_a_float64_brute_force():
    """Vectors 1e-3 apart (relative): cosine distances about 1e-7, where float32 products err by
    about as much; the margins must agree with float64 to 1e-6."""
    rng = np.random.default_rng(3)
    n = 480
    group = np.repeat(np.arange(n // 4), 4)
    section = rng.integers(0, 3, n // 4)[group]
    cell_type = rng.integers(0, 3, n)
    base = rng.standard_normal(64)
    x = (base + 1e-3 * (rng.standard_normal((3, 64))[cell_type] + rng.standard_normal((3, 64))[section]
                        + rng.standard_normal((n, 64)))).astype(np.float32)
    ours = score_embeddings(x, cell_type, section, group, m=5, k=11)
    manifest = pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "image_path": "none",
                             "label": [f"b{v}" for v in cell_type], "group_id": [f"g{v}" for v in group],
                             "section": [f"c{v}" for v in section]})
    reference = croma.CRoMa.compute(x.astype(np.float64), manifest, confounder_column="section", m=5)
    assert np.max(np.abs(ours.margins - reference.sample_values)) < 1e-6
    assert np.median(np.abs(reference.sample_values)) > 1e-2  # the margins are not all near zero


def test_ltm_includes_every_margin_tied_at_the_quantile():
    values = np.array([-0.5, -0.3, -0.3, -0.3, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6,
                       0.6, 0.7, 0.7, 0.8, 0.8, 0.9, 0.9, 0.9, 0.95, np.nan])
    tail = lower_tail(values, 0.10)  # 19 defined; Q at position 1.8 of the sorted values: -0.3
    assert (tail.q_alpha, tail.n_tail) == (-0.3, 4)
    assert tail.ltm == pytest.approx(-0.35, abs=1e-15)  # (-0.5 - 0.3 - 0.3 - 0.3) / 4, not the worst 2
    defined = np.sort(values[np.isfinite(values)])  # the definition, written out
    q = np.percentile(defined, 10)
    assert (tail.q_alpha, tail.ltm) == pytest.approx((q, defined[defined <= q].mean()), abs=1e-15)
    rng = np.random.default_rng(0)
    many = rng.choice(np.linspace(-1, 1, 37), 5000)  # ties everywhere
    for _ in range(3):
        assert lower_tail(rng.permutation(many)) == lower_tail(many)


def test_small_norm_rows_have_the_distances_of_the_unscaled_rows():
    """Rows are divided by their norm, nothing added: rows scaled by 1e-6 or 1e-9 (a filter bank's
    small norms) keep their float64 distances to rounding, where croma's ``norm + 1e-12`` would move
    them by far more than the tie tolerance; a zero row stays zero (cosine 0 to every row)."""
    rng = np.random.default_rng(5)
    n = 240
    group = np.repeat(np.arange(n // 4), 4)
    section = rng.integers(0, 3, n // 4)[group]
    cell_type = rng.integers(0, 3, n)
    x = rng.standard_normal((3, 16))[cell_type] + rng.standard_normal((n, 16))
    typed, knn = scan_neighbours(x, group, cell_type, section, m=5, k=11)
    for scale in (1e-6, 1e-9):
        small = x * scale
        np.testing.assert_allclose(l2_normalise_exact(small), l2_normalise_exact(x), rtol=0, atol=1e-15)
        small_typed, small_knn = scan_neighbours(small, group, cell_type, section, m=5, k=11)
        for got, want in ((small_typed.so, typed.so), (small_typed.os, typed.os), (small_knn.distance, knn.distance)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
        biased = small / (np.linalg.norm(small, axis=1, keepdims=True) + 1e-12)  # croma's convention
        assert np.max(np.abs(biased @ biased.T - l2_normalise_exact(x) @ l2_normalise_exact(x).T)) > 1e-9
    with_zero = x.copy()
    with_zero[0] = 0.0
    unit = l2_normalise_exact(with_zero)
    assert np.all(unit[0] == 0.0) and np.isfinite(unit).all() and np.all(l2_normalise(with_zero)[0] == 0.0)
    zero_typed, zero_knn = scan_neighbours(with_zero, group, cell_type, section, m=5, k=11)
    assert np.all(zero_typed.so[0] == 1.0) and np.all(zero_typed.os[0] == 1.0)
    assert np.all(zero_knn.distance[0][np.isfinite(zero_knn.distance[0])] == 1.0)
    np.testing.assert_allclose(zero_typed.so[1:], scan_neighbours(with_zero[1:], group[1:], cell_type[1:], section[1:],
                                                                  m=5)[0].so, rtol=0, atol=0)


def test_n_tail_is_written_beside_ltm():
    """How many margins LTM averages (every one at or below the quantile, so more than 10 % when
    margins tie there) is in the summary row, the sweeps, the MLflow metrics and robustness_metrics.json."""
    x, cell_type, section, group = _duplicated_panel()
    result = score_embeddings(x, cell_type, section, group, m=5)
    tail = lower_tail(result.margins, result.alpha)
    defined = result.margins[np.isfinite(result.margins)]
    assert result.n_tail == tail.n_tail == int(np.sum(defined <= result.q_alpha))
    row = result.summary()
    keys = list(row)
    assert row["n_tail"] == result.n_tail and keys.index("n_tail") == keys.index("ltm") + 1
    condition = {"model": "a", "magnification": "20x", "readout": HEADLINE_READOUT, "taxonomy": HEADLINE_TAXONOMY,
                 "scope": "panel", "unit": "panel", "confounder": "section_id"}
    assert condition_metrics({**condition, **row}, pd.DataFrame())["n_tail"] == result.n_tail
    summary = pd.DataFrame([{**condition, **row}])
    metrics = robustness_metrics(summary, pd.DataFrame(columns=SHORTCUT_SUMMARY_COLUMNS), "20x")["a"]
    labels = list(metrics)
    assert metrics["LTM10 n_tail"] == result.n_tail and isinstance(metrics["LTM10 n_tail"], int)
    assert labels.index("LTM10 n_tail") == labels.index("LTM10") + 1
    sweep = tail_sweep(result.margins, [0.02, 0.1, 0.2]).set_index("value")
    assert sweep.loc[0.1, "n_tail"] == result.n_tail and sweep.loc[0.1, "ltm"] == result.ltm
    assert [lower_tail(result.margins, a).n_tail for a in (0.02, 0.2)] == sweep.loc[[0.02, 0.2], "n_tail"].tolist()
    # 21 margins are exactly -1 (a duplicated OS neighbour), all at the 2 % quantile: more than 2 % in the tail
    assert sweep.loc[0.02, "n_tail"] == np.sum(defined == -1.0) > np.ceil(0.02 * defined.size)
    by_m = margin_sweep(x, cell_type, section, group, [5]).set_index("value")
    assert by_m.loc[5.0, "n_tail"] == result.n_tail
    assert "n_tail" in sensitivity_table([sweep.reset_index().assign(**condition)]).columns
