"""Exclusive locks between processes on one machine or a shared filesystem (``flock``, POSIX).

Two runs in one project (two ``dvc repro`` of different stages, or ``dvc queue start -j 2`` on a shared
cache) must not write the same download, work folder or tracking store at once. A lock is a small file
beside what it guards. :func:`exclusive` never waits: a second run stops at once with a
:class:`~cellpath.errors.ConcurrentRunError` naming the lock, rather than hanging behind the first.
:func:`waiting` is for short writes two runs may both make (a row of a tracking store): the second
waits its turn, and only a lock held past ``timeout_s`` stops it, named.
The lock is released when the process ends, however it ends (the kernel drops ``flock`` locks with
the descriptor), so a killed run leaves no stale lock; the file itself stays and is harmless.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from cellpath.errors import ConcurrentRunError

LOCK_SUFFIX = ".lock"
POLL_S = 0.02  # how often a waiting lock tries again


@contextlib.contextmanager
def exclusive(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created when absent) for the block; ``what`` names the work
    guarded, for the message when another process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConcurrentRunError(f"{path}: {what} is under way in another process, which holds this lock; "
                                     "wait for it to finish (or stop it) and rerun") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def waiting(path: Path, what: str, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the block, waiting up to ``timeout_s`` seconds for another
    process to release it (then :class:`~cellpath.errors.ConcurrentRunError` naming the lock)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConcurrentRunError(f"{path}: {what} waited {timeout_s:g} s for another process, which "
                                             "still holds this lock; check for a hung run and stop it") from None
                time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)
