"""Properties the simulated tissue must have (issue: foundation, fetch stage)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile
from scipy import ndimage, sparse
from scipy.spatial import cKDTree
from skimage.color import rgb2hed
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from cellpath.annotation.ontology import FINE_CLASSES, cell_type, cell_type_by_name, genes_of, map_reference_labels
from cellpath.config import load_params, parse_params
from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM, parse_alignment_csv
from cellpath.simulation.expression import build_panel, type_programs, xenium_counts
from cellpath.simulation.morphology import draw_nuclei
from cellpath.simulation.programs import COMPARTMENTS, PROGRAMS
from cellpath.simulation.render import acquire, draw_acquisition
from cellpath.simulation.tissue import layout_cells
from cellpath.sources.synthetic import fetch_synthetic
from helpers.project import PROJECT_ROOT, tiny_params


def _fine(types) -> np.ndarray:
    return np.array([cell_type(t).fine or "ineligible" for t in types])


@pytest.fixture(scope="module")
def default_layouts() -> dict:
    """Layouts (no rendering) of every section in the project's params.yaml, at full size, three
    draws each, so that the properties below are those of the section's program, not of one draw."""
    params = load_params(PROJECT_ROOT / "params.yaml")
    layouts = {}
    for i, section in enumerate(params.synthetic.sections):
        program = PROGRAMS[(section.organ, section.status)]
        n_cells = section.n_cells or params.synthetic.cells_per_section
        layouts[section.section_id] = (section, [
            layout_cells(program, n_cells, np.random.default_rng([params.seed, i, draw]))[0] for draw in range(3)])
    return layouts


def test_programs_are_complete_and_use_ontology_labels():
    for (organ, status), program in PROGRAMS.items():
        painted = {program.background}
        for s in program.structures:
            painted |= {s.compartment, s.inner} | ({"vessel_media"} if s.kind == "vessel" else set())
        for name in painted:
            if COMPARTMENTS[name][0] > 0:
                assert name in program.mixes, f"{organ}/{status}: compartment {name} has cells but no mix"
        for mix in program.mixes.values():
            for label, weight in mix.items():
                assert label in cell_type_by_name(), f"{organ}/{status}: {label} is not an ontology label"
                assert weight > 0


def test_default_panel_sizes_and_tfine_coverage(default_layouts):
    fine_seen = set()
    requested = load_params(PROJECT_ROOT / "params.yaml").synthetic.cells_per_section
    assert requested >= 1000  # "a few thousand cells per section"
    for section_id, (section, layouts) in default_layouts.items():
        for layout in layouts:
            n = len(layout.xy_um)
            assert 0.9 * requested <= n <= requested, f"{section_id}: {n} cells"
            fine_seen |= set(_fine(layout.cell_type))
            coarse = {cell_type(t).coarse for t in layout.cell_type} - {None}
            assert len(coarse) >= 2, f"{section_id}: only {coarse}"
    assert set(FINE_CLASSES) <= fine_seen
    # Ineligible types exist too, so eligibility filtering has something to do.
    assert "ineligible" in fine_seen


def test_compositions_are_organ_plausible(default_layouts):
    def share(section_id: str, fine_class: str) -> float:
        return float(np.mean([np.mean(_fine(lay.cell_type) == fine_class) for lay in default_layouts[section_id][1]]))

    def type_share(section_id: str, name: str) -> float:
        return float(np.mean([np.mean(lay.cell_type == name) for lay in default_layouts[section_id][1]]))

    assert type_share("liver_normal_1", "Hepatocyte") > 0.4
    assert share("tonsil_1", "Lymphocyte") > 0.5
    assert share("colon_normal_1", "Plasma cell") > 0.05
    assert type_share("colon_normal_1", "Goblet cell") > 0.03
    assert share("breast_cancer_1", "Neoplastic") > 0.15
    assert share("breast_cancer_1", "Fibroblast/Stromal cell") > 0.15
    assert share("liver_normal_1", "Neoplastic") == 0.0
    assert type_share("skin_normal_1", "Keratinocyte") > 0.05
    assert type_share("skin_melanoma_1", "Melanoma cell") > 0.1
    assert share("colon_cancer_1", "Smooth muscle/Muscle") > 0.02


