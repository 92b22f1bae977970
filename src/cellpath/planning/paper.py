"""The paper's configuration as params, its run counts (CellPath-Bench, Table 3), and the placement
configuration: the paper's, restricted to the condition its published ranking reads."""

from __future__ import annotations

from cellpath.config import Params, parse_params
from cellpath.features.encoders.registry import load_registry
from cellpath.vocabulary import (HEADLINE_MAGNIFICATION, HEADLINE_READOUT, HEADLINE_TAXONOMY, MAGNIFICATIONS,
                                 PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS, PAPER_MOCV_FOLDS, PAPER_PANEL,
                                 PAPER_PANEL_SIZES, PAPER_SEEDS, PLACEMENT_ANCHORS, READOUTS)

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
    data["expression"].update(magnifications=None)
    data["robustness"]["shortcut"]["n_runs"] = 20
    return parse_params(data)


def placement_encoders(encoders: list[str], anchors: list[str] | tuple[str, ...] = PLACEMENT_ANCHORS) -> list[str]:
    """The encoders a placement runs: ``encoders`` and then the ``anchors`` (the paper's models re-run
    beside them, so that the placed models are scored against them on the same units and seeds;
    docs/decisions/0046) not already among them."""
    return list(encoders) + [slug for slug in anchors if slug not in encoders]


def placement_params(params: Params, encoders: list[str] | None = None,
                     anchors: list[str] | tuple[str, ...] = PLACEMENT_ANCHORS) -> Params:
    """The paper's configuration (:func:`paper_params`: S25, its seeds, folds and class gates, no
    cap, all four protocols) restricted to what its published ranking reads — the headline condition,
    20×, Nuc, Tfine, for the probe and for robustness (the CRoMa headline), Nuc for the expression
    probes — for ``encoders``
    (registry slugs or names; default: ``extract.encoders`` of ``params``) and the ``anchors``."""
    data = paper_params(params).model_dump(mode="json")
    data["extract"].update(encoders=placement_encoders(list(encoders or params.extract.encoders), anchors),
                           magnifications=[HEADLINE_MAGNIFICATION])
    data["probe"].update(taxonomies=[HEADLINE_TAXONOMY], readouts=[HEADLINE_READOUT])
    data["robustness"].update(taxonomies=[HEADLINE_TAXONOMY], readouts=[HEADLINE_READOUT])
    data["expression"].update(readouts=[HEADLINE_READOUT])
    return parse_params(data)


def overrides(params: Params, target: Params) -> list[str]:
    """The ``dvc exp run -S`` arguments that turn ``params`` into ``target``: one ``key=value`` per
    setting that differs (dotted keys down to the leaves; lists and null as YAML flow values)."""
    import yaml

    def leaves(value, prefix: str = "") -> dict[str, object]:
        if isinstance(value, dict) and value:
            return {key: leaf for name, item in value.items() for key, leaf in leaves(item, f"{prefix}{name}.").items()}
        return {prefix.rstrip("."): value}

    before, after = leaves(params.model_dump(mode="json")), leaves(target.model_dump(mode="json"))
    flow = {"default_flow_style": True, "width": 10_000}
    return [f"{key}={yaml.safe_dump(value, **flow).strip().removesuffix('...').strip()}"
            for key, value in after.items() if before.get(key, object()) != value]


def paper_comparison(runs: dict[str, int], total: int | None) -> dict:
    """Derived probe runs (per protocol, and in all) against the paper's Table 3."""
    return {"table_3": PAPER_TABLE_3, "total": PAPER_RUNS,
            "matches": total == PAPER_RUNS and all(runs[p] == n for p, n in PAPER_TABLE_3.items())}
