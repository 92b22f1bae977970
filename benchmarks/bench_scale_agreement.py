"""Agreement at scale: the probe engine against scikit-learn run to convergence on bench_scale's panel.

The panel is bench_scale's (``cellpath.simulation.feature_store``: 25 sections of five organs, D = 1,280,
Virchow2's slug) at ``--cells`` cells, with class centres drawn at SD ``--separation`` per feature (bench_scale's
0.35 makes every class separable at D = 1,280, Macro-F1 1.0 whatever the fit; the default 0.03 leaves
the probe a Macro-F1 well below 1, so that a fit short of its optimum shows). The runs are the probe stage's LOOO runs of Tfine on Nuc at 20×
(``--seeds`` seeds, every organ held out in turn; the first ``--max-runs`` of them), uncapped, as the
paper fits them. Ours: ``fit_tasks`` as the stage calls it (params.yaml's C grid, tol and max_iter;
the tasks grouped within ``probe.batch_memory_mb``). Reference: ``LogisticRegression(C, tol=1e-8,
max_iter=10000)`` per C on the same standardised training cells, the same selection (best validation
Macro-F1, earliest C on ties) and the same test cells. Reported per run: training cells, the chosen C
and test Macro-F1 of each side; in all: runs with the same C, the largest |Δ Macro-F1| (pp) and the
share within 0.1 pp. Seconds of each side are recorded for information only (one thread each).

Usage: python benchmarks/bench_scale_agreement.py [--cells 100000] [--seeds 1] [--max-runs N] [--separation 0.03]
       [--workdir <temp dir>/cellpath-scale-agreement]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from cellpath.config import parse_params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import PanelFeatures, load_panel_cells, panel_matrix
from cellpath.probing.fit import fit_tasks
from cellpath.probing.plan import class_codes
from cellpath.probing.tasks import plan_magnification
from cellpath.simulation.feature_store import write_feature_panel

from bench_probe import REFERENCE, sklearn_fits
from bench_scale import ENCODER, N_SECTIONS, SLUG, blas, stage_params
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
F1_POINTS = 0.1


def reference_run(x, y, task, c_grid) -> tuple[float, float, int]:
    """scikit-learn's chosen C, its test Macro-F1 and how many of its fits did not converge."""
    test_f1, val_f1, unconverged = sklearn_fits(x, y, task, c_grid, **REFERENCE)
    best = int(np.argmax(val_f1))
    return float(c_grid[best]), float(test_f1[best]), unconverged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--max-runs", type=int, default=None)
    parser.add_argument("--separation", type=float, default=0.03)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "cellpath-scale-agreement")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale_agreement.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stamp = run_stamp()
    shutil.rmtree(args.workdir, ignore_errors=True)
    data = args.workdir / "data"
    panel_info = write_feature_panel(data, n_sections=N_SECTIONS, cells_per_section=args.cells // N_SECTIONS,
                                     width=1280, encoder=SLUG, separation=args.separation)
    probe = yaml.safe_load((ROOT / "params.yaml").read_text())["probe"]
    raw = stage_params(data, probe["batch_memory_mb"], probe["max_iter"], panel_info.panel, args.seeds)
    params = parse_params(raw)
    cfg = params.probe
    spec = selected_encoders(params.extract.registry, params.extract.encoders)[0]
    panel = load_panel_cells(data, params.panel)
    x = panel_matrix(PanelFeatures(data / "features", spec.slug, "20x", panel).readout("Nuc"))
    y, names = class_codes(panel.cells["fine"])
    runs = [run for run in plan_magnification(params, data, panel, [spec], "20x")["fine"] if run.task is not None]
    tasks = [run.task for run in runs][:args.max_runs]

    started = time.perf_counter()
    ours = fit_tasks(x, y, len(names), tasks, c_grid=tuple(cfg.c_grid), tol=cfg.tol, max_iter=cfg.max_iter,
                     batch_memory_mb=cfg.batch_memory_mb)
    ours_seconds = time.perf_counter() - started
    started = time.perf_counter()
    reference = [reference_run(x, y, task, tuple(cfg.c_grid)) for task in tasks]
    reference_seconds = time.perf_counter() - started

    per_run = [{"n_train": len(task.train), "n_test": len(task.test), "chosen_c": result.chosen_c,
                "chosen_c_reference": c, "macro_f1": round(result.macro_f1, 6), "macro_f1_reference": round(f1, 6),
                "difference_points": round(100 * abs(result.macro_f1 - f1), 4), "iterations": result.iterations,
                "converged": result.converged, "reference_fits_not_converged": bad}
               for task, result, (c, f1, bad) in zip(tasks, ours, reference)]
    differences = [r["difference_points"] for r in per_run]
    result = {"benchmark": "scale_agreement", "encoder": ENCODER, "width": 1280, "n_cells": panel_info.n_cells,
              "separation": args.separation,
              "protocol": "looo", "taxonomy": "fine", "readout": "Nuc", "magnification": "20x",
              "probe": {"c_grid": list(cfg.c_grid), "tol": cfg.tol, "max_iter": cfg.max_iter,
                        "batch_memory_mb": cfg.batch_memory_mb, "max_train_cells": None},
              "reference": REFERENCE, "runs": len(per_run), "same_c": sum(r["chosen_c"] == r["chosen_c_reference"]
                                                                         for r in per_run),
              "max_difference_points": max(differences),
              "share_within_0.1pp": round(float(np.mean([d <= F1_POINTS for d in differences])), 4),
              "seconds": {"ours": round(ours_seconds, 1), "reference": round(reference_seconds, 1)},
              "per_run": per_run, "blas": blas()}
    result["agrees"] = result["same_c"] == result["runs"] and result["max_difference_points"] <= F1_POINTS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(with_provenance(result, stamp), indent=2) + "\n")
    shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_run", "blas")}, indent=2))


if __name__ == "__main__":
    main()
