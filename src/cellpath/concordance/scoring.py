"""Morphology–annotation concordance (AGR-BAcc) and the nested benchmark panels built from it.

For each candidate section, nuclei predicted from the H&E (CellViT++ or the built-in detector) are
matched to Xenium nuclei by mutual nearest neighbours; the section's score is the balanced accuracy
of the matched predictions against the Xenium-derived Tcoarse labels (AGR-BAcc). Sections are
ranked by that score, and the panels S10 ⊂ S15 ⊂ S20 ⊂ S25 are the top 10, 15, 20 and 25.

Everything here is pure (arrays and DataFrames in, results out) except ``paper_panels``, which
reads the reference table of the paper's 52 sections.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.spatial import cKDTree
from sklearn.metrics import balanced_accuracy_score

from cellpath.errors import InputError

PAPER_PANEL_SIZES: tuple[int, ...] = (10, 15, 20, 25)


def mutual_nearest_neighbours(pred_xy: np.ndarray, ref_xy: np.ndarray,
                              max_distance: float) -> tuple[np.ndarray, int, int]:
    """Match predicted to reference points by mutual nearest neighbours within ``max_distance``.

    Both point sets are (N, 2) in one coordinate system (e.g. H&E level-0 px) and ``max_distance``
    is in its units. A pair (i, j) is kept when reference j is the nearest to prediction i, i is the
    nearest to j, and they are at most ``max_distance`` apart. Returns ``(pairs, n_pred_unmatched,
    n_ref_unmatched)`` with ``pairs`` a (K, 2) int array of (prediction, reference) indices sorted by
    prediction index.
    """
    pred, ref = _as_points(pred_xy, "pred_xy"), _as_points(ref_xy, "ref_xy")
    if not np.isfinite(max_distance) or max_distance <= 0:
        raise ValueError(f"max_distance must be a positive finite distance, got {max_distance}")
    if len(pred) == 0 or len(ref) == 0:
        return np.empty((0, 2), dtype=np.int64), len(pred), len(ref)
    distance, nearest_ref = cKDTree(ref).query(pred, k=1)
    _, nearest_pred = cKDTree(pred).query(ref, k=1)
    i = np.arange(len(pred))
    mutual = (nearest_pred[nearest_ref] == i) & (distance <= max_distance)
    pairs = np.column_stack([i[mutual], nearest_ref[mutual]]).astype(np.int64)
    return pairs, len(pred) - len(pairs), len(ref) - len(pairs)


def _as_points(xy: np.ndarray, name: str) -> np.ndarray:
    points = np.asarray(xy, dtype=float)
    if points.size == 0:
        return points.reshape(0, 2)
    if points.ndim != 2 or points.shape[1] != 2 or not np.all(np.isfinite(points)):
        raise ValueError(f"{name} must be an (N, 2) array of finite x, y coordinates, got shape {points.shape}")
    return points


def agr_bacc(true_coarse, pred_coarse) -> float | None:
    """Balanced accuracy of predicted against true classes: mean recall over the true classes.

    Classes predicted but absent from the truth count only as errors. None when the truth holds
    fewer than two classes (balanced accuracy is then undefined for ranking purposes).
    """
    truth = np.asarray(true_coarse, dtype=object)
    predicted = np.asarray(pred_coarse, dtype=object)
    if truth.shape != predicted.shape or truth.ndim != 1:
        raise ValueError(f"true and predicted classes must be 1-D and of one length, got {truth.shape} "
                         f"and {predicted.shape}")
    if pd.isna(truth).any() or pd.isna(predicted).any():
        raise ValueError("class labels contain missing values; drop cells without a Tcoarse class first")
    if len(set(truth)) < 2:
        return None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        return float(balanced_accuracy_score(truth.astype(str), predicted.astype(str)))


def rank_sections(frame: pd.DataFrame) -> pd.DataFrame:
    """Rank sections by descending ``score`` (full precision); ties by ``section_id`` ascending.

    ``frame`` needs columns section_id, organ and score. Returns a copy sorted by rank with an
    integer ``rank`` column (1 = best); sections whose score is missing (NaN/None) are unranked
    (rank <NA>) and placed last, by section_id.
    """
    missing = [c for c in ("section_id", "organ", "score") if c not in frame.columns]
    if missing:
        raise ValueError(f"rank_sections needs columns section_id, organ and score; missing {missing}")
    repeated = sorted(frame["section_id"][frame["section_id"].duplicated()].astype(str).unique())
    if repeated:
        raise ValueError(f"section_id must be unique; repeated: {', '.join(repeated)}")
    out = frame.copy()
    out["score"] = pd.to_numeric(out["score"], errors="raise").astype(float)
    if np.isinf(out["score"]).any():
        bad = out.loc[np.isinf(out["score"]), "section_id"].tolist()
        raise ValueError(f"score must be finite or missing; infinite for {bad}")
    out = out.sort_values(["score", "section_id"], ascending=[False, True], na_position="last", kind="mergesort")
    n_scored = int(out["score"].notna().sum())
    out["rank"] = pd.array([*range(1, n_scored + 1), *[pd.NA] * (len(out) - n_scored)], dtype="Int64")
    return out.reset_index(drop=True)


def nested_panels(ranked: pd.DataFrame, sizes) -> pd.DataFrame:
    """Add one boolean column ``S<k>`` per panel size k: the sections ranked 1..k.

    ``ranked`` is the output of ``rank_sections``; unranked sections belong to no panel. Panels are
    nested by construction. A size larger than the number of ranked sections is an error.
    """
    if "rank" not in ranked.columns:
        raise ValueError("nested_panels needs a 'rank' column; call rank_sections first")
    sizes = [int(k) for k in sizes]
    if len(set(sizes)) != len(sizes) or any(k < 1 for k in sizes):
        raise ValueError(f"panel sizes must be distinct positive integers, got {sizes}")
    n_ranked = int(ranked["rank"].notna().sum())
    out = ranked.copy()
    for k in sorted(sizes):
        if k > n_ranked:
            raise ValueError(f"panel size {k} is larger than the {n_ranked} ranked sections; lower it or add "
                             f"sections with a defined score")
        out[f"S{k}"] = (out["rank"] <= k).fillna(False).astype(bool)
    return out


def paper_panels(reference_csv_path: Path | str) -> pd.DataFrame:
    """The paper's ranking and panels S10–S25 from its table of sections.

    The CSV (``data/manifests/xenium_datasets.csv`` or ``shared/reference/xenium_datasets.csv``)
    needs columns dataset, organ, status, cells and agr_bacc (empty where undefined); a section_id
    column is used as the id when present, else dataset. Scores there are rounded to three decimals,
    so sections tied at that precision are ordered by id, not by the paper's full-precision values.
    """
    path = Path(reference_csv_path)
    try:
        table = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the section table ({exc})", path=path) from None
    missing = [c for c in ("dataset", "organ", "status", "cells", "agr_bacc") if c not in table.columns]
    if missing:
        raise InputError(f"section table lacks column(s) {missing}", path=path)
    frame = pd.DataFrame({
        "section_id": table["section_id"] if "section_id" in table.columns else table["dataset"],
        "dataset": table["dataset"], "organ": table["organ"], "status": table["status"],
        "cells": table["cells"], "score": pd.to_numeric(table["agr_bacc"], errors="coerce"),
    })
    bad = table.loc[frame["score"].isna() & table["agr_bacc"].notna(), "dataset"].tolist()
    if bad:
        raise InputError(f"agr_bacc is not a number for {bad}", path=path)
    try:
        return nested_panels(rank_sections(frame), PAPER_PANEL_SIZES)
    except ValueError as exc:
        raise InputError(str(exc), path=path) from None
