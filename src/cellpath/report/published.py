"""The report's published reference: the paper's 30 models in the headline condition (Tfine, Nuc,
Macro-F1, S25) under all four protocols, this run's models ranked among them only when the run is the
paper's configuration (beside them, unranked, when it is not) and only under the protocols it ran,
each rank with its 95 % interval and the paper's models it cannot be told apart from, and the
reproduction check (ours − published, pp)."""

from __future__ import annotations

import pandas as pd

from cellpath.probing.stats import condition_rng, condition_replicates
from cellpath.published.reference import (RANK_LEVEL, Placement, placement, published_condition, rank_interval,
                                          reproduction)
from cellpath.report.inputs import ReportInputs, protocols_run
from cellpath.report.render import Table, display_table
from cellpath.vocabulary import (HEADLINE_READOUT, HEADLINE_TAXONOMY, PAPER_PANEL, PROTOCOL_LABELS, PROTOCOLS,
                                 TAXONOMY_LABELS)

RANK_RULE = "rank: 1 + the number of the paper's models with a higher mean."
#: The published condition as the titles name it (Tfine, Nuc, Macro-F1).
CONDITION = f"{TAXONOMY_LABELS[HEADLINE_TAXONOMY]}, {HEADLINE_READOUT}, Macro-F1"


def published_tables(inputs: ReportInputs, headline: str) -> dict[str, tuple[Table, pd.DataFrame]]:
    """``published_placement`` (the paper's models ranked, this run's among them when comparable),
    ``published_this_run`` (only when not comparable: this run's means, unranked, and why) and
    ``published_reproduction``; ``headline``: the headline magnification."""
    names = dict(zip(inputs.registry["slug"], inputs.registry["name"]))
    ran = protocols_run(inputs.runs)
    placed = placement(inputs.published, inputs.probe["summary"], names, inputs.run_configuration,
                       protocols=list(PROTOCOLS), magnification=headline)
    out = {"published_placement": _placement_table(placed, list(PROTOCOLS), ran, headline,
                                                   _paper_tables(inputs.published, list(PROTOCOLS), headline))}
    if placed.comparable:
        out["published_rank_intervals"] = _rank_table(inputs, names, placed, ran, headline)
    else:
        out["published_this_run"] = _beside_table(placed, ran, headline)
    out["published_reproduction"] = _reproduction_table(inputs, names, placed.reasons)
    return out


def placement_metrics(built: dict[str, tuple[Table, pd.DataFrame]], slugs: dict[str, str],
                      reasons: list[str]) -> dict:
    """The headline placement for ``dvc metrics`` and MLflow, read from :func:`published_tables`'
    frames: ``comparable``, ``not_comparable`` (the reasons; empty when comparable) and per model of
    this run (registry slug; ``slugs``: display name → slug) and protocol it ran (IS, IOCD, MOCV,
    LOOO) its ``mean`` (pp, 2 decimals) and, for a comparable run, its ``rank`` with the 95 %
    interval's ``rank_low`` and ``rank_high``."""
    out: dict = {"condition": f"{CONDITION}, {PAPER_PANEL}", "comparable": not reasons,
                 "not_comparable": list(reasons)}
    if "published_rank_intervals" in built:
        for name, row in built["published_rank_intervals"][1].iterrows():
            out.setdefault(slugs[name], {})[row["protocol"]] = {
                "mean": round(float(row["mean"]), 2), "rank": int(row["rank"]), "rank_low": int(row["rank_low"]),
                "rank_high": int(row["rank_high"])}
    elif "published_this_run" in built:
        labels = [PROTOCOL_LABELS[p] for p in PROTOCOLS]
        for name, row in built["published_this_run"][1].iterrows():
            means = {label: {"mean": round(float(row[label]), 2)} for label in labels
                     if label in row.index and pd.notna(row[label])}
            if means:
                out[slugs[name]] = means
    return out


def _paper_tables(published: pd.DataFrame, protocols: list[str], headline: str) -> str:
    """The paper's tables the headline condition's values come from, e.g. '15, 87, 105, 123' ('–': none)."""
    sources = sorted({int(t) for p in protocols for t in published_condition(
        published, protocol=p, magnification=headline, readout=HEADLINE_READOUT, taxonomy=HEADLINE_TAXONOMY)["table"]})
    return ", ".join(map(str, sources)) or "–"


def _shown(numeric: pd.DataFrame, protocols: list[str]) -> pd.DataFrame:
    """Ranks as whole numbers ('–' where undefined) and protocols by their labels."""
    shown = numeric.copy()
    for column in [c for c in shown.columns if c.endswith(" rank")]:
        shown[column] = ["–" if pd.isna(v) else str(int(v)) for v in shown[column]]
    return shown.rename(columns={p: PROTOCOL_LABELS[p] for p in protocols}
                        | {f"{p} rank": f"{PROTOCOL_LABELS[p]} rank" for p in protocols})


