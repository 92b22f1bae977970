"""Every C's validation Macro-F1 is kept, exactly: each run's ``chosen_c`` and ``c_tied`` follow from it.

A small probe on constructed features: three classes, the right-hand one three times as frequent in
training, so the boundary between the left and right classes moves towards the left class as C
shrinks. Two validation cells of opposite classes sit on one point between the boundaries of
C = 0.01 and C = 0.1: at C = 0.01 both are called right-hand, at C ≥ 0.1 both left-hand. The
two mistakes mirror each other, so every C scores the same exact Macro-F1 (31/35), while the
float Macro-F1s (per-class F1 4/5, 1, 6/7 against 6/7, 1, 4/5, summed in class order) differ.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from cellpath.config import ProbeConfig
from cellpath.probing.fit import ProbeTask, fit_tasks
from cellpath.probing.plan import C_SCORE_COLUMNS, PlannedRun, fit_condition
from cellpath.probing.scores import exact_macro_f1, fraction_text, macro_f1

GRID = (0.01, 0.1, 1.0, 10.0)
NAMES = ["Alpha", "Mid", "Zeta"]  # class codes 0, 1, 2 (sorted names)
CENTRES = {0: (-1.0, 0.0), 1: (0.0, 6.0), 2: (1.0, 0.0)}
TRAIN = {0: 60, 1: 60, 2: 240}
BETWEEN = (-1.0, 0.0)  # right-hand class at C = 0.01 (boundary near -1.5), left-hand at C ≥ 0.1 (near -0.6)
CLEAR = {0: (-2.5, 0.0), 1: (0.0, 6.0), 2: (2.0, 0.0)}
KEYS = ["taxonomy", "protocol", "unit", "seed"]


def _probe() -> tuple[np.ndarray, pd.DataFrame, list[PlannedRun], dict[str, np.ndarray]]:
    """Features, cells and four runs sharing one training set; their validation cells (test: copies)."""
    rng = np.random.default_rng(0)
    blocks = [np.array(CENTRES[k]) + rng.normal(scale=0.8, size=(n, 2)) for k, n in TRAIN.items()]
    labels = [np.full(n, k) for k, n in TRAIN.items()]
    validation = {  # (label, point) per validation cell
        "mirrored": [(0, CLEAR[0]), (0, CLEAR[0]), (0, BETWEEN), (1, CLEAR[1]), (1, CLEAR[1]), (1, CLEAR[1]),
                     (2, CLEAR[2]), (2, CLEAR[2]), (2, BETWEEN)],
        "left_only": [(0, CLEAR[0]), (0, CLEAR[0]), (0, BETWEEN), (1, CLEAR[1]), (2, CLEAR[2]), (2, CLEAR[2])],
        "right_only": [(0, CLEAR[0]), (0, CLEAR[0]), (1, CLEAR[1]), (2, CLEAR[2]), (2, CLEAR[2]), (2, BETWEEN)],
        "clear": [(0, CLEAR[0]), (1, CLEAR[1]), (2, CLEAR[2])],
    }
    n_train = sum(TRAIN.values())
    rows, start = {}, n_train
    for unit, cells in validation.items():
        val = np.arange(start, start + len(cells))
        rows[unit] = val
        blocks += [np.array([point for _, point in cells])] * 2  # validation, then the same points as test
        labels += [np.array([label for label, _ in cells])] * 2
        start += 2 * len(cells)
    x = np.concatenate(blocks).astype(np.float32)
    codes = np.concatenate(labels)
    cells = pd.DataFrame({"fine": np.asarray(NAMES, dtype=object)[codes]})
    train = np.arange(n_train)
    runs = [PlannedRun("iocd", unit, "organ", 0, "fine", ProbeTask(train, val, val + len(val), np.arange(3)))
            for unit, val in rows.items()]
    runs.append(PlannedRun("iocd", "empty", "organ", 0, "fine", None, "0 class(es)"))
    return x, cells, runs, rows


def _cfg() -> ProbeConfig:
    return ProbeConfig.model_validate({"c_grid": list(GRID), "is_errors": 0, "tol": 1e-10,
                                       "seeds": {"is": 1, "iocd": 1, "mocv": 1, "looo": 1}})


@pytest.fixture(scope="module")
def small_probe(tmp_path_factory):
    x, cells, runs, rows = _probe()
    frame, _, c_scores = fit_condition(x, cells, runs, _cfg())
    path = tmp_path_factory.mktemp("c-scores") / "c_scores.parquet"
    c_scores.to_parquet(path, index=False)  # recomputed from the file, as written
    return {"x": x, "cells": cells, "runs": runs, "rows": rows, "table": frame, "c_scores": pd.read_parquet(path)}


def recompute(c_scores: pd.DataFrame, rule: str = "smallest") -> pd.DataFrame:
    """Per run, the C chosen from its stored exact validation Macro-F1s and how many Cs reach the best:
    ``smallest`` (the probe's rule) or ``largest`` of the tied Cs."""
    out = []
    for key, part in c_scores.groupby(KEYS, sort=False):
        exact = [Fraction(text) for text in part["val_macro_f1_exact"]]
        best = max(exact)
        tied = [c for c, value in zip(part["c"], exact) if value == best]
        out.append({**dict(zip(KEYS, key)), "chosen_c": min(tied) if rule == "smallest" else max(tied),
                    "c_tied": len(tied), "val_macro_f1": float(best)})
    return pd.DataFrame(out)


def test_every_fitted_run_keeps_every_c_in_grid_order(small_probe):
    table, c_scores = small_probe["table"], small_probe["c_scores"]
    assert list(c_scores.columns) == C_SCORE_COLUMNS
    fitted = table[table["status"] == "ok"]
    assert len(c_scores) == len(GRID) * len(fitted) and "empty" not in set(c_scores["unit"])  # skipped: no rows
    for _, part in c_scores.groupby(KEYS, sort=False):
        assert part["c"].tolist() == list(GRID)
        exact = [Fraction(text) for text in part["val_macro_f1_exact"]]
        assert part["val_macro_f1"].tolist() == [float(value) for value in exact]  # rounded once
        assert all(text == fraction_text(Fraction(text)) and "/" in text for text in part["val_macro_f1_exact"])


def test_chosen_c_and_c_tied_follow_from_the_stored_scores(small_probe):
    table, c_scores = small_probe["table"], small_probe["c_scores"]
    fitted = table[table["status"] == "ok"][[*KEYS, "chosen_c", "c_tied", "val_macro_f1"]].reset_index(drop=True)
    expected = recompute(c_scores).astype({"c_tied": "Int64"})
    pd.testing.assert_frame_equal(fitted, expected, check_exact=True)
    # the data tell the rules apart: "the largest tied C" would not give the table
    assert not recompute(c_scores, rule="largest")["chosen_c"].equals(fitted["chosen_c"])
    by_unit = fitted.set_index("unit")
    assert by_unit.loc["mirrored", ["chosen_c", "c_tied"]].tolist() == [0.01, 4]
    assert by_unit.loc["left_only", ["chosen_c", "c_tied"]].tolist() == [0.1, 3]
    assert by_unit.loc["right_only", ["chosen_c", "c_tied"]].tolist() == [0.01, 1]
    assert by_unit.loc["clear", ["chosen_c", "c_tied"]].tolist() == [0.01, 4]
    mirrored = c_scores[c_scores["unit"] == "mirrored"]
    assert set(mirrored["val_macro_f1_exact"]) == {"31/35"}


def test_the_stored_tie_is_exact_where_float_macro_f1_would_break_it(small_probe):
    """The mirrored run's predictions at C = 0.01 and at C = 10, from single-C fits: the same exact
    Macro-F1, two float ones. Ties decided in float would record one C (or choose C = 10), not four."""
    x, runs, rows = small_probe["x"], small_probe["runs"], small_probe["rows"]
    codes = pd.Categorical(small_probe["cells"]["fine"], categories=NAMES).codes.astype(np.int64)
    mirrored = next(run.task for run in runs if run.unit == "mirrored")
    val = rows["mirrored"]
    predictions = {c: fit_tasks(x, codes, 3, [ProbeTask(mirrored.train, val, val, mirrored.classes)], c_grid=(c,),
                                tol=1e-10)[0].test_pred for c in (0.01, 10.0)}
    assert (predictions[0.01] != predictions[10.0]).sum() == 2  # the two cells on the shared point
    exact = {c: exact_macro_f1(codes[val], p, mirrored.classes) for c, p in predictions.items()}
    floats = {c: macro_f1(codes[val], p, mirrored.classes) for c, p in predictions.items()}
    assert exact[0.01] == exact[10.0] == Fraction(31, 35)
    assert floats[0.01] != floats[10.0]
    stored = small_probe["c_scores"].set_index(["unit", "c"])["val_macro_f1_exact"]
    assert [Fraction(stored[("mirrored", c)]) for c in (0.01, 10.0)] == [exact[0.01], exact[10.0]]
    # two Cs of the grid with different floats: a float rule ties at most three Cs (and picks C = 0.1
    # where C = 10's float is the larger), the exact rule ties all four and keeps C = 0.01
    row = small_probe["table"].set_index("unit").loc["mirrored"]
    assert (row["chosen_c"], row["c_tied"]) == (0.01, 4)
    assert recompute(small_probe["c_scores"]).set_index("unit").loc["mirrored", "c_tied"] == 4
