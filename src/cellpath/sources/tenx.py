"""The ``10x`` fetch source: Xenium output bundles and their registered H&E, listed in a manifest.

Per section, ``raw_dir/<section_id>/`` receives the unpacked bundle (``experiment.xenium``,
``cells.parquet``, ...), ``<prefix>he_image.ome.tif``, ``<prefix>he_imagealignment.csv`` and a
``section.json`` that marks the section as finished and records the size and checksums of the three
downloads it was built from. A finished section whose record matches its manifest row is kept;
sections no longer selected are removed (``data/raw`` persists across DVC runs so that an
interrupted fetch keeps its finished sections). Downloads go to a cache folder outside ``raw_dir``
first (``data/.downloads/`` from the stage), so an interrupted run resumes its partial files; they
are removed once a section is done.

Each file has a URL, optional fallback URLs tried in order after it (10x serves its files from two
hosts), and optional size (bytes), MD5 and SHA-256, all checked. ``tenx.mirror`` replaces 10x's root
in every URL (:func:`mirror_url`). A URL derived by 10x's naming (``*_url_source`` ``derived``) that no
server has stops its section with the dataset page to look at. A section that fails does not stop
the others; the error raised after the last one names every failed section.

``python -m cellpath.sources.tenx`` rebuilds the manifest's URL, source, version, MD5 and size
columns from the evidence files in ``data/manifests/evidence/`` (:func:`build_manifest`).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

from cellpath.config import SECTION_ID_PATTERN, TenxConfig
from cellpath.errors import CellPathError, DownloadError, InputError
from cellpath.io.atomic import atomic_output, prune_other_folders, remove_path, remove_stale_temporaries
from cellpath.io.layout import DEFAULT_MANIFEST
from cellpath.sources.download import (SUPPORTED_SCHEMES, RemoteNotFound, download_file, part_path,
                                       safe_extract)

log = logging.getLogger(__name__)

FILE_KINDS = ("bundle", "he_image", "he_alignment")
#: The columns every manifest must have.
MANIFEST_COLUMNS = (
    "section_id", "dataset", "organ", "status", "cells", "agr_bacc", "rank", "panel_s25", "page_url",
    "prefix",
    *(f"{kind}_{field}" for kind in FILE_KINDS for field in ("url", "sha256", "bytes")),
)
#: Columns read when present (empty when absent): fallbacks, provenance, MD5 and the XOA version.
OPTIONAL_COLUMNS = (
    "xoa_version",
    *(f"{kind}_{field}" for kind in FILE_KINDS for field in ("url_fallback", "url_source", "md5", "checksum_source")),
)
#: The shipped manifest's column order (what :func:`main` writes).
SHIPPED_COLUMNS = (
    *MANIFEST_COLUMNS[:10], "xoa_version",
    *(f"{kind}_{field}" for kind in FILE_KINDS
      for field in ("url", "url_fallback", "url_source", "md5", "sha256", "bytes", "checksum_source")),
)
SECTION_MARKER = "section.json"
SHA256_PATTERN = re.compile(r"^[0-9a-fA-F]{64}$")
MD5_PATTERN = re.compile(r"^[0-9a-fA-F]{32}$")
XOA_VERSION_PATTERN = re.compile(r"^[0-9]+(\.[0-9]+)*$")
URL_SEPARATOR = "|"  # between the URLs of a *_url_fallback cell
DERIVED = "derived"  # *_url_source of a URL built by 10x's naming from the bundle's folder
NONE_FOUND = "none found"  # *_url_source of a file no evidence names and none could be derived
#: 10x's layout: a root ending in ``/samples/xenium/``, then ``<XOA version>/<Name>/<file>``.
TENX_URL = re.compile(r"^(?P<root>[A-Za-z][A-Za-z0-9+.-]*://[^?#]*?/samples/xenium/)"
                      r"(?P<version>[^/?#]+)/(?P<name>[^/?#]+)/(?P<file>[^/?#]+)$")
#: 10x's file names: ``<Name>`` (the manifest's prefix without its trailing ``_``) and these suffixes.
TENX_SUFFIXES = {"bundle": "_outs.zip", "he_image": "_he_image.ome.tif", "he_alignment": "_he_imagealignment.csv"}
EVIDENCE_URLS = "xenium_download_urls.csv"
EVIDENCE_CHECKSUMS = "xenium_checksums.csv"


@dataclass(frozen=True)
class RemoteFile:
    """One file to download: ``url`` None until filled in, ``fallbacks`` tried after it in order,
    ``source`` where the URL was seen (``derived``: built by 10x's naming). ``size`` in bytes."""

    url: str | None
    sha256: str | None
    size: int | None
    md5: str | None = None
    fallbacks: tuple[str, ...] = ()
    source: str = ""

    @property
    def urls(self) -> tuple[str, ...]:
        """Every URL of the file, in the order they are tried."""
        return (self.url, *self.fallbacks) if self.url else ()

    @property
    def derived(self) -> bool:
        return self.source == DERIVED


@dataclass(frozen=True)
class ManifestSection:
    """One row of the Xenium manifest."""

    section_id: str
    dataset: str
    organ: str
    status: str
    cells: int
    agr_bacc: float | None
    rank: int | None
    panel_s25: bool
    page_url: str
    prefix: str
    bundle: RemoteFile
    he_image: RemoteFile
    he_alignment: RemoteFile
    xoa_version: str | None = None

    @property
    def missing_url_columns(self) -> tuple[str, ...]:
        """The ``*_url`` columns still empty for this section."""
        return tuple(f"{kind}_url" for kind in FILE_KINDS if getattr(self, kind).url is None)

    @property
    def he_image_name(self) -> str:
        return f"{self.prefix}he_image.ome.tif"

    @property
    def he_alignment_name(self) -> str:
        return f"{self.prefix}he_imagealignment.csv"


@dataclass(frozen=True)
class PlannedFile:
    """One download of a section: its ``kind``, the file ``name`` it is saved as, the URLs to try in order."""

    kind: str
    name: str
    urls: tuple[str, ...]
    remote: RemoteFile


def read_manifest(path: Path) -> list[ManifestSection]:
    """Parse and validate the manifest CSV; raise one InputError naming the file and every problem."""
    path = Path(path)
    if not path.is_file():
        raise InputError("manifest not found; set tenx.manifest in params.yaml", path=path)
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in MANIFEST_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise InputError(f"missing column(s): {', '.join(missing)}; see data/manifests/README.md",
                             path=path)
        rows = list(reader)
    problems: list[str] = []
    sections = [s for line, row in enumerate(rows, start=2) if (s := _parse_row(row, line, problems))]
    ids = [s.section_id for s in sections]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        problems.append(f"section_id must be unique; repeated: {', '.join(repeated)}")
    if problems:
        raise InputError("\n".join(problems), path=path)
    return sections


def _parse_row(row: dict[str, str], line: int, problems: list[str]) -> ManifestSection | None:
    """One manifest row, or None after appending what is wrong with it to ``problems``."""
    before = len(problems)
    value = {**dict.fromkeys(OPTIONAL_COLUMNS, ""), **{k: (v or "").strip() for k, v in row.items() if k is not None}}
    where = f"line {line} (section {value['section_id'] or '?'})"

    def fail(column: str, what: str) -> None:
        problems.append(f"{where}: column {column}: {what}")

    if not re.fullmatch(SECTION_ID_PATTERN, value["section_id"]):
        fail("section_id", f"{value['section_id']!r} must match {SECTION_ID_PATTERN}")
    if any(sep in value["prefix"] for sep in ("/", "\\", "\0")):
        fail("prefix", f"{value['prefix']!r} must be a file-name prefix, without path separators")
    if value["xoa_version"] and not XOA_VERSION_PATTERN.fullmatch(value["xoa_version"]):
        fail("xoa_version", f"{value['xoa_version']!r} must be a version such as 1.0.2, or empty")
    numbers = {
        "cells": _parse_int(value["cells"], required=True),
        "rank": _parse_int(value["rank"], required=False),
        "agr_bacc": _parse_float(value["agr_bacc"]),
    }
    for column, parsed in numbers.items():
        if isinstance(parsed, str):
            fail(column, parsed)
    if value["panel_s25"] not in ("0", "1"):
        fail("panel_s25", f"{value['panel_s25']!r} must be 0 or 1")
    files = {kind: _parse_remote(value, kind, fail) for kind in FILE_KINDS}
    if len(problems) > before:
        return None
    return ManifestSection(
        section_id=value["section_id"], dataset=value["dataset"], organ=value["organ"],
        status=value["status"], cells=numbers["cells"], agr_bacc=numbers["agr_bacc"],
        rank=numbers["rank"], panel_s25=value["panel_s25"] == "1", page_url=value["page_url"],
        prefix=value["prefix"], xoa_version=value["xoa_version"] or None, **files,
    )


def _parse_int(text: str, *, required: bool) -> int | None | str:
    """A non-negative integer, None when empty and optional, or a message saying what is wrong."""
    if not text:
        return "must not be empty" if required else None
    return int(text) if text.isdigit() else f"{text!r} is not a non-negative integer"


def _parse_float(text: str) -> float | None | str:
    """A number, None when empty, or a message saying what is wrong."""
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return f"{text!r} is not a number"


def _parse_remote(value: dict[str, str], kind: str, fail: Callable[[str, str], None]) -> RemoteFile:
    """The ``<kind>_url/_url_fallback/_url_source/_md5/_sha256/_bytes`` columns; problems go to
    ``fail(column, what)``."""
    url, sha, md5, size = (value[f"{kind}_{field}"] for field in ("url", "sha256", "md5", "bytes"))
    fallbacks = tuple(u.strip() for u in value[f"{kind}_url_fallback"].split(URL_SEPARATOR) if u.strip())
    schemes = ", ".join(s + "://" for s in SUPPORTED_SCHEMES)
    for column, each in [(f"{kind}_url", url)] * bool(url) + [(f"{kind}_url_fallback", u) for u in fallbacks]:
        if urlparse(each).scheme not in SUPPORTED_SCHEMES:
            fail(column, f"{each!r} must start with {schemes}")
    if fallbacks and not url:
        fail(f"{kind}_url_fallback", f"fallback URL(s) without a {kind}_url; put the first URL in {kind}_url")
    if sha and not SHA256_PATTERN.fullmatch(sha):
        fail(f"{kind}_sha256", f"{sha!r} is not a 64-digit hex SHA-256")
    if md5 and not MD5_PATTERN.fullmatch(md5):
        fail(f"{kind}_md5", f"{md5!r} is not a 32-digit hex MD5")
    parsed_size = _parse_int(size, required=False)
    if isinstance(parsed_size, str):
        fail(f"{kind}_bytes", parsed_size)
        parsed_size = None
    return RemoteFile(url=url or None, sha256=sha.lower() or None, size=parsed_size, md5=md5.lower() or None,
                      fallbacks=fallbacks, source=value[f"{kind}_url_source"])


def select_sections(sections: list[ManifestSection], wanted: list[str], manifest: Path) -> list[ManifestSection]:
    """The sections to fetch: ``wanted`` in order, or every row with a bundle_url when empty.

    Raises one InputError for unknown ids, and one listing selected sections whose URL columns
    are still empty.
    """
    by_id = {s.section_id: s for s in sections}
    if wanted:
        unknown = [w for w in wanted if w not in by_id]
        if unknown:
            raise InputError(
                f"tenx.sections lists section(s) not in the manifest: {', '.join(unknown)}; "
                "use section_id values from the manifest's first column", path=manifest,
            )
        chosen = [by_id[w] for w in wanted]
    else:
        chosen = [s for s in sections if s.bundle.url is not None]
        if not chosen:
            raise InputError(
                "no section has a bundle_url yet; fill in the bundle/he_image/he_alignment URL "
                "columns of the manifest from the 10x dataset pages (see data/manifests/README.md), "
                "or use source: synthetic", path=manifest,
            )
    incomplete = [f"{s.section_id} ({', '.join(s.missing_url_columns)})" for s in chosen if s.missing_url_columns]
    if incomplete:
        raise InputError(
            f"selected section(s) without download URLs: {'; '.join(incomplete)}; fill in the URL "
            "columns of the manifest from each section's page_url (see data/manifests/README.md) "
            "or remove them from tenx.sections", path=manifest,
        )
    return chosen


def mirror_base(mirror: str, base_dir: Path = Path(".")) -> str:
    """``tenx.mirror`` as a base URL without a trailing ``/``: an ``http(s)://`` or ``file://`` URL as
    given, a folder path (relative to ``base_dir``) as the ``file://`` URL of that folder."""
    if "://" in mirror:
        return mirror.rstrip("/")
    return (base_dir / mirror).resolve().as_uri()


def mirror_url(url: str, mirror: str, base_dir: Path = Path(".")) -> str | None:
    """``url`` as served by ``mirror``: 10x's root — scheme, host and path up to and including
    ``/samples/xenium/`` — replaced by :func:`mirror_base`, keeping ``<XOA version>/<Name>/<file>``.
    None when ``url`` is not in that layout."""
    match = TENX_URL.match(url)
    if match is None:
        return None
    return f"{mirror_base(mirror, base_dir)}/{match['version']}/{match['name']}/{match['file']}"


def download_plan(section: ManifestSection, config: TenxConfig, base_dir: Path = Path(".")) -> list[PlannedFile]:
    """The three downloads of ``section`` (bundle first), with ``config.mirror`` in place of 10x's root when set.

    Raises InputError naming the section and file when the mirror cannot serve one of its URLs.
    """
    names = {"bundle": "bundle", "he_image": section.he_image_name, "he_alignment": section.he_alignment_name}
    plan = []
    for kind in FILE_KINDS:
        remote: RemoteFile = getattr(section, kind)
        urls = remote.urls
        if config.mirror is not None:
            urls = _mirrored(section.section_id, kind, urls, config.mirror, base_dir)
        plan.append(PlannedFile(kind=kind, name=names[kind], urls=urls, remote=remote))
    return plan


def _mirrored(section_id: str, kind: str, urls: tuple[str, ...], mirror: str, base_dir: Path) -> tuple[str, ...]:
    """``urls`` on the mirror, in order, each once (10x's two hosts map to the same mirror URL)."""
    mirrored: list[str] = []
    for url in urls:
        local = mirror_url(url, mirror, base_dir)
        if local is None:
            raise InputError(
                f"{kind} URL {url!r} is not in 10x's layout (…/samples/xenium/<XOA version>/<Name>/<file>), "
                "so tenx.mirror cannot serve it; give the file such a URL in the manifest, or set "
                "tenx.mirror: null to download it as it is", section=section_id,
            )
        if local not in mirrored:
            mirrored.append(local)
    return tuple(mirrored)


def check_downloads(sections: list[ManifestSection], config: TenxConfig,
                    base_dir: Path = Path(".")) -> dict[str, list[PlannedFile]]:
    """Each selected section's download plan (:func:`download_plan`), by section id.

    Raises InputError when ``tenx.mirror`` names a folder that does not exist or cannot serve a URL.
    """
    problem = _mirror_folder_problem(config.mirror, base_dir) if config.mirror is not None else None
    if problem is not None:
        raise InputError(f"tenx.mirror: {config.mirror!r}: {problem}; give the folder that holds "
                         "<XOA version>/<Name>/<file> as 10x lays its files out, or an http:// base URL "
                         "(see data/manifests/README.md)")
    return {section.section_id: download_plan(section, config, base_dir) for section in sections}


def _mirror_folder_problem(mirror: str, base_dir: Path) -> str | None:
    """What is wrong with a folder or ``file://`` mirror (None when it is an existing folder, or a web URL)."""
    parsed = urlparse(mirror_base(mirror, base_dir))
    if parsed.scheme != "file":
        return None
    if parsed.netloc not in ("", "localhost") or not parsed.path:
        return "a file:// mirror is file:///absolute/path"
    folder = Path(url2pathname(parsed.path))
    return None if folder.is_dir() else f"folder not found ({folder})"


def fetch_tenx(config: TenxConfig, raw_dir: Path, downloads_dir: Path, *, base_dir: Path = Path(".")) -> dict:
    """Download and unpack the selected sections into ``raw_dir/<section_id>/``.

    Relative ``config.manifest``, ``config.mirror``, ``raw_dir`` and ``downloads_dir`` are taken from
    ``base_dir``. Finished sections (``section.json`` matching the manifest row) are skipped; section
    folders not selected are removed. A section that fails does not stop the others: one DownloadError
    after the last names each failed section. Returns ``{"source", "fetched", "skipped", "removed",
    "bytes"}``: section ids, and the total size in bytes of the files downloaded for the fetched sections.
    """
    manifest = base_dir / config.manifest
    raw_dir = base_dir / raw_dir
    downloads_dir = base_dir / downloads_dir
    chosen = select_sections(read_manifest(manifest), list(config.sections), manifest)
    plans = check_downloads(chosen, config, base_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(raw_dir)
    removed = prune_other_folders(raw_dir, {section.section_id for section in chosen})
    if removed:
        log.info("removed %d section(s) no longer selected: %s", len(removed), ", ".join(removed))
    summary: dict = {"source": "10x", "fetched": [], "skipped": [], "removed": removed, "bytes": 0}
    failures: list[str] = []
    for section in chosen:
        if is_fetched(raw_dir / section.section_id, section):
            log.info("section %s: already fetched, skipping", section.section_id)
            summary["skipped"].append(section.section_id)
            continue
        try:
            summary["bytes"] += fetch_section(section, plans[section.section_id], raw_dir,
                                              downloads_dir / section.section_id, config)
        except DownloadError as exc:
            log.error("section %s: %s", section.section_id, exc)
            failures.append(f"section {section.section_id}: {exc}")
            continue
        summary["fetched"].append(section.section_id)
    if failures:
        raise DownloadError(_fetch_failure(failures, len(chosen), raw_dir))
    return summary


def _fetch_failure(failures: list[str], selected: int, raw_dir: Path) -> str:
    """One message for every failed section, and what stays in place for the next run."""
    done = selected - len(failures)
    kept = f"; the {done} finished one(s) are in {raw_dir} and are not downloaded again" if done else ""
    return "\n".join(failures) + f"\n({len(failures)} of {selected} selected section(s) failed{kept})"


def fetch_section(section: ManifestSection, plan: list[PlannedFile], raw_dir: Path, cache: Path,
                  config: TenxConfig) -> int:
    """Build ``raw_dir/<section_id>/`` atomically from ``plan``'s downloads, cached in ``cache``; return their bytes."""
    downloads = {planned.name: _download(section, planned, cache / planned.name, config) for planned in plan}
    bundle = downloads[plan[0].name]
    log.info("section %s: unpacking %s", section.section_id, bundle)
    with atomic_output(raw_dir / section.section_id) as out:
        safe_extract(bundle, out, max_total_bytes=config.max_file_bytes)
        for planned in plan[1:]:
            _link_or_copy(downloads[planned.name], out / planned.name)
        (out / SECTION_MARKER).write_text(json.dumps(_section_record(section), indent=2) + "\n")
    total = sum(p.stat().st_size for p in downloads.values())
    remove_path(cache)
    return total


def _download(section: ManifestSection, planned: PlannedFile, dest: Path, config: TenxConfig) -> Path:
    """Download ``planned`` to ``dest`` from the first of its URLs that works.

    Raises one DownloadError naming the file and what each URL answered.
    """
    assert planned.urls  # select_sections refuses sections without URLs
    remote = planned.remote
    failures: list[DownloadError] = []
    for attempt, url in enumerate(planned.urls):
        if attempt and remote.md5 is None and remote.sha256 is None:
            part_path(dest).unlink(missing_ok=True)  # nothing could tell two hosts' bytes apart: start over
        log.info("downloading %s -> %s", url, dest)
        try:
            return download_file(
                url, dest, md5=remote.md5, sha256=remote.sha256, size=remote.size, retries=config.retries,
                timeout_s=config.timeout_s, max_bytes=config.max_file_bytes, progress=sys.stderr.isatty(),
            )
        except DownloadError as exc:
            failures.append(exc)
            if attempt + 1 < len(planned.urls):
                log.warning("%s; trying the next URL, %s", exc, planned.urls[attempt + 1])
    raise DownloadError(_download_failure(section, planned, failures))


def _download_failure(section: ManifestSection, planned: PlannedFile, failures: list[DownloadError]) -> str:
    """The message for a file none of whose URLs worked: the file, each failure, the dataset page."""
    name = unquote(urlparse(planned.urls[0]).path.rsplit("/", 1)[-1]) or planned.name
    what = f"{planned.kind} ({name})"
    if planned.remote.derived and all(isinstance(f, RemoteNotFound) for f in failures):
        return (f"{what}: no server has the file at the URL(s) derived from the bundle's folder by 10x's naming "
                f"({', '.join(planned.urls)}); look the file up on the dataset page {section.page_url} and put its "
                f"URL in {planned.kind}_url (and where you found it in {planned.kind}_url_source)")
    tried = " | then: ".join(str(failure) for failure in failures)
    return f"{what}: {tried} (the dataset page: {section.page_url})"


def _link_or_copy(source: Path, dest: Path) -> None:
    """Hard-link ``source`` to ``dest`` (no extra disk), copying when the filesystem cannot link."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def is_fetched(folder: Path, section: ManifestSection) -> bool:
    """Whether ``folder`` is a finished section built from the files ``section`` lists now."""
    try:
        record = json.loads((folder / SECTION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return record == _section_record(section)


def _section_record(section: ManifestSection) -> dict:
    return {
        "section_id": section.section_id,
        "dataset": section.dataset,
        "organ": section.organ,
        "status": section.status,
        "source": "10x",
        "prefix": section.prefix,
        "files": {kind: _file_record(getattr(section, kind)) for kind in FILE_KINDS},
    }


def _file_record(remote: RemoteFile) -> dict:
    """What ``section.json`` records of a download: sha256 and bytes, and md5 when the manifest has one."""
    record: dict = {"sha256": remote.sha256, "bytes": remote.size}
    if remote.md5 is not None:
        record["md5"] = remote.md5
    return record


# --- Building the manifest's download columns from evidence --------------------------------------------


def build_manifest(rows: list[dict[str, str]], url_evidence: list[dict[str, str]],
                   checksum_evidence: list[dict[str, str]]) -> list[dict[str, str]]:
    """``rows`` with their download columns filled from the evidence (pure; other columns are kept).

    Per file: every URL seen, the one seen in most repositories first (ties: the evidence's order),
    the others in ``*_url_fallback``; ``*_url_source`` is the primary URL's best source (a
    ``repository:path@commit`` before one without a commit, before an unattributed one). An H&E file
    or alignment no evidence names is derived from each bundle URL by 10x's naming (source ``derived``);
    with no bundle URL either, the source is ``none found``. ``xoa_version`` is the URLs' version folder;
    ``*_md5`` and ``*_bytes`` come from the checksum evidence (``*_bytes`` and ``*_sha256`` kept otherwise).
    Raises InputError for evidence naming an unknown section, another section's files, or two versions.
    """
    urls = _urls_by_file(url_evidence)
    sums = _sums_by_file(checksum_evidence)
    unknown = sorted({sid for sid, _ in [*urls, *sums]} - {row["section_id"] for row in rows})
    if unknown:
        raise InputError(f"evidence for section(s) not in the manifest: {', '.join(unknown)}")
    return [_built_row(row, urls, sums) for row in rows]


def _urls_by_file(evidence: list[dict[str, str]]) -> dict[tuple[str, str], dict[str, list[str]]]:
    """(section_id, kind) → URL → its sources, in the evidence's order."""
    found: dict[tuple[str, str], dict[str, list[str]]] = {}
    for line, item in enumerate(evidence, start=2):
        _check_kind(item["kind"], EVIDENCE_URLS, line)
        found.setdefault((item["section_id"], item["kind"]), {}).setdefault(item["url"], []).append(
            item["source_repo_path_commit"])
    return found


def _sums_by_file(evidence: list[dict[str, str]]) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(section_id, kind) → (md5, bytes, sources). Rows with neither a well-formed MD5 nor a size are
    left out (SHA-256 sums of third-party copies, malformed sums); two different values are an error."""
    found: dict[tuple[str, str], tuple[str, str, str]] = {}
    for line, item in enumerate(evidence, start=2):
        _check_kind(item["kind"], EVIDENCE_CHECKSUMS, line)
        value = item["value"].strip().lower()
        md5 = value if item["algo"] == "md5" and MD5_PATTERN.fullmatch(value) else ""
        size = item["bytes"].strip() if item["bytes"].strip().isdigit() else ""
        if not (md5 or size):
            continue
        key = (item["section_id"], item["kind"])
        old_md5, old_size, old_source = found.get(key, ("", "", ""))
        if (old_md5 and md5 and old_md5 != md5) or (old_size and size and old_size != size):
            raise InputError(f"{EVIDENCE_CHECKSUMS} line {line}: {key[0]} {key[1]}: a second, different MD5 or size")
        sources = "; ".join(dict.fromkeys(s for s in (old_source, item["source"]) if s))
        found[key] = (old_md5 or md5, old_size or size, sources)
    return found


def _check_kind(kind: str, where: str, line: int) -> None:
    if kind not in FILE_KINDS:
        raise InputError(f"{where} line {line}: kind {kind!r} must be one of {', '.join(FILE_KINDS)}")


def _source_rank(source: str) -> int:
    """0: ``repository:path@commit``; 1: a repository path without its commit; 2: unattributed."""
    if source.startswith("unattributed"):
        return 2
    return 0 if "@" in source else 1


def _chosen_urls(seen: dict[str, list[str]]) -> tuple[tuple[str, ...], str]:
    """The URLs in the order to try them (most repositories first, then the evidence's order) and the
    first one's best source."""
    order = list(seen)

    def repositories(url: str) -> int:
        return len({s.split(":", 1)[0] for s in seen[url] if _source_rank(s) < 2})

    ranked = tuple(sorted(order, key=lambda url: (-repositories(url), order.index(url))))
    sources = seen[ranked[0]]
    return ranked, min(sources, key=lambda s: (_source_rank(s), sources.index(s)))


def _derived_url(bundle_url: str, kind: str) -> str:
    """The ``kind`` file's URL in the bundle's folder, by 10x's naming (``<Name><suffix>``)."""
    match = TENX_URL.match(bundle_url)
    assert match is not None  # _file_urls checked every bundle URL
    return f"{match['root']}{match['version']}/{match['name']}/{match['name']}{TENX_SUFFIXES[kind]}"


def _file_urls(row: dict[str, str], kind: str, seen: dict[str, list[str]],
               bundle: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """(URLs to try, source) of one file of a manifest row; checks each URL names the row's files."""
    if seen:
        chosen, source = _chosen_urls(seen)
    elif bundle:
        chosen, source = tuple(_derived_url(url, kind) for url in bundle), DERIVED
    else:
        return (), NONE_FOUND
    name = row["prefix"].removesuffix("_")
    for url in chosen:
        match = TENX_URL.match(url)
        if match is None or match["name"] != name or match["file"] != name + TENX_SUFFIXES[kind]:
            raise InputError(f"{EVIDENCE_URLS}: {row['section_id']} {kind}: {url} is not …/samples/xenium/"
                             f"<XOA version>/{name}/{name}{TENX_SUFFIXES[kind]} (from the row's prefix)")
    return chosen, source


def _built_row(row: dict[str, str], urls: dict, sums: dict) -> dict[str, str]:
    """One manifest row with its download columns from the evidence."""
    sid = row["section_id"]
    out = {**dict.fromkeys(SHIPPED_COLUMNS, ""), **row}
    bundle, _ = _file_urls(row, "bundle", urls.get((sid, "bundle"), {}), ())
    versions: set[str] = set()
    for kind in FILE_KINDS:
        chosen, source = _file_urls(row, kind, urls.get((sid, kind), {}), bundle)
        versions.update(match["version"] for url in chosen if (match := TENX_URL.match(url)))
        md5, size, where = sums.get((sid, kind), ("", "", ""))
        out.update({f"{kind}_url": chosen[0] if chosen else "", f"{kind}_url_fallback": URL_SEPARATOR.join(chosen[1:]),
                    f"{kind}_url_source": source, f"{kind}_md5": md5,
                    f"{kind}_bytes": size or out[f"{kind}_bytes"], f"{kind}_checksum_source": where})
    if len(versions) > 1:
        raise InputError(f"{EVIDENCE_URLS}: {sid}: URLs in several XOA version folders: {', '.join(sorted(versions))}")
    out["xoa_version"] = versions.pop() if versions else ""
    return out


def _read_csv(path: Path) -> tuple[list[dict[str, str]], list[str]]:
    """The rows (every value a string) and the column names of a CSV file."""
    if not path.is_file():
        raise InputError("file not found", path=path)
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = [{k: v or "" for k, v in row.items()} for row in reader]
        return rows, list(reader.fieldnames or ())


def write_manifest(path: Path, rows: list[dict[str, str]], columns: list[str]) -> None:
    """Write ``rows`` as the manifest CSV (``columns`` in order, ``\\n`` line ends), atomically."""
    with atomic_output(path) as tmp, Path(tmp).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    """``python -m cellpath.sources.tenx [--manifest CSV] [--evidence FOLDER]``: rebuild the manifest's
    download columns from the evidence CSVs (by default ``evidence/`` beside the manifest)."""
    parser = argparse.ArgumentParser(prog="python -m cellpath.sources.tenx", description=main.__doc__)
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--evidence", type=Path, default=None)
    args = parser.parse_args(argv)
    evidence = args.evidence or args.manifest.parent / "evidence"
    try:
        rows, columns = _read_csv(args.manifest)
        built = build_manifest(rows, _read_csv(evidence / EVIDENCE_URLS)[0],
                               _read_csv(evidence / EVIDENCE_CHECKSUMS)[0])
    except CellPathError as exc:
        raise SystemExit(f"python -m cellpath.sources.tenx: error: {exc}") from None
    extra = [c for c in columns if c not in SHIPPED_COLUMNS]
    write_manifest(args.manifest, built, [*SHIPPED_COLUMNS, *extra])
    log.info("wrote %s: %d rows", args.manifest, len(built))


if __name__ == "__main__":
    main()
