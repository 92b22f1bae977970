"""Refit the default's probe run table with scikit-learn, without the probe engine.

Run from the project root after the default ``dvc repro`` (it reads ``data/``)::

    .venv/bin/python tests/data/probe_reference/refit.py [--jobs 2]

and it writes ``tests/data/probe_reference/default_runs.csv``.

What comes from the pipeline: the runs and their cells — the plan of
``cellpath.probing.tasks.plan_magnification`` (training, validation and test cells, the training cap,
the class gates), which every model shares — and the feature matrices, read from the feature store
by ``cellpath.features.panel.PanelFeatures``. What is computed here, independently of the engine:
each run's standardisation on its training cells (population SD, an SD below 1e-8 taken as 1),
scikit-learn's ``LogisticRegression`` (lbfgs, ``tol`` 1e-10, run until it converges: a fit that
stops at ``max_iter`` stops the script) at every C of ``probe.c_grid``, each C's validation
Macro-F1 over the run's classes (scikit-learn's ``f1_score``), the C of the best one (the smallest
C where several are within 1e-12 of it, the tie rule of docs/decisions/0039-tie-rules.md) and that
C's test Macro-F1 — and every C's validation and test Macro-F1, what the choice was made from.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from joblib import Parallel, delayed
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score

from cellpath.config import load_params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import PanelFeatures, load_panel_cells
from cellpath.features.readouts import readout_available
from cellpath.io.layout import features_dir
from cellpath.probing.plan import class_codes
from cellpath.probing.tasks import plan_magnification

HERE = Path(__file__).resolve().parent
TOL, MAX_ITER, TIE = 1e-10, 100_000, 1e-12
KEYS = ["model", "magnification", "readout", "taxonomy", "protocol", "unit", "seed"]


def refit_run(x: np.ndarray, codes: np.ndarray, task, c_grid: list[float]) -> dict:
    """One run fitted with scikit-learn at every C of ``c_grid``: the chosen C and its test Macro-F1,
    and every C's validation and test Macro-F1 (``val_macro_f1_C=<c>``, ``test_macro_f1_C=<c>``)."""
    train = x[task.train].astype(np.float64)
    mean, sd = train.mean(axis=0), train.std(axis=0)
    sd[sd < 1e-8] = 1.0

    def scaled(rows: np.ndarray) -> np.ndarray:
        return (x[rows].astype(np.float64) - mean) / sd

    val, test = scaled(task.val), scaled(task.test)
    models, scores, tests = [], [], []
    for c in c_grid:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)
            model = LogisticRegression(C=c, tol=TOL, max_iter=MAX_ITER).fit((train - mean) / sd, codes[task.train])
        models.append(model)
        scores.append(f1_score(codes[task.val], model.predict(val), labels=task.classes, average="macro",
                               zero_division=0))
        tests.append(f1_score(codes[task.test], model.predict(test), labels=task.classes, average="macro",
                              zero_division=0))
    best = max(scores)
    chosen = next(i for i, score in enumerate(scores) if score >= best - TIE)
    return {"chosen_c": c_grid[chosen], "macro_f1": float(tests[chosen]),
            **{f"val_macro_f1_C={c:g}": float(v) for c, v in zip(c_grid, scores)},
            **{f"test_macro_f1_C={c:g}": float(t) for c, t in zip(c_grid, tests)}}


def refit_block(params, spec, magnification: str, readout: str, panel, plans) -> list[dict]:
    """Every run of one feature block (encoder, magnification, readout), both taxonomies."""
    rows = PanelFeatures(features_dir(Path("data")).resolve(), spec.slug, magnification, panel).readout(readout)
    x = rows.take(np.arange(len(panel.cells)))
    rows = []
    for taxonomy, runs in plans[magnification].items():
        codes, _ = class_codes(panel.cells[taxonomy])
        for run in runs:
            row = {"model": spec.name, "magnification": magnification, "readout": readout, "taxonomy": taxonomy,
                   "protocol": run.protocol, "unit": run.unit, "seed": run.seed,
                   "status": "ok" if run.task is not None else "skipped"}
            if run.task is not None:
                row |= refit_run(x, codes, run.task, list(params.probe.c_grid))
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="feature blocks fitted at once")
    args = parser.parse_args()
    params = load_params("params.yaml")
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    panel = load_panel_cells(Path("data"), params.panel)
    magnifications = params.stage_magnifications(params.probe.magnifications)
    plans = {m: plan_magnification(params, Path("data"), panel, encoders, m) for m in magnifications}
    blocks = [(spec, m, readout) for spec in encoders for m in magnifications for readout in params.probe.readouts
              if readout_available(spec, readout)]
    results = Parallel(n_jobs=args.jobs)(delayed(refit_block)(params, spec, m, readout, panel, plans)
                                         for spec, m, readout in blocks)
    table = pd.DataFrame([row for rows in results for row in rows]).sort_values(KEYS)
    scores = [c for c in table.columns if "macro_f1" in c]
    table[scores] = table[scores].round(6)
    table.to_csv(HERE / "default_runs.csv", index=False)
    print(f"{len(table)} runs, {(table['status'] == 'ok').sum()} fitted, from {len(blocks)} feature blocks")


if __name__ == "__main__":
    main()
