"""A local HTTP file server (127.0.0.1 only) with injectable faults and an optional throttle, for tests."""

from __future__ import annotations

import hashlib
from email.utils import formatdate

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class FaultyServer:
    """Serves ``root`` over HTTP with Range support; ``faults[path]`` is a queue of one-shot faults for
    that path: ``"500"``, ``"ignore_range"``, ``"truncate:N"`` (announce the full length, send N
    bytes) or ``"redirect:URL"`` (a 302 to URL). With ``validators`` it sends an ``ETag`` (a digest of
    the content) and a ``Last-Modified`` (the file's mtime), answers ``If-None-Match`` with 304, and
    serves a ``Range`` only when ``If-Range`` (if sent) names the current content. ``chunk_delay_s`` > 0 sends bodies in ``chunk_bytes`` pieces with that pause between them.
    ``hold[path] = (n, event)`` sends the first n bytes of that path's next body, then waits for the
    event before sending the rest: a client is then mid-download for as long as a test needs."""

    root: Path
    base_url: str = ""
    faults: dict[str, list[str]] = field(default_factory=dict)
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    headers: list[dict[str, str]] = field(default_factory=list)  # every request's headers, in order
    validators: bool = True
    chunk_bytes: int = 64 * 1024
    chunk_delay_s: float = 0.0
    hold: dict[str, tuple[int, threading.Event]] = field(default_factory=dict)  # path: (bytes, release)

    def url(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    def ranges(self, name: str) -> list[str | None]:
        return [r for p, r in self.requests if p == name]


def _handler(state: FaultyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return None

        def do_GET(self) -> None:
            name = unquote(urlparse(self.path).path).lstrip("/")
            state.requests.append((name, self.headers.get("Range")))
            state.headers.append(dict(self.headers.items()))
            fault = state.faults.get(name, []).pop(0) if state.faults.get(name) else ""
            if fault.startswith("redirect:"):
                self.send_response(302)
                self.send_header("Location", fault.removeprefix("redirect:"))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path = state.root / name
            if fault == "500" or not path.is_file():
                self.send_error(500 if fault == "500" else 404)
                return
            data = path.read_bytes()
            etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"'
            modified = formatdate(path.stat().st_mtime, usegmt=True)
            if state.validators and self.headers.get("If-None-Match") == etag:
                self.send_response(304)
                self.end_headers()
                return
            requested = self.headers.get("Range")
            if_range = self.headers.get("If-Range")
            if state.validators and if_range is not None and if_range not in (etag, modified):
                requested = None  # the content changed since the partial copy: send it whole
            if requested and fault != "ignore_range":
                start = int(requested.removeprefix("bytes=").rstrip("-"))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                data = data[start:]
            else:
                self.send_response(200)
            if state.validators:
                self.send_header("ETag", etag)
                self.send_header("Last-Modified", modified)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if fault.startswith("truncate:"):
                data = data[: int(fault.split(":")[1])]
            self._send(data, name)

        def _send(self, data: bytes, name: str) -> None:
            try:
                if name in state.hold:
                    held_bytes, release = state.hold.pop(name)
                    self.wfile.write(data[:held_bytes])
                    self.wfile.flush()
                    release.wait()
                    data = data[held_bytes:]
                if state.chunk_delay_s <= 0:
                    self.wfile.write(data)
                    return
                for start in range(0, len(data), state.chunk_bytes):
                    self.wfile.write(data[start:start + state.chunk_bytes])
                    self.wfile.flush()
                    time.sleep(state.chunk_delay_s)
            except (BrokenPipeError, ConnectionResetError):  # the client went away (an interrupted download)
                return

    return Handler


@contextmanager
def serving(root: Path, **options: object) -> Iterator[FaultyServer]:
    """Serve ``root`` on 127.0.0.1 (a free port) for the duration of the block."""
    state = FaultyServer(root=root, **options)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
