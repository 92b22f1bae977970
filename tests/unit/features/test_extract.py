"""Extraction end to end: tiling + tiatoolbox reads + encoder + readouts, resume, CLS-less encoders."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile
import torch

from cellpath.features.encoders.loading import Encoder
from cellpath.features.encoders.registry import load_registry
from cellpath.features.extract import read_patches
from cellpath.features.readouts import readout_available
from cellpath.vocabulary import READOUTS
from cellpath.features.store import artifact_dir, read_artifact
from cellpath.features.tiling import place_cells
from cellpath.io.wsi import open_slide
from cellpath.stages.extract import run as run_extract
from cellpath.vocabulary import MAGNIFICATION_MPP
from helpers.project import PROJECT_ROOT

SLIDE_MPP = 0.2738


class DarknessTokens(torch.nn.Module):
    """A stand-in ViT: one CLS token, then one token per 16×16 block = that block's mean darkness."""

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        darkness = -pixels.mean(dim=1, keepdim=True)  # (B, 1, S, S)
        grid = torch.nn.functional.avg_pool2d(darkness, 16).flatten(2).transpose(1, 2)  # (B, 196, 1)
        return torch.cat([grid.mean(dim=1, keepdim=True), grid], dim=1)


def _spec():
    base = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["random-vit-s16"]
    return base.model_copy(update={"name": "darkness", "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0),
                                   "embed_dim": 1})


def _slide_with_dot(path, dot_um: tuple[float, float], size_px: int = 1500) -> None:
    image = np.full((size_px, size_px, 3), 240, dtype=np.uint8)
    yy, xx = np.mgrid[0:size_px, 0:size_px]
    cx, cy = dot_um[0] / SLIDE_MPP, dot_um[1] / SLIDE_MPP
    image[(xx + 0.5 - cx) ** 2 + (yy + 0.5 - cy) ** 2 <= (2.0 / SLIDE_MPP) ** 2] = 10
    tifffile.imwrite(path, image, photometric="rgb", tile=(256, 256),
                     metadata={"axes": "YXS", "PhysicalSizeX": SLIDE_MPP, "PhysicalSizeY": SLIDE_MPP})


@pytest.mark.parametrize("magnification", list(MAGNIFICATION_MPP))
@pytest.mark.parametrize("dot_um", [(101.3, 57.9), (250.0, 301.7), (37.0, 212.4)])
def test_a_dot_at_a_known_position_lands_in_the_cells_token(tmp_path, magnification, dot_um):
    path = tmp_path / "dot.ome.tif"
    _slide_with_dot(path, dot_um)
    spec = _spec()
    encoder = Encoder(spec=spec, module=DarknessTokens(), device=torch.device("cpu"), weights="test", revision="t")
    xy_px = np.array([[dot_um[0] / SLIDE_MPP, dot_um[1] / SLIDE_MPP]])
    placement = place_cells(xy_px, np.array([12.0]), slide_size=(1500, 1500), slide_mpp=SLIDE_MPP,
                            target_mpp=MAGNIFICATION_MPP[magnification], input_size=224)
    patch = read_patches(open_slide(path), placement.grid, placement.patch_index)
    _, grid = encoder.forward_tokens(patch)
    darkest = np.unravel_index(int(grid[0, ..., 0].argmax()), grid.shape[1:3])  # (row, col)
    expected = tuple(int(v) for v in np.floor(placement.position_px[0][::-1] / 16))
    assert darkest == expected


