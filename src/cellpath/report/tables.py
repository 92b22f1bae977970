"""The report's tables, built from the stage outputs (pure: DataFrames in, DataFrames out).

Scores are fractions in the inputs and percentage points (pp) in the display tables, as in the
paper. Each builder returns a numeric frame; ``display`` turns one into strings ("48.12 ± 5.10").
Row order follows the paper: significant wins descending, the unrounded headline score breaking ties.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from cellpath.vocabulary import (CROSS_DOMAIN_PROTOCOLS, HEADLINE_READOUT, HEADLINE_TAXONOMY, PROTOCOL_LABELS,
                                 PROTOCOLS, READOUTS)

_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9}


def parse_count(text: str | None) -> float | None:
    """'350K (converted)' → 350000.0, '1100M' → 1.1e9, '1007' → 1007.0; None or unparsable → None."""
    if text is None:
        return None
    match = re.match(r"\s*([0-9]*\.?[0-9]+)\s*([KMB]?)", str(text))
    return float(match.group(1)) * _SCALE[match.group(2)] if match else None


def _pick(frame: pd.DataFrame, **equals) -> pd.DataFrame:
    mask = np.ones(len(frame), dtype=bool)
    for column, value in equals.items():
        mask &= (frame[column] == value).to_numpy()
    return frame[mask]


def _mean_sd(summary: pd.DataFrame, index: str, columns: str) -> pd.DataFrame:
    """Wide frame with '<column> mean' and '<column> sd' per value of ``columns`` (and '<column> low',
    '<column> high' when ``summary`` has the interval), empty in, empty out."""
    if summary.empty:
        return pd.DataFrame(index=pd.Index([], name=index))
    parts = [p for p in ("mean", "sd", "low", "high") if p in summary.columns]
    wide = summary.pivot_table(index=index, columns=columns, values=parts, aggfunc="first",
                               dropna=False)  # keep an SD that is NaN (one balanced unit)
    out = pd.DataFrame(index=wide.index)
    for key in wide["mean"].columns:
        for part in parts:
            out[f"{key} {part}"] = wide[(part, key)]
    return out


#: The run table's keys and scores that reports/tables/probe_runs.csv keeps (a readable copy in git).
RUN_TABLE_COLUMNS = ["model", "magnification", "readout", "taxonomy", "protocol", "unit", "seed", "status", "n_train",
                     "chosen_c", "c_tied", "macro_f1", "lbfgs_iterations", "converged"]


def run_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Every planned run (fitted or skipped) with its chosen C, how many Cs tied at its validation
    Macro-F1, and its test Macro-F1 (a fraction, 6 decimals), sorted by its keys, indexed by model."""
    table = runs[RUN_TABLE_COLUMNS].sort_values(RUN_TABLE_COLUMNS[:7], kind="stable")
    return table.assign(macro_f1=table["macro_f1"].round(6)).set_index("model")


def headline(summary: pd.DataFrame, cra_pooled: pd.DataFrame, crt: pd.DataFrame, robustness: pd.DataFrame,
             magnification: str) -> pd.DataFrame:
    """Per model: Tfine Nuc Macro-F1 mean/sd and 95% interval per protocol, CRA (Eq. 4) with its
    interval, CRT, and the panel-scope CRoMa median, LTM10 and RI of the Nuc readout (Tfine where
    scored, else Tcoarse)."""
    chosen = _pick(summary, readout=HEADLINE_READOUT, taxonomy=HEADLINE_TAXONOMY, magnification=magnification,
                   metric="macro_f1")
    frame = pd.DataFrame(index=pd.Index(sorted(summary["model"].unique()), name="model"))
    for protocol in PROTOCOLS:
        rows = chosen[chosen["protocol"] == protocol].set_index("model")
        for part in ("mean", "sd", "low", "high"):
            frame[f"{PROTOCOL_LABELS[protocol]} {part}"] = rows[part].reindex(frame.index)
    pooled = _pick(cra_pooled, magnification=magnification, metric="macro_f1").set_index("model")
    frame["CRA"] = pooled["cra"].reindex(frame.index)
    frame["CRA low"] = pooled["low"].reindex(frame.index)
    frame["CRA high"] = pooled["high"].reindex(frame.index)
    frame["CRT"] = crt.set_index("model")["crt"].reindex(frame.index)
    scored = _pick(robustness, readout=HEADLINE_READOUT, magnification=magnification, scope="panel")
    scored = scored.sort_values("taxonomy", key=lambda t: t != HEADLINE_TAXONOMY,
                                kind="mergesort").drop_duplicates("model")
    for column, label in (("croma_median", "CRoMa median"), ("ltm", "LTM10"), ("ri", "RI")):
        frame[label] = scored.set_index("model")[column].reindex(frame.index)
    return frame


