"""The synthetic feature store the scale benchmarks run on: what the probe stage reads, at any size."""

from __future__ import annotations

import numpy as np
import yaml

from cellpath.config import parse_params
from cellpath.features.panel import PanelFeatures, load_panel_cells
from cellpath.simulation.feature_store import write_feature_panel
from helpers.project import PROJECT_ROOT


def test_a_section_does_not_depend_on_how_many_are_written(tmp_path):
    small = write_feature_panel(tmp_path / "a", n_sections=2, cells_per_section=50, width=8, encoder="filterbank-dense")
    large = write_feature_panel(tmp_path / "b", n_sections=3, cells_per_section=50, width=8, encoder="filterbank-dense")
    assert (small.panel, large.panel, large.n_cells) == ("S2", "S3", 150)
    one = np.load(tmp_path / "a" / "features" / "filterbank-dense" / "20x" / "synthetic_001" / "Nuc.npy")
    same = np.load(tmp_path / "b" / "features" / "filterbank-dense" / "20x" / "synthetic_001" / "Nuc.npy")
    assert one.dtype == np.float16 and one.shape == (50, 8)
    np.testing.assert_array_equal(one, same)


def test_the_probe_stage_runs_on_it_and_finds_the_classes(tmp_path):
    from cellpath.stages.probe import run as run_probe

    data_dir = tmp_path / "data"
    synthetic = write_feature_panel(data_dir, n_sections=4, cells_per_section=400, width=32,
                                    encoder="filterbank-dense", separation=1.0)
    panel = load_panel_cells(data_dir, synthetic.panel)
    assert len(panel.cells) == 1600 and panel.cells["fine"].notna().all()
    assert PanelFeatures(data_dir / "features", "filterbank-dense", "20x", panel).readout("Nuc").width == 32
    raw = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    raw.update({"panel": synthetic.panel, "protocol": "looo"})
    raw["concordance"]["panel_sizes"] = [4]
    raw["extract"].update({"encoders": ["filterbank-dense"], "magnifications": ["20x"],
                           "registry": str(PROJECT_ROOT / "models" / "encoders.yaml")})
    raw["probe"].update({"readouts": ["Nuc"], "taxonomies": ["fine"], "magnifications": ["20x"],
                         "min_train_cells": {"fine": 5, "coarse": 5}, "min_test_cells": {"fine": 5, "coarse": 5}})
    raw["mlflow"] = {"enabled": False}
    runs = run_probe(parse_params(raw), data_dir, tmp_path / "reports", root=tmp_path)
    fitted = runs[runs["status"] == "ok"]
    assert len(fitted) == 4 * raw["probe"]["seeds"]["looo"]  # one run per held-out organ and seed
    assert fitted["converged"].all() and (fitted["macro_f1"] > 0.5).all()  # class centres 1 SD apart in 32 dims
