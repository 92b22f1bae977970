"""The CellPath-Bench paper's published results (Tables 4, 5 and the supplementary Tables 9-134) as one
tidy table, transcribed from the text extracted from the paper's PDF by :mod:`.seed_tables`.

``load_published()`` reads the committed ``cellpath/data/published/results.csv`` (its README says
what each column holds; values are percentage points, as printed).
"""

from __future__ import annotations

from importlib.resources import files

import pandas as pd

__all__ = ["load_published"]


def load_published() -> pd.DataFrame:
    """The published results: one row per (table, column, model), dtypes fixed (text as ``string``
    with <NA> for empty, ``table``/``row`` int64, ``mean``/``sd``/``crt`` float64, ``wins`` Int64)."""
    from cellpath.published.seed_tables import read_csv_text  # here: `python -m .seed_tables` runs cleanly

    text = files("cellpath").joinpath("data").joinpath("published").joinpath("results.csv").read_text(encoding="utf-8")
    return read_csv_text(text)