def is_readout_table(is_panels: pd.DataFrame, cra_panels: pd.DataFrame, panel: str, magnification: str,
                     taxonomy: str, metric: str = "macro_f1") -> pd.DataFrame:
    """Supplementary C's IS table for one panel: per readout the organ-balanced mean with the SD
    across sections, this taxonomy's CRA and its CRA wins (paired (section, seed) differences);
    rows by wins, the unrounded CRA breaking ties."""
    chosen = _pick(is_panels, panel=panel, magnification=magnification, taxonomy=taxonomy, metric=metric)
    table = _mean_sd(chosen, "model", "readout")
    ordered = [c for r in READOUTS for c in (f"{r} mean", f"{r} sd") if c in table.columns]
    table = table[ordered]
    cra_rows = _pick(cra_panels, panel=panel, magnification=magnification, taxonomy=taxonomy,
                     metric=metric).set_index("model")
    table["CRA"] = cra_rows["cra"].reindex(table.index)
    table["Wins"] = cra_rows["wins"].reindex(table.index).fillna(0).astype(int)
    return _ranked(table, "Wins", "CRA")


def cra_table(summary: pd.DataFrame, cra_pooled: pd.DataFrame, magnification: str,
              metric: str = "macro_f1") -> pd.DataFrame:
    """Table 4: IS Nuc and Mean per taxonomy, CRA (both taxonomies pooled) ± SD, each with its 95%
    interval, and CRA wins (the paper's, and Holm-corrected beside them)."""
    chosen = _pick(summary, protocol="is", magnification=magnification, metric=metric)
    chosen = chosen[chosen["readout"].isin(["Nuc", "Mean"])]
    chosen = chosen.assign(column=chosen["taxonomy"].map({"fine": "Tfine", "coarse": "Tcoarse"}) + " "
                           + chosen["readout"])
    table = _mean_sd(chosen, "model", "column")
    ordered = [f"{t} {r} {s}" for t in ("Tfine", "Tcoarse") for r in ("Nuc", "Mean")
               for s in ("mean", "sd", "low", "high")]
    table = table[[c for c in ordered if c in table.columns]]
    pooled = _pick(cra_pooled, magnification=magnification, metric=metric).set_index("model")
    for part, column in (("mean", "cra"), ("sd", "sd"), ("low", "low"), ("high", "high")):
        table[f"CRA {part}"] = pooled[column].reindex(table.index)
    table["CRA wins"] = pooled["wins"].reindex(table.index).fillna(0).astype(int)
    table["CRA Holm wins"] = pooled["wins_holm"].reindex(table.index).fillna(0).astype(int)
    return _ranked(table, "CRA wins", "CRA mean")


