"""Scale: the probe and robustness stages on synthetic panels of 0.1M–7M cells at D = 1,280: wall time, peak RSS.

The panel is written straight into the feature store (``cellpath.simulation.feature_store``): 25
sections (the paper's S25), five organs, float16 Nuc and Mean at 20×, written under the Virchow2
slug (D = 1,280, a ViT-H's width). The probe stage runs as the pipeline runs it
(``cellpath.stages.probe.run``, one local worker, MLflow off) in a child process whose peak RSS is
read from ``getrusage``. It runs LOOO (the largest training sets: every organ but one), Tfine, Nuc,
the default's C grid (fitted together by the engine), and ``--max-iter`` L-BFGS iterations. The fits
are therefore capped and recorded as not converged: this measures memory and the cost per iteration,
not the probe's scores. ``--budget-mb`` is small enough that the engine streams the training sets
of every size (at 100,000 cells, 64,000 rows against a chunk of about 41,800).

Baseline (at the sizes in ``--baseline-sizes``): the same stage with a budget large enough for every
design to be built in memory, which is how the fits ran before they were streamed. The two runs alternate
``--repeats`` times, and the median ratio and its range are reported, for wall time and for peak
RSS. At larger sizes only the streamed run is made (the in-memory one does not fit).

Robustness (at ``--robustness-sizes``): the robustness stage on the same kind of panel (Nuc, Tfine,
the panel scope, no shortcut probe or sensitivity sweep), once per size: exact up to
``--full-max-cells``, anchor-sampled (``--anchors``) above. Wall time and peak heap.

Cost model (``--calibrate``): the per-unit costs of ``cellpath.runtime.costs`` are fitted from these
runs (the probe's cost per iteration from ``--max-iter`` vs ``--calibration-max-iter`` at
``--calibration-size``; the robustness cost per pair and its heap from ``--robustness-calibration-sizes``:
one exact run and two anchor-sampled ones) and
written to ``src/cellpath/data/costs.json``. Every run then gets the model's estimate beside its
measurement (``estimates``: estimate ÷ measured, and whether all lie within 2×), the sizes the
model was not fitted on being the check of it.

Usage: python benchmarks/bench_scale.py [--sizes 100000 300000] [--baseline-sizes 100000]
       [--robustness-sizes 50000 100000 300000 1000000] [--merge] [--calibrate]
       [--budget-mb 256] [--max-iter 3] [--repeats 3] [--workdir <temp dir>/cellpath-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from threadpoolctl import threadpool_info

from cellpath.io.layout import work_root
from cellpath.runtime.costs import CostModel, ExtractCosts

ROOT = Path(__file__).resolve().parents[1]
ENCODER = "Virchow2"  # D = 1,280
SLUG = "virchow2"
N_SECTIONS = 25
SLOW_BLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def blas() -> list[dict]:
    return [{k: info.get(k) for k in ("internal_api", "version", "num_threads", "architecture")}
            for info in threadpool_info()]


def stage_params(data_dir: Path, budget_mb: int, max_iter: int, panel: str, looo_seeds: int) -> dict:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw.update({"panel": panel, "protocol": "looo"})
    raw["probe"]["seeds"] = {**raw["probe"]["seeds"], "looo": looo_seeds}
    raw["extract"].update({"encoders": [SLUG], "magnifications": ["20x"],
                           "registry": str(ROOT / "models" / "encoders.yaml")})
    raw["probe"].update({"readouts": ["Nuc"], "taxonomies": ["fine"], "max_iter": max_iter,
                         "max_train_cells": None, "batch_memory_mb": budget_mb, "magnifications": ["20x"]})
    raw["mlflow"] = {**raw.get("mlflow", {}), "enabled": False}
    raw["executor"] = {**raw.get("executor", {}), "backend": "local", "workers": 1}
    raw["concordance"]["panel_sizes"] = [int(panel[1:])]
    return raw


HEAP_WATCH = """
import json, resource, sys, threading, time
from pathlib import Path
from cellpath.config import parse_params
raw, data_dir, reports = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
peak_anon = [0]
def watch():  # anonymous (heap) RSS, sampled: ru_maxrss also counts the memory-mapped features' pages
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak_anon[0] = max(peak_anon[0], int(line.split()[1]))
        time.sleep(0.05)
