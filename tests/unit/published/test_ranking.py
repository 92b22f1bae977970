"""The paired rank interval (cellpath.published.ranking): the power model behind the unit correlation
against scipy's Wilcoxon test, the fit, the anchors' calibration, the t tails, and the separation the
old independent construction could not make."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from cellpath.published.ranking import expected_wins, fit_unit_correlation, paired_rank_interval
from helpers.benchmark_scripts import load_benchmark_script


@pytest.fixture(scope="module")
def bench():
    return load_benchmark_script("bench_placement")


def test_expected_wins_golden():
    """Two models 2 pp apart, SD 5 each, rho 0.92: the per-unit difference has SD
    sqrt(2 · 25 · 0.08) = 2 pp; over 15 pairs the power is a noncentral t's tail with 14 degrees of
    freedom, noncentrality sqrt(15 · 3/pi) · 1, beyond t(0.975, 14)."""
    wins = expected_wins(np.array([52.0, 50.0]), np.array([5.0, 5.0]), 0.92, 15)
    ncp, critical = np.sqrt(15 * 3 / np.pi), stats.t.ppf(0.975, 14)
    assert wins == pytest.approx([stats.nct.sf(critical, 14, ncp), stats.nct.sf(critical, 14, -ncp)], rel=1e-9)
    assert wins[0] == pytest.approx(0.9400, abs=1e-4)  # scipy's test by simulation: 0.937 (8,000 sets)


@pytest.mark.parametrize(("effect", "pairs"), [(0.3, 33), (0.6, 15), (0.45, 69)])
def test_expected_wins_agrees_with_scipys_wilcoxon_by_simulation(effect: float, pairs: int):
    """The power approximation against the test itself: 4,000 simulated sets of ``pairs`` normal
    paired differences with mean/SD ``effect``, scipy.stats.wilcoxon at p < 0.05 with a positive
    median; the share of wins within 0.02 of the formula (a Normal power, without the t, misses by
    0.066 at 15 pairs)."""
    rng = np.random.default_rng(11)
    differences = effect + rng.standard_normal((4000, pairs))
    result = stats.wilcoxon(differences, axis=-1)
    share = float(((result.pvalue < 0.05) & (np.median(differences, axis=1) > 0)).mean())
    # sds 1 and 1 at rho 0.5 give a per-unit difference SD of 1
    predicted = float(expected_wins(np.array([effect, 0.0]), np.array([1.0, 1.0]), 0.5, pairs)[0])
    assert share == pytest.approx(predicted, abs=0.02)


def test_the_fit_recovers_the_correlation_that_made_the_wins():
    rng = np.random.default_rng(3)
    means, sds = np.sort(rng.uniform(15, 35, 30))[::-1], rng.uniform(4, 9, 30)
    wins = expected_wins(means, sds, 0.87, 33)
    fitted = fit_unit_correlation(means, sds, wins, 33, "test")
    assert fitted.rho == 0.87 and fitted.wins_rmse == pytest.approx(0.0, abs=1e-12)


def _paper(means: list[float], sds: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"model": [f"m{i}" for i in range(len(means))], "mean": means, "sd": sds})


def test_a_model_clearly_above_its_anchor_is_separable_where_the_old_construction_was_not(bench):
    """Eleven units with a shared unit effect of SD 8 pp; the placed model is 2 pp above the anchor on
    every unit (± 0.3 pp). Paired, it is separable from the anchor (above it in no draw) and ranked
    first of two; the old construction (independent draws of every published mean, a bootstrap of
    the placed mean) finds the two inseparable."""
    rng = np.random.default_rng(5)
    units = 30.0 + 8.0 * rng.standard_normal(11)
    anchor = units + 0.5 * rng.standard_normal(11)
    placed = anchor + 2.0 + 0.3 * rng.standard_normal(11)
    paper = pd.DataFrame({"model": ["anchor", "other"], "mean": [30.0, 20.0], "sd": [8.0, 8.0]})
    found = paired_rank_interval(paper, placed, {"anchor": anchor}, 0.95, np.random.default_rng(0))
    assert found.mean == pytest.approx(30.0 + float(np.mean(placed - anchor)))
    assert "anchor" not in found.not_separable and (found.rank, found.low, found.high) == (1, 1, 1)
    assert found.beats == 2
    values = pd.DataFrame({"balanced_unit": np.arange(11), "unit": np.arange(11), "value": placed})
    from cellpath.probing.stats import hierarchical_bootstrap

    replicates = hierarchical_bootstrap(values, 2000, np.random.default_rng(1)) - np.mean(placed) + found.mean
    low, high, separated = bench.independent_rank_interval(paper["mean"].to_numpy(), paper["sd"].to_numpy(),
                                                           replicates, 11, np.random.default_rng(2))
    assert (low, high) == (1, 2) and separated == 1  # "other" only: the anchor is not separated


def test_the_placed_mean_does_not_depend_on_the_runs_own_level():
    """A reproduction shift common to the run's models (every score 3 pp lower) changes nothing."""
    rng = np.random.default_rng(8)
    units = 25.0 + 6.0 * rng.standard_normal(9)
    anchors = {"a": units + rng.standard_normal(9), "b": units - 4.0 + rng.standard_normal(9)}
    placed = units + 1.0 + rng.standard_normal(9)
    paper = _paper([25.0, 21.0, 27.0, 24.0], [6.0, 6.5, 5.5, 6.0]).assign(model=["a", "b", "c", "d"])
    first = paired_rank_interval(paper, placed, anchors, 0.9, np.random.default_rng(4))
    shifted = paired_rank_interval(paper, placed - 3.0, {k: v - 3.0 for k, v in anchors.items()}, 0.9,
                                   np.random.default_rng(4))
    assert first == shifted


