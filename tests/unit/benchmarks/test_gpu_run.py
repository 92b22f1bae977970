"""benchmarks/gpu/: the GPU measurement's dry run on the CPU (every part's code at tiny sizes, one JSON),
and the same run where the packages a bare GPU machine lacks cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.benchmark_scripts import BENCHMARKS, blocking_prelude, load_benchmark_file
from helpers.project import PROJECT_ROOT

GPU = BENCHMARKS / "gpu"
PROBE_MODES = ("in_memory", "streamed")


def _environment(tmp_path) -> dict:
    return {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1",
            "GPU_RUN_LIMIT_S": "300", "PYTHONPATH": ""}


def _check_probe(part: dict) -> None:
    """Part (c): a result the merge can use, the floor measured, the device's fits equal to the CPU's."""
    assert part["status"] == "ok", (part.get("error"), part.get("traceback"))
    for key in ("seconds_per_iteration", "seconds_per_pass"):
        assert set(PROBE_MODES) <= set(part["result"][key]) and all(
            v > 0 for v in part["result"][key].values()), key
    floor = part["result"]["floor"][0]
    assert floor["read_seconds"] > 0 and floor["iteration_seconds"] > 0 and floor["design_bytes"] > 0
    assert part["result"]["equality"]["agrees"], part["result"]["equality"]


def _check_parts(record: dict) -> None:
    """Every part ran at the tiny sizes and recorded what the merge reads."""
    parts = record["parts"]
    assert set(parts) == {"encoders", "extraction", "probe", "robustness", "expression"} and record["complete"]
    for name in ("encoders", "extraction", "robustness", "expression"):
        assert parts[name]["status"] == "ok", (name, parts[name].get("error"), parts[name].get("traceback"))
    models = parts["encoders"]["result"]["models"]
    assert [m["label"] for m in models] == ["ViT-S", "ViT-L", "ViT-g"]
    for model in models:
        assert model["depth"] == 1 and model["tokens_finite"] and model["gflop_per_patch"] > 0
        assert model["autocast"]["img_per_s"] > 0 and model["fp32"]["img_per_s"] > 0
        assert "peak_gpu_bytes" in model["autocast"]
    extraction = parts["extraction"]["result"]
    assert extraction["slide"]["levels"] == 2 and extraction["configs"][0]["delivered"]["patches_per_s"] > 0
    assert record["extraction_summary"]["read_patches_per_s"] > 0
    _check_probe(parts["probe"])
    robustness = parts["robustness"]["result"]
    assert robustness["compare"]["agrees"], robustness["compare"]
    assert robustness["full"]["seconds_per_pair_feature"] > 0 and robustness["anchors"]["seconds_per_pair_feature"] > 0
    expression = parts["expression"]["result"]
    assert expression["equality"]["agrees"], expression["equality"]
    assert [(t["rows"], t["width"]) for t in expression["timings"]] == [(3_000, 16), (6_000, 32)]
    assert all(t["seconds"] > 0 for t in expression["timings"])


def test_the_dry_run_writes_one_json_with_every_part(tmp_path):
    done = subprocess.run(["bash", str(GPU / "run.sh"), "--device", "cpu", "--tiny"], cwd=tmp_path,
                          env=_environment(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "gpu.log"]
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["benchmark"] == "gpu" and record["device"] == "cpu" and record["preset"] == "tiny"
    assert record["date"] and record["commit"] and record["machine"]["description"]
    assert {"torch", "cuda", "timm", "tifffile"} <= set(record["versions"])
    _check_parts(record)
    # here faiss imports: the torch search also agrees with the robustness stage's own search
    assert record["parts"]["robustness"]["result"]["compare"]["agrees_with_stage_search"]
    merge = load_benchmark_file("gpu/merge_costs.py", "gpu_merge_costs")
    with pytest.raises(merge.MergeError, match="not a CUDA device"):
        merge.cuda_entry(record, "gpu.json", None, None)


def test_the_run_needs_none_of_what_a_bare_gpu_machine_lacks(tmp_path):
    """Every module of benchmarks/gpu/ imports, and the dry run passes, with pydantic, tiatoolbox,
    spatialdata, anndata, faiss, mlflow, dvc and open_clip (and imagecodecs, zarr) unimportable; and
    without git the commit is the one the runner names."""
    code = blocking_prelude() + (
        "import runpy\n"
        "for name in ('run', 'encoders', 'extraction', 'knn', 'robustness', 'probe_part'):\n"
        "    __import__('gpu.' + name)\n"
        f"sys.argv = ['gpu.run', '--device', 'cpu', '--tiny', '--out', {str(tmp_path)!r}, '--commit', 'abc1234']\n"
        "runpy.run_module('gpu.run', run_name='__main__')\n")
    env = {**_environment(tmp_path), "PYTHONPATH": f"{PROJECT_ROOT / 'src'}:{BENCHMARKS}",
           "GIT_DIR": str(tmp_path / "no-repository")}
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["commit"] == "abc1234"
    _check_parts(record)
    stage = record["parts"]["robustness"]["result"]["compare"]["against_stage_search"]
    assert isinstance(stage, str) and stage.startswith("not importable here: ") and "faiss" in stage
