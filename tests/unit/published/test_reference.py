"""This run among the paper's 30 models: comparability, placement and the reproduction check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from cellpath.published import load_published
from cellpath.published.reference import (PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS, PAPER_SEEDS, RunConfiguration,
                                          comparability, placement, published_condition, reproduction,
                                          unit_correlations)

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


def test_the_condition_comes_from_the_table_whose_sd_is_across_its_balanced_units(published):
    """IS at 20× Nuc: Table 4 (SD across the 11 organs), not Table 15 (the same means, SD across the
    25 sections, 1.2–1.5× larger); an IS condition only the supplement prints keeps its SD across
    sections and says so; cross-domain: the supplement (equal to Table 5), with its Nuc win counts."""
    paper = published_condition(published, protocol="is", magnification="20x", readout="Nuc", taxonomy="fine")
    assert len(paper) == 30 and set(paper["table"]) == {4} and set(paper["sd_across"]) == {"balanced units"}
    assert paper["wins"].isna().all()  # the IS tables count wins in CRA, not in this metric
    sections = published_condition(published, protocol="is", magnification="20x", readout="Nuc", taxonomy="fine",
                                   metric="macro_auroc")
    assert set(sections["table"]) == {17} and set(sections["sd_across"]) == {"sections"}
    table_15 = published[(published["table"] == 15) & (published["readout"] == "Nuc")].set_index("model")
    by_model = paper.set_index("model")
    assert (by_model["mean"] == table_15.loc[by_model.index, "mean"]).all()
    ratio = table_15.loc[by_model.index, "sd"] / by_model["sd"]
    assert 1.2 < ratio.min() and ratio.max() < 1.5 and ratio.median() == pytest.approx(1.40, abs=0.01)
    looo = published_condition(published, protocol="looo", magnification="20x", readout="Nuc", taxonomy="fine")
    assert len(looo) == 30 and int(looo["table"].iloc[0]) == 123 and looo.set_index("model").at["UNI2", "wins"] == 25


def test_the_unit_correlation_fitted_to_the_papers_wins(published):
    """Golden: the one-factor correlation whose expected Wilcoxon wins match Table 5's best (least
    squares over :data:`RHO_GRID`), per cross-domain protocol; IS borrows their median."""
    found = unit_correlations(published, magnification="20x")
    assert {p: c.rho for p, c in found.items()} == {"iocd": 0.97, "mocv": 0.96, "looo": 0.95, "is": 0.96}
    assert all(c.wins_rmse < 1.3 for p, c in found.items() if p != "is")  # about one win per model
    assert "Table 87" in found["iocd"].source and "median" in found["is"].source


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


def test_an_is_condition_with_its_sd_across_sections_uses_the_sections_as_n(published):
    """The supplement's IS SDs are across the 25 sections: the tolerance divides by √25, not by the
    11 organs the mean is balanced over."""
    paper = published_condition(published, protocol="is", magnification="40x", readout="Nuc",
                                taxonomy="fine").set_index("model")
    ours = pd.DataFrame([{"model": "uni2", "magnification": "40x", "readout": "Nuc", "taxonomy": "fine",
                          "protocol": "is", "metric": "macro_f1", "mean": paper.at["UNI2", "mean"] / 100, "sd": 0.05,
                          "n_units": 11}])
    table = reproduction(published, ours, {"uni2": "UNI2"}, is_sections=25).set_index("model")
    assert table.at["UNI2", "sd_across"] == "sections" and table.at["UNI2", "n_units"] == 25
    assert table.at["UNI2", "tolerance"] == pytest.approx(1.959964 * paper.at["UNI2", "sd"] / 5.0)
