"""Per-section annotation: transferred 68-type labels, Tfine/Tcoarse, eligibility and summaries.

A cell is eligible for histology evaluation when its final label has a Tfine class (so never an
"Uncertain cell", a QC state, or a type outside the taxonomies). A section is excluded, as in the
paper, when fewer than two Tcoarse classes are valid, i.e. have enough eligible cells.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.metrics import f1_score

from cellpath.annotation.coverage import Coverage
from cellpath.annotation.ontology import COARSE_CLASSES, FINE_CLASSES, cell_type
from cellpath.annotation.transfer import Transferred

LABEL_COLUMNS = ("section_id", "cell_id", "type_68", "predicted_type", "confidence", "fine", "coarse", "eligible")


def label_frame(section_id: str, cell_ids: np.ndarray, transferred: Transferred) -> pd.DataFrame:
    """The per-cell label table keyed by (section_id, cell_id)."""
    fine = np.array([cell_type(t).fine for t in transferred.label], dtype=object)
    coarse = np.array([cell_type(t).coarse for t in transferred.label], dtype=object)
    return pd.DataFrame({
        "section_id": section_id,
        "cell_id": np.asarray(cell_ids, dtype=str),
        "type_68": transferred.label.astype(str),
        "predicted_type": transferred.predicted.astype(str),
        "confidence": transferred.confidence.astype(np.float32),
        "fine": fine,
        "coarse": coarse,
        "eligible": np.array([f is not None for f in fine]),
    }, columns=list(LABEL_COLUMNS))


def section_summary(labels: pd.DataFrame, *, organ: str, reference: str, min_cells_per_coarse_class: int,
                    coverage: Coverage, max_unmatched: float) -> dict:
    """Counts per class, the "types → fine → coarse" mapping string, the exclusion decision, and the
    reference coverage (flagged, not excluded, when the unmatched share exceeds ``max_unmatched``)."""
    eligible = labels[labels["eligible"]]
    fine_counts = eligible["fine"].value_counts()
    coarse_counts = eligible["coarse"].value_counts()
    valid_coarse = [c for c in COARSE_CLASSES if coarse_counts.get(c, 0) >= min_cells_per_coarse_class]
    n_types = eligible["type_68"].nunique()
    summary = {
        "section_id": labels["section_id"].iloc[0] if len(labels) else "",
        "organ": organ,
        "reference": reference,
        "n_cells": len(labels),
        "n_eligible": len(eligible),
        "n_uncertain": int((labels["type_68"] == "Uncertain cell").sum()),
        "n_ineligible_types": int((~labels["eligible"]).sum() - (labels["type_68"] == "Uncertain cell").sum()),
        "mapping": f"{n_types}→{eligible['fine'].nunique()}→{eligible['coarse'].nunique()}",
        "n_valid_coarse": len(valid_coarse),
        "excluded": len(valid_coarse) < 2,
        "exclusion_reason": "" if len(valid_coarse) >= 2 else
        f"{len(valid_coarse)} valid Tcoarse class(es) (< 2 with ≥ {min_cells_per_coarse_class} eligible cells)",
        "coverage_cells_scored": coverage.n_scored,
        "coverage_unmatched": round(coverage.share_unmatched, 4),
        "coverage_unmatched_low": round(coverage.share_low, 4),
        "coverage_unmatched_high": round(coverage.share_high, 4),
        "poor_reference_coverage": bool(coverage.share_unmatched > max_unmatched),
    }
    summary |= {f"fine:{c}": int(fine_counts.get(c, 0)) for c in FINE_CLASSES}
    summary |= {f"coarse:{c}": int(coarse_counts.get(c, 0)) for c in COARSE_CLASSES}
    return summary


def against_truth(labels: pd.DataFrame, truth: pd.DataFrame) -> dict:
    """Transfer quality where the true types are known (the simulator's ground truth).

    ``accuracy_68``: final label equals the true type, over all cells (uncertain counts as wrong).
    ``tfine_macro_f1``: macro-F1 over the Tfine classes present in the truth, every cell counted;
    cells whose true or predicted label is outside Tfine fall in an "ineligible" bucket that is
    scored as a miss but not averaged as a class.
    """
    merged = labels.merge(truth[["cell_id", "cell_type"]], on="cell_id", how="inner", validate="one_to_one")
    if len(merged) != len(labels):
        raise ValueError(f"{len(labels) - len(merged)} labelled cells have no truth row")
    true_fine = merged["cell_type"].map(lambda t: cell_type(t).fine or "ineligible")
    pred_fine = merged["fine"].fillna("ineligible")
    present = sorted(set(true_fine) - {"ineligible"})
    return {
        "section_id": labels["section_id"].iloc[0],
        "n_cells": len(merged),
        "accuracy_68": float((merged["type_68"] == merged["cell_type"]).mean()),
        "accuracy_68_confident": float((merged["predicted_type"] == merged["cell_type"])[merged["type_68"] != "Uncertain cell"].mean()),
        "tfine_accuracy": float((true_fine == pred_fine).mean()),
        "tfine_macro_f1": float(f1_score(true_fine, pred_fine, labels=present, average="macro", zero_division=0)),
        "uncertain_fraction": float((merged["type_68"] == "Uncertain cell").mean()),
    }
