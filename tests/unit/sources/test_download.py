"""download_file against a local HTTP server with injected faults (no network)."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellpath.errors import DownloadError
from cellpath.sources import download
from cellpath.sources.download import (Downloaded, RemoteNotFound, download_file, file_digests, origin_path,
                                       part_path)
from helpers.http_server import FaultyServer, serving

PAYLOAD = bytes(range(256)) * 40  # 10,240 bytes
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
PAYLOAD_MD5 = hashlib.md5(PAYLOAD).hexdigest()
FAST = {"retries": 2, "timeout_s": 60.0, "max_bytes": 10**6, "backoff_s": 0.0}

pytestmark = pytest.mark.usefixtures("loopback_only")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FaultyServer]:
    root = tmp_path / "served"
    root.mkdir()
    (root / "data.bin").write_bytes(PAYLOAD)
    with serving(root) as state:
        yield state


def test_full_download_checks_size_and_sha(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "out" / "data.bin"
    got = download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert got == Downloaded(dest, len(PAYLOAD), PAYLOAD_MD5, PAYLOAD_SHA) and dest.read_bytes() == PAYLOAD
    assert not part_path(dest).exists()
    assert server.ranges("data.bin") == [None]


def test_existing_verified_file_is_not_downloaded_again(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    again = download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert again.sha256 == PAYLOAD_SHA and len(server.requests) == 1


def test_cached_file_with_wrong_content_is_replaced(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    download_file(server.url("data.bin"), dest, **FAST)
    dest.write_bytes(b"stale")
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD and server.ranges("data.bin") == [None, None]


def test_a_file_cached_without_its_origin_is_not_trusted(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    dest.write_bytes(PAYLOAD)  # e.g. copied in by hand, or left by an older version: no record of its URL
    part_path(dest).write_bytes(b"junk")
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD and server.ranges("data.bin") == [None]
    assert json.loads(origin_path(dest).read_text())["url"] == server.url("data.bin")


def _interrupted(server: FaultyServer, dest: Path, after: int, **expected: object) -> None:
    """A first download of data.bin that gives up after ``after`` bytes, leaving its partial file."""
    server.faults["data.bin"] = [f"truncate:{after}"]
    with pytest.raises(DownloadError, match="after 1 attempt"):
        download_file(server.url("data.bin"), dest, **expected, **{**FAST, "retries": 0})
    assert part_path(dest).stat().st_size == after


def test_partial_file_is_resumed_with_range_and_if_range(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    _interrupted(server, dest, 4000)
    download_file(server.url("data.bin"), dest, **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert server.ranges("data.bin") == [None, "bytes=4000-"]
    assert server.headers[-1]["If-Range"] == json.loads(origin_path(dest).read_text())["etag"]


def test_a_file_changed_on_the_server_is_not_spliced_onto_the_partial(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    _interrupted(server, dest, 4000)
    changed = bytes(reversed(PAYLOAD))
    (server.root / "data.bin").write_bytes(changed)
    got = download_file(server.url("data.bin"), dest, **FAST)
    assert dest.read_bytes() == changed and got.sha256 == hashlib.sha256(changed).hexdigest()
    assert server.ranges("data.bin") == [None, "bytes=4000-"]  # asked to resume; answered with the whole new file


def test_a_partial_without_validators_or_checksum_starts_over(server: FaultyServer, tmp_path: Path) -> None:
    server.validators = False
    dest = tmp_path / "data.bin"
    _interrupted(server, dest, 4000)
    download_file(server.url("data.bin"), dest, **FAST)
    assert server.ranges("data.bin") == [None, None]


def test_a_partial_with_a_checksum_resumes_without_validators(server: FaultyServer, tmp_path: Path) -> None:
    server.validators = False
    dest = tmp_path / "data.bin"
    _interrupted(server, dest, 4000, sha256=PAYLOAD_SHA)
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD and server.ranges("data.bin") == [None, "bytes=4000-"]


def test_a_changed_url_discards_the_cached_file_and_partial(server: FaultyServer, tmp_path: Path) -> None:
    (server.root / "denied.html").write_bytes(b"<html>Access denied</html>")
    dest = tmp_path / "bundle"
    download_file(server.url("denied.html"), dest, **FAST)  # the wrong URL, no checksum: cached as the file
    part_path(dest).write_bytes(b"<html>Acc")
    got = download_file(server.url("data.bin"), dest, **FAST)  # the URL fixed
    assert dest.read_bytes() == PAYLOAD and got.sha256 == PAYLOAD_SHA
    assert server.ranges("data.bin") == [None]


def test_an_unchecked_cached_file_is_kept_only_when_the_server_says_unchanged(server: FaultyServer,
                                                                               tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    download_file(server.url("data.bin"), dest, **FAST)
    download_file(server.url("data.bin"), dest, **FAST)
    assert server.headers[-1]["If-None-Match"] == json.loads(origin_path(dest).read_text())["etag"]
    assert len(server.requests) == 2 and dest.read_bytes() == PAYLOAD  # the 304 kept it
    changed = PAYLOAD[::-1]
    (server.root / "data.bin").write_bytes(changed)
    download_file(server.url("data.bin"), dest, **FAST)
    assert dest.read_bytes() == changed


def test_server_ignoring_range_restarts_from_zero(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    _interrupted(server, dest, 4000)
    server.faults["data.bin"] = ["ignore_range"]
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD


def test_complete_partial_file_answered_416_is_accepted(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    _interrupted(server, dest, 4000)
    part_path(dest).write_bytes(PAYLOAD)  # the last byte written, the process killed before the rename
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert server.ranges("data.bin")[-1] == f"bytes={len(PAYLOAD)}-"


def test_https_redirect_to_http_is_refused(tmp_path: Path) -> None:
    handler = download._HttpsOnlyRedirects()
    request = urllib.request.Request("https://example.org/bundle.zip")
    with pytest.raises(DownloadError, match="leaves https"):
        handler.redirect_request(request, None, 302, "Found", {}, "http://example.org/bundle.zip")
    with pytest.raises(DownloadError, match="leaves https"):
        handler.redirect_request(request, None, 302, "Found", {}, "ftp://example.org/bundle.zip")
    assert handler.redirect_request(request, None, 302, "Found", {}, "https://cdn.example.org/b.zip").full_url == \
        "https://cdn.example.org/b.zip"


def test_redirects_are_followed_only_to_http(server: FaultyServer, tmp_path: Path) -> None:
    server.faults["moved.bin"] = ["redirect:" + server.url("data.bin")]
    got = download_file(server.url("moved.bin"), tmp_path / "data.bin", sha256=PAYLOAD_SHA, **FAST)
    assert got.sha256 == PAYLOAD_SHA
    secret = tmp_path / "secret.txt"
    secret.write_text("local")
    server.faults["moved.bin"] = ["redirect:" + secret.as_uri()]
    with pytest.raises(DownloadError, match="Redirection to url 'file:.*' is not allowed"):
        download_file(server.url("moved.bin"), tmp_path / "other.bin", **FAST)
    assert not (tmp_path / "other.bin").exists()


def test_truncated_body_is_retried_and_resumed(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    server.faults["data.bin"] = ["truncate:3000"]
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert server.ranges("data.bin") == [None, "bytes=3000-"]


def test_server_error_is_retried(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    server.faults["data.bin"] = ["500"]
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert len(server.ranges("data.bin")) == 2


def test_giving_up_keeps_the_partial_file_for_a_later_resume(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    server.faults["data.bin"] = ["truncate:3000", "500", "500"]
    with pytest.raises(DownloadError, match="after 3 attempt") as err:
        download_file(server.url("data.bin"), dest, size=len(PAYLOAD), **FAST)
    assert server.url("data.bin") in str(err.value)
    assert part_path(dest).read_bytes() == PAYLOAD[:3000]
    assert not dest.exists()


def test_missing_file_fails_without_retrying(server: FaultyServer, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="HTTP 404"):
        download_file(server.url("absent.bin"), tmp_path / "absent.bin", **FAST)
    assert len(server.ranges("absent.bin")) == 1


def test_md5_is_checked_beside_size_and_sha(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    download_file(server.url("data.bin"), dest, md5=PAYLOAD_MD5.upper(), sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert file_digests(dest, ("md5", "sha256")) == {"md5": PAYLOAD_MD5, "sha256": PAYLOAD_SHA}


def test_md5_mismatch_is_deleted_and_names_both_sums(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    wrong = "0" * 32
    with pytest.raises(DownloadError) as err:
        download_file(server.url("data.bin"), dest, md5=wrong, sha256=PAYLOAD_SHA, **FAST)
    message = str(err.value)
    assert f"expected md5 {wrong}, got {PAYLOAD_MD5}" in message and "sha256" not in message
    assert server.url("data.bin") in message and str(dest) in message
    assert not dest.exists() and not part_path(dest).exists()


def test_cached_file_matching_its_md5_is_kept_without_a_request(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    download_file(server.url("data.bin"), dest, md5=PAYLOAD_MD5, **FAST)
    download_file(server.url("data.bin"), dest, md5=PAYLOAD_MD5, **FAST)
    assert len(server.requests) == 1
    dest.write_bytes(PAYLOAD[:-1] + b"x")  # same size, other content: fetched again
    download_file(server.url("data.bin"), dest, md5=PAYLOAD_MD5, size=len(PAYLOAD), **FAST)
    assert dest.read_bytes() == PAYLOAD and len(server.requests) == 2


def test_missing_remote_file_is_a_remote_not_found(server: FaultyServer, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFound) as err:
        download_file(server.url("absent.bin"), tmp_path / "absent.bin", **FAST)
    assert err.value.url == server.url("absent.bin")
    with pytest.raises(RemoteNotFound, match="no such local file"):
        download_file((tmp_path / "absent.bin").as_uri(), tmp_path / "out.bin", **FAST)


def test_corrupted_content_is_deleted_and_reported(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    wrong = "0" * 64
    with pytest.raises(DownloadError) as err:
        download_file(server.url("data.bin"), dest, sha256=wrong, size=len(PAYLOAD), **FAST)
    message = str(err.value)
    assert server.url("data.bin") in message and str(dest) in message
    assert wrong in message and PAYLOAD_SHA in message
    assert not dest.exists() and not part_path(dest).exists()


def test_more_than_max_bytes_is_refused(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    with pytest.raises(DownloadError, match="1000 bytes"):
        download_file(server.url("data.bin"), dest, **{**FAST, "max_bytes": 1000})
    assert not dest.exists() and not part_path(dest).exists()


def test_size_differing_from_the_expected_one_is_refused(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    with pytest.raises(DownloadError, match=f"reports {len(PAYLOAD)} bytes, expected 5000"):
        download_file(server.url("data.bin"), dest, size=5000, **FAST)
    assert not dest.exists() and not part_path(dest).exists()


def test_file_url(tmp_path: Path) -> None:
    source = tmp_path / "mirror" / "data.bin"
    source.parent.mkdir()
    source.write_bytes(PAYLOAD)
    dest = tmp_path / "data.bin"
    download_file(source.as_uri(), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert dest.read_bytes() == PAYLOAD


def test_unsupported_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="unsupported URL scheme 'ftp'"):
        download_file("ftp://127.0.0.1/data.bin", tmp_path / "data.bin", **FAST)