threading.Thread(target=watch, daemon=True).start()
"""  # the start of a child process that runs a stage: its arguments, and its peak heap sampled

CHILD = HEAP_WATCH + """
from cellpath.stages.probe import run
started = time.perf_counter()
runs = run(parse_params(raw), data_dir, reports, root=reports.parent)
ok = runs[runs["status"] == "ok"]
print(json.dumps({"wall_s": time.perf_counter() - started,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_anon_rss_mb": peak_anon[0] / 1024,
                  "runs": len(ok), "largest_train": int(ok["n_train"].max()),
                  "lbfgs_iterations": int(ok["lbfgs_iterations"].max()),
                  "fit_seconds": float(ok["fit_seconds"].sum()),
                  "per_run": ok[["n_train", "n_val", "n_test", "n_classes", "lbfgs_iterations", "fit_seconds"]].astype(float)
                  .to_dict("records")}))
"""


ROBUSTNESS_CHILD = HEAP_WATCH + """
from cellpath.stages.robustness import run
started = time.perf_counter()
summary = run(parse_params(raw), data_dir, reports, root=reports.parent)
print(json.dumps({"wall_s": time.perf_counter() - started,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_anon_rss_mb": peak_anon[0] / 1024,
                  "units": summary[["n_cells"]].astype(int).to_dict("records"),
                  "croma_median": summary["croma_median"].astype(float).tolist(),
                  "croma_median_low": summary["croma_median_low"].astype(float).tolist(),
                  "croma_median_high": summary["croma_median_high"].astype(float).tolist()}))
