"""Reference coverage: golden values for the similarity, and the simulator with a type held out of
the reference (the only place where "the reference lacks this type" is known for certain)."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
from scipy.stats import pearsonr

from cellpath.annotation.coverage import (best_correlation, coverage, neighbourhood_similarity, scored_cells,
                                          section_pca, type_centroids)
from cellpath.annotation.ontology import map_reference_labels
from cellpath.stages.annotate import run as run_annotate
from helpers.files import rewrite_reference


def test_best_correlation_is_the_highest_pearson_r_against_scipy():
    rng = np.random.default_rng(0)
    profiles, centroids = rng.normal(size=(7, 12)), rng.normal(size=(3, 12))
    expected = [max(pearsonr(p, c).statistic for c in centroids) for p in profiles]
    np.testing.assert_allclose(best_correlation(profiles, centroids), expected, atol=1e-12)


def test_best_correlation_ignores_scale_and_offset_and_scores_a_flat_profile_zero():
    centroids = np.array([[1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 1.0, 1.0]])
    profiles = np.array([[10.0, 20.0, 30.0, 40.0], [0.5, 0.5, 0.5, 0.5], [-2.0, -4.0, -6.0, -8.0]])
    # Row 3 is −2× centroid 1 (r = −1). Against centroid 2, centred: (3, 1, −1, −3)·(2.25, −0.75, −0.75, −0.75)
    # = 9 over norms √20·√6.75, so r = 9/√135 = √0.6 — the best of the two.
    np.testing.assert_allclose(best_correlation(profiles, centroids), [1.0, 0.0, np.sqrt(0.6)], atol=1e-12)


def test_type_centroids_are_class_means_in_class_order():
    profiles = np.array([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0]])
    labels = np.array(["b", "b", "a"])
    np.testing.assert_array_equal(type_centroids(profiles, labels, np.array(["a", "b"])), [[10, 10], [2, 1]])


def test_one_neighbour_is_no_smoothing_and_fifteen_average_the_nearest():
    rng = np.random.default_rng(1)
    centroids = rng.normal(size=(2, 40))
    query = np.repeat(centroids, 50, axis=0) + rng.normal(scale=3.0, size=(100, 40))
    everyone = np.arange(100)
    np.testing.assert_allclose(neighbourhood_similarity(query, centroids, everyone, n_neighbours=1),
                               best_correlation(query, centroids), atol=1e-6)
    alone = best_correlation(query, centroids)
    smoothed = neighbourhood_similarity(query, centroids, everyone, n_neighbours=15)
    assert np.median(smoothed) > np.median(alone) + 0.2  # averaging same-type neighbours removes the noise


@pytest.mark.parametrize("block_rows", [7, 1_000, 5_000])
def test_section_pca_in_blocks_is_scikit_learns_covariance_eigh(block_rows):
    """Coordinates equal scikit-learn's PCA on the whole float64 matrix (signs included) to 1e-12 of
    their scale, whatever the block size; so the neighbours found in them are the same."""
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(3)
    query = (rng.standard_normal((3_000, 120)) @ rng.standard_normal((120, 120))).astype(np.float32)
    expected = PCA(30, svd_solver="covariance_eigh").fit_transform(query.astype(np.float64))
    got = section_pca(query, 30, block_rows)
    assert got.shape == (3_000, 30) and got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * np.abs(expected).max())


def test_a_type_the_reference_lacks_is_unmatched_and_the_rest_is_not():
    rng = np.random.default_rng(2)
    known = rng.normal(size=(3, 300))  # a Xenium-sized panel
    # A profile exactly uncorrelated with every known type: centred, and orthogonal to the centred known rows.
    basis = np.linalg.qr((known - known.mean(1, keepdims=True)).T)[0]
    novel = rng.normal(size=300)
    novel -= novel.mean()
    novel -= basis @ (basis.T @ novel)
    novel *= np.linalg.norm(known[0] - known[0].mean()) / np.linalg.norm(novel)
    assert np.abs(best_correlation(novel[None], known)).max() < 1e-12
    query = np.vstack([np.repeat(known, 100, axis=0), np.tile(novel, (60, 1))]) + rng.normal(scale=2.5, size=(360, 300))
    similarity = neighbourhood_similarity(query, known, np.arange(360), n_neighbours=15)
    unmatched = similarity < 0.15
    assert unmatched[300:].mean() > 0.95 and unmatched[:300].mean() < 0.02
    result = coverage(similarity, 0.15)
    assert result.n_scored == 360 and result.share_low < result.share_unmatched < result.share_high
    assert result.share_unmatched == pytest.approx(unmatched.mean())


def test_coverage_interval_is_wilson():
    result = coverage(np.r_[np.zeros(20), np.ones(80)], 0.5)
    assert (result.n_scored, result.n_unmatched) == (100, 20)
    # Wilson 95 % interval for 20/100, by the closed form.
    z, p, n = 1.959963984540054, 0.2, 100
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (result.share_low, result.share_high) == pytest.approx((centre - half, centre + half), abs=1e-9)


def test_scored_cells_are_everyone_up_to_the_cap_then_a_seeded_sample():
    np.testing.assert_array_equal(scored_cells(50, 100), np.arange(50))
    sample = scored_cells(1000, 100)
    assert len(sample) == 100 == len(set(sample)) and (np.diff(sample) > 0).all()
    np.testing.assert_array_equal(sample, scored_cells(1000, 100))


# ---------------------------------------------------------------------------------------------
# The stage, on the simulator: the full reference covers every section; a breast reference without
# its fibroblasts (27 % of breast_a's cells) leaves breast_a flagged.


def test_the_simulated_panel_is_covered_by_its_references(tiny_panel):
    summary = tiny_panel["labels"].set_index("section_id")
    assert not summary["poor_reference_coverage"].any(), summary["coverage_unmatched"].to_dict()
    assert (summary["coverage_unmatched"] < 0.06).all()  # 1.3–2.5 % measured
    assert (summary["coverage_cells_scored"] == summary["n_cells"]).all()


def test_a_type_held_out_of_the_reference_flags_the_section(tiny_panel, tmp_path):
    data_dir = tmp_path / "data"
    for sub in ("raw", "references", "sections"):
        shutil.copytree(tiny_panel["data_dir"] / sub, data_dir / sub)

    def without_fibroblasts(adata):
        raw = adata.obs["cell_type"].astype(str)
        mapping = map_reference_labels(sorted(set(raw)), adata.uns["reference"]["label_vocabulary"])
        return adata[raw.map(mapping) != "Fibroblast"].copy()

    rewrite_reference(data_dir / "references" / "breast.h5ad", without_fibroblasts)
    truth = pd.read_parquet(data_dir / "raw" / "breast_a" / "simulation_truth.parquet")
    assert (truth["cell_type"] == "Fibroblast").mean() > 0.2
    summary = run_annotate(tiny_panel["params"], data_dir, tmp_path / "reports").set_index("section_id")
    assert summary.loc["breast_a", "poor_reference_coverage"]
    assert summary.loc["breast_a", "coverage_unmatched"] > 0.2  # 28.8 % measured
    assert not summary.loc["tonsil_a", "poor_reference_coverage"]  # its own reference is untouched
