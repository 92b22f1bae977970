"""Coordinate systems and the one mapping between them.

- Xenium µm: cell and nucleus centroids in cells.parquet / cells.zarr.zip.
- Xenium morphology px: µm ÷ ``pixel_size`` (0.2125 µm/px, from experiment.xenium).
- H&E level-0 px: pixels of the full-resolution registered H&E OME-TIFF.

10x's ``<prefix>he_imagealignment.csv`` is a 3×3 affine that maps H&E px (x, y, 1) to morphology
px. Cells are placed on the H&E through its inverse.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output

XENIUM_PIXEL_SIZE_UM = 0.2125


def parse_alignment_csv(path: Path, section: str | None = None) -> np.ndarray:
    """The 3×3 affine H&E level-0 px → Xenium morphology px of an alignment file (see :func:`read_alignment`)."""
    return read_alignment(path, section)[0]


def read_alignment(path: Path, section: str | None = None) -> tuple[np.ndarray, str]:
    """Read a 10x H&E alignment CSV: three comma-separated rows, no header, a 3×3 affine.

    Returns the matrix mapping H&E level-0 px → Xenium morphology px and the file's kind,
    ``"matrix"`` or ``"keypoints"``. The file is read as
    ``pandas.read_csv(header=None)`` reads it (spatialdata-io's reader does the same): a UTF-8 BOM,
    CRLF line ends, quoted numbers and spaces around them are accepted. Raises InputError for a
    malformed, non-finite, non-affine or singular matrix. Keypoint exports (Xenium Explorer ≥ 2:
    columns fixedX, fixedY, alignmentX, alignmentY) are fitted to an affine by least squares, with
    ``fixed*`` read as morphology px (:func:`check_alignment_scale` tells µm from px).
    """
    table = _read_cells(path, section)
    if len(table) and "fixedX" in table[0]:
        return _affine_from_keypoints(table, path, section), "keypoints"
    try:
        rows = [[float(v) for v in row] for row in table]
    except ValueError:
        raise InputError(
            "H&E alignment must be three comma-separated rows of three numbers (a 3×3 affine)",
            path=path, section=section,
        ) from None
    matrix = np.asarray(rows, dtype=float) if rows and all(len(r) == 3 for r in rows) else None
    if matrix is None or matrix.shape != (3, 3):
        raise InputError(
            f"H&E alignment must be a 3×3 matrix, found {len(rows)} row(s) of lengths "
            f"{[len(r) for r in rows]}", path=path, section=section,
        )
    _check_affine(matrix, path, section)
    return matrix, "matrix"


def _read_cells(path: Path, section: str | None) -> list[list[str]]:
    """The CSV's non-empty rows as stripped strings (pandas' parser: BOM, quotes, CRLF), trailing
    empty cells dropped."""
    try:
        frame = pd.read_csv(path, header=None, dtype=str, encoding="utf-8-sig", skip_blank_lines=True,
                            keep_default_na=False)
    except pd.errors.EmptyDataError:
        return []
    except (OSError, UnicodeDecodeError, pd.errors.ParserError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc).strip()
        raise InputError(f"cannot read the H&E alignment file ({reason})", path=path, section=section) from None
    rows = []
    for values in frame.itertuples(index=False):
        cells = ["" if pd.isna(v) else str(v).strip() for v in values]
        while cells and cells[-1] == "":
            cells.pop()
        if cells:
            rows.append(cells)
    return rows


def _affine_from_keypoints(table: list[list[str]], path: Path, section: str | None) -> np.ndarray:
    header = table[0]
    needed = ["fixedX", "fixedY", "alignmentX", "alignmentY"]
    if any(n not in header for n in needed):
        raise InputError(f"keypoint alignment needs columns {needed}, found {header}", path=path, section=section)
    try:
        values = np.array([[float(v) for v in row] for row in table[1:]])
    except ValueError:
        raise InputError("keypoint alignment has non-numeric values", path=path, section=section) from None
    if values.ndim != 2 or len(values) < 3:
        raise InputError("keypoint alignment needs at least 3 keypoints", path=path, section=section)
    idx = [header.index(n) for n in needed]
    # Explorer keypoints: fixed = Xenium morphology px, alignment = H&E px.
    fixed, moving = values[:, idx[:2]], values[:, idx[2:]]
    design = np.column_stack([moving, np.ones(len(moving))])
    solution, *_ = np.linalg.lstsq(design, fixed, rcond=None)
    matrix = np.eye(3)
    matrix[:2, :] = solution.T
    _check_affine(matrix, path, section)
    return matrix


ALIGNMENT_SCALE_TOLERANCE = 0.1  # relative: the alignment's scale against the two images' pixel sizes


def check_alignment_scale(matrix: np.ndarray, kind: str, he_mpp: float, pixel_size_um: float, path: Path,
                          section: str | None = None) -> tuple[np.ndarray, str]:
    """The alignment checked against the images it links, and how its units were read.

    An affine H&E px → morphology px scales by √|det| ≈ ``he_mpp / pixel_size_um`` (µm per H&E px
    over µm per morphology px). A keypoint export whose fixed points are in µm instead fits a scale
    ≈ ``he_mpp``: 10x's documentation found here does not say which units ``fixedX/fixedY`` carry,
    so the two readings — a factor 1/``pixel_size_um`` (4.7×) apart — are told apart by the data and
    µm are converted to morphology px. Any other scale is an InputError naming the file.
    """
    scale = float(np.sqrt(abs(np.linalg.det(matrix[:2, :2]))))
    expected = he_mpp / pixel_size_um
    if abs(scale / expected - 1) <= ALIGNMENT_SCALE_TOLERANCE:
        return matrix, kind if kind == "matrix" else "keypoints (fixed in morphology px)"
    if kind == "keypoints" and abs(scale / he_mpp - 1) <= ALIGNMENT_SCALE_TOLERANCE:
        return np.diag([1 / pixel_size_um, 1 / pixel_size_um, 1.0]) @ matrix, "keypoints (fixed in µm, converted)"
    raise InputError(
        f"the alignment scales H&E px by {scale:.4g} but the images need {expected:.4g} (H&E {he_mpp:g} µm/px ÷ "
        f"morphology {pixel_size_um:g} µm/px, ±{ALIGNMENT_SCALE_TOLERANCE:.0%}); it belongs to another image, or the "
        "H&E's pixel size (OME PhysicalSizeX) is wrong", path=path, section=section)


def _check_affine(matrix: np.ndarray, path: Path, section: str | None) -> None:
    if not np.all(np.isfinite(matrix)):
        raise InputError("H&E alignment matrix contains NaN or infinite values", path=path, section=section)
    if not np.allclose(matrix[2], [0.0, 0.0, 1.0], atol=1e-9):
        raise InputError(
            f"H&E alignment must be affine (last row 0, 0, 1), found {matrix[2].tolist()}",
            path=path, section=section,
        )
    det = np.linalg.det(matrix[:2, :2])
    if abs(det) < 1e-9:
        raise InputError(
            f"H&E alignment matrix is singular (det = {det:.3g}); re-export the registration",
            path=path, section=section,
        )


def um_to_he_px(xy_um: np.ndarray, alignment: np.ndarray, pixel_size_um: float = XENIUM_PIXEL_SIZE_UM) -> np.ndarray:
    """Map Xenium µm (N, 2) → H&E level-0 px (N, 2) through the inverse of the alignment."""
    morph = np.asarray(xy_um, dtype=float) / pixel_size_um
    homogeneous = np.column_stack([morph, np.ones(len(morph))])
    he = homogeneous @ np.linalg.inv(alignment).T
    return he[:, :2]


def write_alignment_csv(path: Path, matrix: np.ndarray) -> None:
    """Write a 3×3 affine (H&E level-0 px → morphology px) as 10x's alignment CSV: three rows of three
    comma-separated numbers, no header, each as Python's shortest round-trip repr (what
    :func:`read_alignment`, spatialdata-io and Xenium Explorer read back to the same matrix). Written
    whole or not at all."""
    from cellpath.io.atomic import atomic_output

    matrix = np.asarray(matrix, dtype=float)
    if matrix.shape != (3, 3) or not np.all(np.isfinite(matrix)):
        raise ValueError(f"an alignment must be a finite 3×3 matrix, got shape {matrix.shape}")
    with atomic_output(path) as tmp:
        tmp.write_text("\n".join(",".join(repr(float(v)) for v in row) for row in matrix) + "\n")
