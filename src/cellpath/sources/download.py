"""Resumable, verified downloads and safe archive extraction (standard library only).

``download_file`` streams to ``<dest>.part``, resumes it with an HTTP ``Range`` request, retries
transient failures with exponential backoff, and renames the partial file to ``dest`` only once
its size, MD5 and SHA-256 match (each where given). ``safe_extract`` unpacks a zip or tar archive
atomically, refusing members that would land outside the destination. Sizes are in bytes, times in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import stat
import tarfile
import time
import urllib.error
import urllib.request
import urllib.response
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

from cellpath.errors import DownloadError
from cellpath.io.atomic import atomic_output, remove_path

CHUNK_BYTES = 1024 * 1024
SUPPORTED_SCHEMES = ("http", "https", "file")
TRANSIENT_HTTP_CODES = frozenset({408, 425, 429})
DEFAULT_MAX_EXTRACT_BYTES = 1024**4


class RemoteNotFound(DownloadError):
    """The server answered 404 or 410 (or a ``file://`` URL names no file): the URL names nothing."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


class _TransientError(Exception):
    """A failure worth retrying: connection trouble, a 5xx answer or a truncated body."""


class _Progress(Protocol):
    def update(self, n: int) -> object: ...

    def reset(self, total: int | None = None) -> object: ...


class _NoProgress:
    def update(self, n: int) -> None:
        return None

    def reset(self, total: int | None = None) -> None:
        return None


def part_path(dest: Path) -> Path:
    """The partial file a download of ``dest`` is streamed to before it is verified."""
    return dest.with_name(dest.name + ".part")


def file_digests(path: Path, algorithms: tuple[str, ...]) -> dict[str, str]:
    """Lower-case hex digests (``hashlib`` names, e.g. md5, sha256) of a file, read once in 1 MiB chunks."""
    digests = {name: hashlib.new(name) for name in algorithms}
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK_BYTES), b""):
            for digest in digests.values():
                digest.update(chunk)
    return {name: digest.hexdigest() for name, digest in digests.items()}


def _expected_sums(md5: str | None, sha256: str | None) -> dict[str, str]:
    """The digests to check, algorithm → lower-case hex, the empty ones left out."""
    return {name: value.lower() for name, value in (("md5", md5), ("sha256", sha256)) if value}


def download_file(
    url: str,
    dest: Path,
    *,
    sha256: str | None = None,
    size: int | None = None,
    md5: str | None = None,
    retries: int,
    timeout_s: float,
    max_bytes: int,
    progress: bool = False,
    backoff_s: float = 1.0,
) -> Path:
    """Download ``url`` to ``dest`` and return ``dest``.

    ``size`` (bytes), ``md5`` and ``sha256`` (hex) are checked when given; an existing ``dest`` that
    matches them is kept without any request. ``retries`` extra attempts follow a transient failure
    after ``backoff_s * 2**attempt`` seconds; ``timeout_s`` bounds each connect and read. More than
    ``max_bytes`` (or more than ``size``) is refused. On a mismatch the partial file is deleted and
    :class:`DownloadError` raised; after the last failed retry it is kept so that a rerun resumes.
    A 404 or 410 answer raises :class:`RemoteNotFound`.
    """
    dest = Path(dest)
    sums = _expected_sums(md5, sha256)
    if _is_complete(dest, sums=sums, size=size):
        return dest
    _check_request(url, dest, size=size, max_bytes=max_bytes)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = part_path(dest)
    limit, limit_reason = _byte_limit(size, max_bytes)
    with _progress_bar(progress, dest.name, size) as bar:
        for attempt in range(retries + 1):
            try:
                _fetch_once(url, part, size=size, limit=limit, limit_reason=limit_reason,
                            timeout_s=timeout_s, bar=bar)
                break
            except _TransientError as exc:
                failure = exc
            except DownloadError:
                part.unlink(missing_ok=True)
                raise
            if attempt < retries:
                time.sleep(backoff_s * 2**attempt)
        else:
            raise DownloadError(
                f"{url}: download to {dest} failed after {retries + 1} attempt(s): {failure}; "
                f"the partial file {part} is kept and the next run resumes it"
            )
    _verify(part, url=url, dest=dest, sums=sums, size=size)
    os.replace(part, dest)
    return dest


def _is_complete(dest: Path, *, sums: dict[str, str], size: int | None) -> bool:
    if not dest.is_file():
        return False
    if size is not None and dest.stat().st_size != size:
        return False
    return not sums or file_digests(dest, tuple(sums)) == sums