def cross_domain_table(summary: pd.DataFrame, wins: pd.DataFrame, crt: pd.DataFrame, magnification: str,
                       taxonomy: str = HEADLINE_TAXONOMY) -> pd.DataFrame:
    """Table 5: Nuc Macro-F1 and Macro-AUROC (mean, sd, 95% interval) and Macro-F1 wins (the paper's,
    and Holm-corrected beside them) per cross-domain protocol, and CRT (from the paper's wins)."""
    table = pd.DataFrame(index=pd.Index(sorted(summary["model"].unique()), name="model"))
    for protocol in CROSS_DOMAIN_PROTOCOLS:
        name = PROTOCOL_LABELS[protocol]
        for metric, label in (("macro_f1", "F1"), ("macro_auroc", "AUROC")):
            rows = _pick(summary, protocol=protocol, magnification=magnification, taxonomy=taxonomy,
                         readout=HEADLINE_READOUT, metric=metric).set_index("model")
            for part in ("mean", "sd", "low", "high"):
                table[f"{name} {label} {part}"] = rows[part].reindex(table.index)
        won = _pick(wins, protocol=protocol, magnification=magnification, taxonomy=taxonomy,
                    readout=HEADLINE_READOUT, metric="macro_f1").set_index("model")
        table[f"{name} wins"] = won["wins"].reindex(table.index)
        table[f"{name} Holm wins"] = won["wins_holm"].reindex(table.index)
    table["CRT"] = crt.set_index("model")["crt"].reindex(table.index)
    return _ranked(table, "CRT", "MOCV F1 mean").dropna(how="all")


def _ranked(table: pd.DataFrame, key: str, tie_break: str) -> pd.DataFrame:
    columns = [c for c in (key, tie_break) if c in table.columns]
    return table.sort_values(columns, ascending=False, kind="mergesort") if columns else table


def landscape(cra_pooled: pd.DataFrame, crt: pd.DataFrame, registry: pd.DataFrame, magnification: str) -> pd.DataFrame:
    """Fig. 1 data: per model CRA wins (IS), CRT, pretraining scale (WSI equivalents) and parameters."""
    pooled = _pick(cra_pooled, magnification=magnification, metric="macro_f1").set_index("model")
    models = sorted(set(pooled.index) | set(crt["model"]))
    out = pd.DataFrame(index=pd.Index(models, name="model"))
    out["cra"] = pooled["cra"].reindex(out.index)
    out["cra_wins"] = pooled["wins"].reindex(out.index)
    out["crt"] = crt.set_index("model")["crt"].reindex(out.index)
    meta = registry.set_index("name")
    out["type"] = meta["type"].reindex(out.index)
    out["pretraining (WSI eq.)"] = meta["pretrain_wsi_equivalent"].reindex(out.index)
    out["parameters (registry)"] = meta["params"].reindex(out.index)
    out["pretrain_wsi"] = [parse_count(v) for v in out["pretraining (WSI eq.)"]]
    out["parameters"] = [parse_count(v) for v in out["parameters (registry)"]]
    return out.reset_index()


def taxonomy_effect(summary: pd.DataFrame, magnification: str) -> pd.DataFrame:
    """Fig. 3a-b: Nuc Macro-F1 per model and protocol under Tfine and Tcoarse, with ranks."""
    chosen = _pick(summary, magnification=magnification, readout=HEADLINE_READOUT, metric="macro_f1")
    table = chosen.pivot_table(index=["protocol", "model"], columns="taxonomy", values="mean", aggfunc="first")
    table = table.reindex(columns=["fine", "coarse"]).reset_index()
    for taxonomy in ("fine", "coarse"):
        table[f"{taxonomy} rank"] = table.groupby("protocol")[taxonomy].rank(ascending=False, method="min")
    return table


def readout_effect(summary: pd.DataFrame, magnification: str, taxonomy: str = HEADLINE_TAXONOMY) -> pd.DataFrame:
    """Fig. 3c: Macro-F1 per model, protocol and readout."""
    chosen = _pick(summary, magnification=magnification, taxonomy=taxonomy, metric="macro_f1")
    table = chosen.pivot_table(index=["protocol", "model"], columns="readout", values="mean", aggfunc="first")
    return table.reindex(columns=[r for r in READOUTS if r in table.columns]).reset_index()


def magnification_effect(summary: pd.DataFrame, magnifications: list[str],
                         taxonomy: str = HEADLINE_TAXONOMY) -> pd.DataFrame:
    """Fig. 3d: Nuc Macro-F1 per model, protocol and magnification, and retention relative to the
    highest magnification (the paper's 99.6 % at 20× and 92.9 % at 10× under IS)."""
    chosen = _pick(summary, taxonomy=taxonomy, readout=HEADLINE_READOUT, metric="macro_f1")
    table = chosen.pivot_table(index=["protocol", "model"], columns="magnification", values="mean", aggfunc="first")
    ordered = sorted((m for m in magnifications if m in table.columns), key=lambda m: -int(m.rstrip("x")))
    table = table.reindex(columns=ordered)
    for magnification in ordered[1:]:
        table[f"{magnification} retention"] = table[magnification] / table[ordered[0]]
    return table.reset_index()


