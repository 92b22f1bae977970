"""cellpath.robustness: golden values on a hand-computed toy, agreement with the `croma` package
(1e-5) on seeded embeddings, the shortcut probe and its reductions, and every bad input."""

from __future__ import annotations

import warnings

import croma
import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import balanced_accuracy_score

from cellpath.robustness import (K_CANDIDATES, apd, composition, cramers_v, croma_margins, fraction_non_positive,
                                 knn_balanced_accuracy, low_margin_enrichment, lower_tail,
                                 margin_aware_robustness_index, median_margin, neighbours, nipd, robustness_index,
                                 score_embeddings, select_k, shared_k, shortcut_sweep)
from cellpath.robustness.metrics import balanced_accuracy
from cellpath.robustness.sensitivity import margin_sweep, sensitivity_agreement, tail_sweep
from cellpath.robustness.shortcut import _test_groups, cell_balanced_accuracy, split_levels

TOL = 1e-5


def _embedding(n: int, group_sizes: np.ndarray | None = None, d: int = 32, n_bio: int = 4, n_conf: int = 3,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Features with biology, confounder and group structure. Groups (patches) sit inside one
    confounder level (section) and mix biology classes."""
    rng = np.random.default_rng(seed)
    sizes = np.full(n // 8, 8) if group_sizes is None else group_sizes
    group = np.repeat(np.arange(len(sizes)), sizes)[:n]
    conf = rng.integers(0, n_conf, len(sizes))[group]
    bio = rng.integers(0, n_bio, len(group))
    centres = [rng.standard_normal((levels, d)) for levels in (n_bio, n_conf, len(sizes))]
    x = 1.0 * centres[0][bio] + 0.8 * centres[1][conf] + 0.5 * centres[2][group] + 1.5 * rng.standard_normal((len(group), d))
    return x.astype(np.float32), bio, conf, group


def _manifest(bio: np.ndarray, conf: np.ndarray, group: np.ndarray) -> pd.DataFrame:
    n = len(bio)
    return pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(n)], "image_path": "none",
        "label": [f"b{v}" for v in bio], "group_id": [f"g{v}" for v in group], "section": [f"c{v}" for v in conf],
    })


def _croma_scores(x: np.ndarray, manifest: pd.DataFrame, m: int, k_candidates: list[int]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return (croma.CRoMa.compute(x, manifest, confounder_column="section", m=m),
                croma.RI.compute(x, manifest, confounder_column="section", k_candidates=k_candidates),
                croma.MaRI.compute(x, manifest, confounder_column="section", k_candidates=k_candidates))


# ---------------------------------------------------------------- golden values, by hand

# Eight unit vectors in 2-D at these angles; cosine distance = 1 - cos(angle difference).
TOY_ANGLES = np.deg2rad([0, 60, 90, 120, 180, 240, 270, 300])
TOY_BIOLOGY = ["A", "A", "B", "B", "A", "B", "A", "B"]
TOY_CONFOUNDER = ["X", "Y", "X", "Y", "Y", "X", "X", "Y"]
TOY_GROUP = ["g0", "g0", "g1", "g2", "g3", "g4", "g5", "g6"]  # samples 0 and 1 share a patch
S = 1 - np.sqrt(3) / 2  # distance at 30 degrees
T = 1 + np.sqrt(3) / 2  # distance at 150 degrees
# m = 1. Anchor: nearest SO (same biology, other confounder, other group) / nearest OS distance.
#  0 (0°,A,X):   SO {4} (1 shares g0)    -> 2;  OS {2, 5}  -> 1    => (1 - 2) / 3   = -1/3
#  1 (60°,A,Y):  SO {6} (0 shares g0)    -> T;  OS {3, 7}  -> 1/2  => (1/2 - T) / (1/2 + T)
#  2 (90°,B,X):  SO {3, 7} -> S;  OS {0, 6} -> 1                 => (1 - S) / (1 + S)
#  3 (120°,B,Y): SO {2, 5} -> S;  OS {1, 4} -> 1/2               => (1/2 - S) / (1/2 + S)
#  4 (180°,A,Y): SO {0, 6} -> 1;  OS {3, 7} -> 1/2               => -1/3
#  5 (240°,B,X): SO {3, 7} -> 1/2; OS {0, 6} -> S                => (S - 1/2) / (S + 1/2)
#  6 (270°,A,X): SO {1, 4} -> 1;  OS {2, 5} -> S                 => (S - 1) / (S + 1)
#  7 (300°,B,Y): SO {2, 5} -> 1/2; OS {1, 4} -> 3/2              => (3/2 - 1/2) / 2 = 1/2
TOY_MARGINS = np.array([-1 / 3, (0.5 - T) / (0.5 + T), (1 - S) / (1 + S), (0.5 - S) / (0.5 + S),
                        -1 / 3, (S - 0.5) / (S + 0.5), (S - 1) / (S + 1), 0.5])


def _toy_features() -> np.ndarray:
    return np.stack([np.cos(TOY_ANGLES), np.sin(TOY_ANGLES)], axis=1)


def test_toy_margins_and_summaries_match_hand_values():
    result = score_embeddings(_toy_features(), TOY_BIOLOGY, TOY_CONFOUNDER, TOY_GROUP, m=1, k=3)
    np.testing.assert_allclose(result.margins, TOY_MARGINS, atol=1e-6)
    assert result.n_undefined == 0
    assert result.f0 == 5 / 8  # samples 0, 1, 4, 5, 6
    assert result.median == pytest.approx(-1 / 3, abs=1e-6)  # mean of the two middle values, both -1/3
    assert result.ltm == pytest.approx((S - 1) / (S + 1), abs=1e-6)  # 10th percentile keeps the minimum only


def test_toy_matches_croma():
    frame = _manifest(np.array(TOY_BIOLOGY), np.array(TOY_CONFOUNDER), np.array(TOY_GROUP))
    reference = croma.CRoMa.compute(_toy_features(), frame, confounder_column="section", m=1)
    np.testing.assert_allclose(reference.sample_values, TOY_MARGINS, atol=1e-12)


def test_margin_maths_and_undefined_counts():
    so = np.array([[0.2, 0.4], [0.1, np.inf], [0.0, 0.0], [0.5, 0.5]])
    os_ = np.array([[0.6, 0.8], [0.3, 0.3], [0.0, 0.0], [0.5, 0.5]])
    margins = croma_margins(so, os_)
    np.testing.assert_allclose(margins.values, [0.4, np.nan, np.nan, 0.0])
    assert (margins.n_unresolved, margins.n_zero_distance, margins.n_undefined) == (1, 1, 2)
    assert margins.defined.tolist() == [True, False, False, True]
    assert fraction_non_positive(margins.values) == 0.5  # the exact zero counts as non-positive
    assert median_margin(margins.values) == pytest.approx(0.2)


def test_lower_tail_uses_linear_percentile_and_inclusive_cut():
    values = np.append(np.arange(1, 11) / 10, np.nan)
    tail = lower_tail(values, 0.10)  # 10th percentile of 0.1..1.0 = 0.19 -> {0.1}
    assert (tail.q_alpha, tail.ltm, tail.n_tail) == (pytest.approx(0.19), pytest.approx(0.1), 1)
    tail = lower_tail(values, 0.20)  # 0.28 -> {0.1, 0.2}
    assert (tail.q_alpha, tail.ltm, tail.n_tail) == (pytest.approx(0.28), pytest.approx(0.15), 2)


def test_ri_and_mari_on_a_hand_neighbour_table():
    biology = np.array([0, 0, 1, 1, 0])
    confounder = np.array([0, 1, 0, 1, 0])
    # anchor 0 (b0,c0): neighbours 1 (SO), 2 (OS), 4 (SS) -> 1 SO, 1 OS
    # anchor 1 (b0,c1): neighbours 3 (OS), 0 (SO), 2 (OO) -> 1 SO, 1 OS
    # anchor 2 (b1,c0): neighbours 0 (OS), 4 (OS), 3 (SO) -> 1 SO, 2 OS
    # anchor 3 (b1,c1): neighbours 2 (SO), -1, -1        -> 1 SO
    # anchor 4 (b0,c0): neighbours 0 (SS), -1, -1        -> no typed neighbour: outside support
    index = np.array([[1, 2, 4], [3, 0, 2], [0, 4, 3], [2, -1, -1], [0, -1, -1]])
    distance = np.array([[0.1, 0.3, 0.5], [0.2, 0.4, 0.6], [0.1, 0.2, 0.3], [0.4, np.inf, np.inf], [0.1, np.inf, np.inf]])
    ri = robustness_index(index, distance, biology, confounder, 3)
    assert ri.value == pytest.approx(0.5)  # pooled SO 1+1+1+1 = 4, OS 1+1+2 = 4
    np.testing.assert_allclose(ri.samples, [0.5, 0.5, 1 / 3, 1.0, np.nan])
    assert ri.support == 0.8
    assert robustness_index(index, distance, biology, confounder, 1).value == pytest.approx(0.5)  # SO at anchors 0, 3; OS at 1, 2
    mari = margin_aware_robustness_index(index, distance, biology, confounder, 3, tau=0.5)
    w = lambda d: np.exp(-d / 0.5)  # noqa: E731
    so = w(0.1) + w(0.4) + w(0.3) + w(0.4)
    os_ = w(0.3) + w(0.2) + w(0.1) + w(0.2)
    assert mari.value == pytest.approx(so / (so + os_))
    assert mari.samples[0] == pytest.approx(w(0.1) / (w(0.1) + w(0.3)))
    # auto tau: median of the typed distances 0.1 0.3 0.2 0.4 0.1 0.2 0.3 0.4 -> 0.25
    assert margin_aware_robustness_index(index, distance, biology, confounder, 3).tau == pytest.approx(0.25)


def test_knn_balanced_accuracy_and_k_selection():
    labels = np.array([0, 0, 1, 1, 2])
    index = np.array([[1, 2, 3], [0, 2, 4], [3, 0, 1], [0, 1, 2], [3, -1, -1]])
    distance = np.where(index >= 0, [[0.1, 0.2, 0.3]], np.inf)
    scores = knn_balanced_accuracy(index, distance, labels, [1, 3])
    # k=1: predictions 0,0,1,0,1 -> recalls 1, 1/2, 0 -> 1/2
    # k=3: [0,1,1]->1, [0,1,2] tie->0, [1,0,0]->0, [0,0,1]->0, [1]->1 -> recalls 1/2, 0, 0 -> 1/6
    assert scores == {1: pytest.approx(0.5), 3: pytest.approx(1 / 6)}
    assert select_k({1: 0.7, 3: 0.9, 5: 0.9, 7: 0.8}, (1, 3, 5, 7)) == 3  # first maximiser
    assert shared_k([61, 5, 11, 21]) == 11  # lower of the two central values
    assert shared_k([31, 5, 11]) == 11
    assert K_CANDIDATES == (1, 3, 5, 7, 9, 11, 21, 31, 41, 51, 61, 71, 81, 91)


# ---------------------------------------------------------------- agreement with croma

@pytest.fixture(scope="module")
def seeded():
    x, bio, conf, group = _embedding(1800)
    return x, bio, conf, group, _manifest(bio, conf, group)


def test_matches_croma_at_fixed_k(seeded):
    x, bio, conf, group, manifest = seeded
    ours = score_embeddings(x, bio, conf, group, m=5, k=11)
    reference, ri, mari = _croma_scores(x.astype(np.float64), manifest, 5, [11])
    assert ours.n_undefined == 0
    assert np.max(np.abs(ours.margins - reference.sample_values)) < TOL
    assert abs(ours.median - reference.value) < TOL
    assert abs(ours.f0 - reference.f0) < TOL
    assert abs(ours.ltm - reference.ltm_alpha) < TOL and abs(ours.q_alpha - reference.q_alpha) < TOL
    assert abs(ours.ri - ri.value) < TOL and abs(ours.mari - mari.value) < TOL
    assert abs(ours.tau - mari.tau) < TOL and ours.support == ri.support
    np.testing.assert_array_equal(np.isnan(ours.ri_samples), ~ri.occurrence_defined_mask)
    assert np.nanmax(np.abs(ours.ri_samples - ri.sample_values_aligned)) < TOL
    assert np.nanmax(np.abs(ours.mari_samples - mari.sample_values_aligned)) < TOL


def test_k_selection_and_knn_probes_match_croma(seeded):
    x, bio, conf, group, manifest = seeded
    ours = score_embeddings(x, bio, conf, group)
    _, ri, mari = _croma_scores(x.astype(np.float64), manifest, 5, list(K_CANDIDATES))
    assert ours.k == ri.k == mari.k
    assert abs(ours.ri - ri.value) < TOL and abs(ours.mari - mari.value) < TOL
    for labels, ours_scores in ((bio, ours.bio_bacc_by_k), (conf, {ours.k: ours.conf_bacc})):
        codes = pd.factorize(labels, sort=True)[0]  # label codes in sorted order, as cellpath numbers them
        reference = _brute_force_knn_balanced_accuracy(x, codes, group, list(ours_scores))
        assert max(abs(reference[k] - ours_scores[k]) for k in ours_scores) < TOL


def _brute_force_knn_balanced_accuracy(x: np.ndarray, labels: np.ndarray, group: np.ndarray,
                                       k_values: list[int]) -> dict[int, float]:
    """An independent reference: every pairwise cosine distance (float64), a sample's own group
    excluded, the k nearest vote (ties to the smallest label), scikit-learn's balanced accuracy."""
    unit = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    distance = 1.0 - unit @ unit.T
    distance[group[:, None] == group[None, :]] = np.inf
    order = np.argsort(distance, axis=1, kind="stable")
    scores = {}
    for k in k_values:
        votes = labels[order[:, :k]]
        predicted = np.array([np.bincount(row, minlength=labels.max() + 1).argmax() for row in votes])
        scores[k] = balanced_accuracy_score(labels, predicted)
    return scores


def test_large_group_forces_requery_and_still_matches_croma(monkeypatch):
    sizes = np.r_[np.full(352, 5), 40]  # one patch far above the over-fetch quantile
    x, bio, conf, group = _embedding(int(sizes.sum()), sizes, seed=3)
    big = group == 352
    x[big] = x[big].mean(axis=0) + 0.3 * np.random.default_rng(4).standard_normal((40, x.shape[1]))  # a tight patch
    calls: list[int] = []
    search = neighbours._search
    monkeypatch.setattr(neighbours, "_search", lambda index, q, k, chunk: calls.append(k) or search(index, q, k, chunk))
    monkeypatch.setattr(neighbours, "_DENSE_BLOCK_ANCHORS", 0)  # every typed search by faiss, per block
    ours = score_embeddings(x, bio, conf, group, m=5, k=21)
    margin = max(neighbours._FETCH_MARGIN, 21 // 2)  # fetched beyond k and the same-group allowance
    assert calls[-2:] == [21 + margin + 5, 21 + margin + 40]  # generic search: the big patch re-queried
    assert len(calls) - 2 > 12 * 2  # typed search: re-queries beyond one SO and one OS search per block
    monkeypatch.setattr(neighbours, "_DENSE_BLOCK_ANCHORS", 10**9)  # every typed search one dense product
    dense = score_embeddings(x, bio, conf, group, m=5, k=21)
    np.testing.assert_array_equal(dense.margins, ours.margins)
    reference, ri, mari = _croma_scores(x.astype(np.float64), _manifest(bio, conf, group), 5, [21])
    assert np.max(np.abs(ours.margins - reference.sample_values)) < TOL
    assert abs(ours.ri - ri.value) < TOL and abs(ours.mari - mari.value) < TOL


def test_anchor_subset_equals_the_same_rows_of_the_full_search():
    x, bio, conf, group = _embedding(1200, seed=8)
    unit = neighbours.l2_normalise(x)
    anchors = np.random.default_rng(9).choice(len(x), 150, replace=False)
    full_typed = neighbours.typed_neighbours(unit, bio, conf, group, 5)
    sub_typed = neighbours.typed_neighbours(unit, bio, conf, group, 5, anchors=anchors)
    np.testing.assert_array_equal(sub_typed.so, full_typed.so[anchors])
    np.testing.assert_array_equal(sub_typed.os, full_typed.os[anchors])
    full_knn = neighbours.knn_excluding_groups(unit, group, 11)
    sub_knn = neighbours.knn_excluding_groups(unit, group, 11, anchors=anchors)
    np.testing.assert_array_equal(sub_knn.index, full_knn.index[anchors])
    np.testing.assert_array_equal(sub_knn.distance, full_knn.distance[anchors])


def test_samples_without_typed_candidates_are_counted_not_dropped():
    x, bio, conf, group = _embedding(900, seed=5)
    bio = bio.copy()
    bio[conf == 0] = np.where(bio[conf == 0] == 3, 0, bio[conf == 0])
    bio[conf != 0] = np.where(bio[conf != 0] == 3, 1, bio[conf != 0])
    lonely = np.flatnonzero(conf == 0)[:4]
    bio[lonely] = 3  # class 3 exists in one confounder only: no SO candidate at all
    result = score_embeddings(x, bio, conf, group, m=5, k=5)
    assert result.n_unresolved == 4 and result.n_undefined == 4
    np.testing.assert_array_equal(np.flatnonzero(~result.defined), lonely)
    assert np.isnan(result.margins[lonely]).all()
    assert result.f0 == np.mean(result.margins[result.defined] <= 0)


def test_dataframe_input_gives_the_same_result(seeded):
    x, bio, conf, group, _ = seeded
    frame = pd.DataFrame({"cell_type": bio, "section": conf, "patch": group})
    by_name = score_embeddings(x, "cell_type", "section", "patch", frame=frame, k=11)
    by_array = score_embeddings(x, bio, conf, group, k=11)
    assert by_name.summary() == by_array.summary()


# ---------------------------------------------------------------- low-margin enrichment

def test_low_margin_enrichment_table():
    margins = np.array([-0.9, -0.8, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.3, 0.3, 0.3, 0.3,
                        0.3, 0.3, 0.3, 0.3, np.nan])
    frame = pd.DataFrame({"cell_type": ["T"] * 2 + ["B"] * 18 + ["T"], "section": ["s1"] * 10 + ["s2"] * 11})
    table = low_margin_enrichment(margins, frame, columns=("cell_type", "section"), fraction=0.10)
    # 20 defined; 10th percentile = -0.8 + 0.9 * (0.1 + 0.8) = 0.01 -> low = the two T cells
    assert table.attrs["threshold"] == pytest.approx(0.01)
    t_row = table[(table["column"] == "cell_type") & (table["category"] == "T")].iloc[0]
    assert (t_row.n_low, t_row.n_defined, t_row.share_low, t_row.share_all) == (2, 2, 1.0, 0.1)
    assert t_row.enrichment == pytest.approx(10.0)
    s2 = table[(table["column"] == "section") & (table["category"] == "s2")].iloc[0]
    assert (s2.n_low, s2.n_defined, s2.enrichment) == (0, 10, 0.0)
    assert table["column"].tolist() == ["cell_type", "cell_type", "section", "section"]


# ---------------------------------------------------------------- shortcut probe, APD, nIPD

# PathoROB's Camelyon schedule (Kömen et al.; croma's copy of it): per split, slides of
# (centre 0, class 0), (centre 0, class 1), (centre 1, class 0), (centre 1, class 1).
PATHOROB_CAMELYON = [(7 - s, 7 + s, 7 + s, 7 - s) for s in range(8)]


def test_composition_is_pathorob_camelyon_schedule():
    assert PATHOROB_CAMELYON[0] == (7, 7, 7, 7) and PATHOROB_CAMELYON[7] == (0, 14, 14, 0)
    for split, (c0_k0, c0_k1, c1_k0, c1_k1) in enumerate(PATHOROB_CAMELYON):
        pathorob = np.array([[c0_k1, c0_k0], [c1_k1, c1_k0]])  # PathoROB aligns centre 0 with class 1
        table = composition(2, 2, 28, split / 7)
        np.testing.assert_array_equal(table, pathorob)
        assert cramers_v(table) == pytest.approx(split / 7)


@pytest.mark.parametrize(("n_conf", "n_classes", "pool", "used"), [
    (2, 4, 192, 192), (4, 2, 192, 192), (3, 3, 216, 216), (5, 3, 610, 600), (3, 5, 600, 600),
])
def test_composition_keeps_marginals_and_reaches_full_dependence(n_conf, n_classes, pool, used):
    # pool rounded down to a multiple of max(C, K)^2; V = 1 - u / (N / L^2), u = round((1 - v) N / L^2)
    per_cell = used // max(n_conf, n_classes) ** 2
    baseline = composition(n_conf, n_classes, pool, 0.0)
    np.testing.assert_array_equal(baseline * used, np.outer(baseline.sum(axis=1), baseline.sum(axis=0)))  # independent
    for v in np.linspace(0, 1, 11):
        table = composition(n_conf, n_classes, pool, v)
        assert table.sum() == used and (table >= 0).all()
        np.testing.assert_array_equal(table.sum(axis=1), baseline.sum(axis=1))
        np.testing.assert_array_equal(table.sum(axis=0), baseline.sum(axis=0))
        assert cramers_v(table) == pytest.approx(1 - round(per_cell * (1 - v)) / per_cell)
    assert (composition(n_conf, n_classes, pool, 1.0) > 0).sum() == max(n_conf, n_classes)  # one cell per level


def test_apd_and_nipd_match_croma():
    rng = np.random.default_rng(11)
    v = np.linspace(0, 1, 11)
    for _ in range(5):
        acc = np.clip(0.9 - 0.3 * v[:, None] * rng.random((1, 4)) + 0.02 * rng.standard_normal((11, 4)), 0.3, 1)
        assert abs(apd(acc) - croma.apd(acc)) < 1e-12
        assert abs(nipd(acc, v, 0.25) - croma.nipd(acc, v, 0.25)) < 1e-12


@pytest.fixture(scope="module")
def probe_data():
    rng = np.random.default_rng(21)
    groups = np.repeat(np.arange(240), 5)
    conf = np.repeat(rng.permutation(np.arange(240) % 3), 5)  # three sections; section 2 held out
    bio = rng.integers(0, 2, len(groups))
    noise = rng.standard_normal((len(groups), 16))
    robust = noise.copy()
    robust[:, 0] += 2.0 * bio
    confounded = noise.copy()
    confounded[:, 0] += 0.8 * bio
    confounded[:, 1] += 6.0 * (conf == 1)
    return robust, confounded, bio, conf, groups


def test_shortcut_sweep_separates_robust_from_confounded(probe_data):
    robust, confounded, bio, conf, groups = probe_data
    sweeps = [shortcut_sweep(x, bio, conf, groups, pool_size=160, train_confounders=[0, 1], n_runs=2, seed=1,
                             c_grid=(1e-2, 1.0))
              for x in (robust, confounded)]
    for sweep in sweeps:
        assert sweep.in_domain.shape == sweep.held_out.shape == (11, 2)
        np.testing.assert_allclose(sweep.cramers_v, np.linspace(0, 1, 11), atol=1e-12)
        assert all(t.sum() == 160 for t in sweep.tables) and sweep.chance == 0.5
        summary = sweep.summary()
        assert summary["apd_in_domain"] == pytest.approx(croma.apd(sweep.in_domain), abs=1e-12)
        assert summary["nipd_in_domain"] == pytest.approx(croma.nipd(sweep.in_domain, sweep.cramers_v, 0.5), abs=1e-12)
        assert summary["nipd_held_out"] == pytest.approx(croma.nipd(sweep.held_out, sweep.cramers_v, 0.5), abs=1e-12)
    robust_summary, confounded_summary = (s.summary() for s in sweeps)
    assert robust_summary["nipd_in_domain"] > -0.1
    assert confounded_summary["nipd_in_domain"] < robust_summary["nipd_in_domain"] - 0.2


def test_shortcut_sweep_rejects_a_pool_larger_than_the_cells(probe_data):
    robust, _, bio, conf, groups = probe_data
    with pytest.raises(ValueError, match="training-pool rows"):
        shortcut_sweep(robust, bio, conf, groups, pool_size=1200, train_confounders=[0, 1], n_runs=1)
    with pytest.raises(ValueError, match="cannot realise distinct"):
        shortcut_sweep(robust, bio, conf, groups, pool_size=8, train_confounders=[0, 1], n_runs=1)


def test_shortcut_levels_align_in_the_order_given_with_the_sorted_classes():
    # Section "b" has 170 cells of class "x" and 30 of "y", section "a" the reverse. At V = 1 each trained section holds
    # only its aligned class, 40 rows of it, more than a 30-cell class has: only b -> x (the first class, sorted),
    # a -> y is feasible.
    rng = np.random.default_rng(3)
    bio = np.array(["y"] * 170 + ["x"] * 30 + ["x"] * 170 + ["y"] * 30)  # "y" appears first: order is by name
    conf = np.array(["a"] * 200 + ["b"] * 200)
    x = rng.standard_normal((400, 4))
    groups = np.arange(400)
    sweep = shortcut_sweep(x, bio, conf, groups, pool_size=80, train_confounders=["b", "a"], n_runs=1,
                           c_grid=(1.0,))
    np.testing.assert_array_equal(sweep.tables[-1], [[40, 0], [0, 40]])
    with pytest.raises(ValueError, match="confounder 'a' x biology 'x' needs 40 training-pool rows but has 30 cells in all"):
        shortcut_sweep(x, bio, conf, groups, pool_size=80, train_confounders=["a", "b"], n_runs=1, c_grid=(1.0,))


def test_cell_balanced_accuracy_weights_every_cell_equally():
    # Two confounders x two classes (cells 0..3 = confounder * 2 + class). Class 0: cell 0 has 3 of 4 right, cell 2
    # 1 of 1 -> (0.75 + 1) / 2; class 1: cell 1 0 of 2, cell 3 2 of 2 -> 0.5. Mean 0.6875; plain balanced accuracy
    # would pool cell 0's four rows with cell 2's one: class 0 recall 4/5 -> 0.65.
    y_true = np.array([0, 0, 0, 0, 1, 1, 0, 1, 1])
    y_pred = np.array([0, 0, 0, 1, 0, 0, 0, 1, 1])
    cells = np.array([0, 0, 0, 0, 1, 1, 2, 3, 3])
    assert cell_balanced_accuracy(y_true, y_pred, cells, 2) == pytest.approx(0.6875, abs=1e-15)
    assert balanced_accuracy(y_true, y_pred) == pytest.approx(0.65, abs=1e-15)


def test_test_groups_leave_every_cell_its_pool_and_a_test_row():
    # Cell 1 lives in two groups only (5 rows each) and the pool needs 5 of it: the draw may take one, never both.
    cells = np.array([0] * 40 + [1] * 10 + [0] * 10)
    groups = np.array(list(np.repeat(np.arange(8), 5)) + [8] * 5 + [9] * 5 + list(np.repeat([10, 11], 5)))
    need = np.array([20, 5])
    for seed in range(30):
        chosen = _test_groups(cells, groups, need, np.random.default_rng(seed), test_fraction=0.5)
        in_test = np.isin(groups, chosen)
        assert np.bincount(cells[~in_test], minlength=2).tolist() >= [20, 5] and (cells[~in_test] == 1).sum() >= 5
        assert set(cells[in_test]) == {0, 1}  # both cells have test rows
        assert len(chosen) in (6, 7)  # half of the 12 groups, plus one when cell 1 had none


def test_split_levels():
    assert split_levels(["c", "a", "b"], None, 1) == (["a", "b"], ["c"])
    assert split_levels(["c", "a", "b"], ["c", "a"], 1) == (["c", "a"], ["b"])  # held_out unused, order kept
    assert split_levels(["c", "a", "b"], None, 0) == (["a", "b", "c"], [])
    with pytest.raises(ValueError, match=r"train_levels \['z'\] are not among this run's levels: a, b, c"):
        split_levels(["c", "a", "b"], ["a", "z"], 1)
    with pytest.raises(ValueError, match="3 level\\(s\\) leave 1 to train on \\(held_out=2\\)"):
        split_levels(["c", "a", "b"], None, 2)


# ---------------------------------------------------------------- sensitivity to m and alpha (Tables S1, S2)

def test_margin_sweep_matches_croma_at_every_m(seeded):
    x, bio, conf, group, manifest = seeded
    sweep = margin_sweep(x, bio, conf, group, [1, 3, 5, 8]).set_index("value")
    for m in (1, 3, 5, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            reference = croma.CRoMa.compute(x.astype(np.float64), manifest, confounder_column="section", m=m)
        assert abs(sweep.loc[m, "croma_median"] - reference.value) < TOL
        assert abs(sweep.loc[m, "f0"] - reference.f0) < TOL and abs(sweep.loc[m, "ltm"] - reference.ltm_alpha) < TOL


def test_tail_sweep_on_the_toy_margins():
    # The eight toy margins sorted: (S-1)/(S+1) ≈ -0.764, then (1/2-T)/(1/2+T) = (S-1/2)/(S+1/2) ≈ -0.577 (twice),
    # -1/3 (twice), 1/2, (1/2-S)/(1/2+S) ≈ 0.577, (1-S)/(1+S) ≈ 0.764. np.percentile (linear) puts alpha 0.10 at
    # position 0.7 (tail: the minimum), 0.30 at 2.1 (q ≈ -0.553: the three smallest), 0.60 at 4.2 (q ≈ -0.167: five).
    ordered = np.sort(TOY_MARGINS)
    table = tail_sweep(np.append(TOY_MARGINS, np.nan), [0.1, 0.3, 0.6]).set_index("value")
    assert table.loc[0.1, "ltm"] == pytest.approx((S - 1) / (S + 1), abs=1e-12)
    assert table.loc[0.3, "ltm"] == pytest.approx(((S - 1) / (S + 1) + 2 * (S - 0.5) / (S + 0.5)) / 3, abs=1e-12)
    assert table.loc[0.6, "ltm"] == pytest.approx(ordered[:5].mean(), abs=1e-12)
    assert (table["n_undefined"] == 1).all() and np.allclose(table["croma_median"], -1 / 3)
    assert table["n_tail"].tolist() == [1, 3, 5]  # the margins each LTM averages


def test_sensitivity_agreement_golden_spearman():
    # Four models. m: at m = 5 the order is a > b > c > d; at m = 1 b > a > c > d (one swap: rho = 1 - 6*2/60 = 0.8);
    # at m = 20 d > c > b > a (reversed: -1). Medians below 0: 1 model at m = 1, 2 at m = 5 and 20, 3 at m = 10.
    medians = {1: [0.3, 0.4, 0.1, -0.2], 5: [0.4, 0.3, -0.1, -0.2], 10: [0.2, -0.1, -0.2, -0.3], 20: [-0.4, -0.3, 0.1, 0.2]}
    # alpha: LTM ranks at 0.05 and 0.10 equal (rho 1), at 0.20 the first two swap (rho 0.8 with both).
    ltm = {0.05: [-0.5, -0.6, -0.7, -0.8], 0.1: [-0.4, -0.5, -0.6, -0.7], 0.2: [-0.35, -0.3, -0.5, -0.6]}
    rows = [{"model": f"m{i}", "readout": "Nuc", "parameter": "m", "value": float(m), "croma_median": v, "ltm": np.nan}
            for m, values in medians.items() for i, v in enumerate(values)]
    rows += [{"model": f"m{i}", "readout": "Nuc", "parameter": "alpha", "value": a, "croma_median": 0.0, "ltm": v}
             for a, values in ltm.items() for i, v in enumerate(values)]
    table = sensitivity_agreement(pd.DataFrame(rows), ["readout"], headline_m=5)
    got = {(r.parameter, r.x, r.y): (round(r.rho, 12), r.n_negative_x, r.n_negative_y) for r in table.itertuples()}
    assert got == {("alpha", 0.05, 0.1): (1.0, 4, 4), ("alpha", 0.05, 0.2): (0.8, 4, 4), ("alpha", 0.1, 0.2): (0.8, 4, 4),
                   ("m", 5.0, 1.0): (0.8, 2, 1), ("m", 5.0, 20.0): (-1.0, 2, 2), ("m", 1.0, 20.0): (-0.8, 1, 2)}
    m_rows = table[table["parameter"] == "m"]
    assert (m_rows["n_negative_min"] == 1).all() and (m_rows["n_negative_max"] == 3).all()
    assert set(table["statistic"]) == {"ltm", "croma_median"} and (table["n_models"] == 4).all()


# ---------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def small():
    x, bio, conf, group = _embedding(240, seed=9)
    return x, bio, conf, group


def test_nonfinite_features_are_counted(small):
    x, bio, conf, group = small
    bad = x.copy()
    bad[3, 0], bad[7, 5], bad[7, 6] = np.nan, np.inf, -np.inf
    with pytest.raises(ValueError, match="NaN or inf in 2 of 240 rows"):
        score_embeddings(bad, bio, conf, group)


@pytest.mark.parametrize("which", ["biology", "confounder", "group"])
def test_label_of_wrong_length(small, which):
    x, bio, conf, group = small
    labels = {"biology": bio, "confounder": conf, "group": group}
    labels[which] = labels[which][:-1]
    with pytest.raises(ValueError, match=f"{which} must be a 1-D array with one entry per sample \\(240\\)"):
        score_embeddings(x, **labels)


def test_single_confounder_level(small):
    x, bio, _, group = small
    with pytest.raises(ValueError, match="confounder has a single level"):
        score_embeddings(x, bio, np.zeros(len(x)), group)


def test_too_few_typed_candidates_everywhere(small):
    x, bio, conf, group = small
    with pytest.raises(ValueError, match="no sample has at least m=100 SO"):
        score_embeddings(x, bio, conf, group, m=100)
    with pytest.raises(ValueError, match="CRoMa is undefined for every sample"):
        score_embeddings(x, np.zeros(len(x)), conf, group, m=1)  # one biology class: no OS anywhere


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"m": 0}, "m must be an integer >= 1"),
    ({"k": 0}, "k must be an integer >= 1"),
    ({"k": 240}, "k must be smaller than the number of samples"),
    ({"alpha": 0.0}, "alpha must lie in"),
])
def test_bad_m_k_alpha(small, kwargs, message):
    x, bio, conf, group = small
    with pytest.raises(ValueError, match=message):
        score_embeddings(x, bio, conf, group, **kwargs)


