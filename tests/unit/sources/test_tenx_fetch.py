"""The 10x source end to end against a local HTTP server serving a dummy bundle (no network)."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import shutil
import threading
import zipfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cellpath.config import TenxConfig
from cellpath.errors import DownloadError, InputError
from cellpath.sources.lock import LOCK_COLUMNS, read_lock
from cellpath.sources.tenx import MANIFEST_COLUMNS, fetch_tenx, read_manifest
from helpers.http_server import serving
from helpers.project import PROJECT_ROOT

LOCK_HEADER = ",".join(LOCK_COLUMNS) + "\n"
SHIPPED_MANIFEST = PROJECT_ROOT / "data" / "manifests" / "xenium_datasets.csv"
PREFIX = "Xenium_V1_Test_"
BUNDLE_MEMBERS = {
    "outs/experiment.xenium": b'{"pixel_size": 0.2125}',
    "outs/cells.parquet": b"not really parquet",
    "outs/cell_feature_matrix.h5": b"not really hdf5",
}


class RecordingHandler(SimpleHTTPRequestHandler):
    """Serves a folder (ignoring Range, answering 200) and records (path, Range header) per request."""

    requests: list[tuple[str, str | None]]

    def do_GET(self) -> None:
        self.requests.append((self.path.lstrip("/"), self.headers.get("Range")))
        super().do_GET()

    def log_message(self, *args: object) -> None:
        return None


pytestmark = pytest.mark.usefixtures("loopback_only")


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """The files a 10x dataset page offers for one section: bundle zip, H&E image, alignment CSV."""
    root = tmp_path / "served"
    root.mkdir()
    with zipfile.ZipFile(root / "Xenium_V1_Test_outs.zip", "w") as zf:
        for name, data in BUNDLE_MEMBERS.items():
            zf.writestr(name, data)
    (root / "he_image.ome.tif").write_bytes(b"II*\x00" + bytes(5000))
    (root / "he_imagealignment.csv").write_text("1,0,0\n0,1,0\n0,0,1\n")
    return root


@pytest.fixture
def server(served: Path) -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    requests: list[tuple[str, str | None]] = []
    handler = type("Handler", (RecordingHandler,), {"requests": requests})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def _row(section_id: str, **values: str) -> dict[str, str]:
    row = dict.fromkeys(MANIFEST_COLUMNS, "")
    row.update(section_id=section_id, dataset=f"Dataset {section_id}", organ="Liver", status="Normal",
               cells="1000", agr_bacc="0.5", rank="1", panel_s25="1", page_url="https://example.org/page",
               prefix=PREFIX)
    row.update(values)
    return row


def _write_manifest(path: Path, rows: list[dict[str, str]], columns: tuple[str, ...] = MANIFEST_COLUMNS) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def _file_columns(kind: str, url: str, path: Path, *, sha: str | None = None) -> dict[str, str]:
    data = path.read_bytes()
    return {f"{kind}_url": url, f"{kind}_sha256": sha or hashlib.sha256(data).hexdigest(),
            f"{kind}_bytes": str(len(data))}


SERVED_FILES = {"bundle": "Xenium_V1_Test_outs.zip", "he_image": "he_image.ome.tif",
                "he_alignment": "he_imagealignment.csv"}


def _columns(urls: dict[str, str], served: Path, *, sums: bool = True) -> dict[str, str]:
    """The URL columns of a row; with each file's published SHA-256 and size when ``sums``."""
    columns: dict[str, str] = {}
    for kind, url in urls.items():
        columns |= _file_columns(kind, url, served / SERVED_FILES[kind]) if sums else {f"{kind}_url": url}
    return columns


def manifest_urls(manifest: Path) -> dict[str, str]:
    """The first row's URL per file kind."""
    section = read_manifest(manifest)[0]
    return {kind: getattr(section, kind).url for kind in SERVED_FILES}


@pytest.fixture
def manifest(tmp_path: Path, served: Path, server: tuple[str, list]) -> Path:
    base, _ = server
    urls = {kind: f"{base}/{name}" for kind, name in SERVED_FILES.items()}
    return _write_manifest(tmp_path / "manifest.csv", [_row("sec_a", **_columns(urls, served)), _row("sec_b")])