def test_neighbourhood_is_informative_but_not_identical(default_layouts):
    """Ten nearest neighbours agree with a cell's Tfine class beyond chance, but far from always."""
    for section_id, (_, layouts) in default_layouts.items():
        kappas, sames = [], []
        for layout in layouts:
            fine = _fine(layout.cell_type)
            _, idx = cKDTree(layout.xy_um).query(layout.xy_um, k=11)
            same = float((fine[idx[:, 1:]] == fine[:, None]).mean())
            _, counts = np.unique(fine, return_counts=True)
            chance = float(((counts / counts.sum()) ** 2).sum())  # agreement of two random cells
            kappas.append((same - chance) / (1 - chance))
            sames.append(same)
        assert np.mean(kappas) > 0.15, f"{section_id}: chance-corrected neighbour agreement {np.mean(kappas):.2f}"
        assert max(sames) < 0.8, f"{section_id}: neighbours are almost always the same class ({max(sames):.2f})"


def test_nuclear_morphology_differs_by_class():
    rng = np.random.default_rng(0)
    names = ["CD8 T cell", "Plasma cell", "Neutrophil", "Macrophage", "Fibroblast", "Endothelial cell",
             "Smooth muscle cell", "Adenocarcinoma cell"]
    types = np.repeat(np.array(names), 300)
    draws = draw_nuclei(types, strength=1.0, rng=rng)
    area = {n: draws.nucleus_area[types == n].mean() for n in names}
    aspect = {n: (draws.minor / draws.major)[types == n].mean() for n in names}
    dark = {n: draws.darkness[types == n].mean() for n in names}
    assert area["CD8 T cell"] < area["Macrophage"] < area["Adenocarcinoma cell"]
    assert area["CD8 T cell"] < area["Fibroblast"]
    for spindle in ("Fibroblast", "Endothelial cell", "Smooth muscle cell"):
        assert aspect[spindle] < 0.4
    assert aspect["CD8 T cell"] > 0.85
    assert dark["CD8 T cell"] > dark["Macrophage"] + 0.3
    assert (draws.lobes[types == "Neutrophil"] >= 3).all()
    assert (draws.lobes[types == "CD8 T cell"] == 1).all()
    offset = np.linalg.norm(draws.offset, axis=1)
    assert offset[types == "Plasma cell"].mean() > 0.4 * draws.major[types == "Plasma cell"].mean()
    tumour_sd = draws.major[types == "Adenocarcinoma cell"].std()
    assert tumour_sd > 2 * draws.major[types == "CD8 T cell"].std()  # pleomorphism


def test_weak_morphology_blurs_the_classes():
    types = np.repeat(np.array(["CD8 T cell", "Adenocarcinoma cell"]), 400)
    strong = draw_nuclei(types, 1.0, np.random.default_rng(1))
    weak = draw_nuclei(types, 0.0, np.random.default_rng(1))

    def gap(draws):
        a = draws.nucleus_area
        return a[types == "Adenocarcinoma cell"].mean() / a[types == "CD8 T cell"].mean()

    assert gap(strong) > 3.0
    assert gap(weak) < 1.3


def _raw(tiny_panel, section_id: str) -> Path:
    return tiny_panel["data_dir"] / "raw" / section_id


def _read_he(folder: Path) -> np.ndarray:
    return tifffile.imread(next(folder.glob("*he_image.ome.tif")), level=0)