def test_missing_frame_column(small):
    x, bio, conf, group = small
    frame = pd.DataFrame({"cell_type": bio, "section": conf})
    with pytest.raises(ValueError, match=r"missing column\(s\) \['patch'\]"):
        score_embeddings(x, "cell_type", "section", "patch", frame=frame)


def test_nipd_interval_spans_the_runs_and_collapses_for_identical_runs():
    """Two runs: a bootstrap draw is (A, A), (B, B) or a mix, each pure draw with probability 1/4, so
    the 2.5 % and 97.5 % quantiles are the nIPDs of the runs alone. Identical runs: no spread."""
    from cellpath.robustness import nipd_interval

    v = np.linspace(0, 1, 11)
    run_a = 0.9 - 0.2 * v
    run_b = 0.8 - 0.05 * v
    acc = np.column_stack([run_a, run_b])
    low, high = nipd_interval(acc, v, 0.5, seed=3)
    alone = sorted([nipd(run_a[:, None], v, 0.5), nipd(run_b[:, None], v, 0.5)])
    assert (low, high) == pytest.approx(alone)
    assert low < nipd(acc, v, 0.5) < high
    same = np.column_stack([run_a] * 4)
    assert nipd_interval(same, v, 0.5) == pytest.approx((nipd(same, v, 0.5),) * 2)
    assert nipd_interval(acc, v, 0.5, seed=3) == (low, high)  # seeded