def test_extract_stage_writes_and_resumes(tiny_panel, tmp_path, monkeypatch):
    import shutil

    data_dir = tmp_path / "data"
    for sub in ("raw", "sections", "labels"):
        shutil.copytree(tiny_panel["data_dir"] / sub, data_dir / sub)
    params = tiny_panel["params"]
    first = run_extract(params, data_dir, "filterbank-dense", "10x")
    assert first == {"computed": ["breast_a", "breast_b", "tonsil_a"], "reused": [], "removed": []}
    artifact = read_artifact(artifact_dir(data_dir / "features", "filterbank-dense", "10x", "breast_a"))
    assert set(artifact) == {"Nuc", "Mean"}  # no CLS token: Cls and its fusions are unavailable
    n_cells = len(np.load(data_dir / "features" / "filterbank-dense" / "10x" / "breast_a" / "Nuc.npy"))
    assert artifact["Nuc"].shape[0] == n_cells and np.isfinite(artifact["Nuc"]).all()
    assert not np.allclose(artifact["Nuc"], artifact["Mean"])

    # A crash while writing the second section: the first stays, the second is absent. The stage
    # imports write_artifact when it runs, so patching the module attribute reaches it.
    shutil.rmtree(data_dir / "features")
    import cellpath.features.store as store

    calls = {"n": 0}
    original = store.write_artifact

    def crash_on_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(store, "write_artifact", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_extract(params, data_dir, "filterbank-dense", "10x")
    monkeypatch.setattr(store, "write_artifact", original)
    folder = data_dir / "features" / "filterbank-dense" / "10x"
    assert sorted(p.name for p in folder.iterdir()) == ["breast_a"]
    again = run_extract(params, data_dir, "filterbank-dense", "10x")
    assert again == {"computed": ["breast_b", "tonsil_a"], "reused": ["breast_a"], "removed": []}


def test_cls_readouts_are_unavailable_without_a_cls_token():
    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    assert not readout_available(registry["filterbank-dense"], "Cls")
    assert not readout_available(registry["CTransPath (CHIEF)"], "N||C")
    assert all(readout_available(registry["random-vit-s16"], readout) for readout in READOUTS)


def test_an_unknown_encoder_is_named_with_the_closest_slug(tiny_panel):
    from cellpath.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--encoder: 'filterbank-dens': not a slug in models/encoders.yaml; "
                                          r"did you mean 'filterbank-dense'\?"):
        run_extract(tiny_panel["params"], tiny_panel["data_dir"], "filterbank-dens", "10x")


def test_extract_takes_a_registry_name_or_its_slug_and_extract_encoders_slugs_only():
    from cellpath.features.encoders.registry import UnknownEncoder, load_registry, resolve_encoder, selected_encoders

    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    by_name = resolve_encoder(registry, "Kaiko ViT-L/14", accept_names=True)
    assert by_name is resolve_encoder(registry, "kaiko-vit-l-14", accept_names=True)
    assert by_name.slug == "kaiko-vit-l-14"
    with pytest.raises(UnknownEncoder, match="a registry name; list its slug 'kaiko-vit-l-14' instead"):
        resolve_encoder(registry, "Kaiko ViT-L/14")
    chosen = selected_encoders(PROJECT_ROOT / "models" / "encoders.yaml", ["uni2", "filterbank-dense"])
    assert [spec.slug for spec in chosen] == ["uni2", "filterbank-dense"]


def test_sections_no_longer_evaluated_are_pruned_from_the_persistent_output(tmp_path):
    from cellpath.io.atomic import prune_other_folders

    for name in ("kept", "dropped", ".kept.tmp-1-abc"):
        (tmp_path / name).mkdir()
    assert prune_other_folders(tmp_path, {"kept"}) == ["dropped"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".kept.tmp-1-abc", "kept"]
    assert prune_other_folders(tmp_path / "absent", {"kept"}) == []


def test_patches_read_ahead_arrive_in_order_read_by_one_thread():
    """The read-ahead yields the same batches and pixels as on-demand reading, in order, and only its
    one background thread touches the reader."""
    import threading

    from cellpath.features.extract import _batches, read_ahead
    from cellpath.features.tiling import place_cells

    class Reader:  # each patch is filled with its level-0 x origin, so order mistakes show
        def __init__(self):
            self.threads = set()

        def read_rect(self, location, size, **_):
            self.threads.add(threading.get_ident())
            return np.full((*size, 3), location[0] % 251, dtype=np.uint8)

    xy = np.array([[x, 50.0] for x in range(20, 4000, 120)])
    placement = place_cells(xy, np.full(len(xy), 30.0), slide_size=(4100, 300), slide_mpp=0.25, target_mpp=0.5,
                            input_size=32)
    patches = np.unique(placement.patch_index)
    on_demand = list(read_ahead(Reader(), placement.grid, _batches(patches, 4), depth=0))
    reader = Reader()
    ahead = list(read_ahead(reader, placement.grid, _batches(patches, 4), depth=3))
    assert len(ahead) == len(on_demand) > 3
    for (batch_a, images_a), (batch_b, images_b) in zip(on_demand, ahead):
        np.testing.assert_array_equal(batch_a, batch_b)
        np.testing.assert_array_equal(images_a, images_b)
    assert len(reader.threads) == 1 and threading.get_ident() not in reader.threads
