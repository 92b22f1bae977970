"""Part (b): the extraction pipeline's delivered patch rate: a tiled slide read ahead on the CPU cores
and fed to a ViT-L's forward pass, against that forward pass alone and against the reading alone.

The slide is written here: a synthetic H&E-like RGB image (``slide_px`` square at ``slide_mpp``
µm/px, tiles of ``tile`` px, ``compression`` zlib, ``levels`` pyramid levels each half the last),
a pyramidal tiled TIFF (tifffile; sub-IFDs as OME-TIFF writers make them). Patches are the
project's grid (``cellpath.features.tiling.patch_grid``: non-overlapping ``input_size`` px at the
target mpp) and read at the target mpp from the finest level no finer than needed, tile by tile
(:class:`TiledSlide`, a small tile cache per reader; resized with OpenCV when no level has that mpp).
The product reads through tiatoolbox (``cellpath.features.extract.read_patches``, one read-ahead
thread); neither tiatoolbox nor that module (it imports the encoder loader, which needs pydantic)
imports on a bare GPU machine, so this reader stands in for it and a torch ``DataLoader`` with
``workers`` processes does the read-ahead, ``prefetch`` batches each, into pinned memory.

Per worker count, for ``seconds_per_config`` seconds after the first batch: the read rate (batches
only delivered) and the delivered rate (each batch copied to the device, normalised and encoded
under autocast at the row's precision). The forward rate alone is measured on the same model with
tiles already on the device. Rates are patches per second.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from itertools import cycle, islice
from pathlib import Path

import numpy as np
import torch

from cellpath.features.tiling import patch_grid, patch_origins_level0
from gpu.encoders import AUTOCAST, MODELS, REGISTRY, build_module, forward, registry_rows, synchronise

GLASS = 255  # white beyond the slide, as the product pads


def synthetic_slide(side: int, seed: int = 0) -> np.ndarray:
    """(side, side, 3) uint8: pink stroma, purple nuclei (about one per 40 × 40 px) and grain."""
    import cv2

    rng = np.random.default_rng(seed)
    coarse = rng.normal(0, 1, (max(2, side // 64), max(2, side // 64), 1)).astype(np.float32)
    field = cv2.resize(coarse, (side, side), interpolation=cv2.INTER_CUBIC)[..., None]
    base = np.array([236, 190, 215], np.float32) + field * np.array([12, 18, 10], np.float32)
    image = np.clip(base + rng.normal(0, 6, (side, side, 3)), 0, 255).astype(np.uint8)
    for x, y, r in zip(rng.integers(0, side, side * side // 1600), rng.integers(0, side, side * side // 1600),
                       rng.integers(3, 8, side * side // 1600)):
        cv2.circle(image, (int(x), int(y)), int(r), (110, 70, 160), -1)
    return image


def write_slide(path: Path, side: int, tile: int, levels: int, mpp: float, compression: str) -> dict:
    """A pyramidal tiled TIFF of :func:`synthetic_slide`: level 0 and ``levels - 1`` halvings."""
    import cv2
    import tifffile

    image = synthetic_slide(side)
    started = time.perf_counter()
    per_cm = 1e4 / mpp
    with tifffile.TiffWriter(path, bigtiff=True) as tif:
        options = {"tile": (tile, tile), "compression": compression, "photometric": "rgb", "maxworkers": 8}
        tif.write(image, subifds=levels - 1, resolution=(per_cm, per_cm), resolutionunit="CENTIMETER", **options)
        for level in range(1, levels):
            image = cv2.resize(image, (image.shape[1] // 2, image.shape[0] // 2), interpolation=cv2.INTER_AREA)
            tif.write(image, subfiletype=1, **options)
    return {"side_px": side, "tile_px": tile, "levels": levels, "mpp": mpp, "compression": compression,
            "bytes": path.stat().st_size, "write_s": time.perf_counter() - started}


class TiledSlide:
    """Regions of a pyramidal tiled TIFF read tile by tile (``cache`` decoded tiles kept per level);
    opened lazily, so each DataLoader worker opens its own file handle."""

    def __init__(self, path: Path, mpp: float, cache: int = 64):
        self.path, self.mpp, self.cache_size = Path(path), mpp, cache
        self._file = None
        self._cache: OrderedDict = OrderedDict()

    def _open(self):
        import tifffile

        if self._file is None:
            self._file = tifffile.TiffFile(self.path)
            self._pages = [level.keyframe for level in self._file.series[0].levels]
        return self._file

    def _tile(self, level: int, index: int) -> np.ndarray:
        key = (level, index)
        if key not in self._cache:
            page, handle = self._pages[level], self._open().filehandle
            handle.seek(page.dataoffsets[index])
            segment, _, _ = page.decode(handle.read(page.databytecounts[index]), index)
            self._cache[key] = segment[0]
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return self._cache[key]

    def read_region(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """(height, width, 3) uint8 at ``level`` from its px (x, y), white beyond the image."""
        self._open()
        page = self._pages[level]
        tw, th = page.tilewidth, page.tilelength
        across = -(-page.imagewidth // tw)
        out = np.full((height, width, 3), GLASS, np.uint8)
        x1, y1 = min(x + width, page.imagewidth), min(y + height, page.imagelength)
        if x1 <= max(0, x) or y1 <= max(0, y):
            return out
        for row in range(max(0, y) // th, max(0, y1 - 1) // th + 1):
            for col in range(max(0, x) // tw, max(0, x1 - 1) // tw + 1):
                tile = self._tile(level, row * across + col)
                tx, ty = col * tw, row * th
                sx0, sy0, sx1, sy1 = max(x, tx), max(y, ty), min(x1, tx + tw), min(y1, ty + th)
                if sx1 > sx0 and sy1 > sy0:
                    out[sy0 - y:sy1 - y, sx0 - x:sx1 - x] = tile[sy0 - ty:sy1 - ty, sx0 - tx:sx1 - tx, :3]
        return out

    def read_patch(self, x0: float, y0: float, size: int, target_mpp: float) -> np.ndarray:
        """(size, size, 3) uint8 at ``target_mpp`` from level-0 origin (x0, y0): read from the coarsest
        level no coarser than the target, resized (area) when that level's mpp differs."""
        self._open()
        level = max(i for i in range(len(self._pages)) if self.mpp * 2**i <= target_mpp * (1 + 1e-6))
        scale = target_mpp / (self.mpp * 2**level)
        side = int(round(size * scale))
        region = self.read_region(level, int(round(x0 / 2**level)), int(round(y0 / 2**level)), side, side)
        if side != size:
            import cv2

            region = cv2.resize(region, (size, size), interpolation=cv2.INTER_AREA)
        return region


