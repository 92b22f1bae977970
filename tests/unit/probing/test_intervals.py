"""Bootstrap intervals of the balanced means and Holm-corrected win counts (beyond the paper)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cellpath.probing.stats import (hierarchical_bootstrap, holm_adjusted, pairwise_wins,
                                    pooled_cell_representation_advantage, protocol_summary, win_counts)


def _runs(model: str = "a", protocol: str = "is", seed: int = 0, shift: float = 0.0) -> pd.DataFrame:
    """IS-like runs: 4 organs with 1–3 sections each, 3 seeds per section, Macro-F1 in [0, 1]."""
    rng = np.random.default_rng(seed)
    rows = []
    for organ, n_sections in (("breast", 3), ("lung", 2), ("skin", 1), ("liver", 2)):
        organ_effect = rng.normal(0.0, 0.08)
        for s in range(n_sections):
            section_effect = rng.normal(0.0, 0.03)
            for seed_index in range(3):
                rows.append({"model": model, "magnification": "20x", "readout": "Nuc", "taxonomy": "fine",
                             "protocol": protocol, "unit": f"{organ}_{s}", "organ": organ, "seed": seed_index,
                             "macro_f1": 0.5 + shift + organ_effect + section_effect + rng.normal(0.0, 0.02)})
    return pd.DataFrame(rows)


def _direct_interval(runs: pd.DataFrame, n_resamples: int, rng: np.random.Generator) -> tuple[float, float]:
    """The same estimator resampled with plain loops: draw organs with replacement; for each drawn
    organ, each of its sections' seeds with replacement; seeds → sections → organs → mean."""
    organs = {organ: {unit: g["macro_f1"].to_numpy() for unit, g in frame.groupby("unit")}
              for organ, frame in runs.groupby("organ")}
    names = sorted(organs)
    replicates = []
    for _ in range(n_resamples):
        organ_means = []
        for organ in rng.choice(names, size=len(names), replace=True):
            sections = [seeds[rng.integers(0, len(seeds), len(seeds))].mean() for seeds in organs[organ].values()]
            organ_means.append(np.mean(sections))
        replicates.append(np.mean(organ_means))
    return tuple(np.quantile(replicates, [0.025, 0.975]))


def test_interval_matches_a_direct_resampling():
    runs = _runs()
    row = protocol_summary(runs, "macro_f1").iloc[0]
    low, high = _direct_interval(runs, 20_000, np.random.default_rng(11))
    width = high - low
    assert width > 0.05  # the organs differ: a real interval, not a point
    assert row["low"] == pytest.approx(low, abs=0.08 * width)
    assert row["high"] == pytest.approx(high, abs=0.08 * width)
    assert row["low"] < row["mean"] < row["high"]


def test_a_wrong_resampling_unit_fails_the_direct_comparison():
    """Resampling (unit, seed) rows as if independent ignores the organ effect: an interval of
    another width, outside the tolerance the direct comparison above allows."""
    runs = _runs()
    row = protocol_summary(runs, "macro_f1").iloc[0]
    rng = np.random.default_rng(3)
    values = runs["macro_f1"].to_numpy()
    naive = np.quantile([values[rng.integers(0, len(values), len(values))].mean() for _ in range(4000)],
                        [0.025, 0.975])
    width = row["high"] - row["low"]
    assert abs((naive[1] - naive[0]) - width) > 2 * 0.08 * width


def test_identical_scores_give_a_point_interval():
    runs = _runs().assign(macro_f1=0.42)
    row = protocol_summary(runs, "macro_f1").iloc[0]
    assert row["low"] == pytest.approx(0.42) and row["high"] == pytest.approx(0.42)


def test_an_interval_does_not_depend_on_what_is_computed_alongside():
    alone = protocol_summary(_runs("a"), "macro_f1")
    together = protocol_summary(pd.concat([_runs("b", seed=5), _runs("a")], ignore_index=True), "macro_f1")
    mine = together[together["model"] == "a"].reset_index(drop=True)
    pd.testing.assert_frame_equal(alone, mine)


def test_mocv_resamples_folds():
    runs = _runs(protocol="mocv").assign(unit=lambda f: "fold" + (f.index % 5).astype(str), organ="")
    values = runs.assign(balanced_unit=runs["unit"], value=runs["macro_f1"])
    replicates = hierarchical_bootstrap(values, 500, np.random.default_rng(0))
    assert replicates.shape == (500,)
    row = protocol_summary(runs, "macro_f1").iloc[0]
    assert row["n_units"] == 5 and row["low"] <= row["mean"] <= row["high"]


def test_pooled_cra_carries_an_interval_around_its_value():
    nuc = _runs()
    mean = _runs(seed=1).assign(readout="Mean", macro_f1=lambda f: f["macro_f1"] - 0.1)
    row = pooled_cell_representation_advantage(pd.concat([nuc, mean], ignore_index=True), "macro_f1", "20x").iloc[0]
    assert row["low"] < row["cra"] < row["high"]


def test_holm_adjustment_golden():
    # sorted p: 0.01, 0.03, 0.04 with m = 3 tests: 0.03, max(0.03, 0.06), max(0.06, 0.04) = 0.03, 0.06, 0.06
    adjusted = holm_adjusted(np.array([0.01, 0.04, 0.03, np.nan]))
    np.testing.assert_allclose(adjusted[:3], [0.03, 0.06, 0.06])
    assert np.isnan(adjusted[3])


def test_holm_adjustment_equals_statsmodels_bitwise():
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(3)
    for size in (1, 2, 7, 29, 200):
        p = rng.uniform(0, 0.3, size) ** 2
        p[rng.random(size) < 0.2] = 0.004  # ties
        expected = multipletests(p, method="holm")[1]
        np.testing.assert_array_equal(holm_adjusted(p), expected)
        with_gaps = np.insert(p, [0, size], np.nan)
        np.testing.assert_array_equal(holm_adjusted(with_gaps)[1:-1], expected)
    assert np.isnan(holm_adjusted(np.array([np.nan, np.nan]))).all()


def test_holm_wins_are_a_subset_of_the_uncorrected_wins():
    runs = pd.concat([_runs(m, seed=i, shift=0.02 * i) for i, m in enumerate("abcdef")], ignore_index=True)
    wins = pairwise_wins(runs.assign(unit=runs["unit"] + "|" + runs["seed"].astype(str))[["model", "unit", "macro_f1"]]
                         .rename(columns={"macro_f1": "score"}))
    assert not (wins["win_holm"] & ~wins["win"]).any()
    for model, family in wins.groupby("model"):
        tested = family["p_value"].notna().sum()
        assert (family["p_holm"].dropna() >= family["p_value"].dropna()).all()
        assert (family["p_holm"].dropna() <= np.minimum(1.0, tested * family["p_value"].dropna()) + 1e-12).all()
    counts = win_counts(runs, "macro_f1")
    assert (counts["wins_holm"] <= counts["wins"]).all() and counts["wins"].sum() > 0
