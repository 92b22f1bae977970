"""The page's figures: which data each one is drawn from (the drawing is :mod:`cellpath.report.figures`)."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from cellpath.report import figures, tables
from cellpath.report.expression import gene_matrix
from cellpath.report.inputs import ReportInputs
from cellpath.vocabulary import HEADLINE_READOUT, HEADLINE_TAXONOMY, TAXONOMY_LABELS, headline_magnification

#: The robustness conditions a Pareto plane is drawn for (one plane each).
PARETO_KEYS = ["magnification", "taxonomy", "scope", "unit"]


def _drawn(data: pd.DataFrame, draw: Callable[[], bytes]) -> bytes | None:
    """``draw()`` when ``data`` has rows, else None (no figure)."""
    return draw() if len(data) else None


def build_figures(inputs: ReportInputs, magnifications: list[str], numeric: dict[str, pd.DataFrame],
                  colours: dict) -> dict[str, bytes | None]:
    """Every figure of the page as PNG bytes; None where this run has no data for it (for example
    the IS figures of a MOCV-only experiment). ``numeric``: the tables' numeric frames by name."""
    probe, headline = inputs.probe, headline_magnification(magnifications)
    taxonomy_label = TAXONOMY_LABELS[HEADLINE_TAXONOMY]
    readouts = tables.readout_effect(probe["summary"], headline)
    by_mag = tables.magnification_effect(probe["summary"], magnifications)
    mag_columns = [m for m in by_mag.columns if not m.endswith("retention") and m not in ("protocol", "model")]
    taxonomy = tables.taxonomy_effect(probe["summary"], headline)
    landscape = numeric["landscape"].reset_index()
    panel = numeric["panel_robustness"].reset_index().rename(columns={"IS Nuc F1": "macro_f1"})
    margins = inputs.margins.assign(condition=lambda f: f["model"] + " · " + f["readout"] + " · " + f["magnification"]
                                    + " · " + f["taxonomy"] + " · " + f["unit"])
    shortcut = inputs.robustness["shortcut"]
    genes = gene_matrix(inputs.expression["gene_summary"], headline) if inputs.expression else pd.DataFrame()
    return {
        "landscape": _drawn(landscape.dropna(subset=["cra_wins", "crt"], how="all"),
                            lambda: figures.landscape(landscape)),
        "taxonomy": _drawn(taxonomy.dropna(subset=["fine", "coarse"]), lambda: figures.taxonomy_effect(taxonomy)),
        "readouts": _drawn(readouts, lambda: figures.per_protocol_lines(
            readouts, [r for r in tables.READOUTS if r in readouts.columns], "Macro-F1 (pp)",
            f"Readouts ({taxonomy_label}, {headline})")),
        "magnifications": _drawn(by_mag, lambda: figures.per_protocol_lines(
            by_mag, mag_columns, f"{HEADLINE_READOUT} Macro-F1 (pp)",
            f"Magnifications ({taxonomy_label}, {HEADLINE_READOUT})")),
        "panels": _drawn(panel, lambda: figures.panel_ranks(panel)),
        "croma": _drawn(margins, lambda: figures.croma_distributions(margins, sorted(margins["condition"].unique()))),
        "classes": figures.class_abundance(numeric["class_counts"], colours),
        "shortcut": _drawn(shortcut, lambda: figures.shortcut_curves(shortcut)),
        "expression_genes": _drawn(genes, lambda: figures.gene_heatmap(genes)),
    }


def pareto_figures(robustness: pd.DataFrame) -> list[tuple[str, bytes]]:
    """One median–LTM10 plane per (magnification, taxonomy, scope, unit), models × readouts as points."""
    out = []
    for keys, group in robustness.reset_index().groupby(PARETO_KEYS, sort=True):
        title = " · ".join(str(k) for k in keys)
        out.append((title, figures.pareto_plane(group.assign(label=group["model"] + " " + group["readout"]))))
    return out
