"""Protocols: leakage-free splits for every protocol, the MOCV manifest, gates, and Table 3's run count."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cellpath.probing.plan import count_runs
from cellpath.probing.protocols import gate_classes, make_splits, mocv_manifest, protocol_units
from cellpath.vocabulary import PROTOCOLS
from helpers.project import PROJECT_ROOT

MANIFEST = PROJECT_ROOT / "data" / "manifests" / "xenium_datasets.csv"  # transcribed from the paper


def _cells(n_per_section: int = 120, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    layout = {"Breast": 3, "Colon": 2, "Lung": 2, "Liver": 2, "Skin": 2, "Lymphoid": 1}
    frames = []
    for organ, n in layout.items():
        for i in range(n):
            frames.append(pd.DataFrame({
                "section_id": f"{organ.lower()}_{i}", "organ": organ,
                "x_um": rng.uniform(0, 600, n_per_section), "y_um": rng.uniform(0, 600, n_per_section),
            }))
    return pd.concat(frames, ignore_index=True)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_no_test_cell_reaches_fitting(protocol):
    cells = _cells()
    splits = make_splits(cells, protocol, seeds=3)
    assert splits
    for split in splits:
        train, val, test = set(split.train), set(split.val), set(split.test)
        assert not (train & test) and not (val & test) and not (train & val)
        assert test and train and val
        test_rows, fit_rows = cells.loc[split.test], cells.loc[list(train | val)]
        if protocol == "is":
            assert test_rows["section_id"].nunique() == fit_rows["section_id"].nunique() == 1
        elif protocol == "iocd":
            assert test_rows["section_id"].nunique() == 1
            assert not set(test_rows["section_id"]) & set(fit_rows["section_id"])
            assert set(fit_rows["organ"]) == set(test_rows["organ"])
        elif protocol == "mocv":
            assert not set(test_rows["section_id"]) & set(fit_rows["section_id"])
        else:
            assert not set(test_rows["organ"]) & set(fit_rows["organ"])


def test_is_roi_is_spatial_with_a_buffer_and_seeds_move_it():
    cells = _cells(n_per_section=400)
    splits = [s for s in make_splits(cells, "is", seeds=4, buffer_um=25.0) if s.unit == "breast_0"]
    rois = []
    for split in splits:
        axis = ("x_um", "y_um")[split.seed % 2]
        fit = cells.loc[np.concatenate([split.train, split.val]), axis]
        test = cells.loc[split.test, axis]
        low, high = fit.min(), fit.max()
        assert ((test < low - 25.0) | (test > high + 25.0)).all()
        assert 0.4 < len(fit) / 400 < 0.6
        rois.append((axis, round(low, 1)))
    assert len(set(rois)) == 4


def _tiles(cells: pd.DataFrame, side_um: float) -> np.ndarray:
    """A patch id per cell: the section and its square of a ``side_um`` grid."""
    col, row = (np.floor(cells[a].to_numpy() / side_um).astype(int) for a in ("x_um", "y_um"))
    return (cells["section_id"] + ":" + pd.Series(col).astype(str) + ":" + pd.Series(row).astype(str)).to_numpy()


def test_is_test_cells_share_no_patch_with_the_roi_under_any_grid():
    """Two grids (a 112 µm and a 224 µm patch, as 224 px at 20× and 10×): with the 25 µm buffer alone
    many test cells sit in a patch that also holds ROI cells; with the grids, none does, and the
    split counts what each rule removed."""
    cells = _cells(n_per_section=400)
    grids = (_tiles(cells, 112.0), _tiles(cells, 224.0))
    plain = make_splits(cells, "is", seeds=2, buffer_um=25.0)
    strict = make_splits(cells, "is", seeds=2, buffer_um=25.0, patch_groups=grids)
    leaked = 0
    for before, after in zip(plain, strict):
        fit = np.concatenate([after.train, after.val])
        assert np.array_equal(np.sort(np.concatenate([before.train, before.val])), np.sort(fit))  # same ROI
        for groups in grids:
            assert not set(groups[after.test]) & set(groups[fit])
            leaked += len(set(groups[before.test]) & set(groups[fit]))
        assert set(after.test) <= set(before.test)
        excluded = dict(after.excluded)
        assert excluded["shared_patch"] == len(before.test) - len(after.test)
        section = (cells["section_id"] == after.unit).sum()
        assert excluded["buffer"] == section - len(fit) - len(before.test)
    assert leaked > 0  # the buffer alone leaks
    assert all(dict(s.excluded)["shared_patch"] == 0 for s in make_splits(cells, "is", seeds=1, buffer_um=25.0))


def test_mocv_manifest_is_organ_aware_and_fixed():
    cells = _cells()
    manifest = mocv_manifest(cells, 5)
    assert manifest == mocv_manifest(cells.sample(frac=1.0, random_state=3), 5)
    assert sorted(set(manifest.values())) == [0, 1, 2, 3, 4]
    by_organ = pd.Series(manifest).groupby(lambda s: s.rsplit("_", 1)[0]).agg(lambda f: f.nunique() == len(f))
    assert by_organ.all()  # no two sections of one organ share a fold


def test_units_and_splits_agree():
    cells = _cells()
    sections = cells[["section_id", "organ"]].drop_duplicates()
    for protocol in PROTOCOLS:
        units = protocol_units(sections, protocol)
        seen = sorted({s.unit for s in make_splits(cells, protocol, seeds=2)})
        assert seen == sorted(units)
    assert protocol_units(sections, "iocd") == sorted(s for s in sections["section_id"] if not s.startswith("lymphoid"))


def test_unknown_protocol_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: is, iocd, mocv, looo"):
        make_splits(_cells(), "kfold", seeds=1)


def test_class_gates():
    train = np.array(["a"] * 5 + ["b"] * 3 + ["c"] * 9)
    test = np.array(["a"] * 2 + ["b"] * 9 + ["c"] * 1)
    assert gate_classes(train, test, min_train=3, min_test=2) == ["a", "b"]
    assert gate_classes(train, test, min_train=6, min_test=1) == ["c"]


def test_table_3_run_count_for_the_paper_configuration():
    datasets = pd.read_csv(MANIFEST)
    s25 = datasets[datasets["panel_s25"] == 1]
    assert len(s25) == 25 and s25["organ"].nunique() == 11
    has_cls = [True] * 29 + [False]  # CTransPath(CHIEF) is a Swin without a CLS token
    plan = count_runs(s25, models_with_cls=has_cls, n_magnifications=3, n_taxonomies=2,
                      seeds={"is": 5, "iocd": 3, "mocv": 3, "looo": 3})
    assert plan.units == {"is": 25, "iocd": 23, "mocv": 5, "looo": 11}
    assert plan.runs == {"is": 157_500, "iocd": 86_940, "mocv": 18_900, "looo": 41_580}
    assert plan.total == 304_920
    # One CLS-less model: 3 of 7 readouts × 3 mags × 2 taxonomies × (125 + 69 + 15 + 33) unit-seeds.
    assert sum(plan.unavailable.values()) == 3 * 3 * 2 * (125 + 69 + 15 + 33) == 4_356


def test_the_protocol_table_defines_every_protocol_of_the_vocabulary_and_nothing_else():
    from cellpath.probing.protocols import PROTOCOL_DEFINITIONS
    from cellpath.vocabulary import PROTOCOLS

    assert tuple(PROTOCOL_DEFINITIONS) == PROTOCOLS
    with pytest.raises(ValueError, match="unknown protocol 'loo'; valid: is, iocd, mocv, looo"):
        protocol_units(pd.DataFrame({"section_id": ["a"], "organ": ["x"]}), "loo")


@pytest.mark.parametrize("protocol", ["iocd", "mocv", "looo"])
def test_split_sizes_from_counts_equal_the_splits_of_the_cells(protocol):
    """Without cells, the plan sizes each unit from the section counts; held-out protocols must
    match the real splits exactly (every cell kept: no gates)."""
    from cellpath.probing.plan import split_sizes

    cells = _cells(n_per_section=97)
    sections = cells.groupby(["section_id", "organ"]).size().rename("cells").reset_index()
    splits = make_splits(cells, protocol, seeds=1, n_folds=5, val_fraction=0.2)
    actual = sorted((s.unit, len(s.train), len(s.val), len(s.test)) for s in splits)
    sized = sorted((s.unit, s.n_train, s.n_val, s.n_test) for s in split_sizes(sections, protocol, n_folds=5,
                                                                               val_fraction=0.2))
    assert sized == actual


def test_is_split_sizes_bound_the_real_splits():
    from cellpath.probing.plan import split_sizes

    cells = _cells(n_per_section=200)
    sections = cells.groupby(["section_id", "organ"]).size().rename("cells").reset_index()
    splits = make_splits(cells, "is", seeds=1, roi_fraction=0.5, buffer_um=25.0, val_fraction=0.2)
    sized = {s.unit: s for s in split_sizes(sections, "is", roi_fraction=0.5, val_fraction=0.2)}
    for split in splits:
        bound = sized[split.unit]
        assert abs(len(split.train) + len(split.val) - bound.n_train - bound.n_val) <= 1  # the ROI: half, ± a quantile
        assert len(split.test) <= bound.n_test  # the buffer removes some of the complement
    assert sum(s.n_train + s.n_val + s.n_test for s in sized.values()) == len(cells)
