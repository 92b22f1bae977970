"""The beit3 loader (MUSK): cellpath's BEiT-3 vision path against torchscale's, by a golden case
that torchscale 0.3.0 computed (``golden/make_beit3_golden.py``): the checkpoint's keys, in MUSK's
layout, must load strictly with the language expert left out, and the tokens must be the reference's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cellpath.features.encoders.beit3_format import Beit3Tokens
from cellpath.features.encoders.loading import EncoderLoadError, load_encoder
from cellpath.features.encoders.registry import EncoderSpec, load_registry
from helpers.beit3_golden import golden_input, golden_weights, load_golden
from helpers.project import PROJECT_ROOT


def _row(golden: dict) -> EncoderSpec:
    config = golden["config"]
    return EncoderSpec.model_validate({
        "name": "tiny-musk", "type": "PVL", "architecture": "BEiT-3", "hub_id": "hf-hub:cellpath-test/tiny-musk",
        "revision": "main", "loader": "beit3",
        "checkpoint": {"filename": "model.safetensors", "state_dict_key": "model"},
        "beit3_kwargs": {"depth": config["encoder_layers"], "num_heads": config["encoder_attention_heads"],
                         "ffn_dim": config["encoder_ffn_embed_dim"]},
        "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "input_size": config["img_size"],
        "patch_size": config["patch_size"], "num_prefix_tokens": 1, "has_cls": True,
        "embed_dim": config["encoder_embed_dim"], "native_mpp": None, "pretrain_magnification": None,
        "precision": "fp16", "params": None, "pretrain_wsi_equivalent": None})


def _write_checkpoint(folder, state: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: torch.from_numpy(value) for key, value in state.items()}, folder / "model.safetensors")


def test_the_tokens_are_torchscales_for_musks_checkpoint_layout(tmp_path):
    golden = load_golden()
    spec = _row(golden)
    _write_checkpoint(tmp_path / spec.slug, golden_weights(golden["shapes"]))
    encoder = load_encoder(spec, weights_dir=tmp_path)
    with torch.inference_mode():
        tokens = encoder.module.forward_features(torch.from_numpy(golden_input(spec.input_size)))
    torch.testing.assert_close(tokens, torch.tensor(golden["encoder_out"]), atol=2e-5, rtol=1e-4)
    images = np.random.default_rng(0).integers(0, 256, size=(3, spec.input_size, spec.input_size, 3), dtype=np.uint8)
    cls, grid = encoder.forward_tokens(images)
    assert cls.shape == (3, 32) and grid.shape == (3, 2, 2, 32)


def test_the_language_expert_is_left_out_and_every_vision_key_must_load(tmp_path):
    golden = load_golden()
    spec = _row(golden)
    weights = golden_weights(golden["shapes"])
    vision = [key for key in weights if ".B." not in key and "text_embed" not in key and "head" not in key
              and key not in ("logit_scale", "beit3.vision_embed.mask_token")]
    assert sorted(Beit3Tokens(spec).state_dict()) == sorted(vision)
    missing = dict(weights)
    del missing["beit3.encoder.layers.1.ffn.A.ffn_layernorm.weight"]
    _write_checkpoint(tmp_path / spec.slug, missing)
    with pytest.raises(EncoderLoadError, match=r"1 missing: beit3\.encoder\.layers\.1\.ffn\.A\.ffn_layernorm\.weight"):
        load_encoder(spec, weights_dir=tmp_path)
    _write_checkpoint(tmp_path / spec.slug, weights | {"beit3.encoder.layers.2.self_attn.q_proj.A.weight":
                                                       np.zeros((32, 32), np.float32)})
    with pytest.raises(EncoderLoadError, match=r"unexpected: beit3\.encoder\.layers\.2\.self_attn"):
        load_encoder(spec, weights_dir=tmp_path)


def test_the_musk_row_builds_musks_vision_path_at_384_px():
    musk = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["MUSK"]
    with torch.device("meta"):  # real size without allocating it
        module = Beit3Tokens(musk)
        tokens = module.forward_features(torch.zeros(1, 3, 384, 384))
    assert tokens.shape == (1, 1 + 24 * 24, 1024)
    assert module.beit3.encoder.embed_positions.A.weight.shape == (1 + 24 * 24 + 2, 1024)
    vision_params = sum(p.numel() for p in module.parameters())
    assert 300e6 < vision_params < 310e6  # the vision half of MUSK's 675M (Table 6)
