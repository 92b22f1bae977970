"""The memory-mapped panel features: the rows a caller asks for, as the section files hold them."""

from __future__ import annotations

import numpy as np
import pytest

from cellpath.errors import InputError
from cellpath.features.panel import PanelFeatures, load_panel_cells
from cellpath.features.store import artifact_dir


def _by_hand(features_root, panel, name: str) -> np.ndarray:
    """Every panel row of base readout ``name``: each section's whole file, its kept rows, concatenated."""
    return np.concatenate([np.load(artifact_dir(features_root, "filterbank-dense", "10x", section) / f"{name}.npy")
                           [rows].astype(np.float32) for section, rows in panel.rows_in_section.items()])


def test_rows_in_any_order_and_fusions_are_the_stored_ones(tiny_features):
    root = tiny_features["data_dir"] / "features"
    panel = load_panel_cells(tiny_features["data_dir"], tiny_features["params"].panel)
    features = PanelFeatures(root, "filterbank-dense", "10x", panel)
    assert features.n_rows == len(panel.cells) and set(features.bases) == {"Nuc", "Mean"}
    nuc, mean = _by_hand(root, panel, "Nuc"), _by_hand(root, panel, "Mean")
    rows = np.random.default_rng(0).permutation(features.n_rows)[:500]  # across every section, unsorted
    np.testing.assert_array_equal(features.base("Nuc", rows), nuc[rows])
    np.testing.assert_array_equal(features.readout("Mean").take(rows), mean[rows])
    np.testing.assert_array_equal(features.readout("N||M").take(rows), np.concatenate([nuc, mean], axis=1)[rows])
    np.testing.assert_allclose(features.readout("N+M").take(rows), (nuc + mean)[rows], rtol=1e-6)
    assert features.readout("N||M").width == 2 * nuc.shape[1]


def test_the_files_stay_on_disk(tiny_features):
    panel = load_panel_cells(tiny_features["data_dir"], tiny_features["params"].panel)
    features = PanelFeatures(tiny_features["data_dir"] / "features", "filterbank-dense", "10x", panel)
    assert all(isinstance(matrix, np.memmap) for files in features._files for matrix in files.values())


def test_a_non_finite_row_is_refused_when_read_naming_the_file(tiny_features, tmp_path):
    import shutil

    data_dir = tmp_path / "data"
    shutil.copytree(tiny_features["data_dir"], data_dir)
    panel = load_panel_cells(data_dir, tiny_features["params"].panel)
    section, kept = next(iter(panel.rows_in_section.items()))
    path = artifact_dir(data_dir / "features", "filterbank-dense", "10x", section) / "Nuc.npy"
    matrix = np.load(path)
    matrix[kept[3], 0] = np.nan
    np.save(path, matrix)
    features = PanelFeatures(data_dir / "features", "filterbank-dense", "10x", panel)
    with pytest.raises(InputError, match=r"1 cells have NaN or infinite Nuc features") as caught:
        features.base("Nuc", np.arange(10))
    assert str(path) in str(caught.value)
    features.base("Mean", np.arange(10))  # the other readout is intact


def test_a_readout_reads_only_its_bases_and_a_missing_one_is_named(tiny_features, monkeypatch):
    panel = load_panel_cells(tiny_features["data_dir"], tiny_features["params"].panel)
    features = PanelFeatures(tiny_features["data_dir"] / "features", "filterbank-dense", "10x", panel)
    read = []
    original = features.base
    monkeypatch.setattr(features, "base", lambda name, rows: read.append(name) or original(name, rows))
    features.readout("Mean").take(np.arange(5))
    assert read == ["Mean"]
    with pytest.raises(ValueError, match="readout N\\+C needs Cls, which encoder filterbank-dense, 10x lacks"):
        features.readout("N+C").take(np.arange(5))
