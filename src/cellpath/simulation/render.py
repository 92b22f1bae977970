"""Render a simulated section as an H&E image (Beer–Lambert stain mixing, then acquisition effects).

Everything is drawn in H&E level-0 px. Haematoxylin and eosin concentration maps are built from
the tissue background (stroma fibres, muscle, lumens, glass) and per-cell stamps (cytoplasm,
vacuoles, nuclei with chromatin texture, lobes and nucleoli), then mixed with the section's stain
vectors into optical density, blurred, given noise and quantised to 8-bit RGB.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from cellpath.simulation.morphology import NucleusDraws
from cellpath.simulation.tissue import TissueMap

# Reference stain OD vectors (Ruifrok & Johnston), RGB.
HAEMATOXYLIN_OD = np.array([0.650, 0.704, 0.286])
EOSIN_OD = np.array([0.072, 0.990, 0.105])

BACKGROUND_EOSIN = {
    "stroma": 0.32, "muscle": 0.5, "tumour_nest": 0.22, "gland_epithelium": 0.2, "epidermis": 0.28,
    "lymphoid": 0.12, "follicle": 0.12, "plasma_rich": 0.18, "inflamed": 0.2, "hepatic_plate": 0.4,
    "alveolar": 0.06, "vessel_endothelium": 0.25, "vessel_media": 0.45, "vessel_lumen": 0.05,
    "adipose": 0.02, "lumen": 0.03, "glass": 0.0,
}
FIBROUS = {"stroma", "muscle", "vessel_media"}
ACQUIRE_BAND_ROWS = 1024  # image rows turned into RGB at once (+ the blur's halo), × width × 3 × 8 bytes


@dataclass(frozen=True)
class Acquisition:
    """One section's scan and stain: the confounder the robustness metrics look for."""

    haematoxylin_od: np.ndarray  # (3,) unit OD vector
    eosin_od: np.ndarray  # (3,)
    haematoxylin_scale: float
    eosin_scale: float
    background_od: np.ndarray  # (3,) glass tint
    blur_sigma_px: float
    noise_sd: float  # 8-bit grey levels
    illumination_tilt: float  # fractional brightness change across the slide

    def as_dict(self) -> dict:
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in self.__dict__.items()}


def draw_acquisition(rng: np.random.Generator, variation: float) -> Acquisition:
    """Per-section stain hue/intensity, blur, noise and illumination; ``variation`` scales them all."""

    def unit(v: np.ndarray) -> np.ndarray:
        v = np.clip(v, 0.01, None)
        return v / np.sqrt(np.sum(v * v))  # not np.linalg.norm: BLAS, whose kernel depends on the CPU

    return Acquisition(
        haematoxylin_od=unit(HAEMATOXYLIN_OD + rng.normal(0, 0.07 * variation, 3)),
        eosin_od=unit(EOSIN_OD + rng.normal(0, 0.07 * variation, 3)),
        haematoxylin_scale=float(np.exp(rng.normal(0, 0.18 * variation))),
        eosin_scale=float(np.exp(rng.normal(0, 0.22 * variation))),
        background_od=np.abs(rng.normal(0.04, 0.02 * variation, 3)),
        blur_sigma_px=float(np.clip(0.5 + abs(rng.normal(0, 0.45 * variation)), 0.3, 2.5)),
        noise_sd=float(np.clip(2.0 + abs(rng.normal(0, 2.0 * variation)), 0.5, 10.0)),
        illumination_tilt=float(rng.normal(0, 0.04 * variation)),
    )


