"""Per-cell readouts (Nuc, Mean, Cls) and their fusions."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cellpath.features.encoders.registry import load_registry  # noqa: E402
from cellpath.features.readouts import (cls_readout, compose_readout, fuse, readout_available,  # noqa: E402
                                        mean_readout, nuclear_readout)
from cellpath.vocabulary import READOUTS  # noqa: E402
from helpers.project import PROJECT_ROOT

REGISTRY_PATH = PROJECT_ROOT / "models" / "encoders.yaml"


@pytest.fixture
def grid_2x3() -> torch.Tensor:
    """One patch, 2 rows × 3 columns of 1-d tokens, token stride 4 px (a 12 × 8 px patch):
    row 0 = 0, 1, 2; row 1 = 10, 11, 12. Token centres at x = 2, 6, 10 and y = 2, 6."""
    return torch.tensor([[[[0.0], [1.0], [2.0]], [[10.0], [11.0], [12.0]]]])


def test_bilinear_sample_against_hand_computed_values(grid_2x3):
    positions = torch.tensor([
        [2.0, 2.0],  # centre of token (0, 0)
        [4.0, 2.0],  # halfway between tokens (0, 0) and (0, 1)
        [6.0, 4.0],  # halfway between (0, 1) and (1, 1)
        [5.0, 3.0],  # token coordinate (0.75, 0.25): 0.75 + 0.25 · 10
        [8.0, 6.0],  # (1.5, 1): between 11 and 12
    ])
    values = nuclear_readout(grid_2x3, torch.zeros(5, dtype=torch.long), positions, patch_size_px=4)
    torch.testing.assert_close(values[:, 0], torch.tensor([0.0, 0.5, 6.0, 3.25, 11.5]))


def test_border_clamping(grid_2x3):
    positions = torch.tensor([
        [0.0, 0.0],  # top-left patch corner → token (0, 0)
        [12.0, 8.0],  # bottom-right corner → token (1, 2)
        [1.0, 1.5],  # within half a token of the top-left edges → token (0, 0)
        [12.0, 4.0],  # right edge, halfway down: mean of 2 and 12
        [4.0, 0.0],  # top edge, between columns 0 and 1
        [11.0, 7.0],  # within half a token of the bottom-right → token (1, 2)
    ])
    values = nuclear_readout(grid_2x3, torch.zeros(6, dtype=torch.long), positions, patch_size_px=4)
    torch.testing.assert_close(values[:, 0], torch.tensor([0.0, 12.0, 0.0, 7.0, 0.5, 12.0]))


def test_bilinear_sample_equals_grid_sample_with_border_padding():
    generator = torch.Generator().manual_seed(0)
    grid = torch.randn(3, 14, 14, 5, generator=generator, dtype=torch.float64)
    patch_index = torch.randint(0, 3, (200,), generator=generator)
    positions = torch.rand(200, 2, generator=generator, dtype=torch.float64) * 224
    values = nuclear_readout(grid, patch_index, positions, patch_size_px=16)
    # grid_sample's (−1, 1) spans the patch's outer edges with align_corners=False
    normalised = (positions / 224 * 2 - 1)[:, None, None, :]
    expected = F.grid_sample(grid.permute(0, 3, 1, 2)[patch_index], normalised, mode="bilinear",
                             padding_mode="border", align_corners=False)[:, :, 0, 0]
    torch.testing.assert_close(values, expected)


def test_nuclear_readout_picks_each_cells_patch_and_accepts_numpy():
    grid = np.stack([np.full((2, 2, 3), 1.0), np.full((2, 2, 3), 2.0)]).astype(np.float32)
    values = nuclear_readout(grid, np.array([1, 0, 1]), np.array([[3.0, 3.0], [1.0, 2.0], [0.0, 4.0]]), 2)
    torch.testing.assert_close(values, torch.tensor([[2.0] * 3, [1.0] * 3, [2.0] * 3]))


def test_single_token_grid(grid_2x3):
    values = nuclear_readout(grid_2x3[:, :1, :1], torch.tensor([0, 0]), torch.tensor([[0.0, 0.0], [4.0, 4.0]]), 4)
    torch.testing.assert_close(values[:, 0], torch.tensor([0.0, 0.0]))


def test_nuclear_readout_rejects_bad_inputs(grid_2x3):
    with pytest.raises(ValueError, match="inside the patch"):
        nuclear_readout(grid_2x3, torch.tensor([0]), torch.tensor([[12.5, 1.0]]), 4)
    with pytest.raises(ValueError, match="patch_index outside"):
        nuclear_readout(grid_2x3, torch.tensor([1]), torch.tensor([[1.0, 1.0]]), 4)
    with pytest.raises(ValueError, match=r"\(B, H, W, D\)"):
        nuclear_readout(grid_2x3[0], torch.tensor([0]), torch.tensor([[1.0, 1.0]]), 4)


def test_mean_and_cls(grid_2x3):
    torch.testing.assert_close(mean_readout(grid_2x3), torch.tensor([[6.0]]))
    np.testing.assert_allclose(mean_readout(grid_2x3.numpy()), [[6.0]])
    cls = torch.arange(6.0).reshape(3, 2)
    assert cls_readout(cls) is cls
    with pytest.raises(ValueError, match="no class token"):
        cls_readout(None)


@pytest.mark.parametrize("as_array", [np.asarray, torch.as_tensor])
def test_fusions(as_array):
    nuc = as_array(np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32))
    mean = as_array(np.array([[10.0, 20.0], [30.0, 40.0]], dtype=np.float32))
    cls = as_array(np.array([[-1.0, -2.0], [-3.0, -4.0]], dtype=np.float32))
    expected = {
        "Nuc": [[1, 2], [3, 4]], "Mean": [[10, 20], [30, 40]], "Cls": [[-1, -2], [-3, -4]],
        "N+M": [[11, 22], [33, 44]], "N+C": [[0, 0], [0, 0]],
        "N||M": [[1, 2, 10, 20], [3, 4, 30, 40]], "N||C": [[1, 2, -1, -2], [3, 4, -3, -4]],
    }
    for readout in READOUTS:
        features = compose_readout(readout, nuc, mean, cls)
        assert type(features) is type(nuc)
        np.testing.assert_array_equal(np.asarray(features), expected[readout])
    with pytest.raises(ValueError, match="equal shapes"):
        fuse(nuc, compose_readout("N||M", nuc, mean), "sum")
    with pytest.raises(ValueError, match="'sum' or 'concat'"):
        fuse(nuc, mean, "product")


def test_cls_readouts_are_unavailable_without_a_class_token():
    registry = load_registry(REGISTRY_PATH)
    assert tuple(r for r in READOUTS if readout_available(registry["UNI"], r)) == READOUTS
    for name in ("CTransPath (CHIEF)", "filterbank-dense"):
        assert tuple(r for r in READOUTS if readout_available(registry[name], r)) == ("Nuc", "Mean", "N+M", "N||M")
    nuc = np.ones((2, 3))
    for readout in ("Cls", "N+C", "N||C"):
        with pytest.raises(ValueError, match=re.escape(f"readout {readout} needs a class token")):
            compose_readout(readout, nuc, nuc, None)
    with pytest.raises(ValueError, match="unknown readout"):
        compose_readout("N*M", nuc, nuc)


def test_each_readout_names_the_stored_bases_it_is_made_of():
    from cellpath.features.readouts import readout_bases

    assert [readout_bases(r) for r in ("Nuc", "Mean", "Cls", "N+M", "N||C")] == [
        ("Nuc",), ("Mean",), ("Cls",), ("Nuc", "Mean"), ("Nuc", "Cls")]
    with pytest.raises(ValueError, match="unknown readout 'N-M'"):
        readout_bases("N-M")
