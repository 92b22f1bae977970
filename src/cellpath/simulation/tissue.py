"""Simulated tissue layout: a compartment map painted from an organ program, and cells placed on it.

All coordinates are in the tissue frame, which is the Xenium frame: µm from the section's origin.
Pure functions of a numpy Generator; nothing here touches disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from cellpath.simulation.programs import COMPARTMENTS, Structure, TissueProgram

MAP_RESOLUTION_UM = 2.0
LATTICE_SPACING_UM = 7.0
TISSUE_MARGIN_UM = 18.0


@dataclass(frozen=True)
class TissueMap:
    """Raster of compartments over a square field of side ``field_um`` (µm), ``resolution_um`` per px.

    ``centre_xy`` holds, per px, the centre (µm) of the structure that painted it (NaN for the
    background); ``flow_angle`` the local fibre direction (radians).
    """

    field_um: float
    resolution_um: float
    names: tuple[str, ...]
    compartment: np.ndarray  # (H, W) int16 index into names
    centre_xy: np.ndarray  # (H, W, 2) float32
    flow_angle: np.ndarray  # (H, W) float32

    def pixel_of(self, xy_um: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.compartment.shape[0]
        col = np.clip((xy_um[:, 0] / self.resolution_um).astype(int), 0, n - 1)
        row = np.clip((xy_um[:, 1] / self.resolution_um).astype(int), 0, n - 1)
        return row, col

    def compartment_at(self, xy_um: np.ndarray) -> np.ndarray:
        row, col = self.pixel_of(xy_um)
        return np.asarray(self.names)[self.compartment[row, col]]


@dataclass(frozen=True)
class CellLayout:
    """Simulated cells: true nucleus centres (µm), ontology type, compartment, major-axis angle (rad)."""

    xy_um: np.ndarray
    cell_type: np.ndarray
    compartment: np.ndarray
    orientation: np.ndarray
    field_um: float


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], sigma_px: float) -> np.ndarray:
    noise = ndimage.gaussian_filter(rng.standard_normal(shape), sigma_px, mode="wrap")
    return noise / (noise.std() + 1e-12)


def _irregular_radius(rng: np.random.Generator, base: float, theta: np.ndarray, roughness: float) -> np.ndarray:
    """A closed, wobbly outline: base radius modulated by a few random angular harmonics."""
    radius = np.ones_like(theta)
    for harmonic in (2, 3, 5):
        radius += roughness / harmonic * rng.standard_normal() * np.cos(harmonic * theta + rng.uniform(0, 2 * np.pi))
    return base * np.clip(radius, 0.5, 1.6)


def _paint_radial(tmap: dict, structure: Structure, rng: np.random.Generator, centre: np.ndarray) -> None:
    """Paint a blob, patch, gland or vessel centred at ``centre`` (µm)."""
    res, names = tmap["res"], tmap["names"]
    radius = rng.uniform(*structure.radius_um)
    outer_extra = structure.ring_um + (0.8 * radius if structure.kind == "vessel" and radius > 9 else 0.0)
    reach = 1.6 * radius + outer_extra + res
    n = tmap["compartment"].shape[0]
    c0, c1 = (max(0, int((centre[i] - reach) / res)) for i in (0, 1))
    e0, e1 = (min(n, int((centre[i] + reach) / res) + 1) for i in (0, 1))
    if e0 <= c0 or e1 <= c1:
        return
    xs = (np.arange(c0, e0) + 0.5) * res - centre[0]
    ys = (np.arange(c1, e1) + 0.5) * res - centre[1]
    dx, dy = np.meshgrid(xs, ys)
    dist = np.hypot(dx, dy)
    theta = np.arctan2(dy, dx)
    roughness = 0.05 if structure.kind == "vessel" else 0.3
    outline = _irregular_radius(rng, radius, theta, roughness)
    window = (slice(c1, e1), slice(c0, e0))
    region = tmap["compartment"][window]
    inside_tissue = region != names.index("glass")
    layers: list[tuple[np.ndarray, str]] = []
    if structure.kind in ("blob", "patch"):
        layers.append((dist < outline, structure.compartment))
    elif structure.kind == "gland":
        layers.append((dist < outline, structure.compartment))
        layers.append((dist < outline - structure.ring_um, structure.inner))
    elif structure.kind == "vessel":
        if outer_extra > structure.ring_um:
            layers.append((dist < outline + outer_extra, "vessel_media"))
        layers.append((dist < outline + structure.ring_um, structure.compartment))
        layers.append((dist < outline, structure.inner))
    else:
        raise ValueError(f"unknown structure kind {structure.kind!r}")
    for mask, compartment in layers:
        mask = mask & inside_tissue
        region[mask] = names.index(compartment)
        tmap["centre"][window][mask] = centre


def _paint_band(tmap: dict, structure: Structure, rng: np.random.Generator) -> None:
    """Paint a strip along one random edge of the field, with a wavy inner border."""
    res, names, field = tmap["res"], tmap["names"], tmap["field"]
    n = tmap["compartment"].shape[0]
    width = rng.uniform(*structure.radius_um)
    side = rng.integers(4)
    coords = (np.arange(n) + 0.5) * res
    along = coords[None, :] if side in (0, 1) else coords[:, None]
    across_idx = coords[:, None] if side in (0, 1) else coords[None, :]
    depth = across_idx - TISSUE_MARGIN_UM if side in (0, 2) else field - TISSUE_MARGIN_UM - across_idx
    wobble = 0.25 * width * np.sin(2 * np.pi * along / rng.uniform(150, 400) + rng.uniform(0, 2 * np.pi))
    mask = (depth < width + wobble) & (tmap["compartment"] != names.index("glass"))
    tmap["compartment"][mask] = names.index(structure.compartment)
    tmap["flow"][mask] = 0.0 if side in (0, 1) else np.pi / 2


def paint_tissue_map(program: TissueProgram, field_um: float, rng: np.random.Generator) -> TissueMap:
    """Paint the compartments of one section onto a square field of side ``field_um`` µm."""
    res = MAP_RESOLUTION_UM
    n = int(np.ceil(field_um / res))
    names = tuple(sorted(set(COMPARTMENTS) | set(program.mixes)))
    compartment = np.full((n, n), names.index(program.background), dtype=np.int16)
    coords = (np.arange(n) + 0.5) * res
    to_edge = np.minimum(coords, field_um - coords)
    edge_distance = np.minimum(to_edge[None, :], to_edge[:, None])
    ragged = TISSUE_MARGIN_UM + 8.0 * _smooth_noise(rng, (n, n), 12.0 / res)
    compartment[edge_distance < ragged] = names.index("glass")
    flow = (np.pi * _smooth_noise(rng, (n, n), 60.0 / res)).astype(np.float32)
    centre = np.full((n, n, 2), np.nan, dtype=np.float32)
    tmap = {"res": res, "names": names, "field": field_um, "compartment": compartment, "centre": centre,
            "flow": flow}
    area_mm2 = (field_um / 1000.0) ** 2
    for structure in program.structures:
        expected = structure.per_mm2 if structure.kind == "band" else structure.per_mm2 * area_mm2
        count = int(expected) + int(rng.random() < expected % 1)  # low-variance count: every section looks its part
        for _ in range(count):
            if structure.kind == "band":
                _paint_band(tmap, structure, rng)
            else:
                _paint_radial(tmap, structure, rng, rng.uniform(0, field_um, size=2))
    return TissueMap(field_um, res, names, compartment, centre, flow)


def _lattice_sites(field_um: float, rng: np.random.Generator) -> np.ndarray:
    steps = np.arange(0.5, field_um / LATTICE_SPACING_UM) * LATTICE_SPACING_UM
    gx, gy = np.meshgrid(steps, steps)
    sites = np.column_stack([gx.ravel(), gy.ravel()])
    return sites + rng.uniform(-0.33, 0.33, size=sites.shape) * LATTICE_SPACING_UM


def _site_density(tmap: TissueMap, sites: np.ndarray) -> np.ndarray:
    density = np.array([COMPARTMENTS[name][0] for name in tmap.names])
    row, col = tmap.pixel_of(sites)
    return density[tmap.compartment[row, col]]


def _orientations(tmap: TissueMap, xy: np.ndarray, compartments: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    row, col = tmap.pixel_of(xy)
    centre = tmap.centre_xy[row, col]
    radial = np.arctan2(xy[:, 1] - centre[:, 1], xy[:, 0] - centre[:, 0])
    modes = np.array([COMPARTMENTS[c][1] for c in compartments])
    angle = rng.uniform(0, np.pi, size=len(xy))
    flow = modes == "flow"
    angle[flow] = tmap.flow_angle[row, col][flow] + rng.normal(0, 0.15, flow.sum())
    has_centre = ~np.isnan(radial)
    tangent = (modes == "tangent") & has_centre
    angle[tangent] = radial[tangent] + np.pi / 2 + rng.normal(0, 0.1, tangent.sum())
    radial_mode = (modes == "radial") & has_centre
    angle[radial_mode] = radial[radial_mode] + rng.normal(0, 0.1, radial_mode.sum())
    return np.mod(angle, np.pi)


def layout_cells(program: TissueProgram, n_cells: int, rng: np.random.Generator) -> tuple[CellLayout, TissueMap]:
    """Place about ``n_cells`` cells on a freshly painted section of the organ program.

    The field is sized from a trial painting so that the expected count matches; the result is
    then subsampled to exactly ``n_cells`` when more sites were accepted (fewer is kept as is).
    """
    trial_field = LATTICE_SPACING_UM * np.sqrt(n_cells / 0.5)
    trial = paint_tissue_map(program, trial_field, rng)
    mean_density = max(_site_density(trial, _lattice_sites(trial_field, rng)).mean(), 0.05)
    field_um = float(LATTICE_SPACING_UM * np.sqrt(n_cells / mean_density) * 1.06)
    tmap = paint_tissue_map(program, field_um, rng)
    sites = _lattice_sites(field_um, rng)
    keep = rng.random(len(sites)) < _site_density(tmap, sites)
    xy = sites[keep]
    if len(xy) > n_cells:
        xy = xy[np.sort(rng.choice(len(xy), n_cells, replace=False))]
    compartments = tmap.compartment_at(xy)
    cell_type = np.empty(len(xy), dtype=object)
    for name in np.unique(compartments):
        mix = program.mixes[name]
        members = np.flatnonzero(compartments == name)
        weights = np.array(list(mix.values()), dtype=float)
        cell_type[members] = rng.choice(np.array(list(mix), dtype=object), size=len(members), p=weights / weights.sum())
    orientation = _orientations(tmap, xy, compartments, rng)
    layout = CellLayout(xy.astype(float), cell_type.astype(str), compartments.astype(str), orientation, field_um)
    return layout, tmap