def panel_robustness(runs: pd.DataFrame, panels: pd.DataFrame, magnification: str,
                     taxonomy: str = HEADLINE_TAXONOMY) -> pd.DataFrame:
    """IS Nuc Macro-F1 and rank per model on each nested panel (S10 ⊂ … ⊂ S25).

    IS units are single sections, so a smaller panel's IS result is the organ-balanced mean over its
    sections' units of the probe run table (no refit). Cross-domain protocols train on the panel
    and need their own run (``dvc exp run -S panel=S10``). Also gives Spearman ρ of each panel's
    ranking against the largest panel's.
    """
    panel_columns = sorted((c for c in panels.columns if re.fullmatch(r"S\d+", c)), key=lambda c: int(c[1:]))
    ok = runs[(runs["status"] == "ok") & (runs["protocol"] == "is") & (runs["readout"] == HEADLINE_READOUT)
              & (runs["taxonomy"] == taxonomy) & (runs["magnification"] == magnification)]
    per_unit = ok.groupby(["model", "organ", "unit"])["macro_f1"].mean().reset_index()
    rows = []
    for panel in panel_columns:
        members = set(panels.loc[panels[panel].astype(bool), "section_id"])
        chosen = per_unit[per_unit["unit"].isin(members)]
        if chosen.empty:
            continue
        per_model = chosen.groupby(["model", "organ"])["macro_f1"].mean().groupby("model").mean()
        for model, score in per_model.items():
            rows.append({"panel": panel, "n_sections": int(chosen["unit"].nunique()), "model": model,
                         "macro_f1": score})
    table = pd.DataFrame(rows, columns=["panel", "n_sections", "model", "macro_f1"])
    if table.empty:
        return table.assign(rank=[], spearman_vs_largest=[])
    table["rank"] = table.groupby("panel")["macro_f1"].rank(ascending=False, method="min").astype(int)
    largest = table[table["panel"] == table["panel"].iloc[-1]].set_index("model")["macro_f1"]
    rho = {}
    for panel, group in table.groupby("panel"):
        paired = pd.concat([group.set_index("model")["macro_f1"], largest], axis=1, join="inner").dropna()
        rho[panel] = (float(scipy_stats.spearmanr(paired.iloc[:, 0], paired.iloc[:, 1]).statistic)
                      if len(paired) >= 3 else np.nan)
    table["spearman_vs_largest"] = table["panel"].map(rho)
    return table