"""


def robustness_params(panel: str, full_max_cells: int, anchors: int) -> dict:
    """The robustness stage on Nuc, Tfine, the panel scope (no shortcut probe, no sensitivity sweep)."""
    raw = stage_params(Path("."), 512, 3, panel, 1)
    raw["robustness"].update({"readouts": ["Nuc"], "taxonomies": ["fine"], "scopes": ["panel"],
                              "magnifications": ["20x"], "full_max_cells": full_max_cells, "anchors": anchors})
    raw["robustness"]["shortcut"] = {**raw["robustness"]["shortcut"], "enabled": False}
    raw["robustness"]["sensitivity"] = {"alphas": [], "m_max": None}
    return raw


def run_robustness(workdir: Path, data_dir: Path, panel: str, full_max_cells: int, anchors: int) -> dict:
    """The robustness stage in a fresh child process (fresh shard folder): its JSON line."""
    reports = workdir / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    shutil.rmtree(work_root(data_dir), ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in SLOW_BLAS_VARIABLES} | {"HF_HUB_OFFLINE": "1"}
    raw = robustness_params(panel, full_max_cells, anchors)
    done = subprocess.run([sys.executable, "-c", ROBUSTNESS_CHILD, json.dumps(raw), str(data_dir), str(reports)],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"robustness stage failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_stage(workdir: Path, data_dir: Path, budget_mb: int, max_iter: int, panel: str, looo_seeds: int) -> dict:
    """The probe stage in a fresh child process (fresh shard folder): its JSON line."""
    reports = workdir / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    shutil.rmtree(work_root(data_dir), ignore_errors=True)  # no shard of an earlier run is reused
    env = {k: v for k, v in os.environ.items() if k not in SLOW_BLAS_VARIABLES} | {"HF_HUB_OFFLINE": "1"}
    raw = stage_params(data_dir, budget_mb, max_iter, panel, looo_seeds)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(raw), str(data_dir), str(reports)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"probe stage failed (budget {budget_mb} MB):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit() -> str:
    """The git commit the measurement ran at, with ``-dirty`` when the tree had changes."""
    from provenance import git_commit  # benchmarks/, on sys.path when this runs as a script

    head, dirty = git_commit(ROOT)
    return (head or "unknown") + ("-dirty" if dirty else "")


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "values": [round(v, 4) for v in values]}


def measure_probe(args: argparse.Namespace, size: int, looo_seeds: int) -> dict:
    """Write a panel of ``size`` cells and run the probe stage on it (streamed; at baseline sizes
    alternated with the in-memory baseline; at the calibration size also at ``--calibration-max-iter``)."""
    from cellpath.simulation.feature_store import write_feature_panel

    workdir = args.workdir / f"n{size}"
    shutil.rmtree(workdir, ignore_errors=True)
    started = time.perf_counter()
    panel = write_feature_panel(workdir / "data", n_sections=N_SECTIONS, cells_per_section=size // N_SECTIONS,
                                width=args.width, encoder=SLUG)
    written = time.perf_counter() - started
    disk = sum(p.stat().st_size for p in (workdir / "data" / "features").rglob("*.npy"))
    entry = {"n_cells": panel.n_cells, "looo_seeds": looo_seeds, "commit": commit(),
             "write_seconds": round(written, 1), "feature_bytes": disk}
    print(f"n = {panel.n_cells:,}: features written in {written:.0f} s ({disk / 1e9:.1f} GB)", flush=True)
    data = workdir / "data"
    streamed, in_memory = [], []
    for _ in range(args.repeats if size in args.baseline_sizes else 1):
        streamed.append(run_stage(workdir, data, args.budget_mb, args.max_iter, panel.panel, looo_seeds))
        print("  streamed", _brief(streamed[-1]), flush=True)
        if size in args.baseline_sizes:
            in_memory.append(run_stage(workdir, data, args.baseline_budget_mb, args.max_iter, panel.panel, looo_seeds))
            print("  in memory", _brief(in_memory[-1]), flush=True)
    entry["streamed"] = streamed
    entry["peak_rss_mb"] = spread([r["peak_rss_mb"] for r in streamed])
    entry["peak_anon_rss_mb"] = spread([r["peak_anon_rss_mb"] for r in streamed])
    entry["memory_note"] = ("peak_rss counts the memory-mapped features' resident pages (file-backed, "
                            "reclaimable); peak_anon_rss is the heap: the interpreter and torch (~0.7 GB), "
                            "the panel's cell table and plan, and the fits' working memory, bounded by budget_mb")
    if in_memory:
        entry["in_memory"] = in_memory
        entry["ratio_streamed_over_in_memory"] = {
            "wall": spread([a["wall_s"] / b["wall_s"] for a, b in zip(streamed, in_memory)]),
            "peak_rss": spread([a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in zip(streamed, in_memory)]),
            "peak_anon_rss": spread([a["peak_anon_rss_mb"] / b["peak_anon_rss_mb"]
                                     for a, b in zip(streamed, in_memory)])}
    if size == args.calibration_size:
        entry["calibration_max_iter"] = args.calibration_max_iter
        entry["calibration"] = {
            "streamed": run_stage(workdir, data, args.budget_mb, args.calibration_max_iter, panel.panel, looo_seeds),
            "in_memory": run_stage(workdir, data, args.baseline_budget_mb, args.calibration_max_iter, panel.panel,
                                   looo_seeds)}
        print("  calibration", {k: _brief(v) for k, v in entry["calibration"].items()}, flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return entry


def measure_robustness(args: argparse.Namespace, size: int) -> dict:
    """Write a panel of ``size`` cells and run the robustness stage on it once (exact up to
    ``--full-max-cells``, anchor-sampled above)."""
    from cellpath.simulation.feature_store import write_feature_panel

    workdir = args.workdir / f"r{size}"
    shutil.rmtree(workdir, ignore_errors=True)
    panel = write_feature_panel(workdir / "data", n_sections=N_SECTIONS, cells_per_section=size // N_SECTIONS,
                                width=args.width, encoder=SLUG)
    measured = run_robustness(workdir, workdir / "data", panel.panel, args.full_max_cells, args.anchors)
    shutil.rmtree(workdir, ignore_errors=True)
    entry = {"n_cells": panel.n_cells, "commit": commit(), "full_max_cells": args.full_max_cells,
             "anchors": args.anchors, "mode": "full" if panel.n_cells <= args.full_max_cells else "anchors",
             **measured}
    print(f"robustness n = {panel.n_cells:,} ({entry['mode']}):", _brief(entry), flush=True)
    return entry


def _brief(record: dict) -> dict:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in record.items()
            if k not in ("per_run", "units", "croma_median_low", "croma_median_high")}


def calibrate(results: dict) -> CostModel:
    """Per-unit costs from the calibration runs (see the module docstring of ``cellpath.runtime.costs``)."""
    from cellpath.runtime.costs import DeviceCosts, ProbeCosts, RobustnessCosts, load_costs

    width = results["width"]
    columns = width + 1
    entry = next(e for e in results["sizes"] if "calibration" in e)
    per_iteration, per_pass = {}, {}
    for mode in ("streamed", "in_memory"):
        low = entry[mode][int(np.argsort([r["wall_s"] for r in entry[mode]])[len(entry[mode]) // 2])]
        high = entry["calibration"][mode]
        # the stage's summed fit time at two iteration caps, over the same runs (shapes from per_run)
        rows = list(zip(low["per_run"], high["per_run"], strict=True))
        row_iterations = sum(a["n_train"] * (b["lbfgs_iterations"] - a["lbfgs_iterations"]) for a, b in rows)
        per_iteration[mode] = (high["fit_seconds"] - low["fit_seconds"]) / (row_iterations * columns)
        passes = sum(a["n_train"] + a["n_val"] + a["n_test"] for a, _ in rows)
        iterated = sum(a["n_train"] * a["lbfgs_iterations"] for a, _ in rows) * columns * per_iteration[mode]
        per_pass[mode] = max((low["fit_seconds"] - iterated) / (columns * passes), 0.0)
    # the heap beyond the largest fit's working bytes, a line in the panel's cells
    heaps = sorted((e["n_cells"], e["peak_anon_rss_mb"]["median"] * 1024**2 - _largest_fit_bytes(results, e))
                   for e in results["sizes"] if e["n_cells"] in results["heap_calibration_sizes"])
    per_cell = (heaps[1][1] - heaps[0][1]) / (heaps[1][0] - heaps[0][0])
    base = heaps[0][1] - per_cell * heaps[0][0]
    probe = ProbeCosts(seconds_per_iteration=per_iteration, seconds_per_pass=per_pass,
                       iterations=_real_shaped_iterations(), heap_base_bytes=base, heap_bytes_per_cell=per_cell,
                       source=f"benchmarks/bench_scale.py at {entry['commit']}: n = {entry['n_cells']:,}, "
                              f"{len(results['c_grid'])} Cs × 9 classes, max_iter {results['max_iter']} and "
                              f"{entry['calibration_max_iter']}; heap: the line through "
                              f"n = {heaps[0][0]:,} and {heaps[1][0]:,}")
    robustness = None
    runs = sorted((r for r in results.get("robustness", []) if r["n_cells"] in results["robustness_calibration_sizes"]),
                  key=lambda r: r["n_cells"])
    full = [r for r in runs if r["mode"] == "full"]
    sampled = [r for r in runs if r["mode"] == "anchors"]
    if full and len(sampled) >= 2:
        full, (low, high) = full[-1], sampled[-2:]
        heap = {r["n_cells"]: r["peak_anon_rss_mb"] * 1024**2 for r in (full, low, high)}
        # heap = base + queries · width · b_query + n · b_cell: the two anchor runs (queries = anchors) give
        # b_cell, the full run (queries = n) then b_query
        per_cell = (heap[high["n_cells"]] - heap[low["n_cells"]]) / (high["n_cells"] - low["n_cells"])
        at_anchors = heap[low["n_cells"]] - per_cell * low["n_cells"]  # base + anchors · width · b_query
        per_query_feature = ((heap[full["n_cells"]] - per_cell * full["n_cells"] - at_anchors)
                             / ((full["n_cells"] - low["anchors"]) * width))
        robustness = RobustnessCosts(
            seconds_per_pair_full=full["wall_s"] / (full["n_cells"] ** 2 * width),
            seconds_per_pair_anchor=high["wall_s"] / (high["anchors"] * high["n_cells"] * width),
            heap_base_bytes=at_anchors - per_query_feature * low["anchors"] * width,
            heap_bytes_per_query_feature=per_query_feature, heap_bytes_per_cell=per_cell,
            cores=results["machine"]["cpus"],
            source=f"benchmarks/bench_scale.py at {full['commit']}: full at n = {full['n_cells']:,}, "
                   f"{high['anchors']:,} anchors at n = {high['n_cells']:,}; heap: through the full run and the "
                   f"anchor runs at n = {low['n_cells']:,} and {high['n_cells']:,}")
    return CostModel(machine={**results["machine"], "blas": results["blas"]},
                     devices={"cpu": DeviceCosts(probe=probe, robustness=robustness, extract=_extract_costs())},
                     storage=load_costs().storage)  # DVC's rates: benchmarks/bench_dvc_storage.py --calibrate


def _row_bytes(results: dict, n_classes: int) -> tuple[int, int]:
    """A training row's working bytes and fit-state bytes in the engine at the run's C grid."""
    from cellpath.probing.fit import design_row_bytes, state_row_bytes

    columns = len(results["c_grid"]) * n_classes
    return design_row_bytes(results["width"], columns), state_row_bytes(columns)


def _largest_fit_bytes(results: dict, entry: dict) -> float:
    """The working bytes of the largest fit of a size's streamed runs (``probe_fit_bytes``)."""
    from cellpath.runtime.costs import probe_fit_bytes

    largest = max(entry["streamed"][0]["per_run"], key=lambda r: r["n_train"])
    row_bytes, state_bytes = _row_bytes(results, int(largest["n_classes"]))
    return probe_fit_bytes(int(largest["n_train"]), row_bytes, state_bytes, results["budget_mb"])


