"""Scale: the probe stage on a synthetic panel of 0.1M–7M cells at D = 1,280, wall time and peak RSS.

The panel is written straight into the feature store (``cellpath.simulation.feature_store``): 25
sections (the paper's S25), five organs, float16 Nuc and Mean at 20×, written under the Virchow2
slug (D = 1,280, as the issue's ViT-H). The probe stage runs as the pipeline runs it
(``cellpath.stages.probe.run``, one local worker, MLflow off) in a child process whose peak RSS is
read from ``getrusage``. It runs LOOO (the largest training sets: every organ but one), Tfine, Nuc,
one C, and ``--max-iter`` L-BFGS iterations. The fits are therefore capped and recorded as not
converged: this measures memory and the cost per iteration, not the probe's scores.

Baseline (at the sizes in ``--baseline-sizes``): the same stage with a budget large enough for every
design to be built in memory, which is the pre-#21 behaviour for the fits. The two runs alternate
``--repeats`` times, and the median ratio and its range are reported, for wall time and for peak
RSS. At larger sizes only the streamed run is made (the in-memory one does not fit).

Usage: python benchmarks/bench_scale.py [--sizes 100000 1000000] [--baseline-sizes 100000]
       [--budget-mb 512] [--max-iter 3] [--repeats 3] [--workdir /tmp/cellpath-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from threadpoolctl import threadpool_info

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
    raw["probe"].update({"readouts": ["Nuc"], "taxonomies": ["fine"], "c_grid": [1.0], "max_iter": max_iter,
                         "max_train_cells": None, "batch_memory_mb": budget_mb, "magnifications": ["20x"]})
    raw["mlflow"] = {**raw.get("mlflow", {}), "enabled": False}
    raw["executor"] = {**raw.get("executor", {}), "backend": "local", "workers": 1}
    raw["concordance"]["panel_sizes"] = [int(panel[1:])]
    return raw


CHILD = """
import json, resource, sys, threading, time
from pathlib import Path
from cellpath.config import parse_params
from cellpath.stages.probe import run
raw, data_dir, reports = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
peak_anon = [0]
def watch():  # anonymous (heap) RSS, sampled: ru_maxrss also counts the memory-mapped features' pages
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak_anon[0] = max(peak_anon[0], int(line.split()[1]))
        time.sleep(0.05)
threading.Thread(target=watch, daemon=True).start()
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


def run_stage(workdir: Path, data_dir: Path, budget_mb: int, max_iter: int, panel: str, looo_seeds: int) -> dict:
    """The probe stage in a fresh child process (fresh shard folder): its JSON line."""
    reports = workdir / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    shutil.rmtree(data_dir / "work", ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in SLOW_BLAS_VARIABLES} | {"HF_HUB_OFFLINE": "1"}
    raw = stage_params(data_dir, budget_mb, max_iter, panel, looo_seeds)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(raw), str(data_dir), str(reports)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"probe stage failed (budget {budget_mb} MB):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit() -> str:
    """The git commit the measurement ran at, with ``-dirty`` when the tree had changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "values": [round(v, 4) for v in values]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--baseline-sizes", type=int, nargs="*", default=[100_000])
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--baseline-budget-mb", type=int, default=16_384)
    parser.add_argument("--max-iter", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--looo-seeds", type=int, nargs="+", default=[2],
                        help="LOOO seeds per size (one value for all sizes, or one per size)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the sizes already in --out that this run does not measure")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cellpath-scale"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    args = parser.parse_args()
    from cellpath.simulation.feature_store import write_feature_panel

    results = {"benchmark": "scale", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                 "memory_gb": round(os.sysconf("SC_PAGE_SIZE")
                                                                    * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)},
               "blas": blas(), "encoder": ENCODER, "width": args.width, "sections": N_SECTIONS,
               "budget_mb": args.budget_mb, "max_iter": args.max_iter, "sizes": []}
    seeds_per_size = dict(zip(args.sizes, args.looo_seeds * len(args.sizes) if len(args.looo_seeds) == 1
                              else args.looo_seeds, strict=True))
    for size in args.sizes:
        looo_seeds = seeds_per_size[size]
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
        streamed, in_memory = [], []
        for _ in range(args.repeats if size in args.baseline_sizes else 1):
            streamed.append(run_stage(workdir, workdir / "data", args.budget_mb, args.max_iter, panel.panel,
                                      looo_seeds))
            print("  streamed", streamed[-1], flush=True)
            if size in args.baseline_sizes:
                in_memory.append(run_stage(workdir, workdir / "data", args.baseline_budget_mb, args.max_iter,
                                           panel.panel, looo_seeds))
                print("  in memory", in_memory[-1], flush=True)
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
        results["sizes"].append(entry)
        shutil.rmtree(workdir, ignore_errors=True)
    if args.merge and args.out.is_file():
        measured = {entry["n_cells"] for entry in results["sizes"]}
        kept = [entry for entry in json.loads(args.out.read_text())["sizes"] if entry["n_cells"] not in measured]
        results["sizes"] = sorted(kept + results["sizes"], key=lambda entry: entry["n_cells"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
