"""The shipped 10x manifest's download columns, and the builder that fills them from the evidence files in
data/manifests/evidence/ (the manifest is exactly what the builder makes of them)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from cellpath.errors import InputError
from cellpath.sources.tenx import (DERIVED, FILE_KINDS, NONE_FOUND, SHIPPED_COLUMNS, TENX_SUFFIXES, TENX_URL,
                                   URL_SEPARATOR, build_manifest, main, read_manifest)
from helpers.project import PROJECT_ROOT

MANIFESTS = PROJECT_ROOT / "data" / "manifests"
SHIPPED = MANIFESTS / "xenium_datasets.csv"
EVIDENCE = MANIFESTS / "evidence"
CF = "https://cf.10xgenomics.com/samples/xenium"
S3 = "https://s3-us-west-2.amazonaws.com/10x.files/samples/xenium"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _urls(row: dict[str, str], kind: str) -> list[str]:
    return [u for u in [row[f"{kind}_url"], *row[f"{kind}_url_fallback"].split(URL_SEPARATOR)] if u]


def test_the_manifest_is_what_the_builder_makes_of_the_evidence() -> None:
    rows = _rows(SHIPPED)
    assert list(rows[0]) == list(SHIPPED_COLUMNS)
    assert build_manifest(rows, _rows(EVIDENCE / "xenium_download_urls.csv"),
                          _rows(EVIDENCE / "xenium_checksums.csv")) == rows


def test_every_url_has_a_source_and_the_row_s_10x_names() -> None:
    rows = _rows(SHIPPED)
    with_bundle = [r for r in rows if r["bundle_url"] and r["bundle_url_source"] not in ("", NONE_FOUND, DERIVED)]
    assert len(with_bundle) >= 51
    for row in rows:
        name = row["prefix"].removesuffix("_")
        for kind in FILE_KINDS:
            urls = _urls(row, kind)
            assert bool(urls) == (row[f"{kind}_url_source"] != NONE_FOUND), (row["section_id"], kind)
            assert row[f"{kind}_url_source"], (row["section_id"], kind)
            for url in urls:
                match = TENX_URL.match(url)
                assert match and (match["version"], match["name"]) == (row["xoa_version"], name), url
                assert match["file"] == name + TENX_SUFFIXES[kind], url


def test_derived_urls_sit_in_the_bundle_s_folders() -> None:
    for row in _rows(SHIPPED):
        for kind in ("he_image", "he_alignment"):
            if row[f"{kind}_url_source"] == DERIVED:
                folders = [u.rsplit("/", 1)[0] for u in _urls(row, "bundle")]
                assert [u.rsplit("/", 1)[0] for u in _urls(row, kind)] == folders


def test_the_evidence_s_md5_sums_and_sizes_are_in_the_manifest() -> None:
    rows = {r["section_id"]: r for r in _rows(SHIPPED)}
    used = 0
    for item in _rows(EVIDENCE / "xenium_checksums.csv"):
        row = rows[item["section_id"]]
        if item["algo"] == "md5" and len(item["value"]) == 32:
            assert row[f"{item['kind']}_md5"] == item["value"]
            used += 1
        if item["bytes"]:
            assert row[f"{item['kind']}_bytes"] == item["bytes"]
        assert item["source"] in row[f"{item['kind']}_checksum_source"] or item["algo"] == "sha256"
    assert used == 16
    assert not any(r[f"{k}_sha256"] for r in rows.values() for k in FILE_KINDS)  # third-party copies' sums unused


def test_sources_come_from_the_evidence() -> None:
    seen = {r["source_repo_path_commit"] for r in _rows(EVIDENCE / "xenium_download_urls.csv")}
    for row in _rows(SHIPPED):
        for kind in FILE_KINDS:
            assert row[f"{kind}_url_source"] in seen | {DERIVED, NONE_FOUND}


def test_the_shipped_manifest_reads(tmp_path: Path) -> None:
    sections = {s.section_id: s for s in read_manifest(SHIPPED)}
    rep1 = sections["xenium_ffpe_human_breast_cancer_rep1"]
    assert rep1.xoa_version == "1.0.1" and rep1.bundle.md5 == "7d42a0b232f92a2e51de1f513b1a44fd"
    assert rep1.he_alignment.derived and not rep1.he_image.derived
    cervical = sections["xenium_prime_cervical_cancer_ffpe"]
    assert cervical.bundle.url.startswith(S3) and cervical.bundle.fallbacks[0].startswith(CF)  # seen in 2 repos vs 1
    assert sections["xenium_v1_human_kidney_ffpe_protein_updated"].he_alignment.size == 129


def _row(section_id: str = "sec_a", name: str = "Xenium_V1_A") -> dict[str, str]:
    return {**dict.fromkeys(SHIPPED_COLUMNS, ""), "section_id": section_id, "prefix": f"{name}_"}


def _seen(kind: str, url: str, source: str, section_id: str = "sec_a") -> dict[str, str]:
    return {"section_id": section_id, "kind": kind, "url": url, "source_repo_path_commit": source}


def _sum(kind: str, algo: str, value: str, size: str = "", source: str = "o/r:p@1") -> dict[str, str]:
    return {"section_id": "sec_a", "kind": kind, "filename": "", "algo": algo, "value": value, "bytes": size,
            "source": source, "note": ""}


def test_builder_orders_hosts_by_repositories_and_ranks_sources() -> None:
    bundle = "2.0.0/Xenium_V1_A/Xenium_V1_A_outs.zip"
    evidence = [_seen("bundle", f"{CF}/{bundle}", "unattributed (a script)"),
                _seen("bundle", f"{S3}/{bundle}", "o/one:x.sh"),
                _seen("bundle", f"{S3}/{bundle}", "o/two:y.py@abc"),
                _seen("he_image", f"{CF}/2.0.0/Xenium_V1_A/Xenium_V1_A_he_image.ome.tif", "o/one:x.sh")]
    row = build_manifest([_row()], evidence, [])[0]
    assert (row["bundle_url"], row["bundle_url_fallback"]) == (f"{S3}/{bundle}", f"{CF}/{bundle}")
    assert row["bundle_url_source"] == "o/two:y.py@abc" and row["xoa_version"] == "2.0.0"
    assert row["he_image_url_source"] == "o/one:x.sh" and row["he_image_url_fallback"] == ""
    assert row["he_alignment_url_source"] == DERIVED
    assert row["he_alignment_url"] == f"{S3}/2.0.0/Xenium_V1_A/Xenium_V1_A_he_imagealignment.csv"
    assert row["he_alignment_url_fallback"] == f"{CF}/2.0.0/Xenium_V1_A/Xenium_V1_A_he_imagealignment.csv"


def test_builder_leaves_a_row_without_evidence_empty_and_says_so() -> None:
    row = build_manifest([{**_row(), "bundle_sha256": "a" * 64}], [], [])[0]
    assert all(row[f"{k}_url_source"] == NONE_FOUND and row[f"{k}_url"] == "" for k in FILE_KINDS)
    assert row["bundle_sha256"] == "a" * 64 and row["xoa_version"] == ""


def test_builder_takes_md5_and_sizes_and_skips_other_sums() -> None:
    evidence = [_seen("bundle", f"{CF}/1.0.2/Xenium_V1_A/Xenium_V1_A_outs.zip", "o/r:p@1")]
    sums = [_sum("bundle", "md5", "A" * 32), _sum("he_image", "sha256", "b" * 64, source="o/mirror:q"),
            _sum("he_alignment", "md5", "c" * 31, size="129"), _sum("bundle", "", "", size="77", source="o/s:t@2")]
    row = build_manifest([_row()], evidence, sums)[0]
    assert (row["bundle_md5"], row["bundle_bytes"]) == ("a" * 32, "77")
    assert row["bundle_checksum_source"] == "o/r:p@1; o/s:t@2"
    assert row["he_image_md5"] == row["he_image_sha256"] == row["he_image_checksum_source"] == ""
    assert (row["he_alignment_md5"], row["he_alignment_bytes"]) == ("", "129")


@pytest.mark.parametrize(("evidence", "sums", "message"), [
    ([_seen("bundle", f"{CF}/1.0.2/Other/Other_outs.zip", "o/r:p@1")], [], "is not …/samples/xenium/"),
    ([_seen("bundle", f"{CF}/1.0.2/Xenium_V1_A/Xenium_V1_A_outs.zip", "o/r:p@1", section_id="nope")], [],
     "not in the manifest: nope"),
    ([_seen("bundle", f"{CF}/1.0.2/Xenium_V1_A/Xenium_V1_A_outs.zip", "o/r:p@1"),
      _seen("he_image", f"{CF}/1.1.0/Xenium_V1_A/Xenium_V1_A_he_image.ome.tif", "o/r:p@1")], [],
     "several XOA version folders: 1.0.2, 1.1.0"),
    ([], [_sum("bundle", "md5", "a" * 32), _sum("bundle", "md5", "b" * 32)], "a second, different MD5"),
    ([_seen("image", f"{CF}/1.0.2/Xenium_V1_A/Xenium_V1_A_outs.zip", "o/r:p@1")], [], "kind 'image'"),
])
def test_builder_refuses_contradicting_evidence(evidence: list, sums: list, message: str) -> None:
    with pytest.raises(InputError, match=message):
        build_manifest([_row()], evidence, sums)


def test_main_rewrites_the_manifest_identically(tmp_path: Path) -> None:
    manifest = tmp_path / "xenium_datasets.csv"
    shutil.copyfile(SHIPPED, manifest)
    shutil.copytree(EVIDENCE, tmp_path / "evidence")
    main(["--manifest", str(manifest)])
    assert manifest.read_bytes() == SHIPPED.read_bytes()
    (tmp_path / "evidence" / "xenium_checksums.csv").unlink()
    with pytest.raises(SystemExit, match="xenium_checksums.csv: file not found"):
        main(["--manifest", str(manifest)])