def _config(manifest: Path, sections: list[str] | None = None) -> TenxConfig:
    return TenxConfig(manifest=manifest, sections=sections or [], retries=1, timeout_s=60.0,
                      max_file_bytes=10**6)


def test_fetch_builds_the_section_folder(manifest: Path, served: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    summary = fetch_tenx(_config(manifest), raw, tmp_path / "downloads")
    assert summary["fetched"] == ["sec_a"] and summary["skipped"] == []
    assert summary["bytes"] == sum(p.stat().st_size for p in served.iterdir())
    section = raw / "sec_a"
    for name, data in BUNDLE_MEMBERS.items():
        assert (section / name.removeprefix("outs/")).read_bytes() == data
    assert (section / f"{PREFIX}he_image.ome.tif").read_bytes() == (served / "he_image.ome.tif").read_bytes()
    assert (section / f"{PREFIX}he_imagealignment.csv").read_text().startswith("1,0,0")
    served_files = SERVED_FILES
    base = manifest_urls(manifest)
    assert json.loads((section / "section.json").read_text()) == {
        "section_id": "sec_a", "dataset": "Dataset sec_a", "organ": "Liver", "status": "Normal",
        "source": "10x", "prefix": PREFIX,
        "files": {kind: {"url": base[kind], "bytes": (served / name).stat().st_size,
                         "md5": hashlib.md5((served / name).read_bytes()).hexdigest(),
                         "sha256": hashlib.sha256((served / name).read_bytes()).hexdigest(),
                         "verified": "published checksum"} for kind, name in served_files.items()},
    }
    assert sorted(p.name for p in raw.iterdir()) == ["sec_a"]
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == [".fetch.lock"]  # the section's cache is gone


def test_second_run_skips_the_finished_section(manifest: Path, server: tuple[str, list], tmp_path: Path) -> None:
    _, requests = server
    fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    seen = len(requests)
    summary = fetch_tenx(_config(manifest, ["sec_a"]), tmp_path / "raw", tmp_path / "downloads")
    assert summary == {"source": "10x", "fetched": [], "skipped": ["sec_a"], "removed": [], "bytes": 0,
                       "verified": {"published checksum": 3, "first use": 0, "not yet downloaded": 0}}
    assert len(requests) == seen


def test_section_built_from_other_files_is_fetched_again(manifest: Path, served: Path,
                                                         server: tuple[str, list], tmp_path: Path) -> None:
    """A finished section is reused only while its manifest row lists the same files (size, sha256)."""
    _, requests = server
    fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    record = tmp_path / "raw" / "sec_a" / "section.json"
    stale = json.loads(record.read_text())
    stale["files"]["he_image"]["sha256"] = "0" * 64  # as if built from an earlier version of the image
    record.write_text(json.dumps(stale))
    seen = len(requests)
    summary = fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    assert summary["fetched"] == ["sec_a"] and summary["skipped"] == []
    assert len(requests) == seen + 3
    assert json.loads(record.read_text())["files"]["he_image"]["sha256"] != "0" * 64


def test_sections_no_longer_selected_are_removed(manifest: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "old_section").mkdir(parents=True)
    (raw / "old_section" / "section.json").write_text("{}")
    summary = fetch_tenx(_config(manifest), raw, tmp_path / "downloads")
    assert summary["removed"] == ["old_section"]
    assert sorted(p.name for p in raw.iterdir()) == ["sec_a"]


def test_interrupted_download_is_resumed_from_the_cache(served: Path, tmp_path: Path) -> None:
    with serving(served) as server:
        urls = {kind: server.url(name) for kind, name in SERVED_FILES.items()}
        manifest = _write_manifest(tmp_path / "manifest.csv", [_row("sec_a", **_columns(urls, served))])
        server.faults["Xenium_V1_Test_outs.zip"] = ["truncate:100", "500"]  # both attempts of the first run
        with pytest.raises(DownloadError, match="the next run resumes it"):
            fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
        assert (tmp_path / "downloads" / "sec_a" / "bundle.part").stat().st_size == 100
        fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
        resumed = [h for (path, _), h in zip(server.requests, server.headers) if path == "Xenium_V1_Test_outs.zip"][-1]
    assert resumed["Range"] == "bytes=100-" and resumed["If-Range"].startswith('"')
    assert (tmp_path / "raw" / "sec_a" / "cells.parquet").is_file()


def test_relative_paths_are_taken_from_base_dir(manifest: Path, tmp_path: Path) -> None:
    summary = fetch_tenx(_config(Path(manifest.name)), Path("raw"), Path("downloads"), base_dir=tmp_path)
    assert summary["fetched"] == ["sec_a"]
    assert (tmp_path / "raw" / "sec_a" / "section.json").is_file()


def test_checksum_mismatch_leaves_no_section_folder(tmp_path: Path, served: Path, server: tuple[str, list]) -> None:
    base, _ = server
    urls = {
        **_file_columns("bundle", f"{base}/Xenium_V1_Test_outs.zip", served / "Xenium_V1_Test_outs.zip",
                        sha="f" * 64),
        **_file_columns("he_image", f"{base}/he_image.ome.tif", served / "he_image.ome.tif"),
        **_file_columns("he_alignment", f"{base}/he_imagealignment.csv", served / "he_imagealignment.csv"),
    }
    manifest = _write_manifest(tmp_path / "manifest.csv", [_row("sec_a", **urls)])
    with pytest.raises(DownloadError, match="expected sha256 f{64}"):
        fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    assert not (tmp_path / "raw" / "sec_a").exists()


def test_selected_section_without_urls_is_an_input_error(manifest: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"sec_b \(bundle_url, he_image_url, he_alignment_url\)") as err:
        fetch_tenx(_config(manifest, ["sec_a", "sec_b"]), tmp_path / "raw", tmp_path / "downloads")
    assert str(manifest) in str(err.value) and "fill in the URL columns" in str(err.value)
    assert not (tmp_path / "raw").exists()


def test_unknown_section_is_an_input_error(manifest: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not in the manifest: nope"):
        fetch_tenx(_config(manifest, ["nope"]), tmp_path / "raw", tmp_path / "downloads")


def test_missing_column_is_named(tmp_path: Path) -> None:
    columns = tuple(c for c in MANIFEST_COLUMNS if c != "he_image_sha256")
    path = _write_manifest(tmp_path / "m.csv", [_row("sec_a")], columns)
    with pytest.raises(InputError, match="missing column.*he_image_sha256") as err:
        read_manifest(path)
    assert str(path) in str(err.value)


def test_invalid_rows_are_all_reported(tmp_path: Path) -> None:
    rows = [_row("sec_a"), _row("sec_a"), _row("sec_c", cells="many", bundle_url="ftp://x/y.zip",
                                                  he_image_sha256="abc")]
    with pytest.raises(InputError) as err:
        read_manifest(_write_manifest(tmp_path / "m.csv", rows))
    message = str(err.value)
    assert "repeated: sec_a" in message
    assert "line 4 (section sec_c): column cells" in message
    assert "column bundle_url" in message and "column he_image_sha256" in message


def test_shipped_manifest_has_all_sections() -> None:
    sections = read_manifest(SHIPPED_MANIFEST)
    assert len(sections) == 52
    assert len({s.section_id for s in sections}) == 52
    liver = next(s for s in sections if s.section_id == "xenium_v1_hliver_nondiseased_section_ffpe")
    assert (liver.organ, liver.status, liver.cells, liver.rank) == ("Liver", "Normal", 239271, 4)
    assert liver.prefix == "Xenium_V1_hLiver_nondiseased_section_FFPE_"
    leukaemia = next(s for s in sections if s.status == "Leukemia")
    assert leukaemia.agr_bacc is None and leukaemia.rank is None


def test_shipped_section_without_urls_explains_what_to_do(tmp_path: Path) -> None:
    """The one row no evidence gave a URL for (data/manifests/README.md) stops the fetch, named."""
    with pytest.raises(InputError, match=r"xenium_prime_human_ovary_cancer_ff \(bundle_url, he_image_url, "
                                         r"he_alignment_url\)"):
        fetch_tenx(_config(SHIPPED_MANIFEST, ["xenium_prime_human_ovary_cancer_ff"]), tmp_path / "raw",
                   tmp_path / "downloads")
    assert not (tmp_path / "raw").exists()


def test_manifest_without_any_url_explains_what_to_do(tmp_path: Path) -> None:
    manifest = _write_manifest(tmp_path / "manifest.csv", [_row("sec_a"), _row("sec_b")])
    with pytest.raises(InputError, match="no section has a bundle_url yet"):
        fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")


# --- Trust on first use: the lock beside the manifest -----------------------------------------------


@pytest.fixture
def unpublished(tmp_path: Path, served: Path, server: tuple[str, list]) -> Path:
    """A manifest whose section has URLs but no published size or checksum (most of the paper's rows)."""
    base, _ = server
    urls = {kind: f"{base}/{name}" for kind, name in SERVED_FILES.items()}
    return _write_manifest(tmp_path / "manifest.csv", [_row("sec_a", **_columns(urls, served, sums=False))])


def test_first_download_is_recorded_and_every_later_one_checked(unpublished: Path, served: Path,
                                                                tmp_path: Path) -> None:
    raw, downloads = tmp_path / "raw", tmp_path / "downloads"
    summary = fetch_tenx(_config(unpublished), raw, downloads)
    assert summary["verified"] == {"published checksum": 0, "first use": 3, "not yet downloaded": 0}
    lock = read_lock(tmp_path / "manifest.lock.csv")
    for kind, name in SERVED_FILES.items():
        data = (served / name).read_bytes()
        assert (lock[("sec_a", kind)].size, lock[("sec_a", kind)].sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert json.loads((raw / "sec_a" / "section.json").read_text())["files"]["he_image"]["verified"] == "first use"
    # the file changes at its source (same URL); a machine without the section downloads it again
    (served / "he_image.ome.tif").write_bytes(b"II*\x00" + bytes(4999) + b"\x01")
    shutil.rmtree(raw)
    with pytest.raises(DownloadError, match=r"(?s)he_image .*expected .*recorded in \S+manifest\.lock\.csv: if the file "
                                            r"really changed at its source, delete its row there") as err:
        fetch_tenx(_config(unpublished), raw, downloads)
    assert "1 of 1 selected section(s) failed" in str(err.value) and not (raw / "sec_a").exists()
    assert read_lock(tmp_path / "manifest.lock.csv") == lock  # never replaced


def test_a_section_whose_record_disagrees_with_the_lock_is_fetched_again(unpublished: Path, tmp_path: Path,
                                                                         server: tuple[str, list]) -> None:
    _, requests = server
    raw, downloads, lock_file = tmp_path / "raw", tmp_path / "downloads", tmp_path / "manifest.lock.csv"
    fetch_tenx(_config(unpublished), raw, downloads)
    edited = lock_file.read_text().replace(read_lock(lock_file)[("sec_a", "he_alignment")].sha256, "a" * 64)
    lock_file.write_text(edited)  # e.g. a lab's committed lock from a download this machine's does not match
    seen = len(requests)
    with pytest.raises(DownloadError, match="he_alignment.*expected sha256 a{64}"):
        fetch_tenx(_config(unpublished), raw, downloads)
    assert len(requests) > seen  # not reused on the strength of its own record
    assert lock_file.read_text() == edited


def test_a_lock_that_lacks_a_fetched_section_gets_its_rows_back(unpublished: Path, tmp_path: Path) -> None:
    raw, downloads, lock_file = tmp_path / "raw", tmp_path / "downloads", tmp_path / "manifest.lock.csv"
    fetch_tenx(_config(unpublished), raw, downloads)
    rows = lock_file.read_text()
    lock_file.write_text(LOCK_HEADER)
    summary = fetch_tenx(_config(unpublished), raw, downloads)
    assert summary["skipped"] == ["sec_a"] and lock_file.read_text() == rows


def test_a_published_checksum_that_disagrees_with_the_lock_stops_before_anything(tmp_path: Path, served: Path,
                                                                                server: tuple[str, list]) -> None:
    base, _ = server
    urls = {kind: f"{base}/{name}" for kind, name in SERVED_FILES.items()}
    manifest = _write_manifest(tmp_path / "manifest.csv", [_row("sec_a", **_columns(urls, served, sums=False))])
    fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    before = (tmp_path / "raw" / "sec_a" / "section.json").read_text()
    _write_manifest(manifest, [_row("sec_a", **{**_columns(urls, served, sums=False), "bundle_sha256": "b" * 64})])
    with pytest.raises(InputError, match=r"manifest\.lock\.csv: section sec_a: bundle_sha256 is b{64} in the manifest, "
                                         r"but the file first downloaded from \S+ had [0-9a-f]{64}"):
        fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    assert (tmp_path / "raw" / "sec_a" / "section.json").read_text() == before


@pytest.mark.parametrize(("content", "says"), [(b"\xff\xfe not csv", "not UTF-8 text: byte 0xff on line 1"),
                                              ("section_id,kind\nsec_a,bundle\n".encode(), "restore it from git")],
                         ids=["latin-1", "wrong-columns"])
def test_a_malformed_lock_is_one_input_error(unpublished: Path, tmp_path: Path, content: bytes, says: str) -> None:
    (tmp_path / "manifest.lock.csv").write_bytes(content)
    with pytest.raises(InputError, match=rf"manifest\.lock\.csv: .*{says}"):
        fetch_tenx(_config(unpublished), tmp_path / "raw", tmp_path / "downloads")


def test_a_corrupt_bundle_fails_its_section_only_and_leaves_the_cache(tmp_path: Path, served: Path,
                                                                      server: tuple[str, list]) -> None:
    base, _ = server
    good = {kind: f"{base}/{name}" for kind, name in SERVED_FILES.items()}
    zipped = (served / "Xenium_V1_Test_outs.zip").read_bytes()
    (served / "broken_outs.zip").write_bytes(zipped[: len(zipped) // 2])
    broken = {**good, "bundle": f"{base}/broken_outs.zip"}
    manifest = _write_manifest(tmp_path / "manifest.csv", [_row("sec_bad", **_columns(broken, served, sums=False)),
                                                           _row("sec_good", **_columns(good, served, sums=False))])
    with pytest.raises(DownloadError) as err:
        fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    message = str(err.value)
    assert message.startswith("section sec_bad: bundle (broken_outs.zip): ")
    assert "truncated or corrupt" in message and "the cached archive was removed" in message
    assert message.endswith("(1 of 2 selected section(s) failed; the 1 finished one(s) are in "
                            f"{tmp_path / 'raw'} and are not downloaded again)")
    assert (tmp_path / "raw" / "sec_good" / "cells.parquet").is_file()
    assert not (tmp_path / "raw" / "sec_bad").exists()
    assert not (tmp_path / "downloads" / "sec_bad" / "bundle").exists()
    assert {key[0] for key in read_lock(tmp_path / "manifest.lock.csv")} == {"sec_good"}  # nothing trusted of it


def test_fixing_a_wrong_url_replaces_the_cached_page(tmp_path: Path, served: Path, server: tuple[str, list]) -> None:
    base, _ = server
    (served / "denied_outs.zip").write_bytes(b"<html>Access denied</html>")
    urls = {kind: f"{base}/{name}" for kind, name in SERVED_FILES.items()}
    wrong = _row("sec_a", **{**_columns(urls, served, sums=False), "bundle_url": f"{base}/denied_outs.zip"})
    manifest = _write_manifest(tmp_path / "manifest.csv", [wrong])
    with pytest.raises(DownloadError, match="starts with an HTML page"):
        fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    _write_manifest(manifest, [_row("sec_a", **_columns(urls, served, sums=False))])
    assert fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")["fetched"] == ["sec_a"]


def test_a_latin_1_manifest_is_one_input_error_and_a_bom_is_dropped(tmp_path: Path) -> None:
    path = _write_manifest(tmp_path / "m.csv", [_row("sec_a", dataset="Côlon")])
    text = path.read_text(encoding="utf-8")
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(InputError, match=r"m\.csv: not UTF-8 text: byte 0xf4 on line 2 \(invalid continuation byte\); "
                                         r"save it as UTF-8"):
        read_manifest(path)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # Excel's "CSV UTF-8"
    assert read_manifest(path)[0].dataset == "Côlon"
