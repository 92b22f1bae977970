"""Encoders published in the transformers format (Phikon, Phikon-v2, Hibou, PLIP): loaded offline from
checkpoints a test writes in the hub's own layout (config.json + model.safetensors or pytorch_model.bin,
legacy key names as `save_pretrained` writes them), at reduced width and depth."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from transformers import (CLIPConfig, CLIPModel, CLIPVisionModel, Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig,
                          Dinov2WithRegistersModel, ViTConfig, ViTModel)

from cellpath.features.encoders.loading import EncoderLoadError, EncoderUnavailable, load_encoder
from cellpath.features.encoders.registry import EncoderSpec, load_registry
from helpers.project import PROJECT_ROOT

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "image_size": 224}


def _row(name: str, transformers_class: str, *, patch_size: int, prefix: int, **extra) -> EncoderSpec:
    return EncoderSpec.model_validate({
        "name": name, "type": "PV", "architecture": "tiny", "hub_id": f"hf-hub:test/{name}", "revision": "main",
        "loader": "transformers", "transformers_class": transformers_class, "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25], "input_size": 224, "patch_size": patch_size, "num_prefix_tokens": prefix,
        "has_cls": True, "embed_dim": 32, "native_mpp": 0.5, "pretrain_magnification": "20x", "precision": "fp32",
        "params": None, "pretrain_wsi_equivalent": None, **extra})


def _as_pytorch_model_bin(folder) -> None:
    """Rewrite a saved checkpoint as the torch pickle older hub repos hold (same keys)."""
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def _phikon_like(folder, safe=True):
    model = ViTModel(ViTConfig(patch_size=16, **TINY), add_pooling_layer=True)  # the hub file carries the pooler
    model.save_pretrained(folder)
    if not safe:
        _as_pytorch_model_bin(folder)
    return _row("phikon-tiny", "ViTModel", patch_size=16, prefix=1, transformers_kwargs={"add_pooling_layer": False},
                checkpoint={"drop": ["pooler."]})


def _phikon_v2_like(folder):
    Dinov2Model(Dinov2Config(patch_size=16, layerscale_value=1e-5, **TINY)).save_pretrained(folder)
    return _row("phikon-v2-tiny", "Dinov2Model", patch_size=16, prefix=1)


def _hibou_like(folder):
    config = Dinov2WithRegistersConfig(patch_size=14, num_register_tokens=4, use_swiglu_ffn=True, **TINY)
    Dinov2WithRegistersModel(config).save_pretrained(folder)
    return _row("hibou-tiny", "Dinov2WithRegistersModel", patch_size=14, prefix=5)


def _plip_like(folder, safe=False):
    vision = {"patch_size": 32, **TINY}
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    # a whole CLIP checkpoint, text tower included, as a torch pickle: what vinid/plip ships
    CLIPModel(CLIPConfig(vision_config=vision, text_config=text, projection_dim=16)).save_pretrained(folder)
    if not safe:
        _as_pytorch_model_bin(folder)
    return _row("plip-tiny", "CLIPVisionModel", patch_size=32, prefix=1,
                checkpoint={"drop": ["text_model.", "text_projection.", "visual_projection.", "logit_scale"]})


FAMILIES = {"ViTModel": _phikon_like, "Dinov2Model": _phikon_v2_like, "Dinov2WithRegistersModel": _hibou_like,
            "CLIPVisionModel": _plip_like}
REFERENCE = {"ViTModel": (ViTModel, {"add_pooling_layer": False}), "Dinov2Model": (Dinov2Model, {}),
             "Dinov2WithRegistersModel": (Dinov2WithRegistersModel, {}), "CLIPVisionModel": (CLIPVisionModel, {})}


@pytest.fixture(params=sorted(FAMILIES))
def family(request, tmp_path):
    """(transformers class, row, weights_dir) with the checkpoint in ``<weights_dir>/<slug>/``."""
    torch.manual_seed(0)
    name = request.param
    (tmp_path / "models").mkdir()
    row = FAMILIES[name](tmp_path / "scratch")
    (tmp_path / "scratch").rename(tmp_path / "models" / row.slug)
    return name, row, tmp_path / "models"


def _images(n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 224, 224, 3), dtype=np.uint8)


def test_tokens_equal_the_transformers_models_own_and_the_prefix_is_stripped(family):
    name, row, weights_dir = family
    encoder = load_encoder(row, weights_dir=weights_dir)
    cls, grid = encoder.forward_tokens(_images())
    side = 224 // row.patch_size
    assert cls.shape == (2, 32) and grid.shape == (2, side, side, 32)
    model_class, kwargs = REFERENCE[name]
    reference = model_class.from_pretrained(weights_dir / row.slug, local_files_only=True, **kwargs).eval()
    pixels = (torch.from_numpy(_images()).permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.25
    with torch.inference_mode():
        tokens = reference(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(cls, tokens[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grid, tokens[:, row.num_prefix_tokens:].reshape(2, side, side, 32), rtol=1e-5, atol=1e-5)
    assert encoder.revision.startswith("sha256:") and str(weights_dir / row.slug) in encoder.weights


@pytest.mark.parametrize("cell", [(0, 0), (2, 5), (6, 1)])
def test_a_bright_dot_lights_the_token_under_it(family, cell):
    _, row, weights_dir = family
    encoder = load_encoder(row, weights_dir=weights_dir)
    p = row.patch_size
    blank = np.full((1, 224, 224, 3), 128, dtype=np.uint8)
    dotted = blank.copy()
    r, c = cell
    centre_r, centre_c = r * p + p // 2, c * p + p // 2
    dotted[0, centre_r - 1:centre_r + 2, centre_c - 1:centre_c + 2] = 255  # 3×3 px inside token (r, c)
    _, before = encoder.forward_tokens(blank)
    _, after = encoder.forward_tokens(dotted)
    change = (after - before).norm(dim=-1)[0]
    assert divmod(int(change.argmax()), change.shape[1]) == (r, c)


def test_a_pytorch_model_bin_gives_the_tokens_of_the_same_weights_as_safetensors(tmp_path):
    torch.manual_seed(1)
    row = _phikon_like(tmp_path / "safe" / "phikon-tiny")
    safe_tokens = load_encoder(row, weights_dir=tmp_path / "safe").forward_tokens(_images(1))
    shutil.copytree(tmp_path / "safe", tmp_path / "pickle")
    _as_pytorch_model_bin(tmp_path / "pickle" / "phikon-tiny")
    encoder = load_encoder(row, weights_dir=tmp_path / "pickle")
    assert encoder.weights.endswith("pytorch_model.bin")
    for ours, theirs in zip(encoder.forward_tokens(_images(1)), safe_tokens):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_a_config_disagreeing_with_the_row_names_the_field(tmp_path):
    row = _phikon_v2_like(tmp_path / "models" / "phikon-v2-tiny")
    wrong = row.model_copy(update={"embed_dim": 64})
    with pytest.raises(EncoderLoadError, match=r"config.json.*hidden_size = 32.*embed_dim = 64"):
        load_encoder(wrong, weights_dir=tmp_path / "models")
    registers = row.model_copy(update={"num_prefix_tokens": 5})
    with pytest.raises(EncoderLoadError, match=r"num_prefix_tokens = 5"):
        load_encoder(registers, weights_dir=tmp_path / "models")


def test_a_checkpoint_key_the_row_does_not_drop_is_an_error(tmp_path):
    row = _phikon_like(tmp_path / "models" / "phikon-tiny")
    keeps_pooler = row.model_copy(update={"checkpoint": row.checkpoint.model_copy(update={"drop": ()})})
    with pytest.raises(EncoderLoadError, match=r"unexpected.*pooler\.dense"):
        load_encoder(keeps_pooler, weights_dir=tmp_path / "models")


def test_a_checkpoint_missing_weights_is_an_error_naming_them(tmp_path):
    from safetensors.torch import load_file, save_file

    row = _hibou_like(tmp_path / "models" / "hibou-tiny")
    path = tmp_path / "models" / "hibou-tiny" / "model.safetensors"
    state = load_file(path)
    del state["embeddings.register_tokens"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(EncoderLoadError, match=r"missing.*register_tokens"):
        load_encoder(row, weights_dir=tmp_path / "models")


def test_registry_rows_of_the_transformers_models_need_their_checkpoint(tmp_path):
    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    rows = [spec for spec in registry.values() if spec.loader == "transformers"]
    assert sorted(spec.name for spec in rows) == ["Hibou-B", "Hibou-L", "PLIP", "Phikon", "Phikon-v2"]
    for spec in rows:
        with pytest.raises(EncoderUnavailable, match=rf"{spec.name}: no weights found.*config\.json"):
            load_encoder(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
