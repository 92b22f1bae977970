"""Load a script of ``benchmarks/`` (not a package) as a module, for the tests of what it computes."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from helpers.project import PROJECT_ROOT

BENCHMARKS = PROJECT_ROOT / "benchmarks"


def load_benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered in sys.modules: a dataclass looks it up)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: What a bare GPU machine lacks (benchmarks/gpu/ must run without them): the project's heavier
#: dependencies, and two codec and array packages tifffile uses where present.
GPU_MACHINE_LACKS = ("pydantic", "tiatoolbox", "spatialdata", "anndata", "faiss", "mlflow", "dvc", "open_clip",
                     "imagecodecs", "zarr")


def load_benchmark_file(relative: str, module_name: str) -> ModuleType:
    """``benchmarks/<relative>`` (a script in a subfolder, e.g. ``gpu/merge_costs.py``) as ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def blocking_prelude(blocked: tuple[str, ...] = GPU_MACHINE_LACKS) -> str:
    """Python source that makes importing any of ``blocked`` (or a submodule) raise ImportError, as on
    a machine without them: run it first in a child interpreter (``python -c``)."""
    return (
        "import sys\n"
        f"BLOCKED = {tuple(blocked)!r}\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'No module named {name!r} (blocked: not on the GPU machine)')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Absent())\n"
    )
