"""The ``10x`` fetch source: Xenium output bundles and their registered H&E, listed in a manifest.

Per section, ``raw_dir/<section_id>/`` receives the unpacked bundle (``experiment.xenium``,
``cells.parquet``, ...), ``<prefix>he_image.ome.tif``, ``<prefix>he_imagealignment.csv`` and a
``section.json`` that marks the section as finished and records the URL, size, MD5 and SHA-256 of the
three downloads it was built from. A finished section whose record matches its manifest row and the
download lock is kept;
sections no longer selected are removed (``data/raw`` persists across DVC runs so that an
interrupted fetch keeps its finished sections). Downloads go to a cache folder outside ``raw_dir``
first (``data/.downloads/`` from the stage), so an interrupted run resumes its partial files; they
are removed once a section is done.

Each file has a URL, optional fallback URLs tried in order after it (10x serves its files from two
hosts), and optional size (bytes), MD5 and SHA-256, all checked. No file is used before it matches a
checksum: the published one where the manifest has it, and otherwise the size and digests its first
download recorded in the download lock (``tenx.lock``, :mod:`cellpath.sources.lock`). A bundle that
cannot be unpacked (truncated, corrupt, hostile: :mod:`cellpath.sources.archives`) fails its section and
is removed from the cache. One fetch runs at a time (``data/.downloads/.fetch.lock``). ``tenx.mirror`` replaces 10x's root
in every URL (:func:`mirror_url`). A URL derived by 10x's naming (``*_url_source`` ``derived``) that no
server has stops its section with the dataset page to look at. A section that fails does not stop
the others; the error raised after the last one names every failed section.

``python -m cellpath.sources.tenx`` rebuilds the manifest's URL, source, version, MD5 and size
columns from the evidence files in ``data/manifests/evidence/`` (:func:`build_manifest`).
"""

from __future__ import annotations

import argparse
import csv
import io
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

from cellpath.config import SECTION_ID_PATTERN, TenxConfig, has_credentials
from cellpath.errors import CellPathError, DownloadError, InputError
from cellpath.io.atomic import atomic_output, prune_other_folders, remove_path, remove_stale_temporaries
from cellpath.io.layout import DEFAULT_MANIFEST
from cellpath.io.locks import exclusive
from cellpath.io.text import read_utf8
from cellpath.sources.archives import ARCHIVE_SUFFIXES, archive_format, safe_extract
from cellpath.sources.download import SUPPORTED_SCHEMES, Downloaded, RemoteNotFound, download_file, origin_path
from cellpath.sources.lock import FIRST_USE, NOT_YET, PUBLISHED, Lock, LockedFile, add_to_lock, read_lock

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
FETCH_LOCK = ".fetch.lock"  # in the download cache: one fetch of a project at a time
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
    with io.StringIO(read_utf8(path), newline="") as fh:
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
        if has_credentials(each):
            fail(column, f"a URL that holds a password or token must not be in the manifest, a file shared with "
                         "the project; give the file a URL without one (or a tenx.mirror that needs none)")
        elif urlparse(each).scheme not in SUPPORTED_SCHEMES:
            fail(column, f"{each!r} must start with {schemes}")
    if kind == "bundle":
        for column, each in [(f"{kind}_url", url)] * bool(url) + [(f"{kind}_url_fallback", u) for u in fallbacks]:
            if archive_format(url_file_name(each)) is None:
                fail(column, f"{each!r} must name a zip or tar archive ({', '.join(ARCHIVE_SUFFIXES)}): its "
                             "ending decides how it is unpacked")
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
    lock_file = base_dir / config.lock_file
    conflicts = lock_conflicts(sections, read_lock(lock_file))
    if conflicts:
        raise InputError("\n".join(conflicts) + "\nthe manifest's checksum or the lock is wrong: if 10x republished "
                         "the file, delete its row from the lock (the next download records it again); otherwise "
                         "correct the manifest", path=lock_file)
    return {section.section_id: download_plan(section, config, base_dir) for section in sections}


def expected_file(section_id: str, kind: str, remote: RemoteFile, lock: Lock) -> tuple[dict[str, object], str]:
    """What a download of the file must match (``md5``, ``sha256``, ``size``: the manifest's published
    values, else the lock's) and what it is verified by (:data:`PUBLISHED`, :data:`FIRST_USE`, or
    :data:`NOT_YET` when the first download is still to record it)."""
    locked = lock.get((section_id, kind))
    expected = {"md5": remote.md5 or (locked.md5 if locked else None),
                "sha256": remote.sha256 or (locked.sha256 if locked else None),
                "size": remote.size if remote.size is not None else (locked.size if locked else None)}
    trust = PUBLISHED if (remote.md5 or remote.sha256) else FIRST_USE if locked else NOT_YET
    return expected, trust


