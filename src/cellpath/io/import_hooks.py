"""Patches of third-party modules applied when they are imported, and the startup files that install them.

Two libraries of the stack need a change the project cannot make upstream: pandas' local parquet reads
(:mod:`cellpath.io.native_parquet`) and DVC's SSH remote (:mod:`cellpath.io.ssh_remote`). Each is
patched by a function the patched module is handed to, once, as soon as it is loaded: by
:func:`patch_now_or_when_loaded`, which imports nothing itself (the patched library costs nothing
where it is never used). A ``.pth`` startup file in the virtual environment, written by
``make install`` (:func:`write_startup_file`), installs a patch in every Python of the environment —
a ``dvc push`` as much as a cellpath command; where cellpath cannot be imported it does nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def patch_now_or_when_loaded(fullname: str, patch: Callable[[ModuleType], None]) -> None:
    """Apply ``patch`` to module ``fullname`` now if it is loaded, else right after it is. Idempotent
    as long as ``patch`` is."""
    module = sys.modules.get(fullname)
    if module is not None:
        patch(module)
    elif not any(isinstance(finder, PatchWhenLoaded) and finder.fullname == fullname for finder in sys.meta_path):
        sys.meta_path.insert(0, PatchWhenLoaded(fullname, patch))


class PatchWhenLoaded:
    """A ``sys.meta_path`` finder that lets the other finders load ``fullname``, patches it, then leaves."""

    def __init__(self, fullname: str, patch: Callable[[ModuleType], None]):
        self.fullname, self.patch = fullname, patch

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != self.fullname:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.patch(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_module
        return spec


def startup_line(module: str) -> str:
    """The line of a ``.pth`` file that calls ``cellpath.io.<module>.install()`` when cellpath is importable."""
    return (f'import sys; exec("try:\\n    from cellpath.io import {module}\\nexcept ImportError:\\n    pass'
            f'\\nelse:\\n    {module}.install()")\n')


def write_startup_file(file_name: str, module: str, site_packages: str | None = None) -> str:
    """Write the startup file ``file_name`` for ``cellpath.io.<module>`` into ``site_packages`` (default:
    this interpreter's purelib); return its path."""
    import sysconfig

    path = Path(site_packages or sysconfig.get_paths()["purelib"]) / file_name
    path.write_text(startup_line(module))
    return str(path)
