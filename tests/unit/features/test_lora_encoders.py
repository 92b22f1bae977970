"""timm rows with ``lora`` (SEAL): a checkpoint of SEAL's training module — the encoder wrapped by
peft's LoRA under ``encoder.base_model.model.``, a decoder beside it — loads strictly, and the
adapters are merged as W = W₀ + (alpha / r)·B·A, computed here by hand (not by peft)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from cellpath.features.encoders.loading import (EncoderLoadError, build_timm_module, images_to_tensor, load_encoder,
                                                weights_revision)
from cellpath.features.encoders.lora_format import wrap_for_lora_checkpoint
from cellpath.features.encoders.registry import EncoderSpec, RegistryError, load_registry, parse_rows
from cellpath.features.encoders.weights import find_weights
from helpers.project import PROJECT_ROOT

PREFIX = "encoder.base_model.model."
TARGETS = ("blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.1.mlp.fc1", "blocks.1.mlp.fc2")  # SEAL: last block
RANK, ALPHA = 4, 16.0  # scale alpha / r = 4: a merge that ignored it would differ


def _base_row(**overrides) -> dict:
    row = {
        "name": "tiny-base", "type": "PV", "architecture": "ViT-tiny/14", "hub_id": "hf-hub:cellpath-test/tiny-base",
        "revision": "main", "loader": "timm", "timm_model": "vit_small_patch14_dinov2",
        "timm_kwargs": {"img_size": 224, "embed_dim": 32, "depth": 2, "num_heads": 2, "init_values": 1e-5},
        "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "input_size": 224, "patch_size": 14,
        "num_prefix_tokens": 1, "has_cls": True, "embed_dim": 32, "native_mpp": None, "pretrain_magnification": None,
        "precision": "fp32", "params": None, "pretrain_wsi_equivalent": None}
    return row | overrides


def _seal_row(**lora) -> dict:
    return _base_row(name="tiny-seal", type="PVO", hub_id="hf-hub:cellpath-test/tiny-seal",
                     checkpoint={"filename": "seal_tiny_vision.pth", "state_dict_key": "state_dict",
                                 "keep_prefix": PREFIX}, lora={"alpha": ALPHA} | lora)


def _registry(**lora) -> dict[str, EncoderSpec]:
    return parse_rows([_base_row(), _seal_row(**lora)])


def _adapters(base: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    modules = dict(base.named_modules())
    return {name: (torch.randn(RANK, modules[name].in_features, generator=generator) * 0.1,
                   torch.randn(modules[name].out_features, RANK, generator=generator) * 0.1) for name in TARGETS}


def _seal_file(base_state: dict, adapters: dict, *, with_base: bool = True) -> dict:
    """SEAL's saved PatchRecEncoder: {"state_dict": {encoder.base_model.model.…, decoder.…}}."""
    state = {}
    for key, value in base_state.items():
        module, _, leaf = key.rpartition(".")
        if module in adapters:
            state[f"{PREFIX}{module}.base_layer.{leaf}"] = value
        elif with_base:
            state[PREFIX + key] = value
    for name, (a, b) in adapters.items():
        state[f"{PREFIX}{name}.lora_A.default.weight"] = a
        state[f"{PREFIX}{name}.lora_B.default.weight"] = b
    if not with_base:  # only what training changed: the adapters
        state = {key: value for key, value in state.items() if ".lora_" in key}
    state |= {"decoder.decoder.0.weight": torch.zeros(8, 32), "decoder.decoder.3.weight": torch.zeros(5, 8)}
    return {"state_dict": state, "epoch": 10}


def _merged_by_hand(spec: EncoderSpec, base_state: dict, adapters: dict) -> nn.Module:
    merged = dict(base_state)
    for name, (a, b) in adapters.items():
        merged[f"{name}.weight"] = base_state[f"{name}.weight"] + (ALPHA / RANK) * b @ a
    module = build_timm_module(spec)
    module.load_state_dict(merged, strict=True)
    return module.eval()


def _images() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, size=(2, 224, 224, 3), dtype=np.uint8)


def _base(spec: EncoderSpec) -> tuple[nn.Module, dict]:
    torch.manual_seed(11)
    base = build_timm_module(spec)
    return base, base.state_dict()


def test_a_seal_checkpoint_loads_strictly_and_its_adapters_are_merged(tmp_path):
    spec = _registry()["tiny-seal"]
    base, base_state = _base(spec)
    adapters = _adapters(base)
    (tmp_path / spec.slug).mkdir()
    torch.save(_seal_file(base_state, adapters), tmp_path / spec.slug / "seal_tiny_vision.pth")
    encoder = load_encoder(spec, weights_dir=tmp_path)
    assert type(encoder.module.blocks[1].attn.qkv) is nn.Linear  # merged: no LoRA layer left
    assert encoder.revision == find_weights(spec, weights_dir=tmp_path).revision  # a complete file: its own
    expected = _merged_by_hand(spec, base_state, adapters)
    torch.testing.assert_close(encoder.module.blocks[1].mlp.fc1.weight, expected.blocks[1].mlp.fc1.weight)
    with torch.inference_mode():
        reference = expected.forward_features(images_to_tensor(_images(), spec, torch.device("cpu")))
    cls, grid = encoder.forward_tokens(_images())
    torch.testing.assert_close(grid, reference[:, 1:].reshape(2, 16, 16, 32))
    torch.testing.assert_close(cls, reference[:, 0])
    assert not torch.allclose(reference, base.eval().forward_features(
        images_to_tensor(_images(), spec, torch.device("cpu"))))  # the adapters change the tokens


