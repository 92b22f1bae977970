"""Golden values for the paper's aggregation, CRA, Wilcoxon significant wins and CRT."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from cellpath.probing.stats import (PERMUTATION_UNITS, cell_representation_advantage, cell_representation_transferability,
                                    organ_level_scores, pairwise_wins, pooled_cell_representation_advantage,
                                    protocol_summary, signed_rank_p, taxonomy_rank_agreement, win_counts)


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
    # Tfine's runs all skipped by the class gates: no agreement to compute, not an error
    assert np.isnan(taxonomy_rank_agreement(summary[summary["taxonomy"] == "coarse"], protocol="is"))


# --- significance tests over (unit, seed) pairs (docs/decisions/0016) -----------------------------------


def test_wins_pair_every_unit_and_seed():
    """MOCV, 5 folds × 2 seeds, m1 ahead on every pair: 10 pairs all positive, exact two-sided
    p = 2/2^10 ≈ 0.002: a win. Averaging seeds first leaves 5 pairs, p = 2/2^5 = 0.0625: none."""
    rows = [_row(m, "Nuc", "mocv", f"fold{f}", "", seed, 0.5 + 0.01 * f + 0.003 * seed + (0.05 + 0.001 * f * seed
                                                                                      if m == "m1" else 0))
            for m in ("m1", "m2") for f in range(5) for seed in range(2)]
    wins = win_counts(pd.DataFrame(rows), "macro_f1").set_index("model")["wins"]
    assert (wins["m1"], wins["m2"]) == (1, 0)
    pairs = pd.DataFrame(rows).assign(unit=lambda f: f["unit"] + "|seed" + f["seed"].astype(str),
                                      score=lambda f: f["macro_f1"])
    p_value = pairwise_wins(pairs[["model", "unit", "score"]]).set_index(["model", "opponent"])["p_value"]
    assert p_value[("m1", "m2")] == pytest.approx(2 / 2**10)


def test_a_model_that_dominates_every_unit_wins_against_all_in_every_protocol():
    """Three models; the default's smallest protocol sizes: IS 6 sections, IOCD 6 held-out sections,
    MOCV 5 folds × 2 seeds, LOOO 3 organs × 2 seeds. m1 > m2 > m3 on every (unit, seed)."""
    sizes = {"is": (6, 1), "iocd": (6, 1), "mocv": (5, 2), "looo": (3, 2)}
    rng = np.random.default_rng(3)
    rows = []
    for protocol, (n_units, n_seeds) in sizes.items():
        for u in range(n_units):
            for seed in range(n_seeds):
                base = rng.uniform(0.2, 0.6)
                for rank, model in enumerate(("m1", "m2", "m3")):
                    rows.append(_row(model, "Nuc", protocol, f"u{u}", f"o{u % 3}", seed,
                                     base - 0.05 * rank - rng.uniform(0, 0.01) * rank))
    wins = win_counts(pd.DataFrame(rows), "macro_f1").pivot_table(index="model", columns="protocol", values="wins")
    assert wins.loc["m1"].tolist() == [2, 2, 2, 2]  # columns: iocd, is, looo, mocv
    assert wins.loc["m2"].tolist() == [1, 1, 1, 1] and wins.loc["m3"].tolist() == [0, 0, 0, 0]
    crt = cell_representation_transferability(wins.stack().rename("wins").reset_index().assign(
        magnification="20x", readout="Nuc", taxonomy="fine")).set_index("model")["crt"]
    assert crt.tolist() == [2.0, 1.0, 0.0]


def test_cra_wins_per_taxonomy_pair_sections_and_seeds():
    """Fine: 3 sections × 2 seeds. m1's Nuc − Mean is 0.10 + 0.01·k on pair k, m2's 0.05 on every
    pair: 6 positive paired differences, p = 2/2^6 = 0.03125 → m1 wins. Coarse: equal CRAs, no win.
    CRA itself: m1 fine (0.105 + 0.125 + 0.145)/3 over sections, within one organ each → 0.125."""
    rows = []
    for model in ("m1", "m2"):
        for taxonomy in ("fine", "coarse"):
            for s, section in enumerate(("a", "b", "c")):
                for seed in range(2):
                    k = 2 * s + seed
                    diff = (0.10 + 0.01 * k) if (model == "m1" and taxonomy == "fine") else 0.05
                    rows.append(_row(model, "Mean", "is", section, section.upper(), seed, 0.4, taxonomy))
                    rows.append(_row(model, "Nuc", "is", section, section.upper(), seed, 0.4 + diff, taxonomy))
    cra = cell_representation_advantage(pd.DataFrame(rows), "macro_f1").set_index(["model", "taxonomy"])
    assert cra.loc[("m1", "fine"), "cra"] == pytest.approx(0.125)
    assert cra.loc[("m2", "fine"), "cra"] == pytest.approx(0.05)
    assert cra["wins"].to_dict() == {("m1", "coarse"): 0, ("m1", "fine"): 1, ("m2", "coarse"): 0, ("m2", "fine"): 0}


def test_differences_at_rounding_level_are_ties():
    """Two models with the same CRA of 0.1 computed from different bases: (0.3 + 0.1 + o) − (0.3 + o)
    exceeds (0.5 + 0.1 + o) − (0.5 + o) by 6e-17 to 2e-16 on all 8 units, always in the same
    direction. Read literally that is 8 positive differences (p = 2/2^8); it is rounding, not a win."""
    offsets = np.array([0.0, 0.04, 0.02, 0.06, 0.01, 0.03, 0.05, 0.07])
    a, b = (0.3 + 0.1 + offsets) - (0.3 + offsets), (0.5 + 0.1 + offsets) - (0.5 + offsets)
    assert np.all(a - b > 0)  # the trap is set
    scores = pd.DataFrame({"model": ["a"] * 8 + ["b"] * 8, "unit": [f"u{i}" for i in range(8)] * 2,
                           "score": np.concatenate([a, b])})
    assert not pairwise_wins(scores)["win"].any()


def test_nested_panel_is_tables_use_only_each_panels_sections():
    """S2 = {a1, b1} ⊂ S3 = {a1, a2, b1}. Nuc section scores (seed means): a1 0.7, a2 0.5, b1 0.8.
    S3: organs A (0.6), B (0.8) → mean 0.7, SD across sections sd(0.7, 0.5, 0.8). S2: organs A 0.7,
    B 0.8 → 0.75, SD sd(0.7, 0.8). CRA (Nuc − Mean, per section a1 0.1, a2 0.2, b1 0): S2 (0.1 + 0)/2."""
    from cellpath.probing.stats import nested_panel_tables

    readouts, cra = nested_panel_tables(_is_table(), {"S2": ["a1", "b1"], "S3": ["a1", "a2", "b1"]}, ("macro_f1",))
    nuc = readouts[readouts["readout"] == "Nuc"].set_index("panel")
    assert nuc.loc["S3", "mean"] == pytest.approx(0.7)
    assert nuc.loc["S3", "sd"] == pytest.approx(np.std([0.7, 0.5, 0.8], ddof=1))
    assert nuc.loc["S2", "mean"] == pytest.approx(0.75)
    assert nuc.loc["S2", "sd"] == pytest.approx(np.std([0.7, 0.8], ddof=1))
    assert (nuc["n_sections"].to_dict()) == {"S2": 2, "S3": 3}
    assert cra.set_index("panel").loc["S2", "cra"] == pytest.approx(0.05)
    assert cra.set_index("panel").loc["S3", "cra"] == pytest.approx(0.075)


def test_signed_rank_p_is_scipys_wilcoxon_with_ties_zeros_and_without():
    """The vectorised exact permutation test gives scipy's p-value bitwise, where scipy permutes (ties or
    zeros, at most 13 differences) and where it does not (no ties, or more differences)."""
    rng = np.random.default_rng(4)
    cases = [np.round(rng.normal(0.01, 0.04, n), 2) for n in (3, 6, 9, 11, 12, 13, 13, 14, 20)]
    cases[1][2] = cases[4][0] = cases[6][5] = 0.0  # zeros, dropped by the test
    cases.append(np.array([0.1, -0.1, 0.2, 0.2, 0.0, 0.3, -0.2]))
    cases.append(rng.normal(0.0, 0.1, 10))  # no ties: scipy's exact distribution
    permuted = 0
    for diff in cases:
        nonzero = np.abs(diff[diff != 0])
        permuted += len(diff) <= PERMUTATION_UNITS and len(np.unique(nonzero)) < len(diff)
        assert signed_rank_p(diff) == float(scipy_stats.wilcoxon(diff, alternative="two-sided").pvalue), diff
    assert permuted >= 7  # most cases take the permutation path