def _background(tmap: TissueMap, he_to_um: np.ndarray, shape: tuple[int, int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Eosin and haematoxylin background at half resolution, upsampled to ``shape``."""
    half = ((shape[0] + 1) // 2, (shape[1] + 1) // 2)
    ys, xs = np.mgrid[0:half[0], 0:half[1]].astype(np.float32) * 2.0 + 0.5
    um_x = he_to_um[0, 0] * xs + he_to_um[0, 1] * ys + he_to_um[0, 2]
    um_y = he_to_um[1, 0] * xs + he_to_um[1, 1] * ys + he_to_um[1, 2]
    n = tmap.compartment.shape[0]
    col = np.clip((um_x / tmap.resolution_um).astype(np.int32), 0, n - 1)
    row = np.clip((um_y / tmap.resolution_um).astype(np.int32), 0, n - 1)
    outside = (um_x < 0) | (um_y < 0) | (um_x >= tmap.field_um) | (um_y >= tmap.field_um)
    comp = tmap.compartment[row, col]
    eosin_lut = np.array([BACKGROUND_EOSIN.get(name, 0.2) for name in tmap.names], dtype=np.float32)
    fibrous_lut = np.array([name in FIBROUS for name in tmap.names])
    eosin = eosin_lut[comp]
    angle = tmap.flow_angle[row, col]
    phase = 1.5 * ndimage.gaussian_filter(rng.standard_normal(half).astype(np.float32), 3.0) * 6.0
    fibres = np.abs(np.sin(2 * np.pi * (-um_x * np.sin(angle) + um_y * np.cos(angle)) / 5.0 + phase))
    texture = 0.65 + 0.7 * fibres
    eosin = np.where(fibrous_lut[comp], eosin * texture, eosin * (0.85 + 0.3 * fibres))
    eosin[outside | (comp == tmap.names.index("glass"))] = 0.0
    haematoxylin = np.where(eosin > 0.03, 0.03, 0.0).astype(np.float32)
    zoom = (shape[0] / half[0], shape[1] / half[1])
    return (ndimage.zoom(eosin.astype(np.float32), zoom, order=1)[: shape[0], : shape[1]],
            ndimage.zoom(haematoxylin, zoom, order=1)[: shape[0], : shape[1]])


def _ellipse_window(cx: float, cy: float, a: float, b: float, angle: float, shape: tuple[int, int], pad: float = 2.0):
    """Window around an ellipse and each pixel's normalised radius (1 = on the outline)."""
    reach = a + pad
    x0, x1 = max(0, int(cx - reach)), min(shape[1], int(cx + reach) + 2)
    y0, y1 = max(0, int(cy - reach)), min(shape[0], int(cy + reach) + 2)
    if x1 <= x0 or y1 <= y0:
        return None
    ys, xs = np.mgrid[y0:y1, x0:x1]
    dx, dy = xs + 0.5 - cx, ys + 0.5 - cy
    c, s = np.cos(angle), np.sin(angle)
    u, v = (dx * c + dy * s) / a, (-dx * s + dy * c) / b
    return (slice(y0, y1), slice(x0, x1)), np.sqrt(u * u + v * v)


def _soft(radius: np.ndarray, edge_px: float, size_px: float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp((radius - 1.0) * size_px / edge_px))


def render_section(
    tmap: TissueMap,
    he_to_um: np.ndarray,
    shape: tuple[int, int],
    nucleus_px: np.ndarray,
    angle_px: np.ndarray,
    draws: NucleusDraws,
    he_mpp: float,
    acquisition: Acquisition,
    rng: np.random.Generator,
) -> np.ndarray:
    """Render the section to an (H, W, 3) uint8 RGB image.

    ``he_to_um`` is the 3×3 affine H&E px → tissue µm; ``nucleus_px`` the true nucleus centres
    (H&E px) and ``angle_px`` their major-axis angles in the H&E frame (radians).
    """
    eosin, haematoxylin = _background(tmap, he_to_um, shape, rng)
    chromatin = ndimage.gaussian_filter(rng.standard_normal(shape, dtype=np.float32), 0.8)
    chromatin /= chromatin.std() + 1e-6
    px = 1.0 / he_mpp
    order = np.argsort(-draws.cytoplasm_radius, kind="stable")  # big cells first, small on top
    for i in order:
        _paint_cell(i, nucleus_px[i], angle_px[i], draws, px, chromatin, eosin, haematoxylin)
    return acquire(haematoxylin, eosin, acquisition, rng)


def _paint_cell(i: int, centre_px: np.ndarray, angle: float, draws: NucleusDraws, px: float, chromatin: np.ndarray,
                eosin: np.ndarray, haematoxylin: np.ndarray) -> None:
    """Paint cell ``i`` (nucleus centre in H&E px, major-axis angle in radians; ``px``: H&E px per µm)
    into the eosin and haematoxylin density maps, in place: vacuole, cytoplasm, then nucleus lobes."""
    shape = eosin.shape
    cx, cy = centre_px
    major, minor = draws.major[i] * px, draws.minor[i] * px
    if draws.vacuole[i] > 0:
        direction = np.array([np.cos(angle + np.pi / 2), np.sin(angle + np.pi / 2)])
        vcx, vcy = np.array([cx, cy]) - direction * (draws.vacuole[i] * px + minor)
        win = _ellipse_window(vcx, vcy, draws.vacuole[i] * px, draws.vacuole[i] * px, 0.0, shape)
        if win is not None:
            sl, r = win
            ring = np.exp(-(((r - 1.0) * draws.vacuole[i] * px) ** 2) / 2.0)
            eosin[sl] = np.where(r < 1.0, 0.0, eosin[sl]) + 0.25 * ring
            haematoxylin[sl] = np.where(r < 1.0, 0.0, haematoxylin[sl])
    cyto = draws.cytoplasm_radius[i] * px
    cyto_aspect = max(minor / major, 0.45)
    centre = np.array([cx, cy]) - draws.offset[i] * px
    win = _ellipse_window(centre[0], centre[1], cyto, cyto * cyto_aspect, angle, shape)
    if win is not None:
        sl, r = win
        eosin[sl] = np.maximum(eosin[sl], draws.eosin[i] * _soft(r, 1.2, cyto))
    if draws.anucleate[i]:
        return
    lobes = draws.lobes[i]
    if lobes == 1:
        centres = [(cx, cy)]
    else:
        step = 1.5 * major
        offsets = (np.arange(lobes) - (lobes - 1) / 2) * step
        bend = 0.35 * step * (np.arange(lobes) - (lobes - 1) / 2) ** 2
        c, s = np.cos(angle), np.sin(angle)
        centres = [(cx + o * c - b * s, cy + o * s + b * c) for o, b in zip(offsets, bend)]
    for lx, ly in centres:
        win = _ellipse_window(lx, ly, major, minor, angle, shape)
        if win is None:
            continue
        sl, r = win
        mask = _soft(r, 0.7, minor)
        texture = 1.0 + 0.35 * draws.texture[i] * chromatin[sl]
        rim = 1.0 + 0.5 * draws.nucleolus[i] * np.exp(-((r - 0.9) ** 2) / 0.02)
        pale_centre = 1.0 - 0.35 * draws.nucleolus[i] * (r < 0.75)
        value = draws.darkness[i] * mask * texture * rim * pale_centre
        if draws.nucleolus[i] > 0:
            value += 0.9 * draws.nucleolus[i] * np.exp(-(r**2) / 0.03) * mask
        haematoxylin[sl] = np.maximum(haematoxylin[sl], value)
        eosin[sl] *= 1.0 - 0.6 * mask


def acquire(haematoxylin: np.ndarray, eosin: np.ndarray, acquisition: Acquisition, rng: np.random.Generator,
            band_rows: int = ACQUIRE_BAND_ROWS) -> np.ndarray:
    """Stain concentrations → 8-bit RGB through the section's stain vectors, blur, tilt and noise.

    Computed ``band_rows`` image rows at a time, each band with enough rows of its neighbours for the
    blur, so memory is one band's optical density rather than the section's (float64 at 24 bytes per
    px: 17.8 GB for the 742 Mpx of a section of the paper's size). Every pixel is what a whole-image
    computation gives, bit for bit: the blur's rows outside the halo are never kept, and the noise is
    drawn band after band in the whole image's row order.
    """
    height = haematoxylin.shape[0]
    sigma = acquisition.blur_sigma_px
    halo = int(4.0 * sigma + 0.5) if sigma > 0 else 0  # ndimage.gaussian_filter's radius (truncate 4)
    tilt = 1.0 + acquisition.illumination_tilt * np.linspace(-1, 1, haematoxylin.shape[1], dtype=np.float32)
    rgb = np.empty((*haematoxylin.shape, 3), dtype=np.uint8)
    for top in range(0, height, band_rows):
        bottom = min(top + band_rows, height)
        lo, hi = max(0, top - halo), min(height, bottom + halo)
        od = (
            haematoxylin[lo:hi, :, None] * (acquisition.haematoxylin_scale * acquisition.haematoxylin_od)
            + eosin[lo:hi, :, None] * (acquisition.eosin_scale * acquisition.eosin_od)
            + acquisition.background_od
        ).astype(np.float32)
        if sigma > 0:
            od = ndimage.gaussian_filter(od, sigma=(sigma, sigma, 0))
        band = np.float32(255.0) * np.exp(-od[top - lo: top - lo + (bottom - top)])
        band *= tilt[None, :, None]
        band += np.float32(acquisition.noise_sd) * rng.standard_normal(band.shape, dtype=np.float32)
        rgb[top:bottom] = np.clip(np.rint(band), 0, 255).astype(np.uint8)
    return rgb