def test_metric_agreement_golden():
    """Four models, one condition. RI and MaRI order the models identically (ρ = 1), CRoMa reverses
    the last two (ranks 1, 2, 4, 3 against 1, 2, 3, 4: ρ = 1 − 6·2/(4·15) = 0.8). nIPD is joined only
    from the shortcut rows of the same condition; a coarse-taxonomy row is ignored."""
    from cellpath.robustness.agreement import metric_agreement

    condition = {"magnification": "20x", "readout": "Nuc", "taxonomy": "fine", "confounder": "section_id",
                 "scope": "panel", "unit": "panel"}
    values = {"a": (0.1, 0.2, -0.1, 0.9), "b": (0.2, 0.3, 0.0, 0.8), "c": (0.3, 0.4, 0.2, 0.7),
              "d": (0.4, 0.5, 0.1, 0.6)}  # ri, mari, croma_median, conf_bacc
    summary = pd.DataFrame([{"model": m, **condition, "ri": ri, "mari": mari, "croma_median": c, "f0": 0.5 - c,
                             "ltm": c - 0.3, "conf_bacc": conf} for m, (ri, mari, c, conf) in values.items()])
    shortcut = pd.DataFrame([{"model": m, "setting": "in_domain", "magnification": "20x", "readout": "Nuc",
                              "taxonomy": taxonomy, "confounder": "section_id", "apd": -0.1 * i,
                              "nipd": -0.4 + 0.1 * i if taxonomy == "fine" else 0.0}
                             for i, m in enumerate(values) for taxonomy in ("fine", "coarse")])
    table = metric_agreement(summary, shortcut).set_index(["x", "y"])
    assert table.loc[("ri", "mari"), "rho"] == pytest.approx(1.0)
    assert table.loc[("ri", "croma_median"), "rho"] == pytest.approx(0.8)
    assert table.loc[("conf_bacc", "croma_median"), "rho"] == pytest.approx(-0.8)
    assert table.loc[("ri", "nipd_in_domain"), "rho"] == pytest.approx(1.0)  # nIPD rises a → d, as RI
    assert table.loc[("croma_median", "nipd_in_domain"), "rho"] == pytest.approx(0.8)
    assert table.loc[("f0", "nipd_in_domain"), "rho"] == pytest.approx(-0.8)
    assert table.loc[("croma_median", "apd_in_domain"), "rho"] == pytest.approx(-0.8)
    assert (table["n_models"] == 4).all()
    two = metric_agreement(summary[summary["model"].isin(["a", "b"])], shortcut)
    assert two["rho"].isna().all() and (two["n_models"] == 2).all()
