"""The ingest stage registers a section that has no alignment file (simulated in any pose, the true
matrix kept aside) and records a proposal for one that asks for it, placing that one with its own file."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cellpath.errors import InputError
from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM
from cellpath.io.layout import SIMULATION_TRUTH_NAME
from cellpath.io.sections import read_section_obs
from cellpath.stages.fetch import run as run_fetch
from cellpath.stages.ingest import run as run_ingest
from helpers.project import tiny_params

SECTIONS = [
    {"section_id": "breast_free", "organ": "Breast", "status": "Breast cancer", "he_pose": "any",
     "alignment_file": False},
    {"section_id": "tonsil_prop", "organ": "Lymphoid", "status": "Lymphoid hyperplasia", "registration": "propose"},
]


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> dict:
    data = tmp_path_factory.mktemp("registered") / "data"
    params = tiny_params(cells=1000, sections=SECTIONS)
    run_fetch(params, data)
    return {"data": data, "params": params, "index": run_ingest(params, data).set_index("section_id")}


def test_a_section_without_an_alignment_file_is_placed_by_its_registration(registered):
    data, index = registered["data"], registered["index"]
    raw = data / "raw" / "breast_free"
    assert not list(raw.glob("*he_imagealignment.csv"))
    simulation = json.loads((raw / "simulation.json").read_text())
    assert simulation["he_pose"]["kind"] == "any"
    truth = np.asarray(simulation["true_alignment_he_px_to_morphology_px"])
    assert index.loc["breast_free", "alignment_source"] == "registered (no alignment file)"
    # every nucleus placed on the H&E where the true alignment puts it
    obs = read_section_obs(data, "breast_free")
    placed = obs[["he_x_px", "he_y_px"]].to_numpy()
    true_he = np.linalg.solve(truth[:2, :2], (obs[["nucleus_x_um", "nucleus_y_um"]].to_numpy()
                                              / XENIUM_PIXEL_SIZE_UM - truth[:2, 2]).T).T
    errors = np.hypot(*(placed - true_he).T) * simulation["he_mpp"]
    assert np.median(errors) <= 1.0 and errors.max() <= 3.0, (np.median(errors), errors.max())
    record = json.loads((data / "sections" / "breast_free.registration.json").read_text())
    assert record["used"] == "registered (no alignment file)" and record["converged"]
    assert record["registered"]["verdict"] == "passes QC"
    assert len(pd.read_parquet(raw / SIMULATION_TRUTH_NAME)) == len(obs)


def test_a_proposal_is_recorded_and_the_given_alignment_used(registered):
    data, index = registered["data"], registered["index"]
    assert index.loc["tonsil_prop", "alignment_source"] == "given (a registration proposed)"
    assert {"registered_median_um", "given_median_um"} <= set(index.columns)
    record = json.loads((data / "sections" / "tonsil_prop.registration.json").read_text())
    assert record["given"]["verdict"] == record["registered"]["verdict"] == "passes QC"
    given = np.loadtxt(next((data / "raw" / "tonsil_prop").glob("*he_imagealignment.csv")), delimiter=",")
    proposed = np.asarray(record["alignment_he_px_to_morphology_px"])
    obs = read_section_obs(data, "tonsil_prop")
    he = np.column_stack([obs["he_x_px"], obs["he_y_px"], np.ones(len(obs))])  # placed with the given file
    apart_um = np.hypot(*(((he @ proposed.T) - (he @ given.T))[:, :2] * XENIUM_PIXEL_SIZE_UM).T)
    assert np.median(apart_um) <= 1.0 and apart_um.max() <= 3.0  # the proposal agrees with the (good) given one


def test_an_unknown_registration_mode_names_the_file(registered, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(registered["data"] / "raw", data / "raw")
    meta = data / "raw" / "tonsil_prop" / "section.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"registration": "maybe"}))
    with pytest.raises(InputError, match="section.json.*registration must be one of given, propose, accept"):
        run_ingest(registered["params"], data)