def _check_request(url: str, dest: Path, *, size: int | None, max_bytes: int) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in SUPPORTED_SCHEMES:
        raise DownloadError(
            f"{url}: unsupported URL scheme {parsed.scheme!r} for {dest}; "
            f"use one of {', '.join(SUPPORTED_SCHEMES)}"
        )
    if parsed.scheme == "file" and not Path(url2pathname(parsed.path)).is_file():
        raise RemoteNotFound(f"{url}: no such local file (wanted for {dest}); check the path", url)
    if size is not None and size > max_bytes:
        raise DownloadError(
            f"{url}: expected size {size} bytes for {dest} is above the cap of {max_bytes} bytes; "
            "raise the cap (tenx.max_file_bytes in params.yaml) if the file is genuine"
        )


def _byte_limit(size: int | None, max_bytes: int) -> tuple[int, str]:
    if size is not None and size <= max_bytes:
        return size, f"the expected size of {size} bytes"
    return max_bytes, f"the cap of {max_bytes} bytes (tenx.max_file_bytes in params.yaml)"


@contextlib.contextmanager
def _progress_bar(enabled: bool, label: str, total: int | None) -> Iterator[_Progress]:
    if not enabled:
        yield _NoProgress()
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024) as bar:
        yield bar


def _fetch_once(url: str, part: Path, *, size: int | None, limit: int, limit_reason: str,
                timeout_s: float, bar: _Progress) -> None:
    """One request: append to (or restart) ``part``; raise _TransientError when worth retrying."""
    offset = part.stat().st_size if part.exists() else 0
    if size is not None and offset > size:
        part.unlink()
        offset = 0
    if size is not None and part.exists() and offset == size:
        return
    headers = {"User-Agent": "cellpath", "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        _handle_http_error(exc, url, part, offset)
        return
    except (OSError, http.client.HTTPException) as exc:
        raise _TransientError(f"cannot connect: {exc}") from exc
    with response:
        start, length = _response_span(response, url, part, offset, size=size, limit=limit,
                                       limit_reason=limit_reason)
        bar.reset(total=size)
        bar.update(start)
        with part.open("ab" if start else "wb") as fh:
            received = _stream(response, fh, start=start, limit=limit, bar=bar,
                               too_much=f"{url}: more data than {limit_reason} for {part}; "
                                        "the partial file was deleted — check the URL")
    if length is not None and received < length:
        raise _TransientError(f"body truncated after {received} of {length} bytes")
    if size is not None and start + received < size:
        raise _TransientError(f"body ended at {start + received} of {size} bytes")


def _handle_http_error(exc: urllib.error.HTTPError, url: str, part: Path, offset: int) -> None:
    """Return when a 416 says ``part`` is already complete; otherwise raise."""
    code, reason = exc.code, exc.reason
    content_range = exc.headers.get("Content-Range") if exc.headers else None
    exc.close()
    if code == 416:
        _, total = _parse_content_range(content_range)
        if offset and total == offset:
            return
        part.unlink(missing_ok=True)
        raise _TransientError(f"HTTP 416 for range bytes={offset}-; restarting from zero")
    if code >= 500 or code in TRANSIENT_HTTP_CODES:
        raise _TransientError(f"HTTP {code} {reason}")
    if code in (404, 410):
        raise RemoteNotFound(f"{url}: HTTP {code} {reason} (wanted for {part.with_suffix('')}); the server has "
                             "no file at this URL — check the URL", url)
    raise DownloadError(
        f"{url}: HTTP {code} {reason} (wanted for {part.with_suffix('')}); check the URL — "
        "download links on 10x dataset pages can change"
    )


def _response_span(response: http.client.HTTPResponse | urllib.response.addinfourl, url: str, part: Path,
                   offset: int, *, size: int | None, limit: int, limit_reason: str) -> tuple[int, int | None]:
    """(byte offset the body starts at, body length or None) after checking the announced size."""
    status = response.status or 200  # file:// answers have no status and ignore Range
    length = _int_or_none(response.headers.get("Content-Length"))
    if status == 206:
        start, total = _parse_content_range(response.headers.get("Content-Range"))
        if start != offset:
            part.unlink(missing_ok=True)
            raise _TransientError(f"server sent a range from byte {start}, not {offset}; restarting")
    else:
        start, total = 0, length
    if total is not None and size is not None and total != size:
        raise DownloadError(
            f"{url}: the server reports {total} bytes, expected {size}; the file behind the URL "
            "is not the one the manifest describes — check the URL and the expected size"
        )
    if total is not None and total > limit:
        raise DownloadError(f"{url}: the server reports {total} bytes, above {limit_reason}")
    return start, length


def _stream(response: IO[bytes], fh: IO[bytes], *, start: int, limit: int, bar: _Progress,
            too_much: str) -> int:
    """Copy the body to ``fh``; return the bytes received. Refuse to pass ``limit`` in total."""
    received = 0
    while True:
        try:
            chunk = response.read(CHUNK_BYTES)
        except (OSError, http.client.HTTPException) as exc:
            raise _TransientError(f"connection lost after {start + received} bytes: {exc}") from exc
        if not chunk:
            return received
        if start + received + len(chunk) > limit:
            raise DownloadError(too_much)
        fh.write(chunk)
        received += len(chunk)
        bar.update(len(chunk))


def _parse_content_range(value: str | None) -> tuple[int | None, int | None]:
    """``bytes 100-199/200`` → (100, 200); ``bytes */200`` → (None, 200); unknown parts → None."""
    if not value or not value.startswith("bytes "):
        return None, None
    span, _, total = value[len("bytes "):].partition("/")
    start = _int_or_none(span.partition("-")[0]) if span != "*" else None
    return start, _int_or_none(total)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def _verify(part: Path, *, url: str, dest: Path, sums: dict[str, str], size: int | None) -> None:
    """Delete ``part`` and raise DownloadError unless its size and digests (``sums``: md5, sha256) are as
    expected."""
    actual_size = part.stat().st_size
    if size is not None and actual_size != size:
        part.unlink()
        raise DownloadError(
            f"{url}: {dest}: expected {size} bytes, got {actual_size}; the download was deleted — "
            "check the URL and the expected size"
        )
    if not sums:
        return
    actual = file_digests(part, tuple(sums))
    wrong = [name for name in sums if actual[name] != sums[name]]
    if wrong:
        part.unlink()
        found = "; ".join(f"expected {name} {sums[name]}, got {actual[name]}" for name in wrong)
        raise DownloadError(
            f"{url}: {dest}: {found}; the download was deleted — check the URL and the expected checksum"
        )


def safe_extract(archive: Path, dest: Path, *, max_total_bytes: int = DEFAULT_MAX_EXTRACT_BYTES) -> list[Path]:
    """Extract a zip or tar(.gz/.bz2/.xz) archive into ``dest``; return the files written.

    Members with absolute paths or ``..``, device files, zip symlinks and tar links leading
    outside ``dest`` are refused, as is more than ``max_total_bytes`` uncompressed. Everything is
    unpacked beside ``dest`` and renamed into place, so ``dest`` ends up complete or untouched.
    When all members sit under one top-level folder (e.g. ``outs/``) its contents become ``dest``.
    """
    archive, dest = Path(archive), Path(dest)
    with atomic_output(dest) as out:
        staging = out.with_name(out.name + ".extract")
        try:
            staging.mkdir()
            written = _extract_members(archive, staging, max_total_bytes)
            top = _single_top_folder(staging)
            (top or staging).rename(out)
        finally:
            remove_path(staging)
    if top is None:
        return [dest / rel for rel in written]
    return [dest / PurePosixPath(*rel.parts[1:]) for rel in written]


def _extract_members(archive: Path, root: Path, max_total_bytes: int) -> list[PurePosixPath]:
    if zipfile.is_zipfile(archive):
        return _extract_zip(archive, root, max_total_bytes)
    if tarfile.is_tarfile(archive):
        return _extract_tar(archive, root, max_total_bytes)
    raise DownloadError(f"{archive}: not a zip or tar archive; check the bundle URL in the manifest")


def _member_path(archive: Path, name: str) -> PurePosixPath | None:
    """The member's relative path, None for the archive root; refuse absolute paths and ``..``."""
    unified = name.replace("\\", "/")
    parts = [p for p in unified.split("/") if p not in ("", ".")]
    if unified.startswith("/") or (parts and len(parts[0]) == 2 and parts[0][1] == ":"):
        raise DownloadError(f"{archive}: member {name!r} has an absolute path; refusing to extract")
    if ".." in parts:
        raise DownloadError(f"{archive}: member {name!r} contains '..'; refusing to extract")
    return PurePosixPath(*parts) if parts else None


def _target(archive: Path, root: Path, rel: PurePosixPath, name: str) -> Path:
    """``root / rel`` after checking its folder does not lead outside ``root`` via a link."""
    target = root / rel
    if not target.parent.resolve().is_relative_to(root.resolve()):
        raise DownloadError(f"{archive}: member {name!r} leads outside the destination; refusing to extract")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def _check_total(archive: Path, declared: int, max_total_bytes: int) -> None:
    if declared > max_total_bytes:
        raise DownloadError(
            f"{archive}: {declared} bytes uncompressed, above the cap of {max_total_bytes} bytes; "
            "refusing to extract (raise tenx.max_file_bytes in params.yaml if the archive is genuine)"
        )


def _copy_capped(src: IO[bytes], target: Path, budget: int, archive: Path, name: str) -> int:
    """Copy ``src`` to ``target``; return the bytes written, refusing more than ``budget``."""
    written = 0
    with target.open("wb") as fh:
        for chunk in iter(lambda: src.read(CHUNK_BYTES), b""):
            written += len(chunk)
            if written > budget:
                raise DownloadError(f"{archive}: member {name!r} inflates past the size cap; refusing to extract")
            fh.write(chunk)
    return written


def _extract_zip(archive: Path, root: Path, max_total_bytes: int) -> list[PurePosixPath]:
    written: list[PurePosixPath] = []
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        for info in infos:
            _member_path(archive, info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise DownloadError(f"{archive}: member {info.filename!r} is a symlink; refusing to extract")
        _check_total(archive, sum(i.file_size for i in infos), max_total_bytes)
        budget = max_total_bytes
        for info in infos:
            rel = _member_path(archive, info.filename)
            if rel is None:
                continue
            if info.is_dir():
                _target(archive, root, rel, info.filename).mkdir(exist_ok=True)
                continue
            with zf.open(info) as src:
                budget -= _copy_capped(src, _target(archive, root, rel, info.filename), budget,
                                       archive, info.filename)
            written.append(rel)
    return written


def _check_tar_member(archive: Path, member: tarfile.TarInfo) -> PurePosixPath | None:
    rel = _member_path(archive, member.name)
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise DownloadError(f"{archive}: member {member.name!r} is a device or special file; refusing to extract")
    if member.issym() or member.islnk():
        base = rel.parent if member.issym() and rel is not None else PurePosixPath()
        link = PurePosixPath(member.linkname.replace("\\", "/"))
        resolved = os.path.normpath(base / link)
        if link.is_absolute() or resolved == ".." or resolved.startswith("../"):
            raise DownloadError(
                f"{archive}: member {member.name!r} links to {member.linkname!r}, outside the "
                "destination; refusing to extract"
            )
    return rel


def _extract_tar(archive: Path, root: Path, max_total_bytes: int) -> list[PurePosixPath]:
    written: list[PurePosixPath] = []
    with tarfile.open(archive, "r:*") as tf:
        members = tf.getmembers()
        checked = [(m, _check_tar_member(archive, m)) for m in members]
        _check_total(archive, sum(m.size for m in members if m.isfile()), max_total_bytes)
        budget = max_total_bytes
        for member, rel in checked:
            if rel is None:
                continue
            target = _target(archive, root, rel, member.name)
            if member.isdir():
                target.mkdir(exist_ok=True)
                continue
            if member.issym():
                os.symlink(member.linkname, target)
            elif member.islnk():
                _hardlink(archive, root, member, target)
            else:
                with tf.extractfile(member) as src:
                    budget -= _copy_capped(src, target, budget, archive, member.name)
            written.append(rel)
    _check_links_inside(archive, root, written)
    return written


def _hardlink(archive: Path, root: Path, member: tarfile.TarInfo, target: Path) -> None:
    """Link ``target`` to the already extracted file that ``member.linkname`` names."""
    source = root / (_member_path(archive, member.linkname) or PurePosixPath())
    if source.is_symlink() or not source.is_file():
        raise DownloadError(
            f"{archive}: member {member.name!r} hard-links to {member.linkname!r}, which is not a "
            "regular file extracted before it; refusing to extract"
        )
    os.link(source, target, follow_symlinks=False)


def _check_links_inside(archive: Path, root: Path, written: list[PurePosixPath]) -> None:
    """Refuse symlinks that, once all are in place, resolve outside ``root`` (e.g. via chains)."""
    inside = root.resolve()
    for rel in written:
        path = root / rel
        if path.is_symlink() and not path.resolve().is_relative_to(inside):
            raise DownloadError(
                f"{archive}: member {str(rel)!r} links to {os.readlink(path)!r}, which resolves "
                "outside the destination; refusing to extract"
            )


def _single_top_folder(root: Path) -> Path | None:
    """The only entry of ``root`` when it is a real folder (to flatten), else None."""
    entries = list(root.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return None
