"""Does a probe run's result depend on the runs fitted beside it? Each condition of the default's panel
fitted as the stage fits it, and again task by task, protocol by protocol (a one-protocol ``dvc exp
run``) and under a memory budget that groups the tasks otherwise.

Reads the default project's ``data/`` (run ``make run`` first) and ``params.yaml``. Per condition
(model, magnification, readout, taxonomy; ``--conditions`` of them, the first in the stage's order)
and per way of fitting: runs with the same chosen C as the stage, the runs among those that differ
whose C was a recorded tie on either side, runs with a bitwise-equal test Macro-F1 and with equal
L-BFGS iterations, and the largest |Δ Macro-F1| in points. One torch thread, as the stage's default.

Usage: python benchmarks/bench_companions.py [--conditions 4] [--out benchmarks/results/companions.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from cellpath.config import load_params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import PanelFeatures, load_panel_cells
from cellpath.features.readouts import readout_available
from cellpath.probing.fit import ProbeResult, fit_tasks
from cellpath.probing.plan import class_codes
from cellpath.probing.tasks import plan_magnification

from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
#: A memory budget small enough that the default's tasks fall into other groups than at the stage's.
OTHER_BUDGET_MB = 8.0


def compare(stage: list[ProbeResult], other: list[ProbeResult]) -> dict:
    """How far ``other`` is from the stage's results, run by run."""
    differs = [i for i, (a, b) in enumerate(zip(stage, other)) if a.chosen_c != b.chosen_c]
    gaps = [100 * abs(a.macro_f1 - b.macro_f1) for a, b in zip(stage, other)]
    return {"runs": len(stage), "same_c": len(stage) - len(differs),
            "other_c_at_a_recorded_tie": sum(stage[i].tied_cs > 1 or other[i].tied_cs > 1 for i in differs),
            "macro_f1_bitwise_equal": sum(a.macro_f1 == b.macro_f1 for a, b in zip(stage, other)),
            "iterations_equal": sum(a.iterations == b.iterations for a, b in zip(stage, other)),
            "max_macro_f1_difference_points": round(max(gaps), 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "companions.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stamp = run_stamp()
    os.chdir(ROOT)  # params.yaml's paths are relative to the project root
    params = load_params(ROOT / "params.yaml")
    cfg, data = params.probe, ROOT / "data"
    panel = load_panel_cells(data, params.panel)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    magnification = params.stage_magnifications(cfg.magnifications)[0]
    plans = plan_magnification(params, data, panel, encoders, magnification)
    conditions = [(spec, readout, taxonomy) for spec in encoders for readout in cfg.readouts
                  if readout_available(spec, readout) for taxonomy in plans][:args.conditions]

    def fit(x, y, k, tasks, budget=cfg.batch_memory_mb):
        return fit_tasks(x, y, k, tasks, c_grid=tuple(cfg.c_grid), max_iter=cfg.max_iter, tol=cfg.tol,
                         batch_memory_mb=budget)

    rows = []
    for spec, readout, taxonomy in conditions:
        x = PanelFeatures(data / "features", spec.slug, magnification, panel).readout(readout)
        y, names = class_codes(panel.cells[taxonomy])
        runs = [run for run in plans[taxonomy] if run.task is not None]
        tasks = [run.task for run in runs]
        stage = fit(x, y, len(names), tasks)
        alone = [fit(x, y, len(names), [task])[0] for task in tasks]
        by_protocol: list[ProbeResult | None] = [None] * len(tasks)
        for protocol in sorted({run.protocol for run in runs}):
            positions = [i for i, run in enumerate(runs) if run.protocol == protocol]
            for i, result in zip(positions, fit(x, y, len(names), [tasks[i] for i in positions])):
                by_protocol[i] = result
        budget = fit(x, y, len(names), tasks, OTHER_BUDGET_MB)
        rows.append({"model": spec.name, "magnification": magnification, "readout": readout, "taxonomy": taxonomy,
                     "alone": compare(stage, alone), "one_protocol": compare(stage, by_protocol),
                     f"budget_{OTHER_BUDGET_MB:g}_mb": compare(stage, budget)})
        print(json.dumps(rows[-1]))
    total = {way: {key: sum(row[way][key] for row in rows) if key != "max_macro_f1_difference_points"
                   else max(row[way][key] for row in rows) for key in rows[0][way]}
             for way in rows[0] if isinstance(rows[0][way], dict)}
    result = {"benchmark": "companions", "probe": {"c_grid": list(cfg.c_grid), "tol": cfg.tol,
                                                   "batch_memory_mb": cfg.batch_memory_mb},
              "torch_threads": torch.get_num_threads(), "conditions": rows, "total": total}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, stamp), indent=2) + "\n")
    print(json.dumps(total, indent=2))


if __name__ == "__main__":
    main()