def test_few_units_have_t_tails():
    """Five units, no shared effect (rho 0): the published model is 2.4 standard errors above the
    placed one. A Normal would separate them (2.4 > 1.96); a t with 4 degrees of freedom does not
    (2.4 < 2.776): not separable, rank interval 1–2."""
    placed = np.array([-2.0, -1.0, 0.0, 1.0, 2.0]) * np.sqrt(2.5 / 2.5)  # SD exactly sqrt(2.5)
    s_placed = float(np.std(placed, ddof=1))
    se = np.sqrt((s_placed ** 2 + s_placed ** 2) / 5)
    paper = _paper([2.4 * se], [s_placed])
    found = paired_rank_interval(paper, placed, {}, 0.0, np.random.default_rng(0), n_draws=40_000)
    assert found.not_separable == ["m0"] and (found.low, found.high) == (1, 2)
    wide_apart = paired_rank_interval(_paper([3.5 * se], [s_placed]), placed, {}, 0.0, np.random.default_rng(0),
                                      n_draws=40_000)
    assert wide_apart.not_separable == [] and (wide_apart.low, wide_apart.high) == (2, 2)


def test_a_model_that_ignores_the_unit_effect_gets_its_own_loading():
    """The paper's models share the unit effect (rho 0.9); a placed model uncorrelated with its anchor
    is not credited with that correlation: its loading falls to about r / sqrt(rho), never below 0,
    and its interval is wider than the same means with the paper's loading."""
    rng = np.random.default_rng(9)
    units = 8.0 * rng.standard_normal(11)
    anchor = 30.0 + units + rng.standard_normal(11)
    placed = 31.0 + 8.0 * rng.standard_normal(11)
    r = float(np.corrcoef(placed, anchor)[0, 1])
    paper = _paper([30.0, 33.0, 27.0], [8.0, 8.0, 8.0]).assign(model=["anchor", "b", "c"])
    found = paired_rank_interval(paper, placed, {"anchor": anchor}, 0.9, np.random.default_rng(0))
    assert found.loading == pytest.approx(max(0.0, min(np.sqrt(0.9), r / np.sqrt(0.9))))
    correlated = paired_rank_interval(paper, anchor + 1.0, {"anchor": anchor}, 0.9, np.random.default_rng(0))
    assert found.high - found.low > correlated.high - correlated.low


def test_the_old_construction_golden(bench):
    """The baseline the benchmark compares with (decision 0046 before 2026-12-07): placed at 50 pp
    exactly; published means over n = 9 units with SD 3 (SE 1) at 50, 53 and 47: rank 2 or 3, and
    only the one at 47 separated below."""
    low, high, separated = bench.independent_rank_interval(np.array([50.0, 53.0, 47.0]), np.full(3, 3.0),
                                                           np.full(4000, 50.0), 9, np.random.default_rng(0))
    assert (low, high, separated) == (2, 3, 1)