def _by_model(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.set_index("model") if len(frame) else pd.DataFrame(index=pd.Index([], name="model"))


def _placement_table(placed: Placement, protocols: list[str], ran: list[str], headline: str,
                     sources: str) -> tuple[Table, pd.DataFrame]:
    """The paper's models ranked; this run's among them only when the run is comparable, and only
    under the protocols it ran."""
    numeric = _by_model(placed.ranked)
    if placed.comparable:
        missing = [PROTOCOL_LABELS[p] for p in protocols if p not in ran]
        caption = ("Comparable: this run is the paper's configuration (S25, seeds, class gates). The paper's 30 "
                   f"models (its Tables {sources}; pp) with this run's models placed among them under "
                   f"{', '.join(PROTOCOL_LABELS[p] for p in ran)}"
                   + (f"; not run, so not ranked: {', '.join(missing)}" if missing else "")
                   + f"; {RANK_RULE} Each rank's 95 % interval: the table below.")
    else:
        caption = (f"The paper's 30 models (its Tables {sources}; pp), ranked among themselves; {RANK_RULE} This run "
                   "is not the paper's configuration, so its models are shown beside this table, not ranked in it.")
    return display_table("published_placement", f"Published reference — {CONDITION}, {headline}, {PAPER_PANEL}",
                         caption, _shown(numeric, protocols), percent_pairs=False, percent_columns=())


def _rank_table(inputs: ReportInputs, names: dict[str, str], placed: Placement, ran: list[str],
                headline: str) -> tuple[Table, pd.DataFrame]:
    """Per model of this run and protocol it ran: its rank among the paper's models, the rank's 95 %
    interval (:func:`rank_interval`) and the paper's models it cannot be told apart from."""
    summary = inputs.probe["summary"]
    ours = summary[(summary["magnification"] == headline) & (summary["readout"] == HEADLINE_READOUT)
                   & (summary["taxonomy"] == HEADLINE_TAXONOMY) & (summary.get("metric", "macro_f1") == "macro_f1")]
    ranks = placed.ranked[placed.ranked["source"] == "this run"].set_index("model")
    rows = []
    for row in ours[ours["protocol"].isin(ran) & ours["model"].isin(names)].itertuples():
        key = (row.model, headline, HEADLINE_READOUT, HEADLINE_TAXONOMY, row.protocol)
        paper = published_condition(inputs.published, protocol=row.protocol, magnification=headline,
                                    readout=HEADLINE_READOUT, taxonomy=HEADLINE_TAXONOMY)
        replicates = 100.0 * condition_replicates(inputs.runs, "macro_f1", key)
        found = rank_interval(paper, replicates, int(row.n_units), condition_rng("rank", *key))
        rows.append({"model": names[row.model], "protocol": PROTOCOL_LABELS[row.protocol],
                     "mean": 100.0 * float(row.mean), "rank": int(ranks.at[names[row.model], f"{row.protocol} rank"]),
                     "rank_low": found["low"], "rank_high": found["high"],
                     "not_separable": ", ".join(found["not_separable"]) or "none"})
    frame = pd.DataFrame(rows, columns=["model", "protocol", "mean", "rank", "rank_low", "rank_high", "not_separable"])
    return display_table("published_rank_intervals", f"Rank with its {RANK_LEVEL:.0%} interval — {CONDITION}, {headline}",
                         "Per model of this run and protocol it ran: its rank among the paper's 30 (1 = best), the "
                         f"{RANK_LEVEL:.0%} interval of that rank and the paper's models not separable from it. Each "
                         "draw pairs a bootstrap replicate of this run's mean (over its units and seeds) with every "
                         "published mean drawn from Normal(mean, SD/√n), n the protocol's units; not separable: "
                         "above this run in 2.5–97.5 % of the draws (docs/decisions/0046).",
                         frame.set_index("model"), percent_pairs=False, percent_columns=())


def _beside_table(placed: Placement, protocols: list[str], headline: str) -> tuple[Table, pd.DataFrame]:
    """This run's means in the published condition, without a rank, and what differs from the paper."""
    numeric = _by_model(placed.beside.drop(columns="source"))
    caption = ("Not comparable, so not ranked — this run differs from the paper's configuration: "
               + "; ".join(placed.reasons) + ". Its models' means (pp) in the same condition, beside the paper's "
               "and not among them: the paper's values are context only.")
    return display_table("published_this_run", f"This run beside the published reference — {CONDITION}, {headline}",
                         caption, _shown(numeric, protocols), percent_pairs=False, percent_columns=())


def _reproduction_table(inputs: ReportInputs, names: dict[str, str],
                        reasons: tuple[str, ...]) -> tuple[Table, pd.DataFrame]:
    """Ours − published per model and condition, for a comparable run with models the paper tested."""
    published_models = set(inputs.published["model"])
    ours_published = {slug: name for slug, name in names.items() if name in published_models}
    checked = reproduction(inputs.published, inputs.probe["summary"], ours_published) \
        if not reasons and ours_published else pd.DataFrame(columns=["model"])
    table = display_table("published_reproduction", "Reproduction check — ours − published",
                          "Per model and condition both have: the paper's mean, ours, the difference (pp) and the "
                          "tolerance its SD implies for a mean over the same balanced units (±1.96·SD/√n); flagged "
                          "outside it.", _by_model(checked), percent_pairs=False, percent_columns=())
    if reasons:
        table[0].empty_reason = "the run is not the paper's configuration: " + "; ".join(reasons)
    elif not ours_published:
        table[0].empty_reason = "none of this run's encoders is one of the paper's 30"
    return table
