"""The report's published reference: the paper's 30 models in the headline condition (Tfine, Nuc,
Macro-F1, S25) under all four protocols, this run's models ranked among them only when the run is the
paper's configuration (beside them, unranked, when it is not) and only under the protocols it ran,
each rank with its 95 % interval and the paper's models it cannot be told apart from, and the
reproduction check (ours − published, pp)."""

from __future__ import annotations

import pandas as pd

from cellpath.probing.stats import condition_rng, organ_level_scores
from cellpath.published.ranking import RANK_LEVEL, paired_rank_interval
from cellpath.published.reference import (Placement, placement, published_condition, reproduction,
                                          unit_correlations)
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
    LOOO) its ``mean`` (pp, 2 decimals) and, for a comparable run where it was placed, its
    ``placed_mean`` (on the paper's scale, through the anchors), its ``rank`` with the 95 % interval's
    ``rank_low`` and ``rank_high``."""
    out: dict = {"condition": f"{CONDITION}, {PAPER_PANEL}", "comparable": not reasons,
                 "not_comparable": list(reasons)}
    if "published_rank_intervals" in built:
        for name, row in built["published_rank_intervals"][1].iterrows():
            entry = {"mean": round(float(row["mean"]), 2)}
            if row["placed"]:
                entry |= {"placed_mean": round(float(row["placed_mean"]), 2), "rank": int(row["rank"]),
                          "rank_low": int(row["rank_low"]), "rank_high": int(row["rank_high"])}
            out.setdefault(slugs[name], {})[row["protocol"]] = entry
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
    """Per model of this run and protocol it ran: its rank among the paper's models on the paper's
    scale (through the anchors: the paper's models this run also ran), the rank's 95 % interval
    (:func:`paired_rank_interval`) and the paper's models it cannot be told apart from; no rank where
    an anchor does not reproduce its published mean within the tolerance of the reproduction check."""
    balanced = organ_level_scores(inputs.runs, "macro_f1")
    balanced = balanced[(balanced["magnification"] == headline) & (balanced["readout"] == HEADLINE_READOUT)
                        & (balanced["taxonomy"] == HEADLINE_TAXONOMY)]
    correlations = unit_correlations(inputs.published, magnification=headline)
    paper_models = set(inputs.published["model"])
    anchor_slugs = [slug for slug, name in names.items() if name in paper_models]
    checked = _headline_reproduction(inputs, {slug: names[slug] for slug in anchor_slugs})
    rows = []
    for (slug, protocol), scores in balanced.groupby(["model", "protocol"], sort=True):
        if protocol not in ran or slug not in names:
            continue
        placed_units = 100.0 * scores.set_index("balanced_unit")["score"]
        anchors = {names[anchor]: _unit_scores(balanced, anchor, protocol) for anchor in anchor_slugs if anchor != slug}
        common = placed_units.index  # the balanced units every one of them was scored on
        for theirs in anchors.values():
            common = common.intersection(theirs.index, sort=False)
        paper = published_condition(inputs.published, protocol=protocol, magnification=headline,
                                    readout=HEADLINE_READOUT, taxonomy=HEADLINE_TAXONOMY)
        paper = paper[paper["model"] != names[slug]]
        correlation = correlations[protocol]
        shifts = checked[checked["protocol"] == protocol].set_index("model")
        row = {"model": names[slug], "protocol": PROTOCOL_LABELS[protocol], "mean": float(placed_units.mean()),
               "anchors": ", ".join(anchors) or "none",
               "anchor_shift": ", ".join(f"{a} {shifts.at[a, 'difference']:+.2f}" for a in anchors if a in shifts.index)
               or "–", "rho": correlation.rho, "rho_source": correlation.source}
        outside = [a for a in anchors if a in shifts.index and bool(shifts.at[a, "outside"])]
        if outside or len(common) < 2:
            rows.append(row | {"placed": False, "why": _why_not_ranked(outside, shifts, len(common))})
            continue
        found = paired_rank_interval(paper, placed_units.loc[common].to_numpy(),
                                     {a: v.loc[common].to_numpy() for a, v in anchors.items()}, correlation.rho,
                                     condition_rng("rank", slug, headline, HEADLINE_READOUT, HEADLINE_TAXONOMY, protocol))
        rows.append(row | {"placed": True, "why": "" if anchors else "no anchor: this run's own mean, uncalibrated",
                           "placed_mean": found.mean, "rank": found.rank, "rank_low": found.low,
                           "rank_high": found.high, "loading": found.loading, "n_units": found.n_units,
                           "not_separable": ", ".join(found.not_separable) or "none"})
    columns = ["model", "protocol", "mean", "placed_mean", "rank", "rank_low", "rank_high", "not_separable", "anchors",
               "anchor_shift", "rho", "rho_source", "loading", "n_units", "placed", "why"]
    frame = pd.DataFrame(rows, columns=columns).astype({"rank": "Int64", "rank_low": "Int64", "rank_high": "Int64",
                                                        "n_units": "Int64"})
    return display_table("published_rank_intervals", f"Rank with its {RANK_LEVEL:.0%} interval — {CONDITION}, {headline}",
                         "Per model of this run and protocol it ran: its mean on the paper's scale (an anchor's "
                         "published mean plus this run's paired difference with it, averaged over the anchors: the "
                         "paper's models this run also ran), its rank among the paper's models (1 = best), the "
                         f"{RANK_LEVEL:.0%} interval of that rank and the paper's models not separable from it. The "
                         "draws share one unit effect across models (correlation rho, fitted to the paper's "
                         "significant wins; the model's own loading from its correlation with the anchors) and a t "
                         "over the units; not separable: above it in 2.5–97.5 % of the draws. Not placed where an "
                         "anchor misses its published mean by more than the reproduction tolerance "
                         "(docs/decisions/0046).", frame.set_index("model"), percent_pairs=False, percent_columns=())


def _unit_scores(balanced: pd.DataFrame, slug: str, protocol: str) -> pd.Series:
    """One model's Macro-F1 (%) per balanced unit of one protocol, indexed by the unit."""
    theirs = balanced[(balanced["model"] == slug) & (balanced["protocol"] == protocol)]
    return 100.0 * theirs.set_index("balanced_unit")["score"]


def _why_not_ranked(outside: list[str], shifts: pd.DataFrame, n_common: int) -> str:
    """Why a model is not ranked: the anchors outside the reproduction tolerance, or too few shared units."""
    if outside:
        return "outside the reproduction tolerance: " + ", ".join(
            f"{a} {shifts.at[a, 'difference']:+.2f} pp (±{shifts.at[a, 'tolerance']:.2f})" for a in outside)
    return f"{n_common} balanced unit(s) scored for it and every anchor; a rank needs 2"


def _headline_reproduction(inputs: ReportInputs, anchors: dict[str, str]) -> pd.DataFrame:
    """The reproduction check of the anchors (slug → paper name) in the headline condition."""
    return reproduction(inputs.published, inputs.probe["summary"], anchors, _is_sections(inputs.runs)) \
        if anchors else pd.DataFrame(columns=["model", "protocol", "difference", "tolerance", "outside"])


def _is_sections(runs: pd.DataFrame) -> int | None:
    """The run's IS sections (the n of the supplement's IS SDs, which are across sections)."""
    units = runs.loc[runs["protocol"] == "is", "unit"]
    return int(units.nunique()) if len(units) else None


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
    checked = reproduction(inputs.published, inputs.probe["summary"], ours_published, _is_sections(inputs.runs)) \
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
