"""An encoder a third-party package would register under the `cellpath.encoders` entry point group."""

from __future__ import annotations

from pathlib import Path

import timm
import torch
from torch import nn


def build_tiny_vit(spec, weights: Path | None) -> nn.Module:
    """A 1-block ViT/16 at 64 px, width 32, from ``weights`` when given (else seeded random)."""
    torch.manual_seed(11)
    module = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64, embed_dim=32, depth=1,
                               num_heads=2, num_classes=0)
    if weights is not None:
        module.load_state_dict(torch.load(weights, weights_only=True), strict=True)
    return module


def build_broken(spec, weights: Path | None) -> nn.Module:
    raise RuntimeError("CUDA kernels of this package are not compiled")
