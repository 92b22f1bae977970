"""The 10x source's URLs: MD5 checks, fallback hosts, derived URLs that answer 404, and ``tenx.mirror``,
against a local server laid out as 10x serves its files (no network)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellpath.config import TenxConfig, parse_params
from cellpath.errors import DownloadError, InputError
from cellpath.preflight import planned_sections
from cellpath.sources.download import part_path
from cellpath.sources.lock import read_lock
from cellpath.sources.tenx import check_downloads, fetch_tenx, mirror_url, read_manifest
from helpers.http_server import FaultyServer, serving
from helpers.tenx_mirror import TENX_ROOT, ServedSection, manifest_row, write_manifest, write_served

pytestmark = pytest.mark.usefixtures("loopback_only")

OLD = ServedSection("sec_old", "Xenium_V1_Test_Old", "1.0.2")
NEW = ServedSection("sec_new", "Xenium_Prime_Test_New", "3.0.0")
BUNDLE = {"experiment.xenium": b'{"pixel_size": 0.2125}', "cells.parquet": b"not really parquet"}


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """Two sections of two XOA versions, in 10x's layout."""
    root = tmp_path / "mirror"
    for section in (OLD, NEW):
        write_served(root, section, {**BUNDLE, "section": section.name.encode()}, b"II*\x00" + bytes(3000),
                     b"1,0,0\n0,1,0\n0,0,1\n")
    return root


@pytest.fixture
def server(served: Path) -> Iterator[FaultyServer]:
    with serving(served) as state:
        yield state


def _config(manifest: Path, *, mirror: str | None = None, sections: list[str] | None = None) -> TenxConfig:
    return TenxConfig(manifest=manifest, sections=sections or [], retries=0, timeout_s=60.0, max_file_bytes=10**6,
                      mirror=mirror)


def test_mirror_url_replaces_the_root_up_to_samples_xenium(tmp_path: Path) -> None:
    path = "1.0.2/Xenium_V1_X/Xenium_V1_X_outs.zip"
    for host in (TENX_ROOT, "https://s3-us-west-2.amazonaws.com/10x.files/samples/xenium"):
        assert mirror_url(f"{host}/{path}", "http://127.0.0.1:8000/copy/") == f"http://127.0.0.1:8000/copy/{path}"
        assert mirror_url(f"{host}/{path}", "copy", base_dir=tmp_path) == f"{(tmp_path / 'copy').as_uri()}/{path}"
    assert mirror_url("https://example.org/files/Xenium_V1_X_outs.zip", "http://127.0.0.1:8000") is None


def test_http_mirror_serves_every_file_and_md5_is_recorded(tmp_path: Path, served: Path, server: FaultyServer) -> None:
    manifest = write_manifest(tmp_path / "m.csv", [manifest_row(OLD, served, md5=True),
                                                   manifest_row(NEW, served, md5=False, rank=2)])
    summary = fetch_tenx(_config(manifest, mirror=server.base_url + "/"), tmp_path / "raw", tmp_path / "downloads")
    assert summary["fetched"] == ["sec_old", "sec_new"]
    assert sorted(path for path, _ in server.requests) == sorted(s.relative(k) for s in (OLD, NEW)
                                                                  for k in ("bundle", "he_image", "he_alignment"))
    record = json.loads((tmp_path / "raw" / "sec_old" / "section.json").read_text())
    assert record["files"]["bundle"]["md5"] == hashlib.md5((served / OLD.relative("bundle")).read_bytes()).hexdigest()
    assert record["files"]["bundle"]["verified"] == "published checksum"
    new = json.loads((tmp_path / "raw" / "sec_new" / "section.json").read_text())["files"]["bundle"]
    assert new["md5"] == hashlib.md5((served / NEW.relative("bundle")).read_bytes()).hexdigest()
    assert new["verified"] == "first use"  # no published sum: its first download is recorded in the lock
    locked = read_lock(tmp_path / "m.lock.csv")
    assert locked[("sec_new", "bundle")].sha256 == new["sha256"] and len(locked) == 6
    assert (tmp_path / "raw" / "sec_new" / f"{NEW.name}_he_image.ome.tif").is_file()