def pareto_frontier(median: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """True for points no other point dominates (≥ on both axes, > on one); higher is better."""
    median, tail = np.asarray(median, float), np.asarray(tail, float)
    better_or_equal = (median[None, :] >= median[:, None]) & (tail[None, :] >= tail[:, None])
    strictly = (median[None, :] > median[:, None]) | (tail[None, :] > tail[:, None])
    return ~np.any(better_or_equal & strictly, axis=1)


SHORTCUT_KEYS = ["model", "magnification", "readout", "taxonomy", "confounder"]  # what defines its condition


def robustness_table(summary: pd.DataFrame, shortcut: pd.DataFrame) -> pd.DataFrame:
    """Per condition: CRoMa median, F(0), LTM, RI, MaRI, support, k-NN balanced accuracies, the
    median–LTM Pareto flag among the models of the condition, and the shortcut probe's nIPD with its
    bootstrap interval, on the rows of exactly its condition: the same model, magnification,
    readout, taxonomy and confounder, panel scope (the probe is fitted on the whole panel)."""
    keys = ["magnification", "readout", "taxonomy", "scope", "unit"]
    columns = ["model", *keys, "confounder", "n_samples", "n_undefined", "croma_median", "f0", "ltm", "ri", "mari",
               "support", "k", "k_selected", "bio_bacc", "conf_bacc"]
    table = summary[[c for c in columns if c in summary.columns]].copy()
    table["pareto"] = False
    for _, group in table.groupby(keys, sort=False):
        table.loc[group.index, "pareto"] = pareto_frontier(group["croma_median"], group["ltm"])
    if len(shortcut) and "confounder" in table.columns:
        wide = shortcut.pivot_table(index=SHORTCUT_KEYS, columns="setting", values=["nipd", "nipd_low", "nipd_high"],
                                    aggfunc="first")
        wide.columns = [f"{value.replace('_', ' ')} {setting}" for value, setting in wide.columns]
        joined = table[table["scope"] == "panel"].merge(wide.reset_index(), on=SHORTCUT_KEYS, how="left")
        table = pd.concat([joined, table[table["scope"] != "panel"]], ignore_index=True)
    return table.sort_values([*keys, "croma_median"], ascending=[True] * len(keys) + [False], kind="mergesort")


def shortcut_table(shortcut: pd.DataFrame) -> pd.DataFrame:
    """APD and nIPD per model and setting, nIPD with its 95 % bootstrap interval over resampling runs."""
    table = shortcut.copy()
    if {"nipd_low", "nipd_high"} <= set(table.columns):
        table["nIPD 95 % interval"] = [f"[{low:.3f}, {high:.3f}]" for low, high in zip(table["nipd_low"],
                                                                                       table["nipd_high"])]
    return table


def sensitivity_table(agreement: pd.DataFrame) -> pd.DataFrame:
    """The m and α sweeps' rank correlations (CRoMa paper, Tables S1, S2), one row per condition and
    comparison, indexed by the comparison ("m 5 vs 1", "α 0.05 vs 0.1")."""
    if agreement.empty:
        return pd.DataFrame(columns=["condition", "ranked", "ρ", "models", "< 0 at x / y", "< 0 over the sweep"])
    symbol = {"m": "m", "alpha": "α"}
    rows = []
    for row in agreement.itertuples():
        x, y = (f"{v:g}" for v in (row.x, row.y))
        rows.append({"comparison": f"{symbol[row.parameter]} {x} vs {y}",
                     "condition": " ".join(str(v) for v in (row.magnification, row.readout, row.taxonomy, row.scope,
                                                            row.unit)),
                     "ranked": {"croma_median": "median CRoMa", "ltm": "LTM"}[row.statistic], "ρ": row.rho,
                     "models": row.n_models, "< 0 at x / y": f"{row.n_negative_x} / {row.n_negative_y}",
                     "< 0 over the sweep": f"{row.n_negative_min}–{row.n_negative_max}"})
    return pd.DataFrame(rows).set_index("comparison")


def class_counts(label_summary: pd.DataFrame, taxonomy: str = HEADLINE_TAXONOMY) -> pd.DataFrame:
    """Cells per class per section (Fig. 4), from the annotation summary's ``<taxonomy>:<class>``
    columns, with a panel total row and each class's share of the panel."""
    prefix = f"{taxonomy}:"
    columns = [c for c in label_summary.columns if c.startswith(prefix)]
    kept = label_summary[~label_summary["excluded"].astype(bool)]
    table = kept.set_index("section_id")[columns].rename(columns=lambda c: c[len(prefix):]).astype(int)
    total = table.sum(axis=0)
    table.loc["total"] = total
    table.loc["share"] = total / total.sum()
    return table


def display_counts(counts: pd.DataFrame) -> pd.DataFrame:
    """``class_counts`` as strings: integers, and the share row in percent."""
    out = counts.drop(index="share").astype(int).astype(str)
    out.loc["share"] = [f"{100 * v:.1f} %" for v in counts.loc["share"]]
    return out


REGISTRATION_COLUMNS = ("alignment_source", "reg_median_um", "reg_p90_um", "reg_translation_x_um", "reg_translation_y_um",
                        "reg_rotation_deg", "reg_scale_x", "reg_scale_y", "reg_shear_deg", "reg_residual_rms_um",
                        "registration_flagged")


def panel_table(panels: pd.DataFrame) -> pd.DataFrame:
    """The candidate sections ranked by AGR-BAcc, with cell counts, registration QC and panel membership
    (registration columns only where the concordance stage wrote them)."""
    panel_columns = sorted((c for c in panels.columns if re.fullmatch(r"S\d+", c)), key=lambda c: int(c[1:]))
    columns = ["rank", "section_id", "organ", "score", "cells", "n_matched", "reference_unmatched",
               "poor_reference_coverage", "excluded_by_annotation", *REGISTRATION_COLUMNS, *panel_columns]
    return panels[[c for c in columns if c in panels.columns]].sort_values("rank").rename(columns={"score": "AGR-BAcc"})


def display(table: pd.DataFrame, percent_pairs: bool = True, percent_columns: Collection[str] = ("CRA",),
            digits: int = 2) -> pd.DataFrame:
    """Strings for a numeric table. '<x> mean' + '<x> sd' pairs become one '<x>' column 'm ± s';
    a '<x> low' + '<x> high' interval joins its pair (or its '<x>' column) as 'm ± s [low, high]';
    pairs (when ``percent_pairs``) and ``percent_columns`` are shown ×100 (fractions → pp); win
    counts as integers; booleans as 'yes' / ''; other floats rounded; NaN → '–'."""
    out = pd.DataFrame(index=table.index)
    interval_of = {c[:-4] for c in table.columns if c.endswith(" low") and f"{c[:-4]} high" in table.columns}
    for column in table.columns:
        if column.endswith(" sd") and f"{column[:-3]} mean" in table.columns:
            continue
        if (column.endswith(" low") and column[:-4] in interval_of
                or column.endswith(" high") and column[:-5] in interval_of):
            continue
        values = table[column]
        if column.endswith(" mean") and f"{column[:-5]} sd" in table.columns:
            scale = 100.0 if percent_pairs else 1.0
            sd = table[f"{column[:-5]} sd"]
            out[column[:-5]] = [_pm(m * scale, s * scale, digits) for m, s in zip(values, sd)]
            if column[:-5] in interval_of:
                out[column[:-5]] = _with_interval(out[column[:-5]], table, column[:-5], scale, digits)
        elif column.lower().endswith("wins"):
            out[column] = ["–" if pd.isna(v) else str(int(v)) for v in values]
        elif pd.api.types.is_bool_dtype(values):
            out[column] = ["yes" if pd.notna(v) and v else "" for v in values]  # NA: a skipped run
        elif pd.api.types.is_integer_dtype(values):
            out[column] = values.astype(str)
        elif pd.api.types.is_float_dtype(values):
            factor = 100.0 if column in percent_columns else 1.0
            out[column] = ["–" if pd.isna(v) else f"{v * factor:.{digits}f}" for v in values]
            if column in interval_of:
                out[column] = _with_interval(out[column], table, column, factor, digits)
        else:
            out[column] = ["–" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v) for v in values]
    return out


def _with_interval(shown: pd.Series, table: pd.DataFrame, name: str, scale: float, digits: int) -> list[str]:
    """``shown`` values followed by the 95% interval '[low, high]' of ``name`` (× ``scale``)."""
    return [text if pd.isna(lo) or pd.isna(hi) or text == "–"
            else f"{text} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
            for text, lo, hi in zip(shown, table[f"{name} low"], table[f"{name} high"])]


def _pm(mean: float, sd: float, digits: int) -> str:
    if pd.isna(mean):
        return "–"
    return f"{mean:.{digits}f}" if pd.isna(sd) else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def best_two(table: pd.DataFrame) -> dict[str, tuple[object, object]]:
    """Per '<x> mean' column (and CRA / CRT), the index of the best and second-best row (higher is better)."""
    marks = {}
    for column in table.columns:
        if column.endswith(" mean") or column in ("CRA", "CRT"):
            ranked = table[column].dropna().sort_values(ascending=False, kind="mergesort")
            name = column[:-5] if column.endswith(" mean") else column
            marks[name] = (ranked.index[0] if len(ranked) else None, ranked.index[1] if len(ranked) > 1 else None)
    return marks
