"""Golden values for the paper's aggregation, CRA, Wilcoxon significant wins and CRT."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cellpath.stats import (
    cell_representation_advantage,
    cell_representation_transferability,
    organ_level_scores,
    pairwise_wins,
    pooled_cell_representation_advantage,
    protocol_summary,
    taxonomy_rank_agreement,
    win_counts,
)


def _row(model, readout, protocol, unit, organ, seed, f1, taxonomy="fine", mag="20x"):
    return {"model": model, "magnification": mag, "readout": readout, "taxonomy": taxonomy, "protocol": protocol,
            "unit": unit, "organ": organ, "seed": seed, "macro_f1": f1}


def _is_table() -> pd.DataFrame:
    values = {  # (readout, section, organ) -> per-seed macro-F1
        ("Nuc", "a1", "A"): [0.8, 0.6], ("Nuc", "a2", "A"): [0.5, 0.5], ("Nuc", "b1", "B"): [0.9, 0.7],
        ("Mean", "a1", "A"): [0.6, 0.6], ("Mean", "a2", "A"): [0.4, 0.2], ("Mean", "b1", "B"): [0.9, 0.7],
    }
    rows = [_row("m1", r, "is", s, o, seed, v) for (r, s, o), vs in values.items() for seed, v in enumerate(vs)]
    return pd.DataFrame(rows)


def test_is_is_averaged_seeds_then_sections_then_organs():
    summary = protocol_summary(_is_table(), "macro_f1").set_index("readout")
    # Nuc: sections 0.7, 0.5 → organ A 0.6; b1 0.8 → organ B 0.8. Mean 0.7, SD over organs √0.02.
    assert summary.loc["Nuc", "mean"] == pytest.approx(0.7)
    assert summary.loc["Nuc", "sd"] == pytest.approx(np.sqrt(0.02))
    assert summary.loc["Nuc", "n_units"] == 2


def test_cra_golden():
    cra = cell_representation_advantage(_is_table(), "macro_f1")
    # Section diffs: a1 (0.2 + 0.0)/2 = 0.1, a2 (0.1 + 0.3)/2 = 0.2, b1 0 → organs 0.15, 0 → 0.075.
    assert cra["cra"].iloc[0] == pytest.approx(0.075)


def test_pooled_cra_pools_taxonomies_within_organ_and_counts_wins():
    fine = _is_table()
    coarse = fine.assign(taxonomy="coarse", macro_f1=np.where(fine["readout"] == "Nuc", fine["macro_f1"] + 0.1,
                                                             fine["macro_f1"]))
    runs = pd.concat([fine, coarse], ignore_index=True)
    # m1 differences (section, taxonomy): a1 0.1/0.2, a2 0.2/0.3 → organ A 0.2; b1 0.0/0.1 → organ B 0.05.
    # m2 = m1 with Nuc lowered by 0.2 everywhere: every paired difference is 0.2 in m1's favour.
    m2 = runs.assign(model="m2", macro_f1=np.where(runs["readout"] == "Nuc", runs["macro_f1"] - 0.2, runs["macro_f1"]))
    extra = [_row(m, r, "is", s, "C", seed, v + (0.2 if r == "Nuc" and m == "m1" else 0), taxonomy=t)
             for m in ("m1", "m2") for r in ("Nuc", "Mean") for s in ("c1", "c2", "c3") for t in ("fine", "coarse")
             for seed, v in enumerate([0.5, 0.5])]
    table = pooled_cell_representation_advantage(pd.concat([runs, m2, pd.DataFrame(extra)], ignore_index=True),
                                                 "macro_f1", "20x").set_index("model")
    # organ C: m1 0.2, m2 0.0 → m1: (0.2 + 0.05 + 0.2) / 3 = 0.15; m2: (0.0 − 0.15 + 0.0) / 3 = −0.05.
    assert table.loc["m1", "cra"] == pytest.approx(0.15)
    assert table.loc["m2", "cra"] == pytest.approx(-0.05)
    assert table.loc["m1", "sd"] == pytest.approx(np.std([0.2, 0.05, 0.2], ddof=1))
    assert table.loc["m1", "n_organs"] == 3
    # 12 paired (section, taxonomy) units, all favouring m1 by 0.2: p = 2^-11 < 0.05.
    assert (table.loc["m1", "wins"], table.loc["m2", "wins"]) == (1, 0)


def test_iocd_averages_held_out_sections_within_organ_and_mocv_keeps_folds():
    rows = [_row("m1", "Nuc", "iocd", "a1", "A", 0, 0.4), _row("m1", "Nuc", "iocd", "a1", "A", 1, 0.6),
            _row("m1", "Nuc", "iocd", "a2", "A", 0, 0.8), _row("m1", "Nuc", "iocd", "b1", "B", 0, 0.3),
            _row("m1", "Nuc", "mocv", "fold0", "", 0, 0.2), _row("m1", "Nuc", "mocv", "fold0", "", 1, 0.4),
            _row("m1", "Nuc", "mocv", "fold1", "", 0, 0.9)]
    balanced = organ_level_scores(pd.DataFrame(rows), "macro_f1").set_index(["protocol", "balanced_unit"])["score"]
    assert balanced[("iocd", "A")] == pytest.approx((0.5 + 0.8) / 2)
    assert balanced[("iocd", "B")] == pytest.approx(0.3)
    assert balanced[("mocv", "fold0")] == pytest.approx(0.3)
    assert balanced[("mocv", "fold1")] == pytest.approx(0.9)


def test_wilcoxon_win_needs_enough_units_and_a_favourable_median():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.4, 0.6, 8)
    eight = pd.DataFrame({"model": ["m1"] * 8 + ["m2"] * 8, "unit": [f"u{i}" for i in range(8)] * 2,
                          "score": np.concatenate([base + np.linspace(0.01, 0.08, 8), base])})
    wins = pairwise_wins(eight).set_index(["model", "opponent"])
    # All 8 paired differences positive: exact two-sided p = 2 / 2^8 = 0.0078.
    assert wins.loc[("m1", "m2"), "p_value"] == pytest.approx(2 / 256)
    assert wins.loc[("m1", "m2"), "win"] and not wins.loc[("m2", "m1"), "win"]
    five = eight[eight["unit"].isin([f"u{i}" for i in range(5)])]
    wins5 = pairwise_wins(five).set_index(["model", "opponent"])
    assert wins5.loc[("m1", "m2"), "p_value"] == pytest.approx(2 / 32)  # 0.0625: not significant
    assert not wins5["win"].any()


def test_ties_and_single_units_record_no_win():
    tied = pd.DataFrame({"model": ["a", "a", "b", "b"], "unit": ["u1", "u2", "u1", "u2"], "score": [0.5, 0.6, 0.5, 0.6]})
    assert not pairwise_wins(tied)["win"].any()
    single = pd.DataFrame({"model": ["a", "b"], "unit": ["u1", "u1"], "score": [0.9, 0.1]})
    assert not pairwise_wins(single)["win"].any()


def test_win_counts_and_crt_on_a_constructed_table():
    rng = np.random.default_rng(1)
    rows = []
    for protocol, n_units, order in (("iocd", 8, ["m1", "m2", "m3"]), ("mocv", 8, ["m2", "m1", "m3"]),
                                     ("looo", 8, ["m1", "m3", "m2"])):
        base = rng.uniform(0.3, 0.5, n_units)
        for rank, model in enumerate(order):
            for u in range(n_units):
                rows.append(_row(model, "Nuc", protocol, f"u{u}", f"o{u}", 0, base[u] + 0.1 * (2 - rank) + 0.001 * u))
    wins = win_counts(pd.DataFrame(rows), "macro_f1")
    table = wins.pivot_table(index="model", columns="protocol", values="wins")
    assert table.loc["m1"].tolist() == [2, 2, 1]  # columns sorted: iocd, looo, mocv
    crt = cell_representation_transferability(wins).set_index("model")["crt"]
    assert crt["m1"] == pytest.approx((2 + 1 + 2) / 3)
    assert crt["m2"] == pytest.approx((1 + 2 + 0) / 3)
    assert crt["m3"] == pytest.approx((0 + 0 + 1) / 3)


def test_taxonomy_rank_agreement():
    summary = pd.DataFrame({
        "model": ["a", "b", "c", "d"] * 2, "taxonomy": ["fine"] * 4 + ["coarse"] * 4, "protocol": "is",
        "readout": "Nuc", "magnification": "20x", "mean": [0.5, 0.6, 0.7, 0.8, 0.6, 0.7, 0.9, 0.8],
    })
    assert taxonomy_rank_agreement(summary, protocol="is") == pytest.approx(0.8)
