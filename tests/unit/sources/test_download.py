"""download_file and safe_extract against a local HTTP server with injected faults (no network)."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellpath.errors import DownloadError
from cellpath.sources.download import RemoteNotFound, download_file, file_digests, part_path, safe_extract
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
    assert got == dest and dest.read_bytes() == PAYLOAD
    assert not part_path(dest).exists()
    assert server.ranges("data.bin") == [None]


def test_existing_verified_file_is_not_downloaded_again(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    dest.write_bytes(PAYLOAD)
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert server.requests == []


def test_existing_file_with_wrong_content_is_replaced(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    dest.write_bytes(b"stale")
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD


def test_partial_file_is_resumed_with_a_range_request(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    part_path(dest).write_bytes(PAYLOAD[:4000])
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, size=len(PAYLOAD), **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert server.ranges("data.bin") == ["bytes=4000-"]


def test_server_ignoring_range_restarts_from_zero(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    part_path(dest).write_bytes(PAYLOAD[:4000])
    server.faults["data.bin"] = ["ignore_range"]
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD


def test_complete_partial_file_answered_416_is_accepted(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    part_path(dest).write_bytes(PAYLOAD)
    download_file(server.url("data.bin"), dest, sha256=PAYLOAD_SHA, **FAST)
    assert dest.read_bytes() == PAYLOAD
    assert server.ranges("data.bin") == [f"bytes={len(PAYLOAD)}-"]


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


def test_existing_file_matching_its_md5_is_kept_without_a_request(server: FaultyServer, tmp_path: Path) -> None:
    dest = tmp_path / "data.bin"
    dest.write_bytes(PAYLOAD)
    download_file(server.url("data.bin"), dest, md5=PAYLOAD_MD5, **FAST)
    assert server.requests == []
    dest.write_bytes(PAYLOAD[:-1] + b"x")  # same size, other content: fetched again
    download_file(server.url("data.bin"), dest, md5=PAYLOAD_MD5, size=len(PAYLOAD), **FAST)
    assert dest.read_bytes() == PAYLOAD and len(server.requests) == 1


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


# --- safe_extract -------------------------------------------------------------------------------


def _zip(path: Path, members: dict[str, bytes], symlinks: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name), data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o120777 << 16
            zf.writestr(info, target)
    return path


def _tar(path: Path, members: dict[str, bytes], links: dict[str, tuple[bytes, str]] | None = None) -> Path:
    """``links[name] = (tarfile.SYMTYPE | LNKTYPE | CHRTYPE, linkname)``."""
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = target
            tf.addfile(info)
    return path


def _assert_nothing_extracted(dest: Path) -> None:
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir() if p.name.startswith(".")] == []


BUNDLE = {"outs/cells.parquet": b"cells", "outs/experiment.xenium": b"{}", "outs/sub/a.txt": b"a"}


@pytest.mark.parametrize("make", [_zip, _tar], ids=["zip", "tar"])
def test_single_top_folder_is_flattened(make, tmp_path: Path) -> None:
    archive = make(tmp_path / "bundle", BUNDLE)
    dest = tmp_path / "raw" / "sec"
    files = safe_extract(archive, dest)
    assert sorted(files) == sorted(dest / p for p in ("cells.parquet", "experiment.xenium", "sub/a.txt"))
    assert (dest / "cells.parquet").read_bytes() == b"cells"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["sec"]


def test_several_top_level_entries_are_kept(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "b.zip", {"cells.parquet": b"c", "outs/x.txt": b"x"})
    dest = tmp_path / "sec"
    safe_extract(archive, dest)
    assert (dest / "cells.parquet").is_file() and (dest / "outs" / "x.txt").is_file()


@pytest.mark.parametrize("make", [_zip, _tar], ids=["zip", "tar"])
@pytest.mark.parametrize("bad", ["/etc/evil", "outs/../../evil", "../evil"])
def test_escaping_member_paths_are_refused(make, bad: str, tmp_path: Path) -> None:
    archive = make(tmp_path / "bundle", {"outs/ok.txt": b"ok", bad: b"evil"})
    dest = tmp_path / "raw" / "sec"
    with pytest.raises(DownloadError, match="refusing") as err:
        safe_extract(archive, dest)
    assert str(archive) in str(err.value) and bad in str(err.value)
    _assert_nothing_extracted(dest)
    assert not (tmp_path / "evil").exists()


def test_zip_symlink_member_is_refused(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "b.zip", {"outs/ok.txt": b"ok"}, symlinks={"outs/link": "ok.txt"})
    dest = tmp_path / "raw" / "sec"
    with pytest.raises(DownloadError, match="'outs/link' is a symlink"):
        safe_extract(archive, dest)
    _assert_nothing_extracted(dest)


@pytest.mark.parametrize(
    "link",
    [
        (tarfile.SYMTYPE, "/etc/passwd"),
        (tarfile.SYMTYPE, "../../outside"),
        (tarfile.LNKTYPE, "../outside"),
        (tarfile.CHRTYPE, ""),
    ],
    ids=["absolute-symlink", "relative-symlink", "hardlink", "device"],
)
def test_tar_links_outside_and_devices_are_refused(link: tuple[bytes, str], tmp_path: Path) -> None:
    archive = _tar(tmp_path / "b.tar.gz", {"outs/ok.txt": b"ok"}, links={"outs/link": link})
    dest = tmp_path / "raw" / "sec"
    with pytest.raises(DownloadError, match="'outs/link'"):
        safe_extract(archive, dest)
    _assert_nothing_extracted(dest)


def test_tar_symlink_chain_resolving_outside_is_refused(tmp_path: Path) -> None:
    links = {"outs/here": (tarfile.SYMTYPE, "."), "outs/escape": (tarfile.SYMTYPE, "here/../..")}
    archive = _tar(tmp_path / "b.tar.gz", {"outs/ok.txt": b"ok"}, links=links)
    dest = tmp_path / "raw" / "sec"
    with pytest.raises(DownloadError, match="refusing"):
        safe_extract(archive, dest)
    _assert_nothing_extracted(dest)


def test_tar_links_inside_are_kept(tmp_path: Path) -> None:
    links = {"outs/soft": (tarfile.SYMTYPE, "ok.txt"), "outs/hard": (tarfile.LNKTYPE, "outs/ok.txt")}
    archive = _tar(tmp_path / "b.tar.gz", {"outs/ok.txt": b"ok"}, links=links)
    dest = tmp_path / "sec"
    safe_extract(archive, dest)
    assert (dest / "soft").is_symlink() and (dest / "soft").read_bytes() == b"ok"
    assert (dest / "hard").read_bytes() == b"ok"


@pytest.mark.parametrize("make", [_zip, _tar], ids=["zip", "tar"])
def test_uncompressed_size_cap(make, tmp_path: Path) -> None:
    archive = make(tmp_path / "bundle", {"outs/zeros.bin": bytes(100_000)})
    dest = tmp_path / "raw" / "sec"
    with pytest.raises(DownloadError, match="above the cap of 50000 bytes"):
        safe_extract(archive, dest, max_total_bytes=50_000)
    _assert_nothing_extracted(dest)


def test_not_an_archive(tmp_path: Path) -> None:
    bogus = tmp_path / "bundle"
    bogus.write_bytes(b"<html>sign in</html>")
    with pytest.raises(DownloadError, match="not a zip or tar archive"):
        safe_extract(bogus, tmp_path / "sec")
