"""Registration QC: the affine fit, its decomposition and the matched-distance summary on constructed
point sets whose true affine and displacement are known."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from cellpath.concordance.registration import (AffineFit, RegistrationQC, decompose_linear, distance_summary,
                                               fit_affine, registration_flagged, registration_qc)


def _linear(rotation_deg: float, scale_x: float, scale_y: float, shear_deg: float) -> np.ndarray:
    """R(θ) · [[sx, k], [0, sy]] with k = sy · tan(shear): the decomposition's own convention."""
    theta = math.radians(rotation_deg)
    rotation = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    return rotation @ np.array([[scale_x, scale_y * math.tan(math.radians(shear_deg))], [0.0, scale_y]])


def _lattice_um(rng: np.random.Generator, side_um: float = 600.0, spacing_um: float = 7.0) -> np.ndarray:
    """Nuclei on a jittered lattice, about ``spacing_um`` apart (as the simulator lays cells out)."""
    grid = np.arange(spacing_um / 2, side_um, spacing_um)
    xy = np.stack(np.meshgrid(grid, grid), axis=-1).reshape(-1, 2)
    return xy + rng.uniform(-1.0, 1.0, xy.shape)


def test_decomposition_inverts_the_construction():
    for params in [(0.0, 1.0, 1.0, 0.0), (2.5, 1.02, 0.97, 1.5), (-30.0, 0.5, 2.0, -10.0)]:
        assert decompose_linear(_linear(*params)) == pytest.approx(params, abs=1e-9)
    with pytest.raises(ValueError, match="2×2"):
        decompose_linear(np.eye(3))


def test_fit_recovers_a_known_affine_under_noise_and_outliers():
    rng = np.random.default_rng(0)
    src = rng.uniform(0, 2000, (3000, 2))  # µm
    linear, shift = _linear(0.8, 1.01, 0.985, 0.4), np.array([6.0, -4.0])
    centre = src.mean(axis=0)
    dst = (src - centre) @ linear.T + centre + shift + rng.normal(0, 0.5, src.shape)
    dst[:60] += rng.uniform(-40, 40, (60, 2))  # 2 % wrong matches
    fit = fit_affine(src, dst)
    assert isinstance(fit, AffineFit)
    assert fit.translation_um == pytest.approx(shift, abs=0.05)
    assert fit.rotation_deg == pytest.approx(0.8, abs=0.01)
    assert (fit.scale_x, fit.scale_y) == pytest.approx((1.01, 0.985), abs=2e-4)
    assert fit.shear_deg == pytest.approx(0.4, abs=0.02)
    assert fit.n_inliers == pytest.approx(2940, abs=15)  # the wrong matches are trimmed
    inlier_rms = np.sqrt(np.mean(np.sum((fit.apply(src[60:]) - dst[60:]) ** 2, axis=1)))
    assert inlier_rms == pytest.approx(0.5 * math.sqrt(2), rel=0.05)  # the noise RMS: σ√2 in 2-D
    assert fit_affine(src[:2], dst[:2]) is None  # fewer than three pairs
    assert fit_affine(np.column_stack([np.arange(5.0), np.arange(5.0)]), np.zeros((5, 2))) is None  # collinear


def test_distance_summary_is_the_rayleigh_of_an_isotropic_displacement():
    rng = np.random.default_rng(1)
    jitter = 3.0  # RMS displacement (µm), σ = jitter / √2 per axis as in the simulator
    src = rng.uniform(0, 1000, (20000, 2))
    median, p90, rms = distance_summary(src, src + rng.normal(0, jitter / math.sqrt(2), src.shape))
    sigma = jitter / math.sqrt(2)
    assert median == pytest.approx(sigma * math.sqrt(2 * math.log(2)), rel=0.02)
    assert p90 == pytest.approx(sigma * math.sqrt(2 * math.log(10)), rel=0.02)
    assert rms == pytest.approx(jitter, rel=0.02)
    assert all(math.isnan(v) for v in distance_summary(np.empty((0, 2)), np.empty((0, 2))))


def test_qc_of_a_globally_shifted_section_finds_the_shift_and_a_small_residual():
    rng = np.random.default_rng(2)
    placed = _lattice_um(rng)
    mpp, shift = 0.25, np.array([3.0, -2.0])  # µm: over a third of the nucleus spacing
    centre = placed.mean(axis=0)
    detected = (placed - centre) @ _linear(-0.3, 1.0, 1.0, 0.0).T + centre - shift
    detected += rng.normal(0, 0.3, detected.shape)
    qc = registration_qc(detected / mpp, placed / mpp, mpp, radius_um=10.0)
    assert qc.reg_pairs > 0.95 * len(placed)
    assert (qc.reg_translation_x_um, qc.reg_translation_y_um) == pytest.approx(tuple(shift), abs=0.05)
    assert qc.reg_rotation_deg == pytest.approx(0.3, abs=0.01)
    assert qc.reg_median_um > 3.0 and qc.reg_residual_rms_um < 0.5  # large distances, fixed by the affine
    assert registration_flagged(qc, max_median_um=2.7, max_p90_um=4.7)


