"""Organ tissue programs for the simulator: compartments, their cell-type mixes, and structures.

A program says which structures are painted onto a section (tumour nests, glands, lymphoid
aggregates, vessels, muscle bands, epidermis ...) and which ontology types live in each
compartment, with relative weights. Mixed compartments make a cell's neighbourhood informative
about its type without being identical to it. Sizes are in µm; densities are the probability that
a candidate site on the 7 µm jittered lattice holds a cell.
"""

from __future__ import annotations

from dataclasses import dataclass

# Compartment → (density, orientation mode). Orientation: how elongated nuclei are aligned:
# "flow" with the stroma's fibre field, "tangent"/"radial" to the structure's centre, "random".
COMPARTMENTS: dict[str, tuple[float, str]] = {
    "glass": (0.0, "random"),
    "lumen": (0.0, "random"),
    "stroma": (0.42, "flow"),
    "tumour_nest": (0.95, "random"),
    "gland_epithelium": (0.95, "radial"),
    "lymphoid": (1.0, "random"),
    "inflamed": (0.8, "random"),
    "vessel_endothelium": (0.7, "tangent"),
    "vessel_media": (0.8, "tangent"),
    "vessel_lumen": (0.08, "random"),
    "muscle": (0.75, "flow"),
    "epidermis": (0.95, "random"),
    "hepatic_plate": (0.72, "random"),
    "alveolar": (0.38, "tangent"),
    "adipose": (0.05, "random"),
    "portal": (0.7, "flow"),
}

Mix = dict[str, float]

STROMA_BREAST: Mix = {
    "Fibroblast": 0.40, "Cancer associated fibroblast": 0.22, "Macrophage": 0.07, "M2 macrophage": 0.04,
    "CD4 T cell": 0.05, "CD8 T cell": 0.04, "Plasma cell": 0.04, "Mast cell": 0.04, "Dendritic cell": 0.02,
    "Neutrophil": 0.02, "Myofibroblast": 0.04, "B cell": 0.02,
}
LYMPHOID_AGGREGATE: Mix = {
    "CD4 T cell": 0.30, "CD8 T cell": 0.20, "B cell": 0.28, "Regulatory T cell": 0.04, "Plasma cell": 0.07,
    "Macrophage": 0.06, "Dendritic cell": 0.03, "NK cell": 0.02,
}
INFLAMED: Mix = {
    "Neutrophil": 0.42, "Macrophage": 0.18, "M1 macrophage": 0.08, "Plasma cell": 0.12, "CD8 T cell": 0.08,
    "Fibroblast": 0.06, "Eosinophil": 0.04, "Necrotic cell": 0.02,
}
VESSEL_ENDOTHELIUM: Mix = {"Endothelial cell": 0.92, "Lymphatic endothelial": 0.05, "Tip cell": 0.03}
VESSEL_MEDIA: Mix = {"Smooth muscle cell": 0.55, "Pericyte": 0.40, "Fibroblast": 0.05}
VESSEL_LUMEN: Mix = {"Erythrocyte": 0.8, "Neutrophil": 0.1, "Monocyte": 0.1}
MUSCLE: Mix = {"Smooth muscle cell": 0.88, "Fibroblast": 0.06, "Endothelial cell": 0.03, "Macrophage": 0.03}
ADIPOSE: Mix = {"Adipocyte": 0.9, "Endothelial cell": 0.06, "Fibroblast": 0.04}
_BREAST_DUCT: Mix = {"Normal epithelial general": 0.85, "Myofibroblast": 0.10, "Ductal cell": 0.05}
_AIRWAY: Mix = {"Ciliated epithelial": 0.5, "Club cell": 0.45, "Normal epithelial general": 0.05}
_BILE_DUCT: Mix = {"Cholangiocyte": 0.92, "Ductal cell": 0.08}


@dataclass(frozen=True)
class Structure:
    """A kind of structure painted onto the section.

    kind: "blob" (filled irregular disk), "gland" (epithelial ring around a lumen), "vessel" (lumen,
    endothelium and, when large, media), "band" (a strip along one edge) or "patch" (large blob).
    per_mm2: expected structures per mm² of field; for bands, the expected count per section.
    radius_um: range of radii (bands: of widths); ring_um: wall thickness of glands and vessels.
    """

    kind: str
    compartment: str
    per_mm2: float
    radius_um: tuple[float, float]
    ring_um: float = 0.0
    inner: str = "lumen"


