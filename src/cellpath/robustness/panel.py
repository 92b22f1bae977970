"""The robustness maths applied to an evaluated panel: scoring units, groups, anchors and their
intervals, the shared k across models, and the per-cell margin table.

Biology is the cell's Tfine or Tcoarse label, the confounder its section (``robustness.confounder``),
and the group that is never its own neighbour the encoder patch the cell was read from at that
magnification (``group: patch``, the same tiling as extraction) or a square spatial tile of
``tile_um`` µm (``group: tile``). Scope ``panel`` scores every evaluated cell together; scope
``organ`` scores each organ with at least two confounder levels on its own. A unit of more than
``robustness.full_max_cells`` cells is scored on stratified anchors (docs/decisions/0025).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import RobustnessConfig
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.panel import PanelCells, ReadoutRows, encoder_patch_ids
from cellpath.robustness.metrics import shared_k
from cellpath.robustness.neighbours import RowSource, candidate_rows_for
from cellpath.robustness.sampling import INTERVAL_METRICS, bootstrap_intervals, stratified_anchors
from cellpath.robustness.sensitivity import margin_sweep, tail_sweep
from cellpath.robustness.table import RobustnessScores, score_embeddings


def cell_groups(data_dir: Path, panel: PanelCells, spec: EncoderSpec, magnification: str,
                cfg: RobustnessConfig) -> np.ndarray:
    """Group label per evaluated cell: "<section>:<patch>" (encoder patch) or "<section>:<col>:<row>"
    (a ``tile_um`` µm tile of Xenium µm coordinates)."""
    cells = panel.cells
    if cfg.group == "tile":
        col = np.floor(cells["x_um"].to_numpy() / cfg.tile_um).astype(int)
        row = np.floor(cells["y_um"].to_numpy() / cfg.tile_um).astype(int)
        return (cells["section_id"] + ":" + pd.Series(col).astype(str) + ":" + pd.Series(row).astype(str)).to_numpy()
    return encoder_patch_ids(data_dir, panel, spec.input_size, magnification)


def scoring_units(cells: pd.DataFrame, scope: str, confounder: str) -> list[tuple[str, np.ndarray]]:
    """(unit name, row positions) per scope: the whole panel, or each organ with ≥ 2 confounder levels."""
    if scope == "panel":
        return [("panel", np.arange(len(cells)))]
    units = []
    for organ, rows in cells.groupby("organ", sort=True).indices.items():
        if cells[confounder].iloc[rows].nunique() >= 2:
            units.append((str(organ), np.asarray(rows)))
    return units


class UnitRows(RowSource):
    """A readout over some panel rows, read from the memory-mapped store on demand (float32)."""

    def __init__(self, readout: ReadoutRows, rows: np.ndarray):
        self.readout, self.rows = readout, rows

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, positions: np.ndarray) -> np.ndarray:
        return self.readout.take(self.rows[positions])


@dataclass(frozen=True)
class UnitData:
    """One scoring unit's rows: the features of a model slug (a row source over the memory-mapped
    store), biology and confounder labels, groups per model slug, and the anchors scored (positions
    in the unit; None: every cell)."""

    features: dict[str, RowSource]
    biology: np.ndarray
    confounder: np.ndarray
    groups: dict[str, np.ndarray]
    anchors: np.ndarray | None

    def scored_positions(self) -> np.ndarray:
        """Positions in the unit of the cells scored: every cell, or the anchors."""
        return np.arange(len(self.biology)) if self.anchors is None else self.anchors


def candidate_rows(rows: RowSource, cfg: RobustnessConfig) -> int:
    """Rows per candidate chunk of ``rows`` within ``robustness.batch_memory_mb``."""
    return candidate_rows_for(cfg.batch_memory_mb, rows.take(np.zeros(1, dtype=np.int64)).shape[1])


def strata(biology: np.ndarray, confounder: np.ndarray) -> np.ndarray:
    """Each cell's (biology, confounder) cell, as one label."""
    return np.char.add(np.char.add(biology.astype(str), "\x1f"), confounder.astype(str))


def unit_anchors(biology: np.ndarray, confounder: np.ndarray, cfg: RobustnessConfig) -> np.ndarray | None:
    """None (score every cell) up to ``robustness.full_max_cells``; above, the stratified anchors
    (the same for every model of the unit, so their scores stay paired)."""
    if len(biology) <= cfg.full_max_cells:
        return None
    return stratified_anchors(strata(biology, confounder), cfg.anchors, seed=0)


