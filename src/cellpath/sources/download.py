"""Resumable, verified downloads, cached by URL (standard library only).

``download_file`` streams to ``<dest>.part`` and renames it to ``dest`` only once its size, MD5 and
SHA-256 match (each where given); it returns the file's size and digests so that a caller can record
them (trust on first use, :mod:`cellpath.sources.lock`). Sizes are in bytes, times in seconds.

- **The cache follows the URL.** ``<dest>.source.json`` records the URL a cached file or partial came
  from and the server's ``ETag`` and ``Last-Modified``. A different URL discards both. A complete
  file is kept when it matches the expected size and digests, or, with none given, when the server
  answers a conditional request with 304; otherwise it is downloaded again.
- **Resumes cannot splice two files.** A partial file is resumed with ``Range`` and ``If-Range``
  (a strong ETag, else Last-Modified), so a server whose file changed sends the whole new one; a
  partial with neither validator nor expected digest starts over.
- **Redirects stay on https.** A redirect from https to anything else (or to a scheme other than
  http/https) is refused.
- **One download of a file at a time.** ``<dest>.lock`` is held while it runs (:mod:`cellpath.io.locks`).
- Transient failures (connection trouble, 5xx, 408/425/429, a truncated body) are retried with
  exponential backoff; more than ``max_bytes`` is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import time
import urllib.error
import urllib.request
import urllib.response
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

from cellpath.errors import DownloadError
from cellpath.io.atomic import atomic_output
from cellpath.io.locks import LOCK_SUFFIX, exclusive

CHUNK_BYTES = 1024 * 1024
SUPPORTED_SCHEMES = ("http", "https", "file")
TRANSIENT_HTTP_CODES = frozenset({408, 425, 429})
ORIGIN_SUFFIX = ".source.json"
DIGESTS = ("md5", "sha256")


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


@dataclass(frozen=True)
class Downloaded:
    """A verified file: where it is, its size (bytes) and lower-case hex MD5 and SHA-256."""

    path: Path
    size: int
    md5: str
    sha256: str


@dataclass(frozen=True)
class Origin:
    """Where a cached file or partial came from: its URL and the server's validators, when it sent them."""

    url: str
    etag: str | None = None
    last_modified: str | None = None

    @property
    def if_range(self) -> str | None:
        """The validator a resume may send in ``If-Range``: a strong ETag, else Last-Modified."""
        if self.etag and not self.etag.startswith("W/"):
            return self.etag
        return self.last_modified


class _HttpsOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only, and never from https to anything but https."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        old, new = urlparse(req.full_url).scheme, urlparse(newurl).scheme
        if new not in ("http", "https") or (old == "https" and new != "https"):
            raise DownloadError(f"{req.full_url}: the server redirects to {newurl}, which leaves https; refusing "
                                "to follow (a download that starts on https stays on it) — check the URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpsOnlyRedirects)


def part_path(dest: Path) -> Path:
    """The partial file a download of ``dest`` is streamed to before it is verified."""
    return dest.with_name(dest.name + ".part")


def origin_path(dest: Path) -> Path:
    """The record of the URL (and validators) that ``dest`` and its partial file come from."""
    return dest.with_name(dest.name + ORIGIN_SUFFIX)


def file_digests(path: Path, algorithms: tuple[str, ...] = DIGESTS) -> dict[str, str]:
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
) -> Downloaded:
    """Download ``url`` to ``dest`` (see the module docstring) and return the verified file.

    ``size`` (bytes), ``md5`` and ``sha256`` (hex) are checked when given. ``retries`` extra attempts
    follow a transient failure after ``backoff_s * 2**attempt`` seconds; ``timeout_s`` bounds each
    connect and read. More than ``max_bytes`` (or more than ``size``) is refused. On a mismatch the
    partial file is deleted and :class:`DownloadError` raised; after the last failed retry it is kept
    so that a rerun resumes. A 404 or 410 answer raises :class:`RemoteNotFound`.
    """
    dest = Path(dest)
    sums = _expected_sums(md5, sha256)
    _check_request(url, dest, size=size, max_bytes=max_bytes)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(dest.with_name(dest.name + LOCK_SUFFIX), f"the download of {url}"):
        origin = _cached_origin(dest, url)
        kept = _kept(dest, origin, sums=sums, size=size, timeout_s=timeout_s)
        if kept is not None:
            return kept
        return _download(url, dest, origin, sums=sums, size=size, retries=retries, timeout_s=timeout_s,
                         max_bytes=max_bytes, progress=progress, backoff_s=backoff_s)


