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

from cellpath.published.ranking import UnitCorrelation, fit_unit_correlation
from cellpath.vocabulary import (CROSS_DOMAIN_PROTOCOLS, HEADLINE_READOUT, HEADLINE_TAXONOMY, PAPER_MIN_TEST_CELLS,
                                 PAPER_MIN_TRAIN_CELLS, PAPER_MOCV_FOLDS, PAPER_PANEL, PAPER_PANEL_SIZES, PAPER_SEEDS,
                                 PAPER_WILCOXON_UNITS, PROTOCOL_LABELS, PROTOCOLS)

Z_95 = 1.959964  # two-sided 95 % normal quantile


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


#: The main-text table whose SD is across the IS condition's balanced units (11 organs; Table 4's
#: legend). The supplement's IS tables give the same means with the SD across the 25 sections.
IS_ORGAN_SD_TABLE = 4


def published_condition(published: pd.DataFrame, *, protocol: str, magnification: str, readout: str,
                        taxonomy: str, metric: str = "macro_f1", panel: str = PAPER_PANEL) -> pd.DataFrame:
    """The paper's value of every model in one condition: ``model, mean, sd, table, wins, sd_across``.

    The SD is the one across the protocol's balanced units wherever the paper prints it: for IS,
    Table 4 (SD across organs) where it has the condition, else the supplement's table, whose SD is
    across sections (``sd_across``: "sections"); for IOCD, MOCV and LOOO the supplement's table, equal
    to Table 5, SD across organs or folds ("balanced units"). ``wins``: the table's win counts where
    they are of this condition's metric on Nuc (the cross-domain tables); NaN for IS, whose counts are
    of CRA."""
    columns = ["model", "mean", "sd", "table", "wins", "sd_across"]
    rows = published[(published["protocol"] == protocol) & (published["magnification"] == magnification)
                     & (published["readout"] == readout) & (published["taxonomy"] == taxonomy)
                     & (published["metric"] == metric) & (published["panel"] == panel)]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    organ_sd = rows[rows["table"] == IS_ORGAN_SD_TABLE] if protocol == "is" else rows.iloc[:0]
    table = IS_ORGAN_SD_TABLE if len(organ_sd) else int(rows["table"].max())  # the supplement's come last
    chosen = rows[rows["table"] == table].astype({"mean": float, "sd": float})
    wins = chosen["wins"].astype(float) if protocol != "is" and readout == "Nuc" else np.nan
    across = "sections" if protocol == "is" and table != IS_ORGAN_SD_TABLE else "balanced units"
    return chosen.assign(wins=wins, sd_across=across)[columns].reset_index(drop=True)


def unit_correlations(published: pd.DataFrame, *, magnification: str, readout: str = HEADLINE_READOUT,
                      taxonomy: str = HEADLINE_TAXONOMY, metric: str = "macro_f1") -> dict[str, UnitCorrelation]:
    """Per protocol, the shared-unit correlation of the paper's models in one condition: fitted to
    the cross-domain tables' win counts (over the paper's unit × seed pairs), and for IS, whose
    tables count wins in CRA only, the median of the cross-domain fits (docs/decisions/0046)."""
    found: dict[str, UnitCorrelation] = {}
    for protocol in CROSS_DOMAIN_PROTOCOLS:
        paper = published_condition(published, protocol=protocol, magnification=magnification, readout=readout,
                                    taxonomy=taxonomy, metric=metric)
        if len(paper) and paper["wins"].notna().all():
            pairs = PAPER_WILCOXON_UNITS[protocol] * PAPER_SEEDS[protocol]
            found[protocol] = fit_unit_correlation(paper["mean"], paper["sd"], paper["wins"], pairs,
                                                   f"fitted to Table {int(paper['table'].iloc[0])}'s wins")
    if found:
        borrowed = float(np.median([c.rho for c in found.values()]))
        for protocol in [p for p in PROTOCOLS if p not in found]:
            found[protocol] = UnitCorrelation(borrowed, "median of the " + ", ".join(
                PROTOCOL_LABELS[p] for p in found if p in CROSS_DOMAIN_PROTOCOLS) + " fits (no wins of this metric)")
    return found


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


def reproduction(published: pd.DataFrame, ours: pd.DataFrame, names: dict[str, str],
                 is_sections: int | None = None) -> pd.DataFrame:
    """Ours − published for every (model, condition) both have, in pp. ``ours``: the protocol summary
    (fractions, with ``n_units``); ``names``: slug → the paper's model name (models the paper did not
    test are left out). The tolerance is what the paper's SD implies for a mean over the units that
    SD is across: ±1.96 · SD / √n (a 95 % band for the mean), n this run's balanced units
    (``n_units``, the paper's when the run is the paper's configuration), or ``is_sections`` (the
    run's IS sections) for an IS condition only the supplement prints, with its SD across sections;
    ``outside`` flags a difference beyond it."""
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
            n = (is_sections or np.nan) if ref["sd_across"] == "sections" else float(row.n_units)
            ours_pp = 100.0 * float(row.mean)
            tolerance = Z_95 * float(ref["sd"]) / np.sqrt(n) if np.isfinite(ref["sd"]) and np.isfinite(n) else np.nan
            diff = ours_pp - float(ref["mean"])
            rows.append(condition | {"model": row.model, "table": int(ref["table"]), "published": float(ref["mean"]),
                                     "published_sd": float(ref["sd"]), "sd_across": ref["sd_across"], "ours": ours_pp,
                                     "difference": diff, "tolerance": tolerance,
                                     "n_units": int(n) if np.isfinite(n) else pd.NA,
                                     "outside": bool(np.isfinite(tolerance) and abs(diff) > tolerance)})
    columns = ["model", *keys, "table", "published", "published_sd", "sd_across", "ours", "difference", "tolerance",
               "n_units", "outside"]
    return pd.DataFrame(rows, columns=columns)
