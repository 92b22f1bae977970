"""Aggregation and statistics of the run table, as the paper defines them.

A run table has one row per probe run with columns ``model, magnification, readout, taxonomy,
protocol, unit, organ, seed`` and metric columns (``macro_f1``, ``macro_auroc``, ...).

Protocol-balanced summaries (``organ_level_scores`` → ``protocol_summary``): IS averages seeds
within a section, then sections within an organ; IOCD averages seeds and held-out sections within
an organ; MOCV averages seeds within a fold; LOOO averages seeds within the held-out organ. The
reported mean ± SD is across those organ (or fold) scores, not across pooled cells or runs.

CRA (Eq. 4): per IS section, taxonomy and seed the paired difference Nuc − Mean, averaged over
seeds; the differences of both taxonomies are pooled within organ, then organs are averaged (SD
across organ values). ``cell_representation_advantage`` gives the same per taxonomy.

Intervals: every balanced mean (``protocol_summary``) and the pooled CRA carry a 95% percentile
bootstrap interval (``low``, ``high``) over the balanced units and, within each drawn unit, its
seeds (``hierarchical_bootstrap``; 2,000 replicates, seeded by the condition). Beyond the paper.

Significant wins (Supplementary C): per evaluation condition, a two-sided paired Wilcoxon
signed-rank test between two models "on their paired per-unit values over the common fold × seed
units" — every (unit, seed) pair is one paired observation, seeds are not averaged first (with five
MOCV folds averaged over seeds the smallest two-sided p would be 2/2^5 = 0.0625 and no model could
ever win). A win when p < 0.05 and the median paired difference favours the model. CRA wins are
the same test on the paired Nuc − Mean differences "over their common section × fold units"
(fold = seed in IS), per taxonomy; the pooled CRA of Table 4 pairs (section, taxonomy, seed)
units. CRT: the mean of a model's IOCD, MOCV and LOOO win counts (Tfine, Nuc, 20× by default).
Beside each win count, ``wins_holm`` counts the wins left after Holm's correction over the model's
opponents (beyond the paper, which reports uncorrected counts).
docs/decisions/0016-significance-tests.md quotes each legend.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from cellpath.vocabulary import CROSS_DOMAIN_PROTOCOLS

CONDITION = ["model", "magnification", "readout", "taxonomy", "protocol"]


# --------------------------------------------------------------------------- intervals
BOOTSTRAP_RESAMPLES = 2000
INTERVAL_LEVEL = 0.95


def condition_rng(*key: object) -> np.random.Generator:
    """A generator seeded by the condition itself (e.g. model, magnification, readout, …): an interval
    does not depend on which other conditions were computed alongside or in what order."""
    digest = hashlib.sha256("\x1f".join(map(str, key)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def hierarchical_bootstrap(values: pd.DataFrame, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of a balanced mean. ``values`` has columns ``balanced_unit, unit, value``,
    one row per (unit, seed): the estimate averages seeds within each unit, units within each balanced
    unit (organ or fold) and then balanced units. Each replicate draws the balanced units with
    replacement and, independently for every draw, the seeds of each of its units with replacement."""
    groups = [[unit["value"].to_numpy(float) for _, unit in balanced.groupby("unit", sort=True)]
              for _, balanced in values.groupby("balanced_unit", sort=True)]
    n = len(groups)
    picks = rng.integers(0, n, size=(n_resamples, n))
    draws = np.empty((n_resamples, n))
    for index, units in enumerate(groups):
        chosen = picks == index
        k = int(chosen.sum())
        if k:
            unit_means = [seeds[rng.integers(0, len(seeds), size=(k, len(seeds)))].mean(axis=1) for seeds in units]
            draws[chosen] = np.mean(unit_means, axis=0)
    return draws.mean(axis=1)


def percentile_interval(replicates: np.ndarray, level: float = INTERVAL_LEVEL) -> tuple[float, float]:
    """The equal-tailed percentile interval of bootstrap replicates."""
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(replicates, [tail, 1.0 - tail])
    return float(low), float(high)


