import numpy as np
import pytest

from cellpath.errors import InputError
from cellpath.io.coords import XENIUM_PIXEL_SIZE_UM, parse_alignment_csv, um_to_he_px


def _he_px_to_um(xy_px: np.ndarray, alignment: np.ndarray, pixel_size_um: float) -> np.ndarray:
    """The forward map as 10x defines it: H&E px → morphology px (the alignment) → µm (× pixel size)."""
    return (np.column_stack([xy_px, np.ones(len(xy_px))]) @ alignment.T)[:, :2] * pixel_size_um


def _write(tmp_path, text):
    path = tmp_path / "x_he_imagealignment.csv"
    path.write_text(text)
    return path


def test_golden_mapping_through_the_inverse(tmp_path):
    # H&E px → morph px: scale 2, rotate 90°, shift (10, 20). Hand-computed inverse for one point.
    path = _write(tmp_path, "0,-2,10\n2,0,20\n0,0,1\n")
    matrix = parse_alignment_csv(path)
    # µm (4.25, 8.5) → morph px (20, 40) → H&E px solves 0*x - 2*y + 10 = 20, 2*x + 20 = 40 → (10, -5)
    he = um_to_he_px(np.array([[4.25, 8.5]]), matrix, pixel_size_um=0.2125)
    np.testing.assert_allclose(he, [[10.0, -5.0]], atol=1e-12)
    np.testing.assert_allclose(_he_px_to_um(he, matrix, 0.2125), [[4.25, 8.5]], atol=1e-12)


def test_round_trip_random_affine():
    rng = np.random.default_rng(0)
    matrix = np.eye(3)
    matrix[:2, :] = rng.normal(size=(2, 3)) + np.array([[1.3, 0, 0], [0, 1.3, 0]])
    xy = rng.uniform(0, 1000, size=(50, 2))
    np.testing.assert_allclose(_he_px_to_um(um_to_he_px(xy, matrix), matrix, XENIUM_PIXEL_SIZE_UM), xy, atol=1e-8)


def test_keypoint_export_is_fitted_to_an_affine(tmp_path):
    truth = np.array([[1.2, 0.1, 5.0], [-0.1, 1.2, 7.0], [0, 0, 1]])
    he = np.array([[0, 0], [100, 0], [0, 100], [80, 90.0]])
    morph = he @ truth[:2, :2].T + truth[:2, 2]
    rows = "\n".join(f"{m[0]},{m[1]},{h[0]},{h[1]}" for m, h in zip(morph, he))
    path = _write(tmp_path, "fixedX,fixedY,alignmentX,alignmentY\n" + rows + "\n")
    np.testing.assert_allclose(parse_alignment_csv(path), truth, atol=1e-9)


@pytest.mark.parametrize("encoded", [
    "\ufeff0,-2,10\r\n2,0,20\r\n0,0,1\r\n",          # a UTF-8 BOM and CRLF (Windows exports)
    '"0","-2","10"\n"2","0","20"\n"0","0","1"\n',      # quoted numbers
    "0 , -2 , 10 \n 2,0,20\n\n0,0,1\n\n",              # spaces around numbers, blank lines
])
def test_the_matrix_is_read_as_pandas_reads_a_csv(tmp_path, encoded):
    path = tmp_path / "x_he_imagealignment.csv"
    path.write_bytes(encoded.encode("utf-8"))
    np.testing.assert_array_equal(parse_alignment_csv(path), [[0, -2, 10], [2, 0, 20], [0, 0, 1]])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("1,0,0\n0,1,0\n", "3×3 matrix"),
        ("1,0\n0,1\n0,0\n", "3×3 matrix"),
        ("1,0,0\n0,one,0\n0,0,1\n", "three comma-separated rows"),
        ("1,0,0\n0,nan,0\n0,0,1\n", "NaN or infinite"),
        ("1,2,0\n2,4,0\n0,0,1\n", "singular"),
        ("1,0,0\n0,1,0\n0.1,0,1\n", "must be affine"),
        ("", "3×3 matrix"),
        ("1,0,0\n0,1\n0,0,1\n", "3×3 matrix"),
        ("1,0,0\n0,1,0,7\n0,0,1\n", "cannot read the H&E alignment file"),
    ],
)
def test_bad_alignment_names_the_file(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(InputError) as err:
        parse_alignment_csv(path, section="s1")
    assert needle in str(err.value)
    assert "section s1" in str(err.value) and str(path) in str(err.value)
