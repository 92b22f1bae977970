"""The paper's configuration as params, and its run counts (CellPath-Bench, Table 3)."""

from __future__ import annotations

from cellpath.config import Params, parse_params
from cellpath.features.encoders.registry import load_registry
from cellpath.vocabulary import (MAGNIFICATIONS, PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS, PAPER_MOCV_FOLDS,
                                 PAPER_PANEL, PAPER_PANEL_SIZES, PAPER_SEEDS, READOUTS)

PAPER_TABLE_3 = {"is": 157_500, "iocd": 86_940, "mocv": 18_900, "looo": 41_580}  # probe runs per protocol
PAPER_RUNS = 304_920


def paper_params(params: Params) -> Params:
    """``params`` with the paper's values (those params.yaml gives in its comments, and Table 3)."""
    data = params.model_dump(mode="json")
    registry = load_registry(params.extract.registry)
    data["extract"].update(encoders=[s.slug for s in registry.values() if s.type != "control"],
                           magnifications=list(MAGNIFICATIONS))
    data["concordance"]["panel_sizes"] = list(PAPER_PANEL_SIZES)
    data.update(panel=PAPER_PANEL, protocol="all", source="10x")
    data["probe"].update(taxonomies=["fine", "coarse"], readouts=list(READOUTS), magnifications=None,
                         seeds=dict(PAPER_SEEDS), mocv_folds=PAPER_MOCV_FOLDS, max_train_cells=None,
                         min_train_cells=dict(PAPER_MIN_TRAIN_CELLS), min_test_cells=dict(PAPER_MIN_TEST_CELLS))
    data["robustness"].update(taxonomies=["fine", "coarse"], magnifications=None)
    data["robustness"]["shortcut"]["n_runs"] = 20
    return parse_params(data)


def paper_comparison(runs: dict[str, int], total: int | None) -> dict:
    """Derived probe runs (per protocol, and in all) against the paper's Table 3."""
    return {"table_3": PAPER_TABLE_3, "total": PAPER_RUNS,
            "matches": total == PAPER_RUNS and all(runs[p] == n for p, n in PAPER_TABLE_3.items())}
