"""Nuclear and cytoplasmic morphology per cell type, and per-cell draws.

Sizes in µm. ``darkness`` is haematoxylin optical density at the nucleus centre; ``eosin`` the
cytoplasm's eosin optical density. ``morphology_strength`` s ∈ [0, 1] blends every type's
parameters towards the panel-wide average (s = 0: all nuclei alike), which is how the simulator
makes some sections' morphology less informative than others'.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from cellpath.annotation.ontology import cell_type


@dataclass(frozen=True)
class Morphology:
    """Mean appearance of one cell type (µm, optical densities, dimensionless shape factors)."""

    radius: float  # nuclear semi-major axis
    radius_sd: float  # pleomorphism: SD of the semi-major axis across cells
    aspect: float  # minor / major axis
    darkness: float  # haematoxylin OD
    texture: float  # chromatin granularity (0 smooth … 1 coarse)
    lobes: int  # 1 = single nucleus; 2-4 = lobed (granulocytes)
    nucleolus: float  # prominence of a dark central nucleolus
    cytoplasm: float  # cytoplasm radius / nuclear radius
    eosin: float  # cytoplasm eosin OD
    eccentricity: float  # nucleus offset from the cell centre, in nuclear radii
    vacuole: float = 0.0  # clear vacuole radius (µm), adipocytes
    anucleate: bool = False  # erythrocytes


_BY_FINE: dict[str, Morphology] = {
    "Lymphocyte": Morphology(3.1, 0.25, 0.92, 1.05, 0.25, 1, 0.0, 1.25, 0.15, 0.0),
    "Plasma cell": Morphology(3.2, 0.3, 0.85, 0.85, 0.7, 1, 0.0, 2.1, 0.55, 0.55),
    "Neutrophil": Morphology(1.7, 0.2, 0.9, 1.0, 0.1, 3, 0.0, 2.6, 0.3, 0.0),
    "Macrophage/Histiocyte": Morphology(4.6, 0.6, 0.65, 0.5, 0.35, 1, 0.0, 3.0, 0.45, 0.2),
    "Fibroblast/Stromal cell": Morphology(5.8, 0.9, 0.3, 0.7, 0.2, 1, 0.0, 1.15, 0.28, 0.0),
    "Endothelial/Vessel-associated": Morphology(5.2, 0.7, 0.27, 0.62, 0.2, 1, 0.0, 1.1, 0.25, 0.0),
    "Smooth muscle/Muscle": Morphology(7.0, 0.9, 0.26, 0.5, 0.2, 1, 0.0, 1.9, 0.8, 0.0),
    "Neoplastic": Morphology(6.6, 1.6, 0.74, 0.78, 0.65, 1, 0.8, 1.9, 0.42, 0.1),
    "Non-neoplastic epithelial/parenchymal": Morphology(4.4, 0.45, 0.8, 0.55, 0.3, 1, 0.2, 2.1, 0.5, 0.1),
}
_BY_TYPE: dict[str, Morphology] = {
    "Hepatocyte": replace(_BY_FINE["Non-neoplastic epithelial/parenchymal"], radius=4.6, aspect=0.9,
                          cytoplasm=3.0, eosin=0.7, nucleolus=0.5),
    "Keratinocyte": replace(_BY_FINE["Non-neoplastic epithelial/parenchymal"], cytoplasm=2.4, eosin=0.65),
    "Goblet cell": replace(_BY_FINE["Non-neoplastic epithelial/parenchymal"], aspect=0.55, eosin=0.15),
    "Mast cell": Morphology(4.0, 0.4, 0.9, 0.75, 0.3, 1, 0.0, 2.0, 0.7, 0.0),
    "Eosinophil": Morphology(2.0, 0.2, 0.9, 0.95, 0.1, 2, 0.0, 2.5, 1.0, 0.0),
    "Basophil": Morphology(2.0, 0.2, 0.9, 1.0, 0.1, 2, 0.0, 2.4, 0.6, 0.0),
    "Dendritic cell": Morphology(4.6, 0.7, 0.55, 0.55, 0.3, 1, 0.0, 2.2, 0.3, 0.1),
    "Plasmacytoid DC": Morphology(3.8, 0.4, 0.8, 0.7, 0.3, 1, 0.0, 1.8, 0.35, 0.3),
    "Adipocyte": Morphology(4.2, 0.4, 0.3, 0.7, 0.1, 1, 0.0, 1.0, 0.2, 0.0, vacuole=18.0),
    "Erythrocyte": Morphology(3.6, 0.2, 0.95, 0.0, 0.0, 1, 0.0, 1.0, 1.1, 0.0, anucleate=True),
    "Schwann cell": Morphology(5.5, 0.6, 0.35, 0.6, 0.2, 1, 0.0, 1.5, 0.3, 0.0),
    "Mitotic cell": Morphology(5.0, 0.8, 0.5, 1.4, 0.9, 1, 0.0, 1.8, 0.4, 0.0),
    "Apoptotic cell": Morphology(2.6, 0.5, 0.95, 1.5, 0.0, 1, 0.0, 1.8, 0.7, 0.0),
    "Necrotic cell": Morphology(2.8, 0.8, 0.8, 0.6, 0.8, 2, 0.0, 1.5, 0.6, 0.0),
}
_FALLBACK = _BY_FINE["Non-neoplastic epithelial/parenchymal"]


def type_morphology(name: str) -> Morphology:
    """Mean morphology of an ontology type: its own entry, else its Tfine class's."""
    if name in _BY_TYPE:
        return _BY_TYPE[name]
    fine = cell_type(name).fine
    return _BY_FINE.get(fine, _FALLBACK) if fine else _FALLBACK


