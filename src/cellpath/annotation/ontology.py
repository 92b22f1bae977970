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
#: A reference label ending in this matches every label that starts with the rest (``Endo_*``).
PATTERN_SUFFIX = "*"


@functools.cache
def _alias_rows() -> tuple[dict[str, str], ...]:
    with resources.files("cellpath.annotation.data").joinpath(ALIAS_TABLE).open(encoding="utf-8") as handle:
        return tuple(csv.DictReader(handle))


@functools.cache
def label_aliases() -> dict[str, dict[str, str]]:
    """Versioned alias table: vocabulary (e.g. ``name/1``) → {reference label → ontology label}.

    Only mapped rows; a label ending in ``*`` is a prefix pattern (see :func:`resolve_reference_labels`)."""
    table: dict[str, dict[str, str]] = {}
    for row in _alias_rows():
        if row["ontology_label"]:
            table.setdefault(row["vocabulary"], {})[row["reference_label"]] = row["ontology_label"]
    return table


@functools.cache
def unmapped_labels() -> dict[str, dict[str, str]]:
    """Labels recorded as mapping to no ontology type: vocabulary → {reference label → reason}."""
    table: dict[str, dict[str, str]] = {}
    for row in _alias_rows():
        if not row["ontology_label"]:
            table.setdefault(row["vocabulary"], {})[row["reference_label"]] = row["basis"]
    return table


def _lookup(label: str, aliases: dict[str, str], reasons: dict[str, str]) -> tuple[bool, str] | None:
    """(mapped?, ontology name or reason) for ``label``: its exact row, else the longest prefix pattern
    that matches it; None when no row matches."""
    for table, mapped in ((aliases, True), (reasons, False)):
        if label in table:
            return mapped, table[label]
    patterns = [(key, mapped, value) for table, mapped in ((aliases, True), (reasons, False))
                for key, value in table.items() if key.endswith(PATTERN_SUFFIX) and label.startswith(key[:-1])]
    if not patterns:
        return None
    _, mapped, value = max(patterns, key=lambda p: len(p[0]))
    return mapped, value


@dataclass(frozen=True)
class LabelResolution:
    """A reference's labels resolved in one vocabulary: mapped (→ ontology name), recorded as
    unmapped (→ the reason) and unknown (in no row of the vocabulary: the table needs a row)."""

    vocabulary: str
    mapped: dict[str, str]
    unmapped: dict[str, str]
    unknown: tuple[str, ...]


def resolve_reference_labels(labels: list[str], vocabulary: str) -> LabelResolution:
    """Resolve each distinct label: an ontology name maps to itself in every vocabulary; other
    labels need a row of the alias table for ``vocabulary`` (exact, else a ``prefix*`` pattern), which
    maps them or records them as unmapped with a reason."""
    aliases = label_aliases().get(vocabulary, {})
    reasons = unmapped_labels().get(vocabulary, {})
    known = cell_type_by_name()
    mapped, unmapped, unknown = {}, {}, []
    for label in sorted(set(labels)):
        if (row := _lookup(label, aliases, reasons)) is not None:
            (mapped if row[0] else unmapped)[label] = row[1]
        elif label in known:
            mapped[label] = label
        else:
            unknown.append(label)
    return LabelResolution(vocabulary, mapped, unmapped, tuple(unknown))


def unknown_labels_message(resolution: LabelResolution) -> str:
    """What to do about labels the vocabulary has no row for (names the vocabulary and the table)."""
    return (f"{len(resolution.unknown)} reference label(s) have no ontology mapping in vocabulary "
            f"{resolution.vocabulary!r}: {', '.join(repr(u) for u in resolution.unknown)}; add rows to "
            f"cellpath/annotation/data/{ALIAS_TABLE} (an ontology type, or no type and the reason), or set "
            f"annotate.label_vocabulary to the reference's vocabulary")


def map_reference_labels(labels: list[str], vocabulary: str) -> dict[str, str]:
    """Map a reference's own label names onto ontology names (the mapped ones of
    :func:`resolve_reference_labels`). Raises KeyError listing every label the vocabulary lacks."""
    resolution = resolve_reference_labels(labels, vocabulary)
    if resolution.unknown:
        raise KeyError(unknown_labels_message(resolution))
    return resolution.mapped


def inverse_aliases(vocabulary: str) -> dict[str, str]:
    """Ontology label → reference label for one vocabulary (used by the simulator's references)."""
    return {ontology: ref for ref, ontology in label_aliases().get(vocabulary, {}).items()}
