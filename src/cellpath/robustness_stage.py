"""The ``robustness`` stage: CRoMa, F(0), LTM, RI, MaRI and k-NN probes per encoder, plus the
shortcut probe's APD / nIPD and the low-margin enrichment table.

Biology is the cell's Tfine or Tcoarse label, the confounder its section (``robustness.confounder``),
and the group that is never its own neighbour the encoder patch the cell was read from at that
magnification (``group: patch``, the same tiling as extraction) or a square spatial tile of
``tile_um`` µm (``group: tile``). Scope ``panel`` scores every evaluated cell together; scope
``organ`` scores each organ with at least two confounder levels on its own.

The shared k of RI / MaRI follows the paper: per model, k* maximises the biological k-NN balanced
accuracy over the candidate k's; the shared k is the lower median of the models' k* within each
(magnification, readout, taxonomy, scope, unit). Outputs (under the reports folder):

- ``robustness/summary.csv``: one row per (model, magnification, readout, taxonomy, scope, unit);
- ``robustness/margins.parquet``: every cell's CRoMa margin (NaN where undefined) for failure analysis;
- ``robustness/low_margin_enrichment.csv``: cell type, organ and section shares of the worst decile;
- ``robustness/shortcut.csv``: the shortcut probe's accuracy curves, ``shortcut_summary.csv`` APD / nIPD;
- ``robustness_metrics.json``: per model, the headline numbers for ``dvc metrics show``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.atomic import atomic_output
from cellpath.config import Params, RobustnessConfig
from cellpath.encoders.registry import EncoderSpec
from cellpath.errors import ConfigError
from cellpath.panel_cells import PanelCells, load_base_readouts, load_panel_cells, readout_matrix
from cellpath.probe_stage import evaluated_encoders, flat_metrics, headline_magnification
from cellpath.readouts import CLS_READOUTS
from cellpath.sections import read_section_index, read_section_table
from cellpath.tracking import Tracker

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("croma_median", "f0", "ltm", "ri", "mari", "bio_bacc", "conf_bacc")


def cell_groups(data_dir: Path, panel: PanelCells, spec: EncoderSpec, magnification: str,
                cfg: RobustnessConfig) -> np.ndarray:
    """Group label per evaluated cell: "<section>:<patch>" (encoder patch) or "<section>:<col>:<row>" (tile)."""
    cells = panel.cells
    if cfg.group == "tile":
        col = np.floor(cells["x_um"].to_numpy() / cfg.tile_um).astype(int)
        row = np.floor(cells["y_um"].to_numpy() / cfg.tile_um).astype(int)
        return (cells["section_id"] + ":" + pd.Series(col).astype(str) + ":" + pd.Series(row).astype(str)).to_numpy()
    from cellpath.features import MAGNIFICATIONS, place_cells

    index = read_section_index(data_dir).set_index("section_id")
    parts = []
    for section_id, rows in panel.rows_in_section.items():
        obs = read_section_table(data_dir, section_id).obs
        geometry = index.loc[section_id]
        placement = place_cells(obs[["he_x_px", "he_y_px"]].to_numpy(), obs["nucleus_area"].to_numpy(dtype=float),
                                slide_size=(int(geometry["he_width_px"]), int(geometry["he_height_px"])),
                                slide_mpp=float(geometry["he_mpp"]), target_mpp=MAGNIFICATIONS[magnification],
                                input_size=spec.input_size)
        parts.append(np.char.add(f"{section_id}:", placement.patch_index[rows].astype(str)))
    return np.concatenate(parts)


def scoring_units(cells: pd.DataFrame, scope: str, confounder: str) -> list[tuple[str, np.ndarray]]:
    """(unit name, row positions) per scope: the whole panel, or each organ with ≥ 2 confounder levels."""
    if scope == "panel":
        return [("panel", np.arange(len(cells)))]
    units = []
    for organ, rows in cells.groupby("organ", sort=True).indices.items():
        if cells[confounder].iloc[rows].nunique() >= 2:
            units.append((str(organ), np.asarray(rows)))
    return units


def run_robustness_stage(params: Params, data_dir: Path, reports: Path, root: Path | None = None) -> pd.DataFrame:
    """robustness: score every (encoder, magnification, readout, taxonomy, scope, unit)."""
    from cellpath.robustness import low_margin_enrichment

    started = time.perf_counter()
    cfg = params.robustness
    magnifications = params.stage_magnifications(cfg.magnifications)
    encoders = evaluated_encoders(params)
    panel = load_panel_cells(data_dir, params.panel)
    cells = panel.cells
    if cells[cfg.confounder].nunique() < 2:
        raise ConfigError(f"robustness.confounder: {cfg.confounder!r} has a single level in panel {params.panel}; "
                          "robustness needs at least two")
    tracker = Tracker(params.mlflow, "robustness", root)
    rows, margin_frames, enrichment_frames, skipped = [], [], [], 0
    try:
        for magnification in magnifications:
            groups = {spec.slug: cell_groups(data_dir, panel, spec, magnification, cfg) for spec in encoders}
            bases = {spec.slug: load_base_readouts(data_dir / "features", spec.slug, magnification, panel)
                     for spec in encoders}
            for readout in cfg.readouts:
                usable = [s for s in encoders if s.has_cls or readout not in CLS_READOUTS]
                skipped += len(encoders) - len(usable)
                for taxonomy in cfg.taxonomies:
                    for scope in cfg.scopes:
                        for unit, unit_rows in scoring_units(cells, scope, cfg.confounder):
                            condition = {"magnification": magnification, "readout": readout, "taxonomy": taxonomy,
                                         "scope": scope, "unit": unit}
                            scored = _score_models(usable, bases, groups, unit_rows, cells, condition, cfg)
                            for spec, result in scored:
                                summary = {"model": spec.name, **condition, **result.summary(),
                                           "k_selected": _own_k(result)}
                                rows.append(summary)
                                margins = _margin_frame(cells.iloc[unit_rows], result.margins, spec.name, condition,
                                                        taxonomy)
                                margin_frames.append(margins)
                                enrichment = low_margin_enrichment(
                                    result.margins, margins, columns=("cell_type", "organ", "section_id"),
                                    fraction=cfg.low_margin_fraction)
                                enrichment_frames.append(enrichment.assign(model=spec.name, **condition))
                                tracker.log_child(f"{spec.name} {magnification} {readout} {taxonomy} {scope} {unit}",
                                                  {"model": spec.name, **condition, "m": cfg.m, "k": result.k,
                                                   "group": cfg.group, "confounder": cfg.confounder},
                                                  result.summary(),
                                                  {"margins.parquet": margins})
                                log.info("robustness %s %s %s %s %s %s: CRoMa median %.3f, F(0) %.3f, LTM %.3f, "
                                         "RI %.3f, MaRI %.3f (k=%d; %d of %d margins undefined)", spec.name,
                                         magnification, readout, taxonomy, scope, unit, result.median, result.f0,
                                         result.ltm, result.ri, result.mari, result.k, result.n_undefined,
                                         len(result.margins))
        summary = pd.DataFrame(rows)
        shortcut_curves, shortcut_summary = _shortcut(params, encoders, panel, data_dir,
                                                      headline_magnification(magnifications))
        metrics = robustness_metrics(summary, shortcut_summary, headline_magnification(magnifications))
        _write(reports, summary, pd.concat(margin_frames, ignore_index=True),
               pd.concat(enrichment_frames, ignore_index=True), shortcut_curves, shortcut_summary, metrics)
        tracker.finish({"panel": params.panel, "group": cfg.group, "confounder": cfg.confounder, "m": cfg.m,
                        "alpha": cfg.alpha, "k": cfg.k, "scopes": ",".join(cfg.scopes)},
                       flat_metrics(metrics), [reports / "robustness" / "summary.csv"])
    except BaseException:
        tracker.finish({}, {}, failed=True)
        raise
    log.info("robustness: %d scored conditions (%d model × readout pairs without a CLS token skipped) in %.1f s; "
             "MLflow %.1f s blocking, %.1f s in the logging thread", len(summary), skipped,
             time.perf_counter() - started, tracker.seconds, tracker.busy_seconds)
    return summary


def _own_k(result) -> int:
    """This model's k*: the first maximiser of its biological k-NN balanced accuracy curve."""
    from cellpath.robustness import select_k

    return int(select_k(result.bio_bacc_by_k, sorted(result.bio_bacc_by_k)))