def test_nuclei_are_rendered_where_the_truth_says(tiny_panel):
    folder = _raw(tiny_panel, "breast_b")
    truth = pd.read_parquet(folder / "simulation_truth.parquet")
    haematoxylin = rgb2hed(_read_he(folder))[..., 0]
    x = np.round(truth["true_he_x_px"]).astype(int)
    y = np.round(truth["true_he_y_px"]).astype(int)
    nucleated = ~truth["cell_type"].isin(["Erythrocyte"]).to_numpy()
    at_nuclei = haematoxylin[y, x][nucleated]
    rng = np.random.default_rng(0)
    background = haematoxylin[rng.integers(0, haematoxylin.shape[0], 2000), rng.integers(0, haematoxylin.shape[1], 2000)]
    assert np.median(at_nuclei) > np.percentile(background, 75)
    lymph = truth["cell_type"].isin(["CD4 T cell", "CD8 T cell", "B cell"]).to_numpy()
    macro = truth["cell_type"].isin(["Macrophage", "M2 macrophage"]).to_numpy()
    assert np.median(haematoxylin[y, x][lymph]) > np.median(haematoxylin[y, x][macro])


def test_sections_are_detectable_from_image_colour(tiny_panel):
    """Acquisition differs per section enough that tile colour statistics identify the section."""
    features, labels = [], []
    for section_id in ("breast_a", "breast_b", "tonsil_a"):
        folder = _raw(tiny_panel, section_id)
        truth = pd.read_parquet(folder / "simulation_truth.parquet")
        image = _read_he(folder).astype(float)
        rng = np.random.default_rng(1)
        for i in rng.choice(len(truth), 40, replace=False):
            x, y = int(truth["true_he_x_px"].iloc[i]), int(truth["true_he_y_px"].iloc[i])
            tile = image[max(0, y - 24):y + 24, max(0, x - 24):x + 24].reshape(-1, 3)
            features.append(np.concatenate([tile.mean(0), tile.std(0), np.percentile(tile, [10, 90], axis=0).ravel()]))
            labels.append(section_id)
    classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    scores = cross_val_score(classifier, np.array(features), labels, cv=4)
    assert scores.mean() > 0.8  # chance is 1/3


def test_expression_follows_marker_programs(tiny_panel):
    """Each type's primary markers are enriched in its cells (log-normalised, vs the section's other cells)."""
    import h5py

    tested, enriched = 0, 0
    for section_id in ("breast_a", "breast_b", "tonsil_a"):
        folder = _raw(tiny_panel, section_id)
        truth = pd.read_parquet(folder / "simulation_truth.parquet")
        with h5py.File(folder / "cell_feature_matrix.h5") as f:
            m = f["matrix"]
            shape = tuple(m["shape"][:])
            counts = sparse.csc_matrix((m["data"][:], m["indices"][:], m["indptr"][:]), shape=shape).T.toarray()
            names = m["features/name"][:].astype(str)
        logged = np.log1p(counts / np.maximum(counts.sum(1, keepdims=True), 1) * 100)
        index = {g: i for i, g in enumerate(names)}
        for name, group in truth.groupby("cell_type"):
            if len(group) < 10 or cell_type(name).is_qc_state:
                continue
            genes = [index[g] for g in genes_of(cell_type(name).primary_markers) if g in index]
            inside = truth["cell_type"].to_numpy() == name
            tested += 1
            enriched += logged[inside][:, genes].mean() - logged[~inside][:, genes].mean() > 0.5
    assert tested >= 12
    assert enriched / tested >= 0.9


def test_reference_differs_technically_from_xenium(tiny_panel):
    import anndata as ad
    import h5py

    ref = ad.read_h5ad(tiny_panel["data_dir"] / "references" / "breast.h5ad")
    folder = _raw(tiny_panel, "breast_a")
    with h5py.File(folder / "cell_feature_matrix.h5") as f:
        panel_genes = set(f["matrix/features/name"][:].astype(str)[f["matrix/features/feature_type"][:] == b"Gene Expression"])
        xenium_depth = f["matrix/data"][:].sum() / f["matrix/shape"][1]
    ref_genes = set(ref.var_names)
    shared = panel_genes & ref_genes
    assert len(shared) >= 0.9 * len(panel_genes)
    assert panel_genes - ref_genes and ref_genes - panel_genes
    assert ref.X.sum() / ref.n_obs > 5 * xenium_depth
    mapping = map_reference_labels(list(ref.obs["cell_type"].unique()), ref.uns["reference"]["label_vocabulary"])
    assert set(mapping.values()) <= set(cell_type_by_name())
    assert set(mapping) != set(mapping.values())  # the reference speaks its own vocabulary
    assert ref.obs["cell_type"].nunique() >= 10


