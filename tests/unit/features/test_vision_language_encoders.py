"""The vision-language rows (CONCH, CONCH v1.5, PLIP, OmiCLIP, SEAL (CONCH)): their vision trunks read
from reduced checkpoints written in each model's own layout, and what their Cls readout is — the
trunk's class token at the grid tokens' layer, not the model's published image embedding."""

from __future__ import annotations

import json

import numpy as np
import open_clip
import pytest
import torch
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from transformers import CLIPConfig, CLIPModel, CLIPVisionModel

from cellpath.features.encoders.loading import build_timm_module, images_to_tensor, load_encoder
from cellpath.features.encoders.registry import EncoderSpec, load_registry
from helpers.project import PROJECT_ROOT

VISION_LANGUAGE = ("CONCH", "CONCH v1.5", "PLIP", "OmiCLIP", "SEAL (CONCH)")
WIDTH, CONTRAST_WIDTH = 32, 16  # trunk tokens; CONCH's pooled image embedding (512 in the real model)


@pytest.fixture(scope="module")
def registry() -> dict[str, EncoderSpec]:
    return load_registry(PROJECT_ROOT / "models" / "encoders.yaml")


def _reduced(spec: EncoderSpec, **update) -> EncoderSpec:
    """A registry row at test width and depth (its architecture, kwargs and geometry otherwise kept)."""
    row = spec.model_dump(exclude={"lora"}) | {"embed_dim": WIDTH, "hub_id": "hf-hub:test/reduced"}
    row["timm_kwargs"] = spec.timm_kwargs | {"embed_dim": WIDTH, "depth": 2, "num_heads": 2}
    if "input_size" in update:  # fed another size than the row's: no longer Table 6's departure
        row["paper_input_size"] = None
    return EncoderSpec.model_validate(row | update)


def _images(size: int, n: int = 2) -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _pixels(spec: EncoderSpec, images: np.ndarray) -> torch.Tensor:
    return images_to_tensor(images, spec, torch.device("cpu"))


