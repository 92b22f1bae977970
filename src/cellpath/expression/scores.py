"""Scores of an expression probe on its test cells: per gene, Pearson's and Spearman's r between the
predicted and the measured expression; per run, their means over the genes (HEST's headline is the
mean Pearson r) and the share of genes with r above ``R_THRESHOLD``.

A gene whose measured or predicted expression is constant over the test cells has no r: it is left
out of the means and the share, and counted (``n_genes_undefined``).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

R_THRESHOLD = 0.3
MIN_SPREAD = 1e-12  # a column whose centred norm is below this (relative to its scale) is constant


def pearson_columns(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Pearson's r of each column pair (G,), float64 (two-pass: centred, then normalised); NaN where
    either column is constant."""
    p = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(measured, dtype=np.float64)
    p = p - p.mean(axis=0)
    y = y - y.mean(axis=0)
    p_norm, y_norm = np.linalg.norm(p, axis=0), np.linalg.norm(y, axis=0)
    defined = (p_norm > MIN_SPREAD * np.sqrt(len(p))) & (y_norm > MIN_SPREAD * np.sqrt(len(y)))
    r = np.full(p.shape[1], np.nan)
    r[defined] = (p[:, defined] * y[:, defined]).sum(axis=0) / (p_norm[defined] * y_norm[defined])
    return np.clip(r, -1.0, 1.0)


def spearman_columns(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Spearman's r of each column pair (G,): Pearson's r of the ranks (ties get their mean rank)."""
    return pearson_columns(stats.rankdata(predicted, axis=0), stats.rankdata(measured, axis=0))


def run_scores(pearson: np.ndarray, spearman: np.ndarray) -> dict[str, float | int]:
    """A run's summary over its genes: mean Pearson and Spearman r, the share of genes with Pearson
    r above ``R_THRESHOLD``, and how many genes had no r."""
    defined = np.isfinite(pearson)
    if not defined.any():
        return {"mean_pearson": float("nan"), "mean_spearman": float("nan"), "share_r_above": float("nan"),
                "n_genes_scored": 0, "n_genes_undefined": int(len(pearson))}
    return {"mean_pearson": float(pearson[defined].mean()), "mean_spearman": float(np.nanmean(spearman[defined])),
            "share_r_above": float((pearson[defined] > R_THRESHOLD).mean()),
            "n_genes_scored": int(defined.sum()), "n_genes_undefined": int((~defined).sum())}