def test_registration_is_non_identity_and_jitter_matches(tiny_panel):
    for section_id, jitter in (("breast_a", 2.0), ("breast_b", 0.0)):
        folder = _raw(tiny_panel, section_id)
        matrix = parse_alignment_csv(next(folder.glob("*he_imagealignment.csv")))
        angle = np.degrees(np.arctan2(matrix[1, 0], matrix[0, 0]))
        assert 2.0 <= abs(angle) <= 8.0
        implied_mpp = np.sqrt(abs(np.linalg.det(matrix[:2, :2]))) * XENIUM_PIXEL_SIZE_UM  # µm per H&E px
        assert implied_mpp == pytest.approx(0.2738, rel=1e-6)
        assert np.linalg.norm(matrix[:2, 2]) > 1.0
        truth = pd.read_parquet(folder / "simulation_truth.parquet")
        nuclei = pd.read_parquet(folder / "cells.parquet")  # cell centroids: only the id order is used here
        assert (nuclei["cell_id"].to_numpy() == truth["cell_id"].to_numpy()).all()
        table = tiny_panel_table(tiny_panel, section_id)
        displacement = table[["nucleus_x_um", "nucleus_y_um"]].to_numpy() - truth[["true_x_um", "true_y_um"]].to_numpy()
        rms = float(np.sqrt((displacement**2).sum(1).mean()))
        assert rms == pytest.approx(jitter, abs=0.2 * jitter + 1e-9)


def tiny_panel_table(tiny_panel, section_id: str) -> pd.DataFrame:
    import anndata as ad

    return ad.read_zarr(tiny_panel["data_dir"] / "sections" / f"{section_id}.zarr" / "tables" / "table").obs


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_files(tmp_path):
    sections = [{"section_id": "liver_x", "organ": "Liver", "status": "Normal"}]
    params = tiny_params(seed=3, cells=150, sections=sections)
    fetch_synthetic(params.synthetic, params.seed, tmp_path / "a" / "raw", tmp_path / "a" / "ref")
    fetch_synthetic(params.synthetic, params.seed, tmp_path / "b" / "raw", tmp_path / "b" / "ref")
    first, second = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert len(first) == 11 and first == second  # 10 bundle files + 1 reference
    other = tiny_params(seed=4, cells=150, sections=sections)
    fetch_synthetic(other.synthetic, other.seed, tmp_path / "c" / "raw", tmp_path / "c" / "ref")
    assert _digest(tmp_path / "c")["raw/liver_x/cells.parquet"] != first["raw/liver_x/cells.parquet"]


def test_sections_and_references_no_longer_listed_are_removed(tmp_path):
    """data/raw and data/references persist across DVC runs: fetch removes what the params dropped."""
    raw, ref = tmp_path / "raw", tmp_path / "ref"
    (raw / "dropped_section").mkdir(parents=True)
    ref.mkdir()
    (ref / "kidney.h5ad").write_bytes(b"stale")
    (ref / "notes.txt").write_text("not a reference: kept")
    params = tiny_params(seed=3, cells=150, sections=[{"section_id": "liver_x", "organ": "Liver", "status": "Normal"}])
    summary = fetch_synthetic(params.synthetic, params.seed, raw, ref)
    assert summary["removed"] == ["dropped_section", "kidney.h5ad"]
    assert sorted(p.name for p in raw.iterdir()) == ["liver_x"]
    assert sorted(p.name for p in ref.iterdir()) == ["liver.h5ad", "notes.txt"]


