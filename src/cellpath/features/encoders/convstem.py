"""CTransPath's convolutional stem: the patch embedding of its Swin-T, in timm's embed_layer interface.

TransPath (Wang et al., MedIA 2022) replaces Swin's 4×4 patchify convolution with two 3×3
stride-2 convolutions (3 → D/8 → D/4 channels, each with BatchNorm and ReLU) and a 1×1 projection
to D, so the grid keeps Swin's stride 4. Written here because no PyPI package ships it (TRIDENT
imports it from the ``timm_ctp`` fork of timm 0.5); the module names (``proj.0`` … ``proj.6``,
``norm``) are those of CTransPath's checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvStem(nn.Module):
    """(B, 3, H, W) → (B, H/4, W/4, D) in NHWC, as timm's SwinTransformer expects of its embed_layer."""

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 4, in_chans: int = 3,
                 embed_dim: int = 96, norm_layer: type[nn.Module] | None = None, strict_img_size: bool = True,
                 output_fmt: str = "NHWC", **factory):
        super().__init__()
        if patch_size != 4 or embed_dim % 8 or output_fmt != "NHWC":
            raise ValueError(f"ConvStem is CTransPath's stride-4 stem: patch_size 4 (got {patch_size}), embed_dim "
                             f"a multiple of 8 (got {embed_dim}), NHWC output (got {output_fmt})")
        size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.img_size, self.patch_size = size, (patch_size, patch_size)
        self.grid_size = (size[0] // patch_size, size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.strict_img_size = strict_img_size
        layers: list[nn.Module] = []
        width_in, width_out = in_chans, embed_dim // 8
        for _ in range(2):
            layers += [nn.Conv2d(width_in, width_out, kernel_size=3, stride=2, padding=1, bias=False, **factory),
                       nn.BatchNorm2d(width_out, **factory), nn.ReLU(inplace=True)]
            width_in, width_out = width_out, width_out * 2
        layers.append(nn.Conv2d(width_in, embed_dim, kernel_size=1, **factory))
        self.proj = nn.Sequential(*layers)
        self.norm = norm_layer(embed_dim, **factory) if norm_layer else nn.Identity()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(pixels).permute(0, 2, 3, 1))
