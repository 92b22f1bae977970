"""Encoders published as BEiT-3 checkpoints (MUSK: ``xiangjx/musk``, ``model.safetensors``).

MUSK is torchscale's ``BEiT3`` (a Multiway Transformer: shared self-attention, with a vision
expert ``A`` and a language expert ``B`` for each projection, layer norm and feed-forward
network) plus two contrastive heads, and its code (github lilab-stanford/MUSK) is not on PyPI;
torchscale is (0.3.0), but it pins timm 0.6.13 and fairscale 0.4.0, which cellpath's timm
cannot live with. So the vision path is written here, module for module, with torchscale's
parameter names, and checked against torchscale itself by a golden test
(``tests/unit/features/golden/``). What it computes, for a (B, 3, S, S) input:

- ``vision_embed``: a stride-p convolution → the row-major grid, after a CLS token;
- ``+ encoder.embed_positions.A.weight[2 : 2 + 1 + grid²]`` (fairseq's positions start at 2);
- each layer, pre-LN (sub-LN: torchscale's ``subln`` default): ``x + out_proj(inner_attn_ln(
  attention(self_attn_layer_norm(x))))``, then ``x + fc2(ffn_layernorm(gelu(fc1(final_layer_norm(x)))))``;
- ``encoder.layer_norm``: CLS then the grid — the tokens MUSK's ``return_global=False`` returns.

Only the vision expert runs on an image, so the checkpoint's language expert (``.B.``), its text
embedding and text positions, and the parts an image's tokens never pass through (the contrastive
heads ``vision_head``/``language_head``, ``logit_scale``, the masked-modelling ``mask_token``) are
left out by name: :func:`vision_state` drops exactly those, and every other key must load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cellpath.features.encoders.registry import EncoderSpec

#: Checkpoint keys an image's tokens never use (beyond the language expert's ``.B.`` keys).
UNUSED_BY_IMAGES = ("beit3.text_embed.weight", "beit3.vision_embed.mask_token", "vision_head.weight",
                    "language_head.weight", "logit_scale")
POSITION_OFFSET = 2  # fairseq convention: position ids start at 2
LAYER_NORM_EPS = 1e-5  # torchscale's layernorm_eps default


class _Expert(nn.Module):
    """torchscale's MultiwayNetwork reduced to its vision expert ``A`` (the key names kept)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.A = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.A(x)


class _FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.ffn_layernorm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.fc1(x).float()).type_as(x)  # exact (erf) GELU in fp32, as torchscale
        return self.fc2(self.ffn_layernorm(hidden))


class _SelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            setattr(self, name, _Expert(nn.Linear(width, width)))
        self.inner_attn_ln = _Expert(nn.LayerNorm(width, eps=LAYER_NORM_EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = [proj(x).view(batch, length, self.num_heads, width // self.num_heads).transpose(1, 2)
                 for proj in (self.q_proj, self.k_proj, self.v_proj)]
        attended = F.scaled_dot_product_attention(*heads, scale=1 / math.sqrt(width // self.num_heads))
        return self.out_proj(self.inner_attn_ln(attended.transpose(1, 2).reshape(batch, length, width)))


class _Layer(nn.Module):
    def __init__(self, width: int, num_heads: int, ffn_dim: int):
        super().__init__()
        self.self_attn = _SelfAttention(width, num_heads)
        self.self_attn_layer_norm = _Expert(nn.LayerNorm(width, eps=LAYER_NORM_EPS))
        self.ffn = _Expert(_FeedForward(width, ffn_dim))
        self.final_layer_norm = _Expert(nn.LayerNorm(width, eps=LAYER_NORM_EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.ffn(self.final_layer_norm(x))


class _VisionEmbed(nn.Module):
    def __init__(self, patch_size: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        grid = self.proj(pixels).flatten(2).transpose(1, 2)  # (B, grid², D), row-major
        return torch.cat([self.cls_token.expand(grid.shape[0], -1, -1), grid], dim=1)


class _Encoder(nn.Module):
    def __init__(self, num_positions: int, width: int, depth: int, num_heads: int, ffn_dim: int):
        super().__init__()
        self.embed_positions = _Expert(nn.Embedding(num_positions, width))
        self.layers = nn.ModuleList(_Layer(width, num_heads, ffn_dim) for _ in range(depth))
        self.layer_norm = _Expert(nn.LayerNorm(width, eps=LAYER_NORM_EPS))


class _Beit3Vision(nn.Module):
    def __init__(self, input_size: int, patch_size: int, width: int, depth: int, num_heads: int, ffn_dim: int):
        super().__init__()
        self.vision_embed = _VisionEmbed(patch_size, width)
        tokens = 1 + (input_size // patch_size) ** 2
        self.encoder = _Encoder(tokens + POSITION_OFFSET, width, depth, num_heads, ffn_dim)


class Beit3Tokens(nn.Module):
    """The vision path of a BEiT-3 checkpoint behind the encoder interface (keys under ``beit3.``)."""

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        kwargs = spec.beit3_kwargs
        self.beit3 = _Beit3Vision(spec.input_size, spec.patch_size, spec.embed_dim, kwargs.depth, kwargs.num_heads,
                                  kwargs.ffn_dim)
        self.num_prefix_tokens = 1
        self.num_features = spec.embed_dim

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) normalised pixels → (B, 1 + grid², D): CLS then the row-major grid."""
        x = self.beit3.vision_embed(pixels)
        encoder = self.beit3.encoder
        positions = encoder.embed_positions.A.weight[POSITION_OFFSET:POSITION_OFFSET + x.shape[1]]
        x = x + positions.to(x.dtype)
        for layer in encoder.layers:
            x = layer(x)
        return encoder.layer_norm(x)


def vision_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BEiT-3 checkpoint without what an image never passes through (see the module docstring)."""
    return {key: value for key, value in state.items() if ".B." not in key and key not in UNUSED_BY_IMAGES}
