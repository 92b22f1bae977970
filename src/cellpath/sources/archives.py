"""Extraction of untrusted zip and tar archives that cannot write outside their destination.

The whole member list is decided before a byte is written (:func:`plan_members`): a member whose
normalised path is absolute or climbs with ``..``, any link (symbolic or hard: 10x bundles are zips
without links), any device, FIFO or other special file, a name that repeats (also when only its case
differs, or when a file's name is another member's folder), more than ``max_members`` entries, or an
uncompressed total past ``max_total_bytes`` or ``max_expansion_ratio`` times the archive's size is
refused with the member named. The members are then written into a fresh private staging folder
(``tempfile.mkdtemp``, mode 0700, that only this user can enter) through directory file descriptors with ``O_NOFOLLOW`` and
``O_EXCL``, so no write follows a link and none replaces an existing file; the folder is renamed
into place when every member is in, and removed otherwise. Modes, owners and times in the archive
are ignored (files get 0666 and folders 0777, less the umask), as tarfile's ``data`` filter does.

The archive's format is the one its file name says (:func:`archive_format`), and its first bytes
must agree: an HTML page saved under a ``.zip`` name is not opened as a tar. A truncated or corrupt
archive is a :class:`DownloadError` naming it. Sizes are in bytes.

Written by hand rather than with ``tarfile``'s ``filter="data"``: that filter still extracts links
that stay inside the destination and applies to tar only, and ``zipfile`` has no equivalent.
"""

from __future__ import annotations

import bz2
import contextlib
import lzma
import os
import stat
import tarfile
import tempfile
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from cellpath.errors import DownloadError
from cellpath.io.atomic import atomic_output, remove_path

CHUNK_BYTES = 1024 * 1024
DEFAULT_MAX_EXTRACT_BYTES = 1024**4
#: Entries (files and folders) an archive may hold: a Xenium bundle has about 100; an archive of
#: millions of empty files exhausts inodes without passing any size cap.
DEFAULT_MAX_MEMBERS = 200_000
#: Uncompressed bytes per byte of archive: a Xenium bundle's members are compressed already (zarr,
#: OME-TIFF, gzip), about 1–3; deflate cannot pass 1,032 without overlapping members (a zip bomb).
DEFAULT_MAX_EXPANSION_RATIO = 200.0
#: The formats :func:`archive_format` knows, by file-name ending, with ``tarfile``'s read modes.
ARCHIVE_SUFFIXES = {".zip": "zip", ".tar": "r:", ".tar.gz": "r:gz", ".tgz": "r:gz", ".tar.bz2": "r:bz2",
                    ".tbz2": "r:bz2", ".tar.xz": "r:xz", ".txz": "r:xz"}
#: The first bytes each format starts with (a plain tar has no fixed start; its header is checked by tarfile).
_MAGIC = {"zip": (b"PK\x03\x04", b"PK\x05\x06"), "r:gz": (b"\x1f\x8b",), "r:bz2": (b"BZh",),
          "r:xz": (b"\xfd7zXZ\x00",)}
#: What reading a damaged archive raises, by library: zipfile, zlib, gzip, bz2 (an OSError), lzma, tarfile.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, lzma.LZMAError, tarfile.TarError, OSError, ValueError)
_OPEN_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_OPEN_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class _CorruptArchive(Exception):
    """Reading the archive failed (truncated, bad CRC, bad compressed stream): not a write failure."""


@dataclass(frozen=True)
class Member:
    """One entry to extract: its normalised relative path, whether it is a folder, its declared size."""

    path: PurePosixPath
    is_folder: bool
    size: int
    name: str  # as stored in the archive, for messages
    entry: zipfile.ZipInfo | tarfile.TarInfo


