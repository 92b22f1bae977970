"""The ``10x`` fetch source: Xenium output bundles and their registered H&E, listed in a manifest.

Per section, ``raw_dir/<section_id>/`` receives the unpacked bundle (``experiment.xenium``,
``cells.parquet``, ...), ``<prefix>he_image.ome.tif``, ``<prefix>he_imagealignment.csv`` and a
``section.json`` that marks the section as finished and records the size and sha256 of the three
downloads it was built from. A finished section whose record matches its manifest row is kept;
sections no longer selected are removed (``data/raw`` persists across DVC runs so that an
interrupted fetch keeps its finished sections). Downloads go to a cache folder outside ``raw_dir``
first (``data/.downloads/`` from the stage), so an interrupted run resumes its partial files; they
are removed once a section is done.
"""

from __future__ import annotations

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
from urllib.parse import urlparse

from cellpath.config import SECTION_ID_PATTERN, TenxConfig
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output, prune_other_folders, remove_path, remove_stale_temporaries
from cellpath.sources.download import SUPPORTED_SCHEMES, download_file, safe_extract

log = logging.getLogger(__name__)

FILE_KINDS = ("bundle", "he_image", "he_alignment")
MANIFEST_COLUMNS = (
    "section_id", "dataset", "organ", "status", "cells", "agr_bacc", "rank", "panel_s25", "page_url",
    "prefix",
    *(f"{kind}_{field}" for kind in FILE_KINDS for field in ("url", "sha256", "bytes")),
)
SECTION_MARKER = "section.json"
SHA256_PATTERN = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class RemoteFile:
    """One file to download; ``url`` None until the user fills it in. ``size`` in bytes."""

    url: str | None
    sha256: str | None
    size: int | None


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
    value = {k: (v or "").strip() for k, v in row.items() if k is not None}
    where = f"line {line} (section {value['section_id'] or '?'})"

    def fail(column: str, what: str) -> None:
        problems.append(f"{where}: column {column}: {what}")

    if not re.fullmatch(SECTION_ID_PATTERN, value["section_id"]):
        fail("section_id", f"{value['section_id']!r} must match {SECTION_ID_PATTERN}")
    if any(sep in value["prefix"] for sep in ("/", "\\", "\0")):
        fail("prefix", f"{value['prefix']!r} must be a file-name prefix, without path separators")
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
        prefix=value["prefix"], **files,
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
    """The ``<kind>_url/_sha256/_bytes`` columns; problems go to ``fail(column, what)``."""
    url, sha, size = value[f"{kind}_url"], value[f"{kind}_sha256"], value[f"{kind}_bytes"]
    if url and urlparse(url).scheme not in SUPPORTED_SCHEMES:
        fail(f"{kind}_url", f"{url!r} must start with {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}")
    if sha and not SHA256_PATTERN.fullmatch(sha):
        fail(f"{kind}_sha256", f"{sha!r} is not a 64-digit hex SHA-256")
    parsed_size = _parse_int(size, required=False)
    if isinstance(parsed_size, str):
        fail(f"{kind}_bytes", parsed_size)
        parsed_size = None
    return RemoteFile(url=url or None, sha256=sha.lower() or None, size=parsed_size)


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


def fetch_tenx(config: TenxConfig, raw_dir: Path, downloads_dir: Path, *, base_dir: Path = Path(".")) -> dict:
    """Download and unpack the selected sections into ``raw_dir/<section_id>/``.

    Relative ``config.manifest``, ``raw_dir`` and ``downloads_dir`` are taken from ``base_dir``. Finished sections
    (``section.json`` matching the manifest row) are skipped; section folders not selected are
    removed. Returns ``{"source", "fetched", "skipped", "removed", "bytes"}``: section ids, and the
    total size in bytes of the files downloaded for the fetched sections.
    """
    manifest = base_dir / config.manifest
    raw_dir = base_dir / raw_dir
    downloads_dir = base_dir / downloads_dir
    chosen = select_sections(read_manifest(manifest), list(config.sections), manifest)
    raw_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(raw_dir)
    removed = prune_other_folders(raw_dir, {section.section_id for section in chosen})
    if removed:
        log.info("removed %d section(s) no longer selected: %s", len(removed), ", ".join(removed))
    summary: dict = {"source": "10x", "fetched": [], "skipped": [], "removed": removed, "bytes": 0}
    for section in chosen:
        if is_fetched(raw_dir / section.section_id, section):
            log.info("section %s: already fetched, skipping", section.section_id)
            summary["skipped"].append(section.section_id)
            continue
        summary["bytes"] += fetch_section(section, raw_dir, downloads_dir / section.section_id, config)
        summary["fetched"].append(section.section_id)
    return summary


def fetch_section(section: ManifestSection, raw_dir: Path, cache: Path, config: TenxConfig) -> int:
    """Build ``raw_dir/<section_id>/`` atomically from downloads cached in ``cache``; return their bytes."""
    downloads = {
        "bundle": _download(section.bundle, cache / "bundle", config),
        section.he_image_name: _download(section.he_image, cache / section.he_image_name, config),
        section.he_alignment_name: _download(section.he_alignment, cache / section.he_alignment_name, config),
    }
    log.info("section %s: unpacking %s", section.section_id, downloads["bundle"])
    with atomic_output(raw_dir / section.section_id) as out:
        safe_extract(downloads["bundle"], out, max_total_bytes=config.max_file_bytes)
        for name in (section.he_image_name, section.he_alignment_name):
            _link_or_copy(downloads[name], out / name)
        (out / SECTION_MARKER).write_text(json.dumps(_section_record(section), indent=2) + "\n")
    total = sum(p.stat().st_size for p in downloads.values())
    remove_path(cache)
    return total


def _download(remote: RemoteFile, dest: Path, config: TenxConfig) -> Path:
    assert remote.url is not None  # select_sections refuses sections without URLs
    log.info("downloading %s -> %s", remote.url, dest)
    return download_file(
        remote.url, dest, sha256=remote.sha256, size=remote.size, retries=config.retries,
        timeout_s=config.timeout_s, max_bytes=config.max_file_bytes, progress=sys.stderr.isatty(),
    )


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
        "files": {kind: {"sha256": getattr(section, kind).sha256, "bytes": getattr(section, kind).size}
                  for kind in FILE_KINDS},
    }
