"""Local parquet reads through pandas stay in pyarrow's C++ file layer, so a process does not abort at exit.

pandas 2.x opens a local path itself (``open(path, "rb")``) and hands pyarrow the Python file
object. pyarrow reads it on its I/O threads and releases it, at the end of the scan, on one of its
CPU-pool threads, which must take the GIL to do so. That release can come after ``read_parquet``
has returned; when it comes while the interpreter is shutting down, CPython 3.11 ends the thread
with ``pthread_exit`` inside a C++ destructor and the process aborts ("terminate called without an
active exception", exit status 134) after the script's work is done. pandas 3.1 reads local paths
natively (pandas GH#47702); the stack pins pandas < 3 (anndata), so this backports that one change:
for a local file read with no filesystem given, ``pandas.io.parquet._get_path_or_handle`` returns
the path and a ``pyarrow.fs.LocalFileSystem`` — what ``pd.read_parquet(path,
filesystem=pyarrow.fs.LocalFileSystem())`` does — and pyarrow opens the file in C++. Writes,
URLs, buffers, directories and a given filesystem go through pandas unchanged.

:func:`install` imports nothing heavy (``cellpath fetch`` sets numpy's CPU dispatch before numpy
is loaded): it patches ``pandas.io.parquet`` if it is loaded, else when it is. Idempotent.
docs/decisions/0033-parquet-reads-without-exit-aborts.md has the cause and the counts.
"""

from __future__ import annotations

import os
import sys

from cellpath.io import import_hooks
from cellpath.io.import_hooks import patch_now_or_when_loaded

PANDAS_PARQUET = "pandas.io.parquet"
#: Set on the replacement function, so that a second install (or a reload) does not wrap it twice.
MARK = "__cellpath_native_local_reads__"
#: The first pandas that reads local parquet files in C++ itself: nothing to patch from there on.
FIXED_IN = (3, 1)


def install() -> None:
    """Make pandas hand pyarrow local parquet paths, not Python file objects (now, or once pandas loads)."""
    patch_now_or_when_loaded(PANDAS_PARQUET, patch)


def installed() -> bool:
    """Whether the loaded ``pandas.io.parquet`` reads local files natively (patched, or a pandas that does)."""
    module = sys.modules.get(PANDAS_PARQUET)
    return module is not None and (getattr(module._get_path_or_handle, MARK, False) or _pandas_fixed())


def patch(module) -> None:
    """Wrap ``module._get_path_or_handle`` (``module`` is ``pandas.io.parquet``), once, for pandas < 3.1."""
    original = getattr(module, "_get_path_or_handle", None)
    if original is None or getattr(original, MARK, False) or _pandas_fixed():
        return
    module._get_path_or_handle = _native_local_reads(original, module)


def _pandas_fixed() -> bool:
    from importlib import metadata  # here, not at import: it costs more than everything else in this module

    try:
        major, minor = (int(part) for part in metadata.version("pandas").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= FIXED_IN


def _native_local_reads(original, module):
    """``_get_path_or_handle`` that leaves a local file read to pyarrow's C++ layer, else calls ``original``."""

    def _get_path_or_handle(path, fs, storage_options=None, mode="rb", is_dir=False):
        if fs is None and not storage_options and mode == "rb" and not is_dir:
            local = module.stringify_path(path)  # str or os.PathLike → str, "~" expanded; a buffer stays as is
            if (isinstance(local, str) and not module.is_url(local) and not module.is_fsspec_url(local)
                    and os.path.isfile(local)):
                from pyarrow import fs as arrow_fs

                return local, None, arrow_fs.LocalFileSystem()
        return original(path, fs, storage_options=storage_options, mode=mode, is_dir=is_dir)

    setattr(_get_path_or_handle, MARK, True)
    _get_path_or_handle.__wrapped__ = original
    _get_path_or_handle.__doc__ = original.__doc__
    return _get_path_or_handle


#: The startup file ``make install`` writes into the virtual environment, so that every Python of it —
#: a user's script, a notebook kernel — reads local parquet files natively, not only cellpath's commands.
#: It does nothing where cellpath cannot be imported.
STARTUP_FILE = "cellpath_native_parquet.pth"


def write_startup_file(site_packages: str | None = None) -> str:
    """Write :data:`STARTUP_FILE` into ``site_packages`` (default: this interpreter's purelib); returns its path."""
    return import_hooks.write_startup_file(STARTUP_FILE, "native_parquet", site_packages)