def _download(url: str, dest: Path, origin: Origin, *, sums: dict[str, str], size: int | None, retries: int,
              timeout_s: float, max_bytes: int, progress: bool, backoff_s: float) -> Downloaded:
    part = part_path(dest)
    if part.exists() and not (sums or origin.if_range):
        part.unlink()  # nothing could tell whether the server's file is still the one it was cut from
    limit, limit_reason = _byte_limit(size, max_bytes)
    with _progress_bar(progress, dest.name, size) as bar:
        for attempt in range(retries + 1):
            try:
                _fetch_once(url, dest, size=size, limit=limit, limit_reason=limit_reason, timeout_s=timeout_s,
                            bar=bar)
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
    verified = _verify(part, url=url, dest=dest, sums=sums, size=size)
    os.replace(part, dest)
    return Downloaded(dest, verified.size, verified.md5, verified.sha256)


def _cached_origin(dest: Path, url: str) -> Origin:
    """The recorded origin of ``dest``'s cache when it is ``url``; otherwise the cache is discarded and a
    new record (``url`` alone) written before any byte is."""
    origin = _read_origin(dest)
    if origin is not None and origin.url == url:
        return origin
    for stale in (dest, part_path(dest)):
        stale.unlink(missing_ok=True)
    origin = Origin(url)
    _write_origin(dest, origin)
    return origin


def _read_origin(dest: Path) -> Origin | None:
    try:
        return Origin(**json.loads(origin_path(dest).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_origin(dest: Path, origin: Origin) -> None:
    with atomic_output(origin_path(dest)) as tmp:
        tmp.write_text(json.dumps(asdict(origin)) + "\n")


def _kept(dest: Path, origin: Origin, *, sums: dict[str, str], size: int | None,
          timeout_s: float) -> Downloaded | None:
    """``dest`` when it may be used without downloading it again (see the module docstring), else None
    (and ``dest`` removed)."""
    if not dest.is_file():
        return None
    actual_size = dest.stat().st_size
    if sums or size is not None:
        if size is None or actual_size == size:
            digests = file_digests(dest)
            if all(digests[name] == value for name, value in sums.items()):
                return Downloaded(dest, actual_size, digests["md5"], digests["sha256"])
    elif _unchanged_on_server(origin, timeout_s):
        digests = file_digests(dest)
        return Downloaded(dest, actual_size, digests["md5"], digests["sha256"])
    dest.unlink()
    return None


def _unchanged_on_server(origin: Origin, timeout_s: float) -> bool:
    """Whether an http(s) server answers 304 to a conditional request on the recorded validators."""
    if urlparse(origin.url).scheme not in ("http", "https") or not (origin.etag or origin.last_modified):
        return False
    headers = {"User-Agent": "cellpath", "Accept-Encoding": "identity"}
    if origin.etag:
        headers["If-None-Match"] = origin.etag
    if origin.last_modified:
        headers["If-Modified-Since"] = origin.last_modified
    try:
        with _OPENER.open(urllib.request.Request(origin.url, headers=headers), timeout=timeout_s):
            return False  # 200: the server sends the file again, so it changed (or ignores validators)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code == 304
    except (OSError, http.client.HTTPException):
        return False


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


def _fetch_once(url: str, dest: Path, *, size: int | None, limit: int, limit_reason: str, timeout_s: float,
                bar: _Progress) -> None:
    """One request: append to (or restart) ``dest``'s partial file, recording the origin the server
    describes before any byte of the body. Raise _TransientError when worth retrying."""
    part, origin = part_path(dest), _read_origin(dest) or Origin(url)
    offset = part.stat().st_size if part.exists() else 0
    if size is not None and offset > size:
        part.unlink()
        offset = 0
    if size is not None and part.exists() and offset == size:
        return
    headers = {"User-Agent": "cellpath", "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
        if origin.if_range:
            headers["If-Range"] = origin.if_range
    try:
        response = _OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        _handle_http_error(exc, url, part, offset)
        return
    except (OSError, http.client.HTTPException) as exc:
        raise _TransientError(f"cannot connect: {exc}") from exc
    with response:
        start, length = _response_span(response, url, part, offset, size=size, limit=limit,
                                       limit_reason=limit_reason)
        served = Origin(url, response.headers.get("ETag"), response.headers.get("Last-Modified"))
        if served != origin:
            _write_origin(dest, served)
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


def _verify(part: Path, *, url: str, dest: Path, sums: dict[str, str], size: int | None) -> Downloaded:
    """``part``'s size and digests; delete it and raise DownloadError unless they are as expected
    (``sums``: md5, sha256, each where given)."""
    actual_size = part.stat().st_size
    if size is not None and actual_size != size:
        part.unlink()
        raise DownloadError(
            f"{url}: {dest}: expected {size} bytes, got {actual_size}; the download was deleted — "
            "check the URL and the expected size"
        )
    actual = file_digests(part)
    wrong = [name for name in sums if actual[name] != sums[name]]
    if wrong:
        part.unlink()
        found = "; ".join(f"expected {name} {sums[name]}, got {actual[name]}" for name in wrong)
        raise DownloadError(
            f"{url}: {dest}: {found}; the download was deleted — check the URL and the expected checksum"
        )
    return Downloaded(part, actual_size, actual["md5"], actual["sha256"])
