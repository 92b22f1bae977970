"""The concordance stage on the tiny simulated panel: scores, counts, ranking and panels."""

from __future__ import annotations

import json

import pandas as pd

from cellpath.stages.concordance import run as run_concordance


def test_concordance_stage_ranks_sections_and_builds_nested_panels(tiny_panel, tmp_path):
    panels = run_concordance(tiny_panel["params"], tiny_panel["data_dir"], tmp_path / "reports")
    on_disk = pd.read_csv(tiny_panel["data_dir"] / "panels.csv")
    assert list(on_disk["section_id"]) == list(panels["section_id"])
    assert sorted(panels["section_id"]) == ["breast_a", "breast_b", "tonsil_a"]
    assert panels["rank"].tolist() == [1, 2, 3]
    assert (panels["score"].diff().dropna() <= 0).all()
    assert (panels["score"] > 0.4).all()  # informative morphology: above the three-class chance of 1/3
    for smaller, larger in (("S1", "S2"), ("S2", "S3")):
        assert (~panels[smaller] | panels[larger]).all()  # nested by construction
    assert panels[["S1", "S2", "S3"]].sum().tolist() == [1, 2, 3]
    counts = panels.set_index("section_id")
    assert (counts["n_matched"] + counts["n_xenium_unmatched"] == counts["n_xenium"]).all()
    assert (counts["n_matched"] + counts["n_detected_unmatched"] == counts["n_detected"]).all()
    metrics = json.loads((tmp_path / "reports" / "concordance" / "metrics.json").read_text())
    assert metrics["sections_ranked"] == 3 and metrics["panel"] == "S3" and metrics["panel_sections"] == 3


def test_simulator_knobs_move_the_ranking(tmp_path):
    """Weak morphology lowers AGR-BAcc (ranked last); registration jitter shows as lost matches."""
    from cellpath.stages.annotate import run as run_annotate
    from cellpath.stages.fetch import run as run_fetch
    from cellpath.stages.ingest import run as run_ingest
    from helpers.project import tiny_params

    sections = [
        {"section_id": "a_sharp", "organ": "Breast", "status": "Breast cancer", "registration_jitter_um": 0.5,
         "morphology_strength": 1.0},
        {"section_id": "b_jitter", "organ": "Breast", "status": "Breast cancer", "registration_jitter_um": 6.0,
         "morphology_strength": 1.0},
        {"section_id": "c_weak", "organ": "Breast", "status": "Breast cancer", "registration_jitter_um": 0.5,
         "morphology_strength": 0.2},
    ]
    params = tiny_params(seed=1, cells=600, sections=sections)
    data, reports = tmp_path / "data", tmp_path / "reports"
    run_fetch(params, data)
    run_ingest(params, data)
    run_annotate(params, data, reports)
    panels = run_concordance(params, data, reports).set_index("section_id")
    assert panels.loc["c_weak", "rank"] == 3
    assert panels.loc["c_weak", "score"] < panels.loc["a_sharp", "score"] - 0.1
    assert panels.loc["b_jitter", "n_matched"] < 0.7 * panels.loc["a_sharp", "n_matched"]