def _real_shaped_iterations():
    """L-BFGS iterations to convergence of each problem's slowest C (its Cs iterate together) by training
    size: median and p25–p75 over the problems of ``bench_real_shaped.py`` at each size (spectra and
    priors), the problems shaped like foundation-model features, never the simulated default."""
    from cellpath.runtime.costs import Iterations

    record = json.loads((ROOT / "benchmarks" / "results" / "real_shaped.json").read_text())
    by_size: dict[int, list[int]] = {}
    for problem in record["problems"]:
        by_size.setdefault(problem["n_train"], []).append(max(problem["engine"]["iterations"]))
    sizes = sorted(by_size)
    quartiles = [np.quantile(by_size[n], [0.5, 0.25, 0.75]) for n in sizes]
    counts = ", ".join(f"{len(by_size[n])} at {n:,}" for n in sizes)
    return Iterations(tuple(float(n) for n in sizes), *(tuple(float(q[i]) for q in quartiles) for i in range(3)),
                      source=f"benchmarks/results/real_shaped.json ({record['date']}, {record['commit']}): problems "
                             f"shaped like foundation-model features (D = 1,280, nine imbalanced classes, power-law "
                             f"spectra), {counts} rows, tol {record['tol']:g}")


def _extract_costs() -> ExtractCosts:
    """Seconds per GFLOP from the extraction benchmark's delivered rate, and patches per cell at 20×
    from the default run's feature sidecars."""
    from cellpath.features.encoders.registry import load_registry
    from cellpath.features.store import read_sidecar
    from cellpath.runtime.costs import parameter_count, patch_gflop
    from cellpath.vocabulary import MAGNIFICATION_MPP

    record = json.loads((ROOT / "benchmarks" / "results" / "extract.json").read_text())
    spec = load_registry(ROOT / "models" / "encoders.yaml")[record["encoder"]]
    gflop = patch_gflop(parameter_count(spec.params), spec.input_size, spec.patch_size, spec.num_prefix_tokens)
    sidecars = [read_sidecar(p.parent) for p in (ROOT / "data" / "features").rglob("sidecar.json")]
    at_20x = [s for s in sidecars if s and s["magnification"] == "20x" and s["tiling"]["input_size"] == 224]
    per_cell = sum(int(s["n_patches"]) for s in at_20x) / sum(int(s["n_cells"]) for s in at_20x)
    reference = MAGNIFICATION_MPP["20x"]
    return ExtractCosts(seconds_per_gflop=1.0 / (record["pipeline_patches_per_s"] * gflop),
                        patches_per_cell_224={m: per_cell * (reference / mpp) ** 2
                                              for m, mpp in MAGNIFICATION_MPP.items()},
                        cores=record["machine"]["cpus"],
                        source=f"benchmarks/results/extract.json ({record['encoder']}, {gflop:.2f} GFLOP per patch, "
                               f"{record['pipeline_patches_per_s']} patches/s delivered); patches per cell: the "
                               f"default run's 20× sidecars ({len(at_20x)}: sections × encoders, simulated tissue), "
                               "scaled by patch area to 40× and 10×")


