"""Registration from the nuclei against known truth: any pose, a wrong mpp, what real data has
(missed and false nuclei, a fold, a section larger than the H&E), the 10x matrix it writes, and what
it refuses."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM, parse_alignment_csv, write_alignment_csv
from cellpath.registration.pose import apply, rigid_matrix
from cellpath.registration.solve import RegistrationError, register_nuclei
from cellpath.simulation.programs import program_for
from cellpath.simulation.tissue import layout_cells

MPP = 0.2737  # µm per H&E px


@pytest.fixture(scope="module")
def tissue() -> np.ndarray:
    """Xenium nucleus centroids (µm) of a simulated breast section of 6,000 cells."""
    layout, _ = layout_cells(program_for("Breast", "Breast cancer"), 6000, np.random.default_rng(3))
    return layout.xy_um


def _he_nuclei(xenium_um: np.ndarray, truth: np.ndarray, rng: np.random.Generator, *, missing: float = 0.2,
               false: float = 0.05, fold: bool = True) -> np.ndarray:
    """The H&E's detected nuclei (µm on the H&E) of Xenium nuclei under ``truth`` (Xenium µm → H&E µm):
    1 µm detection noise, ``missing`` of them missed, ``false`` extra detections, and a fold (every
    nucleus within a tenth of the tissue's extent of one nucleus displaced by 30 µm)."""
    he = apply(truth, xenium_um) + rng.normal(0.0, 1.0, xenium_um.shape)
    he = he[rng.random(len(he)) >= missing]
    if fold:
        centre = he[rng.integers(len(he))]
        he[np.hypot(*(he - centre).T) < 0.1 * np.ptp(he, axis=0).max()] += np.array([24.0, -18.0])
    low, high = he.min(axis=0), he.max(axis=0)
    return np.vstack([he, rng.uniform(low, high, (int(false * len(he)), 2))])


def _errors(result, truth: np.ndarray, xenium_um: np.ndarray) -> np.ndarray:
    """Distances (µm) at every Xenium nucleus between where the recovered matrix puts its H&E position
    and where it is."""
    return np.hypot(*(apply(result.he_um_to_xenium_um, apply(truth, xenium_um)) - xenium_um).T)


@pytest.mark.parametrize(("angle", "flipped", "shift_mm"), [
    (0.0, False, (0.0, 0.0)), (137.0, False, (2.0, -1.5)), (253.4, True, (-3.0, 1.0)), (359.6, True, (0.4, 4.0))])
def test_any_pose_is_recovered_to_a_micrometre(tissue, angle, flipped, shift_mm):
    rng = np.random.default_rng(int(angle))
    centre = tissue.mean(axis=0)
    truth = rigid_matrix(angle, flipped, centre, centre + 1000.0 * np.array(shift_mm))
    xenium = tissue[rng.random(len(tissue)) >= 0.2]  # 20 % of the Xenium nuclei missing too
    he_um = _he_nuclei(tissue, truth, rng)
    result = register_nuclei(he_um / MPP, MPP, xenium)
    errors = _errors(result, truth, tissue)
    assert np.median(errors) <= 0.5 and errors.max() <= 3.0, (np.median(errors), errors.max(), result.record)
    assert result.record["converged"] and result.record["coarse"]["flipped"] == flipped
    _assert_a_fixed_point(result.he_um_to_xenium_um, he_um, xenium)


def _assert_a_fixed_point(matrix: np.ndarray, moving: np.ndarray, fixed: np.ndarray) -> None:
    """``converged`` checked without the code that sets it: nuclei paired by scipy's KD-tree (mutual
    nearest, within 3 µm) under the returned affine and refitted by numpy's least squares give that
    affine back, to 0.1 µm at the corners of the tissue."""
    from scipy.spatial import cKDTree

    placed = apply(matrix, moving)
    to_fixed, nearest = cKDTree(fixed).query(placed)
    back = cKDTree(placed).query(fixed)[1]
    keep = (back[nearest] == np.arange(len(placed))) & (to_fixed <= 3.0)
    design = np.column_stack([moving[keep], np.ones(keep.sum())])
    refit = np.linalg.lstsq(design, fixed[nearest[keep]], rcond=None)[0].T
    low, high = moving.min(axis=0), moving.max(axis=0)
    corners = np.array([[x, y] for x in (low[0], high[0]) for y in (low[1], high[1])])
    moved = np.hypot(*(corners @ refit[:, :2].T + refit[:, 2] - apply(matrix, corners)).T)
    assert moved.max() <= 0.1, moved


def test_a_wrong_mpp_is_found_by_the_scale_search(tissue):
    """The slide's mpp 8 % off: no pose agrees at its scale, the scale search finds it."""
    rng = np.random.default_rng(8)
    centre = tissue.mean(axis=0)
    truth = rigid_matrix(61.0, False, centre, centre + 700.0)
    truth[:2, :2] *= 1.08
    result = register_nuclei(_he_nuclei(tissue, truth, rng) / MPP, MPP, tissue)
    errors = _errors(result, truth, tissue)
    assert np.median(errors) <= 0.5 and errors.max() <= 3.0
    assert result.record["coarse"]["scale"] != 1.0


def test_an_h_and_e_of_part_of_a_larger_section(tissue):
    """The H&E shows a third of the Xenium section: every nucleus it shows is placed right."""
    rng = np.random.default_rng(5)
    centre = tissue.mean(axis=0)
    truth = rigid_matrix(200.0, True, centre, centre)
    he = _he_nuclei(tissue, truth, rng, fold=False)
    he_centre = apply(truth, centre[None])[0]
    shown = (np.abs(he - he_centre) < np.ptp(he, axis=0) / 3.4).all(axis=1)
    result = register_nuclei(he[shown] / MPP, MPP, tissue)
    inside = (np.abs(apply(truth, tissue) - he_centre) < np.ptp(he, axis=0) / 3.4).all(axis=1)
    errors = _errors(result, truth, tissue[inside])
    assert np.median(errors) <= 0.5 and errors.max() <= 3.0


def test_the_alignment_is_10x_s_matrix_and_reads_back(tissue, tmp_path):
    """The written CSV maps H&E px to morphology px; the project's reader and spatialdata-io's read it
    back to the same matrix."""
    rng = np.random.default_rng(11)
    centre = tissue.mean(axis=0)
    truth = rigid_matrix(33.0, False, centre, centre - 500.0)
    he_um = _he_nuclei(tissue, truth, rng, missing=0.0, false=0.0, fold=False)
    result = register_nuclei(he_um / MPP, MPP, tissue)
    he_px = apply(truth, tissue[:5]) / MPP
    morphology_px = apply(result.alignment, he_px)
    np.testing.assert_allclose(morphology_px * XENIUM_PIXEL_SIZE_UM, tissue[:5], atol=0.5)
    path = tmp_path / "he_imagealignment.csv"
    write_alignment_csv(path, result.alignment)
    np.testing.assert_array_equal(parse_alignment_csv(path), result.alignment)
    # spatialdata-io reads it with pandas' default float parser, which may round the last bit
    np.testing.assert_allclose(pd.read_csv(path, header=None).values, result.alignment, rtol=1e-15, atol=1e-12)


def test_bad_inputs_are_refused_with_the_reason(tissue):
    for mpp in (None, 0.0, float("nan")):
        with pytest.raises(RegistrationError, match="µm per pixel"):
            register_nuclei(tissue / MPP, mpp, tissue)
    with pytest.raises(RegistrationError, match="no nuclei were detected"):
        register_nuclei(tissue[:10] / MPP, MPP, tissue)
    other, _ = layout_cells(program_for("Colon", "Normal"), 4000, np.random.default_rng(99))
    with pytest.raises(RegistrationError, match="no pose lines the nuclei up|too few matched nuclei"):
        register_nuclei(other.xy_um / MPP, MPP, tissue)


def test_a_symmetric_tissue_is_refused_as_ambiguous(tissue):
    """A section that is its own half-turn: two poses match every nucleus equally."""
    centre = tissue.mean(axis=0)
    half = tissue[tissue[:, 0] < centre[0]]
    symmetric = np.vstack([half, apply(rigid_matrix(180.0, False, centre, centre), half)])
    truth = rigid_matrix(40.0, False, centre, centre + 300.0)
    with pytest.raises(RegistrationError, match="ambiguous"):
        register_nuclei(apply(truth, symmetric) / MPP, MPP, symmetric)
