"""`cellpath encoders list` and `cellpath encoders check`: every row with its weights' whereabouts, and
a check that passes a working encoder and fails a wrong grid, a wrong row or missing weights."""

from __future__ import annotations

import json

import torch
import yaml
from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

from cellpath.cli import main
from cellpath.features.encoders.check import check_encoder
from cellpath.features.encoders.loading import Encoder
from cellpath.features.encoders.registry import EncoderSpec, load_registry
from helpers.project import PROJECT_ROOT

TINY_HIBOU = {
    "name": "tiny-hibou", "type": "PV", "architecture": "ViT-tiny/14", "hub_id": "hf-hub:cellpath-test/tiny-hibou",
    "revision": "main", "loader": "transformers", "transformers_class": "Dinov2WithRegistersModel",
    "mean": [0.7068, 0.5755, 0.722], "std": [0.195, 0.2316, 0.1816], "input_size": 224, "patch_size": 14,
    "num_prefix_tokens": 5, "has_cls": True, "embed_dim": 32, "native_mpp": None, "pretrain_magnification": None,
    "precision": "fp32", "params": None, "pretrain_wsi_equivalent": None}


def _project(tmp_path, rows: list[dict]):
    """params.yaml pointing at a registry of ``rows`` and at ``tmp_path/models``."""
    (tmp_path / "registry.yaml").write_text(yaml.safe_dump({"notes": "test", "encoders": rows}))
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    params["extract"].update(registry=str(tmp_path / "registry.yaml"), weights_dir=str(tmp_path / "models"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return tmp_path / "params.yaml"


def _tiny_hibou_checkpoint(folder):
    torch.manual_seed(0)
    config = Dinov2WithRegistersConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                       patch_size=14, image_size=224, num_register_tokens=4, use_swiglu_ffn=True)
    Dinov2WithRegistersModel(config).save_pretrained(folder)


def test_list_shows_every_row_with_where_its_weights_are(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(PROJECT_ROOT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["encoders", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    assert len(out) == 1 + len(registry)
    by_slug = {line.split()[0]: line for line in out[1:]}
    assert "built in (no download)" in by_slug["filterbank-dense"]
    assert "missing (GPFM.pth in models/gpfm/" in by_slug["gpfm"]
    assert "+ config.json" in by_slug["phikon"]
    assert "missing (seal_univ2_vision.pth in models/seal-uni2/" in by_slug["seal-uni2"]
    assert "missing (model.safetensors in models/musk/" in by_slug["musk"]


def test_check_passes_a_working_encoder_given_by_weights_folder(capsys, tmp_path):
    _tiny_hibou_checkpoint(tmp_path / "download")
    params = _project(tmp_path, [TINY_HIBOU])
    command = ["encoders", "check", "tiny-hibou", "--params", str(params)]
    assert main([*command, "--weights", str(tmp_path / "download")]) == 0
    out = capsys.readouterr().out
    for needle in ("token grid     16 x 16 (patch 14 px), width 32", "prefix tokens  5 stripped; CLS yes",
                   "mean [0.7068, 0.5755, 0.722]", "revision       sha256:", "  ok"):
        assert needle in out, out


def test_check_fails_with_every_problem_a_wrong_row_or_missing_weights(capsys, tmp_path):
    _tiny_hibou_checkpoint(tmp_path / "models" / "tiny-hibou")
    params = _project(tmp_path, [TINY_HIBOU | {"num_prefix_tokens": 1}])  # the registers forgotten
    assert main(["encoders", "check", "tiny-hibou", "--params", str(params)]) == 2
    assert "1 + num_register_tokens = 5 vs num_prefix_tokens = 1" in capsys.readouterr().err
    assert main(["encoders", "check", "tiny-hibou", "--params", str(params), "--weights", str(tmp_path / "none")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["encoders", "check", "--params", str(params)]) == 2
    assert "name the encoder to check" in capsys.readouterr().err


def test_a_transposed_grid_fails_the_bright_dot(monkeypatch, tmp_path):
    spec = EncoderSpec.model_validate(TINY_HIBOU)
    _tiny_hibou_checkpoint(tmp_path / spec.slug)
    forward = Encoder.forward_tokens

    def transposed(self, images):
        cls, grid = forward(self, images)
        return cls, grid.transpose(1, 2)  # the bug a wrong reshape makes

    assert not check_encoder(spec, weights_dir=tmp_path).problems
    monkeypatch.setattr(Encoder, "forward_tokens", transposed)
    result = check_encoder(spec, weights_dir=tmp_path)
    assert result.dot_found == result.dot_token[::-1]
    assert any("not in image order" in problem for problem in result.problems)


def test_check_warns_of_a_hub_config_that_disagrees_and_still_passes(capsys, monkeypatch, tmp_path):
    """A port's config.json with ImageNet mean/std beside the card's 0.5: a warning printing both
    values, the check passes; weights of another depth fail it."""
    import huggingface_hub.constants as hf_constants
    from safetensors.torch import save_file

    from cellpath.features.encoders.loading import build_timm_module
    from helpers.hub_cache import hub_snapshot

    row = {"name": "tiny-port", "type": "PV", "architecture": "ViT-tiny/16", "hub_id": "hf-hub:cellpath-test/tiny-port",
           "revision": "main", "loader": "timm", "timm_model": "vit_small_patch16_224",
           "timm_kwargs": {"img_size": 64, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 0},
           "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "input_size": 64, "patch_size": 16,
           "num_prefix_tokens": 1, "has_cls": True, "embed_dim": 32, "native_mpp": None,
           "pretrain_magnification": None, "precision": "fp32", "params": None, "pretrain_wsi_equivalent": None}
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_snapshot(tmp_path / "hub", "cellpath-test/tiny-port")
    torch.manual_seed(0)
    save_file(build_timm_module(EncoderSpec.model_validate(row)).state_dict(), snapshot / "model.safetensors")
    (snapshot / "config.json").write_text(json.dumps({
        "architecture": "vit_small_patch16_224",
        "pretrained_cfg": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}))
    params = _project(tmp_path, [row])
    assert main(["encoders", "check", "tiny-port", "--params", str(params)]) == 0
    out = capsys.readouterr().out
    assert "WARNING        tiny-port: the hub config" in out and out.rstrip().endswith("ok"), out
    assert "pretrained_cfg.mean [0.485, 0.456, 0.406] vs mean [0.5, 0.5, 0.5]" in out
    assert "pretrained_cfg.std [0.229, 0.224, 0.225] vs std [0.5, 0.5, 0.5]" in out
    deeper = EncoderSpec.model_validate(row | {"timm_kwargs": {**row["timm_kwargs"], "depth": 2}})
    save_file(build_timm_module(deeper).state_dict(), snapshot / "model.safetensors")
    assert main(["encoders", "check", "tiny-port", "--params", str(params)]) == 2
    assert "does not match" in capsys.readouterr().err
