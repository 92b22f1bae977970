"""This run among the paper's 30 models: comparability, placement and the reproduction check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from cellpath.published import load_published
from cellpath.published.reference import (PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS, PAPER_SEEDS, RunConfiguration,
                                          comparability, placement, published_condition, rank_interval,
                                          reproduction)

S25 = frozenset(f"s{i}" for i in range(25))
PAPER_RUN = RunConfiguration(source="10x", panel="S25", panel_sizes=(10, 15, 20, 25), panel_sections=S25,
                             paper_panel_sections=S25, seeds=dict(PAPER_SEEDS), mocv_folds=5,
                             min_train_cells=dict(PAPER_MIN_TRAIN_CELLS), min_test_cells=dict(PAPER_MIN_TEST_CELLS),
                             max_train_cells=None)


@pytest.fixture(scope="module")
def published() -> pd.DataFrame:
    return load_published()


def test_the_paper_configuration_is_comparable():
    assert comparability(PAPER_RUN) == []


@pytest.mark.parametrize("change, reason", [
    ({"source": "synthetic"}, "simulated panel"),
    ({"panel": "S12", "panel_sizes": (6, 8, 10, 12)}, "another panel"),
    ({"panel_sections": S25 - {"s3"} | {"other"}}, "2 sections differ"),
    ({"seeds": {"is": 1, "iocd": 1, "mocv": 2, "looo": 2}}, "other seeds"),
    ({"min_train_cells": {"fine": 25, "coarse": 10}}, "other class gates"),
    ({"max_train_cells": 5000}, "capped at 5000"),
])
def test_every_departure_from_the_paper_is_named(change, reason):
    reasons = comparability(dataclasses.replace(PAPER_RUN, **change))
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_the_condition_comes_from_the_complete_supplementary_table(published):
    paper = published_condition(published, protocol="is", magnification="20x", readout="Nuc", taxonomy="fine")
    assert len(paper) == 30 and set(paper["table"]) == {15}  # Table 15, not Table 4's copy of the same column
    looo = published_condition(published, protocol="looo", magnification="20x", readout="Nuc", taxonomy="fine")
    assert len(looo) == 30 and int(looo["table"].iloc[0]) > 116


def _summary(rows: list[tuple[str, str, float, int]]) -> pd.DataFrame:
    """A probe summary (fractions) with one Tfine Nuc Macro-F1 row per (model, protocol, mean, n_units)."""
    return pd.DataFrame([{"model": m, "magnification": "20x", "readout": "Nuc", "taxonomy": "fine", "protocol": p,
                          "metric": "macro_f1", "mean": mean, "sd": 0.05, "n_units": n} for m, p, mean, n in rows])


def test_a_comparable_run_is_ranked_among_the_paper(published):
    paper = published_condition(published, protocol="is", magnification="20x", readout="Nuc", taxonomy="fine")
    best, third = sorted(paper["mean"], reverse=True)[0], sorted(paper["mean"], reverse=True)[2]
    ours = _summary([("mine", "is", (best + 1.0) / 100, 11), ("other", "is", (third - 0.001) / 100, 11)])
    placed = placement(published, ours, {"mine": "My model"}, PAPER_RUN, protocols=["is"], magnification="20x")
    assert placed.comparable and placed.reasons == () and placed.beside.empty
    table = placed.ranked
    assert len(table) == 32 and table.iloc[0]["model"] == "My model" and table.iloc[0]["source"] == "this run"
    ranks = table.set_index("model")["is rank"]
    assert ranks["My model"] == 1 and ranks["other"] == 4
    own = table[table["source"] == "paper"]
    assert [1 + int((paper["mean"] > v).sum()) for v in own["is"]] == own["is rank"].tolist()  # ties share a rank


@pytest.mark.parametrize("change", [{"source": "synthetic"}, {"seeds": {"is": 1, "iocd": 1, "mocv": 2, "looo": 2}},
                                    {"max_train_cells": 5000}])
def test_a_run_that_is_not_comparable_is_shown_beside_the_paper_without_a_rank(published, change):
    paper = published_condition(published, protocol="is", magnification="20x", readout="Nuc", taxonomy="fine")
    best = max(paper["mean"])
    ours = _summary([("mine", "is", (best + 1.0) / 100, 11), ("other", "is", 0.2, 11), ("mine", "mocv", 0.3, 5)])
    run = dataclasses.replace(PAPER_RUN, **change)
    placed = placement(published, ours, {"mine": "My model"}, run, protocols=["is", "mocv"], magnification="20x")
    assert not placed.comparable and list(placed.reasons) == comparability(run)
    # the ranking holds the paper's models only, ranked as in the paper's own table
    assert set(placed.ranked["source"]) == {"paper"} and len(placed.ranked) == 30
    assert not {"My model", "other"} & set(placed.ranked["model"])
    assert [1 + int((paper["mean"] > v).sum()) for v in placed.ranked["is"]] == placed.ranked["is rank"].tolist()
    # this run's rows carry their means (pp) and no rank at all
    beside = placed.beside.set_index("model")
    assert sorted(beside.index) == ["My model", "other"] and set(beside["source"]) == {"this run"}
    assert not [c for c in beside.columns if "rank" in c]
    assert beside.at["My model", "is"] == pytest.approx(best + 1.0) and beside.at["other", "is"] == pytest.approx(20.0)
    assert beside.at["My model", "mocv"] == pytest.approx(30.0) and np.isnan(beside.at["other", "mocv"])
    assert beside.index[0] == "My model"  # best first


def test_reproduction_differences_and_flags(published):
    paper = published_condition(published, protocol="mocv", magnification="20x", readout="Nuc",
                                taxonomy="fine").set_index("model")
    uni2, virchow = paper.loc["UNI2"], paper.loc["Virchow"]
    # a paper-configuration run: UNI2 1 pp above its published mean (inside ±1.96·SD/√5), Virchow 10 pp below
    ours = _summary([("uni2", "mocv", (uni2["mean"] + 1.0) / 100, 5), ("virchow", "mocv", (virchow["mean"] - 10) / 100, 5),
                     ("new-model", "mocv", 0.3, 5)])
    table = reproduction(published, ours, {"uni2": "UNI2", "virchow": "Virchow"}).set_index("model")
    assert list(table.index) == ["UNI2", "Virchow"]  # a model the paper did not test is left out
    assert table.at["UNI2", "difference"] == pytest.approx(1.0)
    assert table.at["UNI2", "tolerance"] == pytest.approx(1.959964 * uni2["sd"] / np.sqrt(5))
    assert table.at["Virchow", "difference"] == pytest.approx(-10.0)
    assert not table.at["UNI2", "outside"] and table.at["Virchow", "outside"]
    assert table.at["UNI2", "table"] == paper.at["UNI2", "table"]


def test_rank_interval_golden_with_a_fixed_placed_mean():
    """Placed at 50 pp exactly; published means over n = 9 units with SD 3 (SE 1): A at 50 (above it
    in half the draws: not separable), B at 53 and C at 47 (three SEs away: separable). The rank is
    2 or 3, never 1 or 4."""
    paper = pd.DataFrame({"model": ["A", "B", "C"], "mean": [50.0, 53.0, 47.0], "sd": [3.0, 3.0, 3.0]})
    result = rank_interval(paper, np.full(4000, 50.0), 9, np.random.default_rng(0))
    assert (result["low"], result["high"]) == (2, 3)
    assert result["not_separable"] == ["A"]


def test_rank_interval_widens_with_the_placed_models_own_uncertainty():
    """Published means known exactly (SD 0) at 10, 20, …, 50 pp; the placed model's replicates spread
    over 15–45 pp: its rank runs from 2 to 5, and the three models inside that spread are not separable."""
    paper = pd.DataFrame({"model": list("abcde"), "mean": [10.0, 20.0, 30.0, 40.0, 50.0], "sd": [0.0] * 5})
    replicates = np.random.default_rng(1).uniform(15.0, 45.0, 4000)
    result = rank_interval(paper, replicates, 11, np.random.default_rng(2))
    assert (result["low"], result["high"]) == (2, 5)
    assert result["not_separable"] == ["b", "c", "d"]
