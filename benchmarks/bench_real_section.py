"""Benchmark: one section of the paper's size through every stage, with each stage's wall time and peak RSS.

The paper's S25 averages 283,171 cells per section (7,079,283 over 25). This writes one simulated
section of ``--cells`` cells on a ``--genes``-gene panel (5,000: Xenium Prime has 5,001) in 10x's own
formats, with its registered H&E at the simulator's 0.2738 µm/px, and a CellViT++ ``cells.json``
of every nucleus with a 32-point contour (from the simulation's true nuclei, PanNuke classes by
compartment), then runs the pipeline's stages on it as ``dvc repro`` runs them — ``cellpath <stage>``
in a child process each — in order: fetch (the simulator), ingest, annotate (the simulator's own
reference of the organ), concordance (reading the CellViT++ file), extract (the ViT-Ti/16 control
at 20×) and probe (IS, the two taxonomies, every readout). A stage's peak RSS is its own process's
(``os.wait4``'s rusage), its wall time from start to exit.

Writes benchmarks/results/real_section.json after every stage (``--stages`` may stop early; a stage
that fails is recorded with its exit status, and the signal that killed it — SIGKILL from the
kernel's OOM killer where memory ran out — and the run stops there). ``--workdir`` keeps the data for a rerun of later
stages (``--stages concordance extract``).

Usage: python benchmarks/bench_real_section.py [--cells 283171] [--genes 5000] [--workdir DIR]
       [--stages fetch ingest annotate cellvit concordance extract probe]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from blas_conditions import blas_report
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "real_section.json"
STAGES = ("fetch", "ingest", "annotate", "cellvit", "concordance", "extract", "probe")
SECTION = {"section_id": "breast_real_size", "organ": "Breast", "status": "Breast cancer"}
CONTOUR_POINTS = 32
PANNUKE_TYPE_MAP = {"0": "Background", "1": "Neoplastic", "2": "Inflammatory", "3": "Connective", "4": "Dead",
                    "5": "Epithelial"}
# A simulated cell's Tcoarse class as the PanNuke class id CellViT++ would give it (no class: Dead).
COARSE_TYPE = {"Epithelial/Tumor": 1, "Immune/Inflammatory": 2, "Stromal/Structural": 3}


def write_params(workdir: Path, cells: int, genes: int) -> Path:
    """The project's params with one simulated section of the paper's size, its CellViT++ folder,
    the ViT-Ti/16 control at 20× and the IS protocol; MLflow off."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["synthetic"].update(cells_per_section=cells, panel_genes=genes, sections=[SECTION])
    params["concordance"].update(panel_sizes=[1], cellvit_dir=str(workdir / "cellvit"))
    params["panel"] = "S1"
    params["protocol"] = "is"
    params["extract"].update(encoders=["random-vit-t16"], magnifications=["20x"])
    params["mlflow"]["enabled"] = False
    path = workdir / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def write_cellvit(data_dir: Path, out_dir: Path, he_mpp: float, seed: int = 0) -> dict:
    """A CellViT++ cells.json of every simulated nucleus (true H&E position, a round 32-point
    contour, the PanNuke class of its cell type's Tcoarse class); its path, nuclei and bytes."""
    from cellpath.annotation.ontology import cell_type
    from cellpath.io.layout import simulation_truth_parquet

    truth = pd.read_parquet(simulation_truth_parquet(data_dir, SECTION["section_id"]),
                            columns=["true_he_x_px", "true_he_y_px", "cell_type", "nucleus_major_um"])
    rng = np.random.default_rng(seed)
    angles = np.linspace(0, 2 * np.pi, CONTOUR_POINTS, endpoint=False)
    folder = out_dir / SECTION["section_id"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cells.json"
    coarse = {name: COARSE_TYPE.get(cell_type(name).coarse, 4) for name in truth["cell_type"].unique()}
    types = truth["cell_type"].map(coarse).to_numpy()
    radius_px = truth["nucleus_major_um"].to_numpy() / 2 / he_mpp
    with path.open("w") as out:
        header = {"wsi_metadata": {"base_mpp": he_mpp, "target_patch_mpp": he_mpp, "magnification": 40},
                  "type_map": PANNUKE_TYPE_MAP}
        out.write(json.dumps(header)[:-1] + ', "cells": [')
        for i, (x, y) in enumerate(truth[["true_he_x_px", "true_he_y_px"]].to_numpy()):
            r = radius_px[i]
            contour = np.round(np.stack([x + r * np.cos(angles), y + r * np.sin(angles)], 1)).astype(int)
            cell = {"bbox": [[int(y - r), int(x - r)], [int(y + r), int(x + r)]],
                    "centroid": [round(float(x), 2), round(float(y), 2)], "contour": contour.tolist(),
                    "type_prob": round(float(rng.uniform(0.5, 1.0)), 4), "type": int(types[i])}
            out.write(("," if i else "") + json.dumps(cell))
        out.write("]}")
    return {"path": f"{path.relative_to(out_dir.parent)} in the workdir", "nuclei": len(truth),
            "bytes": path.stat().st_size}


def run_stage(stage: str, params: Path, workdir: Path) -> dict:
    """``cellpath <stage>`` in a child process: exit status, wall seconds, its own peak RSS (bytes)."""
    command = [str(Path(sys.executable).parent / "cellpath"), stage, "--params", str(params),
               "--data-dir", str(workdir / "data"), "--reports-dir", str(workdir / "reports")]
    log = (workdir / f"{stage}.log").open("w")
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, HF_HUB_OFFLINE="1"))
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    log.close()
    returncode = os.waitstatus_to_exitcode(status)
    return {"returncode": returncode, "seconds": round(seconds, 1), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "log": f"{stage}.log in the workdir",
            **({"killed_by": signal.Signals(-returncode).name} if returncode < 0 else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=283_171)
    parser.add_argument("--genes", type=int, default=5_000)  # the simulator's most; Xenium Prime has 5,001
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    stamp = run_stamp()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cellpath-real-section-"))
    workdir.mkdir(parents=True, exist_ok=True)
    params = write_params(workdir, args.cells, args.genes)
    he_mpp = yaml.safe_load(params.read_text())["synthetic"]["he_mpp"]
    previous = json.loads(OUT.read_text()) if OUT.is_file() and args.workdir else {}
    stages = dict(previous.get("stages", {})) if previous.get("cells") == args.cells else {}
    for stage in args.stages:
        if stage == "cellvit":
            started = time.perf_counter()
            stages[stage] = write_cellvit(workdir / "data", workdir / "cellvit", he_mpp) | {
                "seconds": round(time.perf_counter() - started, 1), "returncode": 0, "written_by": "the benchmark"}
        else:
            stages[stage] = run_stage(stage, params, workdir)
        print(stage, stages[stage], flush=True)
        result = with_provenance({
            "benchmark": "real_section", "cells": args.cells, "genes": args.genes, "section": SECTION,
            "he_mpp": he_mpp, "stages": stages, "workdir": "kept" if args.workdir else "temporary",
            "budget_bytes": 24e9, "blas": blas_report(), "machine": {"cpus": os.cpu_count()},
        }, stamp)
        OUT.write_text(json.dumps(result, indent=2) + "\n")  # after every stage: a long run stopped keeps its stages
        if stages[stage]["returncode"] != 0:
            break
    print(json.dumps(stages, indent=2))


if __name__ == "__main__":
    main()
