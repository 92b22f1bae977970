"""Encoders published as open_clip checkpoints (OmiCLIP: a CoCa ViT-L/14).

open_clip builds the architecture (``open_clip.create_model(<name>, pretrained=None)``: nothing
is downloaded); the row's checkpoint is loaded strictly into its vision tower. A CoCa tower's own
output is its attentional pooler's queries, not the image grid, so the tokens are read before
the pool: patch embedding, class token and position embeddings, ``ln_pre``, the transformer —
the tower's own modules in its own order — giving CLS then the grid, before ``ln_post``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cellpath.errors import EncoderLoadError
from cellpath.features.encoders.registry import EncoderSpec


class OpenClipTokens(nn.Module):
    """An open_clip ``VisionTransformer`` behind the encoder interface: all tokens before the pool."""

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual
        self.num_prefix_tokens = 1
        self.num_features = visual.transformer.width

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        x = visual.conv1(pixels)  # (B, D, grid, grid)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # row-major grid tokens
        cls = visual.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)
        return visual.transformer(visual.ln_pre(visual.patch_dropout(x)))


def build_open_clip_visual(spec: EncoderSpec) -> nn.Module:
    """The row's open_clip model's vision tower, randomly initialised."""
    import open_clip

    logging.getLogger("root").setLevel(logging.ERROR)  # "No pretrained weights loaded": none are asked for
    try:
        model = open_clip.create_model(spec.open_clip_model, pretrained=None)
    except RuntimeError as exc:
        raise EncoderLoadError(f"{spec.name}: open_clip has no model {spec.open_clip_model!r} ({exc}); "
                               "fix open_clip_model in models/encoders.yaml") from None
    image_size = model.visual.image_size
    if tuple(image_size if isinstance(image_size, tuple) else (image_size, image_size)) != (spec.input_size,) * 2:
        raise EncoderLoadError(f"{spec.name}: open_clip {spec.open_clip_model} takes {image_size} px, the row says "
                               f"input_size = {spec.input_size}")
    return OpenClipTokens(model.visual)
