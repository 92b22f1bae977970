"""Benchmark: reading a whole section's CellViT++ cells.json, streamed against parsed whole.

A cells.json of ``--nuclei`` nuclei in CellViT++'s layout (bbox, centroid, a 32-point contour,
type_prob and type per cell, in level-0 px of a 40,000 px slide) is written once; then, each in a
fresh child process so that its peak RSS is its own (``getrusage``):

- ``streamed``: ``cellpath.concordance.cellvit.read_cellvit`` (ijson, one cell at a time);
- baseline ``whole``: the standard library's ``json.loads`` of the whole document and the same
  centroids and class ids taken from it (how the reader worked before it streamed).

They alternate ``--repeats`` times, in swapped order every repeat; the JSON has each side's median
wall time and peak RSS and the whole ÷ streamed ratios (median, range). Writes
benchmarks/results/cellvit_read.json.

Usage: python benchmarks/bench_cellvit_read.py [--nuclei 300000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
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
OUT = ROOT / "benchmarks" / "results" / "cellvit_read.json"
CONTOUR_POINTS = 32
SLIDE_PX = 40_000
TYPE_MAP = {"0": "Background", "1": "Neoplastic", "2": "Inflammatory", "3": "Connective", "4": "Dead",
            "5": "Epithelial"}

STREAMED = """
import sys
from cellpath.concordance.cellvit import read_cellvit
detections = read_cellvit(sys.argv[1])
print(len(detections.x_px) + detections.n_dropped)
"""
WHOLE = """
import json, sys
import numpy as np
document = json.loads(open(sys.argv[1], "rb").read())
cells = document["cells"]
xy = np.asarray([cell["centroid"] for cell in cells], dtype=float)
names = [document["type_map"][str(cell["type"])] for cell in cells]
print(len(names))
"""


def write_cells_json(path: Path, nuclei: int, seed: int = 0) -> int:
    """A CellViT++ cells.json of ``nuclei`` round nuclei; its size in bytes."""
    rng = np.random.default_rng(seed)
    angles = np.linspace(0, 2 * np.pi, CONTOUR_POINTS, endpoint=False)
    with path.open("w") as out:
        out.write(json.dumps({"wsi_metadata": {"base_mpp": 0.2125, "target_patch_mpp": 0.25, "magnification": 40},
                              "type_map": TYPE_MAP})[:-1] + ', "cells": [')
        for i in range(nuclei):
            x, y = rng.uniform(0, SLIDE_PX, 2)
            radius = rng.uniform(8, 20)
            contour = np.round(np.stack([x + radius * np.cos(angles), y + radius * np.sin(angles)], 1)).astype(int)
            cell = {"bbox": [[int(y - radius), int(x - radius)], [int(y + radius), int(x + radius)]],
                    "centroid": [round(float(x), 2), round(float(y), 2)], "contour": contour.tolist(),
                    "type_prob": round(float(rng.uniform(0.5, 1.0)), 4), "type": int(rng.integers(1, 6))}
            out.write(("," if i else "") + json.dumps(cell))
        out.write("]}")
    return path.stat().st_size


def measure(code: str, path: Path) -> dict:
    """Wall time, nuclei read and peak RSS (bytes, the child's own ``getrusage``) of a fresh child
    process running ``code`` on ``path``."""
    probe = code + "import resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe, str(path)], check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stdout.split()
    return {"seconds": time.perf_counter() - started, "cells": int(out[-2]), "peak_rss_bytes": int(out[-1]) * 1024}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nuclei", type=int, default=300_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stamp = run_stamp()
    sides = {"streamed": STREAMED, "whole": WHOLE}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cells.json"
        size = write_cells_json(path, args.nuclei)
        for repeat in range(args.repeats):
            for side in (list(sides) if repeat % 2 == 0 else list(reversed(sides))):
                run = measure(sides[side], path)
                runs[side].append(run)
                print(side, repeat, run, flush=True)
    assert all(r["cells"] == args.nuclei for rows in runs.values() for r in rows), "a side lost nuclei"
    summary = {side: {"seconds": spread([r["seconds"] for r in rows]),
                      "peak_rss_bytes": int(statistics.median(r["peak_rss_bytes"] for r in rows))}
               for side, rows in runs.items()}
    ratios = {"seconds": spread([w["seconds"] / s["seconds"] for w, s in zip(runs["whole"], runs["streamed"])]),
              "peak_rss": spread([w["peak_rss_bytes"] / s["peak_rss_bytes"]
                                  for w, s in zip(runs["whole"], runs["streamed"])])}
    result = with_provenance({
        "benchmark": "cellvit_read", "nuclei": args.nuclei, "contour_points": CONTOUR_POINTS, "file_bytes": size,
        "repeats": args.repeats, "runs": runs, "summary": summary, "whole_over_streamed": ratios,
        "blas": blas_report(), "machine": {"cpus": os.cpu_count()},
    }, stamp)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"summary": summary, "whole_over_streamed": ratios}, indent=2))


if __name__ == "__main__":
    main()