def estimate(results: dict, model: CostModel) -> dict:
    """The cost model's estimate beside every measurement, and their ratio (estimate ÷ measured)."""
    from cellpath.runtime.costs import probe_fit_seconds, probe_heap_bytes, robustness_heap_bytes, robustness_seconds

    costs = model.costs("cpu")
    rows = []
    for entry in results["sizes"]:
        records = [("streamed", results["budget_mb"], r) for r in entry["streamed"]]
        records += [("in_memory", results["baseline_budget_mb"], r) for r in entry.get("in_memory", [])]
        for mode, budget, record in records:
            if "per_run" not in record:
                continue
            seconds = sum(probe_fit_seconds(costs.probe, n_train=int(r["n_train"]), n_val=int(r["n_val"]),
                                            n_test=int(r["n_test"]), width=results["width"],
                                            row_bytes=_row_bytes(results, int(r["n_classes"]))[0],
                                            iterations=r["lbfgs_iterations"],
                                            budget_mb=budget) for r in record["per_run"])
            largest = max(record["per_run"], key=lambda r: r["n_train"])
            row_bytes, state_bytes = _row_bytes(results, int(largest["n_classes"]))
            alike = sum(r["n_classes"] == largest["n_classes"] for r in record["per_run"])  # one group's candidates
            heap = probe_heap_bytes(costs.probe, entry["n_cells"], budget, n_train=int(largest["n_train"]),
                                    row_bytes=row_bytes, state_bytes=state_bytes, tasks=alike) / 1024**2
            rows.append({"stage": "probe", "mode": mode, "n_cells": entry["n_cells"], "measured_s": record["wall_s"],
                         "estimate_s": seconds, "ratio_s": seconds / record["wall_s"],
                         "measured_heap_mb": record["peak_anon_rss_mb"], "estimate_heap_mb": heap,
                         "ratio_heap": heap / record["peak_anon_rss_mb"]})
    for record in results.get("robustness", []):
        seconds = robustness_seconds(costs.robustness, record["n_cells"], results["width"],
                                     full_max_cells=record["full_max_cells"], anchors=record["anchors"])
        heap = robustness_heap_bytes(costs.robustness, record["n_cells"], results["width"],
                                     full_max_cells=record["full_max_cells"], anchors=record["anchors"]) / 1024**2
        rows.append({"stage": "robustness", "mode": record["mode"], "n_cells": record["n_cells"],
                     "measured_s": record["wall_s"], "estimate_s": seconds, "ratio_s": seconds / record["wall_s"],
                     "measured_heap_mb": record["peak_anon_rss_mb"], "estimate_heap_mb": heap,
                     "ratio_heap": heap / record["peak_anon_rss_mb"]})
    ratios = [r[key] for r in rows for key in ("ratio_s", "ratio_heap") if r[key] is not None]
    return {"rows": rows, "within_2x": bool(ratios) and all(0.5 <= r <= 2.0 for r in ratios),
            "ratio_range": [min(ratios), max(ratios)] if ratios else None}


