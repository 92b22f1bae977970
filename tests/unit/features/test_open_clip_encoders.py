"""open_clip rows (OmiCLIP, a CoCa ViT-L/14): the vision tower of an open_clip checkpoint, tokens read
before CoCa's attentional pooler. A reduced CoCa is registered through open_clip's own add_model_config."""

from __future__ import annotations

import json

import numpy as np
import open_clip
import pytest
import torch

from cellpath.features.encoders.loading import EncoderLoadError, load_encoder
from cellpath.features.encoders.registry import EncoderSpec, load_registry
from helpers.project import PROJECT_ROOT

TINY_COCA = {"embed_dim": 16,
             "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 16, "patch_size": 14,
                            "attentional_pool": True, "attn_pooler_heads": 2, "output_tokens": True},
             "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 32, "heads": 2, "layers": 1,
                          "embed_cls": True, "output_tokens": True},
             "multimodal_cfg": {"context_length": 16, "vocab_size": 100, "width": 32, "heads": 2, "layers": 1,
                                "attn_pooler_heads": 2},
             "custom_text": True}


@pytest.fixture(scope="module")
def tiny_coca(tmp_path_factory):
    folder = tmp_path_factory.mktemp("open_clip_configs")
    (folder / "cellpath_tiny_coca.json").write_text(json.dumps(TINY_COCA))
    open_clip.add_model_config(folder / "cellpath_tiny_coca.json")
    torch.manual_seed(0)
    return open_clip.create_model("cellpath_tiny_coca", pretrained=None).eval()


def _row(**checkpoint) -> EncoderSpec:
    return EncoderSpec.model_validate({
        "name": "tiny-coca", "type": "PVO", "architecture": "CoCa-tiny/14", "hub_id": "hf-hub:test/tiny-coca",
        "revision": "main", "loader": "open_clip", "open_clip_model": "cellpath_tiny_coca",
        "checkpoint": {"filename": "checkpoint.pt", "state_dict_key": "state_dict", "keep_prefix": "visual.",
                       **checkpoint},
        "mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711],
        "input_size": 224, "patch_size": 14, "num_prefix_tokens": 1, "has_cls": True, "embed_dim": 32,
        "native_mpp": None, "pretrain_magnification": None, "precision": "fp32", "params": None,
        "pretrain_wsi_equivalent": None})


def _images(n=2):
    return np.random.default_rng(7).integers(0, 256, size=(n, 224, 224, 3), dtype=np.uint8)


def test_tokens_are_the_towers_transformer_output_before_the_pool(tiny_coca, tmp_path):
    spec = _row()
    (tmp_path / spec.slug).mkdir()
    torch.save({"state_dict": tiny_coca.state_dict(), "epoch": 9}, tmp_path / spec.slug / "checkpoint.pt")
    encoder = load_encoder(spec, weights_dir=tmp_path)
    cls, grid = encoder.forward_tokens(_images())
    assert cls.shape == (2, 32) and grid.shape == (2, 16, 16, 32)
    visual = tiny_coca.visual
    mean, std = torch.tensor(spec.mean).view(1, 3, 1, 1), torch.tensor(spec.std).view(1, 3, 1, 1)
    pixels = (torch.from_numpy(_images()).permute(0, 3, 1, 2).float() / 255 - mean) / std
    with torch.inference_mode():
        reference = visual.transformer(visual._embeds(pixels))  # open_clip's own embedding path
    torch.testing.assert_close(cls, reference[:, 0])
    torch.testing.assert_close(grid, reference[:, 1:].reshape(2, 16, 16, 32))
    blank = np.full((1, 224, 224, 3), 128, dtype=np.uint8)
    dotted = blank.copy()
    dotted[0, 5 * 14 + 5:5 * 14 + 9, 12 * 14 + 5:12 * 14 + 9] = 255  # inside token (5, 12)
    change = (encoder.forward_tokens(dotted)[1] - encoder.forward_tokens(blank)[1]).norm(dim=-1)[0]
    assert divmod(int(change.argmax()), 16) == (5, 12)


def test_a_checkpoint_saved_from_dataparallel_loads(tiny_coca, tmp_path):
    """OmiCLIP's checkpoint.pt may hold a DataParallel model's keys (``module.visual.…``): read without
    the prefix, as open_clip's own loader reads them."""
    spec = _row()
    (tmp_path / spec.slug).mkdir()
    ddp = {f"module.{k}": v for k, v in tiny_coca.state_dict().items()}
    torch.save({"state_dict": ddp, "epoch": 9}, tmp_path / spec.slug / "checkpoint.pt")
    plain = tmp_path / "plain"
    (plain / spec.slug).mkdir(parents=True)
    torch.save({"state_dict": tiny_coca.state_dict()}, plain / spec.slug / "checkpoint.pt")
    cls, grid = load_encoder(spec, weights_dir=tmp_path).forward_tokens(_images())
    expected_cls, expected_grid = load_encoder(spec, weights_dir=plain).forward_tokens(_images())
    torch.testing.assert_close(cls, expected_cls, rtol=0, atol=0)
    torch.testing.assert_close(grid, expected_grid, rtol=0, atol=0)


def test_a_checkpoint_whose_keys_are_not_under_visual_is_named(tiny_coca, tmp_path):
    spec = _row()
    (tmp_path / spec.slug).mkdir()
    other = {f"model.{k}": v for k, v in tiny_coca.state_dict().items()}
    torch.save({"state_dict": other}, tmp_path / spec.slug / "checkpoint.pt")
    with pytest.raises(EncoderLoadError, match=r"no key under 'visual\.'.*model\."):
        load_encoder(spec, weights_dir=tmp_path)


def test_the_omiclip_row_names_an_open_clip_model():
    spec = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["OmiCLIP"]
    assert spec.loader == "open_clip" and spec.open_clip_model in open_clip.list_models()
    config = open_clip.get_model_config(spec.open_clip_model)["vision_cfg"]
    assert (config["image_size"], config["patch_size"], config["width"]) == (spec.input_size, spec.patch_size,
                                                                             spec.embed_dim)