def _score_models(specs: list[EncoderSpec], bases: dict[str, dict[str, np.ndarray]], groups: dict[str, np.ndarray],
                  unit_rows: np.ndarray, cells: pd.DataFrame, condition: dict, cfg: RobustnessConfig) -> list[tuple]:
    """Score each model of one condition; RI/MaRI at the shared k unless ``robustness.k`` is set."""
    from cellpath.robustness import score_embeddings, shared_k

    biology = cells[condition["taxonomy"]].to_numpy()[unit_rows]
    confounder = cells[cfg.confounder].to_numpy()[unit_rows]
    features = {s.slug: readout_matrix(bases[s.slug], condition["readout"])[unit_rows] for s in specs}

    def score(spec, k):
        return score_embeddings(features[spec.slug], biology, confounder, groups[spec.slug][unit_rows], m=cfg.m, k=k,
                                alpha=cfg.alpha)

    if cfg.k is not None:
        return [(spec, score(spec, cfg.k)) for spec in specs]
    first = [(spec, score(spec, None)) for spec in specs]
    k = int(shared_k([result.k for _, result in first]))
    return [(spec, result if result.k == k else score(spec, k)) for spec, result in first]


def _margin_frame(cells: pd.DataFrame, margins: np.ndarray, model: str, condition: dict, taxonomy: str) -> pd.DataFrame:
    return pd.DataFrame({"model": model, **condition, "cell_id": cells["cell_id"].to_numpy(),
                         "section_id": cells["section_id"].to_numpy(), "organ": cells["organ"].to_numpy(),
                         "cell_type": cells[taxonomy].to_numpy(), "margin": margins})