_BLENDED = ("radius", "radius_sd", "aspect", "darkness", "texture", "nucleolus", "cytoplasm", "eosin", "eccentricity")


def _panel_average() -> dict[str, float]:
    entries = list(_BY_FINE.values())
    return {f: float(np.mean([getattr(e, f) for e in entries])) for f in _BLENDED}


def blended_morphology(name: str, strength: float) -> Morphology:
    """Type morphology pulled towards the panel average: strength 1 = distinct, 0 = all alike."""
    own = type_morphology(name)
    average = _panel_average()
    values = {f: strength * getattr(own, f) + (1 - strength) * average[f] for f in _BLENDED}
    lobes = own.lobes if strength >= 0.5 else 1
    return replace(own, lobes=lobes, **values)


@dataclass(frozen=True)
class NucleusDraws:
    """Per-cell draws (arrays of length N): semi-axes (µm), darkness, texture, lobes, cytoplasm …"""

    major: np.ndarray
    minor: np.ndarray
    darkness: np.ndarray
    texture: np.ndarray
    lobes: np.ndarray
    nucleolus: np.ndarray
    cytoplasm_radius: np.ndarray
    eosin: np.ndarray
    offset: np.ndarray  # (N, 2) nucleus offset from the cell centre, µm
    vacuole: np.ndarray
    anucleate: np.ndarray

    @property
    def nucleus_area(self) -> np.ndarray:
        area = np.pi * self.major * self.minor
        return np.where(self.anucleate, 0.0, area)


def draw_nuclei(cell_types: np.ndarray, strength: float, rng: np.random.Generator) -> NucleusDraws:
    """Draw per-cell morphology for an array of ontology type names."""
    n = len(cell_types)
    out = {f.name: np.zeros(n) for f in fields(NucleusDraws) if f.name != "offset"}
    out["offset"] = np.zeros((n, 2))
    for name in np.unique(cell_types):
        idx = np.flatnonzero(cell_types == name)
        m = blended_morphology(str(name), strength)
        k = len(idx)
        major = np.clip(rng.normal(m.radius, m.radius_sd, k), 1.2, 14.0)
        aspect = np.clip(rng.normal(m.aspect, 0.06 + 0.1 * m.radius_sd / max(m.radius, 1e-6), k), 0.15, 1.0)
        out["major"][idx] = major
        out["minor"][idx] = major * aspect
        out["darkness"][idx] = np.clip(rng.normal(m.darkness, 0.08, k), 0.0, 2.0)
        out["texture"][idx] = m.texture
        out["lobes"][idx] = m.lobes
        out["nucleolus"][idx] = m.nucleolus
        out["cytoplasm_radius"][idx] = major * m.cytoplasm * rng.uniform(0.9, 1.1, k)
        out["eosin"][idx] = np.clip(rng.normal(m.eosin, 0.05, k), 0.0, 1.5)
        direction = rng.uniform(0, 2 * np.pi, k)
        out["offset"][idx] = m.eccentricity * major[:, None] * np.column_stack([np.cos(direction), np.sin(direction)])
        out["vacuole"][idx] = m.vacuole * rng.uniform(0.8, 1.2, k) if m.vacuole else 0.0
        out["anucleate"][idx] = float(m.anucleate)
    out["lobes"] = out["lobes"].astype(int)
    out["anucleate"] = out["anucleate"].astype(bool)
    return NucleusDraws(**out)


NUCLEUS_GROWTH = 0.5  # a nucleus of proliferation score p has its semi-axes × (1 + NUCLEUS_GROWTH · p)
DARKENING = 0.8      # ... and its haematoxylin OD + DARKENING · p (at most 2.0)


def proliferating(draws: NucleusDraws, score: np.ndarray) -> NucleusDraws:
    """The nuclei of cells with proliferation score ``score`` (n,), in [0, 1]: larger and darker
    (replicating chromatin), whatever their type; anucleate cells are unchanged."""
    growth = np.where(draws.anucleate, 1.0, 1.0 + NUCLEUS_GROWTH * score)
    return replace(draws, major=draws.major * growth, minor=draws.minor * growth,
                   darkness=np.where(draws.anucleate, draws.darkness,
                                     np.minimum(draws.darkness + DARKENING * score, 2.0)))
