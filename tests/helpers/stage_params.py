"""Params and inputs of the stage tests: the tiny panel's params narrowed to one encoder and magnification."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd

from cellpath.config import parse_params

SECTION = "breast_a"


def probe_params(base, tmp_path, **top):
    data = base.model_dump(mode="json")
    data["extract"].update(encoders=["filterbank-dense"], magnifications=["10x"])
    data["probe"] = {"seeds": {"is": 2, "iocd": 1, "mocv": 1, "looo": 1}, "mocv_folds": 3,
                     "min_train_cells": {"fine": 10, "coarse": 10}, "min_test_cells": {"fine": 5, "coarse": 5},
                     "readouts": ["Nuc", "Mean", "Cls", "N||M"], "max_iter": 30}
    data["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_location": str(tmp_path / "art"),
                      "experiment": "test"}
    data.update(top)
    return parse_params(data)


def robustness_params(base, tmp_path, **robustness):
    data = base.model_dump(mode="json")
    data["extract"].update(encoders=["filterbank-dense"], magnifications=["10x"])
    # Tiles of 40 µm as groups: at 10× the tiny sections hold only 3-4 encoder patches each, too few
    # for the shortcut probe's in-domain test groups.
    data["robustness"] = {"taxonomies": ["coarse"], "readouts": ["Nuc", "Mean"], "scopes": ["panel", "organ"],
                          "group": "tile", "tile_um": 40.0,
                          "shortcut": {"confounder": "section_id", "pool_size": 90, "n_runs": 2, "taxonomy": "coarse",
                                       # aligned with Epithelial/Tumor, Immune/Inflammatory, Stromal/Structural
                                       "train_levels": ["breast_a", "tonsil_a", "breast_b"]},
                          "sensitivity": {"alphas": [0.05, 0.1, 0.2], "m_max": 6}} | robustness
    data["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_location": str(tmp_path / "art"),
                      "experiment": "rob"}
    return parse_params(data)


def extract_inputs(panel: dict, data_dir: Path, section: str = SECTION) -> Path:
    """What the extract stage reads for one section: its H&E, its zarr, one-row sections.csv and
    labels/summary.csv. Returns ``data_dir``."""
    source = panel["data_dir"]
    index = pd.read_csv(source / "sections" / "sections.csv")
    row = index[index["section_id"] == section]
    raw = data_dir / "raw" / row["raw_folder"].iloc[0]
    raw.mkdir(parents=True)
    shutil.copy2(source / "raw" / row["raw_folder"].iloc[0] / row["he_image"].iloc[0], raw)
    shutil.copytree(source / "sections" / f"{section}.zarr", data_dir / "sections" / f"{section}.zarr")
    row.to_csv(data_dir / "sections" / "sections.csv", index=False)
    (data_dir / "labels").mkdir()
    summary = pd.read_csv(source / "labels" / "summary.csv")
    summary[summary["section_id"] == section].to_csv(data_dir / "labels" / "summary.csv", index=False)
    return data_dir
