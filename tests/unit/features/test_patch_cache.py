"""The shared patch store: the same features with and without it, the slide read once for two
encoders, nothing half-written after a failure, and no stale pixels after the slide changes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tifffile
import torch

from cellpath.features.encoders.loading import Encoder
from cellpath.features.encoders.registry import load_registry
from cellpath.features.extract import extract_cells
from cellpath.features.patch_cache import open_store, patch_store_path
from cellpath.features.tiling import place_cells
from cellpath.io.wsi import open_slide
from helpers.project import PROJECT_ROOT

SLIDE_MPP = 0.2738


class Tokens(torch.nn.Module):
    """A stand-in ViT: a CLS token and one token per 16×16 block, its three channel means."""

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        grid = torch.nn.functional.avg_pool2d(pixels, 16).flatten(2).transpose(1, 2)  # (B, 196, 3)
        return torch.cat([grid.mean(dim=1, keepdim=True), grid], dim=1)


class CountingReader:
    """A slide reader that counts its patch reads."""

    def __init__(self, path):
        self.reader, self.reads = open_slide(path), 0

    def read_rect(self, *args, **kwargs):
        self.reads += 1
        return self.reader.read_rect(*args, **kwargs)


@pytest.fixture
def slide(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(1400, 1400, 3), dtype=np.uint8)
    path = tmp_path / "slide.ome.tif"
    tifffile.imwrite(path, image, photometric="rgb", tile=(256, 256),
                     metadata={"axes": "YXS", "PhysicalSizeX": SLIDE_MPP, "PhysicalSizeY": SLIDE_MPP})
    return path


def _encoder() -> Encoder:
    base = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["random-vit-s16"]
    spec = base.model_copy(update={"name": "means", "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "embed_dim": 3})
    return Encoder(spec=spec, module=Tokens(), device=torch.device("cpu"), weights="test", revision="t")


def _placement():
    rng = np.random.default_rng(1)
    xy = rng.uniform(20, 1380, size=(300, 2))
    return place_cells(xy, np.full(len(xy), 30.0), slide_size=(1400, 1400), slide_mpp=SLIDE_MPP, target_mpp=0.5,
                       input_size=224)


def test_two_encoders_read_the_slide_once_and_get_the_features_of_direct_reads(slide, tmp_path):
    placement, encoder = _placement(), _encoder()
    n_patches = len(np.unique(placement.patch_index))
    direct = extract_cells(encoder, open_slide(slide), placement, batch_size=4)
    store = patch_store_path(tmp_path / "patches", "s1", slide, placement.grid)
    first, second = CountingReader(slide), CountingReader(slide)
    via_slide = extract_cells(encoder, first, placement, batch_size=4, patch_store=store)
    via_store = extract_cells(encoder, second, placement, batch_size=3, patch_store=store)
    assert first.reads == n_patches and second.reads == 0 and n_patches > 4
    for readout in direct:
        np.testing.assert_array_equal(via_slide[readout], direct[readout])
        np.testing.assert_array_equal(via_store[readout], direct[readout])
    assert store.stat().st_size >= n_patches * 224 * 224 * 3


def test_a_failed_extraction_leaves_no_store_and_no_temporary(slide, tmp_path):
    placement, encoder = _placement(), _encoder()
    store = patch_store_path(tmp_path / "patches", "s1", slide, placement.grid)
    calls = {"n": 0}
    forward = encoder.forward_tokens

    def failing(images):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory")
        return forward(images)

    object.__setattr__(encoder, "forward_tokens", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        extract_cells(encoder, open_slide(slide), placement, batch_size=4, patch_store=store)
    assert list((tmp_path / "patches").iterdir()) == []


def test_a_changed_slide_gets_a_new_store_and_the_old_one_is_removed(slide, tmp_path):
    placement, encoder = _placement(), _encoder()
    folder = tmp_path / "patches"
    old = patch_store_path(folder, "s1", slide, placement.grid)
    extract_cells(encoder, open_slide(slide), placement, batch_size=8, patch_store=old)
    stat = slide.stat()
    os.utime(slide, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place
    new = patch_store_path(folder, "s1", slide, placement.grid)
    assert new != old
    extract_cells(encoder, open_slide(slide), placement, batch_size=8, patch_store=new)
    assert sorted(p.name for p in folder.iterdir()) == sorted([new.name, new.with_suffix(".index.npy").name])


def test_a_store_missing_a_needed_patch_is_not_used(slide, tmp_path):
    placement, encoder = _placement(), _encoder()
    store = patch_store_path(tmp_path / "patches", "s1", slide, placement.grid)
    extract_cells(encoder, open_slide(slide), placement, batch_size=8, patch_store=store)
    patches = np.unique(placement.patch_index)
    assert open_store(store, patches) is not None
    assert open_store(store, np.append(patches, patches.max() + 1)) is None
