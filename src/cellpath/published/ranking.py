"""A placed model's rank among the paper's models, from paired differences (docs/decisions/0046).

The paper publishes, per model and condition, a balanced mean and the SD of its n balanced units, and
per cross-domain protocol how many models each one beats in a paired Wilcoxon test; it does not
publish per-unit values. Models scored on the same units are strongly correlated (a hard organ is
hard for all), so this module models the per-unit values of every model with one shared unit factor:

    y_ku = mu_k + s_k (lambda_k z_u + sqrt(1 - lambda_k^2) e_ku),   lambda_k = sqrt(rho) for the paper's models,

with ``rho`` fitted to the published win counts (:func:`fit_unit_correlation`). A placed model is
run beside one or more of the paper's models (*anchors*) on the same units and seeds: its value on
the paper's scale is an anchor's published mean plus the paired difference, and its own loading
comes from its correlation with the anchors. Each draw of the mean errors (a multivariate t with
n - 1 degrees of freedom: the SDs are estimated from the same n units) gives every true difference
with the published models and so a rank; the interval is the draws' equal-tailed range. Its coverage
of the true rank is measured by simulation (benchmarks/bench_placement.py), not guaranteed by
construction. Pure: numbers in, numbers out; means and SDs in percentage points.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats

RANK_LEVEL = 0.95  # the rank interval's nominal coverage
WILCOXON_ALPHA = 0.05  # the paper's win threshold (two-sided)
WILCOXON_EFFICIENCY = 3.0 / np.pi  # asymptotic efficiency of the signed-rank test against the t test (normal data)
RHO_GRID = np.round(np.arange(0.0, 0.9901, 0.01), 2)  # the unit correlations a fit chooses from
DRAWS = 8000  # joint draws of the mean errors behind one interval


def expected_wins(means: np.ndarray, sds: np.ndarray, rho: float, n_pairs: int) -> np.ndarray:
    """Per model, the expected number of the others it beats (a two-sided paired Wilcoxon test at
    :data:`WILCOXON_ALPHA` over ``n_pairs`` unit × seed pairs, median in its favour) when per-unit
    values follow the one-factor model with correlation ``rho``: the power of a paired t test over
    n · 3/pi pairs (the signed-rank test's efficiency), noncentrality sqrt(n · 3/pi) · delta / sigma,
    delta the difference of means and sigma the SD of the per-unit difference,
    sqrt(s_j² + s_k² - 2 rho s_j s_k). Within 0.01 of scipy's test by simulation at 15–69 pairs."""
    means, sds = np.asarray(means, float), np.asarray(sds, float)
    delta = means[:, None] - means[None, :]
    sigma = np.sqrt(np.maximum(sds[:, None] ** 2 + sds[None, :] ** 2 - 2.0 * rho * sds[:, None] * sds[None, :], 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        noncentrality = np.where(sigma > 0, delta / sigma, np.sign(delta) * 1e6) * np.sqrt(n_pairs * WILCOXON_EFFICIENCY)
    power = stats.nct.sf(stats.t.ppf(1.0 - WILCOXON_ALPHA / 2.0, n_pairs - 1), n_pairs - 1, noncentrality)
    np.fill_diagonal(power, 0.0)
    return power.sum(axis=1)


@dataclass(frozen=True)
class UnitCorrelation:
    """The shared-unit correlation ``rho`` of one protocol and where it comes from: fitted to the
    published wins (``wins_rmse``: the fit's root-mean-square error in wins per model) or borrowed."""

    rho: float
    source: str
    wins_rmse: float = float("nan")


def fit_unit_correlation(means: np.ndarray, sds: np.ndarray, wins: np.ndarray, n_pairs: int,
                         source: str) -> UnitCorrelation:
    """The ``rho`` of :data:`RHO_GRID` whose :func:`expected_wins` are closest (least squares) to the
    published ``wins`` of the same models; ties go to the smaller ``rho`` (the wider intervals)."""
    wins = np.asarray(wins, float)
    errors = np.array([np.sum((expected_wins(means, sds, rho, n_pairs) - wins) ** 2) for rho in RHO_GRID])
    best = int(np.argmin(errors))
    return UnitCorrelation(float(RHO_GRID[best]), source, float(np.sqrt(errors[best] / len(wins))))


@dataclass(frozen=True)
class RankInterval:
    """A placed model in one condition: its ``mean`` on the paper's scale (pp; an anchor's published
    mean plus the paired difference, averaged over anchors), its ``rank`` among the published models
    (1 + those above), the ``level`` interval ``low``–``high``, the published models above it in
    between 2.5 % and 97.5 % of the draws (``not_separable``), how many are above it in fewer than
    2.5 % (``beats``), its unit loading ``loading`` and the anchors it was calibrated on."""

    mean: float
    rank: int
    low: int
    high: int
    not_separable: list[str]
    beats: int
    loading: float
    n_units: int
    anchors: list[str] = field(default_factory=list)


def paired_rank_interval(paper: pd.DataFrame, placed: np.ndarray, anchors: dict[str, np.ndarray], rho: float,
                         rng: np.random.Generator, level: float = RANK_LEVEL, n_draws: int = DRAWS) -> RankInterval:
    """The rank of a placed model among ``paper``'s models (columns model, mean, sd; pp; the SD across
    the same n balanced units the placed values are on).

    ``placed``: the placed model's balanced-unit scores (pp, seeds averaged), one per unit;
    ``anchors``: published model name → its scores in this run on the same units, in the same order
    (empty: the placed model's own mean is used, uncalibrated, with the paper's loading);
    ``rho``: the protocol's unit correlation (:func:`fit_unit_correlation`). The placed model's
    loading is sqrt(rho), lowered to r / sqrt(rho) when its mean correlation r with the anchors says it
    follows the shared unit effect less than the paper's models do (never raised above them)."""
    placed = np.asarray(placed, float)
    n = len(placed)
    if n < 2:
        raise ValueError(f"a rank interval needs at least 2 balanced units, got {n}")
    names = [str(m) for m in paper["model"]]
    means, sds = paper["mean"].to_numpy(float), paper["sd"].to_numpy(float)
    if not (np.isfinite(means).all() and np.isfinite(sds).all()):
        raise ValueError("every published model needs a finite mean and SD")
    published = dict(zip(names, means))
    loading = np.sqrt(rho)
    if anchors:
        level_estimates = [published[a] + float(np.mean(placed - np.asarray(v, float))) for a, v in anchors.items()]
        mean = float(np.mean(level_estimates))
        if n >= 3 and placed.std() > 0 and all(np.std(v) > 0 for v in anchors.values()):
            r = float(np.mean([np.corrcoef(placed, np.asarray(v, float))[0, 1] for v in anchors.values()]))
            loading = float(np.clip(min(loading, r / loading if loading > 0 else 0.0), 0.0, 1.0))
    else:
        mean = float(np.mean(placed))
    s_placed = float(np.std(placed, ddof=1))
    # mean errors of the published models and of the placed one: one shared unit draw, independent
    # idiosyncratic draws, one shared variance scale (a multivariate t with n - 1 degrees of freedom)
    shared = rng.standard_normal(n_draws)[:, None]
    own = rng.standard_normal((n_draws, len(names) + 1))
    scale = np.sqrt((n - 1) / rng.chisquare(n - 1, n_draws))[:, None] / np.sqrt(n)
    loadings = np.append(np.full(len(names), np.sqrt(rho)), loading)
    errors = np.append(sds, s_placed) * (loadings * shared + np.sqrt(1.0 - loadings ** 2) * own) * scale
    delta = means - mean  # published − placed, pp
    above = (delta - (errors[:, :-1] - errors[:, -1:])) > 0  # per draw, the true differences' signs
    ranks = 1 + above.sum(axis=1)
    tail = (1.0 - level) / 2.0
    share = above.mean(axis=0)
    return RankInterval(mean=mean, rank=1 + int((delta > 0).sum()),
                        low=int(np.quantile(ranks, tail, method="lower")),
                        high=int(np.quantile(ranks, 1.0 - tail, method="higher")),
                        not_separable=[m for m, q in zip(names, share) if tail <= q <= 1.0 - tail],
                        beats=int((share < tail).sum()), loading=loading, n_units=n, anchors=list(anchors))
