"""``data/manifests/references.csv``: the paper's 14 scRNA-seq references, one row each.

Each row says where the reference comes from (citation, accession, files), how its files are
shaped (``builder``), where its raw counts and labels are, and which vocabulary of
``cellpath/annotation/data/label_aliases.csv`` maps its labels onto the ontology.
data/manifests/references.md describes the columns.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from cellpath.errors import InputError
from cellpath.io.layout import DEFAULT_MANIFEST
from cellpath.io.text import read_utf8

REFERENCE_MANIFEST = DEFAULT_MANIFEST.with_name("references.csv")

#: the public shapes a reference comes in (``builder``), see cellpath.references.build
BUILDERS = ("10x-h5", "10x-mtx", "dense-table", "cellxgene-h5ad", "tpm-refused")
#: where a reference's labels are: an annotation table joined on the barcode, the column header of a
#: dense table, or an obs column of an h5ad; empty when no author annotation is known
LABEL_SOURCES = ("annotation", "header", "obs", "")
MANIFEST_COLUMNS = ("name", "tissue_state", "organ", "citation", "title", "accession", "files", "format",
                    "counts_location", "builder", "labels_from", "label_column", "annotation_key",
                    "label_vocabulary", "gene_ids", "cells_in_paper", "notes")


@dataclass(frozen=True)
class ReferenceEntry:
    """One row of the reference manifest (see data/manifests/references.md)."""

    name: str
    tissue_state: str
    organ: str
    citation: str
    title: str
    accession: str
    files: str
    format: str
    counts_location: str
    builder: str
    labels_from: str
    label_column: str
    annotation_key: str
    label_vocabulary: str
    gene_ids: str
    cells_in_paper: str
    notes: str


def _row_problems(row: dict[str, str], line: int) -> list[str]:
    where = f"line {line} ({row.get('name') or '?'})"
    problems = []
    if not row["name"]:
        problems.append(f"{where}: column name is empty")
    if row["builder"] not in BUILDERS:
        problems.append(f"{where}: column builder is {row['builder']!r}; one of {', '.join(BUILDERS)}")
    if row["labels_from"] not in LABEL_SOURCES:
        problems.append(f"{where}: column labels_from is {row['labels_from']!r}; one of "
                        f"{', '.join(repr(s) for s in LABEL_SOURCES)}")
    if row["labels_from"] in ("annotation", "obs") and not row["label_column"]:
        problems.append(f"{where}: labels_from {row['labels_from']!r} needs a label_column")
    return problems


def read_reference_manifest(path: Path = REFERENCE_MANIFEST) -> dict[str, ReferenceEntry]:
    """The manifest's rows by name; one InputError naming the file and every problem."""
    path = Path(path)
    if not path.is_file():
        raise InputError("reference manifest not found; pass --manifest or run from the project's root", path=path)
    with io.StringIO(read_utf8(path), newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in MANIFEST_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise InputError(f"missing column(s): {', '.join(missing)}; see data/manifests/references.md", path=path)
        rows = [{c: (row.get(c) or "").strip() for c in MANIFEST_COLUMNS} for row in reader]
    problems = [p for line, row in enumerate(rows, start=2) for p in _row_problems(row, line)]
    names = [row["name"] for row in rows]
    problems += [f"name {n!r} is repeated" for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise InputError("\n".join(problems), path=path)
    return {row["name"]: ReferenceEntry(**row) for row in rows}


def manifest_entry(entries: dict[str, ReferenceEntry], name: str, path: Path) -> ReferenceEntry:
    """The row named ``name``; InputError listing the names the manifest has."""
    if name not in entries:
        raise InputError(f"no reference {name!r} in the manifest (it lists {', '.join(entries)})", path=path)
    return entries[name]