@dataclass(frozen=True)
class TissueProgram:
    """What one organ + status looks like: the background compartment, structures, and mixes."""

    organ: str
    status: str
    background: str
    structures: tuple[Structure, ...]
    mixes: dict[str, Mix]


def _vessels(per_mm2: float = 35.0) -> tuple[Structure, ...]:
    return (
        Structure("vessel", "vessel_endothelium", per_mm2, (4.0, 14.0), ring_um=3.5, inner="vessel_lumen"),
    )


def _common_mixes(stroma: Mix) -> dict[str, Mix]:
    return {
        "stroma": stroma, "lymphoid": LYMPHOID_AGGREGATE, "inflamed": INFLAMED,
        "vessel_endothelium": VESSEL_ENDOTHELIUM, "vessel_media": VESSEL_MEDIA, "vessel_lumen": VESSEL_LUMEN,
        "muscle": MUSCLE, "adipose": ADIPOSE,
    }


def _program(organ: str, status: str, background: str, structures: tuple[Structure, ...], stroma: Mix,
             **extra: Mix) -> TissueProgram:
    mixes = _common_mixes(stroma)
    mixes.update(extra)
    return TissueProgram(organ, status, background, structures + _vessels(), mixes)


PROGRAMS: dict[tuple[str, str], TissueProgram] = {}


def _register(program: TissueProgram) -> None:
    PROGRAMS[(program.organ, program.status)] = program


_register(_program(
    "Breast", "Breast cancer", "stroma",
    (Structure("blob", "tumour_nest", 14.0, (35.0, 90.0)),
     Structure("gland", "gland_epithelium", 3.0, (25.0, 40.0), ring_um=11.0),
     Structure("blob", "lymphoid", 2.5, (35.0, 70.0)),
     Structure("patch", "adipose", 0.8, (60.0, 110.0))),
    STROMA_BREAST,
    tumour_nest={"Adenocarcinoma cell": 0.70, "Tumor epithelial general": 0.20, "Mitotic cell": 0.02,
                 "CD8 T cell": 0.04, "Macrophage": 0.04},
    gland_epithelium=_BREAST_DUCT,
))
_register(_program(
    "Breast", "Normal", "stroma",
    (Structure("gland", "gland_epithelium", 10.0, (22.0, 42.0), ring_um=11.0),
     Structure("blob", "lymphoid", 1.5, (30.0, 55.0)),
     Structure("patch", "adipose", 1.5, (70.0, 120.0))),
    {k: v for k, v in STROMA_BREAST.items() if k != "Cancer associated fibroblast"},
    gland_epithelium=_BREAST_DUCT,
))

_COLON_STROMA: Mix = {
    "Fibroblast": 0.30, "Plasma cell": 0.20, "Macrophage": 0.12, "CD4 T cell": 0.10, "CD8 T cell": 0.07,
    "B cell": 0.04, "Eosinophil": 0.04, "Neutrophil": 0.04, "Mast cell": 0.03, "Myofibroblast": 0.04,
    "Dendritic cell": 0.02,
}
_register(_program(
    "Colon", "Colorectal cancer", "stroma",
    (Structure("gland", "tumour_nest", 40.0, (30.0, 65.0), ring_um=22.0),
     Structure("band", "muscle", 1.0, (40.0, 70.0)),
     Structure("blob", "inflamed", 8.0, (25.0, 55.0)),
     Structure("blob", "lymphoid", 1.5, (35.0, 70.0))),
    {**_COLON_STROMA, "Cancer associated fibroblast": 0.15, "Plasma cell": 0.10},
    tumour_nest={"Adenocarcinoma cell": 0.82, "Tumor epithelial general": 0.10, "Mitotic cell": 0.02,
                 "Neutrophil": 0.03, "Apoptotic cell": 0.03},
))
_register(_program(
    "Colon", "Normal", "stroma",
    (Structure("gland", "gland_epithelium", 70.0, (22.0, 32.0), ring_um=14.0),
     Structure("band", "muscle", 1.0, (40.0, 70.0)),
     Structure("blob", "lymphoid", 1.5, (40.0, 80.0))),
    _COLON_STROMA,
    gland_epithelium={"Enterocyte": 0.50, "Goblet cell": 0.38, "Paneth cell": 0.04,
                      "Normal epithelial general": 0.05, "Plasma cell": 0.03},
))

