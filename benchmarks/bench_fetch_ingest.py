"""Benchmark: `cellpath fetch` + `cellpath ingest` on the default params, against named baselines.

Runs both stages as the pipeline does (subprocesses of the CLI) into a temporary data folder, then
times, in the same run and on the same files:

- baseline for ingest: spatialdata-io's Xenium reader alone on every bundle (the library floor);
- baseline for fetch: copying the bytes fetch wrote (the disk floor).

Writes benchmarks/results/fetch_ingest.json with wall times, the ratios to the baselines, and
whether fetch + ingest met the 3-minute budget. Usage: python benchmarks/bench_fetch_ingest.py
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 180.0


def _stage(name: str, data_dir: Path) -> float:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    started = time.perf_counter()
    subprocess.run(["cellpath", name, "--params", str(ROOT / "params.yaml"), "--data-dir", str(data_dir)],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    return time.perf_counter() - started


def _reader_floor(raw: Path) -> float:
    from spatialdata_io import xenium

    started = time.perf_counter()
    for folder in sorted(p for p in raw.iterdir() if p.is_dir()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            xenium(folder, cells_boundaries=False, nucleus_boundaries=False, cells_labels=False,
                   nucleus_labels=False, transcripts=False, morphology_mip=False, morphology_focus=False,
                   aligned_images=False, cells_as_circles=False)
    return time.perf_counter() - started


def main() -> None:
    stamp = run_stamp()
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        data = Path(tmp) / "data"
        fetch_s = _stage("fetch", data)
        ingest_s = _stage("ingest", data)
        written = sum(p.stat().st_size for p in (data / "raw").rglob("*") if p.is_file())
        started = time.perf_counter()
        shutil.copytree(data / "raw", Path(tmp) / "copy")
        copy_s = time.perf_counter() - started
        reader_s = _reader_floor(data / "raw")
        n_sections = sum(1 for p in (data / "raw").iterdir() if p.is_dir())
    result = {
        "benchmark": "fetch_ingest",
        "params": "params.yaml (default)",
        "sections": n_sections,
        "bytes_written_raw": written,
        "fetch_s": round(fetch_s, 2),
        "ingest_s": round(ingest_s, 2),
        "fetch_plus_ingest_s": round(fetch_s + ingest_s, 2),
        "budget_s": BUDGET_S,
        "within_budget": fetch_s + ingest_s < BUDGET_S,
        "baselines": {
            "copy_raw_bytes_s": round(copy_s, 3),
            "spatialdata_io_reader_only_s": round(reader_s, 2),
        },
        "ratios": {
            "fetch_over_copy": round(fetch_s / copy_s, 1),
            "ingest_over_reader": round(ingest_s / reader_s, 2),
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    result = with_provenance(result, stamp)
    out = ROOT / "benchmarks" / "results" / "fetch_ingest.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
