"""The concordance stage on the tiny simulated panel: scores, counts, ranking and panels."""

from __future__ import annotations

import json
import logging

import numpy as np
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
    # Registration QC: jitter 0, 2 and 1–3 µm (tonsil_a, drawn) is within the limits; the columns are written.
    assert metrics["registration_flagged"] == 0 and not on_disk["registration_flagged"].any()
    assert {"reg_median_um", "reg_p90_um", "reg_translation_x_um", "reg_rotation_deg", "reg_scale_x",
            "reg_shear_deg", "reg_residual_rms_um"} <= set(on_disk.columns)
    reported = pd.read_csv(tmp_path / "reports" / "concordance" / "concordance.csv")
    assert reported["registration_flagged"].tolist() == on_disk["registration_flagged"].tolist()


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


def test_registration_qc_flags_the_section_simulated_with_large_jitter(tmp_path, caplog):
    """The simulator displaces each Xenium nucleus on its own (isotropic Gaussian, RMS = the section's
    registration_jitter_um) and applies no global shift: the QC flags the 5 µm section, not the 1 and
    3 µm ones, its distances grow with the simulated jitter and the residual affine stays the identity."""
    from cellpath.io.layout import raw_dir
    from cellpath.stages.annotate import run as run_annotate
    from cellpath.stages.fetch import run as run_fetch
    from cellpath.stages.ingest import run as run_ingest
    from helpers.project import tiny_params

    sections = [{"section_id": f"jitter_{j}", "organ": "Breast", "status": "Breast cancer",
                 "registration_jitter_um": float(j)} for j in (1, 3, 5)]
    params = tiny_params(seed=3, cells=600, sections=sections)
    data, reports = tmp_path / "data", tmp_path / "reports"
    run_fetch(params, data)
    run_ingest(params, data)
    run_annotate(params, data, reports)
    with caplog.at_level(logging.WARNING, logger="cellpath.stages.concordance"):
        panels = run_concordance(params, data, reports).set_index("section_id")
    truth = {s: json.loads((raw_dir(data) / s / "simulation.json").read_text())["registration_jitter_um"]
             for s in panels.index}
    assert truth == {"jitter_1": 1.0, "jitter_3": 3.0, "jitter_5": 5.0}
    assert panels["registration_flagged"].to_dict() == {s: j >= 5.0 for s, j in truth.items()}
    by_jitter = panels.loc[sorted(truth, key=truth.get)]
    assert by_jitter["reg_median_um"].is_monotonic_increasing and by_jitter["reg_p90_um"].is_monotonic_increasing
    assert (np.hypot(panels["reg_translation_x_um"], panels["reg_translation_y_um"]) < 1.0).all()  # no global shift
    # ~400 pairs on a ~170 µm field: the fit's noise is ~0.2 µm in shift, ~0.15° in rotation at 5 µm jitter
    assert (panels["reg_rotation_deg"].abs() < 1.0).all()
    assert ((panels[["reg_scale_x", "reg_scale_y"]] - 1).abs() < 0.02).all().all()
    assert (panels["reg_residual_rms_um"] > 0.9 * panels["reg_rms_um"]).all()  # nothing for an affine to remove
    assert panels["rank"].notna().all()  # informational: the flagged section is still ranked
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "jitter_5: registration flagged" in warnings[0]
