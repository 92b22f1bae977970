"""A built-in nucleus detector and classifier that needs no weights: a stand-in for CellViT++.

CellPath-Bench ranks sections by how well nuclei seen on the H&E agree with the Xenium-derived
labels. The paper uses CellViT++ for that; this module gives the same output (``Detections``: nucleus
centres in H&E level-0 px plus a Tcoarse class each) from classical image analysis, so the pipeline
runs end to end without a GPU or downloaded weights. It is much weaker than CellViT++ on real
tissue; use CellViT++ outputs (``cellpath.concordance.cellvit.read_cellvit``) when you have them.

Method, per tile of the slide at its native resolution (level 0), all sizes in µm via the mpp:

1. haematoxylin optical density by colour deconvolution (scikit-image's ``rgb2hed``), smoothed;
2. foreground = haematoxylin above ``threshold_scale`` × the tile's Otsu threshold (with a floor, so
   a tile of glass yields nothing); specks removed, the pale centres of vesicular nuclei filled;
3. touching nuclei split by a watershed on the distance transform, seeded at its maxima; a clump
   larger than ``clump_area_um2`` (a tumour nest) is split along the darker rims of its nuclei
   instead, when that finds more nuclei;
4. per nucleus: area (µm²), minor/major axis ratio, solidity, mean haematoxylin.

Tiles overlap by ``overlap_um``; a nucleus is kept only by the tile whose core holds its centroid,
so none is counted twice. After all tiles, each nucleus is classified by rules on its morphology
(thresholds on ``DetectorConfig``, tuned on the simulated sections):

- elongated (minor/major axis ratio below 0.5) → Stromal/Structural;
- else small, convex and dark (area below 42 µm², solidity at least 0.9, haematoxylin at least
  0.8 × the slide's median nucleus) → Immune/Inflammatory;
- else (large, irregular or pale) → Epithelial/Tumor.

Measured on simulated sections (0.2738 µm/px, 3000 cells): 56-76 % of true nuclei found within
3 µm; three-class balanced accuracy 0.72-0.88 where morphology is class-specific
(``morphology_strength`` 0.9-1), 0.54-0.58 at strength 0.4 and 0.35 (chance: 1/3) at 0, so the score
ranks sections by how informative their morphology is. 3-5 s per 2600 × 2600 px slide on one core.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import ndimage as ndi
from scipy.spatial import ConvexHull
from skimage.color import hed_from_rgb
from skimage.feature import peak_local_max
from skimage.filters import threshold_otsu
from skimage.morphology import remove_small_holes, remove_small_objects
from skimage.segmentation import watershed

from cellpath.annotation.ontology import COARSE_CLASSES
from cellpath.concordance.detections import Detections
from cellpath.errors import InputError
from cellpath.io.wsi import open_slide

EPITHELIAL, IMMUNE, STROMAL = COARSE_CLASSES


@dataclass(frozen=True)
class DetectorConfig:
    """Detector settings. Lengths in µm, areas in µm², optical densities in ``rgb2hed`` units."""

    tile_um: float = 280.0  # side of a tile's core (about 1024 px at 0.27 µm/px)
    overlap_um: float = 16.0  # margin read around each core: more than the widest nucleus radius
    smoothing_um: float = 0.4  # Gaussian sigma applied to the haematoxylin channel
    min_threshold_od: float = 0.015  # floor on the threshold (glass and pale stroma stay empty)
    threshold_scale: float = 1.3  # foreground = haematoxylin > scale × the tile's Otsu threshold
    min_area_um2: float = 4.0  # smaller foreground specks are noise
    max_hole_um2: float = 80.0  # holes up to this size are filled (pale centres of vesicular nuclei)
    seed_spacing_um: float = 2.0  # watershed seeds (distance-transform maxima) at least this far apart
    seed_min_depth_um: float = 0.5  # seeds lie at least this deep inside the foreground
    clump_area_um2: float = 200.0  # larger foreground blobs are clumps of nuclei (tumour nests)
    rim_fine_um: float = 0.8  # clumps: nuclear rims = haematoxylin smoothed at this sigma ...
    rim_coarse_um: float = 2.0  # ... minus haematoxylin smoothed at this sigma ...
    rim_contrast: float = 0.1  # ... above this fraction of the foreground threshold
    clump_seed_spacing_um: float = 3.0  # seed spacing inside clumps split along rims
    max_axis_ratio_stromal: float = 0.5  # minor/major axis below this: elongated (spindle) nucleus
    max_area_immune_um2: float = 42.0  # lymphocytes ~30 µm² (6 µm across), epithelial nuclei ≥ 50 µm²
    min_solidity_immune: float = 0.9  # immune nuclei are convex; clump fragments are not
    min_relative_darkness_immune: float = 0.8  # × the slide's median nucleus haematoxylin


def detect_nuclei(slide_path: Path | str, *, mpp: float | None = None,
                  config: DetectorConfig = DetectorConfig()) -> Detections:
    """Detect and classify the nuclei of one H&E slide; centres in level-0 px.

    ``mpp`` (µm per level-0 px) overrides the slide's own metadata; one of them must exist. The
    detector has no classes finer than Tcoarse: ``label`` repeats ``coarse``.
    """
    path = Path(slide_path)
    try:
        reader = open_slide(path)
    except Exception as exc:  # tiatoolbox raises many types for unreadable slides
        raise InputError(f"cannot open the H&E image ({type(exc).__name__}: {exc})", path=path) from None
    mpp = _slide_mpp(reader, mpp, path)
    width, height = (int(v) for v in reader.info.slide_dimensions)
    core = max(64, int(round(config.tile_um / mpp)))
    margin = int(np.ceil(config.overlap_um / mpp))
    frames = []
    for y0 in range(0, height, core):
        for x0 in range(0, width, core):
            rx0, ry0 = max(0, x0 - margin), max(0, y0 - margin)
            rx1, ry1 = min(width, x0 + core + margin), min(height, y0 + core + margin)
            rgb = reader.read_rect(location=(rx0, ry0), size=(rx1 - rx0, ry1 - ry0), resolution=0, units="level")
            nuclei = tile_nuclei(rgb[..., :3], mpp, config)
            nuclei["x_px"] += rx0
            nuclei["y_px"] += ry0
            owned = ((nuclei["x_px"] >= x0) & (nuclei["x_px"] < x0 + core)
                     & (nuclei["y_px"] >= y0) & (nuclei["y_px"] < y0 + core))
            frames.append(nuclei[owned])
    nuclei = pd.concat(frames, ignore_index=True)
    coarse = classify_nuclei(nuclei, config)
    return Detections(x_px=nuclei["x_px"].to_numpy(float), y_px=nuclei["y_px"].to_numpy(float),
                      label=coarse.copy(), coarse=coarse, n_dropped=0, source=f"builtin detector: {path}")


def _slide_mpp(reader, mpp: float | None, path: Path) -> float:
    if mpp is not None:
        if not np.isfinite(mpp) or mpp <= 0:
            raise InputError(f"mpp must be a positive number of µm per pixel, got {mpp}", path=path)
        return float(mpp)
    native = reader.info.mpp
    if native is None or not np.all(np.isfinite(np.asarray(native, dtype=float))):
        raise InputError("the H&E image has no pixel size (mpp); pass mpp= from the section's table "
                         "(uns['section']['he_mpp'])", path=path)
    return float(np.mean(native))


def haematoxylin_od(rgb: np.ndarray) -> np.ndarray:
    """Haematoxylin channel of scikit-image's ``rgb2hed`` for an (H, W, 3) uint8 RGB image.

    Computed as ``rgb2hed`` does (Ruifrok–Johnston deconvolution with ``hed_from_rgb``), through a
    256-entry table of each channel's optical density: the same values, several times faster.
    """
    levels = np.maximum(np.arange(256) / 255.0, 1e-6)
    density = (np.log(levels) / np.log(1e-6)).astype(np.float32)
    weights = hed_from_rgb[:, 0].astype(np.float32)
    haematoxylin = density[rgb[..., 0]] * weights[0]
    haematoxylin += density[rgb[..., 1]] * weights[1]
    haematoxylin += density[rgb[..., 2]] * weights[2]
    return np.maximum(haematoxylin, 0, out=haematoxylin)


_TRUNCATE = 2.5  # Gaussian kernels end at this many sigmas


def segment_nuclei(haematoxylin: np.ndarray, mpp: float, config: DetectorConfig = DetectorConfig()) -> np.ndarray:
    """Label image of nuclei (0 = background) from a haematoxylin OD image at ``mpp`` µm/px.

    Foreground blobs are split by a watershed on their distance transform. A clump (a blob larger
    than ``clump_area_um2``) is instead split along the darker rims of its nuclei, as in tumour
    nests, when that yields more seeds than its distance transform does.
    """
    smooth = ndi.gaussian_filter(haematoxylin, config.smoothing_um / mpp, truncate=_TRUNCATE)
    threshold = max(config.min_threshold_od, config.threshold_scale * _otsu(smooth[::4, ::4]))
    stained = smooth > threshold
    foreground = remove_small_holes(stained, max_size=int(config.max_hole_um2 / mpp**2))
    foreground = remove_small_objects(foreground, max_size=int(config.min_area_um2 / mpp**2))
    distance = _smoothed_distance(foreground)
    seeds = _seeds(distance, config.seed_spacing_um, mpp, config)
    seeds = _split_clumps(haematoxylin, stained, foreground, threshold, distance, seeds, mpp, config)
    markers = np.zeros(distance.shape, dtype=np.int32)
    markers[tuple(seeds.T)] = np.arange(1, len(seeds) + 1)
    labels = watershed(-distance, markers, mask=foreground)
    seedless, _ = ndi.label(foreground & (labels == 0))  # blobs no seed reached: one nucleus each
    labels[seedless > 0] = seedless[seedless > 0] + len(seeds)
    return labels


def _split_clumps(haematoxylin: np.ndarray, stained: np.ndarray, foreground: np.ndarray, threshold: float,
                  distance: np.ndarray, seeds: np.ndarray, mpp: float, config: DetectorConfig) -> np.ndarray:
    """Seeds after re-seeding clumps along their nuclear rims where that finds more nuclei.

    For such clumps ``distance`` is overwritten in place with the distance map of their interiors,
    so that the watershed follows the rims.
    """
    blobs, _ = ndi.label(foreground)
    seed_blob = blobs[tuple(seeds.T)]
    keep, extra = np.ones(len(seeds), dtype=bool), []
    pad = int(np.ceil(_TRUNCATE * config.rim_coarse_um / mpp))
    for index, box in enumerate(ndi.find_objects(blobs)):
        if np.count_nonzero(blobs[box] == index + 1) * mpp**2 <= config.clump_area_um2:
            continue
        window = tuple(slice(max(0, b.start - pad), b.stop + pad) for b in box)
        inside = blobs[window] == index + 1
        rim_distance, rim_seeds = _split_along_rims(haematoxylin[window], inside & stained[window], threshold,
                                                    mpp, config)
        if len(rim_seeds) > np.count_nonzero(seed_blob == index + 1):
            distance[window][inside] = rim_distance[inside]
            keep &= seed_blob != index + 1
            extra.append(rim_seeds + [window[0].start, window[1].start])
    return np.concatenate([seeds[keep], *extra])


def _split_along_rims(haematoxylin: np.ndarray, stained_clump: np.ndarray, threshold: float, mpp: float,
                      config: DetectorConfig) -> tuple[np.ndarray, np.ndarray]:
    """Distance map of a clump's nuclear interiors (its stained pixels minus rims) and their seeds.

    Filled gaps between nuclei are not stained, so they seed nothing. Seeds are (row, col).
    """
    fine = ndi.gaussian_filter(haematoxylin, config.rim_fine_um / mpp, truncate=_TRUNCATE)
    coarse = ndi.gaussian_filter(haematoxylin, config.rim_coarse_um / mpp, truncate=_TRUNCATE)
    rims = fine - coarse > config.rim_contrast * threshold
    distance = _smoothed_distance(stained_clump & ~rims)
    return distance, _seeds(distance, config.clump_seed_spacing_um, mpp, config)


def _smoothed_distance(mask: np.ndarray) -> np.ndarray:
    """Distance (px) to the background, lightly smoothed so ridges have one maximum.

    The octagonal distance (mean of the chessboard and city-block distances) is within 8 % of the
    Euclidean one and several times faster to compute.
    """
    octagonal = (ndi.distance_transform_cdt(mask, metric="chessboard").astype(np.float32)
                 + ndi.distance_transform_cdt(mask, metric="taxicab")) / 2
    return ndi.gaussian_filter(octagonal, 1.0, truncate=_TRUNCATE)


def _seeds(distance: np.ndarray, spacing_um: float, mpp: float, config: DetectorConfig) -> np.ndarray:
    """(K, 2) row, col of distance-transform maxima at least ``spacing_um`` apart."""
    peaks = peak_local_max(distance, min_distance=max(1, int(round(spacing_um / mpp))),
                           threshold_abs=config.seed_min_depth_um / mpp, exclude_border=False)
    return peaks.reshape(-1, 2).astype(np.intp)


def _otsu(image: np.ndarray) -> float:
    return float(threshold_otsu(image)) if image.max() > image.min() else float(image.max())


def tile_nuclei(rgb: np.ndarray, mpp: float, config: DetectorConfig = DetectorConfig()) -> pd.DataFrame:
    """Segment an (H, W, 3) uint8 RGB tile at ``mpp`` µm/px and measure its nuclei (``measure_nuclei``)."""
    haematoxylin = haematoxylin_od(rgb)
    return measure_nuclei(segment_nuclei(haematoxylin, mpp, config), haematoxylin, mpp)


def measure_nuclei(labels: np.ndarray, haematoxylin: np.ndarray, mpp: float) -> pd.DataFrame:
    """One row per label: position, size, shape and stain of each nucleus.

    Columns: x_px, y_px (centroid, px of the tile, pixel centres at +0.5), area_um2, major_um,
    minor_um (full axes of the ellipse with the same second moments, µm), axis_ratio (minor/major,
    1 = round), solidity (area / convex hull area) and haematoxylin (mean OD).
    """
    pixels = np.flatnonzero(labels)
    ids = labels.ravel()[pixels]
    n = int(ids.max(initial=0)) + 1
    area = np.bincount(ids, minlength=n)[1:].astype(float)
    present = area > 0
    if not present.any():
        return pd.DataFrame({c: np.empty(0) for c in _MEASURES})
    ys, xs = np.divmod(pixels, labels.shape[1])

    def mean(values: np.ndarray) -> np.ndarray:
        return np.bincount(ids, weights=values, minlength=n)[1:] / np.maximum(area, 1)

    cx, cy = mean(xs.astype(np.float64)), mean(ys.astype(np.float64))
    mu20, mu02, mu11 = mean(xs * xs) - cx**2, mean(ys * ys) - cy**2, mean(xs * ys) - cx * cy
    half_trace, spread = (mu20 + mu02) / 2, np.sqrt(((mu20 - mu02) / 2) ** 2 + mu11**2)
    major = 4 * np.sqrt(np.maximum(half_trace + spread, 0))
    minor = 4 * np.sqrt(np.maximum(half_trace - spread, 0))
    frame = pd.DataFrame({
        "x_px": cx + 0.5, "y_px": cy + 0.5, "area_um2": area * mpp**2, "major_um": major * mpp,
        "minor_um": minor * mpp, "axis_ratio": np.divide(minor, major, out=np.ones_like(major), where=major > 0),
        "solidity": area / _convex_areas(labels, n - 1),
        "haematoxylin": mean(haematoxylin.ravel()[pixels].astype(np.float64)),
    })
    return frame[present].reset_index(drop=True)


_MEASURES = ("x_px", "y_px", "area_um2", "major_um", "minor_um", "axis_ratio", "solidity", "haematoxylin")


def _convex_areas(labels: np.ndarray, n: int) -> np.ndarray:
    """Convex hull area (px²) of each label 1..n, over its pixels as unit squares (1 where absent)."""
    areas = np.ones(n)
    for index, box in enumerate(ndi.find_objects(labels, max_label=n)):
        if box is None:
            continue
        mask = labels[box] == index + 1
        rows = np.flatnonzero(mask.any(axis=1))
        first = mask[rows].argmax(axis=1)
        last = mask.shape[1] - mask[rows, ::-1].argmax(axis=1)
        corners = np.empty((4 * len(rows), 2))  # outer corners of each row's first and last pixel
        corners[:, 0] = np.concatenate([first, first, last, last])
        corners[:, 1] = np.concatenate([rows, rows + 1, rows, rows + 1])
        areas[index] = ConvexHull(corners).volume
    return areas


def classify_nuclei(nuclei: pd.DataFrame, config: DetectorConfig = DetectorConfig()) -> np.ndarray:
    """Tcoarse class per nucleus of one slide from its morphology (rules in the module docstring).

    Darkness is relative to the slide's median nucleus, so the rules hold across stain intensities.
    """
    if len(nuclei) == 0:
        return np.array([], dtype=object)
    darkness = nuclei["haematoxylin"].to_numpy() / max(float(nuclei["haematoxylin"].median()), 1e-9)
    elongated = nuclei["axis_ratio"].to_numpy() < config.max_axis_ratio_stromal
    small_round_dark = ((nuclei["area_um2"].to_numpy() < config.max_area_immune_um2)
                        & (nuclei["solidity"].to_numpy() >= config.min_solidity_immune)
                        & (darkness >= config.min_relative_darkness_immune))
    return np.where(elongated, STROMAL, np.where(small_round_dark, IMMUNE, EPITHELIAL)).astype(object)
