"""The GPU measurement's driver: five parts, each within its time budget, into one JSON.

    PYTHONPATH=src:benchmarks python -m gpu.run [--device cuda] [--out DIR] [--commit HASH] [--tiny]
                                                [--parts encoders extraction probe robustness expression]
                                                [--total-s 450]

Parts (each a module with ``measure(device, sizes, budget_s) -> dict``): (a) ``encoders``, forward
rates of a ViT-S, a ViT-L and a ViT-g at the registry's precision against fp32; (b) ``extraction``,
the delivered patch rate of a slide read ahead on the CPU cores into the ViT-L; (c) ``probe``, the
probe engine on the device (``gpu.probe_part``); (d) ``robustness``, the exact
k-NN and margins on the device against the CPU's, and the time per pair; (e) ``expression``, the
expression probes' exact ridge on the device against the CPU's (``gpu.expression_part``). Each part runs guarded: an
exception, or running past its budget by ``GRACE_S`` (an alarm), is recorded as the part's
``status`` with its text, and the next part runs. ``--total-s`` caps the sum: a part gets at most
what is left. ``OUT/gpu.json`` is rewritten after every part, so a run killed from outside keeps
what it measured (``complete`` false). ``--tiny`` is the dry run: every code path at sizes that take
seconds on two CPU cores (models cut to one block: ``depth`` 1), never merged into the cost model.

JSON: ``date``, ``commit`` (``--commit`` or ``CELLPATH_BENCH_COMMIT`` where git is absent, else
"unknown"), ``dirty``, ``benchmark`` ("gpu"), ``device``, ``device_name``, ``versions`` (python,
torch, cuda, cudnn, timm, numpy, tifffile), ``cpus``, ``preset`` ("device" | "tiny"), ``sizes`` and
``budgets_s`` per part, ``total_s``, ``complete``, ``parts`` (per part: ``status`` "ok" | "error" |
"timeout" | "pending", ``seconds``, ``budget_s``, ``result`` or ``error`` and ``traceback``),
``extraction_summary`` (part (b) against its forward pass alone and part (a)) and ``machine``
(benchmarks/provenance.py, with the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

PARTS = {"encoders": "gpu.encoders", "extraction": "gpu.extraction", "probe": "gpu.probe_part",
         "robustness": "gpu.robustness", "expression": "gpu.expression_part"}
BUDGETS_S = {"device": {"encoders": 115, "extraction": 115, "probe": 80, "robustness": 90, "expression": 40},
             "tiny": {"encoders": 60, "extraction": 60, "probe": 30, "robustness": 60, "expression": 20}}
GRACE_S = 15  # past its budget a part is interrupted
OUT_NAME = "gpu.json"


def sizes_for(preset: str, cpus: int) -> dict:
    """The sizes of every part: ``device`` (a GPU, about seven minutes) or ``tiny`` (the dry run)."""
    from gpu.encoders import MODELS

    if preset == "tiny":
        return {"encoders": {"models": MODELS, "batch": 2, "batches": 2, "depth": 1},
                "extraction": {"slide_px": 1024, "tile": 256, "levels": 2, "slide_mpp": 0.25, "target_mpp": 1.0,
                               "compression": "zlib", "batch": 4, "prefetch": 2, "workers": [1],
                               "seconds_per_config": 1.0, "depth": 1},
                "probe": {"n_cells": 2_000, "width": 16, "n_classes": 4, "max_iter": [3, 9],
                          "budget_mb": {"streamed": 0.5, "in_memory": 64}},  # 1,400 training rows, 814 a chunk
                "robustness": {"width": 32, "n_types": 4, "n_sections": 3, "cells_per_group": 4, "k": 11, "m": 5,
                               "compare_cells": 1_500, "compare_anchors": 64, "full_cells": 800,
                               "anchor_cells": 3_000, "anchors": 100, "candidate_block": 512, "query_block": 256,
                               "tolerance": 1e-4},
                "expression": {"shapes": [(3_000, 16), (6_000, 32)], "equality": (2_000, 16)}}
    return {"encoders": {"models": MODELS, "batch": 64, "batches": 20, "depth": None},
            "extraction": {"slide_px": 8192, "tile": 256, "levels": 3, "slide_mpp": 0.25, "target_mpp": 0.25,
                           "compression": "zlib", "batch": 64, "prefetch": 4,
                           "workers": sorted({1, max(1, cpus // 4), max(1, cpus - 2)}),
                           "seconds_per_config": 10.0, "depth": None},
            "probe": {"n_cells": 100_000, "width": 1_280, "n_classes": 9, "max_iter": [3, 9],  # bench_scale's shape:
                      "budget_mb": {"streamed": 256, "in_memory": 16_384},  # 70,000 rows, 41,811 a chunk
                      "floor_rows": [1_000_000]},
            "robustness": {"width": 1_280, "n_types": 20, "n_sections": 25, "cells_per_group": 8, "k": 91, "m": 5,
                           "compare_cells": 200_000, "compare_anchors": 512, "full_cells": 100_000,
                           "anchor_cells": 1_000_000, "anchors": 20_000, "candidate_block": 65_536,
                           "query_block": 8_192, "tolerance": 1e-4},
            "expression": {"shapes": [(100_000, 1_280), (100_000, 2_560), (400_000, 1_280)], "equality": (20_000, 256)}}


class PartTimeout(Exception):
    """A part ran past its budget and its grace."""


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise :class:`PartTimeout` in this (main) thread after ``seconds``."""
    def expire(signum, frame):
        raise PartTimeout(f"ran past its budget + {GRACE_S} s grace ({seconds:.0f} s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_part(name: str, device: str, sizes: dict, budget_s: float) -> dict:
    """One part, guarded: ``status`` ok with its ``result``, or error / timeout with the text."""
    started = time.perf_counter()
    record: dict = {"budget_s": round(budget_s, 1)}
    try:
        with alarm(budget_s + GRACE_S):
            module = importlib.import_module(PARTS[name])
            record["result"] = module.measure(device, sizes, budget_s)
        record["status"] = "ok"
    except PartTimeout as error:
        record.update(status="timeout", error=f"PartTimeout: {error}", traceback=traceback.format_exc(limit=6))
    except Exception as error:  # noqa: BLE001 - every failure is recorded; the next part still runs
        record.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(limit=6))
    record["seconds"] = round(time.perf_counter() - started, 2)
    _free(device)
    return record


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def extraction_summary(parts: dict) -> dict | None:
    """Part (b)'s best read and delivered rates against its forward pass alone and part (a)'s rate of
    the same row (patches or images per second)."""
    if parts.get("extraction", {}).get("status") != "ok":
        return None
    result = parts["extraction"]["result"]
    measured = [c for c in result["configs"] if "delivered" in c]
    if not measured:
        return None
    best = max(measured, key=lambda c: c["delivered"]["patches_per_s"] or 0)
    read = max(measured, key=lambda c: c["read"]["patches_per_s"] or 0)
    same = [m for m in parts.get("encoders", {}).get("result", {}).get("models", [])
            if m.get("name") == result["model"] and "autocast" in m and m.get("depth") == result["depth"]]
    return {"delivered_patches_per_s": best["delivered"]["patches_per_s"], "delivered_workers": best["workers"],
            "read_patches_per_s": read["read"]["patches_per_s"], "read_workers": read["workers"],
            "forward_alone_patches_per_s": result["forward_alone"]["patches_per_s"],
            "forward_part_a_img_per_s": same[0]["autocast"]["img_per_s"] if same else None,
            "delivered_over_forward_alone": best["delivered"]["patches_per_s"]
            / result["forward_alone"]["patches_per_s"]}