def _interval_columns(values: pd.DataFrame, keys: list[str], n_resamples: int, *salt: str) -> pd.DataFrame:
    """``low`` / ``high`` per group of ``keys`` from :func:`hierarchical_bootstrap` of its rows, each
    seeded by its key followed by ``salt`` (what else names the quantity, e.g. the metric)."""
    rows = []
    for key, group in values.groupby(keys, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        low, high = percentile_interval(hierarchical_bootstrap(group, n_resamples, condition_rng(*key, *salt)))
        rows.append(dict(zip(keys, key)) | {"low": low, "high": high})
    return pd.DataFrame(rows, columns=[*keys, "low", "high"])


def holm_adjusted(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values: sorted ascending, the i-th of m (1-based) becomes
    min(1, max over j <= i of (m - j + 1)·p_(j)). NaN (no test) stays NaN and does not count towards
    the number of tests m. Written out rather than statsmodels' ``multipletests(method="holm")``
    (the same arithmetic; tests compare them bitwise) because that function runs ``gc.collect()`` on
    every call: 0.15 s each, 39 s of the default probe stage's 258 (docs/decisions/0030)."""
    p_values = np.asarray(p_values, dtype=float)
    adjusted = np.full(p_values.shape, np.nan)
    tested = np.flatnonzero(np.isfinite(p_values))
    order = tested[np.argsort(p_values[tested])]
    steps = np.maximum.accumulate(p_values[order] * np.arange(len(order), 0, -1))
    adjusted[order] = np.minimum(steps, 1.0)
    return adjusted


def paired_values(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One value per (condition, unit, seed): the units of the significance tests (``pair`` names
    the unit and seed, e.g. ``breast_1|seed0``)."""
    valid = runs.dropna(subset=[metric])
    pairs = valid["unit"].astype(str) + "|seed" + valid["seed"].astype(str)
    return valid[[*CONDITION, "unit", "organ", "seed"]].assign(pair=pairs.to_numpy(), score=valid[metric].to_numpy())


def unit_scores(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Seed-averaged score per evaluation unit (section, held-out section, fold or organ)."""
    valid = runs.dropna(subset=[metric])
    return (valid.groupby([*CONDITION, "unit", "organ"], dropna=False, sort=True)[metric]
            .mean().rename("score").reset_index())


def organ_level_scores(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The protocol's balanced unit scores A_u: per organ (IS, IOCD, LOOO) or per fold (MOCV)."""
    per_unit = unit_scores(runs, metric)
    mocv = per_unit["protocol"] == "mocv"
    by_fold = per_unit[mocv].assign(balanced_unit=per_unit.loc[mocv, "unit"])
    by_organ = (per_unit[~mocv].groupby([*CONDITION, "organ"], sort=True)["score"].mean().reset_index()
                .assign(balanced_unit=lambda f: f["organ"]))
    columns = [*CONDITION, "balanced_unit", "score"]
    return pd.concat([by_organ[columns], by_fold[columns]], ignore_index=True)


def seed_values(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per scored run: its condition, ``balanced_unit`` (its organ, or its fold for MOCV),
    ``unit`` and ``value`` — what :func:`hierarchical_bootstrap` resamples."""
    valid = runs.dropna(subset=[metric])
    return valid[CONDITION].assign(
        balanced_unit=np.where(valid["protocol"] == "mocv", valid["unit"].astype(str), valid["organ"].astype(str)),
        unit=valid["unit"].astype(str).to_numpy(), value=valid[metric].to_numpy(float))


def condition_replicates(runs: pd.DataFrame, metric: str, key: tuple,
                         n_resamples: int = BOOTSTRAP_RESAMPLES) -> np.ndarray:
    """The bootstrap replicates of one condition's balanced mean (``key``: its values in
    ``CONDITION`` order), the very ones :func:`protocol_summary`'s interval is read from."""
    values = seed_values(runs, metric)
    chosen = values[(values[CONDITION] == pd.Series(dict(zip(CONDITION, key)))).all(axis=1)]
    return hierarchical_bootstrap(chosen, n_resamples, condition_rng(*key, metric))


def protocol_summary(runs: pd.DataFrame, metric: str, n_resamples: int = BOOTSTRAP_RESAMPLES) -> pd.DataFrame:
    """Mean and SD across balanced units per evaluation condition (SD with ddof=1; NaN for one unit),
    and the 95% bootstrap interval of the mean (``low``, ``high``; :func:`hierarchical_bootstrap` over
    the balanced units and the seeds within them)."""
    balanced = organ_level_scores(runs, metric)
    table = (balanced.groupby(CONDITION, sort=True)["score"]
             .agg(mean="mean", sd=lambda s: s.std(ddof=1), n_units="size").reset_index())
    intervals = _interval_columns(seed_values(runs, metric), CONDITION, n_resamples, metric)
    return table.merge(intervals, on=CONDITION, how="left")


def cra_differences(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """IS Nuc − Mean per (model, magnification, taxonomy, organ, section, seed): the paired CRA values."""
    is_runs = runs[(runs["protocol"] == "is") & runs["readout"].isin(["Nuc", "Mean"])]
    keys = ["model", "magnification", "taxonomy", "organ", "unit", "seed"]
    wide = is_runs.pivot_table(index=keys, columns="readout", values=metric, aggfunc="first")
    if not {"Nuc", "Mean"} <= set(wide.columns):
        return pd.DataFrame(columns=[*keys, "diff"])
    wide = wide[["Nuc", "Mean"]].dropna()
    return (wide["Nuc"] - wide["Mean"]).rename("diff").reset_index()


def cell_representation_advantage(runs: pd.DataFrame, metric: str, alpha: float = 0.05) -> pd.DataFrame:
    """CRA per (model, magnification, taxonomy): IS Nuc − Mean, seeds → sections → organs → mean, and
    its significant wins over the paired (section, seed) differences of that taxonomy."""
    diffs = cra_differences(runs, metric)
    columns = ["model", "magnification", "taxonomy", "cra", "wins"]
    if diffs.empty:
        return pd.DataFrame(columns=columns)
    per_section = diffs.groupby(["model", "magnification", "taxonomy", "organ", "unit"])["diff"].mean()
    per_organ = per_section.groupby(["model", "magnification", "taxonomy", "organ"]).mean()
    table = per_organ.groupby(["model", "magnification", "taxonomy"]).mean().rename("cra").reset_index()
    pairs = diffs.assign(unit=diffs["unit"].astype(str) + "|seed" + diffs["seed"].astype(str), score=diffs["diff"])
    won = [pairwise_wins(group[["model", "unit", "score"]], alpha).groupby("model")["win"].sum()
           .rename("wins").reset_index().assign(magnification=mag, taxonomy=tax)
           for (mag, tax), group in pairs.groupby(["magnification", "taxonomy"], sort=True)]
    table = table.merge(pd.concat(won, ignore_index=True), on=["model", "magnification", "taxonomy"], how="left")
    return table.assign(wins=table["wins"].fillna(0).astype(int))[columns]


def pooled_cell_representation_advantage(runs: pd.DataFrame, metric: str, magnification: str,
                                         alpha: float = 0.05) -> pd.DataFrame:
    """The paper's CRA (Eq. 4) per model, both taxonomies pooled within organ, with its SD across
    organs and its significant wins (Wilcoxon over common (section, taxonomy, seed) differences)."""
    diffs = cra_differences(runs, metric)
    diffs = diffs[diffs["magnification"] == magnification]
    columns = ["model", "magnification", "cra", "sd", "n_organs", "low", "high", "wins", "wins_holm"]
    if diffs.empty:
        return pd.DataFrame(columns=columns)
    per_section = diffs.groupby(["model", "organ", "unit", "taxonomy"], sort=True)["diff"].mean()
    per_organ = per_section.groupby(["model", "organ"]).mean()
    table = per_organ.groupby("model").agg(cra="mean", sd=lambda s: s.std(ddof=1), n_organs="size")
    pairs = diffs["unit"].astype(str) + "|" + diffs["taxonomy"] + "|seed" + diffs["seed"].astype(str)
    scores = diffs.assign(unit=pairs, score=diffs["diff"])
    tested = pairwise_wins(scores[["model", "unit", "score"]], alpha).groupby("model")
    wins, holm = tested["win"].sum(), tested["win_holm"].sum()
    table = table.assign(wins=wins.reindex(table.index, fill_value=0).astype(int),
                         wins_holm=holm.reindex(table.index, fill_value=0).astype(int), magnification=magnification)
    per_seed = diffs.assign(balanced_unit=diffs["organ"].astype(str),
                            unit=diffs["unit"].astype(str) + "|" + diffs["taxonomy"], value=diffs["diff"])
    intervals = _interval_columns(per_seed, ["model"], BOOTSTRAP_RESAMPLES,
                                  f"cra|{metric}|{magnification}").set_index("model")
    return table.join(intervals).reset_index()[columns]


def is_section_summary(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """IS per (model, magnification, readout, taxonomy) as the supplement's IS tables report it: the
    organ-balanced mean (seeds → sections → organs → mean) with the sample SD across the sections'
    seed-averaged scores ("so it measures between-section variability")."""
    is_runs = runs[runs["protocol"] == "is"].dropna(subset=[metric])
    keys = ["model", "magnification", "readout", "taxonomy"]
    columns = [*keys, "mean", "sd", "n_sections"]
    if is_runs.empty:
        return pd.DataFrame(columns=columns)
    per_section = is_runs.groupby([*keys, "organ", "unit"], sort=True)[metric].mean()
    per_organ = per_section.groupby([*keys, "organ"]).mean()
    table = per_organ.groupby(keys).mean().rename("mean").to_frame()
    spread = per_section.groupby(keys).agg(sd=lambda s: s.std(ddof=1), n_sections="size")
    return table.join(spread).reset_index()[columns]


def nested_panel_tables(runs: pd.DataFrame, panels: dict[str, list[str]], metrics: tuple[str, ...],
                        alpha: float = 0.05) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The supplement's IS tables for each nested panel (``panels``: name → its section ids).

    IS trains and tests inside one section, so a smaller panel's IS results are the larger panel's
    runs of its sections: nothing is refitted. Returns (readouts: panel, metric and
    ``is_section_summary`` columns; CRA: panel, metric and ``cell_representation_advantage``
    columns with its wins), each computed from that panel's sections alone."""
    readouts, cra = [], []
    for name, members in panels.items():
        chosen = runs[(runs["protocol"] == "is") & runs["unit"].isin(members)]
        for metric in metrics:
            readouts.append(is_section_summary(chosen, metric).assign(panel=name, metric=metric))
            cra.append(cell_representation_advantage(chosen, metric, alpha).assign(panel=name, metric=metric))
    first = ["panel", "metric"]

    def ordered(frames: list[pd.DataFrame]) -> pd.DataFrame:
        frame = pd.concat(frames, ignore_index=True)
        return frame[first + [c for c in frame.columns if c not in first]]

    return ordered(readouts), ordered(cra)


ROUNDING_TIE = 1e-12  # |paired difference| below this is floating-point rounding (scores lie in [0, 1]): a tie
PERMUTATION_UNITS = 13  # scipy's wilcoxon enumerates all 2^n sign flips at up to this many differences with ties or zeros


def signed_rank_p(diff: np.ndarray) -> float:
    """Two-sided p-value of the Wilcoxon signed-rank test of paired differences ``diff`` (zeros
    dropped, Wilcoxon's method): scipy's ``wilcoxon`` (method "auto"), with its exact permutation
    test over every sign flip, used at up to 13 differences with ties or zeros, run vectorised. Inside
    scipy that test evaluates the statistic once per flip in a Python loop (0.6 s per pair, hours over
    the paper's pairs and conditions); here the ranks of |diff| are computed once, as flips do not
    change them, and the same ``permutation_test`` gives the same null distribution and p-value."""
    diff = np.asarray(diff, dtype=float)
    nonzero = np.abs(diff[diff != 0])
    exact_flips = len(diff) <= PERMUTATION_UNITS and (len(nonzero) < len(diff)
                                                      or len(np.unique(nonzero)) < len(nonzero))
    if not exact_flips:
        return float(scipy_stats.wilcoxon(diff, alternative="two-sided").pvalue)
    ranks = np.zeros(len(diff))
    ranks[diff != 0] = scipy_stats.rankdata(nonzero)  # average ranks of the nonzero |differences|

    def positive_rank_sum(flipped: np.ndarray, axis: int) -> np.ndarray:
        return np.sum((flipped > 0) * ranks, axis=axis)

    return float(scipy_stats.permutation_test((diff,), positive_rank_sum, permutation_type="samples",
                                              vectorized=True, n_resamples=9999, alternative="two-sided",
                                              axis=-1).pvalue)


def pairwise_wins(scores: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Significant wins among models for one condition: ``scores`` has columns model, unit, score.

    Returns one row per ordered pair (model, opponent) with the p-value, the median paired
    difference and ``win`` (the paper's, uncorrected), and ``p_holm`` / ``win_holm``: the p-value
    Holm-adjusted over the model's opponents (a family of up to 29 tests per model), a win at
    ``p_holm < alpha``. Differences within ``ROUNDING_TIE`` of zero are ties and, as exact zeros,
    are dropped by the test (scipy's ``zero_method="wilcox"``); pairs with fewer than two units, or
    only ties, record no win and are no test of the Holm family.
    """
    table = scores.pivot_table(index="unit", columns="model", values="score", aggfunc="first")
    rows = []
    for a, b in itertools.permutations(sorted(table.columns), 2):
        common = table[[a, b]].dropna()
        diff = (common[a] - common[b]).to_numpy()
        diff = np.where(np.abs(diff) < ROUNDING_TIE, 0.0, diff)
        p_value, median = np.nan, float(np.median(diff)) if len(diff) else np.nan
        if len(diff) >= 2 and np.any(diff != 0):
            p_value = signed_rank_p(diff)
        rows.append({"model": a, "opponent": b, "n_units": len(diff), "median_diff": median, "p_value": p_value,
                     "win": bool(p_value < alpha and median > 0) if not np.isnan(p_value) else False})
    table = pd.DataFrame(rows, columns=["model", "opponent", "n_units", "median_diff", "p_value", "win"])
    table["p_holm"] = np.nan
    for _, family in table.groupby("model", sort=False):
        table.loc[family.index, "p_holm"] = holm_adjusted(family["p_value"].to_numpy())
    table["win_holm"] = (table["p_holm"] < alpha) & (table["median_diff"] > 0)
    return table


def win_counts(runs: pd.DataFrame, metric: str, alpha: float = 0.05) -> pd.DataFrame:
    """Significant-win count per model for every (magnification, readout, taxonomy, protocol), over
    the paired (unit, seed) values (``paired_values``)."""
    pairs = paired_values(runs, metric)
    frames = []
    for condition, group in pairs.groupby(["magnification", "readout", "taxonomy", "protocol"], sort=True):
        wins = pairwise_wins(group[["model", "pair", "score"]].rename(columns={"pair": "unit"}), alpha)
        models = sorted(group["model"].unique())
        per_model = wins.groupby("model")[["win", "win_holm"]].sum().reindex(models, fill_value=0).astype(int)
        frame = pd.DataFrame({"model": models, "wins": per_model["win"].to_numpy(),
                              "wins_holm": per_model["win_holm"].to_numpy()})
        for key, value in zip(["magnification", "readout", "taxonomy", "protocol"], condition):
            frame[key] = value
        frames.append(frame)
    columns = ["model", "magnification", "readout", "taxonomy", "protocol", "wins", "wins_holm"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def cell_representation_transferability(wins: pd.DataFrame, *, taxonomy: str = "fine", readout: str = "Nuc",
                                        magnification: str = "20x") -> pd.DataFrame:
    """CRT per model: mean of its IOCD, MOCV and LOOO win counts in one condition."""
    chosen = wins[(wins["taxonomy"] == taxonomy) & (wins["readout"] == readout)
                  & (wins["magnification"] == magnification) & wins["protocol"].isin(CROSS_DOMAIN_PROTOCOLS)]
    table = chosen.pivot_table(index="model", columns="protocol", values="wins", aggfunc="first")
    table = table.reindex(columns=list(CROSS_DOMAIN_PROTOCOLS))
    return table.assign(crt=table.mean(axis=1, skipna=False)).reset_index()


def taxonomy_rank_agreement(summary: pd.DataFrame, *, protocol: str, readout: str = "Nuc",
                            magnification: str = "20x") -> float:
    """Spearman correlation of model means between the fine and coarse taxonomies (NaN with fewer than
    three models scored under both, e.g. when a taxonomy's runs were all skipped by the class gates)."""
    chosen = summary[(summary["protocol"] == protocol) & (summary["readout"] == readout)
                     & (summary["magnification"] == magnification)]
    table = chosen.pivot_table(index="model", columns="taxonomy", values="mean", aggfunc="first")
    table = table.reindex(columns=["fine", "coarse"]).dropna()
    if len(table) < 3:
        return float("nan")
    return float(scipy_stats.spearmanr(table["fine"], table["coarse"]).statistic)
