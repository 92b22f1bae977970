"""timm rows whose published checkpoint is not a bare model.safetensors: GPFM's wrapped GPFM.pth, a
checkpoint with keys to drop, and Kaiko ViT-L/14's 37×37 position embeddings fed 224 px."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cellpath.features.encoders.loading import (EncoderLoadError, EncoderUnavailable, build_timm_module,
                                                images_to_tensor, load_encoder)
from cellpath.features.encoders.registry import EncoderSpec, load_registry
from helpers.hub_cache import COMMIT, hub_snapshot
from helpers.project import PROJECT_ROOT



def _row(**overrides) -> EncoderSpec:
    """A 2-block DINOv2-style ViT/14 at 224 px (16×16 grid), width 32."""
    row = {
        "name": "tiny-dinov2", "type": "PV", "architecture": "ViT-tiny/14",
        "hub_id": "hf-hub:cellpath-test/tiny-dinov2", "revision": "main", "loader": "timm",
        "timm_model": "vit_small_patch14_dinov2",
        "timm_kwargs": {"img_size": 224, "embed_dim": 32, "depth": 2, "num_heads": 2, "init_values": 1e-5},
        "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "input_size": 224, "patch_size": 14,
        "num_prefix_tokens": 1, "has_cls": True, "embed_dim": 32, "native_mpp": None, "pretrain_magnification": None,
        "precision": "fp32", "params": None, "pretrain_wsi_equivalent": None}
    row.update(overrides)
    return EncoderSpec.model_validate(row)


def _images(n: int = 2) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, size=(n, 224, 224, 3), dtype=np.uint8)


def _tokens(module, spec, images):
    with torch.inference_mode():
        return module.eval().forward_features(images_to_tensor(images, spec, torch.device("cpu")))


def test_the_gpfm_row_is_a_timm_dinov2_vit_reading_gpfm_pth():
    gpfm = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["GPFM"]
    assert (gpfm.loader, gpfm.timm_model, gpfm.checkpoint.filename) == ("timm", "vit_large_patch14_dinov2", "GPFM.pth")
    module = build_timm_module(gpfm)
    assert module.pos_embed.shape == (1, 1 + 16 * 16, 1024) and module.num_prefix_tokens == 1


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_named_pth_file_wrapped_in_a_state_dict_entry_loads_strictly(tmp_path, wrapped):
    spec = _row(checkpoint={"filename": "GPFM.pth", "state_dict_key": "state_dict"})
    torch.manual_seed(0)
    original = build_timm_module(spec)
    folder = tmp_path / spec.slug
    folder.mkdir()
    state = original.state_dict()
    torch.save({"state_dict": state, "epoch": 3} if wrapped else state, folder / "GPFM.pth")
    encoder = load_encoder(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
    assert encoder.weights.endswith("GPFM.pth")
    cls, grid = encoder.forward_tokens(_images())
    expected = _tokens(original, spec, _images())
    torch.testing.assert_close(grid, expected[:, 1:].reshape(2, 16, 16, 32))
    torch.testing.assert_close(cls, expected[:, 0])


def _dinov2_training_checkpoint(state: dict) -> dict:
    """A DINOv2 training checkpoint of ``state`` (a 2-block ViT): the teacher's backbone under
    ``backbone.``, one block per chunk (``blocks.<chunk>.<i>.``), with the mask token, DINO and iBOT
    heads and a student beside it, as GPFM's GitHub release stores it."""
    def chunked(key: str) -> str:
        parts = key.split(".")
        return ".".join([parts[0], parts[1], *parts[1:]]) if parts[0] == "blocks" else key

    teacher = {f"backbone.{chunked(k)}": v for k, v in state.items()}
    heads = {"backbone.mask_token": torch.zeros(1, 32), "dino_head.mlp.0.weight": torch.randn(64, 32),
             "dino_head.last_layer.weight_v": torch.randn(128, 32), "ibot_head.mlp.0.weight": torch.randn(64, 32)}
    return {"teacher": teacher | heads, "student": {k: v + 1 for k, v in (teacher | heads).items()}, "iteration": 7}


def test_gpfms_training_checkpoint_loads_from_its_teacher(tmp_path):
    spec = _row(checkpoint={"filename": "GPFM.pth", "state_dict_key": "state_dict", "dinov2_teacher": True})
    torch.manual_seed(0)
    original = build_timm_module(spec)
    training = _dinov2_training_checkpoint(original.state_dict())
    assert "backbone.blocks.1.1.norm1.weight" in training["teacher"]
    (tmp_path / spec.slug).mkdir()
    torch.save(training, tmp_path / spec.slug / "GPFM.pth")
    encoder = load_encoder(spec, weights_dir=tmp_path)
    cls, grid = encoder.forward_tokens(_images())
    expected = _tokens(original, spec, _images())  # the teacher's weights, not the student's
    torch.testing.assert_close(grid, expected[:, 1:].reshape(2, 16, 16, 32))
    torch.testing.assert_close(cls, expected[:, 0])
    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    assert registry["GPFM"].checkpoint.dinov2_teacher
    assert not any(spec.checkpoint.dinov2_teacher for name, spec in registry.items() if name != "GPFM")