def archive_format(name: str) -> str | None:
    """``"zip"`` or a ``tarfile`` read mode (``"r:gz"``, ...) from a file name's ending; None when unknown."""
    lower = name.lower()
    for suffix in sorted(ARCHIVE_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return ARCHIVE_SUFFIXES[suffix]
    return None


def safe_extract(archive: Path, dest: Path, *, archive_name: str | None = None,
                 max_total_bytes: int = DEFAULT_MAX_EXTRACT_BYTES, max_members: int = DEFAULT_MAX_MEMBERS,
                 max_expansion_ratio: float = DEFAULT_MAX_EXPANSION_RATIO) -> list[Path]:
    """Extract the zip or tar ``archive`` into ``dest`` (complete, or untouched); return the files written.

    ``archive_name`` (default: the archive's own file name) gives the format by its ending. When all
    members sit under one top-level folder (e.g. ``outs/``), its contents become ``dest``. Raises
    :class:`DownloadError` naming the archive and member for anything the module docstring refuses.
    """
    archive, dest = Path(archive), Path(dest)
    fmt = archive_format(archive_name or archive.name)
    if fmt is None:
        raise DownloadError(f"{archive}: {archive_name or archive.name!r} is not named as a zip or tar archive "
                            f"({', '.join(ARCHIVE_SUFFIXES)}); check the bundle URL in the manifest")
    _check_magic(archive, fmt)
    try:
        with _open(archive, fmt) as (entries, read):
            members = plan_members(archive, entries(), max_members=max_members)
            budget = _byte_budget(archive, members, max_total_bytes, max_expansion_ratio)
            with atomic_output(dest) as out:
                staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.extract-", dir=out.parent))
                try:
                    tree = staging / "tree"  # the private folder's only entry, with the umask's mode
                    tree.mkdir()
                    written = _write_members(archive, tree, members, read, budget)
                    top = _single_top_folder(tree, members)
                    (tree / top if top else tree).rename(out)
                finally:
                    remove_path(staging)
    except _CorruptArchive as exc:
        raise DownloadError(f"{archive}: the archive is truncated or corrupt ({exc}); nothing was extracted — "
                            "download it again") from None
    if top is None:
        return [dest / rel for rel in written]
    return [dest / PurePosixPath(*rel.parts[1:]) for rel in written]


def _check_magic(archive: Path, fmt: str) -> None:
    with archive.open("rb") as fh:
        head = fh.read(64)
    if fmt in _MAGIC and not head.startswith(_MAGIC[fmt]):
        kind = "zip" if fmt == "zip" else f"tar ({fmt.removeprefix('r:') or 'uncompressed'})"
        shown = "an HTML page" if head.lstrip().lower().startswith((b"<!doctype", b"<html", b"<?xml")) else repr(head[:8])
        raise DownloadError(f"{archive}: named as a {kind} archive but it starts with {shown}; it is not one — "
                            "check the bundle URL in the manifest (a sign-in or error page?)")


Reader = Callable[[Member], IO[bytes]]


@contextlib.contextmanager
def _open(archive: Path, fmt: str) -> Iterator[tuple[Callable[[], list], Reader]]:
    """(a function listing the archive's entries, a function opening one member's bytes)."""
    try:
        handle = zipfile.ZipFile(archive) if fmt == "zip" else tarfile.open(archive, fmt)
    except _READ_ERRORS as exc:
        raise _CorruptArchive(f"cannot open it: {exc}") from exc
    with handle:
        if isinstance(handle, zipfile.ZipFile):
            yield handle.infolist, lambda member: handle.open(member.entry)
        else:
            yield _listed(handle.getmembers), lambda member: handle.extractfile(member.entry)


def _listed(getmembers: Callable[[], list]) -> Callable[[], list]:
    def entries() -> list:
        try:
            return getmembers()
        except _READ_ERRORS as exc:
            raise _CorruptArchive(f"cannot list its members: {exc}") from exc
    return entries


def _normalised(archive: Path, name: str) -> PurePosixPath | None:
    """A member name as a relative path (None for the archive's root); refuse absolute paths and ``..``."""
    if "\0" in name:
        raise DownloadError(f"{archive}: member {name!r} has a NUL byte in its name; refusing to extract")
    unified = name.replace("\\", "/")
    parts = [p for p in unified.split("/") if p not in ("", ".")]
    if unified.startswith("/") or (parts and len(parts[0]) == 2 and parts[0][1] == ":"):
        raise DownloadError(f"{archive}: member {name!r} has an absolute path; refusing to extract")
    if ".." in parts:
        raise DownloadError(f"{archive}: member {name!r} contains '..'; refusing to extract")
    return PurePosixPath(*parts) if parts else None


def _kind(archive: Path, entry: zipfile.ZipInfo | tarfile.TarInfo) -> bool:
    """Whether the entry is a folder (else a regular file); refuse links and special files."""
    if isinstance(entry, zipfile.ZipInfo):
        name, mode = entry.filename, entry.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise DownloadError(f"{archive}: member {name!r} is a symbolic link; refusing to extract "
                                "(a 10x bundle has no links)")
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise DownloadError(f"{archive}: member {name!r} is a device or special file; refusing to extract")
        return entry.is_dir()
    if entry.issym() or entry.islnk():
        what = "symbolic" if entry.issym() else "hard"
        raise DownloadError(f"{archive}: member {entry.name!r} is a {what} link (to {entry.linkname!r}); refusing "
                            "to extract (a 10x bundle has no links)")
    if not (entry.isfile() or entry.isdir()):
        raise DownloadError(f"{archive}: member {entry.name!r} is a device or special file; refusing to extract")
    return entry.isdir()


def plan_members(archive: Path, entries: list, *, max_members: int = DEFAULT_MAX_MEMBERS) -> list[Member]:
    """Every entry checked, before anything is written; raise DownloadError on the first refused one."""
    if len(entries) > max_members:
        raise DownloadError(f"{archive}: {len(entries)} members, above the bound of {max_members}; refusing to "
                            "extract (a Xenium bundle has about a hundred)")
    members: list[Member] = []
    seen: dict[str, Member] = {}
    for entry in entries:
        # zipfile cuts a name at a NUL byte; orig_filename keeps what the archive holds
        name = entry.orig_filename if isinstance(entry, zipfile.ZipInfo) else entry.name
        is_folder = _kind(archive, entry)
        path = _normalised(archive, name)
        if path is None:
            if not is_folder:
                raise DownloadError(f"{archive}: member {name!r} is a file without a name; refusing to extract")
            continue
        size = entry.file_size if isinstance(entry, zipfile.ZipInfo) else entry.size
        member = Member(path=path, is_folder=is_folder, size=0 if is_folder else size, name=name, entry=entry)
        key = _folded(path)
        if key in seen:
            raise DownloadError(f"{archive}: member {name!r} repeats {seen[key].name!r} (the same name, or one "
                                "that differs only in case); refusing to extract")
        seen[key] = member
        members.append(member)
    for member in members:
        for parent in member.path.parents[:-1]:
            above = seen.get(_folded(parent))
            if above is not None and not above.is_folder:
                raise DownloadError(f"{archive}: member {member.name!r} is inside {above.name!r}, which is a file; "
                                    "refusing to extract")
    return members


def _folded(path: PurePosixPath) -> str:
    """The key two names collide under on a case-insensitive, normalising filesystem (macOS, Windows)."""
    return unicodedata.normalize("NFC", str(path)).casefold()


def _byte_budget(archive: Path, members: list[Member], max_total_bytes: int, max_expansion_ratio: float) -> int:
    """The uncompressed bytes the members may write in total, after checking what they declare."""
    declared = sum(m.size for m in members)
    if declared > max_total_bytes:
        raise DownloadError(f"{archive}: {declared} bytes uncompressed, above the cap of {max_total_bytes} bytes; "
                            "refusing to extract (raise tenx.max_file_bytes in params.yaml if the archive is genuine)")
    ratio_cap = int(max_expansion_ratio * max(archive.stat().st_size, 1))
    if declared > ratio_cap:
        raise DownloadError(f"{archive}: {declared} bytes uncompressed from {archive.stat().st_size} bytes, more than "
                            f"{max_expansion_ratio:g} times the archive; refusing to extract (an archive bomb?)")
    return min(max_total_bytes, ratio_cap)


def _write_members(archive: Path, root: Path, members: list[Member], read: Reader, budget: int) -> list[PurePosixPath]:
    """Write ``members`` under ``root`` (a fresh private folder), never following a link; the files written."""
    written: list[PurePosixPath] = []
    root_fd = os.open(root, _OPEN_FOLDER)
    try:
        for member in members:
            folder_fd = _folder(root_fd, member.path.parts if member.is_folder else member.path.parts[:-1])
            try:
                if member.is_folder:
                    continue
                budget -= _write_file(archive, folder_fd, member, read, budget)
                written.append(member.path)
            finally:
                os.close(folder_fd)
    finally:
        os.close(root_fd)
    return written


def _folder(root_fd: int, parts: tuple[str, ...]) -> int:
    """An open descriptor of ``root/parts…``, each folder created (or entered) without following a link."""
    fd = os.dup(root_fd)
    for part in parts:
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o777, dir_fd=fd)
        try:
            inner = os.open(part, _OPEN_FOLDER, dir_fd=fd)
        finally:
            os.close(fd)
        fd = inner
    return fd


