"""A run's models against the paper's 30 (ranked among them only when comparable), whether the run is
comparable, and the reproduction check.

Everything here is pure: the published table (:func:`cellpath.published.load_published`), this run's
protocol summary (``probe/summary.csv``: fractions) and what the run was (:class:`RunConfiguration`)
go in; tables in percentage points, as the paper prints them, come out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from cellpath.vocabulary import (HEADLINE_READOUT, HEADLINE_TAXONOMY, PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS,
                                 PAPER_MOCV_FOLDS, PAPER_PANEL, PAPER_PANEL_SIZES, PAPER_SEEDS)

Z_95 = 1.959964  # two-sided 95 % normal quantile
RANK_LEVEL = 0.95  # the rank interval's coverage


@dataclass(frozen=True)
class RunConfiguration:
    """What a run evaluated, as far as comparability with the paper goes."""

    source: str  # "10x" or "synthetic"
    panel: str
    panel_sizes: tuple[int, ...]
    panel_sections: frozenset[str]  # the evaluated panel's section ids
    paper_panel_sections: frozenset[str]  # the paper's S25 (data/manifests/xenium_datasets.csv, panel_s25)
    seeds: dict[str, int]
    mocv_folds: int
    min_train_cells: dict[str, int]
    min_test_cells: dict[str, int]
    max_train_cells: int | None


def comparability(run: RunConfiguration) -> list[str]:
    """Why the run's numbers cannot be read against the paper's (empty: they can)."""
    reasons = []
    if run.source != "10x":
        reasons.append("simulated panel (source: synthetic), not the 10x sections")
    if run.panel != PAPER_PANEL or tuple(run.panel_sizes) != PAPER_PANEL_SIZES:
        reasons.append(f"another panel ({run.panel} of {list(run.panel_sizes)}; the paper: {PAPER_PANEL} of "
                       f"{list(PAPER_PANEL_SIZES)})")
    elif run.source == "10x" and run.panel_sections != run.paper_panel_sections:
        reasons.append(f"another S25: {len(run.panel_sections ^ run.paper_panel_sections)} sections differ from the "
                       "paper's")
    if run.seeds != PAPER_SEEDS or run.mocv_folds != PAPER_MOCV_FOLDS:
        reasons.append(f"other seeds or folds ({run.seeds}, {run.mocv_folds} MOCV folds; the paper: {PAPER_SEEDS}, "
                       f"{PAPER_MOCV_FOLDS})")
    if run.min_train_cells != PAPER_MIN_TRAIN_CELLS or run.min_test_cells != PAPER_MIN_TEST_CELLS:
        reasons.append(f"other class gates (train {run.min_train_cells}, test {run.min_test_cells}; the paper: train "
                       f"{PAPER_MIN_TRAIN_CELLS}, test {PAPER_MIN_TEST_CELLS})")
    if run.max_train_cells is not None:
        reasons.append(f"training cells capped at {run.max_train_cells} per run (the paper: no cap)")
    return reasons


def published_condition(published: pd.DataFrame, *, protocol: str, magnification: str, readout: str,
                        taxonomy: str, metric: str = "macro_f1", panel: str = PAPER_PANEL) -> pd.DataFrame:
    """The paper's value of every model in one condition (model, mean, sd, table): from the
    supplement's complete table where there is one, else from Table 4 / 5."""
    rows = published[(published["protocol"] == protocol) & (published["magnification"] == magnification)
                     & (published["readout"] == readout) & (published["taxonomy"] == taxonomy)
                     & (published["metric"] == metric) & (published["panel"] == panel)]
    if rows.empty:
        return pd.DataFrame(columns=["model", "mean", "sd", "table"])
    table = int(rows["table"].max())  # the supplement's complete tables come after Tables 4 and 5
    chosen = rows[rows["table"] == table]
    return chosen[["model", "mean", "sd", "table"]].astype({"mean": float, "sd": float}).reset_index(drop=True)


