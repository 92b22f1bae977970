"""The label vocabularies of the paper's references (label_aliases.csv): every label value seen in
the references' annotation files maps to one of the 68 types, named by its markers, or is recorded
as mapping to none with a reason. ``reference_label_values.csv`` beside this file copies the values
with their source (accession, publication)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from cellpath.annotation.ontology import (cell_type, cell_types, genes_of, label_aliases, resolve_reference_labels,
                                          unmapped_labels)
from cellpath.references.manifest import read_reference_manifest
from helpers.project import PROJECT_ROOT

VALUES = Path(__file__).with_name("reference_label_values.csv")
ALIASES = PROJECT_ROOT / "src" / "cellpath" / "annotation" / "data" / "label_aliases.csv"
SIMULATED = "cellpath-simulated-atlas/1"


def _values() -> list[dict[str, str]]:
    with VALUES.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _by_vocabulary() -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for row in _values():
        table.setdefault(row["vocabulary"], []).append(row["label"])
    return table


@pytest.mark.parametrize("vocabulary", sorted(_by_vocabulary()))
def test_every_label_value_maps_to_one_of_the_68_types_or_is_recorded_unmapped(vocabulary):
    labels = _by_vocabulary()[vocabulary]
    resolution = resolve_reference_labels(labels, vocabulary)
    assert not resolution.unknown, f"{vocabulary}: no row for {resolution.unknown}"
    assert set(resolution.mapped) | set(resolution.unmapped) == set(labels)
    qc = {t.name for t in cell_types() if t.is_qc_state}
    assert not set(resolution.mapped.values()) & qc, "real labels map to the 68 biological types, not QC states"
    assert all(reason.strip() for reason in resolution.unmapped.values())


def test_the_values_file_names_its_source_for_every_value():
    rows = _values()
    assert len(rows) >= 250
    assert all(row["source"] and re.search(r"(GEO GSE\d+|CELLxGENE)", row["source"]) and
               re.search(r"et al\. 20\d\d", row["source"]) for row in rows)
    assert {row["seen_in"] for row in rows} <= {"evidence table", "annotation file"}


def _real_rows() -> list[tuple[str, str, str, str]]:
    with ALIASES.open(encoding="utf-8") as handle:
        return [(r["vocabulary"], r["reference_label"], r["ontology_label"], r["basis"])
                for r in csv.DictReader(handle) if r["vocabulary"] != SIMULATED]


def _markers(name: str) -> set[str]:
    """A type's primary and secondary markers, as the table names them and as gene symbols."""
    t = cell_type(name)
    names = set(t.primary_markers + t.secondary_markers)
    return names | set(genes_of(t.primary_markers + t.secondary_markers)) | {m.split(" (")[0] for m in names}


def test_every_mapping_names_a_marker_of_its_type_and_every_unmapped_label_a_reason():
    unnamed = []
    for vocabulary, label, target, basis in _real_rows():
        if not target:
            assert basis.strip(), f"{vocabulary} {label!r}: recorded as unmapped without a reason"
            continue
        words = set(re.findall(r"[A-Za-z0-9/-]+", basis))
        if not words & _markers(target):
            unnamed.append(f"{vocabulary} {label!r} → {target}: {basis}")
    assert not unnamed, "mappings whose basis names none of the type's markers:\n" + "\n".join(unnamed)


def test_every_manifest_vocabulary_exists_and_has_values_on_record():
    on_record = set(_by_vocabulary())
    for name, entry in read_reference_manifest().items():
        if entry.label_vocabulary:
            assert entry.label_vocabulary in label_aliases(), name
            assert entry.label_vocabulary in on_record, name
    assert set(_by_vocabulary()) <= set(label_aliases()) | set(unmapped_labels())


def test_a_prefix_pattern_maps_a_family_of_labels_and_an_exact_row_wins():
    resolution = resolve_reference_labels(["Endo_GC", "Endo_AEA", "Endo", "Tumor"], "zhang2021_kidney.anno/1")
    assert resolution.mapped == {"Endo_GC": "Endothelial cell", "Endo_AEA": "Endothelial cell",
                                 "Tumor": "Clear cell carcinoma"}
    assert resolution.unknown == ("Endo",)


def test_ontology_names_map_to_themselves_and_unknown_labels_are_listed_with_the_vocabulary():
    resolution = resolve_reference_labels(["Mast cell", "Mystery"], "wu2021_breast.celltype_minor/1")
    assert resolution.mapped == {"Mast cell": "Mast cell"} and resolution.unknown == ("Mystery",)


def test_an_exact_row_wins_over_a_pattern_whichever_maps(monkeypatch):
    from cellpath.annotation import ontology

    monkeypatch.setattr(ontology, "label_aliases", lambda: {"v/1": {"Endo_*": "Endothelial cell"}})
    monkeypatch.setattr(ontology, "unmapped_labels", lambda: {"v/1": {"Endo_doublet": "doublets", "Endo_x*": "bin"}})
    resolution = ontology.resolve_reference_labels(["Endo_doublet", "Endo_GC", "Endo_xy"], "v/1")
    assert resolution.mapped == {"Endo_GC": "Endothelial cell"}
    assert resolution.unmapped == {"Endo_doublet": "doublets", "Endo_xy": "bin"}
