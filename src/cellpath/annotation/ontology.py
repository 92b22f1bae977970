"""The 72-label cell-type ontology of CellPath-Bench (Table 8) and its Tfine / Tcoarse mapping.

68 biological types plus 4 QC states, each with level-1/level-2 lineage, primary and secondary
markers, and (where it exists) a nine-class Tfine and a three-class Tcoarse class. Labels without a
Tfine class are ineligible for histology evaluation. Marker names in the table are partly protein
names (CK7, CD20, p63 ...); ``marker_gene_aliases.csv`` maps them to HGNC gene symbols.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources

FINE_CLASSES: tuple[str, ...] = (
    "Neoplastic",
    "Non-neoplastic epithelial/parenchymal",
    "Lymphocyte",
    "Plasma cell",
    "Macrophage/Histiocyte",
    "Neutrophil",
    "Fibroblast/Stromal cell",
    "Endothelial/Vessel-associated",
    "Smooth muscle/Muscle",
)
COARSE_CLASSES: tuple[str, ...] = ("Epithelial/Tumor", "Immune/Inflammatory", "Stromal/Structural")


@dataclass(frozen=True)
class CellType:
    """One ontology row. ``fine``/``coarse`` are None for labels outside the histology taxonomies."""

    type_id: int
    level1: str
    level2: str
    name: str
    primary_markers: tuple[str, ...]
    secondary_markers: tuple[str, ...]
    fine: str | None
    coarse: str | None

    @property
    def eligible(self) -> bool:
        """Whether cells of this type enter histology evaluation (it has a Tfine class)."""
        return self.fine is not None

    @property
    def is_qc_state(self) -> bool:
        return self.level1 == "Other/QC"


def _split(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


@functools.cache
def cell_types() -> tuple[CellType, ...]:
    """All 72 ontology rows, in table order."""
    with resources.files("cellpath.annotation.data").joinpath("cell_type_ontology.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return tuple(
        CellType(
            type_id=int(r["id"]),
            level1=r["level1"],
            level2=r["level2"],
            name=r["cell_type"],
            primary_markers=_split(r["primary_markers"]),
            secondary_markers=_split(r["secondary_markers"]),
            fine=r["fine"] or None,
            coarse=r["coarse"] or None,
        )
        for r in rows
    )


@functools.cache
def cell_type_by_name() -> dict[str, CellType]:
    return {t.name: t for t in cell_types()}


def cell_type(name: str) -> CellType:
    """Look up a label by its ontology name; KeyError names the label."""
    try:
        return cell_type_by_name()[name]
    except KeyError:
        raise KeyError(f"{name!r} is not one of the 72 ontology labels") from None


@functools.cache
def _marker_aliases() -> dict[str, tuple[str, ...]]:
    with resources.files("cellpath.annotation.data").joinpath("marker_gene_aliases.csv").open() as handle:
        return {r["marker"]: tuple(r["genes"].split(";")) for r in csv.DictReader(handle)}


def marker_genes(marker: str) -> tuple[str, ...]:
    """Gene symbol(s) measured for a marker name of the ontology table."""
    return _marker_aliases().get(marker, (marker,))


def genes_of(markers: tuple[str, ...]) -> tuple[str, ...]:
    """Unique gene symbols for a list of markers, in first-seen order."""
    seen: dict[str, None] = {}
    for m in markers:
        for g in marker_genes(m):
            seen.setdefault(g, None)
    return tuple(seen)


def all_marker_genes() -> tuple[str, ...]:
    """Every gene symbol named by any primary or secondary marker, sorted."""
    genes = set()
    for t in cell_types():
        genes.update(genes_of(t.primary_markers + t.secondary_markers))
    return tuple(sorted(genes))


ALIAS_TABLE = "label_aliases.csv"
ONTOLOGY_VOCABULARY = "cellpath-ontology"


@functools.cache
def label_aliases() -> dict[str, dict[str, str]]:
    """Versioned alias table: vocabulary (e.g. ``name/1``) → {reference label → ontology label}."""
    table: dict[str, dict[str, str]] = {}
    with resources.files("cellpath.annotation.data").joinpath(ALIAS_TABLE).open() as handle:
        for row in csv.DictReader(handle):
            table.setdefault(row["vocabulary"], {})[row["reference_label"]] = row["ontology_label"]
    return table


def map_reference_labels(labels: list[str], vocabulary: str) -> dict[str, str]:
    """Map a reference's own label names onto ontology names.

    Ontology names map to themselves in every vocabulary; other names need a row of the alias
    table for ``vocabulary``. Raises KeyError listing every unmapped label.
    """
    aliases = label_aliases().get(vocabulary, {})
    known = cell_type_by_name()
    mapping, unmapped = {}, []
    for label in sorted(set(labels)):
        if label in aliases:
            mapping[label] = aliases[label]
        elif label in known:
            mapping[label] = label
        else:
            unmapped.append(label)
    if unmapped:
        raise KeyError(
            f"{len(unmapped)} reference label(s) have no ontology mapping in vocabulary {vocabulary!r}: "
            f"{', '.join(repr(u) for u in unmapped)}; add rows to cellpath/annotation/data/{ALIAS_TABLE}"
        )
    return mapping


def inverse_aliases(vocabulary: str) -> dict[str, str]:
    """Ontology label → reference label for one vocabulary (used by the simulator's references)."""
    return {ontology: ref for ref, ontology in label_aliases().get(vocabulary, {}).items()}