def test_folder_mirror_is_taken_from_base_dir(tmp_path: Path, served: Path) -> None:
    manifest = write_manifest(tmp_path / "m.csv", [manifest_row(NEW, served, md5=True)])
    summary = fetch_tenx(_config(Path("m.csv"), mirror="mirror"), Path("raw"), Path("downloads"), base_dir=tmp_path)
    assert summary["fetched"] == ["sec_new"] and manifest.is_file()
    assert (tmp_path / "raw" / "sec_new" / "cells.parquet").read_bytes() == BUNDLE["cells.parquet"]


def test_corrupted_file_is_refused_by_its_md5(tmp_path: Path, served: Path, server: FaultyServer) -> None:
    manifest = write_manifest(tmp_path / "m.csv", [manifest_row(OLD, served, md5=True)])
    bundle = served / OLD.relative("bundle")
    expected = hashlib.md5(bundle.read_bytes()).hexdigest()
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed on the server, the size kept
    bundle.write_bytes(bytes(data))
    actual = hashlib.md5(bundle.read_bytes()).hexdigest()
    with pytest.raises(DownloadError) as err:
        fetch_tenx(_config(manifest, mirror=server.base_url), tmp_path / "raw", tmp_path / "downloads")
    message = str(err.value)
    assert message.startswith("section sec_old: bundle (Xenium_V1_Test_Old_outs.zip): ")
    assert f"expected md5 {expected}, got {actual}" in message
    cache = tmp_path / "downloads" / "sec_old"
    assert not (tmp_path / "raw" / "sec_old").exists()
    assert not (cache / "bundle").exists() and not part_path(cache / "bundle").exists()


def test_a_fallback_host_is_tried_when_the_first_fails(tmp_path: Path, served: Path, server: FaultyServer) -> None:
    row = manifest_row(OLD, served, md5=True, url_root=f"{server.base_url}/gone")
    row["bundle_url_fallback"] = f"{server.base_url}/{OLD.relative('bundle')}"
    for kind in ("he_image", "he_alignment"):
        row[f"{kind}_url"] = f"{server.base_url}/{OLD.relative(kind)}"
    manifest = write_manifest(tmp_path / "m.csv", [row])
    summary = fetch_tenx(_config(manifest), tmp_path / "raw", tmp_path / "downloads")
    assert summary["fetched"] == ["sec_old"]
    assert [p for p, _ in server.requests if p.endswith("_outs.zip")] == [f"gone/{OLD.relative('bundle')}",
                                                                          OLD.relative("bundle")]


def test_a_mirror_asks_once_for_a_file_with_two_hosts(tmp_path: Path, served: Path, server: FaultyServer) -> None:
    row = manifest_row(OLD, served, md5=False)
    row["bundle_url_fallback"] = row["bundle_url"].replace(TENX_ROOT, "https://s3-us-west-2.amazonaws.com/10x.files"
                                                                      "/samples/xenium")
    manifest = write_manifest(tmp_path / "m.csv", [row])
    fetch_tenx(_config(manifest, mirror=server.base_url), tmp_path / "raw", tmp_path / "downloads")
    assert [p for p, _ in server.requests if p.endswith("_outs.zip")] == [OLD.relative("bundle")]


