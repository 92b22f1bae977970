"""A placement run in the report: a private model and an anchor (Phikon, one of the paper's 30) in the
paper's configuration on a fabricated S25 (25 sections of 11 organs, the paper's seeds), run under
IS, IOCD and LOOO but not MOCV, ranked among the paper's 30 at the headline condition with a rank
interval per protocol (on the paper's scale through the anchor), and unranked under the protocol it
did not run."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cellpath.probing.stats import protocol_summary
from cellpath.published import load_published
from cellpath.published.reference import (PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS, PAPER_SEEDS, RunConfiguration,
                                          published_condition)
from cellpath.report.inputs import ReportInputs
from cellpath.report.published import published_tables

ORGANS = [f"organ{i:02d}" for i in range(11)]
SECTIONS = [(f"s{i:02d}", ORGANS[i % 11]) for i in range(25)]  # 25 sections, 2–3 per organ
S25 = frozenset(s for s, _ in SECTIONS)
PAPER_RUN = RunConfiguration(source="10x", panel="S25", panel_sizes=(10, 15, 20, 25), panel_sections=S25,
                             paper_panel_sections=S25, seeds=dict(PAPER_SEEDS), mocv_folds=5,
                             min_train_cells=dict(PAPER_MIN_TRAIN_CELLS), min_test_cells=dict(PAPER_MIN_TEST_CELLS),
                             max_train_cells=None)
RAN = ("is", "iocd", "looo")


ANCHOR = ("phikon", "Phikon")
AHEAD_OF_ANCHOR = 0.04  # the private model's paired advantage over the anchor (fraction)


def placement_runs(levels: dict[str, float], anchor_levels: dict[str, float] | None = None) -> pd.DataFrame:
    """Tfine Nuc 20× Macro-F1 of one model around ``levels[protocol]`` (fractions): per unit an offset,
    per seed noise; IS per section, IOCD per held-out section, LOOO per held-out organ. With
    ``anchor_levels``, the anchor too, on the same units with the same unit offsets (a hard unit is
    hard for both) and its own seed noise."""
    rng = np.random.default_rng(7)
    units = {"is": SECTIONS, "iocd": SECTIONS[:23], "looo": [(organ, organ) for organ in ORGANS]}
    models = [("my-vit-s16", levels)] + ([(ANCHOR[0], anchor_levels)] if anchor_levels else [])
    rows = []
    for protocol in RAN:
        for unit, organ in units[protocol]:
            offset = rng.normal(0.0, 0.03)
            for model, level in models:
                for seed in range(PAPER_SEEDS[protocol]):
                    rows.append({"model": model, "magnification": "20x", "readout": "Nuc", "taxonomy": "fine",
                                 "protocol": protocol, "unit": unit, "organ": organ, "seed": seed, "status": "ok",
                                 "macro_f1": level[protocol] + offset + rng.normal(0.0, 0.01)})
    return pd.DataFrame(rows)


def _inputs(published: pd.DataFrame, runs: pd.DataFrame, run: RunConfiguration = PAPER_RUN) -> ReportInputs:
    slugs = sorted(set(runs["model"]))
    names = {"my-vit-s16": "my-vit-s16", ANCHOR[0]: ANCHOR[1]}
    return ReportInputs(probe={"summary": protocol_summary(runs, "macro_f1").assign(metric="macro_f1")},
                        counts={}, runs=runs, robustness={}, margins=pd.DataFrame(), label_summary=pd.DataFrame(),
                        panels=pd.DataFrame(), registry=pd.DataFrame({"slug": slugs, "name": [names[s] for s in slugs]}),
                        published=published, run_configuration=run, gallery=None)


def _anchor_levels(published: pd.DataFrame, shift: float = 0.0) -> dict[str, float]:
    """The anchor's published Tfine Nuc 20× means (fractions), shifted by ``shift``."""
    return {p: float(published_condition(published, protocol=p, magnification="20x", readout="Nuc", taxonomy="fine")
                     .set_index("model").at[ANCHOR[1], "mean"]) / 100 + shift for p in RAN}


@pytest.fixture(scope="module")
def tables() -> dict:
    published = load_published()
    anchor = _anchor_levels(published)
    runs = placement_runs({p: anchor[p] + AHEAD_OF_ANCHOR for p in RAN}, anchor)
    built = published_tables(_inputs(published, runs), "20x")
    return {name: frame for name, (_, frame) in built.items()} | {
        "captions": {name: table.caption for name, (table, _) in built.items()},
        "published": published, "runs": runs, "built": built}


def test_the_placement_run_is_ranked_among_the_30_where_it_ran_and_unranked_where_it_did_not(tables):
    placed = tables["published_placement"]
    assert "published_this_run" not in tables  # comparable: among the paper's models, not beside them
    assert len(placed) == 32 and "my-vit-s16" in placed.index  # the paper's 30, and this run's two
    mine = placed.loc["my-vit-s16"]
    for protocol in ("IS", "IOCD", "LOOO"):
        paper = published_condition(tables["published"], protocol=protocol.lower(), magnification="20x",
                                    readout="Nuc", taxonomy="fine")
        assert mine[f"{protocol} rank"] == str(1 + int((paper["mean"] > float(mine[protocol])).sum()))
    assert mine["MOCV rank"] == "–" and np.isnan(float(mine["MOCV"]))  # not run: no value, no rank
    caption = tables["captions"]["published_placement"]
    assert "placed among them under IS, IOCD, LOOO; not run, so not ranked: MOCV" in caption


