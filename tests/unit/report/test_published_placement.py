"""A placement run in the report: a private model's run table in the paper's configuration on a
fabricated S25 (25 sections of 11 organs, the paper's seeds), run under IS, IOCD and LOOO but not
MOCV, ranked among the paper's 30 at the headline condition with a rank interval per protocol, and
unranked under the protocol it did not run."""

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


def placement_runs(levels: dict[str, float]) -> pd.DataFrame:
    """Tfine Nuc 20× Macro-F1 of one model around ``levels[protocol]`` (fractions): per unit an offset,
    per seed noise; IS per section, IOCD per held-out section, LOOO per held-out organ."""
    rng = np.random.default_rng(7)
    units = {"is": SECTIONS, "iocd": SECTIONS[:23], "looo": [(organ, organ) for organ in ORGANS]}
    rows = []
    for protocol in RAN:
        for unit, organ in units[protocol]:
            offset = rng.normal(0.0, 0.03)
            for seed in range(PAPER_SEEDS[protocol]):
                rows.append({"model": "my-vit-s16", "magnification": "20x", "readout": "Nuc", "taxonomy": "fine",
                             "protocol": protocol, "unit": unit, "organ": organ, "seed": seed, "status": "ok",
                             "macro_f1": levels[protocol] + offset + rng.normal(0.0, 0.01)})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def tables() -> dict:
    published = load_published()
    runs = placement_runs({protocol: float(published_condition(published, protocol=protocol, magnification="20x",
                                                               readout="Nuc", taxonomy="fine")["mean"].median()) / 100
                           for protocol in RAN})  # mid-table under each protocol
    inputs = ReportInputs(probe={"summary": protocol_summary(runs, "macro_f1").assign(metric="macro_f1")},
                          counts={}, runs=runs, robustness={}, margins=pd.DataFrame(), label_summary=pd.DataFrame(),
                          panels=pd.DataFrame(), registry=pd.DataFrame({"slug": ["my-vit-s16"], "name": ["my-vit-s16"]}),
                          published=published, run_configuration=PAPER_RUN, gallery=None)
    built = published_tables(inputs, "20x")
    return {name: frame for name, (_, frame) in built.items()} | {
        "captions": {name: table.caption for name, (table, _) in built.items()},
        "published": published, "runs": runs, "built": built}


def test_the_placement_run_is_ranked_among_the_30_where_it_ran_and_unranked_where_it_did_not(tables):
    placed = tables["published_placement"]
    assert "published_this_run" not in tables  # comparable: among the paper's models, not beside them
    assert len(placed) == 31 and "my-vit-s16" in placed.index
    mine = placed.loc["my-vit-s16"]
    for protocol in ("IS", "IOCD", "LOOO"):
        paper = published_condition(tables["published"], protocol=protocol.lower(), magnification="20x",
                                    readout="Nuc", taxonomy="fine")
        assert mine[f"{protocol} rank"] == str(1 + int((paper["mean"] > float(mine[protocol])).sum()))
    assert mine["MOCV rank"] == "–" and np.isnan(float(mine["MOCV"]))  # not run: no value, no rank
    assert (placed.drop(index="my-vit-s16")["MOCV rank"] != "–").all()  # the paper's 30 still ranked under MOCV
    caption = tables["captions"]["published_placement"]
    assert "placed among them under IS, IOCD, LOOO; not run, so not ranked: MOCV" in caption


def test_each_rank_has_an_interval_and_the_models_it_cannot_be_told_from(tables):
    ranks = tables["published_rank_intervals"]
    assert list(ranks["protocol"]) == ["IOCD", "IS", "LOOO"] and set(ranks.index) == {"my-vit-s16"}
    placed = tables["published_placement"].loc["my-vit-s16"]
    for row in ranks.itertuples():
        assert str(row.rank) == placed[f"{row.protocol} rank"]
        assert 1 <= row.rank_low <= row.rank <= row.rank_high <= 31
        assert row.rank_high > row.rank_low  # mid-table among models a few points apart: never one rank
        assert row.not_separable != "none"
    paper_names = set(tables["published"]["model"])
    is_row = ranks[ranks["protocol"] == "IS"].iloc[0]
    assert set(is_row.not_separable.split(", ")) <= paper_names


def test_the_rank_uses_the_replicates_the_summary_interval_is_read_from(tables):
    from cellpath.probing.stats import condition_replicates, percentile_interval

    runs = tables["runs"]
    summary = protocol_summary(runs, "macro_f1").set_index("protocol")
    for protocol in RAN:
        key = ("my-vit-s16", "20x", "Nuc", "fine", protocol)
        low, high = percentile_interval(condition_replicates(runs, "macro_f1", key))
        assert (low, high) == (summary.at[protocol, "low"], summary.at[protocol, "high"])


def test_the_rank_and_its_interval_are_the_metrics_dvc_and_mlflow_show(tables):
    """``placement_metrics``: per protocol run, the rank table's numbers under the model's slug; none
    for MOCV; ``comparable`` with no reasons."""
    from cellpath.report.published import placement_metrics
    from cellpath.runtime.tracking import flat_metrics

    metrics = placement_metrics(tables["built"], {"my-vit-s16": "my-vit-s16"}, [])
    assert metrics["comparable"] is True and metrics["not_comparable"] == []
    assert metrics["condition"] == "Tfine, Nuc, Macro-F1, S25"
    ranks = tables["published_rank_intervals"]
    assert set(metrics["my-vit-s16"]) == {"IS", "IOCD", "LOOO"}
    for row in ranks.itertuples():
        assert metrics["my-vit-s16"][row.protocol] == {"mean": round(row.mean, 2), "rank": row.rank,
                                                       "rank_low": row.rank_low, "rank_high": row.rank_high}
    flat = flat_metrics({"my-vit-s16": metrics["my-vit-s16"]}, "placement/")
    assert flat["placement/my-vit-s16/LOOO/rank_high"] == float(ranks.set_index("protocol").at["LOOO", "rank_high"])
    assert len(flat) == 12  # 3 protocols × mean, rank, rank_low, rank_high


def test_a_run_that_is_not_comparable_gives_means_and_the_reasons():
    """Not the paper's configuration: means only, under the protocols run, and why."""
    from cellpath.published.reference import comparability
    from cellpath.report.published import placement_metrics

    published = load_published()
    runs = placement_runs({protocol: 0.5 for protocol in RAN})
    other = RunConfiguration(**{**PAPER_RUN.__dict__, "seeds": {"is": 1, "iocd": 1, "mocv": 1, "looo": 1}})
    inputs = ReportInputs(probe={"summary": protocol_summary(runs, "macro_f1").assign(metric="macro_f1")},
                          counts={}, runs=runs, robustness={}, margins=pd.DataFrame(), label_summary=pd.DataFrame(),
                          panels=pd.DataFrame(), registry=pd.DataFrame({"slug": ["my-vit-s16"], "name": ["My ViT"]}),
                          published=published, run_configuration=other, gallery=None)
    reasons = comparability(other)
    metrics = placement_metrics(published_tables(inputs, "20x"), {"My ViT": "my-vit-s16"}, reasons)
    assert metrics["comparable"] is False and metrics["not_comparable"] == reasons and reasons
    summary = protocol_summary(runs, "macro_f1").set_index("protocol")
    assert metrics["my-vit-s16"] == {p.upper(): {"mean": round(100 * summary.at[p, "mean"], 2)} for p in RAN}