def test_a_derived_url_that_answers_404_stops_its_section_only(tmp_path: Path, served: Path,
                                                               server: FaultyServer) -> None:
    (served / OLD.relative("he_alignment")).unlink()  # 10x publishes no file under the derived name
    old = manifest_row(OLD, served, md5=False)
    old["he_alignment_url_source"] = "derived"
    manifest = write_manifest(tmp_path / "m.csv", [old, manifest_row(NEW, served, md5=True, rank=2)])
    with pytest.raises(DownloadError) as err:
        fetch_tenx(_config(manifest, mirror=server.base_url), tmp_path / "raw", tmp_path / "downloads")
    message = str(err.value)
    assert message.startswith(f"section sec_old: he_alignment ({OLD.name}_he_imagealignment.csv): ")
    assert "derived from the bundle's folder by 10x's naming" in message
    assert "https://www.10xgenomics.com/datasets/sec_old" in message and "he_alignment_url" in message
    assert "1 of 2 selected section(s) failed" in message
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["sec_new"]


def test_a_url_seen_in_the_evidence_that_answers_404_names_the_page(tmp_path: Path, served: Path,
                                                                      server: FaultyServer) -> None:
    (served / OLD.relative("he_image")).unlink()
    manifest = write_manifest(tmp_path / "m.csv", [manifest_row(OLD, served, md5=False)])
    with pytest.raises(DownloadError, match=r"HTTP 404.*\(the dataset page: https://www\.10xgenomics\.com/datasets/"
                                            r"sec_old\)"):
        fetch_tenx(_config(manifest, mirror=server.base_url), tmp_path / "raw", tmp_path / "downloads")


def test_a_mirror_cannot_serve_a_url_outside_10x_layout(tmp_path: Path, served: Path) -> None:
    row = manifest_row(OLD, served, md5=False)
    row["he_image_url"] = "https://example.org/he.ome.tif"
    manifest = write_manifest(tmp_path / "m.csv", [row])
    with pytest.raises(InputError, match=r"section sec_old: he_image URL 'https://example.org/he.ome.tif' is not in "
                                         r"10x's layout .* tenx.mirror"):
        fetch_tenx(_config(manifest, mirror=str(served)), tmp_path / "raw", tmp_path / "downloads")
    assert not (tmp_path / "raw").exists()


def test_a_missing_mirror_folder_is_named(tmp_path: Path, served: Path) -> None:
    manifest = write_manifest(tmp_path / "m.csv", [manifest_row(OLD, served, md5=False)])
    sections = read_manifest(manifest)
    with pytest.raises(InputError, match="tenx.mirror: 'nowhere': folder not found"):
        check_downloads(sections, _config(manifest, mirror="nowhere"), tmp_path)


def test_validate_reports_a_missing_mirror_folder(tmp_path: Path, served: Path) -> None:
    write_manifest(tmp_path / "m.csv", [manifest_row(OLD, served, md5=False)])
    params = parse_params({"source": "10x", "tenx": {"manifest": "m.csv", "mirror": "nowhere"},
                           "synthetic": {"sections": [{"section_id": "x", "organ": "Liver", "status": "Normal"}]}})
    sections, problems = planned_sections(params, tmp_path)
    assert sections == [] and [p.where for p in problems] == ["source: 10x"]
    assert "tenx.mirror: 'nowhere': folder not found" in problems[0].message
    (tmp_path / "nowhere").mkdir()
    assert [s.section_id for s in planned_sections(params, tmp_path)[0]] == ["sec_old"]


def test_bad_download_columns_are_all_reported(tmp_path: Path, served: Path) -> None:
    row = manifest_row(OLD, served, md5=False)
    row.update(xoa_version="v1", bundle_md5="abc", bundle_url_fallback=f"{row['bundle_url']}|ftp://x/y.zip",
               he_image_url="", he_image_url_fallback="https://cf.10xgenomics.com/x")
    with pytest.raises(InputError) as err:
        read_manifest(write_manifest(tmp_path / "m.csv", [row]))
    message = str(err.value)
    assert "column xoa_version: 'v1'" in message and "column bundle_md5: 'abc' is not a 32-digit hex MD5" in message
    assert "column bundle_url_fallback: 'ftp://x/y.zip' must start with" in message
    assert "column he_image_url_fallback: fallback URL(s) without a he_image_url" in message
