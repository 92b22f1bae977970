"""The 10x source end to end against a local HTTP server serving a dummy bundle (no network)."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import threading
import zipfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cellpath.config import TenxConfig
from cellpath.errors import DownloadError, InputError
from cellpath.sources.tenx import MANIFEST_COLUMNS, fetch_tenx, read_manifest
from helpers.project import PROJECT_ROOT

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


@pytest.fixture
def manifest(tmp_path: Path, served: Path, server: tuple[str, list]) -> Path:
    base, _ = server
    urls = {
        **_file_columns("bundle", f"{base}/Xenium_V1_Test_outs.zip", served / "Xenium_V1_Test_outs.zip"),
        **_file_columns("he_image", f"{base}/he_image.ome.tif", served / "he_image.ome.tif"),
        **_file_columns("he_alignment", f"{base}/he_imagealignment.csv", served / "he_imagealignment.csv"),
    }
    return _write_manifest(tmp_path / "manifest.csv", [_row("sec_a", **urls), _row("sec_b")])


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
    served_files = {"bundle": "Xenium_V1_Test_outs.zip", "he_image": "he_image.ome.tif",
                    "he_alignment": "he_imagealignment.csv"}
    assert json.loads((section / "section.json").read_text()) == {
        "section_id": "sec_a", "dataset": "Dataset sec_a", "organ": "Liver", "status": "Normal",
        "source": "10x", "prefix": PREFIX,
        "files": {kind: {"sha256": hashlib.sha256((served / name).read_bytes()).hexdigest(),
                         "bytes": (served / name).stat().st_size} for kind, name in served_files.items()},
    }
    assert sorted(p.name for p in raw.iterdir()) == ["sec_a"]
    assert list((tmp_path / "downloads").iterdir()) == []


def test_second_run_skips_the_finished_section(manifest: Path, server: tuple[str, list], tmp_path: Path) -> None:
    _, requests = server
    fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    seen = len(requests)
    summary = fetch_tenx(_config(manifest, ["sec_a"]), tmp_path / "raw", tmp_path / "downloads")
    assert summary == {"source": "10x", "fetched": [], "skipped": ["sec_a"], "removed": [], "bytes": 0}
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


def test_interrupted_download_is_resumed_from_the_cache(manifest: Path, served: Path,
                                                        server: tuple[str, list], tmp_path: Path) -> None:
    _, requests = server
    cache = tmp_path / "downloads" / "sec_a"
    cache.mkdir(parents=True)
    (cache / "bundle.part").write_bytes((served / "Xenium_V1_Test_outs.zip").read_bytes()[:100])
    fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    assert ("Xenium_V1_Test_outs.zip", "bytes=100-") in requests
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
