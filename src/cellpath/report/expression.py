"""The report's expression-probe section: per model, how much of each cell's measured expression its
features decode (mean Pearson r per protocol with its interval), how much the transferred type alone
decodes, what the type and the features decode together and the gain of that over the type, and the
expression CRA (Nuc − Mean); and the genes ×
models matrix of r that the heatmap draws. Pure: ``reports/expression/*.csv`` in, frames out."""

from __future__ import annotations

import pandas as pd

from cellpath.vocabulary import HEADLINE_READOUT, PROTOCOL_LABELS, PROTOCOLS

HEATMAP_GENES = 30  # genes shown in the heatmap: those with the highest r averaged over the models


def expression_table(summary: pd.DataFrame, cra: pd.DataFrame, wins: pd.DataFrame, magnification: str) -> pd.DataFrame:
    """Per model at ``magnification`` and the headline readout: per protocol '<P> r' (mean, sd, low,
    high across the balanced units), '<P> r(type)', '<P> r(type+features)', '<P> gain' (r(type+features) −
    r(type): what the features add to the type) and '<P> wins'
    (paired Wilcoxon on mean r); 'CRA r' (Nuc − Mean) with its interval."""
    chosen = summary[(summary["magnification"] == magnification) & (summary["readout"] == HEADLINE_READOUT)]
    frame = pd.DataFrame(index=pd.Index(sorted(chosen["model"].unique()), name="model"))
    won = wins[(wins["magnification"] == magnification) & (wins["readout"] == HEADLINE_READOUT)]
    for protocol in PROTOCOLS:
        label = PROTOCOL_LABELS[protocol]
        mine = chosen[chosen["protocol"] == protocol]
        features = mine[mine["metric"] == "mean_pearson"].set_index("model")
        if features.empty:
            continue
        for part in ("mean", "sd", "low", "high"):
            frame[f"{label} r {part}"] = features[part].reindex(frame.index)
        for metric, column in (("mean_pearson_type", "r(type)"), ("mean_pearson_type_features", "r(type+features)"),
                               ("gain_type_features_over_type", "gain")):
            frame[f"{label} {column}"] = mine[mine["metric"] == metric].set_index("model")["mean"].reindex(frame.index)
        frame[f"{label} wins"] = won[won["protocol"] == protocol].set_index("model")["wins"].reindex(frame.index)
    pooled = cra[cra["magnification"] == magnification].set_index("model")
    if len(pooled):
        frame["CRA r"] = pooled["cra"].reindex(frame.index)
        frame["CRA r low"] = pooled["low"].reindex(frame.index)
        frame["CRA r high"] = pooled["high"].reindex(frame.index)
    return frame


def gene_matrix(gene_summary: pd.DataFrame, magnification: str, genes: int = HEATMAP_GENES) -> pd.DataFrame:
    """Genes × models: Pearson r from the features (headline readout, ``magnification``), averaged over
    the protocols' runs that scored the gene, weighted by those runs; the ``genes`` best on average."""
    chosen = gene_summary[(gene_summary["magnification"] == magnification)
                          & (gene_summary["readout"] == HEADLINE_READOUT)]
    if chosen.empty:
        return pd.DataFrame()
    weighted = chosen.assign(total=chosen["pearson"] * chosen["n_runs"])
    grouped = weighted.groupby(["gene", "model"])[["total", "n_runs"]].sum()
    matrix = (grouped["total"] / grouped["n_runs"]).unstack("model")
    order = matrix.mean(axis=1).sort_values(ascending=False, kind="mergesort").index[:genes]
    return matrix.loc[order]