def test_bundle_files_and_metadata(tiny_panel):
    folder = _raw(tiny_panel, "tonsil_a")
    names = {p.name for p in folder.iterdir()}
    assert {"experiment.xenium", "cell_feature_matrix.h5", "cells.parquet", "cells.zarr.zip",
            "nucleus_boundaries.parquet", "tonsil_a_he_image.ome.tif", "tonsil_a_he_imagealignment.csv"} <= names
    experiment = json.loads((folder / "experiment.xenium").read_text())
    assert experiment["pixel_size"] == XENIUM_PIXEL_SIZE_UM
    with tifffile.TiffFile(folder / "tonsil_a_he_image.ome.tif") as tif:
        assert tif.is_ome
        assert len(tif.series[0].levels) >= 2
        assert 'PhysicalSizeX="0.273800"' in tif.ome_metadata
    boundaries = pd.read_parquet(folder / "nucleus_boundaries.parquet")
    assert boundaries.groupby("cell_id").size().eq(14).all()


def _counts_of_one_block(types, xy_um, cell_area, programs, panel, rng, depth=110.0, spillover=0.2,
                         dispersion=4.0):
    """The section's counts computed whole, as one (cells × genes) draw of each kind: the reference
    the block-wise sampler must reproduce bit for bit."""
    rates = np.stack([programs[t] for t in types])
    _, neighbours = cKDTree(xy_um).query(xy_um, k=7)
    rates = (1 - spillover) * rates + spillover * rates[neighbours[:, 1:]].mean(axis=1)
    size = cell_area / np.mean(cell_area) * rng.lognormal(0.0, 0.3, len(types))
    rates = rates / rates.sum(axis=1, keepdims=True) * (depth * size)[:, None]
    genes = rng.poisson(rates * rng.gamma(dispersion, 1.0 / dispersion, rates.shape))
    controls = rng.poisson(0.004, (len(types), len(panel.controls)))
    return np.hstack([genes, controls]).astype(np.int32)