def test_a_training_checkpoint_for_a_row_that_reads_released_weights_names_the_file(tmp_path):
    spec = _row(checkpoint={"filename": "GPFM.pth", "state_dict_key": "state_dict"})
    (tmp_path / spec.slug).mkdir()
    torch.save(_dinov2_training_checkpoint(build_timm_module(spec).state_dict()), tmp_path / spec.slug / "GPFM.pth")
    with pytest.raises(EncoderLoadError, match=r"is a training checkpoint \(top-level 'teacher'\), not the released "
                                               r"weights the row reads; use GPFM\.pth from cellpath-test/tiny-dinov2"):
        load_encoder(spec, weights_dir=tmp_path)


def test_a_wrapped_file_without_the_named_entry_names_what_it_has(tmp_path):
    spec = _row(checkpoint={"filename": "GPFM.pth", "state_dict_key": "state_dict"})
    (tmp_path / spec.slug).mkdir()
    torch.save({"model": build_timm_module(spec).state_dict(), "epoch": 3}, tmp_path / spec.slug / "GPFM.pth")
    with pytest.raises(EncoderLoadError, match=r"no 'state_dict' entry.*top-level keys: model, epoch"):
        load_encoder(spec, weights_dir=tmp_path)


def test_without_the_named_file_the_message_names_it(tmp_path):
    spec = _row(checkpoint={"filename": "GPFM.pth"})
    (tmp_path / spec.slug).mkdir()
    save_file(build_timm_module(spec).state_dict(), tmp_path / spec.slug / "model.safetensors")  # not the row's file
    with pytest.raises(EncoderUnavailable, match=r"Looked for GPFM\.pth in"):
        load_encoder(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")


def test_dropped_keys_are_left_out_and_others_still_load_strictly(tmp_path):
    spec = _row(checkpoint={"drop": ["attn_mask", "head."]})
    folder = tmp_path / spec.slug
    folder.mkdir()
    state = build_timm_module(spec).state_dict() | {"attn_mask": torch.zeros(4, 4), "head.weight": torch.zeros(2, 32)}
    save_file(state, folder / "model.safetensors")
    load_encoder(spec, weights_dir=tmp_path)
    save_file(state | {"extra.weight": torch.zeros(1)}, folder / "model.safetensors")
    with pytest.raises(EncoderLoadError, match=r"unexpected: extra\.weight"):
        load_encoder(spec, weights_dir=tmp_path)


def test_position_embeddings_of_a_larger_grid_are_resampled_to_the_input(tmp_path):
    # Kaiko ViT-L/14: a 37×37 pos_embed (img_size 518) fed 224 px patches with dynamic_img_size.
    spec = _row(timm_model="vit_small_patch14_reg4_dinov2", num_prefix_tokens=5,
                timm_kwargs={"img_size": 518, "embed_dim": 32, "depth": 2, "num_heads": 2, "dynamic_img_size": True})
    torch.manual_seed(2)
    original = build_timm_module(spec)
    assert original.pos_embed.shape[1] == 37 * 37
    (tmp_path / spec.slug).mkdir()
    save_file(original.state_dict(), tmp_path / spec.slug / "model.safetensors")
    encoder = load_encoder(spec, weights_dir=tmp_path)
    cls, grid = encoder.forward_tokens(_images())
    assert grid.shape == (2, 16, 16, 32)
    torch.testing.assert_close(grid, _tokens(original, spec, _images())[:, 5:].reshape(2, 16, 16, 32))
    blank = np.full((1, 224, 224, 3), 128, dtype=np.uint8)
    dotted = blank.copy()
    dotted[0, 3 * 14 + 6:3 * 14 + 9, 11 * 14 + 6:11 * 14 + 9] = 255  # inside token (3, 11)
    change = (encoder.forward_tokens(dotted)[1] - encoder.forward_tokens(blank)[1]).norm(dim=-1)[0]
    assert divmod(int(change.argmax()), 16) == (3, 11)


def test_img_size_may_differ_from_the_input_only_where_position_embeddings_are_resampled():
    with pytest.raises(ValueError, match="timm_kwargs.img_size = 518 disagrees with input_size = 224"):
        _row(timm_kwargs={"img_size": 518, "embed_dim": 32, "depth": 2, "num_heads": 2})


def _hub_snapshot(cache, spec, state, config):
    snapshot = hub_snapshot(cache, spec.hub_repo)
    save_file(state, snapshot / "model.safetensors")
    (snapshot / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("source", ["hub-config", "model-card"])
def test_a_kaiko_port_whose_hub_config_carries_imagenet_mean_std_loads_with_the_cards(tmp_path, source):
    """The community ports of the Kaiko models may carry ImageNet mean/std in config.json: the weights
    load with the card's 0.5 (the row's); a row whose mean/std follow the hub config warns, printing
    both, and a row recorded as following the card (mean_std_source: model-card) does not."""
    spec = _row(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5], mean_std_source=source)
    original = build_timm_module(spec)
    _hub_snapshot(tmp_path / "hub", spec, original.state_dict(), {
        "architecture": "vit_small_patch14_dinov2", "model_args": {"depth": 2},
        "pretrained_cfg": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}})
    encoder = load_encoder(spec, weights_dir=tmp_path / "none", hf_cache_dir=tmp_path / "hub")
    assert encoder.revision == COMMIT
    if source == "hub-config":
        assert [w.split("disagrees with models/encoders.yaml: ")[1].split(".")[0] for w in encoder.warnings] == [
            "pretrained_cfg", "pretrained_cfg"]
        assert "pretrained_cfg.mean [0.485, 0.456, 0.406] vs mean [0.5, 0.5, 0.5]" in encoder.warnings[0]
        assert "pretrained_cfg.std [0.229, 0.224, 0.225] vs std [0.5, 0.5, 0.5]" in encoder.warnings[1]
    else:
        assert encoder.warnings == ()
    cls, grid = encoder.forward_tokens(_images())
    expected = _tokens(original, spec, _images())  # normalised with the row's (the card's) 0.5
    torch.testing.assert_close(grid, expected[:, 1:].reshape(2, 16, 16, 32))