def write_results(path: Path, results: dict) -> None:
    """``results`` as JSON at ``path``, renamed into place whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(partial, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--baseline-sizes", type=int, nargs="*", default=[100_000])
    parser.add_argument("--budget-mb", type=int, default=256)
    parser.add_argument("--baseline-budget-mb", type=int, default=16_384)
    parser.add_argument("--max-iter", type=int, default=3)
    parser.add_argument("--calibration-size", type=int, default=100_000)
    parser.add_argument("--calibration-max-iter", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--looo-seeds", type=int, nargs="+", default=[2],
                        help="LOOO seeds per size (one value for all sizes, or one per size)")
    parser.add_argument("--heap-calibration-sizes", type=int, nargs=2, default=[100_000, 1_000_000],
                        help="the probe heap's line is fitted through these two sizes (the others check it)")
    parser.add_argument("--robustness-sizes", type=int, nargs="*", default=[50_000, 100_000, 300_000, 1_000_000])
    parser.add_argument("--robustness-calibration-sizes", type=int, nargs="*", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--full-max-cells", type=int, default=100_000)
    parser.add_argument("--anchors", type=int, default=20_000)
    parser.add_argument("--merge", action="store_true",
                        help="keep the measurements already in --out that this run does not repeat")
    parser.add_argument("--calibrate", action="store_true",
                        help="write the cost model (src/cellpath/data/costs.json) from --out's calibration runs")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "cellpath-scale")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    args = parser.parse_args()
    from cellpath.runtime.costs import load_costs, save_costs
    from provenance import run_stamp, with_provenance

    stamp = run_stamp()
    results = {"benchmark": "scale", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                 "memory_gb": round(os.sysconf("SC_PAGE_SIZE")
                                                                    * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)},
               "blas": blas(), "encoder": ENCODER, "width": args.width, "sections": N_SECTIONS,
               "c_grid": yaml.safe_load((ROOT / "params.yaml").read_text())["probe"]["c_grid"],
               "budget_mb": args.budget_mb, "baseline_budget_mb": args.baseline_budget_mb, "max_iter": args.max_iter,
               "heap_calibration_sizes": args.heap_calibration_sizes,
               "robustness_calibration_sizes": args.robustness_calibration_sizes, "sizes": [], "robustness": []}
    results = with_provenance(results, stamp)
    seeds_per_size = dict(zip(args.sizes, args.looo_seeds * len(args.sizes) if len(args.looo_seeds) == 1
                              else args.looo_seeds, strict=True))
    for size in args.sizes:
        results["sizes"].append(measure_probe(args, size, seeds_per_size[size]))
    for size in args.robustness_sizes:
        results["robustness"].append(measure_robustness(args, size))
    if args.merge and args.out.is_file():
        earlier = json.loads(args.out.read_text())
        for key in ("sizes", "robustness"):
            measured = {entry["n_cells"] for entry in results[key]}
            kept = [entry for entry in earlier.get(key, []) if entry["n_cells"] not in measured]
            results[key] = sorted(kept + results[key], key=lambda entry: entry["n_cells"])
    write_results(args.out, results)  # the measurements first: a failed calibration loses none of them
    if args.calibrate:
        save_costs(calibrate(results))
        print("wrote src/cellpath/data/costs.json", flush=True)
    results["estimates"] = estimate(results, load_costs())
    write_results(args.out, results)
    print(f"wrote {args.out}; estimate ÷ measured {results['estimates']['ratio_range']}, "
          f"within 2×: {results['estimates']['within_2x']}")


if __name__ == "__main__":
    main()
