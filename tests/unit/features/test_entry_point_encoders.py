"""`loader: entry-point:<name>`: an encoder brought by an installed package, without editing cellpath."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from cellpath.features.encoders.loading import EncoderLoadError, EncoderUnavailable, load_encoder
from cellpath.features.encoders.registry import ENTRY_POINT_GROUP, EncoderSpec
from helpers.plugins import build_tiny_vit


def _row(loader: str, hub_id: str | None = None) -> EncoderSpec:
    return EncoderSpec.model_validate({
        "name": "my-model", "type": "PV", "architecture": "ViT-tiny/16", "hub_id": hub_id, "revision": "main",
        "loader": loader, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "input_size": 64, "patch_size": 16,
        "num_prefix_tokens": 1, "has_cls": True, "embed_dim": 32, "native_mpp": None, "pretrain_magnification": None,
        "precision": "fp32", "params": None, "pretrain_wsi_equivalent": None})


@pytest.fixture
def installed(monkeypatch):
    """Entry points as a package's metadata would declare them: [project.entry-points."cellpath.encoders"]."""
    points = [importlib.metadata.EntryPoint("tiny-vit", "helpers.plugins:build_tiny_vit", ENTRY_POINT_GROUP),
              importlib.metadata.EntryPoint("broken", "helpers.plugins:build_broken", ENTRY_POINT_GROUP)]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: points if kw.get("group") == ENTRY_POINT_GROUP else real(**kw))


def test_a_package_encoder_with_its_own_weights(installed):
    encoder = load_encoder(_row("entry-point:tiny-vit"))
    cls, grid = encoder.forward_tokens(np.zeros((1, 64, 64, 3), dtype=np.uint8))
    assert cls.shape == (1, 32) and grid.shape == (1, 4, 4, 32)
    assert encoder.weights == "built by helpers.plugins:build_tiny_vit"


def test_a_package_encoder_gets_the_checkpoint_cellpath_finds(installed, tmp_path):
    spec = _row("entry-point:tiny-vit", hub_id="hf-hub:someone/my-model")
    (tmp_path / spec.slug).mkdir()
    torch.save(build_tiny_vit(spec, None).state_dict(), tmp_path / spec.slug / "pytorch_model.bin")
    encoder = load_encoder(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
    assert encoder.weights == str(tmp_path / spec.slug / "pytorch_model.bin")
    assert encoder.revision.startswith("sha256:") and encoder.revision.endswith("helpers.plugins:build_tiny_vit")


def test_a_missing_or_failing_entry_point_is_named(installed):
    with pytest.raises(EncoderUnavailable, match=r"no installed package provides the entry point 'absent'"):
        load_encoder(_row("entry-point:absent"))
    with pytest.raises(EncoderLoadError, match=r"entry point helpers.plugins:build_broken failed.*not compiled"):
        load_encoder(_row("entry-point:broken"))


def test_only_rows_whose_checkpoint_cellpath_finds_need_a_weights_file():
    from cellpath.features.encoders.weights import needs_weights_file

    assert not needs_weights_file(_row("entry-point:tiny-vit"))
    assert needs_weights_file(_row("entry-point:tiny-vit", hub_id="hf-hub:someone/my-model"))


def test_the_weights_path_recorded_carries_no_machine_layout(tmp_path, monkeypatch):
    """What a feature sidecar records as ``weights`` travels to remotes: no home folder, no project root."""
    from cellpath.features.encoders.weights import portable_path

    project, home, cache = tmp_path / "project", tmp_path / "home" / "alice", tmp_path / "home" / "alice" / "hub"
    for folder in (project, cache):
        folder.mkdir(parents=True)
    monkeypatch.chdir(project)
    monkeypatch.setenv("HOME", str(home))
    assert portable_path(project / "models" / "uni" / "pytorch_model.bin", cache) == "models/uni/pytorch_model.bin"
    assert portable_path(cache / "models--x--y" / "snapshots" / "abc" / "m.bin", cache) == \
        "<hf cache>/models--x--y/snapshots/abc/m.bin"
    assert portable_path(home / "weights" / "m.bin", cache) == "~/weights/m.bin"
    assert portable_path(Path("/shared/weights/m.bin"), cache) == "/shared/weights/m.bin"
