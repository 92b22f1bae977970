"""Where a stage's task outputs (shards) live between runs, and the keys that make reuse safe.

Shards live in ``<data>/.work/<stage>/`` — no DVC stage's output, ignored by git — as
``<key>.<ext>`` files or folders. A key ends with a digest of everything the shard's result
depends on (docs/decisions/0010-executor.md): the stage's parameters, the shard's identity,
the source files the stage runs and the library versions
(:func:`cellpath.runtime.code_deps.stage_fingerprint`), the thread counts (they
change floating-point results), the panel's cells by content (``PanelCells.digest``) and the feature
files by size, mtime and inode (:func:`file_fingerprint`: re-extraction renames new files into
place). So a shard is reused only for exactly the inputs it was computed from, and anything else
gets a new key; after a successful run the stage removes the shards it no longer uses
(:func:`prune`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import stat
from collections.abc import Callable
from pathlib import Path

from cellpath.errors import ExecutorError
from cellpath.io.atomic import atomic_output, remove_path
from cellpath.runtime.executor import Task
from cellpath.io.layout import work_root


def shard_task(stage: str, name: str, material: dict, fn: Callable[..., None], args: tuple, work: Path, *,
               suffix: str = "", gpu: bool = False) -> Task:
    """The task whose output is the shard ``<work>/<key><suffix>``, keyed by :func:`shard_key` of
    everything its result depends on (``material``): how the probe and robustness stages make tasks."""
    key = shard_key(stage, name, material)
    return Task(key, fn, args, work / f"{key}{suffix}", gpu=gpu)


def work_dir(data_dir: Path, stage: str) -> Path:
    """``<data>/.work/<stage>`` (absolute, created), with a .gitignore that ignores the whole .work."""
    root = work_root(data_dir).resolve()
    folder = root / stage
    folder.mkdir(parents=True, exist_ok=True)
    ignore = root / ".gitignore"
    if not ignore.is_file():
        ignore.write_text("# task outputs of the extract, probe and robustness stages (cellpath.runtime.shards)\n*\n")
    return folder


def digest(material: object) -> str:
    """A 16-hex-digit SHA-256 of JSON-serialisable material (keys sorted)."""
    text = json.dumps(material, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shard_key(stage: str, name: str, material: object) -> str:
    """``<stage>-<readable name>-<digest of material>``: file-system and Dask safe."""
    readable = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{stage}-{readable}-{digest(material)}"


def file_fingerprint(paths: list[Path]) -> list[list]:
    """(path, size, mtime_ns, inode) of every file under ``paths`` (sorted); missing paths as None."""
    found = []
    for path in paths:
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
        for file in files:
            try:
                stat = file.stat()
            except FileNotFoundError:
                found.append([str(file), None])
                continue
            found.append([str(file), stat.st_size, stat.st_mtime_ns, stat.st_ino])
    return found


def write_context(folder: Path, name: str, material: object, value: object) -> Path:
    """Pickle what every task of a stage reads (the panel, the plan) once, keyed like a shard; the file is
    this user's and writable by nobody else (mode 0600), so that :func:`read_context` may trust it."""
    path = folder / f"{shard_key('context', name, material)}.pkl"
    if not path.is_file():
        with atomic_output(path) as tmp:
            tmp.write_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            os.chmod(tmp, 0o600)
    _check_own_file(path)
    return path


def read_context(path: Path) -> object:
    """A context written by :func:`write_context`: unpickled only when it is this user's own file that no
    one else can write (a pickle runs code as it loads)."""
    _check_own_file(Path(path))
    return pickle.loads(Path(path).read_bytes())


def _check_own_file(path: Path) -> None:
    """Raise ExecutorError unless ``path`` is a regular file owned by this user, writable by no one else."""
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ExecutorError(
            f"{path}: a stage's work file that is not this user's own (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}); it is pickled state, which runs code when loaded, so it is not read. "
            "Delete it (the stage writes it again), and keep the data folder's .work writable only by you")


def prune(folder: Path, keep: list[Path]) -> int:
    """Remove everything in ``folder`` but ``keep`` (shards of other inputs, interrupted writes)."""
    kept = {Path(p).name for p in keep}
    stale = [p for p in folder.iterdir() if p.name not in kept]
    for path in stale:
        remove_path(path)
    return len(stale)
