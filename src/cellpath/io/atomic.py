"""Atomic writes: build every output under a temporary name in the same folder, then rename.

A crash or an error half-way leaves the previous output (or nothing) in place, never a partial one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from cellpath.errors import OutputError

_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # disk full, quota exceeded


def _temporary_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_path(path: Path) -> None:
    """Remove a file, link or directory tree if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


@contextlib.contextmanager
def atomic_output(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path to write a file or a folder to; on success rename it to ``path``.

    On an exception the temporary path is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(path)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"{tmp}: nothing was written for {path}")
        if path.is_dir() and not path.is_symlink():
            old = _temporary_sibling(path)
            path.rename(old)
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)  # put the previous output back
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except OSError as exc:
        remove_path(tmp)
        if exc.errno in _NO_SPACE:  # nested writes: the outermost (the output a user knows) is named
            raise OutputError(exc.errno, f"{os.strerror(exc.errno)} while writing {path.name}; the partial output "
                              "was removed and any previous one is unchanged: free space and rerun",
                              str(path)) from exc
        raise
    except BaseException:
        remove_path(tmp)
        raise


def remove_stale_temporaries(folder: Path) -> int:
    """Delete leftovers of interrupted atomic writes in ``folder``; return how many were removed."""
    if not folder.is_dir():
        return 0
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]
    for p in stale:
        remove_path(p)
    return len(stale)


def prune_other_folders(folder: Path, keep: set[str]) -> list[str]:
    """Delete the sub-folders of ``folder`` not named in ``keep`` (hidden ones aside); their sorted names.

    For outputs that persist across DVC runs so that finished parts survive an interruption: parts
    that the current parameters no longer ask for must not survive.
    """
    if not folder.is_dir():
        return []
    stale = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
                   and p.name not in keep)
    for name in stale:
        remove_path(folder / name)
    return stale
