"""Registration from the nuclei (``cellpath.registration``) on sections of known truth.

Twenty simulated sections of 5,000 to 280,000 cells (log-spaced; the simulator's tissue layouts, a
different organ in turn). Each H&E is posed against its Xenium section as a lab's own scan is:
any rotation, mirrored half of the time, scanned at its own µm/px (0.2125 × 0.9–1.1, recorded in
the slide as it is) and shifted by 1–5 mm; 20 % of the nuclei missed on either side, 5 % false
detections, 1 µm detection noise and a fold (the nuclei within a twentieth of the tissue's extent of
one nucleus displaced by 30 µm). Every fifth section's H&E shows only a third of the section; four
sections' slides record an mpp 5–8 % off (a miscalibrated scanner: the scale search must find it).

Per section: the error of the recovered matrix at the tissue's nuclei (every Xenium nucleus the H&E
shows, its true H&E position mapped by the recovered matrix against its Xenium position; median and
max, µm), seconds and peak memory of the registration (resident set above what the process held
before, sampled every 5 ms; and the process's own peak, the simulation included, an upper bound),
and failures (a refusal counts). Against, on the same nuclei, the
registration the pipeline had before: the QC's displacement mode and trimmed affine
(``concordance.registration.refined_pairs``) from the identity pose, the H&E µm taken as Xenium µm.
Each section runs in a process of its own, so memory is that section's.

Writes benchmarks/results/registration.json.
Usage: python benchmarks/bench_registration.py [--sections N] [--largest CELLS]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from blas_conditions import blas_report, restart_without_slow_blas
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "registration.json"
ORGANS = [("Breast", "Breast cancer"), ("Lung", "Lung cancer"), ("Colon", "Colorectal cancer"),
          ("Skin", "Melanoma"), ("Liver", "Normal")]
XENIUM_UM_PER_PX = 0.2125


class PeakMemory:
    """Peak resident set (MiB) above the level at entry, sampled every 5 ms on a thread."""

    def __enter__(self) -> "PeakMemory":
        self.process, self.base, self.peak, self.running = psutil.Process(), psutil.Process().memory_info().rss, 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.mib = max(self.peak, self.process.memory_info().rss - self.base) / 2**20


def section_case(index: int, n_cells: int, crop: bool, mpp_error: float) -> dict:
    """One section: simulate, register (ours, then the baseline), score against the truth."""
    from cellpath.concordance.registration import refined_pairs
    from cellpath.registration.pose import apply, rigid_matrix
    from cellpath.registration.solve import RegistrationError, register_nuclei
    from cellpath.simulation.programs import program_for
    from cellpath.simulation.tissue import layout_cells

    rng = np.random.default_rng(1000 + index)
    layout, _ = layout_cells(program_for(*ORGANS[index % len(ORGANS)]), n_cells, rng)
    xenium = layout.xy_um
    centre = xenium.mean(axis=0)
    angle, flipped = float(rng.uniform(0, 360)), bool(rng.random() < 0.5)
    shift = rng.uniform(1000, 5000) * np.array([np.cos(a := rng.uniform(0, 2 * np.pi)), np.sin(a)])
    truth = rigid_matrix(angle, flipped, centre, centre + shift)  # Xenium µm → H&E µm
    true_he = apply(truth, xenium)
    he = true_he + rng.normal(0.0, 1.0, xenium.shape)
    shown = np.ones(len(he), bool)
    if crop:
        shown = (np.abs(true_he - true_he.mean(axis=0)) < np.ptp(true_he, axis=0) / 3.4).all(axis=1)
    he = he[shown & (rng.random(len(he)) >= 0.2)]
    fold_centre = he[rng.integers(len(he))]
    he[np.hypot(*(he - fold_centre).T) < 0.05 * np.ptp(he, axis=0).max()] += np.array([24.0, -18.0])
    he = np.vstack([he, rng.uniform(he.min(axis=0), he.max(axis=0), (len(he) // 20, 2))])
    he_mpp = XENIUM_UM_PER_PX * float(rng.uniform(0.9, 1.1))
    recorded_mpp = he_mpp * (1.0 + mpp_error)
    he_px = he / he_mpp
    seen = xenium[rng.random(len(xenium)) >= 0.2]
    record = {"section": index, "n_cells": n_cells, "n_he_nuclei": len(he), "n_xenium_nuclei": len(seen),
              "angle_deg": round(angle, 3), "flipped": flipped, "he_mpp": he_mpp, "recorded_mpp": recorded_mpp,
              "he_shows_a_third": crop, "shift_mm": float(np.hypot(*shift) / 1000)}
    with PeakMemory() as memory:
        started = time.perf_counter()
        try:
            result = register_nuclei(he_px, recorded_mpp, seen)
        except RegistrationError as error:
            result, record["refused"] = None, str(error)
        record["seconds"] = time.perf_counter() - started
    record["peak_mib"] = memory.mib
    record["process_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # simulation included
    if result is not None:
        # the matrix found maps the slide's recorded µm; the true H&E position in those µm
        errors = np.hypot(*(apply(result.he_um_to_xenium_um, true_he[shown] * recorded_mpp / he_mpp)
                            - xenium[shown]).T)
        record |= {"median_error_um": float(np.median(errors)), "max_error_um": float(errors.max()),
                   "record": result.record}
    started = time.perf_counter()
    pairs, fit = refined_pairs(he_px * recorded_mpp, seen, 10.0)
    record["baseline_seconds"] = time.perf_counter() - started
    if fit is not None:
        base = np.hypot(*(fit.apply(true_he[shown] * recorded_mpp / he_mpp) - xenium[shown]).T)
        record |= {"baseline_median_error_um": float(np.median(base)), "baseline_max_error_um": float(base.max())}
    return record


def _run(args: tuple) -> dict:
    return section_case(*args)


def main() -> None:
    removed = restart_without_slow_blas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", type=int, default=20)
    parser.add_argument("--largest", type=int, default=280_000)
    args = parser.parse_args()
    stamp = run_stamp()
    sizes = np.round(np.geomspace(5000, args.largest, args.sections)).astype(int)
    wrong_mpp = {3: 0.05, 8: -0.08, 13: 0.07, 18: -0.06}
    context = multiprocessing.get_context("spawn")
    results = []
    for index, n in enumerate(sizes):
        with context.Pool(1) as pool:  # a fresh process per section: its memory is the section's
            result = pool.apply(_run, ((index, int(n), index % 5 == 4, wrong_mpp.get(index, 0.0)),))
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "record"}), flush=True)
    registered = [r for r in results if "median_error_um" in r]
    within = [r for r in registered if r["median_error_um"] <= 1.0 and r["max_error_um"] <= 3.0]
    summary = {
        "sections": len(results), "refused": sum("refused" in r for r in results),
        "within_1um_median_3um_max": len(within),
        "worst_median_error_um": max((r["median_error_um"] for r in registered), default=None),
        "worst_max_error_um": max((r["max_error_um"] for r in registered), default=None),
        "largest_seconds": results[-1]["seconds"], "largest_peak_mib": results[-1]["peak_mib"],
        "max_process_peak_mib": max(r["process_peak_mib"] for r in results),
        "max_seconds": max(r["seconds"] for r in results),
        "median_seconds": statistics.median(r["seconds"] for r in results),
        "baseline_within_1um_median_3um_max": sum(r.get("baseline_median_error_um", np.inf) <= 1.0
                                                 and r.get("baseline_max_error_um", np.inf) <= 3.0 for r in results),
    }
    out = with_provenance({"benchmark": "registration", "summary": summary, "sections": results,
                           "removed_blas_variables": removed, "blas": blas_report()}, stamp)
    OUT.write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
