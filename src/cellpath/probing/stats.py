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

Significant wins (Supplementary C): per evaluation condition, a two-sided paired Wilcoxon
signed-rank test between two models "on their paired per-unit values over the common fold × seed
units" — every (unit, seed) pair is one paired observation, seeds are not averaged first (with five
MOCV folds averaged over seeds the smallest two-sided p would be 2/2^5 = 0.0625 and no model could
ever win). A win when p < 0.05 and the median paired difference favours the model. CRA wins are
the same test on the paired Nuc − Mean differences "over their common section × fold units"
(fold = seed in IS), per taxonomy; the pooled CRA of Table 4 pairs (section, taxonomy, seed)
units. CRT: the mean of a model's IOCD, MOCV and LOOO win counts (Tfine, Nuc, 20× by default).
docs/decisions/0016-significance-tests.md quotes each legend.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from cellpath.vocabulary import CROSS_DOMAIN_PROTOCOLS

CONDITION = ["model", "magnification", "readout", "taxonomy", "protocol"]


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


def protocol_summary(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Mean and SD across balanced units per evaluation condition (SD with ddof=1; NaN for one unit)."""
    balanced = organ_level_scores(runs, metric)
    return (balanced.groupby(CONDITION, sort=True)["score"]
            .agg(mean="mean", sd=lambda s: s.std(ddof=1), n_units="size").reset_index())


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
    columns = ["model", "magnification", "cra", "sd", "n_organs", "wins"]
    if diffs.empty:
        return pd.DataFrame(columns=columns)
    per_section = diffs.groupby(["model", "organ", "unit", "taxonomy"], sort=True)["diff"].mean()
    per_organ = per_section.groupby(["model", "organ"]).mean()
    table = per_organ.groupby("model").agg(cra="mean", sd=lambda s: s.std(ddof=1), n_organs="size")
    pairs = diffs["unit"].astype(str) + "|" + diffs["taxonomy"] + "|seed" + diffs["seed"].astype(str)
    scores = diffs.assign(unit=pairs, score=diffs["diff"])
    wins = pairwise_wins(scores[["model", "unit", "score"]], alpha).groupby("model")["win"].sum()
    table = table.assign(wins=wins.reindex(table.index, fill_value=0).astype(int), magnification=magnification)
    return table.reset_index()[columns]


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


def pairwise_wins(scores: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Significant wins among models for one condition: ``scores`` has columns model, unit, score.

    Returns one row per ordered pair (model, opponent) with the p-value, the median paired
    difference and ``win``. Differences within ``ROUNDING_TIE`` of zero are ties and, as exact
    zeros, are dropped by the test (scipy's ``zero_method="wilcox"``); pairs with fewer than two
    units, or only ties, record no win.
    """
    table = scores.pivot_table(index="unit", columns="model", values="score", aggfunc="first")
    rows = []
    for a, b in itertools.permutations(sorted(table.columns), 2):
        common = table[[a, b]].dropna()
        diff = (common[a] - common[b]).to_numpy()
        diff = np.where(np.abs(diff) < ROUNDING_TIE, 0.0, diff)
        p_value, median = np.nan, float(np.median(diff)) if len(diff) else np.nan
        if len(diff) >= 2 and np.any(diff != 0):
            p_value = float(scipy_stats.wilcoxon(diff, alternative="two-sided").pvalue)
        rows.append({"model": a, "opponent": b, "n_units": len(diff), "median_diff": median, "p_value": p_value,
                     "win": bool(p_value < alpha and median > 0) if not np.isnan(p_value) else False})
    return pd.DataFrame(rows, columns=["model", "opponent", "n_units", "median_diff", "p_value", "win"])


def win_counts(runs: pd.DataFrame, metric: str, alpha: float = 0.05) -> pd.DataFrame:
    """Significant-win count per model for every (magnification, readout, taxonomy, protocol), over
    the paired (unit, seed) values (``paired_values``)."""
    pairs = paired_values(runs, metric)
    frames = []
    for condition, group in pairs.groupby(["magnification", "readout", "taxonomy", "protocol"], sort=True):
        wins = pairwise_wins(group[["model", "pair", "score"]].rename(columns={"pair": "unit"}), alpha)
        counts = wins.groupby("model")["win"].sum().reindex(sorted(group["model"].unique()), fill_value=0)
        frame = counts.astype(int).rename("wins").reset_index()
        for key, value in zip(["magnification", "readout", "taxonomy", "protocol"], condition):
            frame[key] = value
        frames.append(frame)
    columns = ["model", "magnification", "readout", "taxonomy", "protocol", "wins"]
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
    """Spearman correlation of model means between the fine and coarse taxonomies."""
    chosen = summary[(summary["protocol"] == protocol) & (summary["readout"] == readout)
                     & (summary["magnification"] == magnification)]
    table = chosen.pivot_table(index="model", columns="taxonomy", values="mean", aggfunc="first").dropna()
    if len(table) < 3:
        return float("nan")
    return float(scipy_stats.spearmanr(table["fine"], table["coarse"]).statistic)