def lock_conflicts(sections: list[ManifestSection], lock: Lock) -> list[str]:
    """Each file whose published MD5, SHA-256 or size differs from the one its first download recorded."""
    found = []
    for section in sections:
        for kind in FILE_KINDS:
            remote, locked = getattr(section, kind), lock.get((section.section_id, kind))
            if locked is None:
                continue
            for column, published, recorded in (("md5", remote.md5, locked.md5), ("sha256", remote.sha256,
                                                 locked.sha256), ("bytes", remote.size, locked.size)):
                if published is not None and published != recorded:
                    found.append(f"section {section.section_id}: {kind}_{column} is {published} in the manifest, but "
                                 f"the file first downloaded from {locked.url} had {recorded}")
    return found


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
    lock_file = base_dir / config.lock_file
    with exclusive(downloads_dir / FETCH_LOCK, "a fetch of this project's 10x sections"):
        raw_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(raw_dir)
        removed = prune_other_folders(raw_dir, {section.section_id for section in chosen})
        if removed:
            log.info("removed %d section(s) no longer selected: %s", len(removed), ", ".join(removed))
        summary: dict = {"source": "10x", "fetched": [], "skipped": [], "removed": removed, "bytes": 0}
        failures: list[str] = []
        for section in chosen:
            lock = read_lock(lock_file)
            folder = raw_dir / section.section_id
            if is_fetched(folder, section, lock):
                log.info("section %s: already fetched, skipping", section.section_id)
                add_to_lock(lock_file, recorded_files(folder))  # a lock that lacks the rows gets them back
                summary["skipped"].append(section.section_id)
                continue
            try:
                summary["bytes"] += fetch_section(section, plans[section.section_id], raw_dir,
                                                  downloads_dir / section.section_id, config, lock, lock_file)
            except DownloadError as exc:
                log.error("section %s: %s", section.section_id, exc)
                failures.append(f"section {section.section_id}: {exc}")
                continue
            summary["fetched"].append(section.section_id)
    summary["verified"] = verification_counts(chosen, read_lock(lock_file))
    if failures:
        raise DownloadError(_fetch_failure(failures, len(chosen), raw_dir))
    return summary


def verification_counts(sections: list[ManifestSection], lock: Lock) -> dict[str, int]:
    """How many of the sections' files each kind of check verifies (:func:`expected_file`'s second value)."""
    counts = dict.fromkeys((PUBLISHED, FIRST_USE, NOT_YET), 0)
    for section in sections:
        for kind in FILE_KINDS:
            counts[expected_file(section.section_id, kind, getattr(section, kind), lock)[1]] += 1
    return counts


def _fetch_failure(failures: list[str], selected: int, raw_dir: Path) -> str:
    """One message for every failed section, and what stays in place for the next run."""
    done = selected - len(failures)
    kept = f"; the {done} finished one(s) are in {raw_dir} and are not downloaded again" if done else ""
    return "\n".join(failures) + f"\n({len(failures)} of {selected} selected section(s) failed{kept})"


def fetch_section(section: ManifestSection, plan: list[PlannedFile], raw_dir: Path, cache: Path,
                  config: TenxConfig, lock: Lock, lock_file: Path) -> int:
    """Build ``raw_dir/<section_id>/`` atomically from ``plan``'s downloads, cached in ``cache``, each checked
    against the manifest's checksums and ``lock``; record the files the lock lacks in ``lock_file``; return
    the bytes downloaded. A bundle that cannot be unpacked is removed from the cache."""
    downloads = {planned.kind: _download(section, planned, cache / planned.name, config, lock, lock_file)
                 for planned in plan}
    bundle, name = downloads["bundle"], url_file_name(plan[0].urls[0])
    log.info("section %s: unpacking %s", section.section_id, bundle.path)
    files = {kind: {"url": planned.urls[0], "bytes": downloads[kind].size, "md5": downloads[kind].md5,
                    "sha256": downloads[kind].sha256,
                    "verified": PUBLISHED if expected_file(section.section_id, kind, planned.remote, lock)[1] == PUBLISHED
                    else FIRST_USE}
             for kind, planned in zip(FILE_KINDS, plan)}
    try:
        with atomic_output(raw_dir / section.section_id) as out:
            safe_extract(bundle.path, out, archive_name=name, max_total_bytes=config.max_file_bytes)
            for planned in plan[1:]:
                _link_or_copy(downloads[planned.kind].path, out / planned.name)
            record = {**_section_record(section), "files": files}
            (out / SECTION_MARKER).write_text(json.dumps(record, indent=2) + "\n")
    except DownloadError as exc:
        for stale in (bundle.path, origin_path(bundle.path)):
            stale.unlink(missing_ok=True)
        raise DownloadError(f"bundle ({name}): {exc}; the cached archive was removed, so the next run downloads "
                            "it again") from None
    add_to_lock(lock_file, recorded_files(raw_dir / section.section_id))
    remove_path(cache)
    return sum(d.size for d in downloads.values())


