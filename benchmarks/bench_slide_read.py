"""Benchmark: reading 20× patches from a real-size registered H&E, against tifffile's raw decode.

Writes, with the project's own writer (``cellpath.simulation.xenium_bundle.write_he_ome_tiff``: BigTIFF, 256 px
JPEG tiles, a ×2 pyramid in SubIFDs, OME-XML with PhysicalSizeX/Y in µm — the form 10x's
``*_he_image.ome.tif`` takes as far as the readers of it describe), a slide of 10x's size
(default 24576 px a side at 0.2738 µm/px, a 6.7 mm field) with a tissue-like texture, then reads
the same seeded 224 px patches at 0.5 µm/px (20×) two ways, alternating, ``--rounds`` times:

- pipeline: ``open_slide(...).read_rect(..., resolution=0.5, units="mpp")`` as extraction reads;
- baseline: tifffile's zarr view of level 0, the same level-0 window, resized with OpenCV
  (INTER_AREA) — the decode floor.

Writes benchmarks/results/slide_read.json: patches/s of each, the median ratio baseline_s /
pipeline_s with its spread (1.0: reading costs no more than decoding), the file size, and each
side's BLAS (threadpoolctl). Usage: python benchmarks/bench_slide_read.py [--side 24576]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import cv2
import numpy as np
import tifffile
import zarr
from scipy import ndimage
from threadpoolctl import threadpool_info

from cellpath.io.wsi import open_slide
from cellpath.simulation.xenium_bundle import write_he_ome_tiff

from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
MPP = 0.2738  # µm per level-0 px, the simulator's and a common 10x H&E scan's
TARGET_MPP = 0.5  # 20×
PATCH = 224


def tissue_texture(side: int, rng: np.random.Generator) -> np.ndarray:
    """An H&E-like RGB tile: smooth eosin-pink stroma with haematoxylin-dark nuclei (uint8)."""
    field = ndimage.gaussian_filter(rng.normal(size=(side, side)), 6.0)
    field = (field - field.min()) / (np.ptp(field) + 1e-9)
    nuclei = ndimage.gaussian_filter((rng.random((side, side)) > 0.9985).astype(float), 3.0)
    nuclei = np.clip(nuclei / (nuclei.max() + 1e-9) * 3.0, 0.0, 1.0)
    pink, purple, glass = np.array([232, 160, 200]), np.array([90, 50, 140]), np.array([245, 240, 245])
    rgb = glass + (pink - glass) * field[..., None]
    rgb = rgb + (purple - rgb) * nuclei[..., None]
    return np.clip(rgb + rng.normal(0, 4, size=rgb.shape), 0, 255).astype(np.uint8)


def write_slide(path: Path, side: int, rng: np.random.Generator) -> float:
    """The slide, tiled from one 2048 px texture tile; returns the write time (s)."""
    tile = tissue_texture(2048, rng)
    reps = -(-side // 2048)
    rgb = np.tile(tile, (reps, reps, 1))[:side, :side]
    started = time.perf_counter()
    write_he_ome_tiff(path, rgb, MPP)
    return time.perf_counter() - started


def read_pipeline(path: Path, origins: np.ndarray) -> float:
    slide = open_slide(path, mpp=MPP)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x0, y0 in origins:
            patch = slide.read_rect(location=(int(x0), int(y0)), size=(PATCH, PATCH), resolution=TARGET_MPP,
                                    units="mpp")
            assert patch.shape[:2] == (PATCH, PATCH)
    return time.perf_counter() - started


def read_baseline(path: Path, origins: np.ndarray) -> float:
    window = int(round(PATCH * TARGET_MPP / MPP))
    with tifffile.TiffFile(path) as tif:
        level0 = zarr.open_array(tif.series[0].aszarr(level=0), mode="r")
        started = time.perf_counter()
        for x0, y0 in origins:
            region = np.asarray(level0[int(y0):int(y0) + window, int(x0):int(x0) + window])
            patch = cv2.resize(region, (PATCH, PATCH), interpolation=cv2.INTER_AREA)
            assert patch.shape[:2] == (PATCH, PATCH)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=24576, help="slide width = height in level-0 px")
    parser.add_argument("--patches", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    stamp = run_stamp()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        path = Path(tmp) / "bench_he_image.ome.tif"
        write_s = write_slide(path, args.side, rng)
        window = int(round(PATCH * TARGET_MPP / MPP))
        origins = rng.integers(0, args.side - window, size=(args.patches, 2))
        rounds = []
        for _ in range(args.rounds):  # alternate A/B under the same conditions
            pipeline_s = read_pipeline(path, origins)
            baseline_s = read_baseline(path, origins)
            rounds.append({"pipeline_s": round(pipeline_s, 3), "baseline_s": round(baseline_s, 3),
                           "ratio_baseline_over_pipeline": round(baseline_s / pipeline_s, 3)})
        with tifffile.TiffFile(path) as tif:
            levels = [list(level.shape) for level in tif.series[0].levels]
            compression = str(tif.pages[0].compression.name)
        size_bytes = path.stat().st_size
    ratios = [r["ratio_baseline_over_pipeline"] for r in rounds]
    pipeline = statistics.median(r["pipeline_s"] for r in rounds)
    baseline = statistics.median(r["baseline_s"] for r in rounds)
    result = {
        "benchmark": "slide_read",
        "slide": {"side_px": args.side, "mpp": MPP, "levels": levels, "compression": compression,
                  "file_bytes": size_bytes, "write_s": round(write_s, 1)},
        "patches": args.patches, "patch_px": PATCH, "target_mpp": TARGET_MPP,
        "pipeline": "tiatoolbox read_rect at 0.5 mpp (open_slide)",
        "baseline": "tifffile zarr level-0 window + cv2.resize INTER_AREA",
        "pipeline_patches_per_s": round(args.patches / pipeline, 1),
        "baseline_patches_per_s": round(args.patches / baseline, 1),
        "median_ratio_baseline_over_pipeline": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)],
        "rounds": rounds,
        "blas": [{k: info.get(k) for k in ("internal_api", "num_threads", "version")} for info in threadpool_info()],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    result = with_provenance(result, stamp)
    out = ROOT / "benchmarks" / "results" / "slide_read.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