def test_a_wrong_mlp_ratio_is_named_by_the_strict_load(tmp_path):
    # H0-mini's mlp_ratio (5.33334) is confirmed only by its checkpoint: the error must say which field.
    spec = _row(timm_kwargs={"img_size": 224, "embed_dim": 32, "depth": 2, "num_heads": 2, "init_values": 1e-5,
                             "mlp_ratio": 4.0})
    (tmp_path / spec.slug).mkdir()
    other = _row(timm_kwargs=spec.timm_kwargs | {"mlp_ratio": 5.0})
    save_file(build_timm_module(other).state_dict(), tmp_path / spec.slug / "model.safetensors")
    with pytest.raises(EncoderLoadError, match=r"misshapen.*mlp\.fc1\.weight \(160, 32\) vs \(128, 32\).*mlp_ratio"):
        load_encoder(spec, weights_dir=tmp_path)


def test_conch_rows_read_the_trunk_of_their_checkpoints_at_their_cards_field():
    # CONCH: 448 px (its eval transform); CONCH v1.5: 512 px, the 256 µm tile at 20x that its pipeline
    # (TRIDENT: --patch_size 512 --mag 20) resizes to 448 — Table 6's input size.
    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    conch, conch15 = registry["CONCH"], registry["CONCH v1.5"]
    assert (conch.input_size, conch.paper_input_size, conch.checkpoint.keep_prefix) == (448, 224, "visual.trunk.")
    assert (conch15.input_size, conch15.paper_input_size, conch15.checkpoint.filename) == (
        512, None, "pytorch_model_vision.bin")
    assert build_timm_module(conch).pos_embed.shape == (1, 1 + 28 * 28, 768)
    assert conch.timm_kwargs["dynamic_img_size"] and conch15.timm_kwargs["dynamic_img_size"]


def test_a_trunk_under_a_prefix_loads_with_its_towers_left_out(tmp_path):
    # CONCH: a whole CoCa checkpoint; the encoder is the timm trunk under visual.trunk.
    spec = _row(checkpoint={"keep_prefix": "visual.trunk."})
    torch.manual_seed(4)
    trunk = build_timm_module(spec)
    coca = {f"visual.trunk.{k}": v for k, v in trunk.state_dict().items()} | {
        "visual.attn_pool_contrast.attn.in_proj_weight": torch.zeros(96, 32), "text.token_embedding.weight":
        torch.zeros(10, 32), "logit_scale": torch.zeros(())}
    (tmp_path / spec.slug).mkdir()
    torch.save(coca, tmp_path / spec.slug / "pytorch_model.bin")
    grid = load_encoder(spec, weights_dir=tmp_path).forward_tokens(_images())[1]
    torch.testing.assert_close(grid, _tokens(trunk, spec, _images())[:, 1:].reshape(2, 16, 16, 32))
    torch.save({"trunk.cls_token": torch.zeros(1, 1, 32)}, tmp_path / spec.slug / "pytorch_model.bin")
    with pytest.raises(EncoderLoadError, match=r"no key under 'visual\.trunk\.'.*first keys: trunk\.cls_token"):
        load_encoder(spec, weights_dir=tmp_path)