def test_the_placed_mean_is_the_anchors_published_mean_plus_the_paired_difference(tables):
    """On the paper's scale: Phikon's published mean + (mine − Phikon's) over the same balanced units,
    whatever this run's own level; Phikon itself is placed too, calibrated on no other anchor."""
    from cellpath.probing.stats import organ_level_scores

    ranks = tables["published_rank_intervals"]
    mine = ranks.loc["my-vit-s16"].set_index("protocol")
    scores = organ_level_scores(tables["runs"], "macro_f1")
    for protocol in RAN:
        paper = published_condition(tables["published"], protocol=protocol, magnification="20x", readout="Nuc",
                                    taxonomy="fine").set_index("model")
        wide = scores[scores["protocol"] == protocol].pivot(index="balanced_unit", columns="model", values="score")
        paired = 100 * float((wide["my-vit-s16"] - wide[ANCHOR[0]]).mean())
        row = mine.loc[protocol.upper()]
        assert row["placed_mean"] == pytest.approx(paper.at[ANCHOR[1], "mean"] + paired, abs=1e-9)
        assert row["anchors"] == ANCHOR[1] and row["placed"] and row["n_units"] == len(wide)
        assert 1 <= row["rank_low"] <= row["rank_high"] <= 30
        assert ANCHOR[1] not in row["not_separable"].split(", ")  # 4 pp ahead on every unit: separable
    anchor_rows = ranks.loc[ANCHOR[1]]
    assert (anchor_rows["anchors"] == "none").all() and anchor_rows["placed"].all()


def test_no_rank_where_the_anchor_does_not_reproduce_the_paper():
    """The anchor 12 pp below its published mean (beyond ±1.96·SD/√n): the run is not placed, and says why."""
    published = load_published()
    anchor = _anchor_levels(published, shift=-0.12)
    runs = placement_runs({p: anchor[p] + AHEAD_OF_ANCHOR for p in RAN}, anchor)
    ranks = published_tables(_inputs(published, runs), "20x")["published_rank_intervals"][1].loc["my-vit-s16"]
    assert not ranks["placed"].any() and ranks["rank"].isna().all()
    assert all(why.startswith("outside the reproduction tolerance: Phikon -1") for why in ranks["why"]), list(ranks["why"])


def test_the_rank_and_its_interval_are_the_metrics_dvc_and_mlflow_show(tables):
    """``placement_metrics``: per protocol run, the rank table's numbers under the model's slug; none
    for MOCV; ``comparable`` with no reasons."""
    from cellpath.report.published import placement_metrics
    from cellpath.runtime.tracking import flat_metrics

    metrics = placement_metrics(tables["built"], {"my-vit-s16": "my-vit-s16", ANCHOR[1]: ANCHOR[0]}, [])
    assert metrics["comparable"] is True and metrics["not_comparable"] == []
    assert metrics["condition"] == "Tfine, Nuc, Macro-F1, S25"
    ranks = tables["published_rank_intervals"].loc["my-vit-s16"]
    assert set(metrics["my-vit-s16"]) == {"IS", "IOCD", "LOOO"}
    for row in ranks.itertuples():
        assert metrics["my-vit-s16"][row.protocol] == {"mean": round(row.mean, 2),
                                                       "placed_mean": round(row.placed_mean, 2), "rank": row.rank,
                                                       "rank_low": row.rank_low, "rank_high": row.rank_high}
    flat = flat_metrics({"my-vit-s16": metrics["my-vit-s16"]}, "placement/")
    assert flat["placement/my-vit-s16/LOOO/rank_high"] == float(ranks.set_index("protocol").at["LOOO", "rank_high"])
    assert len(flat) == 15  # 3 protocols × mean, placed_mean, rank, rank_low, rank_high


def test_a_run_that_is_not_comparable_gives_means_and_the_reasons():
    """Not the paper's configuration: means only, under the protocols run, and why."""
    from cellpath.published.reference import comparability
    from cellpath.report.published import placement_metrics

    published = load_published()
    runs = placement_runs({protocol: 0.5 for protocol in RAN})
    other = RunConfiguration(**{**PAPER_RUN.__dict__, "seeds": {"is": 1, "iocd": 1, "mocv": 1, "looo": 1}})
    inputs = _inputs(published, runs, other)
    reasons = comparability(other)
    metrics = placement_metrics(published_tables(inputs, "20x"), {"my-vit-s16": "my-vit-s16"}, reasons)
    assert metrics["comparable"] is False and metrics["not_comparable"] == reasons and reasons
    summary = protocol_summary(runs, "macro_f1").set_index("protocol")
    assert metrics["my-vit-s16"] == {p.upper(): {"mean": round(100 * summary.at[p, "mean"], 2)} for p in RAN}


def test_no_rank_where_the_model_and_its_anchors_share_fewer_than_two_units():
    """The anchor scored on one LOOO organ only: LOOO is not placed, and says why; IS and IOCD are."""
    published = load_published()
    anchor = _anchor_levels(published)
    runs = placement_runs({p: anchor[p] + AHEAD_OF_ANCHOR for p in RAN}, anchor)
    dropped = (runs["model"] == ANCHOR[0]) & (runs["protocol"] == "looo") & (runs["unit"] != ORGANS[0])
    ranks = published_tables(_inputs(published, runs[~dropped]), "20x")["published_rank_intervals"][1]
    mine = ranks.loc["my-vit-s16"].set_index("protocol")
    assert not mine.at["LOOO", "placed"] and mine.at["LOOO", "why"].startswith("1 balanced unit(s) scored")
    assert mine.loc[["IS", "IOCD"], "placed"].all()
