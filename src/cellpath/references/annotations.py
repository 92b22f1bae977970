"""Cell annotation tables (the authors' labels per barcode) and their join onto a count matrix.

Published references keep labels beside the counts: Wu 2021's ``metadata.csv``, Kim 2020's
``cell_annotation.txt.gz``, Ma 2019's ``samples.txt.gz`` ... The key column (``annotation_key`` in
the manifest, else the table's first column) is matched to the cells either as ``<sample>_<barcode>``
(several samples) / the barcode (one sample), or as the bare barcode when barcodes are unique,
whichever matches more cells. Cells without a row, or with an empty label, are left out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.errors import InputError
from cellpath.references.readers import text_lines, separator

MISSING_LABELS = ("", "nan", "NaN", "NA", "None")


def read_annotation_table(path: Path) -> pd.DataFrame:
    """A csv/tsv/whitespace table, gzip or not, all columns as text; a header one field short (R's
    row names) gives its first column the name ``index``."""
    lines = text_lines(path, 1)
    if not lines:
        raise InputError("the annotation table is empty", path=path)
    sep = separator(lines[0])
    try:
        frame = pd.read_csv(path, sep=sep or r"\s+", dtype=str, keep_default_na=False)
    except Exception as exc:  # pandas raises several parser errors
        raise InputError(f"cannot read the annotation table ({type(exc).__name__}: {exc})", path=path) from None
    if not isinstance(frame.index, pd.RangeIndex):
        frame = frame.reset_index()
    return frame


@dataclass(frozen=True)
class JoinedLabels:
    """Per-cell labels from a table (None where the cell has no row or an empty label) and counts."""

    labels: np.ndarray
    matched_on: str  # "cell id" or "barcode"
    cells_without_row: int
    cells_with_empty_label: int
    rows_without_cell: int


def _column(frame: pd.DataFrame, name: str, what: str, path: Path) -> pd.Series:
    if name not in frame.columns:
        raise InputError(f"the annotation table has no {what} column {name!r} (columns: "
                         f"{', '.join(map(str, frame.columns))}); pass --{what}-column COLUMN", path=path)
    return frame[name]


def join_labels(cell_ids: tuple[str, ...], barcodes: tuple[str, ...], frame: pd.DataFrame, key: str | None,
                label_column: str, path: Path) -> JoinedLabels:
    """Each cell's label from ``frame``: its ``label_column`` on the row whose ``key`` (default: the
    first column) is the cell's id or, when that matches fewer cells, its barcode."""
    key = key or str(frame.columns[0])
    keys = _column(frame, key, "barcode", path).astype(str)
    labels = _column(frame, label_column, "label", path).astype(str).to_numpy()
    lookup = dict(zip(keys, labels)) if keys.is_unique else None
    if lookup is None:
        first = keys[keys.duplicated()].iloc[0]
        raise InputError(f"the barcode column {key!r} repeats {first!r}: one row per cell is needed (the samples' "
                         "barcodes may need their sample as prefix)", path=path)
    by_id = sum(c in lookup for c in cell_ids)
    by_barcode = sum(b in lookup for b in barcodes) if len(set(barcodes)) == len(barcodes) else 0
    if max(by_id, by_barcode) == 0:
        raise InputError(f"no cell of the matrix has a row in the annotation table: its {key!r} values look like "
                         f"{keys.iloc[0]!r}, the cells like {cell_ids[0]!r} (barcode {barcodes[0]!r}); pass the "
                         "table's barcode column with --barcode-column", path=path)
    names, how = (cell_ids, "cell id") if by_id >= by_barcode else (barcodes, "barcode")
    found = np.array([lookup.get(n) for n in names], dtype=object)
    empty = np.array([v is not None and v.strip() in MISSING_LABELS for v in found])
    without_row = int(sum(v is None for v in found))
    found[empty] = None
    return JoinedLabels(found, how, without_row, int(empty.sum()), len(keys) - (len(names) - without_row))
