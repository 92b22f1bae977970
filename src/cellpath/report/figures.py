"""The report's figures as PNG bytes (matplotlib, Agg backend), each from one table of ``tables``.

Every function takes the frame its docstring names and returns PNG bytes; nothing here reads files.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from cellpath.report.tables import pareto_frontier  # noqa: E402
from cellpath.vocabulary import PROTOCOL_LABELS  # noqa: E402

DPI = 110
plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})


def png(fig: plt.Figure) -> bytes:
    """The figure as PNG bytes; closes it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def class_colours(classes: Sequence[str]) -> dict[str, tuple]:
    """A fixed colour per class name (tab10 in the given order)."""
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(classes)}


def _model_colours(models: Sequence[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab20" if len(models) > 10 else "tab10")
    return {m: cmap(i % cmap.N) for i, m in enumerate(sorted(models))}


def landscape(data: pd.DataFrame) -> bytes:
    """Fig. 1 from ``tables.landscape``: x = WSI-equivalent pretraining scale (log), outlined bubbles
    CRA wins under IS, filled bubbles CRT; area ∝ parameters. Models without a pretraining scale
    (the controls) are drawn side by side in a strip left of the scale, not on it."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    known = data["pretrain_wsi"].notna().to_numpy()
    scale = data.loc[known, "pretrain_wsi"]
    left = scale.min() / 30 if len(scale) else 1.0
    strip = left * 1.6 ** np.arange((~known).sum())  # unknown models, side by side on the log axis
    x = data["pretrain_wsi"].to_numpy(float)
    x[~known] = strip
    params = data["parameters"].fillna(0.0).to_numpy(float)
    area = 40 + 400 * np.sqrt(params / max(params.max(), 1.0))
    colours = _model_colours(data["model"])
    for i, row in enumerate(data.itertuples()):
        colour = colours[row.model]
        ax.scatter(x[i], row.cra_wins, s=area[i], facecolors="none", edgecolors=[colour], linewidths=1.5)
        ax.scatter(x[i], row.crt, s=area[i], color=colour, alpha=0.7)
        ax.annotate(row.model, (x[i], np.nanmax([row.cra_wins, row.crt])), textcoords="offset points",
                    xytext=(6, 6), fontsize=8, rotation=20)
    ax.set_xscale("log")
    ax.set_xlim(left / 2, (scale.max() * 3) if len(scale) else strip[-1] * 2)
    if (~known).any():
        if len(scale):
            ax.axvline(strip[-1] * 1.3, color="0.7", lw=0.8, ls=":")
        ax.text(left, 1.02, "no pretraining scale in the registry", transform=ax.get_xaxis_transform(),
                fontsize=7, color="0.4")
    if not len(scale):
        ax.set_xticks([])
        ax.minorticks_off()
    ax.set_xlabel("pretraining scale (WSI equivalents, log)")
    ax.set_ylabel("significant wins")
    ax.margins(y=0.25)
    ax.scatter([], [], facecolors="none", edgecolors="0.3", label="CRA wins (IS)")
    ax.scatter([], [], color="0.3", alpha=0.7, label="CRT (IOCD, MOCV, LOOO)")
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    ax.set_title("CRA–CRT landscape (bubble area ∝ parameters)", pad=14)
    return png(fig)


def taxonomy_effect(table: pd.DataFrame) -> bytes:
    """Fig. 3a-b from ``tables.taxonomy_effect``: Tfine vs Tcoarse Macro-F1 per protocol, and ranks."""
    protocols = [p for p in PROTOCOL_LABELS if p in set(table["protocol"])]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    colours = _model_colours(table["model"].unique())
    for j, protocol in enumerate(protocols):
        rows = table[table["protocol"] == protocol]
        for _, row in rows.iterrows():
            a.plot([j - 0.15, j + 0.15], [row["fine"] * 100, row["coarse"] * 100], color=colours[row["model"]],
                   marker="o", lw=0.8)
        b.scatter(rows["fine rank"], rows["coarse rank"], label=PROTOCOL_LABELS[protocol], alpha=0.8)
    a.set_xticks(range(len(protocols)), [PROTOCOL_LABELS[p] for p in protocols])
    a.set_xlabel("each line: one model, Tfine (left) → Tcoarse (right)")
    a.set_ylabel("Nuc Macro-F1 (pp)")
    a.set_title("(a) taxonomy")
    top = max(table[["fine rank", "coarse rank"]].max().max(), 1)
    b.plot([1, top], [1, top], ls="--", color="0.5", lw=0.8)
    b.set_xlabel("rank under Tfine")
    b.set_ylabel("rank under Tcoarse")
    b.set_title("(b) model-rank concordance")
    b.legend(fontsize=7, frameon=False)
    return png(fig)


def _lines_by_model(ax: plt.Axes, table: pd.DataFrame, columns: list[str], colours: dict) -> None:
    for _, row in table.iterrows():
        ax.plot(range(len(columns)), row[columns].to_numpy(float) * 100, marker="o", lw=0.8,
                color=colours[row["model"]], label=row["model"])
    ax.set_xticks(range(len(columns)), columns)


def per_protocol_lines(table: pd.DataFrame, columns: list[str], ylabel: str, title: str) -> bytes:
    """Fig. 3c/3d from ``tables.readout_effect`` / ``magnification_effect``: one panel per protocol,
    one line per model across ``columns``."""
    protocols = [p for p in PROTOCOL_LABELS if p in set(table["protocol"])]
    fig, axes = plt.subplots(1, len(protocols), figsize=(2.6 * len(protocols) + 1, 3.2), sharey=True, squeeze=False)
    colours = _model_colours(table["model"].unique())
    for ax, protocol in zip(axes[0], protocols):
        _lines_by_model(ax, table[table["protocol"] == protocol], columns, colours)
        ax.set_title(PROTOCOL_LABELS[protocol])
        ax.tick_params(axis="x", labelrotation=45 if len(columns) > 3 else 0)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title, y=1.03)
    return png(fig)


def panel_ranks(table: pd.DataFrame) -> bytes:
    """IS Nuc Macro-F1 and rank per model as the panel grows, from ``tables.panel_robustness``."""
    panels = list(dict.fromkeys(table["panel"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    colours = _model_colours(table["model"].unique())
    for model, rows in table.groupby("model"):
        rows = rows.set_index("panel").reindex(panels)
        a.plot(panels, rows["macro_f1"] * 100, marker="o", color=colours[model], label=model)
        b.plot(panels, rows["rank"], marker="o", color=colours[model])
    a.set_ylabel("IS Nuc Macro-F1 (pp)")
    a.legend(fontsize=7, frameon=False)
    b.set_ylabel("rank (1 = best)")
    b.invert_yaxis()
    b.yaxis.get_major_locator().set_params(integer=True)
    fig.suptitle("Panel robustness: nested panels, smallest to largest", y=1.03)
    return png(fig)


def croma_distributions(margins: pd.DataFrame, labels: list[str]) -> bytes:
    """Per-cell CRoMa margins per condition (``margins`` columns: condition, margin), as violins
    with the median marked and the biology/confounder boundary at 0."""
    data = [margins.loc[margins["condition"] == label, "margin"].dropna().to_numpy() for label in labels]
    fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(labels)))
    parts = ax.violinplot(data, vert=False, showmedians=True, showextrema=False)
    for body in parts["bodies"]:
        body.set_alpha(0.6)
    ax.axvline(0, color="crimson", lw=0.8, ls="--")
    ax.set_yticks(range(1, len(labels) + 1), labels)
    ax.set_xlabel("CRoMa margin (> 0: biology-dominant, ≤ 0: confounder-dominant)")
    ax.set_title("Per-cell CRoMa")
    return png(fig)


def pareto_plane(table: pd.DataFrame) -> bytes:
    """Median–LTM10 plane from rows of ``tables.robustness_table`` (one condition: columns label,
    croma_median, ltm); frontier points outlined in black and joined."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    front = pareto_frontier(table["croma_median"], table["ltm"])
    colours = _model_colours(table["label"])
    for (_, row), on_front in zip(table.iterrows(), front):
        ax.scatter(row["croma_median"], row["ltm"], s=60, color=colours[row["label"]],
                   edgecolors="black" if on_front else "none", linewidths=1.5, zorder=3)
        ax.annotate(row["label"], (row["croma_median"], row["ltm"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    frontier = table[front].sort_values("croma_median")
    ax.plot(frontier["croma_median"], frontier["ltm"], color="black", lw=0.8, ls="--", zorder=2)
    ax.axvline(0, color="0.7", lw=0.6)
    ax.axhline(0, color="0.7", lw=0.6)
    ax.set_xlabel("median CRoMa")
    ax.set_ylabel("LTM10 (mean of the worst decile)")
    ax.set_title("Median–tail plane (outlined: Pareto frontier)")
    return png(fig)


def shortcut_curves(curves: pd.DataFrame) -> bytes:
    """Balanced accuracy of the confounder-biased probe against Cramér's V (``shortcut.csv``)."""
    settings = list(dict.fromkeys(curves["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.2), sharey=True, squeeze=False)
    colours = _model_colours(curves["model"].unique())
    for ax, setting in zip(axes[0], settings):
        for model, rows in curves[curves["setting"] == setting].groupby("model"):
            rows = rows.sort_values("cramers_v")
            ax.errorbar(rows["cramers_v"], rows["balanced_accuracy_mean"], yerr=rows["balanced_accuracy_sd"],
                        marker="o", ms=3, lw=1, capsize=2, color=colours[model], label=model)
        ax.set_title(setting.replace("_", "-"))
        ax.set_xlabel("Cramér's V in training")
    axes[0][0].set_ylabel("balanced accuracy")
    axes[0][-1].legend(fontsize=7, frameon=False)
    return png(fig)


def class_abundance(counts: pd.DataFrame, colours: dict[str, tuple]) -> bytes:
    """Fig. 4 from ``tables.class_counts``: stacked cells per class per section, panel totals."""
    sections = counts.drop(index=["total", "share"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.28 * len(sections)), width_ratios=[2, 1],
                               layout="constrained")
    left = np.zeros(len(sections))
    for name in counts.columns:
        a.barh(sections.index, sections[name], left=left, color=colours.get(name), label=name)
        left += sections[name].to_numpy()
    a.invert_yaxis()
    a.set_xlabel("cells")
    a.set_title("cells per Tfine class and section")
    total, share = counts.loc["total"], counts.loc["share"]
    order = total.sort_values().index
    b.barh(order, total[order], color=[colours.get(n) for n in order])
    for y, name in enumerate(order):
        b.text(total[name], y, f" {int(total[name])} ({100 * share[name]:.1f} %)", va="center", fontsize=7)
    b.set_title("panel total")
    b.set_xlim(0, total.max() * 1.45)
    fig.legend(*a.get_legend_handles_labels(), fontsize=7, frameon=False, loc="outside lower center", ncol=5)
    return png(fig)


def thumbnail(image: np.ndarray, points: pd.DataFrame, colours: dict[str, tuple], title: str, mpp: float) -> bytes:
    """An H&E crop (RGB array at ``mpp`` µm/px) with nuclei (columns x_px, y_px, fine) as dots."""
    fig, ax = plt.subplots(figsize=(3.6, 3.6))
    ax.imshow(image)
    for name, rows in points.groupby("fine"):
        ax.scatter(rows["x_px"], rows["y_px"], s=7, color=colours.get(name, "black"), edgecolors="white",
                   linewidths=0.3, label=name)
    ax.set_xlim(0, image.shape[1])
    ax.set_ylim(image.shape[0], 0)
    ax.set_axis_off()
    ax.set_title(f"{title}\n{image.shape[1] * mpp:.0f} × {image.shape[0] * mpp:.0f} µm", fontsize=8)
    return png(fig)


def gene_heatmap(matrix: pd.DataFrame) -> bytes:
    """Genes × models Pearson r (``report.expression.gene_matrix``), genes in rows, best first."""
    fig, ax = plt.subplots(figsize=(1.6 + 0.9 * matrix.shape[1], 1.2 + 0.22 * matrix.shape[0]))
    limit = max(float(np.nanmax(np.abs(matrix.to_numpy()))), 0.05)
    image = ax.imshow(matrix.to_numpy(float), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(matrix.shape[1]), matrix.columns, rotation=30, ha="right")
    ax.set_yticks(range(matrix.shape[0]), matrix.index)
    fig.colorbar(image, ax=ax, label="Pearson r (test cells)")
    ax.set_title("Measured expression decoded per gene")
    return png(fig)