def _write_file(archive: Path, folder_fd: int, member: Member, read: Reader, budget: int) -> int:
    """Copy one member into a new file in ``folder_fd``; return its bytes, refusing more than ``budget``."""
    fd = os.open(member.path.name, _OPEN_FILE, 0o666, dir_fd=folder_fd)
    written = 0
    with os.fdopen(fd, "wb") as out:
        try:
            source = read(member)
        except _READ_ERRORS as exc:
            raise _CorruptArchive(f"member {member.name!r}: {exc}") from exc
        with source:
            while True:
                try:
                    chunk = source.read(CHUNK_BYTES)
                except _READ_ERRORS as exc:
                    raise _CorruptArchive(f"member {member.name!r}: {exc}") from exc
                if not chunk:
                    break
                written += len(chunk)
                if written > budget or written > member.size:
                    raise DownloadError(f"{archive}: member {member.name!r} inflates past its declared size or the "
                                        "archive's cap; refusing to extract")
                out.write(chunk)
    if written != member.size:
        raise _CorruptArchive(f"member {member.name!r}: {written} of its {member.size} bytes")
    return written


def _single_top_folder(root: Path, members: list[Member]) -> str | None:
    """The one top-level folder every member sits under (to flatten into the destination), else None."""
    tops = {m.path.parts[0] for m in members}
    if len(tops) != 1:
        return None
    (top,) = tops
    return top if (root / top).is_dir() and not (root / top).is_symlink() else None

