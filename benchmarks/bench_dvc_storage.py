"""Benchmark: DVC's hashing and linking of a multi-GB feature store, copies against links.

A synthetic feature store in the project's layout (``<section>/Nuc.npy``, ``Mean.npy``, ``Cls.npy``:
float16 cells × D, and ``sidecar.json``) is put under DVC in a fresh repository with each cache type,
and the operations a user meets at scale are timed with the real ``dvc`` CLI:

- ``add``: what ``dvc repro`` does to a stage's outputs when the stage ends (hash, then into the cache);
- ``push``: then ``dvc push`` to a folder remote on the same disk (the bytes copied once; a remote
  over a network adds its own transfer time);
- ``rehash``: ``dvc status`` after every file's mtime changed (DVC reads and hashes every byte again;
  with links the cache's objects share those inodes, so a later push hashes them again too);
- ``checkout``: the workspace copy removed, then ``dvc checkout`` (another clone of the same commit).

Sides: ``copy`` (``cache.type copy``, DVC's default on filesystems without reflinks) against the
project's ``hardlink,symlink`` (docs/decisions/0041). They alternate, in swapped order every repeat;
the OS page cache is dropped before each timed command where this process may (root), so reads come
from the disk. Rates are bytes over the median seconds less the CLI's start (``dvc status`` in the
empty repository). Bytes on disk are ``du`` of the workspace and the cache together (an inode counted
once). Writes benchmarks/results/dvc_storage.json; ``--calibrate`` writes the measured rates to the
cost model (``cellpath/data/costs.json``, ``storage``), which ``cellpath plan`` prices DVC's part of
the paper from.

Usage: python benchmarks/bench_dvc_storage.py [--gb 4] [--repeats 3] [--calibrate]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from blas_conditions import blas_report
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "dvc_storage.json"
SIDES = {"copy": "copy", "links": "hardlink,symlink"}
OPERATIONS = ("add", "push", "rehash", "checkout")
WIDTH = 1024  # features per readout (ViT-L)
CELLS_PER_SECTION = 80_000
READOUTS = ("Nuc", "Mean", "Cls")
SEED = 20261206


def _dvc(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["dvc", *args], cwd=cwd, env=env, check=True, capture_output=True, timeout=7200)


def _drop_page_cache() -> bool:
    """Flush and drop the OS page cache (root only); whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _disk_bytes(*paths: Path) -> int:
    """Bytes the paths take on disk together (``du``: a hard-linked inode counted once)."""
    out = subprocess.run(["du", "-s", "-B1", *map(str, paths)], check=True, capture_output=True, text=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines())


def write_store(root: Path, total_gb: float) -> tuple[int, int]:
    """Sections of float16 features adding up to about ``total_gb`` GB; (files, bytes)."""
    rng = np.random.default_rng(SEED)
    per_section = CELLS_PER_SECTION * WIDTH * 2 * len(READOUTS)
    sections = max(1, math.ceil(total_gb * 1e9 / per_section))
    for index in range(sections):
        folder = root / f"section_{index:03d}"
        folder.mkdir(parents=True)
        for readout in READOUTS:
            np.save(folder / f"{readout}.npy",
                    rng.standard_normal((CELLS_PER_SECTION, WIDTH), dtype=np.float32).astype(np.float16))
        (folder / "sidecar.json").write_text(json.dumps({"n_cells": CELLS_PER_SECTION, "width": WIDTH}) + "\n")
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _timed(args: list[str], cwd: Path, cold: bool) -> float:
    if cold:
        _drop_page_cache()
    started = time.perf_counter()
    _dvc(args, cwd)
    return time.perf_counter() - started


def measure(side: str, store: Path, where: Path, cold: bool) -> dict:
    """One side once: a fresh repository, the store copied in (untimed), then each operation."""
    repo, remote = where / f"repo-{side}", where / f"remote-{side}"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(["init", "-q"], repo)
    _dvc(["config", "cache.type", SIDES[side]], repo)
    _dvc(["remote", "add", "-d", "folder", str(remote)], repo)
    features = repo / "data" / "features"
    result = {"startup_s": _timed(["status"], repo, cold=False)}  # the CLI's own start, subtracted in the rates
    shutil.copytree(store, features)
    result["add_s"] = _timed(["add", "data/features"], repo, cold)
    result["bytes_on_disk_after_add"] = _disk_bytes(repo / "data", repo / ".dvc" / "cache")
    result["push_s"] = _timed(["push"], repo, cold)  # as after `dvc repro`: the objects just hashed
    now = time.time()
    for path in features.rglob("*"):
        os.utime(path, (now + 10, now + 10))
    result["rehash_s"] = _timed(["status"], repo, cold)
    shutil.rmtree(features)
    result["checkout_s"] = _timed(["checkout"], repo, cold)
    result["bytes_on_disk_after_checkout"] = _disk_bytes(repo / "data", repo / ".dvc" / "cache")
    shutil.rmtree(repo)
    shutil.rmtree(remote)
    return result