_LUNG_STROMA: Mix = {
    "Fibroblast": 0.38, "Cancer associated fibroblast": 0.12, "Macrophage": 0.10, "Alveolar macrophage": 0.05,
    "Neutrophil": 0.08, "Plasma cell": 0.07, "CD4 T cell": 0.06, "CD8 T cell": 0.05, "B cell": 0.03,
    "Mast cell": 0.03, "Dendritic cell": 0.03,
}
_ALVEOLAR: Mix = {"AT2 cell": 0.38, "Alveolar macrophage": 0.22, "Endothelial cell": 0.22, "Fibroblast": 0.10,
                  "Pericyte": 0.04, "Neutrophil": 0.04}
_register(_program(
    "Lung", "Lung cancer", "alveolar",
    (Structure("patch", "stroma", 1.6, (90.0, 160.0)),
     Structure("blob", "tumour_nest", 14.0, (35.0, 85.0)),
     Structure("blob", "inflamed", 6.0, (25.0, 50.0)),
     Structure("blob", "lymphoid", 2.0, (30.0, 60.0)),
     Structure("gland", "gland_epithelium", 1.0, (30.0, 45.0), ring_um=12.0)),
    _LUNG_STROMA,
    alveolar=_ALVEOLAR,
    tumour_nest={"Squamous carcinoma cell": 0.55, "Adenocarcinoma cell": 0.25, "Tumor epithelial general": 0.12,
                 "Mitotic cell": 0.02, "Neutrophil": 0.03, "Macrophage": 0.03},
    gland_epithelium=_AIRWAY,
))
_register(_program(
    "Lung", "Normal", "alveolar",
    (Structure("patch", "stroma", 1.0, (70.0, 120.0)),
     Structure("gland", "gland_epithelium", 3.0, (30.0, 50.0), ring_um=12.0),
     Structure("blob", "lymphoid", 1.0, (25.0, 45.0))),
    {k: v for k, v in _LUNG_STROMA.items() if k != "Cancer associated fibroblast"},
    alveolar=_ALVEOLAR,
    gland_epithelium=_AIRWAY,
))

_PORTAL: Mix = {
    "Fibroblast": 0.35, "CD4 T cell": 0.12, "CD8 T cell": 0.10, "Macrophage": 0.08, "Plasma cell": 0.08,
    "B cell": 0.05, "Neutrophil": 0.06, "Myofibroblast": 0.06, "Dendritic cell": 0.04, "Mast cell": 0.03,
    "Stellate cell": 0.03,
}
_HEPATIC: Mix = {"Hepatocyte": 0.80, "Kupffer cell": 0.08, "Stellate cell": 0.04, "Endothelial cell": 0.07,
                 "Neutrophil": 0.01}
_register(_program(
    "Liver", "Normal", "hepatic_plate",
    (Structure("patch", "portal", 9.0, (60.0, 110.0)),
     Structure("gland", "gland_epithelium", 12.0, (8.0, 14.0), ring_um=6.0)),
    _PORTAL,
    hepatic_plate=_HEPATIC,
    portal=_PORTAL,
    gland_epithelium=_BILE_DUCT,
))
_register(_program(
    "Liver", "Liver cancer", "hepatic_plate",
    (Structure("patch", "tumour_nest", 5.0, (80.0, 150.0)),
     Structure("band", "stroma", 1.0, (40.0, 70.0)),
     Structure("blob", "lymphoid", 2.0, (25.0, 45.0)),
     Structure("gland", "gland_epithelium", 2.0, (8.0, 14.0), ring_um=6.0)),
    {**_PORTAL, "Cancer associated fibroblast": 0.12},
    hepatic_plate=_HEPATIC,
    tumour_nest={"Tumor epithelial general": 0.86, "Mitotic cell": 0.03, "Kupffer cell": 0.03,
                 "Endothelial cell": 0.05, "CD8 T cell": 0.03},
    gland_epithelium=_BILE_DUCT,
))

