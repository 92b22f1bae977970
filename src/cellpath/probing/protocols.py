"""The four evaluation protocols as pure functions returning cell indices per (unit, seed).

All functions take a cell table with one row per eligible cell — columns ``section_id``,
``organ``, ``x_um``, ``y_um`` (nucleus centroid, µm) — and return :class:`Split` objects whose
``train``/``val``/``test`` are integer row positions into that table. No cell of a test unit is
ever in ``train`` or ``val``:

- IS: per section and seed, train+val are the cells inside a spatial ROI (a band covering
  ``roi_fraction`` of the section's cells along x or y; the seed moves it and picks the axis);
  test is every cell outside the ROI farther than ``buffer_um`` from it and sharing no encoder
  patch with a cell inside it, under every patch grid given (``patch_groups``: one grid per
  encoder input size at the evaluated magnification). A shared patch would give a test cell
  exactly a training cell's Mean and Cls features (docs/decisions/0017-leak-free-is-split.md).
  Each split counts the test cells each rule removed (``excluded``).
- IOCD: per organ with ≥ 2 sections, each section is held out in turn; the organ's other
  sections give train+val.
- MOCV: whole sections go to ``n_folds`` folds by an organ-aware manifest (sections of one organ
  spread over folds); each fold is tested on its pooled sections, trained on the rest.
- LOOO: each organ is held out whole; every other organ gives train+val.

Validation cells are a seeded random ``val_fraction`` of the train+val pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cellpath.vocabulary import PROTOCOLS


@dataclass(frozen=True)
class Split:
    """One evaluation run's partition of the cell table (row positions)."""

    protocol: str
    unit: str
    organ: str  # the organ the unit belongs to ("" for MOCV folds, which mix organs)
    seed: int
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    excluded: tuple[tuple[str, int], ...] = ()  # (rule, test cells it removed), e.g. (("buffer", 12),)