def condition_means(published: pd.DataFrame, ours: pd.DataFrame, names: dict[str, str], *, protocols: list[str],
                    magnification: str, readout: str = HEADLINE_READOUT, taxonomy: str = HEADLINE_TAXONOMY,
                    metric: str = "macro_f1") -> pd.DataFrame:
    """The paper's models and this run's in one condition: one row per (``source``: "paper" or "this
    run", ``model``), per protocol its mean (pp). ``ours``: this run's protocol summary (fractions);
    ``names``: this run's model slug → display name. Rows in order of first appearance."""
    columns: dict[str, pd.Series] = {}
    index: list[tuple[str, str]] = []
    for protocol in protocols:
        paper = published_condition(published, protocol=protocol, magnification=magnification, readout=readout,
                                    taxonomy=taxonomy, metric=metric)
        mine = ours[(ours["protocol"] == protocol) & (ours["magnification"] == magnification)
                    & (ours["readout"] == readout) & (ours["taxonomy"] == taxonomy)]
        if "metric" in mine.columns:
            mine = mine[mine["metric"] == metric]
        values = {("paper", m): v for m, v in zip(paper["model"], paper["mean"])}
        values |= {("this run", names.get(m, m)): 100.0 * float(v) for m, v in zip(mine["model"], mine["mean"])}
        columns[protocol] = pd.Series(values, dtype=float)
        index += [k for k in values if k not in index]
    if not index:
        return pd.DataFrame(columns=["source", "model", *protocols])
    table = pd.DataFrame(columns, index=pd.MultiIndex.from_tuples(index, names=["source", "model"]))
    return table.reset_index()


def with_ranks(means: pd.DataFrame, protocols: list[str]) -> pd.DataFrame:
    """``means`` (:func:`condition_means` rows) with a rank per protocol among the paper's models plus
    the row itself (1 = best: 1 + the number of the paper's models with a higher mean), ordered by the
    first protocol's mean."""
    table = means.copy()
    paper = table["source"] == "paper"
    for protocol in protocols:
        paper_values = table.loc[paper, protocol].dropna().to_numpy()
        table[f"{protocol} rank"] = [np.nan if np.isnan(v) else 1 + int((paper_values > v).sum())
                                     for v in table[protocol]]
    return table.sort_values(protocols[0], ascending=False, na_position="last", kind="mergesort")


@dataclass(frozen=True)
class Placement:
    """This run against the paper in one condition. ``ranked``: the paper's models, ranked, with this
    run's among them only when the run is comparable; ``beside``: this run's rows with their means
    and no rank when it is not (empty when it is); ``reasons``: why it is not comparable (empty: it is)."""

    ranked: pd.DataFrame
    beside: pd.DataFrame
    reasons: tuple[str, ...]

    @property
    def comparable(self) -> bool:
        """Whether the run is the paper's configuration (and so ranked)."""
        return not self.reasons


def placement(published: pd.DataFrame, ours: pd.DataFrame, names: dict[str, str], run: RunConfiguration, *,
              protocols: list[str], magnification: str, readout: str = HEADLINE_READOUT,
              taxonomy: str = HEADLINE_TAXONOMY, metric: str = "macro_f1") -> Placement:
    """This run's models ranked among the paper's models when ``run`` is the paper's configuration;
    otherwise the paper's models ranked among themselves and this run's shown beside them, unranked
    (a rank is a claim a different configuration cannot make). Means in pp; ``ours``: this run's
    protocol summary (fractions); ``names``: this run's model slug → display name."""
    means = condition_means(published, ours, names, protocols=protocols, magnification=magnification,
                            readout=readout, taxonomy=taxonomy, metric=metric)
    reasons = tuple(comparability(run))
    if not protocols or means.empty:
        return Placement(means, means.iloc[:0], reasons)
    if not reasons:
        return Placement(with_ranks(means, protocols).reset_index(drop=True), means.iloc[:0], reasons)
    mine = means["source"] == "this run"
    beside = means[mine].sort_values(protocols[0], ascending=False, na_position="last", kind="mergesort")
    return Placement(with_ranks(means[~mine], protocols).reset_index(drop=True), beside.reset_index(drop=True),
                     reasons)