_DERMIS: Mix = {
    "Fibroblast": 0.60, "Macrophage": 0.08, "Mast cell": 0.06, "CD4 T cell": 0.07, "CD8 T cell": 0.04,
    "Dendritic cell": 0.04, "Plasma cell": 0.03, "Pericyte": 0.04, "Schwann cell": 0.02, "Myofibroblast": 0.02,
}
_EPIDERMIS: Mix = {"Keratinocyte": 0.90, "Melanocyte": 0.06, "Dendritic cell": 0.03, "CD8 T cell": 0.01}
_register(_program(
    "Skin", "Normal", "stroma",
    (Structure("band", "epidermis", 1.0, (60.0, 90.0)),
     Structure("gland", "gland_epithelium", 3.0, (18.0, 30.0), ring_um=10.0),
     Structure("band", "muscle", 0.5, (20.0, 35.0)),
     Structure("blob", "lymphoid", 1.0, (20.0, 40.0)),
     Structure("patch", "adipose", 0.5, (60.0, 100.0))),
    _DERMIS,
    epidermis=_EPIDERMIS,
    gland_epithelium={"Normal epithelial general": 0.9, "Ductal cell": 0.1},
))
_register(_program(
    "Skin", "Melanoma", "stroma",
    (Structure("band", "epidermis", 1.0, (45.0, 70.0)),
     Structure("blob", "tumour_nest", 9.0, (35.0, 90.0)),
     Structure("blob", "lymphoid", 3.0, (30.0, 60.0)),
     Structure("blob", "inflamed", 1.0, (20.0, 40.0))),
    {**_DERMIS, "Cancer associated fibroblast": 0.10},
    epidermis=_EPIDERMIS,
    tumour_nest={"Melanoma cell": 0.88, "Mitotic cell": 0.02, "Macrophage": 0.05, "CD8 T cell": 0.05},
))

_register(_program(
    "Lymphoid", "Lymphoid hyperplasia", "lymphoid",
    (Structure("patch", "follicle", 5.0, (70.0, 130.0)),
     Structure("band", "epidermis", 1.0, (35.0, 55.0)),
     Structure("blob", "inflamed", 2.5, (20.0, 40.0)),
     Structure("blob", "plasma_rich", 3.0, (25.0, 45.0)),
     Structure("patch", "stroma", 0.8, (40.0, 70.0))),
    {"Fibroblast": 0.55, "Macrophage": 0.12, "Plasma cell": 0.10, "CD4 T cell": 0.10, "Pericyte": 0.05,
     "Mast cell": 0.04, "Myofibroblast": 0.04},
    lymphoid={"CD4 T cell": 0.44, "CD8 T cell": 0.20, "Regulatory T cell": 0.06, "Macrophage": 0.09,
              "Dendritic cell": 0.05, "Plasmacytoid DC": 0.02, "Plasma cell": 0.06, "NK cell": 0.03,
              "Endothelial cell": 0.05},
    follicle={"B cell": 0.82, "CD4 T cell": 0.08, "Macrophage": 0.06, "Dendritic cell": 0.02, "Mitotic cell": 0.02},
    epidermis={"Keratinocyte": 0.88, "CD8 T cell": 0.05, "Neutrophil": 0.07},
    plasma_rich={"Plasma cell": 0.70, "Macrophage": 0.10, "CD4 T cell": 0.10, "B cell": 0.10},
))
# Compartments that exist only in one program inherit density/orientation from a similar one.
COMPARTMENTS.setdefault("follicle", COMPARTMENTS["lymphoid"])
COMPARTMENTS.setdefault("plasma_rich", COMPARTMENTS["lymphoid"])


def program_for(organ: str, status: str) -> TissueProgram:
    """The tissue program for an organ and status; KeyError names what is simulated."""
    try:
        return PROGRAMS[(organ, status)]
    except KeyError:
        known = ", ".join(f"{o}/{s}" for o, s in PROGRAMS)
        raise KeyError(f"no tissue program for {organ}/{status}; simulated: {known}") from None


def organ_cell_types(organ: str) -> tuple[str, ...]:
    """Every type with non-zero weight in any program of the organ (what its reference must hold)."""
    names: dict[str, None] = {}
    for (o, _), program in PROGRAMS.items():
        if o != organ:
            continue
        for mix in program.mixes.values():
            for name in mix:
                names.setdefault(name, None)
    return tuple(sorted(names))
