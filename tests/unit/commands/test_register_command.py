"""``cellpath register`` on simulated raw sections: the H&E's own nuclei found by the built-in
detector, registered to the Xenium nuclei, against the simulator's true alignment."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import tifffile

from cellpath.cli import main
from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM, parse_alignment_csv
from cellpath.io.layout import SIMULATION_TRUTH_NAME
from cellpath.simulation.xenium_bundle import write_he_ome_tiff


def _section(tiny_panel, tmp_path, section_id: str = "breast_b"):
    folder = tmp_path / section_id
    shutil.copytree(tiny_panel["data_dir"] / "raw" / section_id, folder)
    (alignment,) = folder.glob("*he_imagealignment.csv")
    return folder, alignment


def _error_at_nuclei_um(folder, truth: np.ndarray, found: np.ndarray) -> np.ndarray:
    """Distances (µm) between where the true and the found alignment put each nucleus's true H&E position."""
    cells = pd.read_parquet(folder / SIMULATION_TRUTH_NAME)
    he = np.column_stack([cells["true_he_x_px"], cells["true_he_y_px"], np.ones(len(cells))])
    return np.hypot(*(((he @ truth.T) - (he @ found.T))[:, :2] * XENIUM_PIXEL_SIZE_UM).T)


def test_a_section_without_an_alignment_file_gets_10x_s_file(tiny_panel, tmp_path):
    folder, alignment = _section(tiny_panel, tmp_path)
    truth = parse_alignment_csv(alignment)
    alignment.unlink()
    assert main(["register", str(folder)]) == 0
    errors = _error_at_nuclei_um(folder, truth, parse_alignment_csv(alignment))
    assert np.median(errors) <= 1.0 and errors.max() <= 3.0, (np.median(errors), errors.max())
    record = json.loads(next(folder.glob("*he_registration.json")).read_text())
    assert record["written"] == alignment.name and record["converged"]
    assert record["registered"]["verdict"] == "passes QC" and "given" not in record
    # spatialdata-io's own reader takes the written file as the H&E image's transformation
    from spatialdata.transformations import get_transformation
    from spatialdata_io import xenium_aligned_image

    image = xenium_aligned_image(next(folder.glob("*he_image.ome.tif")), alignment)
    np.testing.assert_allclose(get_transformation(image, "global").to_affine_matrix(("x", "y"), ("x", "y")),
                               parse_alignment_csv(alignment), rtol=1e-15, atol=1e-12)


def test_a_poor_given_alignment_is_kept_and_a_repair_proposed_beside_it(tiny_panel, tmp_path):
    folder, alignment = _section(tiny_panel, tmp_path)
    truth = parse_alignment_csv(alignment)
    shifted = truth.copy()
    shifted[:2, 2] += 12.0 / XENIUM_PIXEL_SIZE_UM  # the given alignment 12 µm off along x and y
    alignment.write_text("\n".join(",".join(repr(float(v)) for v in row) for row in shifted) + "\n")
    given_bytes = alignment.read_bytes()
    assert main(["register", str(folder)]) == 0
    assert alignment.read_bytes() == given_bytes  # the given alignment is never touched
    (proposal,) = folder.glob("*he_imagealignment.registered.csv")
    errors = _error_at_nuclei_um(folder, truth, parse_alignment_csv(proposal))
    assert np.median(errors) <= 1.0 and errors.max() <= 3.0
    record = json.loads(next(folder.glob("*he_registration.json")).read_text())
    assert record["given"]["verdict"] == "fails QC" and record["registered"]["verdict"] == "passes QC"
    assert record["given"]["median_um"] > 3 * record["registered"]["median_um"]


def test_a_slide_without_nuclei_is_refused_with_the_reason(tiny_panel, tmp_path, capsys):
    folder, alignment = _section(tiny_panel, tmp_path)
    alignment.unlink()
    (he,) = folder.glob("*he_image.ome.tif")
    blank = np.full_like(tifffile.imread(he), 245)  # an empty, white slide of the same size
    write_he_ome_tiff(he, blank, float(json.loads((folder / "simulation.json").read_text())["he_mpp"]))
    assert main(["register", str(folder)]) == 2
    assert "no nuclei were detected" in capsys.readouterr().err
    assert not list(folder.glob("*he_imagealignment*.csv")) and not list(folder.glob("*he_registration.json"))