def rank_interval(paper: pd.DataFrame, replicates: np.ndarray, n_units: int, rng: np.random.Generator,
                  level: float = RANK_LEVEL) -> dict:
    """A placed model's rank among the paper's models in one condition, with its ``level`` interval and
    the paper's models it cannot be told apart from.

    ``paper``: the condition's published rows (model, mean, sd; pp, :func:`published_condition`);
    ``replicates``: bootstrap replicates of the placed model's balanced mean (pp; the report's
    hierarchical bootstrap over its units and seeds); ``n_units``: the balanced units each published
    mean averages (the placed run's, which is the paper's when the run is comparable). Each draw pairs
    one replicate with a draw of every published mean from Normal(mean, SD / √n) — the sampling
    distribution of a mean over n units whose SD the paper reports, drawn independently per model
    (docs/decisions/0046) — and counts the published means above it. The interval is the draws'
    equal-tailed quantiles of that rank; a published model is *not separable* when the share of draws
    in which it is above the placed model lies within the interval's tails (both orders plausible)."""
    means = paper["mean"].to_numpy(float)
    errors = np.nan_to_num(paper["sd"].to_numpy(float)) / np.sqrt(max(n_units, 1))
    draws = means + errors * rng.standard_normal((len(replicates), len(means)))
    above = draws > np.asarray(replicates, float)[:, None]
    ranks = 1 + above.sum(axis=1)
    tail = (1.0 - level) / 2.0
    share = above.mean(axis=0)
    return {"low": int(np.quantile(ranks, tail, method="lower")),
            "high": int(np.quantile(ranks, 1.0 - tail, method="higher")),
            "not_separable": [str(m) for m, q in zip(paper["model"], share) if tail <= q <= 1.0 - tail]}


def reproduction(published: pd.DataFrame, ours: pd.DataFrame, names: dict[str, str]) -> pd.DataFrame:
    """Ours − published for every (model, condition) both have, in pp. ``ours``: the protocol summary
    (fractions, with ``n_units``); ``names``: slug → the paper's model name (models the paper did not
    test are left out). The tolerance is what the paper's SD implies for a mean over the same number
    of balanced units: ±1.96 · SD / √n (a 95 % band for the mean; n = this run's ``n_units``, the
    paper's when the run is the paper's configuration); ``outside`` flags a difference beyond it."""
    keys = ["protocol", "magnification", "readout", "taxonomy", "metric"]
    mine = ours.assign(model=ours["model"].map(names)).dropna(subset=["model"])
    rows = []
    for key, group in mine.groupby(keys, sort=True):
        condition = dict(zip(keys, key))
        paper = published_condition(published, **condition).set_index("model")
        for row in group.itertuples():
            if row.model not in paper.index:
                continue
            ref = paper.loc[row.model]
            ours_pp = 100.0 * float(row.mean)
            tolerance = Z_95 * float(ref["sd"]) / np.sqrt(float(row.n_units)) if np.isfinite(ref["sd"]) else np.nan
            diff = ours_pp - float(ref["mean"])
            rows.append(condition | {"model": row.model, "table": int(ref["table"]), "published": float(ref["mean"]),
                                     "published_sd": float(ref["sd"]), "ours": ours_pp, "difference": diff,
                                     "tolerance": tolerance, "n_units": int(row.n_units),
                                     "outside": bool(np.isfinite(tolerance) and abs(diff) > tolerance)})
    columns = ["model", *keys, "table", "published", "published_sd", "ours", "difference", "tolerance", "n_units",
               "outside"]
    return pd.DataFrame(rows, columns=columns)