def _dot_lights(encoder, size: int, stride: int, cell: tuple[int, int]) -> bool:
    blank = np.full((1, size, size, 3), 128, dtype=np.uint8)
    dotted = blank.copy()
    r, c = cell
    dotted[0, r * stride + stride // 2 - 2:r * stride + stride // 2 + 2,
           c * stride + stride // 2 - 2:c * stride + stride // 2 + 2] = 255
    change = (encoder.forward_tokens(dotted)[1] - encoder.forward_tokens(blank)[1]).norm(dim=-1)[0]
    return divmod(int(change.argmax()), change.shape[1]) == cell


# ------------------------------------------------------------------ CONCH's CoCa layout


class AttentionalPooler(nn.Module):
    """CONCH's ``open_clip_custom.transformer.AttentionalPooler`` (same parameters, same forward)."""

    def __init__(self, d_model: int, context_dim: int, n_head: int, n_queries: int):
        super().__init__()
        self.query = nn.Parameter(torch.randn(n_queries, d_model))
        self.attn = nn.MultiheadAttention(d_model, n_head, kdim=context_dim, vdim=context_dim)
        self.ln_q, self.ln_k = nn.LayerNorm(d_model), nn.LayerNorm(context_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_k(x).permute(1, 0, 2)
        q = self.ln_q(self.query).unsqueeze(1).repeat(1, x.shape[1], 1)
        return self.attn(q, x, x, need_weights=False)[0].permute(1, 0, 2)


class ConchVisual(nn.Module):
    """CONCH's ``VisualModel`` as ``conch_ViT-B-16`` builds it (reduced): the timm trunk exactly as
    ``coca_model._build_vision_tower`` creates it, the contrastive and caption attentional poolers."""

    def __init__(self):
        super().__init__()
        self.trunk = VisionTransformer(embed_dim=WIDTH, depth=2, num_heads=2, mlp_ratio=4.0, img_size=448,
                                       patch_size=16, num_classes=0, dynamic_img_size=True)
        self.attn_pool_contrast = AttentionalPooler(CONTRAST_WIDTH, WIDTH, n_head=2, n_queries=1)
        self.ln_contrast = nn.LayerNorm(CONTRAST_WIDTH)
        self.proj_contrast = nn.Parameter(torch.randn(CONTRAST_WIDTH, CONTRAST_WIDTH))
        self.attn_pool_caption = AttentionalPooler(WIDTH, WIDTH, n_head=2, n_queries=4)
        self.ln_caption = nn.LayerNorm(WIDTH)

    def image_embedding(self, pixels: torch.Tensor) -> torch.Tensor:
        """CONCH's published vision embedding: ``encode_image(proj_contrast=False, normalize=False)``."""
        return self.ln_contrast(self.attn_pool_contrast(self.trunk.forward_features(pixels))[:, 0])


@pytest.fixture(scope="module")
def conch_visual() -> ConchVisual:
    torch.manual_seed(21)
    return ConchVisual().eval()


@pytest.fixture
def conch_weights(tmp_path, registry, conch_visual):
    """A whole CONCH checkpoint (pytorch_model.bin: visual tower with its poolers, text tower, logit
    scale) in ``<tmp>/conch/``; returns the weights folder."""
    state = {f"visual.{k}": v for k, v in conch_visual.state_dict().items()} | {
        "text.token_embedding.weight": torch.zeros(10, WIDTH), "text.ln_final.weight": torch.ones(WIDTH),
        "logit_scale": torch.zeros(())}
    (tmp_path / registry["CONCH"].slug).mkdir()
    torch.save(state, tmp_path / registry["CONCH"].slug / "pytorch_model.bin")
    return tmp_path


def test_the_conch_rows_build_their_trunk_with_dynamic_img_size_as_conch_does(registry):
    # CONCH's coca_model.py: VisionTransformer(img_size=448, patch_size=16, num_classes=0, dynamic_img_size=True)
    for name in ("CONCH", "SEAL (CONCH)", "CONCH v1.5"):
        assert registry[name].timm_kwargs["dynamic_img_size"] is True, name
    conch = registry["CONCH"]
    assert (conch.timm_kwargs["img_size"], conch.input_size, conch.grid_size) == (448, 448, 28)


def test_conch_reads_its_coca_checkpoints_trunk_at_448_px_as_a_28x28_grid(registry, conch_visual, conch_weights):
    spec = _reduced(registry["CONCH"])
    encoder = load_encoder(spec, weights_dir=conch_weights, hf_cache_dir=conch_weights / "hub")
    cls, grid = encoder.forward_tokens(_images(448))
    assert cls.shape == (2, WIDTH) and grid.shape == (2, 28, 28, WIDTH)
    with torch.inference_mode():
        reference = conch_visual.trunk.forward_features(_pixels(spec, _images(448)))
    torch.testing.assert_close(grid, reference[:, 1:].reshape(2, 28, 28, WIDTH))
    torch.testing.assert_close(cls, reference[:, 0])
    assert _dot_lights(encoder, 448, 16, (9, 18))


def test_only_dynamic_img_size_lets_the_conch_trunk_take_another_input_size(registry, conch_visual, conch_weights):
    # SEAL (CONCH) feeds CONCH's trunk 224 px: the position embeddings are resampled to 14x14.
    spec = _reduced(registry["CONCH"], input_size=224)
    grid = load_encoder(spec, weights_dir=conch_weights).forward_tokens(_images(224))[1]
    with torch.inference_mode():
        reference = conch_visual.trunk.forward_features(_pixels(spec, _images(224)))
    torch.testing.assert_close(grid, reference[:, 1:].reshape(2, 14, 14, WIDTH))
    static = registry["CONCH"].timm_kwargs | {"dynamic_img_size": False}
    with pytest.raises(ValueError, match="timm_kwargs.img_size = 448 disagrees with input_size = 224"):
        _reduced(registry["CONCH"], input_size=224, timm_kwargs=static | {"embed_dim": WIDTH, "depth": 2,
                                                                          "num_heads": 2})
    with pytest.raises(AssertionError, match=r"Input height \(224\) doesn't match model \(448\)"):
        build_timm_module(_reduced(registry["CONCH"], timm_kwargs=static | {"embed_dim": WIDTH, "depth": 2,
                                                                             "num_heads": 2})).forward_features(
            torch.zeros(1, 3, 224, 224))


def test_conch_v15_reads_a_512_px_tile_as_a_32x32_grid(registry, tmp_path):
    spec = _reduced(registry["CONCH v1.5"])
    assert (spec.input_size, spec.grid_size, spec.paper_input_size) == (512, 32, None)
    torch.manual_seed(22)
    saved = build_timm_module(_reduced(registry["CONCH v1.5"], timm_kwargs=spec.timm_kwargs | {"img_size": 448}))
    (tmp_path / spec.slug).mkdir()
    torch.save({f"trunk.{k}": v for k, v in saved.state_dict().items()} | {  # the vision file's other heads
        "attn_pool_contrast.query": torch.zeros(1, 16), "ln_contrast.weight": torch.ones(16)},
        tmp_path / spec.slug / "pytorch_model_vision.bin")
    encoder = load_encoder(spec, weights_dir=tmp_path)
    cls, grid = encoder.forward_tokens(_images(512))
    assert cls.shape == (2, WIDTH) and grid.shape == (2, 32, 32, WIDTH)
    assert _dot_lights(encoder, 512, 16, (10, 21))


# ------------------------------------------------------------------ the Cls readout


def test_every_vision_language_row_keeps_only_its_vision_trunk(registry):
    """The poolers and projections that make each model's published image embedding are not loaded
    (the strict load would name any of their keys), so Cls can only be the trunk's class token."""
    for name in VISION_LANGUAGE:
        spec = registry[name]
        assert spec.has_cls and spec.num_prefix_tokens == 1, name
        if spec.loader == "timm":
            assert spec.checkpoint.keep_prefix.endswith("trunk."), name
    assert "visual_projection." in registry["PLIP"].checkpoint.drop
    assert registry["OmiCLIP"].loader == "open_clip"


def test_conch_cls_is_the_trunks_class_token_not_its_image_embedding(registry, conch_visual, conch_weights):
    spec = _reduced(registry["CONCH"])
    encoder = load_encoder(spec, weights_dir=conch_weights)
    assert not [k for k in encoder.module.state_dict() if "pool" in k or "contrast" in k or "caption" in k]
    cls = encoder.forward_tokens(_images(448))[0]
    with torch.inference_mode():
        pixels = _pixels(spec, _images(448))
        trunk = conch_visual.trunk.forward_features(pixels)  # after the trunk's final LayerNorm, as the grid
        embedding = conch_visual.image_embedding(pixels)
    torch.testing.assert_close(cls, trunk[:, 0])
    assert embedding.shape == (2, CONTRAST_WIDTH) != cls.shape


def test_plip_cls_is_the_class_token_before_clips_post_layernorm(tmp_path):
    torch.manual_seed(23)
    vision = {"hidden_size": WIDTH, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "image_size": 224, "patch_size": 32}
    text = {"hidden_size": WIDTH, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    CLIPModel(CLIPConfig(vision_config=vision, text_config=text, projection_dim=16)).save_pretrained(tmp_path / "plip")
    plip = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["PLIP"]
    spec = EncoderSpec.model_validate(plip.model_dump() | {"embed_dim": WIDTH})
    encoder = load_encoder(spec, weights_path=tmp_path / "plip")
    cls, grid = encoder.forward_tokens(_images(224))
    assert grid.shape == (2, 7, 7, WIDTH)
    reference = CLIPVisionModel.from_pretrained(tmp_path / "plip", local_files_only=True).eval()
    with torch.inference_mode():
        out = reference(pixel_values=_pixels(spec, _images(224)))
    torch.testing.assert_close(cls, out.last_hidden_state[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cls, out.pooler_output, atol=1e-3)  # post_layernorm(CLS) → visual_projection
    assert set(load_file(tmp_path / "plip" / "model.safetensors")) >= {"visual_projection.weight"}


def test_omiclip_cls_is_the_towers_class_token_not_cocas_pooled_embedding(tmp_path):
    config = {"embed_dim": 16,
              "vision_cfg": {"image_size": 224, "layers": 2, "width": WIDTH, "head_width": 16, "patch_size": 14,
                             "attentional_pool": True, "attn_pooler_heads": 2, "output_tokens": True},
              "text_cfg": {"context_length": 16, "vocab_size": 100, "width": WIDTH, "heads": 2, "layers": 1,
                           "embed_cls": True, "output_tokens": True},
              "multimodal_cfg": {"context_length": 16, "vocab_size": 100, "width": WIDTH, "heads": 2, "layers": 1,
                                 "attn_pooler_heads": 2},
              "custom_text": True}
    (tmp_path / "cellpath_cls_coca.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "cellpath_cls_coca.json")
    torch.manual_seed(24)
    coca = open_clip.create_model("cellpath_cls_coca", pretrained=None).eval()
    omiclip = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["OmiCLIP"]
    spec = EncoderSpec.model_validate(omiclip.model_dump() | {"open_clip_model": "cellpath_cls_coca",
                                                              "embed_dim": WIDTH})
    (tmp_path / spec.slug).mkdir()
    torch.save({"state_dict": coca.state_dict()}, tmp_path / spec.slug / "checkpoint.pt")
    cls = load_encoder(spec, weights_dir=tmp_path).forward_tokens(_images(224))[0]
    pixels = _pixels(spec, _images(224))
    with torch.inference_mode():
        tokens = coca.visual.transformer(coca.visual._embeds(pixels))
        embedding = coca.encode_image(pixels, normalize=False)  # attentional pooler → ln_post → proj
    torch.testing.assert_close(cls, tokens[:, 0])
    assert embedding.shape == (2, 16) != cls.shape
