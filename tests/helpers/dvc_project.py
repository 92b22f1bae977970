"""A very small DVC project in a temporary git repository, for tests that run `dvc repro` itself."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from helpers.project import HANG_GUARD_S, PROJECT_ROOT

TRACKED = ["dvc.yaml", "data/manifests", "src/cellpath", "models/encoders.yaml", ".gitignore"]


def dvc_env() -> dict[str, str]:
    """The environment for `dvc` and `cellpath` subprocesses: this venv first, offline hub."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"
    env["DVC_NO_ANALYTICS"] = "1"
    return env


def run(cmd: list[str], cwd: Path, timeout: int = HANG_GUARD_S) -> str:
    """Run a command; fail the test with its output when it fails."""
    result = subprocess.run(cmd, cwd=cwd, env=dvc_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def make_tiny_project(work: Path, magnifications: tuple[str, ...] = ("10x", "20x")) -> Path:
    """Two simulated sections (150 cells), the filter bank at ``magnifications`` (two, so that the probe
    has two tasks), every stage: a committed git + DVC repo at ``work`` that has never run."""
    work.mkdir(parents=True)
    for item in TRACKED:
        source, dest = PROJECT_ROOT / item, work / item
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest)
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    params["synthetic"].update(cells_per_section=150, panel_genes=230, reference_cells_per_type=20)
    params["synthetic"]["sections"] = [
        {"section_id": "colon_t", "organ": "Colon", "status": "Colorectal cancer"},
        {"section_id": "skin_t", "organ": "Skin", "status": "Normal"},
    ]
    params["concordance"]["panel_sizes"] = [1, 2]
    params["panel"] = "S2"
    params["extract"].update(encoders=["filterbank-dense"], magnifications=list(magnifications))
    params["probe"].update(seeds={"is": 1, "iocd": 1, "mocv": 1, "looo": 1}, mocv_folds=2, readouts=["Nuc", "Mean"],
                           min_train_cells={"fine": 5, "coarse": 5}, min_test_cells={"fine": 5, "coarse": 5},
                           max_iter=20, magnifications=None)
    params["robustness"].update(magnifications=["10x"], taxonomies=["coarse"], readouts=["Nuc"], group="tile",
                                shortcut={"enabled": False})
    params["expression"].update(magnifications=["10x"], readouts=["Nuc"], genes=20)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q", "-b", "main"], work)
    run(["git", "config", "user.email", "test@example.com"], work)
    run(["git", "config", "user.name", "test"], work)
    run(["dvc", "init", "-q"], work)
    shutil.copytree(PROJECT_ROOT / ".dvc" / "plots", work / ".dvc" / "plots")  # the offline plots page, as here
    shutil.copy2(PROJECT_ROOT / ".dvc" / "config", work / ".dvc" / "config")  # the project's cache links and remote
    run(["git", "add", "-A"], work)
    run(["git", "commit", "-qm", "tiny project"], work)
    return work


def run_tiny_project(root: Path) -> dict:
    """``root/pristine`` (never run) and ``root/completed`` (a copy after `dvc repro`), with that run's log."""
    pristine = make_tiny_project(root / "pristine")
    completed = root / "completed"
    shutil.copytree(pristine, completed)
    return {"pristine": pristine, "completed": completed, "log": run(["dvc", "repro"], completed)}


def shared_tiny_project(root: Path) -> dict:
    """:func:`run_tiny_project` at ``root`` once for every process that asks: under a file lock the
    first builds it and records it (``root/run.json``), the others wait and read the record. Its users
    copy it before changing anything, so the two test workers may read it at once."""
    root.parent.mkdir(parents=True, exist_ok=True)
    record = root / "run.json"
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if record.is_file():
            data = json.loads(record.read_text())
            return {"pristine": Path(data["pristine"]), "completed": Path(data["completed"]), "log": data["log"]}
        if root.exists():  # a build that failed in another worker
            shutil.rmtree(root)
        built = run_tiny_project(root)
        record.write_text(json.dumps({key: str(value) for key, value in built.items()}))
        return built


def cached_files(project: Path) -> dict[Path, Path]:
    """Every file of every output DVC caches in ``project``, and its object in the cache (from dvc.lock
    and the cache's directory listings)."""
    from dvc.repo import Repo

    files: dict[Path, Path] = {}
    with Repo(str(project)) as repo:
        cache = Path(repo.cache.local.path)
        for out in repo.index.outs:
            if not out.use_cache:
                continue
            oid = out.hash_info.value
            if out.is_dir_checksum:
                for entry in json.loads((cache / oid[:2] / oid[2:]).read_text()):
                    files[Path(out.fs_path) / entry["relpath"]] = cache / entry["md5"][:2] / entry["md5"][2:]
            else:
                files[Path(out.fs_path)] = cache / oid[:2] / oid[2:]
    return files