@pytest.mark.parametrize("block_cells", [1, 37, 500, 4096])
def test_counts_drawn_block_by_block_are_the_whole_sections_draws(block_cells):
    """Memory is one block's, and the counts do not depend on the block size: the same draws in the
    same order as a whole-section computation, bit for bit (and the generator left where it would be)."""
    panel = build_panel(240)
    programs = type_programs(panel.genes, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    n = 500
    types = rng.choice(sorted(programs), n)
    xy_um, cell_area = rng.uniform(0, 400, (n, 2)), rng.uniform(30, 120, n)
    expected_rng, blocked_rng = np.random.default_rng(3), np.random.default_rng(3)
    expected = _counts_of_one_block(types, xy_um, cell_area, programs, panel, expected_rng)
    counts = xenium_counts(types, xy_um, cell_area, programs, panel, blocked_rng, block_cells=block_cells)
    assert sparse.isspmatrix_csr(counts) and counts.dtype == np.int32 and counts.has_sorted_indices
    np.testing.assert_array_equal(counts.toarray(), expected)
    assert expected.sum() > 10 * n  # counts, not zeros
    assert blocked_rng.random() == expected_rng.random()


def _acquire_whole(haematoxylin, eosin, acquisition, rng):
    """The whole image's RGB in one computation: the reference for the banded ``acquire``."""
    od = (haematoxylin[..., None] * (acquisition.haematoxylin_scale * acquisition.haematoxylin_od)
          + eosin[..., None] * (acquisition.eosin_scale * acquisition.eosin_od) + acquisition.background_od
          ).astype(np.float32)
    od = ndimage.gaussian_filter(od, sigma=(acquisition.blur_sigma_px, acquisition.blur_sigma_px, 0))
    rgb = np.float32(255.0) * np.exp(-od)
    rgb *= (1.0 + acquisition.illumination_tilt * np.linspace(-1, 1, rgb.shape[1], dtype=np.float32))[None, :, None]
    rgb += np.float32(acquisition.noise_sd) * rng.standard_normal(rgb.shape, dtype=np.float32)
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("band_rows", [1, 5, 33, 1024])
def test_the_rgb_made_band_by_band_is_the_whole_images(band_rows):
    """The blur reaches across bands through their halos and the noise is drawn in the image's row
    order: every pixel bit for bit what one whole-image computation gives, and the generator left
    where it would be (a 2.5 px blur: the widest the simulator draws)."""
    rng = np.random.default_rng(4)
    haematoxylin = rng.uniform(0, 1.2, (67, 41)).astype(np.float32)
    eosin = rng.uniform(0, 0.6, (67, 41)).astype(np.float32)
    acquisition = draw_acquisition(np.random.default_rng(5), 1.0)
    acquisition = dataclasses.replace(acquisition, blur_sigma_px=2.5)
    expected_rng, banded_rng = np.random.default_rng(6), np.random.default_rng(6)
    expected = _acquire_whole(haematoxylin, eosin, acquisition, expected_rng)
    np.testing.assert_array_equal(acquire(haematoxylin, eosin, acquisition, banded_rng, band_rows=band_rows),
                                  expected)
    assert banded_rng.random() == expected_rng.random()
    assert len(np.unique(expected)) > 50  # an image, not a constant


@pytest.fixture(scope="module")
def program_panel(tmp_path_factory) -> dict:
    """The tiny panel's raw files simulated with the proliferation program on."""
    root = tmp_path_factory.mktemp("program")
    data = tiny_params().model_dump(mode="json")
    data["synthetic"]["proliferation"] = 1.0
    params = parse_params(data)
    fetch_synthetic(params.synthetic, params.seed, root / "data" / "raw", root / "data" / "references")
    return {"data_dir": root / "data"}


def test_the_proliferation_program_shows_in_nuclei_and_cell_cycle_genes_within_a_type(program_panel):
    """Within one type, the proliferation score grows the nucleus and raises the program's genes; a
    type's markers follow it far less (only through the per-cell normalisation: the program's counts
    are a larger share of a proliferating cell's total): expression the type label cannot carry,
    visible at the nucleus."""
    import h5py

    from cellpath.simulation.expression import PROLIFERATION_GENES

    tested = 0
    for section_id in ("breast_a", "breast_b", "tonsil_a"):
        folder = _raw(program_panel, section_id)
        truth = pd.read_parquet(folder / "simulation_truth.parquet")
        with h5py.File(folder / "cell_feature_matrix.h5") as f:
            m = f["matrix"]
            counts = sparse.csc_matrix((m["data"][:], m["indices"][:], m["indptr"][:]), shape=tuple(m["shape"][:])).T
            names = m["features/name"][:].astype(str)
        logged = np.log1p(counts.toarray() / np.maximum(counts.sum(1).A, 1) * 1e4)
        program = logged[:, np.isin(names, PROLIFERATION_GENES)].mean(axis=1)
        for name, group in truth.groupby("cell_type"):
            if len(group) < 50 or name == "Erythrocyte":
                continue
            rows, p = group.index.to_numpy(), group["proliferation"].to_numpy()
            assert np.corrcoef(p, group["nucleus_major_um"])[0, 1] > 0.1, (section_id, name)  # beside pleomorphism
            follows = np.corrcoef(p, program[rows])[0, 1]
            assert follows > 0.3, (section_id, name)
            markers = np.isin(names, genes_of(cell_type(name).primary_markers))
            assert abs(np.corrcoef(p, logged[rows][:, markers].mean(axis=1))[0, 1]) < follows, (section_id, name)
            tested += 1
    assert tested >= 3
    assert 0.0 <= truth["proliferation"].min() and truth["proliferation"].max() <= 1.0


def test_no_program_leaves_every_other_draw_as_it_was():
    """Strength 0 gives scores of 0 and exactly the counts drawn without the program: the program's
    own stream moves no other draw."""
    from cellpath.simulation.expression import proliferation_scores

    panel = build_panel(240)
    programs = type_programs(panel.genes, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    types = rng.choice(sorted(programs), 300)
    xy_um, cell_area = rng.uniform(0, 400, (300, 2)), rng.uniform(30, 120, 300)
    scores = proliferation_scores(300, 0.0, np.random.default_rng(9))
    assert not scores.any()
    with_zero = xenium_counts(types, xy_um, cell_area, programs, panel, np.random.default_rng(3), proliferation=scores)
    without = xenium_counts(types, xy_um, cell_area, programs, panel, np.random.default_rng(3))
    np.testing.assert_array_equal(with_zero.toarray(), without.toarray())
