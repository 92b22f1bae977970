"""Representation robustness to a confounder (CRoMa, F(0), LTM, RI, MaRI, k-NN probes) and the
downstream shortcut probe (APD, nIPD), after Grisi et al. and the ``croma`` package.

Cosine distance on L2-normalised features; same-group samples (patch, tile) are never neighbours.
"""

from cellpath.robustness.metrics import (K_CANDIDATES, croma_margins, fraction_non_positive, knn_balanced_accuracy,
                                         lower_tail, margin_aware_robustness_index, median_margin, robustness_index,
                                         select_k, shared_k)
from cellpath.robustness.neighbours import knn_excluding_groups, l2_normalise, typed_neighbours
from cellpath.robustness.shortcut import (ShortcutSweep, apd, composition, cramers_v, nipd, nipd_interval,
                                          shortcut_sweep, sweep_tables)
from cellpath.robustness.table import RobustnessScores, low_margin_enrichment, score_embeddings

__all__ = [
    "K_CANDIDATES",
    "RobustnessScores",
    "ShortcutSweep",
    "apd",
    "composition",
    "cramers_v",
    "croma_margins",
    "fraction_non_positive",
    "knn_balanced_accuracy",
    "knn_excluding_groups",
    "l2_normalise",
    "low_margin_enrichment",
    "lower_tail",
    "margin_aware_robustness_index",
    "median_margin",
    "nipd",
    "nipd_interval",
    "robustness_index",
    "score_embeddings",
    "select_k",
    "shared_k",
    "shortcut_sweep",
    "sweep_tables",
    "typed_neighbours",
]
