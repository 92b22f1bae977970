"""Benchmark: the per-section stages' cost lines, fitted on small sections and checked on the real-size one.

``cellpath plan`` prices ingest, annotate and concordance, and the work of an extraction around the
encoder's forward pass (reading the H&E, placing the cells, pooling, writing), as lines in a
section's cells (``runtime.costs.SectionCosts``). This runs ``bench_real_section``'s stages — fetch,
atlas, reference, ingest, annotate, cellvit, concordance, extract (ViT-Ti/16 at 20×) — on simulated
sections of ``--cells`` sizes (default 10,000, 40,000 and 120,000 cells, the 5,000-gene panel, the same
100,000 × 30,000 CELLxGENE-shaped atlas as reference), fits each stage's line of wall seconds and of
peak RSS (least squares), and predicts the section of ``benchmarks/results/real_section.json``
(283,171 cells, not among the fitted sizes): estimate ÷ measured per stage, the goal within 2×.
Extraction's line is fitted on its measured time less the forward pass the cost model's
``extract`` entry prices for the patches the run read (``n_patches`` of its sidecar), and on its
peak RSS less the ViT's fp32 weights.

Writes benchmarks/results/section_stages.json; with ``--calibrate`` also the lines into the cost
model stored with the code (``cellpath/data/costs.json``, the ``cpu`` entry's ``sections``).

A size whose stages a kept ``--workdir`` already recorded (``cells-<n>/stages.json``) is not run again.

Usage: python benchmarks/bench_section_stages.py [--cells 10000 40000 120000] [--workdir DIR] [--calibrate]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from bench_real_section import EXTRACT_ENCODER, REFERENCE, run_section
from blas_conditions import blas_report
from provenance import run_stamp, with_provenance

from cellpath.features.encoders.registry import load_registry
from cellpath.runtime.costs import (COSTS_PATH, SECTION_STAGES, extract_seconds, fit_section_costs, load_costs,
                                    parameter_count, patch_gflop, save_costs, section_heap_bytes, section_seconds)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "section_stages.json"
REAL_SECTION = ROOT / "benchmarks" / "results" / "real_section.json"
STAGES = ["fetch", "atlas", "reference", "ingest", "annotate", "cellvit", "concordance", "extract"]


def forward_seconds(patches: int) -> float:
    """Seconds the cost model's ``cpu`` extract entry gives the ViT-Ti/16's forward pass over ``patches``."""
    spec = load_registry(ROOT / "models" / "encoders.yaml")[EXTRACT_ENCODER]
    gflop = patch_gflop(parameter_count(spec.params), spec.input_size, spec.patch_size, spec.num_prefix_tokens)
    return extract_seconds(load_costs().costs("cpu").extract, patches, gflop)


def weights_bytes() -> float:
    return parameter_count(load_registry(ROOT / "models" / "encoders.yaml")[EXTRACT_ENCODER].params) * 4


def stage_points(stage: str, runs: dict) -> tuple[list[int], list[float], list[float]]:
    """(cells, seconds, peak bytes) of one stage over the sizes run; extraction's less its forward
    pass and its weights."""
    cells, seconds, peaks = [], [], []
    for size, run in runs.items():
        result = run["stages"][stage]
        cells.append(size)
        if stage == "extract":
            seconds.append(result["seconds"] - forward_seconds(run["patches"]))
            peaks.append(result["peak_rss_bytes"] - weights_bytes())
        else:
            seconds.append(result["seconds"])
            peaks.append(result["peak_rss_bytes"])
    return cells, seconds, peaks


def check_real_section(lines: dict) -> dict:
    """Estimate ÷ measured, seconds and peak RSS, per stage of the real-size section."""
    real = json.loads(REAL_SECTION.read_text())
    cells = real["cells"]
    checks = {}
    for stage, costs in lines.items():
        measured = real["stages"].get(stage)
        if measured is None or measured.get("returncode") != 0:
            checks[stage] = {"measured": None}
            continue
        seconds, peak = section_seconds(costs, cells), section_heap_bytes(costs, cells)
        if stage == "extract":
            patches = measured.get("n_patches")
            if patches is None:
                checks[stage] = {"measured": None, "why": "the real-size run did not record the patches it read"}
                continue
            seconds += forward_seconds(patches)
            peak += weights_bytes()
        checks[stage] = {"cells": cells, "estimated_seconds": round(seconds, 1), "measured_seconds": measured["seconds"],
                         "seconds_ratio": round(seconds / measured["seconds"], 3),
                         "estimated_peak_bytes": round(peak), "measured_peak_bytes": measured["peak_rss_bytes"],
                         "peak_ratio": round(peak / measured["peak_rss_bytes"], 3)}
        checks[stage]["within_2x"] = all(0.5 <= checks[stage][k] <= 2.0 for k in ("seconds_ratio", "peak_ratio"))
    return {"section": real["section"]["section_id"], "cells": cells, "commit": real["commit"], "stages": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[10_000, 40_000, 120_000])
    parser.add_argument("--genes", type=int, default=5_000)
    parser.add_argument("--workdir", type=Path, help="keep each size's data here (default: a temporary folder)")
    parser.add_argument("--calibrate", action="store_true", help="write the lines into the stored cost model")
    args = parser.parse_args()
    stamp = run_stamp()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="cellpath-section-stages-"))
    runs, atlas = {}, None
    for size in sorted(args.cells):
        workdir = root / f"cells-{size}"
        workdir.mkdir(parents=True, exist_ok=True)
        record = workdir / "stages.json"  # a size measured before in this workdir is not run again
        stages = json.loads(record.read_text()) if record.is_file() else run_section(
            workdir, size, args.genes, STAGES, {}, lambda done: None, atlas=atlas)
        failed = [stage for stage, result in stages.items() if result["returncode"] != 0]
        if failed:
            raise SystemExit(f"bench_section_stages: {failed[0]} failed at {size:,} cells (see its log in {workdir})")
        record.write_text(json.dumps(stages, indent=2) + "\n")
        atlas = atlas or workdir / "atlas.h5ad"
        runs[size] = {"stages": stages, "patches": stages["extract"]["n_patches"]}
    source = (f"benchmarks/results/section_stages.json ({stamp['date']}, {stamp['commit']}): simulated sections of "
              f"{', '.join(f'{n:,}' for n in sorted(runs))} cells, {args.genes:,}-gene panel, a 100,000 × 30,000 "
              f"reference ({REFERENCE})")
    lines = {stage: fit_section_costs(*stage_points(stage, runs), cores=os.cpu_count(), source=source)
             for stage in SECTION_STAGES}
    result = with_provenance({
        "benchmark": "section_stages", "genes": args.genes, "encoder": EXTRACT_ENCODER,
        "runs": {str(size): run for size, run in runs.items()},
        "lines": {stage: dataclasses.asdict(costs) for stage, costs in lines.items()},
        "real_section": check_real_section(lines), "blas": blas_report(), "machine": {"cpus": os.cpu_count()}}, stamp)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["real_section"], indent=2))
    if args.calibrate:
        model = load_costs()
        cpu = dataclasses.replace(model.costs("cpu"), sections=lines)
        save_costs(dataclasses.replace(model, devices={**model.devices, "cpu": cpu}), COSTS_PATH)
        print(f"wrote the per-section lines into {COSTS_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
