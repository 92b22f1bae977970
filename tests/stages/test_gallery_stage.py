"""The gallery stage on the tiny simulated panel: the lowest-margin cells of margins.parquet and the most
confident IS errors, as crops on a static page per model."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from cellpath.errors import InputError
from cellpath.stages.gallery import run as run_gallery
from cellpath.stages.robustness import run as run_robustness
from helpers.stage_params import robustness_params


@pytest.fixture(scope="module")
def gallery(tiny_features, tmp_path_factory):
    from cellpath.config import parse_params
    from cellpath.features.panel import load_panel_cells

    tmp = tmp_path_factory.mktemp("gallery")
    reports = tmp / "reports"
    params = robustness_params(tiny_features["params"], tmp, scopes=["panel"], shortcut={"enabled": False},
                               sensitivity={"alphas": [], "m_max": None})
    params = parse_params(params.model_dump(mode="json") | {"gallery": {"cells": 5, "crop_um": 30.0}})
    run_robustness(params, tiny_features["data_dir"], reports, root=tmp)
    cells = load_panel_cells(tiny_features["data_dir"], params.panel).cells
    rng = np.random.default_rng(1)
    chosen = cells.iloc[rng.choice(len(cells), 8, replace=False)]
    errors = pd.DataFrame({"model": "filterbank-dense", "magnification": "10x", "readout": "Nuc", "taxonomy": "coarse",
                           "protocol": "is", "unit": chosen["section_id"].to_numpy(), "seed": 0,
                           "section_id": chosen["section_id"].to_numpy(), "cell_id": chosen["cell_id"].to_numpy(),
                           "true_class": chosen["coarse"].to_numpy(), "predicted_class": "Stromal/Structural",
                           "confidence": np.linspace(0.99, 0.6, len(chosen))})
    (reports / "probe").mkdir(parents=True)
    errors.to_parquet(reports / "probe" / "is_errors.parquet", index=False)
    index = run_gallery(params, tiny_features["data_dir"], reports)
    return {"reports": reports, "index": index, "errors": errors, "params": params, "data_dir": tiny_features["data_dir"]}


def test_the_margin_lists_are_the_lowest_margins_of_margins_parquet(gallery):
    margins = pd.read_parquet(gallery["reports"] / "robustness" / "margins.parquet")
    shown = pd.read_csv(gallery["reports"] / "gallery" / "cells.csv")
    for readout in ("Nuc", "Mean"):
        part = margins[(margins["readout"] == readout) & (margins["scope"] == "panel")].dropna(subset=["margin"])
        expected = part.nsmallest(5, "margin")
        listed = shown[(shown["kind"] == "margins") & (shown["readout"] == readout) & (shown["role"] == "cell")]
        assert listed["cell_id"].tolist() == expected["cell_id"].tolist()
        assert listed["rank"].tolist() == [1, 2, 3, 4, 5]
        # each shown neighbour is the one margins.parquet names for that cell
        for role in ("so", "os"):
            neighbours = shown[(shown["kind"] == "margins") & (shown["readout"] == readout) & (shown["role"] == role)]
            assert neighbours["cell_id"].tolist() == expected[f"{role}_cell_id"].tolist()


def test_the_error_list_is_the_most_confident_errors(gallery):
    shown = pd.read_csv(gallery["reports"] / "gallery" / "cells.csv")
    listed = shown[(shown["kind"] == "errors") & (shown["role"] == "cell")]
    assert listed["cell_id"].tolist() == gallery["errors"]["cell_id"].tolist()[:5]
    assert set(shown[shown["kind"] == "errors"]["readout"]) == {"Nuc"}


def test_the_page_is_static_light_and_links_every_crop(gallery):
    folder = gallery["reports"] / "gallery"
    index = json.loads((folder / "index.json").read_text())
    assert list(index["models"]) == ["filterbank-dense"]
    page = (folder / index["models"]["filterbank-dense"]["page"]).read_text()
    sources = re.findall(r'<img loading="lazy" src="([^"]+)"', page)
    shown = pd.read_csv(folder / "cells.csv")
    assert sorted(sources) == sorted(shown["file"])
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing remote: opens offline
    sizes = [(folder / source).stat().st_size for source in sources]
    assert all((folder / source).is_file() for source in sources) and max(sizes) < 40_000
    assert [item["cells"] for item in index["models"]["filterbank-dense"]["lists"]] == [5, 5, 5]


def test_a_margins_table_without_neighbours_asks_for_the_robustness_stage(gallery, tmp_path):
    reports = tmp_path / "reports"
    (reports / "robustness").mkdir(parents=True)
    (reports / "probe").mkdir()
    margins = pd.read_parquet(gallery["reports"] / "robustness" / "margins.parquet")
    margins.drop(columns=["so_cell_id"]).to_parquet(reports / "robustness" / "margins.parquet")
    gallery["errors"].to_parquet(reports / "probe" / "is_errors.parquet")
    with pytest.raises(InputError, match="so_cell_id.*dvc repro robustness"):
        run_gallery(gallery["params"], gallery["data_dir"], reports)
    assert not (reports / "gallery").exists()  # nothing half-written