def _download(section: ManifestSection, planned: PlannedFile, dest: Path, config: TenxConfig, lock: Lock,
              lock_file: Path) -> Downloaded:
    """Download ``planned`` to ``dest`` from the first of its URLs that works, checked against the
    manifest's checksums and the lock (:func:`expected_file`).

    Raises one DownloadError naming the file and what each URL answered.
    """
    assert planned.urls  # select_sections refuses sections without URLs
    expected, trust = expected_file(section.section_id, planned.kind, planned.remote, lock)
    try:
        return _first_that_works(section, planned, dest, config, expected)
    except DownloadError as exc:
        if trust != FIRST_USE:
            raise
        raise DownloadError(f"{exc}\n(the size and digests expected are those its first download had, recorded in "
                            f"{lock_file}: if the file really changed at its source, delete its row there)") from None


def _first_that_works(section: ManifestSection, planned: PlannedFile, dest: Path, config: TenxConfig,
                      expected: dict) -> Downloaded:
    failures: list[DownloadError] = []
    for attempt, url in enumerate(planned.urls):
        log.info("downloading %s -> %s", url, dest)
        try:
            return download_file(url, dest, md5=expected["md5"], sha256=expected["sha256"], size=expected["size"],
                                 retries=config.retries, timeout_s=config.timeout_s, max_bytes=config.max_file_bytes,
                                 progress=sys.stderr.isatty())
        except DownloadError as exc:
            failures.append(exc)
            if attempt + 1 < len(planned.urls):
                log.warning("%s; trying the next URL, %s", exc, planned.urls[attempt + 1])
    raise DownloadError(_download_failure(section, planned, failures))


def url_file_name(url: str) -> str:
    """The file name a URL's path ends with (percent-decoded; no query or fragment)."""
    return unquote(urlparse(url).path.rsplit("/", 1)[-1])


def _download_failure(section: ManifestSection, planned: PlannedFile, failures: list[DownloadError]) -> str:
    """The message for a file none of whose URLs worked: the file, each failure, the dataset page."""
    name = url_file_name(planned.urls[0]) or planned.name
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


def is_fetched(folder: Path, section: ManifestSection, lock: Lock) -> bool:
    """Whether ``folder`` is a finished section of ``section``'s manifest row whose recorded files match
    the manifest's checksums and the lock (a lock without the section's rows does not stop it)."""
    record = _read_record(folder)
    if record is None or {k: v for k, v in record.items() if k != "files"} != _section_record(section):
        return False
    for kind in FILE_KINDS:
        recorded = record["files"].get(kind)
        if not isinstance(recorded, dict) or not all(isinstance(recorded.get(k), t) for k, t in
                                                     (("bytes", int), ("md5", str), ("sha256", str), ("url", str))):
            return False  # an older record, without the digests of what was downloaded: fetched again
        expected, _ = expected_file(section.section_id, kind, getattr(section, kind), lock)
        actual = {"md5": recorded["md5"], "sha256": recorded["sha256"], "size": recorded["bytes"]}
        if any(value is not None and actual[name] != value for name, value in expected.items()):
            return False
    return True


def recorded_files(folder: Path) -> list[LockedFile]:
    """The files a finished section folder records (its ``section.json``), as lock rows."""
    record = _read_record(folder) or {}
    return [LockedFile(record["section_id"], kind, f["url"], f["bytes"], f["md5"], f["sha256"])
            for kind, f in record.get("files", {}).items()]


def _read_record(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / SECTION_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None


def _section_record(section: ManifestSection) -> dict:
    """What ``section.json`` records of the manifest row (besides its files, :func:`fetch_section`)."""
    return {
        "section_id": section.section_id,
        "dataset": section.dataset,
        "organ": section.organ,
        "status": section.status,
        "source": "10x",
        "prefix": section.prefix,
    }


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
    with io.StringIO(read_utf8(path), newline="") as fh:
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