def test_position_embeddings_of_another_grid_are_resampled_before_the_strict_load(tmp_path):
    # CONCH v1.5: the checkpoint's pos_embed is resampled to the model's grid, bilinearly, then loaded.
    import timm

    spec = _row(checkpoint={"keep_prefix": "trunk.", "resample_pos_embed": True},
                timm_kwargs={"img_size": 224, "embed_dim": 32, "depth": 2, "num_heads": 2, "dynamic_img_size": True})
    torch.manual_seed(5)
    larger = build_timm_module(_row(timm_kwargs=spec.timm_kwargs | {"img_size": 448}))  # a 32x32 grid
    state = larger.state_dict()
    (tmp_path / spec.slug).mkdir()
    torch.save({f"trunk.{k}": v for k, v in state.items()}, tmp_path / spec.slug / "pytorch_model.bin")
    encoder = load_encoder(spec, weights_dir=tmp_path)
    expected = timm.layers.resample_abs_pos_embed(state["pos_embed"], new_size=(16, 16), num_prefix_tokens=1,
                                                  interpolation="bilinear", antialias=False)
    torch.testing.assert_close(encoder.module.pos_embed.detach(), expected)
    without = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"resample_pos_embed": False})})
    with pytest.raises(EncoderLoadError, match=r"pos_embed \(1, 1025, 32\) vs \(1, 257, 32\).*img_size"):
        load_encoder(without, weights_dir=tmp_path)


def _old_timm_swin_layout(state: dict) -> dict:
    """A timm ≥ 0.9 Swin state dict in the layout of timm 0.5 (CTransPath's): each stage's downsample
    at the end of the stage before, the relative-position index and attention masks stored."""
    import re

    old = {re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", k): v
           for k, v in state.items()}
    old |= {"layers.0.blocks.1.attn_mask": torch.zeros(64, 49, 49),
            "layers.0.blocks.0.attn.relative_position_index": torch.zeros(49, 49, dtype=torch.long),
            "head.weight": torch.zeros(1000, 768), "head.bias": torch.zeros(1000)}
    return old


def test_ctranspath_loads_chiefs_checkpoint_in_the_old_timm_layout_from_a_dataset_repo(tmp_path):
    spec = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["CTransPath (CHIEF)"]
    assert (spec.hub_repo, spec.checkpoint.repo_type) == ("MahmoodLab/hest-bench", "dataset")
    torch.manual_seed(6)
    original = build_timm_module(spec)
    torch.nn.init.normal_(original.patch_embed.proj[1].running_mean)  # BatchNorm statistics must load too
    # the HF cache layout of a dataset repo file in a subfolder: datasets--org--name/snapshots/<commit>/fm_v1/...
    snapshot = hub_snapshot(tmp_path / "hub", "MahmoodLab/hest-bench", repo_type="dataset")
    target = snapshot / "fm_v1" / "ctranspath" / "CHIEF_CTransPath.pth"
    target.parent.mkdir(parents=True)
    torch.save({"model": _old_timm_swin_layout(original.state_dict())}, target)
    encoder = load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hub")
    assert encoder.revision == COMMIT
    cls, grid = encoder.forward_tokens(_images())
    assert cls is None and grid.shape == (2, 7, 7, 768)
    torch.testing.assert_close(grid, _tokens(original, spec, _images()))
    blank = np.full((1, 224, 224, 3), 128, dtype=np.uint8)
    dotted = blank.copy()
    dotted[0, 2 * 32 + 12:2 * 32 + 20, 5 * 32 + 12:5 * 32 + 20] = 255  # inside token (2, 5)
    change = (encoder.forward_tokens(dotted)[1] - encoder.forward_tokens(blank)[1]).norm(dim=-1)[0]
    assert divmod(int(change.argmax()), 7) == (2, 5)


def test_without_ctranspaths_file_the_message_says_how_to_download_it(tmp_path):
    spec = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["CTransPath (CHIEF)"]
    with pytest.raises(EncoderUnavailable, match=r"hf download MahmoodLab/hest-bench fm_v1/ctranspath/CHIEF_CTransPath"
                                                 r"\.pth --repo-type dataset.*as CHIEF_CTransPath\.pth"):
        load_encoder(spec, weights_dir=tmp_path, hf_cache_dir=tmp_path / "hub")