def _shortcut(params: Params, encoders: list[EncoderSpec], panel: PanelCells, data_dir: Path,
              magnification: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The shortcut probe per encoder at the headline magnification: curves and APD / nIPD."""
    from cellpath.robustness import apd, nipd, shortcut_sweep

    cfg = params.robustness.shortcut
    if not cfg.enabled:
        return pd.DataFrame(), pd.DataFrame()
    cells = panel.cells
    levels = sorted(cells[cfg.confounder].unique())
    if len(levels) - cfg.held_out < 2:
        raise ConfigError(f"robustness.shortcut: {len(levels)} {cfg.confounder} level(s) leave fewer than two to "
                          f"train on with held_out={cfg.held_out}")
    train_levels = levels[:len(levels) - cfg.held_out]  # the last `held_out` levels (sorted) are never trained on
    log.info("shortcut probe: trained on %s, held out %s", ", ".join(train_levels),
             ", ".join(levels[len(train_levels):]))
    curves, summaries = [], []
    for spec in encoders:
        if cfg.readout in CLS_READOUTS and not spec.has_cls:
            continue
        x = readout_matrix(load_base_readouts(data_dir / "features", spec.slug, magnification, panel), cfg.readout)
        groups = cell_groups(data_dir, panel, spec, magnification, params.robustness)
        sweep = shortcut_sweep(x, cells[cfg.taxonomy].to_numpy(), cells[cfg.confounder].to_numpy(), groups,
                               pool_size=cfg.pool_size, train_confounders=train_levels, n_runs=cfg.n_runs,
                               seed=params.seed)
        for setting, accuracies in (("in_domain", sweep.in_domain), ("held_out", sweep.held_out)):
            if accuracies is None:
                continue
            for v, row in zip(sweep.cramers_v, np.asarray(accuracies)):
                curves.append({"model": spec.name, "setting": setting, "cramers_v": float(v),
                               "balanced_accuracy_mean": float(np.mean(row)), "balanced_accuracy_sd": float(np.std(row))})
            summaries.append({"model": spec.name, "setting": setting, "readout": cfg.readout,
                              "taxonomy": cfg.taxonomy, "magnification": magnification,
                              "apd": apd(accuracies), "nipd": nipd(accuracies, sweep.cramers_v, sweep.chance)})
    return pd.DataFrame(curves), pd.DataFrame(summaries)


def robustness_metrics(summary: pd.DataFrame, shortcut: pd.DataFrame, magnification: str) -> dict:
    """Per model: panel-scope Tfine Nuc summaries at the headline magnification, and nIPD."""
    chosen = summary[(summary["scope"] == "panel") & (summary["magnification"] == magnification)
                     & (summary["readout"] == "Nuc") & (summary["taxonomy"] == "fine")]
    metrics: dict = {"magnification": magnification}
    for row in chosen.itertuples():
        metrics[row.model] = {key: round(float(getattr(row, key)), 4) for key in SUMMARY_KEYS
                              if np.isfinite(getattr(row, key))}
    for row in shortcut.itertuples() if len(shortcut) else []:
        if np.isfinite(row.nipd):
            metrics.setdefault(row.model, {})[f"nipd_{row.setting}"] = round(float(row.nipd), 4)
    return metrics


def _write(reports: Path, summary: pd.DataFrame, margins: pd.DataFrame, enrichment: pd.DataFrame,
           curves: pd.DataFrame, shortcut: pd.DataFrame, metrics: dict) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    with atomic_output(reports / "robustness") as out:
        out.mkdir()
        summary.to_csv(out / "summary.csv", index=False)
        margins.to_parquet(out / "margins.parquet", index=False)
        enrichment.to_csv(out / "low_margin_enrichment.csv", index=False)
        curves.to_csv(out / "shortcut.csv", index=False)
        shortcut.to_csv(out / "shortcut_summary.csv", index=False)
    with atomic_output(reports / "robustness_metrics.json") as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
