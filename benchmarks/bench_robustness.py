"""Robustness-metric throughput: cellpath.robustness against the `croma` package and the exact-search bound.

Per data kind (``KINDS``: balanced types with a moderate section effect, and a tissue's skewed type
frequencies over 12 sections with a low-rank type signal as large as the section effect) and size n
(default 5,000, 20,000, 100,000 and 1,000,000; d = 384), seeded synthetic embeddings are scored with
CRoMa (m = 5), RI and MaRI (fixed k = 11):

* ours: ``cellpath.robustness.score_embeddings`` (also computes the two k-NN probes);
* croma: ``croma.CRoMa.compute`` + ``croma.RI.compute`` + ``croma.MaRI.compute`` on the same
  float32 array (only for n <= --croma-max-n; it is brute force and slow), with every value
  compared to ours (per-sample CRoMa, median, F(0), LTM, RI, MaRI; target: within 1e-5);
* bound: one blocked n x n x d float32 matrix product in numpy on the same L2-normalised data,
  the machine's floor for any exact search (target: ours within 3x);
* float64: where ours runs in full, a blocked float64 brute force of the m nearest SO and OS
  distances of every cell, against which every margin and mean distance of ours is compared
  (target: within 1e-9).

Same conditions for both sides: the script restarts without the environment variables that slow
numpy's BLAS on some machines here (``blas_conditions``), runs ours and croma in one process with
the same BLAS and thread counts (threadpoolctl's report is written), and alternates them
--repeats times (ours, croma, ours, croma, ...); speed-ups are quoted as the median of the per-pair
ratios with their range, against croma's three metrics and against its CRoMa alone.

Above --full-max-n (default 100,000) our time is *estimated from a measured sample*: the same exact
searches (typed SO/OS per block, and the k-NN search) for --anchor-sample random anchors against
all n candidates, plus every index the full run would build, timed separately. Each anchor's search
costs the same in expectation, so estimate = normalise + index builds + sampled searches x n / sample.
At n = --full-max-n both the full run and the estimate are made, so the estimator is checked
against a measurement in the same run ("estimate_vs_measured").

Writes benchmarks/results/robustness.json (targets: >= 10x croma's public API at every croma size;
<= 3x the matmul bound; margins within 1e-9 of the float64 brute force). --bound-rows times the bound on the first rows only and scales it
(the blocked product is linear in the query rows).
Usage: python benchmarks/bench_robustness.py [--kinds balanced imbalanced] [--sizes 5000 20000 100000 1000000]
       [--croma-max-n N] [--repeats R] [--bound-rows R] [--full-max-n N] [--anchor-sample S]
The committed record: --sizes 10000 20000 --croma-max-n 20000 --full-max-n 20000.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import croma
import faiss
import numpy as np
import pandas as pd

from cellpath.robustness import l2_normalise, score_embeddings
from cellpath.robustness.neighbours import knn_excluding_groups, typed_neighbours

from blas_conditions import blas_report, restart_without_slow_blas
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
D, M, K = 384, 5, 11
TOLERANCE = 1e-5
FLOAT64_TOLERANCE = 1e-9


@dataclass(frozen=True)
class DataKind:
    """How a synthetic panel is drawn: cell-type frequencies, sections, cells per patch and the scale of
    each effect (type centres live in a ``type_rank``-dimensional subspace of the D features)."""

    type_frequencies: tuple[float, ...]
    n_sections: int
    cells_per_patch: int
    type_scale: float
    section_scale: float
    patch_scale: float
    noise_scale: float
    type_rank: int


KINDS = {
    # 4 balanced types x 4 sections, patches of 8, full-rank type centres: types well separated.
    "balanced": DataKind((0.25, 0.25, 0.25, 0.25), 4, 8, 1.0, 0.8, 0.5, 1.5, D),
    # 9 types at a tissue's skewed frequencies x 12 sections, patches of 16, low-rank type signal and
    # a section effect as large as the type effect: many near-ties and negative margins.
    "imbalanced": DataKind((0.34, 0.2, 0.13, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02), 12, 16, 1.0, 1.0, 0.6, 1.2, 16),
}


def synthetic(n: int, kind: DataKind, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float32 (n, D) features = cell-type centre + section centre + patch offset + noise, with the
    cell type, section and patch of every row."""
    rng = np.random.default_rng(seed)
    n_types = len(kind.type_frequencies)
    n_patches = -(-n // kind.cells_per_patch)
    patch = np.repeat(np.arange(n_patches), kind.cells_per_patch)[:n]
    section = rng.integers(0, kind.n_sections, n_patches)[patch]
    cell_type = rng.choice(n_types, size=n, p=np.asarray(kind.type_frequencies) / sum(kind.type_frequencies))
    basis = np.linalg.qr(rng.standard_normal((D, kind.type_rank)))[0].T.astype(np.float32)
    type_centre = kind.type_scale * np.sqrt(D / kind.type_rank, dtype=np.float32) * (
        rng.standard_normal((n_types, kind.type_rank), dtype=np.float32) @ basis)
    section_centre = kind.section_scale * rng.standard_normal((kind.n_sections, D), dtype=np.float32)
    patch_offset = kind.patch_scale * rng.standard_normal((n_patches, D), dtype=np.float32)
    x = np.empty((n, D), dtype=np.float32)
    for start in range(0, n, 65536):
        rows = slice(start, min(n, start + 65536))
        x[rows] = kind.noise_scale * rng.standard_normal((rows.stop - start, D), dtype=np.float32)
        x[rows] += type_centre[cell_type[rows]] + section_centre[section[rows]] + patch_offset[patch[rows]]
    return x, cell_type, section, patch


def matmul_bound(unit: np.ndarray, rows: int | None, block: int = 1024) -> tuple[float, int]:
    """Seconds for unit @ unit.T in blocks of query rows (products discarded), and the rows timed.

    With ``rows`` below n only the first ``rows`` query rows are multiplied and the time is scaled by
    n / rows: every block costs the same (block x n x d), so the product is linear in the rows.
    """
    timed = len(unit) if rows is None else min(len(unit), rows)
    start = time.perf_counter()
    for first in range(0, timed, block):
        np.dot(unit[first : min(timed, first + block)], unit.T)
    return (time.perf_counter() - start) * len(unit) / timed, timed


def run_croma(x: np.ndarray, cell_type: np.ndarray, section: np.ndarray, patch: np.ndarray) -> dict:
    manifest = pd.DataFrame({
        "sample_id": np.arange(len(x)).astype(str), "image_path": "none", "label": cell_type.astype(str),
        "group_id": patch.astype(str), "section": section.astype(str),
    })
    timings, cpu, results = {}, {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, call in (
            ("croma", lambda: croma.CRoMa.compute(x, manifest, confounder_column="section", m=M)),
            ("ri", lambda: croma.RI.compute(x, manifest, confounder_column="section", k_candidates=[K])),
            ("mari", lambda: croma.MaRI.compute(x, manifest, confounder_column="section", k_candidates=[K])),
        ):
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = call()
            timings[name] = time.perf_counter() - start
            cpu[name] = time.process_time() - start_cpu
    return {"seconds": sum(timings.values()), "seconds_by_metric": timings, "cpu_seconds": sum(cpu.values()),
            "results": results}


def float64_brute_force(x: np.ndarray, cell_type: np.ndarray, section: np.ndarray, patch: np.ndarray,
                        block: int = 1024) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every cell's mean float64 cosine distance to its M nearest SO and OS cells outside its patch
    (NaN where it has fewer than M) and its margin, from blocked float64 products of rows divided by
    their norm: an implementation that shares nothing with ours but the definition."""
    unit = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    d_so, d_os = np.full(len(x), np.nan), np.full(len(x), np.nan)
    for start in range(0, len(x), block):
        rows = slice(start, min(len(x), start + block))
        distance = np.clip(1.0 - unit[rows] @ unit.T, 0.0, 2.0)
        distance[patch[rows, None] == patch[None, :]] = np.inf
        same_type, same_section = cell_type[rows, None] == cell_type[None, :], section[rows, None] == section[None, :]
        for out, allowed in ((d_so, same_type & ~same_section), (d_os, ~same_type & same_section)):
            nearest = np.partition(np.where(allowed, distance, np.inf), M - 1, axis=1)[:, :M]
            out[rows] = np.where(np.isfinite(nearest).all(axis=1), np.sort(nearest, axis=1).mean(axis=1), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return d_so, d_os, (d_os - d_so) / (d_os + d_so)


def float64_agreement(ours, x, cell_type, section, patch) -> dict:
    """How far ours is from :func:`float64_brute_force`: margins and mean SO / OS distances (max abs)."""
    d_so, d_os, margins = float64_brute_force(x, cell_type, section, patch)
    same_nan = bool(np.array_equal(np.isnan(margins), np.isnan(ours.margins)))
    diffs = {name: float(np.nanmax(np.abs(a - b))) for name, a, b in (
        ("margins_max_abs", ours.margins, margins), ("mean_so_distance_max_abs", ours.mean_so_distance, d_so),
        ("mean_os_distance_max_abs", ours.mean_os_distance, d_os))}
    return {"abs_differences": diffs, "undefined_margins_identical": same_nan,
            "within_1e-9": bool(same_nan and max(diffs.values()) <= FLOAT64_TOLERANCE)}


def agreement(ours, reference: dict) -> dict:
    c, ri, mari = reference["croma"], reference["ri"], reference["mari"]
    diffs = {
        "per_sample_croma_max_abs": float(np.max(np.abs(ours.margins - c.sample_values))),
        "median": abs(ours.median - c.value), "f0": abs(ours.f0 - c.f0), "ltm": abs(ours.ltm - c.ltm_alpha),
        "ri": abs(ours.ri - ri.value), "mari": abs(ours.mari - mari.value),
    }
    return {"abs_differences": diffs, "identical_within_1e-5": bool(max(diffs.values()) <= TOLERANCE)}


def sampled_estimate(x: np.ndarray, cell_type: np.ndarray, section: np.ndarray, patch: np.ndarray,
                     sample: int, seed: int = 1) -> dict:
    """Our full-run seconds estimated from exact searches for ``sample`` random anchors (see module doc)."""
    n = len(x)
    start = time.perf_counter()
    unit = l2_normalise(x)
    normalise_s = time.perf_counter() - start

    start = time.perf_counter()  # the indexes a full run builds (faiss.IndexFlatIP copies, as neighbours does)
    for b, c in np.unique(np.stack([cell_type, section]), axis=1).T:
        for candidates in ((cell_type == b) & (section != c), (cell_type != b) & (section == c)):
            faiss.IndexFlatIP(D).add(unit[candidates])
    faiss.IndexFlatIP(D).add(unit)
    build_s = time.perf_counter() - start

    anchors = np.sort(np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False))
    start = time.perf_counter()
    typed_neighbours(unit, cell_type, section, patch, M, anchors=anchors)
    knn_excluding_groups(unit, patch, K, anchors=anchors)
    sampled_s = time.perf_counter() - start
    search_s = max(0.0, sampled_s - build_s) * n / len(anchors)
    return {"anchors_sampled": int(len(anchors)), "normalise_seconds": normalise_s, "index_build_seconds": build_s,
            "sampled_search_seconds": sampled_s, "estimated_seconds": normalise_s + build_s + search_s}


def time_ours(x, cell_type, section, patch):
    start = time.perf_counter()
    ours = score_embeddings(x, cell_type, section, patch, m=M, k=K)
    return time.perf_counter() - start, ours


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


def run_size(kind_name: str, n: int, with_croma: bool, bound_rows: int | None, full: bool, anchor_sample: int,
             check_estimate: bool, repeats: int) -> dict:
    """One (data kind, n): ours and, with croma, both sides alternated ``repeats`` times (ours, croma,
    ours, croma, ...) in this process, under the same BLAS and threads; ratios per pair."""
    x, cell_type, section, patch = synthetic(n, KINDS[kind_name])
    row: dict = {"kind": kind_name, "n": n, "croma_run": with_croma, "ours_measured_in_full": full}
    if full:
        ours_s, ours = time_ours(x, cell_type, section, patch)
        row.update({"ours_seconds_each": [ours_s], "ours_summary": ours.summary(),
                    "float64_brute_force": float64_agreement(ours, x, cell_type, section, patch)})
    if not full or check_estimate:
        estimate = sampled_estimate(x, cell_type, section, patch, anchor_sample)
        row["ours_estimate_from_sample"] = estimate
        if full:
            estimate["estimate_vs_measured"] = estimate["estimated_seconds"] / row["ours_seconds_each"][0]
        else:
            row["ours_seconds_each"] = [estimate["estimated_seconds"]]
    if with_croma:
        croma_runs = []
        for repeat in range(repeats):
            if repeat:
                row["ours_seconds_each"].append(time_ours(x, cell_type, section, patch)[0])
            croma_runs.append(run_croma(x, cell_type, section, patch))
        ours_each = row["ours_seconds_each"]
        row.update({
            "croma_seconds_each": [r["seconds"] for r in croma_runs],
            "croma_seconds_by_metric_each": [r["seconds_by_metric"] for r in croma_runs],
            "croma_cpu_seconds_each": [r["cpu_seconds"] for r in croma_runs],
            "speedup_vs_croma": spread([r["seconds"] / o for r, o in zip(croma_runs, ours_each)]),
            "speedup_vs_croma_crom_a_alone": spread(
                [r["seconds_by_metric"]["croma"] / o for r, o in zip(croma_runs, ours_each)]),
            **agreement(ours, croma_runs[0]["results"]),
        })
    row["ours_seconds"] = float(np.median(row["ours_seconds_each"]))
    bound_s, timed_rows = matmul_bound(l2_normalise(x), bound_rows)
    row.update({"matmul_bound_seconds": bound_s, "matmul_bound_rows_timed": timed_rows,
                "ratio_vs_matmul_bound": row["ours_seconds"] / bound_s})
    print(json.dumps({key: value for key, value in row.items() if key != "ours_summary"}), flush=True)
    return row


def targets(runs: list[dict]) -> dict:
    """Per data kind: the speed-up over croma at every croma size, ours against the matmul bound and the
    float64 brute force."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        compared = [r for r in mine if r["croma_run"]]
        medians = {str(r["n"]): r["speedup_vs_croma"]["median"] for r in compared}
        measured = {str(r["n"]): r["ratio_vs_matmul_bound"] for r in mine if r["ours_measured_in_full"]}
        estimated = {str(r["n"]): r["ratio_vs_matmul_bound"] for r in mine if not r["ours_measured_in_full"]}
        float64 = [r["float64_brute_force"] for r in mine if "float64_brute_force" in r]
        out[kind] = {
            "speedup_vs_croma": {"target": ">= 10 at every croma size", "measured_median": medians,
                                 "met": bool(all(v >= 10 for v in medians.values())) if medians else None},
            "margins_vs_float64_brute_force": {
                "target": "<= 1e-9", "max_abs": max((max(f["abs_differences"].values()) for f in float64), default=None),
                "met": all(f["within_1e-9"] for f in float64) if float64 else None},
            "ratio_vs_matmul_bound": {"target": "<= 3", "measured": measured,
                                      "estimated_from_anchor_sample": estimated,
                                      "met": all(v <= 3 for v in [*measured.values(), *estimated.values()])},
            "croma_values_identical_within_1e-5": all(r["identical_within_1e-5"] for r in compared),
        }
    return out


def main() -> None:
    removed = restart_without_slow_blas()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=sorted(KINDS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[5_000, 20_000, 100_000, 1_000_000])
    parser.add_argument("--croma-max-n", type=int, default=20_000, help="run croma only up to this size")
    parser.add_argument("--repeats", type=int, default=3, help="ours/croma alternations where croma runs")
    parser.add_argument("--bound-rows", type=int, default=None,
                        help="time the matmul bound on this many query rows and scale to n (default: all rows)")
    parser.add_argument("--full-max-n", type=int, default=100_000,
                        help="above this, estimate our time from a sample of anchors (see module doc)")
    parser.add_argument("--anchor-sample", type=int, default=10_000, help="anchors timed for the estimate")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "robustness.json")
    args = parser.parse_args()
    if args.croma_max_n > args.full_max_n:
        parser.error("--croma-max-n must not exceed --full-max-n (croma is compared with a full run)")

    stamp = run_stamp()
    load_at_start = os.getloadavg()
    runs = [run_size(kind, n, n <= args.croma_max_n, args.bound_rows, n <= args.full_max_n, args.anchor_sample,
                     n == args.full_max_n, args.repeats) for kind in args.kinds for n in args.sizes]
    report = with_provenance({
        "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "numpy": np.__version__, "faiss": faiss.__version__, "faiss_gpus": faiss.get_num_gpus(),
            "croma": croma.__version__, "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        },
        "blas": {"libraries": blas_report(), "removed_environment_variables": removed,
                 "conditions": "ours and croma in one process, alternated, with the same BLAS and thread counts"},
        "settings": {
            "d": D, "m": M, "k": K, "kinds": {name: asdict(KINDS[name]) for name in args.kinds},
            "sizes": args.sizes, "croma_max_n": args.croma_max_n, "repeats": args.repeats,
            "bound_rows": args.bound_rows, "full_max_n": args.full_max_n, "anchor_sample": args.anchor_sample,
        },
        "runs": runs,
        "targets": targets(runs),
    }, stamp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["targets"], indent=2))


if __name__ == "__main__":
    main()
