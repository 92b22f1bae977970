"""Coordinate-aligned cell features for one section: tile at a target mpp, encode, read out per cell.

The slide is cut into the encoder's non-overlapping input-size patches at the target mpp
(:mod:`cellpath.features.tiling`); only patches holding at least one nucleus are read (tiatoolbox, at that
mpp, padded white beyond the slide). Each patch is encoded once; every cell in it gets its Nuc
(bilinear sample of the token grid at the nucleus), Mean (mean of the patch's grid tokens) and
Cls (class token, when the encoder has one) from that single forward pass. Patches are read by one
background thread up to ``read_ahead`` batches ahead of the forward pass, so reading and encoding
overlap; the reader is only ever used by that thread, and batches are encoded in order, so the
features do not depend on ``read_ahead``. The patches read are kept in a shared store in the work
folder (:mod:`cellpath.features.patch_cache`), so every other encoder with the same input size at
the same mpp reads them from there instead of the slide.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cellpath.features.encoders.loading import Encoder
from cellpath.features.readouts import cls_readout, mean_readout, nuclear_readout
from cellpath.features.tiling import CellPlacement, PatchGrid, patch_origins_level0

FEATURE_CODE_VERSION = "1"  # bump when tiling, reading or readouts change what is stored
GLASS_PAD = 255


def read_patches(reader, grid: PatchGrid, patch_index: np.ndarray) -> np.ndarray:
    """(B, S, S, 3) uint8 patches at the grid's target mpp; level-0 origins rounded to whole px."""
    origins = np.rint(patch_origins_level0(grid, patch_index)).astype(int)
    size = (grid.input_size, grid.input_size)
    images = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiatoolbox warns when reading finer than the slide's mpp
        for x0, y0 in origins:
            patch = reader.read_rect(location=(int(x0), int(y0)), size=size, resolution=grid.target_mpp,
                                     units="mpp", pad_mode="constant", pad_constant_values=GLASS_PAD)
            images.append(np.asarray(patch)[..., :3])
    return np.stack(images).astype(np.uint8)


def _batches(patches: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(patches), batch_size):
        yield patches[start:start + batch_size]


def read_ahead(reader, grid: PatchGrid, batches: Iterator[np.ndarray],
               depth: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(patch indices, patches) per batch, in order, read by one background thread up to ``depth``
    batches ahead of the caller (0: read in the caller's thread, on demand)."""
    if depth == 0:
        for batch in batches:
            yield batch, read_patches(reader, grid, batch)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="patch-reader") as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.submit(read_patches, reader, grid, batch)))
            if len(pending) > depth:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def patch_batches(reader, grid: PatchGrid, patches: np.ndarray, batch_size: int, read_ahead_batches: int,
                  store: Path | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(patch indices, patches) per batch of ``patches`` (ascending): from the shared patch store at
    ``store`` when it holds them all, else read from the slide (``read_ahead``) and, with ``store``
    given, written to it once every patch was read (:mod:`cellpath.features.patch_cache`)."""
    from cellpath.features.patch_cache import StoreWriter, open_store

    cached = None if store is None else open_store(store, patches)
    if cached is not None:
        for batch in _batches(patches, batch_size):
            yield batch, cached.take(batch)
        return
    writer = None if store is None else StoreWriter(store, patches, grid.input_size)
    try:
        for batch, images in read_ahead(reader, grid, _batches(patches, batch_size), read_ahead_batches):
            if writer is not None:
                writer.write(batch, images)
            yield batch, images
        if writer is not None:
            writer.commit()
            writer = None
    finally:
        if writer is not None:
            writer.discard()


def extract_cells(encoder: Encoder, reader, placement: CellPlacement, *, batch_size: int,
                  progress: str | None = None, read_ahead_batches: int = 2,
                  patch_store: Path | None = None) -> dict[str, np.ndarray]:
    """Nuc, Mean and (if available) Cls per cell, rows in the order of ``placement``; patches are
    read ``read_ahead_batches`` batches ahead of the forward pass, or from the shared patch store
    ``patch_store`` (see the module docstring and :func:`patch_batches`)."""
    spec = encoder.spec
    patches = np.unique(placement.patch_index)
    n_cells = len(placement.patch_index)
    out: dict[str, np.ndarray] = {}
    bar = tqdm(total=len(patches), desc=progress, unit="patch", disable=progress is None, leave=False)
    for batch, images in patch_batches(reader, placement.grid, patches, batch_size, read_ahead_batches, patch_store):
        cls, grid_tokens = encoder.forward_tokens(images)
        local = {p: i for i, p in enumerate(batch)}
        cells = np.flatnonzero(np.isin(placement.patch_index, batch))
        where = np.array([local[p] for p in placement.patch_index[cells]], dtype=np.int64)
        readouts = {
            "Nuc": nuclear_readout(grid_tokens, where, placement.position_px[cells], spec.patch_size),
            "Mean": mean_readout(grid_tokens)[where],
        }
        if cls is not None:
            readouts["Cls"] = cls_readout(cls)[where]
        for name, values in readouts.items():
            values = values.detach().float().cpu().numpy() if isinstance(values, torch.Tensor) else values
            if name not in out:
                out[name] = np.zeros((n_cells, values.shape[1]), dtype=np.float32)
            out[name][cells] = values
        bar.update(len(batch))
    bar.close()
    return out
