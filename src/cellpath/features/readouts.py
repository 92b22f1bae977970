"""Per-cell readouts of an encoder's token grid — the paper's Nuc, Mean and Cls — and their fusions.

Token coordinates: with token stride p (patch px per token), token (row i, column j) has its centre
at patch px ((j + 0.5)·p, (i + 0.5)·p); a nucleus at patch px (x, y) sits at the continuous token
coordinate (x/p − 0.5, y/p − 0.5). Patch px are px of the patch read at the target mpp (see
``cellpath.features.tiling``).

Readouts: Nuc = bilinear sample of the grid at the nucleus's token coordinate; Mean = mean of the
patch's grid tokens; Cls = the patch's class token. Fusions: N+M, N+C (sum) and N||M, N||C
(concatenation, Nuc first), no normalisation. Cls and its fusions need a class token.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import numpy as np
import torch

from cellpath.features.encoders.registry import EncoderSpec
from cellpath.vocabulary import CLS_READOUTS, READOUTS

# readout → (global readout fused with Nuc, fusion kind); base readouts are absent.
FUSIONS: dict[str, tuple[str, Literal["sum", "concat"]]] = {
    "N+M": ("Mean", "sum"), "N+C": ("Cls", "sum"), "N||M": ("Mean", "concat"), "N||C": ("Cls", "concat"),
}
POSITION_TOLERANCE_PX = 1e-6

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def token_coordinates(position_px: torch.Tensor, patch_size_px: float) -> torch.Tensor:
    """(N, 2) patch px (x, y) → (N, 2) continuous token coordinates (column, row)."""
    return position_px / patch_size_px - 0.5


def nuclear_readout(grid: torch.Tensor | np.ndarray, patch_index: torch.Tensor | np.ndarray,
                    position_px: torch.Tensor | np.ndarray, patch_size_px: float) -> torch.Tensor:
    """Nuc: bilinear sample of each cell's patch grid at its nucleus → (N, D) in the grid's dtype.

    ``grid``: (B, H, W, D) token grids of B patches; ``patch_index``: (N,) row of ``grid`` holding
    each cell; ``position_px``: (N, 2) nucleus (x, y) in patch px, inside [0, W·p] × [0, H·p];
    ``patch_size_px``: token stride p in patch px.

    Border: token coordinates are clamped to [0, W − 1] × [0, H − 1], so a nucleus within half a
    token of the patch edge takes the edge token's value along that axis (no extrapolation, no
    zero padding; the same as ``grid_sample(..., padding_mode="border", align_corners=False)``).
    """
    grid = torch.as_tensor(grid)
    if grid.ndim != 4:
        raise ValueError(f"grid must have shape (B, H, W, D), got {tuple(grid.shape)}")
    n_patches, height, width, _ = grid.shape
    index = torch.as_tensor(patch_index, device=grid.device).long()
    position = torch.as_tensor(position_px, device=grid.device, dtype=torch.float64)
    if index.ndim != 1 or position.shape != (len(index), 2):
        raise ValueError(f"patch_index must be (N,) and position_px (N, 2), got {tuple(index.shape)} "
                         f"and {tuple(position.shape)}")
    if len(index) and (index.min() < 0 or index.max() >= n_patches):
        raise ValueError(f"patch_index outside 0..{n_patches - 1}")
    limits = torch.tensor([width, height], dtype=torch.float64, device=grid.device) * patch_size_px
    if not bool(((position >= -POSITION_TOLERANCE_PX) & (position <= limits + POSITION_TOLERANCE_PX)).all()):
        raise ValueError(f"position_px must lie inside the patch [0, {width * patch_size_px}] × "
                         f"[0, {height * patch_size_px}] patch px")
    coords = token_coordinates(position, patch_size_px)
    tx, ty = coords[:, 0].clamp(0, width - 1), coords[:, 1].clamp(0, height - 1)
    x0 = tx.floor().long().clamp(max=max(width - 2, 0))
    y0 = ty.floor().long().clamp(max=max(height - 2, 0))
    x1, y1 = (x0 + 1).clamp(max=width - 1), (y0 + 1).clamp(max=height - 1)
    wx = (tx - x0).to(grid.dtype)[:, None]
    wy = (ty - y0).to(grid.dtype)[:, None]
    top = (1 - wx) * grid[index, y0, x0] + wx * grid[index, y0, x1]
    bottom = (1 - wx) * grid[index, y1, x0] + wx * grid[index, y1, x1]
    return (1 - wy) * top + wy * bottom


def mean_readout(grid: Array) -> Array:
    """Mean: (B, H, W, D) token grids → (B, D) per patch (index with patch_index for cells)."""
    if grid.ndim != 4:
        raise ValueError(f"grid must have shape (B, H, W, D), got {tuple(grid.shape)}")
    return grid.mean(axis=(1, 2)) if isinstance(grid, np.ndarray) else grid.mean(dim=(1, 2))


def cls_readout(cls: Array | None) -> Array:
    """Cls: (B, D) class tokens per patch (index with patch_index for cells); None is an error."""
    if cls is None:
        raise ValueError("this encoder has no class token: Cls, N+C and N||C are unavailable")
    if cls.ndim != 2:
        raise ValueError(f"class tokens must have shape (B, D), got {tuple(cls.shape)}")
    return cls


def fuse(nuc: Array, other: Array, kind: Literal["sum", "concat"]) -> Array:
    """Fuse per-cell Nuc (N, D) with a global readout: ``sum`` → (N, D), ``concat`` → (N, D + D')."""
    if kind == "sum":
        if nuc.shape != other.shape:
            raise ValueError(f"sum fusion needs equal shapes, got {tuple(nuc.shape)} and {tuple(other.shape)}")
        return nuc + other
    if kind == "concat":
        if nuc.ndim != 2 or other.ndim != 2 or nuc.shape[0] != other.shape[0]:
            raise ValueError(f"concat fusion needs (N, D) arrays with equal N, got {tuple(nuc.shape)} "
                             f"and {tuple(other.shape)}")
        if isinstance(nuc, torch.Tensor):
            return torch.cat([nuc, other], dim=1)
        return np.concatenate([nuc, other], axis=1)
    raise ValueError(f"fusion kind must be 'sum' or 'concat', got {kind!r}")


def readout_available(spec: EncoderSpec, readout: str) -> bool:
    """Whether ``readout`` is defined for ``spec``: every readout but the Cls ones needs no CLS token."""
    return spec.has_cls or readout not in CLS_READOUTS


def readout_width(embed_dim: int, readout: str) -> int:
    """Feature columns of ``readout`` for an encoder of width ``embed_dim``: 2·D for a concatenation, else D."""
    if readout not in READOUTS:
        raise ValueError(f"unknown readout {readout!r}; choose from {', '.join(READOUTS)}")
    return 2 * embed_dim if readout in FUSIONS and FUSIONS[readout][1] == "concat" else embed_dim


def readout_bases(readout: str) -> tuple[str, ...]:
    """The stored base readouts ``readout`` is composed of (itself for a base; Nuc and the other for a fusion)."""
    if readout not in READOUTS:
        raise ValueError(f"unknown readout {readout!r}; choose from {', '.join(READOUTS)}")
    return (readout,) if readout not in FUSIONS else ("Nuc", FUSIONS[readout][0])


def compose_readout(readout: str, nuc: Array | None, mean: Array | None, cls: Array | None = None) -> Array:
    """Per-cell features of ``readout`` from the per-cell base readouts (each (N, D); those it does
    not use, :func:`readout_bases`, may be None)."""
    if readout not in READOUTS:
        raise ValueError(f"unknown readout {readout!r}; choose from {', '.join(READOUTS)}")
    if readout in CLS_READOUTS and cls is None:
        raise ValueError(f"readout {readout} needs a class token; this encoder has none")
    bases = {"Nuc": nuc, "Mean": mean, "Cls": cls}
    if readout in bases:
        return bases[readout]
    other, kind = FUSIONS[readout]
    return fuse(nuc, bases[other], kind)
