"""The download lock: each 10x file's size and digests as first downloaded (trust on first use).

Most files of the paper's manifest have no published checksum. So the first complete download of
each file (one whose section was built from it) records its URL, size (bytes), MD5 and SHA-256 in
the manifest's lock (``data/manifests/xenium_datasets.lock.csv`` beside ``xenium_datasets.csv``, or
``tenx.lock``), a file to commit with the manifest;
every later download of that file, on any machine that has the committed lock, must match it. A file
with a published MD5 or SHA-256 (manifest columns) is checked against that as well. A row is never
replaced: when the manifest's checksum and the lock disagree, fetch and ``cellpath validate`` stop and
say which, and a file 10x really republished needs its row deleted by hand.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.text import read_utf8

LOCK_COLUMNS = ("section_id", "kind", "url", "bytes", "md5", "sha256")
PUBLISHED, FIRST_USE, NOT_YET = "published checksum", "first use", "not yet downloaded"


@dataclass(frozen=True)
class LockedFile:
    """One file as first downloaded: the URL it came from, its size (bytes) and lower-case hex digests."""

    section_id: str
    kind: str
    url: str
    size: int
    md5: str
    sha256: str

    @property
    def key(self) -> tuple[str, str]:
        return self.section_id, self.kind


Lock = dict[tuple[str, str], LockedFile]


def read_lock(path: Path) -> Lock:
    """The lock's rows by (section_id, kind); an absent file is an empty lock. A malformed one raises
    one InputError naming the file and its faulty lines."""
    path = Path(path)
    if not path.is_file():
        return {}
    with io.StringIO(read_utf8(path), newline="") as fh:
        reader = csv.DictReader(fh)
        if tuple(reader.fieldnames or ()) != LOCK_COLUMNS:
            raise InputError(f"the columns must be {','.join(LOCK_COLUMNS)}; restore it from git, or delete it "
                             "to record every file again at its next download", path=path)
        rows = list(reader)
    lock: Lock = {}
    problems = []
    for line, row in enumerate(rows, start=2):
        entry = _parsed(row)
        if entry is None:
            problems.append(f"line {line}: expected a section id, a kind, a URL, a size in bytes, a 32-digit MD5 "
                            "and a 64-digit SHA-256")
        elif entry.key in lock:
            problems.append(f"line {line}: a second row for {entry.section_id} {entry.kind}")
        else:
            lock[entry.key] = entry
    if problems:
        raise InputError("; ".join(problems) + "; restore the file from git", path=path)
    return lock


def _parsed(row: dict[str, str | None]) -> LockedFile | None:
    value = {column: (row.get(column) or "").strip() for column in LOCK_COLUMNS}
    digests_ok = (len(value["md5"]) == 32 and len(value["sha256"]) == 64
                  and all(c in "0123456789abcdef" for c in value["md5"] + value["sha256"]))
    if not (value["section_id"] and value["kind"] and value["url"] and value["bytes"].isdigit() and digests_ok):
        return None
    return LockedFile(value["section_id"], value["kind"], value["url"], int(value["bytes"]), value["md5"],
                      value["sha256"])


def add_to_lock(path: Path, entries: list[LockedFile]) -> Lock:
    """The lock with ``entries`` whose (section, kind) it lacks added, written atomically (sorted rows)."""
    lock = read_lock(path)
    new = [entry for entry in entries if entry.key not in lock]
    if not new:
        return lock
    lock.update({entry.key: entry for entry in new})
    with atomic_output(path) as tmp, Path(tmp).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(LOCK_COLUMNS)
        for key in sorted(lock):
            entry = lock[key]
            writer.writerow([entry.section_id, entry.kind, entry.url, entry.size, entry.md5, entry.sha256])
    return lock