def test_a_file_of_adapters_only_takes_the_rest_from_the_base_rows_checkpoint(tmp_path):
    from safetensors.torch import save_file

    registry = _registry(base="tiny-base")
    spec, base_spec = registry["tiny-seal"], registry["tiny-base"]
    base, base_state = _base(spec)
    adapters = _adapters(base)
    (tmp_path / spec.slug).mkdir()
    torch.save(_seal_file(base_state, adapters, with_base=False), tmp_path / spec.slug / "seal_tiny_vision.pth")
    (tmp_path / base_spec.slug).mkdir()
    save_file(base_state, tmp_path / base_spec.slug / "model.safetensors")
    encoder = load_encoder(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
    found = find_weights(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
    base_found = find_weights(base_spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
    assert encoder.revision == f"{found.revision};base tiny-base={base_found.revision}"  # both files' identity
    assert weights_revision(spec, found, tmp_path, tmp_path / "hub") == encoder.revision  # what extract expects
    expected = _merged_by_hand(spec, base_state, adapters)
    for name in TARGETS:
        torch.testing.assert_close(encoder.module.get_submodule(name).weight, expected.get_submodule(name).weight)
    without_base = _registry()["tiny-seal"]
    with pytest.raises(EncoderLoadError, match=r"holds only part.*names no lora\.base"):
        load_encoder(without_base, weights_dir=tmp_path)


def test_a_file_without_lora_weights_or_with_unknown_modules_is_named(tmp_path):
    spec = _registry()["tiny-seal"]
    base, base_state = _base(spec)
    (tmp_path / spec.slug).mkdir()
    path = tmp_path / spec.slug / "seal_tiny_vision.pth"
    torch.save({"state_dict": {PREFIX + k: v for k, v in base_state.items()}}, path)
    with pytest.raises(EncoderLoadError, match=r"holds no LoRA weights.*lora_A\.default\.weight"):
        load_encoder(spec, weights_dir=tmp_path)
    state = _seal_file(base_state, _adapters(base))
    state["state_dict"][f"{PREFIX}blocks.1.attn.qkv.lora_A.default.weight"] = torch.zeros(RANK, 33)
    torch.save(state, path)
    with pytest.raises(EncoderLoadError, match=r"misshapen.*blocks\.1\.attn\.qkv\.lora_A\.default\.weight"):
        load_encoder(spec, weights_dir=tmp_path)


def test_lora_base_must_name_a_timm_row_of_the_same_architecture():
    with pytest.raises(RegistryError, match=r"'lora\.base'.*'nowhere' is not a registry name"):
        _registry(base="nowhere")
    other = _base_row(timm_model="vit_small_patch14_reg4_dinov2", num_prefix_tokens=5)
    with pytest.raises(RegistryError, match=r"must be a timm row of the same timm_model"):
        parse_rows([other, _seal_row(base="tiny-base")])
    with pytest.raises(RegistryError, match=r"base_row is filled in from lora\.base"):
        parse_rows([_base_row(), _seal_row(base="tiny-base", base_row=_base_row())])
    with pytest.raises(RegistryError, match=r"lora is read into a timm architecture"):
        parse_rows([_base_row(loader="open_clip", timm_model=None, timm_kwargs={}, open_clip_model="coca_ViT-L-14",
                              lora={"alpha": 8})])


@pytest.mark.parametrize("name, base, target, grid", [("SEAL (UNI2)", "UNI2", "blocks.23.attn.qkv", 16),
                                                       ("SEAL (CONCH)", "CONCH", "blocks.11.mlp.fc2", 14)])
def test_the_seal_rows_adapt_their_base_models_last_block(name, base, target, grid):
    row = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")[name]
    assert (row.lora.base, row.lora.base_row.name, row.lora.alpha, row.hub_repo) == (base, base, 8, "MahmoodLab/SEAL")
    assert row.grid_size == grid
    with torch.device("meta"):  # real size without allocating it
        module = build_timm_module(row)
        out_features, in_features = module.get_submodule(target).weight.shape
        state = {f"{target}.lora_A.default.weight": torch.zeros(8, in_features),
                 f"{target}.lora_B.default.weight": torch.zeros(out_features, 8)}
        wrapped, keyed = wrap_for_lora_checkpoint(module, state, row, PROJECT_ROOT / "x.pth", None)
    assert f"model.{target}.base_layer.weight" in wrapped.state_dict() and set(keyed) <= set(wrapped.state_dict())