def header(args: argparse.Namespace, preset: str, sizes: dict, budgets: dict) -> dict:
    """Date, commit, device and versions, and the plan of the run (every part pending)."""
    import numpy
    import torch

    from provenance import run_stamp, with_provenance

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                "numpy": numpy.__version__}
    for name in ("timm", "tifffile"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None
    stamp = run_stamp()
    stamp["commit"] = stamp["commit"] or "unknown"
    result = {"benchmark": "gpu", "device": args.device, "device_name": gpu or platform.processor() or "cpu",
              "versions": versions, "cpus": os.cpu_count(), "preset": preset, "sizes": sizes,
              "budgets_s": budgets, "total_s": args.total_s, "complete": False,
              "parts": {name: {"status": "pending"} for name in budgets},
              "machine": {"cpus": os.cpu_count(), "gpu": gpu, "torch": torch.__version__}}
    return with_provenance(result, stamp)


def write(path: Path, record: dict) -> None:
    """``record`` as JSON, atomically (numpy scalars as numbers)."""
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(record, indent=2, default=lambda v: v.item() if hasattr(v, "item") else str(v))
                       + "\n")
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder of gpu.json (default: $OUT)")
    parser.add_argument("--commit", help="the commit this tree is (where git is absent)")
    parser.add_argument("--tiny", action="store_true", help="the dry run: every path at tiny sizes")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--total-s", type=float, default=450.0, help="all parts together (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.commit:
        os.environ["CELLPATH_BENCH_COMMIT"] = args.commit
    preset = "tiny" if args.tiny else "device"
    sizes = sizes_for(preset, os.cpu_count() or 1)
    budgets = {name: BUDGETS_S[preset][name] for name in args.parts}
    out = Path(args.out) / OUT_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    record = header(args, preset, {name: sizes[name] for name in args.parts}, budgets)
    write(out, record)
    end = time.perf_counter() + args.total_s
    for name in args.parts:
        budget = min(budgets[name], end - time.perf_counter() - GRACE_S)
        print(f"part {name}: budget {budget:.0f} s", flush=True)
        record["parts"][name] = (run_part(name, args.device, sizes[name], budget) if budget > 5
                                 else {"status": "timeout", "error": "no time left of --total-s"})
        print(f"part {name}: {record['parts'][name]['status']} {record['parts'][name].get('error', '')}", flush=True)
        record["extraction_summary"] = extraction_summary(record["parts"])
        write(out, record)
    record["complete"] = True
    write(out, record)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