def test_qc_of_per_cell_jitter_keeps_the_affine_near_the_identity():
    rng = np.random.default_rng(3)
    placed = _lattice_um(rng)
    detected = placed + rng.normal(0, 1.0 / math.sqrt(2), placed.shape)  # 1 µm RMS, no global part
    qc = registration_qc(detected, placed, 1.0, radius_um=10.0)
    assert abs(qc.reg_translation_x_um) < 0.05 and abs(qc.reg_translation_y_um) < 0.05
    assert abs(qc.reg_rotation_deg) < 0.01 and qc.reg_scale_x == pytest.approx(1.0, abs=1e-3)
    assert qc.reg_rms_um == pytest.approx(1.0, rel=0.05)
    assert qc.reg_residual_rms_um == pytest.approx(qc.reg_rms_um, rel=0.02)  # nothing global to remove
    assert not registration_flagged(qc, max_median_um=2.7, max_p90_um=4.7)
    columns = qc.as_columns()
    assert list(columns) == [f.name for f in RegistrationQC.__dataclass_fields__.values()]


def test_qc_without_matches_is_nan_and_not_flagged():
    qc = registration_qc(np.empty((0, 2)), np.array([[10.0, 10.0]]), 0.5, radius_um=10.0)
    assert qc.reg_pairs == 0 and math.isnan(qc.reg_median_um) and math.isnan(qc.reg_rotation_deg)
    assert not registration_flagged(qc, 2.7, 4.7)
    with pytest.raises(ValueError, match="mpp"):
        registration_qc(np.zeros((1, 2)), np.zeros((1, 2)), 0.0, radius_um=10.0)


def test_flag_uses_either_limit():
    base = dict(reg_pairs=100, reg_rms_um=1.0, reg_translation_x_um=0.0, reg_translation_y_um=0.0,
                reg_rotation_deg=0.0, reg_scale_x=1.0, reg_scale_y=1.0, reg_shear_deg=0.0, reg_residual_rms_um=1.0)
    assert not registration_flagged(RegistrationQC(reg_median_um=2.0, reg_p90_um=4.0, **base), 2.7, 4.7)
    assert registration_flagged(RegistrationQC(reg_median_um=2.8, reg_p90_um=4.0, **base), 2.7, 4.7)
    assert registration_flagged(RegistrationQC(reg_median_um=2.0, reg_p90_um=5.0, **base), 2.7, 4.7)


def test_the_report_shows_the_registration_columns_and_the_flag():
    from cellpath.report.tables import display, panel_table

    panels = pd.DataFrame({"rank": [1, 2], "section_id": ["a", "b"], "organ": ["Breast"] * 2, "score": [0.7, 0.6],
                           "cells": [100, 100], "n_matched": [80, 60], "reg_median_um": [1.2, 3.0],
                           "reg_p90_um": [2.8, 5.1], "reg_translation_x_um": [0.01, 0.1],
                           "reg_translation_y_um": [0.0, -0.1], "reg_rotation_deg": [0.0, 0.01],
                           "reg_scale_x": [1.0, 1.0], "reg_scale_y": [1.0, 1.0], "reg_shear_deg": [0.0, 0.0],
                           "reg_rms_um": [1.5, 3.3], "reg_residual_rms_um": [1.5, 3.3],
                           "registration_flagged": [False, True], "S1": [True, False]})
    shown = display(panel_table(panels).set_index("section_id"), percent_pairs=False, percent_columns=())
    assert shown.loc["b", "registration_flagged"] == "yes" and shown.loc["a", "registration_flagged"] == ""
    assert shown.loc["b", "reg_p90_um"] == "5.10"
    assert {"reg_median_um", "reg_residual_rms_um", "reg_rotation_deg"} <= set(shown.columns)
    old = panel_table(panels.drop(columns=[c for c in panels.columns if c.startswith("reg")]))
    assert "registration_flagged" not in old.columns  # a panels table from before the QC still shows


def test_the_registration_radius_may_not_truncate_the_match_cap():
    from pydantic import ValidationError

    from cellpath.config import ConcordanceConfig

    assert ConcordanceConfig().registration_radius_um == 10.0
    with pytest.raises(ValidationError, match="registration_radius_um"):
        ConcordanceConfig(max_match_distance_um=6.0, registration_radius_um=5.0)
