"""Benchmark: extraction throughput against the encoder's raw forward pass on the same batches.

For one section of the default panel (run `dvc repro` first), times the full pipeline path —
tiling, tiatoolbox patch reads, encoder forward, Nuc/Mean/Cls readouts — and, in the same run,
the encoder's bare ``forward_tokens`` on the very same patches already in memory. The ratio
raw_time / pipeline_time is the share of time spent in the model (target: ≥ 0.9, i.e. tiling,
reading and sampling cost ≤ 10 %). The pipeline runs with patches read ahead on a background
thread (the default, ``read_ahead_batches`` 2) and, as the baseline, read on demand in the main
thread (0, the behaviour before reading ahead), and from the shared patch store a second encoder of the same
input size reads (``cellpath.features.patch_cache``). Reading alone is timed too: patches/s one
reader delivers from the slide and from the store. All alternate ``--repeats`` times and the
medians and ranges of the ratios are reported, with threadpoolctl's BLAS report. Writes
benchmarks/results/extract.json.

Usage: python benchmarks/bench_extract.py [--encoder random-vit-s16] [--magnification 40x] [--section ID]
       [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_info

from cellpath.config import load_params
from cellpath.features.encoders.loading import load_encoder
from cellpath.features.encoders.registry import load_registry
from cellpath.features.extract import extract_cells, read_patches
from cellpath.features.patch_cache import PatchStore, patch_store_path
from cellpath.features.tiling import place_section_cells
from cellpath.io.layout import raw_dir
from cellpath.io.sections import read_section_index, read_section_table
from cellpath.io.wsi import open_slide
from cellpath.vocabulary import MAGNIFICATION_MPP

from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoder", default="random-vit-s16")
    parser.add_argument("--magnification", default="40x")
    parser.add_argument("--section", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stamp = run_stamp()
    params = load_params(ROOT / "params.yaml")
    spec = {s.slug: s for s in load_registry(ROOT / params.extract.registry).values()}[args.encoder]
    data = ROOT / "data"
    index = read_section_index(data)
    row = index.iloc[0] if args.section is None else index.set_index("section_id").loc[args.section].to_dict() | {
        "section_id": args.section}
    table = read_section_table(data, row["section_id"])
    placement = place_section_cells(table.obs, row, target_mpp=MAGNIFICATION_MPP[args.magnification],
                                    input_size=spec.input_size)
    encoder = load_encoder(spec, weights_dir=ROOT / params.extract.weights_dir)
    slide_path = raw_dir(data) / row["raw_folder"] / row["he_image"]
    slide = open_slide(slide_path, mpp=float(row["he_mpp"]))
    batch = params.extract.batch_size
    patches = np.unique(placement.patch_index)
    encoder.forward_tokens(read_patches(slide, placement.grid, patches[:2]))  # warm-up

    images = [read_patches(slide, placement.grid, patches[i:i + batch]) for i in range(0, len(patches), batch)]

    def timed(run) -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    scratch = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    store = patch_store_path(scratch, row["section_id"], Path(slide_path), placement.grid)
    extract_cells(encoder, slide, placement, batch_size=batch, patch_store=store)  # fills the shared store
    shared = PatchStore(store)
    blocks = [patches[i:i + batch] for i in range(0, len(patches), batch)]

    ahead, on_demand, from_store, raw, read_slide, read_store = [], [], [], [], [], []
    for _ in range(args.repeats):
        ahead.append(timed(lambda: extract_cells(encoder, slide, placement, batch_size=batch, read_ahead_batches=2)))
        on_demand.append(timed(lambda: extract_cells(encoder, slide, placement, batch_size=batch,
                                                     read_ahead_batches=0)))
        from_store.append(timed(lambda: extract_cells(encoder, slide, placement, batch_size=batch,
                                                      patch_store=store)))
        raw.append(timed(lambda: [encoder.forward_tokens(block) for block in images]))
        read_slide.append(timed(lambda: [read_patches(slide, placement.grid, block) for block in blocks]))
        read_store.append(timed(lambda: [shared.take(block) for block in blocks]))
    shutil.rmtree(scratch)

    def spread(values: list[float]) -> dict:
        return {"median": round(float(np.median(values)), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}

    pipeline_s, raw_s = float(np.median(ahead)), float(np.median(raw))
    result = {
        "benchmark": "extract",
        "encoder": spec.name, "magnification": args.magnification, "section": row["section_id"],
        "cells": int(table.n_obs), "patches": int(len(patches)), "batch_size": batch, "repeats": args.repeats,
        "pipeline_s": [round(t, 2) for t in ahead], "on_demand_s": [round(t, 2) for t in on_demand],
        "raw_forward_s": [round(t, 2) for t in raw],
        "pipeline_patches_per_s": round(len(patches) / pipeline_s, 2),
        "pipeline_cells_per_s": round(table.n_obs / pipeline_s, 1),
        "raw_patches_per_s": round(len(patches) / raw_s, 2),
        "ratio_raw_over_pipeline": spread([r / a for r, a in zip(raw, ahead)]),
        "ratio_raw_over_on_demand": spread([r / o for r, o in zip(raw, on_demand)]),
        "ratio_on_demand_over_read_ahead": spread([o / a for o, a in zip(on_demand, ahead)]),
        "from_store_s": [round(t, 2) for t in from_store],
        "ratio_raw_over_from_store": spread([r / f for r, f in zip(raw, from_store)]),
        "read_patches_per_s": {"slide": spread([len(patches) / t for t in read_slide]),
                               "shared_store": spread([len(patches) / t for t in read_store])},
        "ratio_store_read_rate_over_slide": spread([a / b for a, b in zip(read_slide, read_store)]),
        "read_note": ("patches/s one reader thread delivers (slide: tiatoolbox read_rect; shared_store: the "
                      "memory-mapped patch store that the first encoder of a (section, mpp, input size) fills)"),
        "target_ratio": 0.9,
        "blas": [{k: info.get(k) for k in ("internal_api", "version", "num_threads")} for info in threadpool_info()],
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
    }
    result = with_provenance(result, stamp)
    out = ROOT / "benchmarks" / "results" / "extract.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