class Patches(torch.utils.data.Dataset):
    """The slide's patches ``repeats`` times over (patch ``i`` is origin ``i mod n``), read at the
    target mpp as (S, S, 3) uint8: one DataLoader pass long enough for any measurement."""

    def __init__(self, slide: TiledSlide, origins: np.ndarray, size: int, target_mpp: float, repeats: int = 1000):
        self.slide, self.origins, self.size, self.target_mpp, self.repeats = slide, origins, size, target_mpp, repeats

    def __len__(self) -> int:
        return len(self.origins) * self.repeats

    def __getitem__(self, i: int) -> torch.Tensor:
        x0, y0 = self.origins[i % len(self.origins)]
        return torch.from_numpy(self.slide.read_patch(x0, y0, self.size, self.target_mpp))


def _loader(dataset: Patches, batch: int, workers: int, prefetch: int, pin: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers, pin_memory=pin,
                                       prefetch_factor=prefetch if workers else None,
                                       persistent_workers=False, shuffle=False)


def _rate(batches, consume, seconds: float, device: torch.device) -> dict:
    """Patches per second of ``consume`` over ``batches`` for ``seconds`` after the first batch."""
    first = next(batches)
    consume(first)
    synchronise(device)
    started, patches = time.perf_counter(), 0
    for batch in batches:
        consume(batch)
        patches += len(batch)
        if time.perf_counter() - started > seconds:
            break
    synchronise(device)
    elapsed = time.perf_counter() - started
    return {"patches": patches, "seconds": elapsed, "patches_per_s": patches / elapsed if elapsed else None}


def _pipeline(dataset: Patches, run, workers: int, sizes: dict, device: torch.device) -> dict:
    """Read rate and delivered rate (read, copy, normalise, encode) with ``workers`` read-ahead processes."""
    pin = device.type == "cuda"
    rows = {}
    for name, consume in (("read", lambda b: None),
                          ("delivered", lambda b: run(b.to(device, non_blocking=True)))):
        batches = iter(_loader(dataset, sizes["batch"], workers, sizes["prefetch"], pin))
        with torch.inference_mode():
            rows[name] = _rate(batches, consume, sizes["seconds_per_config"], device)
        del batches  # stops the workers
    return {"workers": workers, **rows}


def measure(device: str, sizes: dict, budget_s: float) -> dict:
    """Part (b): write the slide, then per worker count the read and delivered rates, and the forward
    rate alone (same model, batch and precision; tiles on the device)."""
    import tempfile

    dev = torch.device(device)
    end = time.perf_counter() + budget_s
    row = registry_rows(Path(sizes.get("registry", REGISTRY)))[sizes.get("model", MODELS["ViT-L"])]
    with tempfile.TemporaryDirectory(dir=sizes.get("workdir")) as tmp:
        slide_path = Path(tmp) / "slide.tif"
        slide = write_slide(slide_path, sizes["slide_px"], sizes["tile"], sizes["levels"], sizes["slide_mpp"],
                            sizes["compression"])
        grid = patch_grid(sizes["slide_px"], sizes["slide_px"], sizes["slide_mpp"], sizes["target_mpp"],
                          row["input_size"])
        origins = patch_origins_level0(grid, np.arange(grid.n_patches))
        dataset = Patches(TiledSlide(slide_path, sizes["slide_mpp"]), origins, row["input_size"], sizes["target_mpp"])
        module = build_module(row, dev, sizes.get("depth"))
        run = forward(module, row, AUTOCAST[row["precision"]] if dev.type == "cuda" else None)
        tiles = torch.randint(0, 256, (sizes["batch"], row["input_size"], row["input_size"], 3), dtype=torch.uint8,
                              device=dev)
        with torch.inference_mode():
            alone = _rate(islice(cycle([tiles]), 10_000), run, sizes["seconds_per_config"], dev)
        configs = []
        for workers in sizes["workers"]:
            if time.perf_counter() + 2 * sizes["seconds_per_config"] > end:
                configs.append({"workers": workers, "skipped": "out of the part's time budget"})
                continue
            configs.append(_pipeline(dataset, run, workers, sizes, dev))
            print(f"part b: {configs[-1]}", flush=True)
    return {"model": row["name"], "timm_model": row["timm_model"], "precision": row["precision"],
            "depth": sizes.get("depth"), "batch": sizes["batch"], "prefetch": sizes["prefetch"], "slide": slide,
            "target_mpp": sizes["target_mpp"], "input_size": row["input_size"], "patches_per_pass": grid.n_patches,
            "reader": "tifffile tile reader with a per-worker tile cache (stands in for tiatoolbox)",
            "zlib": zlib.ZLIB_RUNTIME_VERSION, "forward_alone": alone, "configs": configs}
