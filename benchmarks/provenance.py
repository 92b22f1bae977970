"""When, on what code and where a benchmark's numbers were measured: the fields every JSON in
benchmarks/results/ carries (``date``, ``commit``, ``dirty``, ``machine`` with its ``description``).

Each ``bench_*.py`` takes ``run_stamp()`` as it starts (the date and the commit the code ran at: a
long benchmark must not pick up a commit made while it ran) and passes its result through
``with_provenance`` before writing it. ``benchmarks/results_table.py`` reads ``date``, ``commit``
and ``machine["description"]`` for its table; the ``recorded_in`` pointer of older records (the
commit that committed the numbers) cannot be known when they are measured and is not written.

Used by the benchmark scripts (``python benchmarks/<name>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Read only where git cannot tell the commit (a copy of the tree without its history): the short
#: hash of the commit that copy was made from, set by whoever runs the benchmark there.
COMMIT_VARIABLE = "CELLPATH_BENCH_COMMIT"
_BLAS_NAMES = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS", "flexiblas": "FlexiBLAS"}


def _git(*args: str, root: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """The short hash of HEAD and whether tracked files differ from it (``None``: unknown)."""
    head = _git("rev-parse", "--short", "HEAD", root=root)
    if not head:
        return os.environ.get(COMMIT_VARIABLE) or None, None
    changes = _git("status", "--porcelain", "--untracked-files=no", root=root)
    return head, None if changes is None else bool(changes)


def run_stamp(root: Path = ROOT) -> dict:
    """The date (UTC, ISO) and the commit of a benchmark run, taken when it starts."""
    commit, dirty = git_commit(root)
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": commit,
            "dirty": dirty}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name (/proc/cpuinfo on Linux, else what ``platform`` knows), or ``None``."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or None


def memory_gb() -> float | None:
    """Physical memory in GB (10⁹ bytes), to one decimal, or ``None`` where the system does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (AttributeError, OSError, ValueError):
        return None


def _blas_libraries(recorded) -> list[dict]:
    """The BLAS libraries in a result's ``blas`` field, whatever its shape: threadpoolctl's rows as a
    list, or a dict holding such a list."""
    if isinstance(recorded, dict):
        if "internal_api" in recorded:  # one library: BLAS, or OpenMP (whose rows say user_api "openmp")
            api = recorded.get("user_api")
            return [recorded] if api == "blas" or (api is None and recorded["internal_api"] in _BLAS_NAMES) else []
        return [lib for value in recorded.values() for lib in _blas_libraries(value)]
    if isinstance(recorded, list):
        return [lib for value in recorded for lib in _blas_libraries(value)]
    return []


def blas_summary(recorded) -> str | None:
    """``OpenBLAS 0.3.29/0.3.31 (SkylakeX)`` from a result's ``blas`` field; ``None`` without one."""
    names: dict[str, tuple[dict, dict]] = {}
    for lib in _blas_libraries(recorded):
        api = str(lib.get("internal_api"))
        versions, kernels = names.setdefault(_BLAS_NAMES.get(api, api), ({}, {}))
        if lib.get("version"):
            versions[str(lib["version"])] = None
        if lib.get("architecture"):
            kernels[str(lib["architecture"])] = None
    parts = []
    for name, (versions, kernels) in names.items():
        text = " ".join([name, "/".join(sorted(versions))]).strip()
        parts.append(text + (f" ({'/'.join(kernels)} kernels)" if kernels else ""))
    return ", ".join(parts) or None


def machine(fields: dict | None = None, blas=None) -> dict:
    """The machine of a run: ``description`` (in words), CPU model, cores, memory, Python, then the
    script's own ``fields`` (which win where they name the same thing)."""
    fields = dict(fields or {})
    cpus, model, memory = fields.get("cpus", os.cpu_count()), cpu_model(), memory_gb()
    release = re.match(r"\d+(\.\d+)?", platform.release())
    parts = [f"{cpus} CPUs" + (f" ({model})" if model else ""),
             *([f"{memory} GB"] if memory else []),
             " ".join(p for p in (platform.system(), release.group(0) if release else "",
                                  platform.machine().replace("_", "-")) if p),
             f"Python {fields.get('python', platform.python_version())}"]
    if blas_summary(blas):
        parts.append(blas_summary(blas))
    if fields.get("torch"):
        threads = fields.get("torch_threads")
        parts.append(f"torch {fields['torch']}" + (f" on {threads} threads" if threads else ""))
    if fields.get("gpu"):
        parts.append(f"GPU {fields['gpu']}")
    description = ", ".join(parts) + ("" if model else "; the CPU model is unknown")
    return {"description": description, "cpu_model": model, "cpus": cpus, "memory_gb": memory,
            "python": platform.python_version(), **fields}


def with_provenance(result: dict, stamp: dict | None = None) -> dict:
    """``result`` with the run's date, commit and dirty flag first and its ``machine`` described; every
    field and value of ``result`` kept (``machine`` is extended in place, or added last)."""
    stamp = run_stamp() if stamp is None else stamp
    recorded = {key: stamp[key] for key in ("date", "commit", "dirty")}
    return recorded | {key: value for key, value in result.items() if key not in recorded} | {
        "machine": machine(result.get("machine"), blas=result.get("blas"))}
