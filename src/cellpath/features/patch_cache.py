"""Patches read once per (slide, target mpp, input size) and shared by every encoder that tiles alike.

Reading a patch from the slide (tiatoolbox ``read_rect``: tile decode, resample) costs milliseconds,
and most of the benchmark's 30 encoders take 224-px patches at the same mpp, so without sharing
each patch would be read once per encoder. The first extraction of a (slide, grid) writes the
patches it reads into a store in the work folder; later extractions with the same key read the
store instead (a memory-mapped array, microseconds per patch).

A store is ``<key>.npy``, (n, S, S, 3) uint8 with rows in ascending patch index, and
``<key>.index.npy`` beside it, the patch indices. The key is the section, the grid (target mpp,
input size, grid shape) and a digest of the slide file (path, size, mtime, inode) and the reading
code's version, so a changed slide or tiling is never served stale pixels. It holds exactly the
bytes :func:`cellpath.features.extract.read_patches` returns, so features do not depend on
whether a store was used (a test checks this). A store is written only when an extraction read
every patch it needs, and renamed into place whole, so a failed run leaves none half-written.
Disk: 150 kB per 224-px patch (``cellpath plan`` reports the total).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from cellpath.features.tiling import PatchGrid

PATCH_CACHE_VERSION = "1"  # bump when read_patches changes what a patch holds


def patch_store_path(folder: Path, section_id: str, slide: Path, grid: PatchGrid) -> Path:
    """The store of ``section_id``'s patches on ``grid`` read from ``slide`` (``.npy``; the index beside)."""
    stat = Path(slide).stat()
    material = {"slide": str(Path(slide).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "inode": stat.st_ino, "grid": [grid.slide_width_px, grid.slide_height_px, grid.slide_mpp,
                                               grid.target_mpp, grid.input_size, grid.n_cols, grid.n_rows],
                "version": PATCH_CACHE_VERSION}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder) / f"{section_id}-{grid.target_mpp:g}mpp-{grid.input_size}px-{digest}.npy"


def _index_path(store: Path) -> Path:
    return store.with_suffix(".index.npy")


class PatchStore:
    """A written store: ``take(patch_indices)`` returns those patches (B, S, S, 3) uint8."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.index = np.load(_index_path(self.path))
        self.patches = np.load(self.path, mmap_mode="r")

    def covers(self, patch_indices: np.ndarray) -> bool:
        return bool(np.isin(patch_indices, self.index).all())

    def take(self, patch_indices: np.ndarray) -> np.ndarray:
        return np.asarray(self.patches[np.searchsorted(self.index, patch_indices)])


def open_store(path: Path, patch_indices: np.ndarray) -> PatchStore | None:
    """The store at ``path`` when it exists, is readable and holds every patch of ``patch_indices``."""
    if not (Path(path).is_file() and _index_path(Path(path)).is_file()):
        return None
    try:
        store = PatchStore(path)
    except (OSError, ValueError):
        return None
    return store if store.covers(patch_indices) else None


class StoreWriter:
    """Patches written as they are read (ascending indices given up front), renamed into place by
    :meth:`commit`; :meth:`discard` (or no commit) leaves nothing behind. Other stores of the same
    section and grid (an older slide or code version) are removed on commit."""

    def __init__(self, path: Path, patch_indices: np.ndarray, input_size: int):
        self.path = Path(path)
        self.index = np.asarray(patch_indices, dtype=np.int64)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.stem}.{os.getpid()}.tmp.npy")
        self._array = np.lib.format.open_memmap(self._tmp, mode="w+", dtype=np.uint8,
                                                shape=(len(self.index), input_size, input_size, 3))

    def write(self, patch_indices: np.ndarray, images: np.ndarray) -> None:
        self._array[np.searchsorted(self.index, patch_indices)] = images

    def commit(self) -> None:
        self._array.flush()
        del self._array
        index_tmp = self._tmp.with_name(self._tmp.name.replace(".tmp.npy", ".index.tmp.npy"))
        np.save(index_tmp, self.index)
        os.replace(index_tmp, _index_path(self.path))
        os.replace(self._tmp, self.path)
        prefix = self.path.name.rsplit("-", 1)[0] + "-"
        for other in self.path.parent.glob(f"{prefix}*.npy"):
            if other.name.startswith(prefix) and other not in (self.path, _index_path(self.path)):
                other.unlink(missing_ok=True)

    def discard(self) -> None:
        if hasattr(self, "_array"):
            del self._array
        self._tmp.unlink(missing_ok=True)