def anchor_intervals(result: RobustnessScores, unit: UnitData, cfg: RobustnessConfig) -> dict[str, float]:
    """``<metric>_low`` / ``<metric>_high``: the anchors' bootstrap 95 % interval (NaN when every cell was scored)."""
    if unit.anchors is None:
        return {f"{name}_{end}": float("nan") for name in INTERVAL_METRICS for end in ("low", "high")}
    intervals = bootstrap_intervals(result, strata(unit.biology, unit.confounder)[unit.anchors],
                                    n_boot=cfg.bootstrap, seed=0)
    return {f"{name}_{end}": getattr(intervals[name], end) for name in INTERVAL_METRICS for end in ("low", "high")}


def score_models(specs: list[EncoderSpec], unit: UnitData,
                 cfg: RobustnessConfig) -> list[tuple[EncoderSpec, RobustnessScores, int, float]]:
    """Score each model of one condition: (spec, result, the model's own k*, seconds spent scoring
    it). RI/MaRI are at the shared k (the lower median of the models' k*) unless ``robustness.k``
    is set; k* is each model's own maximiser of its biological k-NN accuracy, whatever k the scores use."""
    seconds = {spec.slug: 0.0 for spec in specs}

    def score(spec: EncoderSpec, k: int | None) -> RobustnessScores:
        started = time.perf_counter()
        rows = unit.features[spec.slug]
        result = score_embeddings(rows, unit.biology, unit.confounder, unit.groups[spec.slug], m=cfg.m, k=k,
                                  alpha=cfg.alpha, anchors=unit.anchors, candidate_rows=candidate_rows(rows, cfg))
        seconds[spec.slug] += time.perf_counter() - started
        return result

    first = [(spec, score(spec, None)) for spec in specs]  # k=None: each model at its own k*
    own = {spec.slug: int(result.k) for spec, result in first}
    k = cfg.k if cfg.k is not None else int(shared_k(list(own.values())))
    scored = [(spec, result if result.k == k else score(spec, k), own[spec.slug]) for spec, result in first]
    return [(spec, result, own_k, seconds[spec.slug]) for spec, result, own_k in scored]


def sensitivity_rows(spec: EncoderSpec, unit: UnitData, margins: np.ndarray,
                     cfg: RobustnessConfig) -> list[pd.DataFrame]:
    """The model's rows of the optional α and m sweeps (``robustness.sensitivity``) on one unit."""
    frames = []
    if cfg.sensitivity.alphas:
        frames.append(tail_sweep(margins, cfg.sensitivity.alphas))
    if cfg.sensitivity.m_max is not None:
        rows = unit.features[spec.slug]
        frames.append(margin_sweep(rows, unit.biology, unit.confounder, unit.groups[spec.slug],
                                   range(1, cfg.sensitivity.m_max + 1), alpha=cfg.alpha, anchors=unit.anchors,
                                   candidate_rows=candidate_rows(rows, cfg)))
    return frames


def margin_table(unit_cells: pd.DataFrame, scored: np.ndarray, result: RobustnessScores, model: str,
                 condition: dict, taxonomy: str) -> pd.DataFrame:
    """One row per scored cell: its CRoMa ``margin``, the two mean cosine distances it is made of
    (``d_so``, ``d_os``: over the m nearest SO and OS neighbours, so that ``margin = (d_os - d_so) /
    (d_os + d_so)``; NaN where unresolved) and the nearest SO and OS neighbours (``so_section_id``,
    ``so_cell_id``, ``so_distance``, and the same for OS; empty where none)."""
    cells = unit_cells.iloc[scored]
    frame = pd.DataFrame({"model": model, **condition, "cell_id": cells["cell_id"].to_numpy(),
                          "section_id": cells["section_id"].to_numpy(), "organ": cells["organ"].to_numpy(),
                          "cell_type": cells[taxonomy].to_numpy(), "margin": result.margins,
                          "d_so": result.mean_so_distance, "d_os": result.mean_os_distance})
    for kind, nearest, distance in (("so", result.nearest_so, result.nearest_so_distance),
                                    ("os", result.nearest_os, result.nearest_os_distance)):
        found = nearest >= 0
        for column in ("section_id", "cell_id"):
            values = np.full(len(nearest), None, dtype=object)
            values[found] = unit_cells[column].to_numpy()[nearest[found]]
            frame[f"{kind}_{column}"] = values
        frame[f"{kind}_distance"] = np.where(found, distance, np.nan)
    return frame