def _train_val(pool: np.ndarray, val_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    shuffled = rng.permutation(pool)
    n_val = int(round(val_fraction * len(shuffled)))
    return np.sort(shuffled[n_val:]), np.sort(shuffled[:n_val])


def _seed_rng(protocol: str, unit: str, seed: int) -> np.random.Generator:
    key = [ord(c) for c in f"{protocol}:{unit}"]
    return np.random.default_rng([seed, *key])


def _held_out_unit(protocol: str, unit: str, organ: str, test: np.ndarray, pool: np.ndarray, seeds: int,
                   val_fraction: float) -> list[Split]:
    """One held-out unit's splits, one per seed: the whole ``test`` set, ``pool`` split into train/val."""
    return [Split(protocol, unit, organ, seed, *_train_val(pool, val_fraction, _seed_rng(protocol, unit, seed)),
                  np.sort(test)) for seed in range(seeds)]


IS_EXCLUSION_RULES = ("buffer", "shared_patch")  # in the order they apply; run table: n_test_excluded_<rule>


def intra_section_splits(cells: pd.DataFrame, seeds: int, *, roi_fraction: float = 0.5, buffer_um: float = 25.0,
                         val_fraction: float = 0.2, patch_groups: tuple[np.ndarray, ...] = ()) -> list[Split]:
    """IS: spatial ROI train/val inside a section, test outside it beyond the buffer and in no patch
    of ``patch_groups`` (per grid, a patch id per cell table row) that holds an ROI cell."""
    splits = []
    for section_id, group in cells.groupby("section_id", sort=True):
        rows = group.index.to_numpy()
        organ = str(group["organ"].iloc[0])
        for seed in range(seeds):
            rng = _seed_rng("is", section_id, seed)
            axis = ("x_um", "y_um")[seed % 2]
            coord = group[axis].to_numpy()
            start = rng.uniform(0.0, 1.0 - roi_fraction)
            low, high = np.quantile(coord, [start, start + roi_fraction])
            inside = (coord >= low) & (coord <= high)
            beyond_buffer = (coord < low - buffer_um) | (coord > high + buffer_um)
            test = beyond_buffer.copy()
            for groups in patch_groups:
                section_groups = groups[rows]
                test &= ~np.isin(section_groups, section_groups[inside])
            excluded = (("buffer", int((~inside & ~beyond_buffer).sum())),
                        ("shared_patch", int((beyond_buffer & ~test).sum())))
            train, val = _train_val(rows[inside], val_fraction, rng)
            splits.append(Split("is", str(section_id), organ, seed, train, val, np.sort(rows[test]), excluded))
    return splits


def intra_organ_splits(cells: pd.DataFrame, seeds: int, *, val_fraction: float = 0.2) -> list[Split]:
    """IOCD: hold out one whole section of an organ with ≥ 2 sections; train on the organ's others."""
    splits = []
    for organ, group in cells.groupby("organ", sort=True):
        sections = sorted(group["section_id"].unique())
        if len(sections) < 2:
            continue
        for held_out in sections:
            held = (group["section_id"] == held_out).to_numpy()
            splits += _held_out_unit("iocd", str(held_out), str(organ), group.index[held].to_numpy(),
                                     group.index[~held].to_numpy(), seeds, val_fraction)
    return splits


def mocv_manifest(sections: pd.DataFrame, n_folds: int) -> dict[str, int]:
    """Organ-aware fold manifest: sections sorted by (organ, id) are dealt round-robin to folds.

    Sections of one organ therefore land in different folds (as long as the organ has no more
    sections than folds), and the manifest depends only on the section list.
    """
    ordered = sections[["section_id", "organ"]].drop_duplicates().sort_values(["organ", "section_id"])
    if len(ordered) < n_folds:
        raise ValueError(f"MOCV needs at least {n_folds} sections for {n_folds} folds, found {len(ordered)}")
    return {sid: i % n_folds for i, sid in enumerate(ordered["section_id"])}


def multi_organ_splits(cells: pd.DataFrame, seeds: int, *, n_folds: int = 5, val_fraction: float = 0.2) -> list[Split]:
    """MOCV: each fold's pooled sections are tested; the other folds give train+val."""
    manifest = mocv_manifest(cells, n_folds)
    fold = cells["section_id"].map(manifest).to_numpy()
    splits = []
    for k in range(n_folds):
        splits += _held_out_unit("mocv", f"fold{k}", "", cells.index[fold == k].to_numpy(),
                                 cells.index[fold != k].to_numpy(), seeds, val_fraction)
    return splits


def leave_one_organ_out_splits(cells: pd.DataFrame, seeds: int, *, val_fraction: float = 0.2) -> list[Split]:
    """LOOO: every cell of one organ is tested (pooled); all other organs give train+val."""
    splits = []
    for organ in sorted(cells["organ"].unique()):
        held = (cells["organ"] == organ).to_numpy()
        splits += _held_out_unit("looo", str(organ), str(organ), cells.index[held].to_numpy(),
                                 cells.index[~held].to_numpy(), seeds, val_fraction)
    return splits


def _section_units(sections: pd.DataFrame, n_folds: int) -> list[str]:
    return sorted(sections["section_id"])


def _sections_of_shared_organs(sections: pd.DataFrame, n_folds: int) -> list[str]:
    counts = sections["organ"].value_counts()
    return sorted(sections.loc[sections["organ"].map(counts) >= 2, "section_id"])


def _fold_units(sections: pd.DataFrame, n_folds: int) -> list[str]:
    return [f"fold{k}" for k in range(n_folds)]


def _organ_units(sections: pd.DataFrame, n_folds: int) -> list[str]:
    return sorted(sections["organ"].unique())


@dataclass(frozen=True)
class ProtocolDefinition:
    """A protocol's evaluation units for a section list, its split function and the options it takes."""

    units: Callable[[pd.DataFrame, int], list[str]]  # (sections: section_id, organ; n_folds) → unit names
    splits: Callable[..., list[Split]]  # (cells, seeds, **options) → one Split per (unit, seed)
    options: tuple[str, ...]


#: The one table of the protocols: name → units, splits, options (names as in vocabulary.PROTOCOLS).
PROTOCOL_DEFINITIONS: dict[str, ProtocolDefinition] = {
    "is": ProtocolDefinition(_section_units, intra_section_splits,
                             ("roi_fraction", "buffer_um", "val_fraction", "patch_groups")),
    "iocd": ProtocolDefinition(_sections_of_shared_organs, intra_organ_splits, ("val_fraction",)),
    "mocv": ProtocolDefinition(_fold_units, multi_organ_splits, ("n_folds", "val_fraction")),
    "looo": ProtocolDefinition(_organ_units, leave_one_organ_out_splits, ("val_fraction",)),
}


def _definition(protocol: str) -> ProtocolDefinition:
    if protocol not in PROTOCOL_DEFINITIONS:
        raise ValueError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    return PROTOCOL_DEFINITIONS[protocol]


def protocol_units(sections: pd.DataFrame, protocol: str, n_folds: int = 5) -> list[str]:
    """Evaluation units of a protocol for a section list (columns section_id, organ)."""
    return _definition(protocol).units(sections[["section_id", "organ"]].drop_duplicates(), n_folds)


def make_splits(cells: pd.DataFrame, protocol: str, seeds: int, *, n_folds: int = 5, roi_fraction: float = 0.5,
                buffer_um: float = 25.0, val_fraction: float = 0.2,
                patch_groups: tuple[np.ndarray, ...] = ()) -> list[Split]:
    """One protocol's splits (the table's index must be 0..n-1); each protocol takes the options its
    definition names (``patch_groups``, ``roi_fraction`` and ``buffer_um``: IS only)."""
    if not cells.index.equals(pd.RangeIndex(len(cells))):
        raise ValueError("the cell table must have a 0..n-1 RangeIndex (row positions are returned)")
    definition = _definition(protocol)
    options = {"n_folds": n_folds, "roi_fraction": roi_fraction, "buffer_um": buffer_um,
               "val_fraction": val_fraction, "patch_groups": patch_groups}
    return definition.splits(cells, seeds, **{name: options[name] for name in definition.options})


def gate_classes(train_labels: np.ndarray, test_labels: np.ndarray, min_train: int, min_test: int) -> list[str]:
    """Classes scored in a unit: at least ``min_train`` training and ``min_test`` test cells."""
    train_counts = pd.Series(train_labels).value_counts()
    test_counts = pd.Series(test_labels).value_counts()
    return sorted(c for c in train_counts.index
                  if train_counts[c] >= min_train and test_counts.get(c, 0) >= min_test)