def _net(side: dict, op: str) -> float:
    """An operation's median seconds less the CLI's start (what grows with the bytes)."""
    return side[f"{op}_s"] - side["startup_s"]


def summarise(runs: dict[str, list[dict]], store_bytes: int) -> dict:
    """Per side the median of each operation; per operation the copy ÷ links ratio (median, range)."""
    sides = {side: {f"{op}_s": round(statistics.median(r[f"{op}_s"] for r in rows), 2) for op in OPERATIONS}
             | {"bytes_on_disk": max(r["bytes_on_disk_after_checkout"] for r in rows),
                "disk_over_store": round(max(r["bytes_on_disk_after_checkout"] for r in rows) / store_bytes, 3)}
             for side, rows in runs.items()}
    ratios = {}
    for op in OPERATIONS:
        pairs = [c[f"{op}_s"] / h[f"{op}_s"] for c, h in zip(runs["copy"], runs["links"])]
        ratios[op] = {"median": round(statistics.median(pairs), 3), "min": round(min(pairs), 3),
                      "max": round(max(pairs), 3)}
    for side, rows in runs.items():
        sides[side]["startup_s"] = round(statistics.median(r["startup_s"] for r in rows), 2)
    rates = {f"{op}_mb_per_s": {side: round(store_bytes / 1e6 / _net(sides[side], op), 1) for side in runs}
             for op in OPERATIONS}
    return {"sides": sides, "copy_over_links": ratios, "rates": rates}


def calibrate(result: dict) -> None:
    """The measured rates (bytes per second) as the cost model's ``storage`` entry."""
    from cellpath.runtime.costs import StorageCosts, load_costs, save_costs

    store, sides = result["store"]["bytes"], result["summary"]["sides"]
    storage = StorageCosts(
        hash_bytes_per_second=store / statistics.median(_net(sides[s], "rehash") for s in SIDES),
        add_bytes_per_second={s: store / _net(sides[s], "add") for s in SIDES},
        checkout_bytes_per_second={s: store / _net(sides[s], "checkout") for s in SIDES},
        push_bytes_per_second={s: store / _net(sides[s], "push") for s in SIDES},
        source=f"benchmarks/results/dvc_storage.json ({result['date'][:10]}, {result['commit']}): "
               f"{store / 1e9:.1f} GB in {result['store']['files']} files, dvc {result['dvc']}, "
               f"{'cold' if result['cold_page_cache'] else 'warm'} page cache, a folder remote on the same disk")
    model = load_costs()
    save_costs(type(model)(machine=model.machine, devices=model.devices, storage=storage))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the synthetic feature store (GB)")
    parser.add_argument("--repeats", type=int, default=3, help="A/B repeats (default: %(default)s)")
    parser.add_argument("--calibrate", action="store_true", help="write the rates to cellpath/data/costs.json")
    args = parser.parse_args()
    stamp = run_stamp()
    import dvc

    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        store = Path(tmp) / "store"
        files, store_bytes = write_store(store, args.gb)
        cold = _drop_page_cache()
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for repeat in range(args.repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
            for side in order:
                runs[side].append(measure(side, store, Path(tmp), cold))
                print(side, repeat, runs[side][-1], flush=True)
    result = with_provenance({
        "benchmark": "dvc_storage", "dvc": dvc.__version__,
        "store": {"files": files, "bytes": store_bytes, "sections": files // (len(READOUTS) + 1),
                  "cells_per_section": CELLS_PER_SECTION, "width": WIDTH, "dtype": "float16"},
        "repeats": args.repeats, "cold_page_cache": cold, "sides": SIDES, "runs": runs,
        "summary": summarise(runs, store_bytes),
        "blas": blas_report(),  # recorded for every benchmark; DVC's hashing does not use BLAS
        "machine": {"cpus": os.cpu_count()},
    }, stamp)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    if args.calibrate:
        calibrate(result)


if __name__ == "__main__":
    main()
