"""Benchmark: one section of the paper's size through every stage, with each stage's wall time and peak RSS.

The paper's S25 averages 283,171 cells per section (7,079,283 over 25). This writes one simulated
section of ``--cells`` cells on a ``--genes``-gene panel (5,000: Xenium Prime has 5,001) in 10x's own
formats, with its registered H&E at the simulator's 0.2738 µm/px; an atlas of 100,000 cells × 30,000
genes in CELLxGENE's shape (Ensembl var_names, symbols in feature_name, counts in raw.X, normalised
X) that ``cellpath references build`` turns into the section's reference; and a CellViT++
``cells.json`` of every nucleus with a 32-point contour (from the simulation's true nuclei, PanNuke
classes by compartment). It then runs the pipeline's stages on them as ``dvc repro`` runs them —
``cellpath <stage>`` in a child process each — in order: fetch (the simulator), atlas (written by
the benchmark), reference (``references build``), ingest, annotate (the built atlas as reference),
cellvit (written by the benchmark), concordance (reading the CellViT++ file), extract (the ViT-Ti/16
control at 20×) and probe (IS, the two taxonomies, every readout, every training cell). A stage's
peak RSS is its own process's (``os.wait4``'s rusage; the benchmark writes its own files in spawned
processes, so that no stage inherits their pages), its wall time from start to exit; each stage
starts as a first run would (the task outputs an earlier run kept in ``data/.work``, and the
extraction's features, removed) and records its commit.

Writes benchmarks/results/real_section.json after every stage (``--stages`` may stop early; a stage
that fails is recorded with its exit status, and the signal that killed it — SIGKILL from the
kernel's OOM killer where memory ran out — and the run stops there). ``--workdir`` keeps the data
for a rerun of later stages (``--stages concordance extract``).

Usage: python benchmarks/bench_real_section.py [--cells 283171] [--genes 5000] [--workdir DIR]
       [--stages fetch atlas reference ingest annotate cellvit concordance extract probe]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from blas_conditions import blas_report
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "real_section.json"
STAGES = ("fetch", "atlas", "reference", "ingest", "annotate", "cellvit", "concordance", "extract", "probe")
REFERENCE = "breast_cellxgene"  # data/references/<name>.h5ad: the CELLxGENE-shaped atlas after `references build`
ATLAS_CELLS, ATLAS_GENES = 100_000, 30_000
EXTRACT_ENCODER = "random-vit-t16"  # the ViT-Ti/16 control, at 20×
EXTRA_GENES_PER_CELL = 1_100  # detected genes per cell outside the simulator's (about 2,000 in all, as 10x 3' v3)
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
    params["annotate"]["references"] = {SECTION["section_id"]: REFERENCE}
    params["panel"] = "S1"
    params["protocol"] = "is"
    params["probe"]["max_train_cells"] = None  # every training cell, as the paper fits
    params["extract"].update(encoders=[EXTRACT_ENCODER], magnifications=["20x"])
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


def write_cellxgene_atlas(data_dir: Path, out: Path, cells: int = ATLAS_CELLS, genes: int = ATLAS_GENES,
                          seed: int = 0) -> dict:
    """An atlas in CELLxGENE's shape at ``out``: ``cells`` × ``genes``, Ensembl ids as var_names with
    symbols in var["feature_name"], raw counts (float32) in raw.X, log-normalised X, labels in
    obs["cell_type"]. Its cells are the simulator's Breast reference cells drawn with replacement and
    binomially thinned to depths of 60–100 %, beside genes the panel lacks with about
    ``EXTRA_GENES_PER_CELL`` detected per cell; drawn in blocks of 10,000 cells. Its shape and bytes."""
    import anndata as ad
    import scanpy as sc
    from scipy import sparse

    from cellpath.io.layout import reference_h5ad

    simulated = ad.read_h5ad(reference_h5ad(data_dir, "breast"))
    rng = np.random.default_rng(seed)
    n_extra = genes - simulated.n_vars
    drawn_cells = rng.integers(0, simulated.n_obs, cells)
    blocks = []
    for start in range(0, cells, 10_000):
        chosen = drawn_cells[start:start + 10_000]
        drawn = sparse.csr_matrix(simulated.X[chosen], dtype=np.int64)
        drawn.data = rng.binomial(drawn.data, np.repeat(rng.uniform(0.6, 1.0, len(chosen)), np.diff(drawn.indptr)))
        rows = np.repeat(np.arange(len(chosen)), rng.poisson(EXTRA_GENES_PER_CELL, len(chosen)))
        extra = sparse.csr_matrix((1 + rng.poisson(0.3, len(rows)), (rows, rng.integers(0, n_extra, len(rows)))),
                                  shape=(len(chosen), n_extra))  # a gene drawn twice for a cell sums
        block = sparse.hstack([drawn, extra], format="csr", dtype=np.float32)
        block.eliminate_zeros()
        blocks.append(block)
    counts = sparse.vstack(blocks, format="csr")
    del blocks
    symbols = [*map(str, simulated.var_names), *(f"CPX{i:05d}" for i in range(n_extra))]
    var = pd.DataFrame({"feature_name": symbols, "feature_biotype": "gene"},
                       index=pd.Index([f"ENSG{i:011d}" for i in range(genes)]))
    obs = pd.DataFrame({"cell_type": pd.Categorical(simulated.obs["cell_type"].to_numpy()[drawn_cells]),
                        "assay": "10x 3' v3", "tissue": "breast", "donor_id": "simulated"},
                       index=pd.Index([f"cell{i:06d}" for i in range(cells)]))
    atlas = ad.AnnData(X=counts.copy(), obs=obs, var=var)
    sc.pp.normalize_total(atlas, target_sum=1e4)
    sc.pp.log1p(atlas)
    atlas.raw = ad.AnnData(X=counts, var=var)
    out.parent.mkdir(parents=True, exist_ok=True)
    atlas.write_h5ad(out)
    return {"path": f"{out.name} in the workdir", "cells": cells, "genes": genes, "nonzeros": int(counts.nnz),
            "bytes": out.stat().st_size}


def stage_command(stage: str, params: Path, workdir: Path) -> list[str]:
    """The command a stage runs: ``cellpath <stage>`` as ``dvc repro`` runs it, or for ``reference``
    ``cellpath references build`` of the atlas (as Tabula Sapiens' CELLxGENE h5ad, raw.X counts)."""
    cellpath = str(Path(sys.executable).parent / "cellpath")
    if stage == "reference":
        return [cellpath, "references", "build", "tabula_sapiens_normal", "--from", str(workdir / "atlas.h5ad"),
                "--vocabulary", "cellpath-simulated-atlas/1",
                "--out", str(workdir / "data" / "references" / f"{REFERENCE}.h5ad")]
    return [cellpath, stage, "--params", str(params), "--data-dir", str(workdir / "data"),
            "--reports-dir", str(workdir / "reports")]


def in_child(function, *args):
    """``function(*args)`` in a fresh (spawned) process: the benchmark's own memory stays small, as it
    must — a stage's process forked from a large parent counts the parent's pages in its peak RSS."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def run_stage(stage: str, params: Path, workdir: Path) -> dict:
    """A stage's command in a child process: exit status, wall seconds, its own peak RSS (bytes)."""
    command = stage_command(stage, params, workdir)
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


def patches_read(workdir: Path) -> int:
    """Patches the extraction read (its sidecar's ``n_patches``)."""
    from cellpath.io.layout import features_dir

    sidecar = features_dir(workdir / "data") / EXTRACT_ENCODER / "20x" / SECTION["section_id"] / "sidecar.json"
    return int(json.loads(sidecar.read_text())["n_patches"])


def run_section(workdir: Path, cells: int, genes: int, stages: list[str], done: dict, record, *,
                atlas: Path | None = None) -> dict:
    """Run ``stages`` on one simulated section of ``cells`` cells in ``workdir``, adding each stage's
    result to ``done`` (stage → result) and calling ``record(done)`` after each; stop at a stage that
    fails. ``atlas``: an atlas h5ad written before, linked instead of written again."""
    params = write_params(workdir, cells, genes)
    he_mpp = yaml.safe_load(params.read_text())["synthetic"]["he_mpp"]
    commit = run_stamp()["commit"]
    for stage in stages:
        started = time.perf_counter()
        if stage == "atlas" and atlas is not None:
            target = workdir / "atlas.h5ad"
            target.unlink(missing_ok=True)
            target.symlink_to(atlas.resolve())
            result = {"returncode": 0, "written_by": "linked: the atlas of the first section size"}
        elif stage == "atlas":
            result = in_child(write_cellxgene_atlas, workdir / "data", workdir / "atlas.h5ad") | {
                "returncode": 0, "written_by": "the benchmark"}
        elif stage == "cellvit":
            result = in_child(write_cellvit, workdir / "data", workdir / "cellvit", he_mpp) | {
                "returncode": 0, "written_by": "the benchmark"}
        else:
            kept = [workdir / "data" / ".work" / stage]  # as a first run: nothing to reuse
            if stage == "extract":
                kept += [workdir / "data" / ".work" / "patches", workdir / "data" / "features" / EXTRACT_ENCODER]
            for folder in kept:
                shutil.rmtree(folder, ignore_errors=True)
            result = run_stage(stage, params, workdir)
        if stage == "extract" and result["returncode"] == 0:
            result["n_patches"] = patches_read(workdir)
        if "written_by" in result:
            result["seconds"] = round(time.perf_counter() - started, 1)
        done[stage] = result | {"commit": commit}
        print(stage, done[stage], flush=True)
        record(done)
        if result["returncode"] != 0:
            break
    return done


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
    previous = json.loads(OUT.read_text()) if OUT.is_file() and args.workdir else {}
    kept = ({stage: {"commit": previous["commit"], **result} for stage, result in previous["stages"].items()}
            if previous.get("cells") == args.cells else {})  # a stage kept from an earlier run keeps its commit

    def record(stages: dict) -> None:  # after every stage: a long run stopped keeps its stages
        result = with_provenance({
            "benchmark": "real_section", "cells": args.cells, "genes": args.genes, "section": SECTION,
            "he_mpp": yaml.safe_load((workdir / "params.yaml").read_text())["synthetic"]["he_mpp"],
            "atlas": {"cells": ATLAS_CELLS, "genes": ATLAS_GENES, "reference": REFERENCE},
            "stages": {stage: stages[stage] for stage in STAGES if stage in stages},
            "workdir": "kept" if args.workdir else "temporary", "budget_bytes": 24e9, "blas": blas_report(),
            "machine": {"cpus": os.cpu_count()}}, stamp)
        OUT.write_text(json.dumps(result, indent=2) + "\n")

    stages = run_section(workdir, args.cells, args.genes, args.stages, kept, record)
    print(json.dumps(stages, indent=2))


if __name__ == "__main__":
    main()
