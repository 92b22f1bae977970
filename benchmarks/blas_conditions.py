"""The same BLAS for every side of a benchmark: restart without the variables that slow numpy's
BLAS on some machines here, and report what threadpoolctl sees.

Used by the benchmark scripts (``python benchmarks/<name>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import sys

from threadpoolctl import threadpool_info

#: Set on some machines here; each makes OpenBLAS pick a slow kernel for this CPU.
SLOW_BLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_REMOVED = "CELLPATH_BENCH_REMOVED_BLAS_VARIABLES"


def restart_without_slow_blas() -> dict[str, str]:
    """Re-execute this script without ``SLOW_BLAS_VARIABLES`` if any is set (never returns then);
    after the restart, return what was removed (empty if nothing was)."""
    removed = {name: os.environ[name] for name in SLOW_BLAS_VARIABLES if name in os.environ}
    if removed:
        env = {k: v for k, v in os.environ.items() if k not in SLOW_BLAS_VARIABLES}
        env[_REMOVED] = json.dumps(removed)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return json.loads(os.environ.get(_REMOVED, "{}"))


def blas_report() -> list[dict]:
    """The BLAS / OpenMP libraries loaded in this process (threadpoolctl), with their thread counts."""
    keys = ("user_api", "internal_api", "prefix", "version", "architecture", "num_threads", "threading_layer")
    return [{k: _as_json_value(lib.get(k)) for k in keys} for lib in threadpool_info()]


def _as_json_value(value: object) -> object:
    """A threadpoolctl field as JSON: some controllers (scipy's fast_matrix_market) report a callable
    as their version; it is called, and anything else not a JSON scalar is written as text."""
    if callable(value):
        value = value()
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
