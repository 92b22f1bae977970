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
