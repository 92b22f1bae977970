"""The reference manifest (data/manifests/references.csv) and the section → reference rule: the
paper's 14 references, the rule equal to the manifest, every 10x section assigned, annotate.references
winning, and the simulated default (``<organ>.h5ad``) unchanged."""

from __future__ import annotations

import csv

import pytest

from cellpath.annotation.assignment import CAVEATS, NORMAL_STATUS, reference_caveat, reference_for, reference_name
from cellpath.errors import InputError
from cellpath.references.manifest import BUILDERS, REFERENCE_MANIFEST, read_reference_manifest
from helpers.project import PROJECT_ROOT

XENIUM = PROJECT_ROOT / "data" / "manifests" / "xenium_datasets.csv"


def test_the_manifest_lists_the_papers_14_references():
    entries = read_reference_manifest(PROJECT_ROOT / REFERENCE_MANIFEST)
    assert len(entries) == 14
    assert sum(e.tissue_state == "Normal tissue" for e in entries.values()) == 1
    assert {e.citation for e in entries.values()} >= {"Wu et al. 2021", "Tirosh et al. 2016", "Ma et al. 2019",
                                                       "Ruiz-Moreno et al. 2025", "Tabula Sapiens Consortium et al. 2022"}
    assert all(e.builder in BUILDERS and e.accession and e.title and e.cells_in_paper.isdigit()
               for e in entries.values())
    assert entries["tirosh2016_melanoma"].builder == "tpm-refused"
    assert "UNCONFIRMED" in entries["li2021_cervix"].accession and "UNCONFIRMED" in entries["li2021_cervix"].notes


def test_the_rule_is_the_manifests_organ_and_tissue_state():
    for name, entry in read_reference_manifest(PROJECT_ROOT / REFERENCE_MANIFEST).items():
        if entry.organ == "any":
            assert reference_for("Heart", NORMAL_STATUS) == name
        else:
            assert reference_for(entry.organ, entry.tissue_state) == name, name


def test_every_10x_section_has_a_reference_of_the_manifest():
    names = set(read_reference_manifest(PROJECT_ROOT / REFERENCE_MANIFEST))
    with XENIUM.open(encoding="utf-8") as handle:
        sections = list(csv.DictReader(handle))
    assigned = {row["section_id"]: reference_for(row["organ"], row["status"]) for row in sections}
    assert len(assigned) == len(sections) >= 50 and set(assigned.values()) <= names
    assert assigned["xenium_ffpe_human_breast_cancer_rep1"] == "wu2021_breast"
    normal = [row for row in sections if row["status"] == "Normal"]
    assert normal and all(assigned[row["section_id"]] == "tabula_sapiens_normal" for row in normal)


def test_annotate_references_wins_and_simulated_sections_keep_their_organ_reference():
    overrides = {"s1": "my_breast"}
    assert reference_name(overrides, "10x", "s1", "Breast", "Breast cancer") == "my_breast"
    assert reference_name(overrides, "10x", "s2", "Breast", "Breast cancer") == "wu2021_breast"
    assert reference_name(overrides, "synthetic", "s2", "Breast", "Breast cancer") == "breast"
    assert reference_name(overrides, "synthetic", "s1", "Breast", "Breast cancer") == "my_breast"


def test_a_section_the_table_does_not_cover_is_refused_naming_what_to_set():
    with pytest.raises(InputError, match=r"no reference for organ 'Heart' with status 'Myocarditis'.*annotate.references"):
        reference_for("Heart", "Myocarditis")
    with pytest.raises(InputError, match=r"status 'Breast cancer' has reference 'wu2021_breast' for organ 'Breast', "
                                         r"but the section's organ is 'Lung'"):
        reference_for("Lung", "Breast cancer")


def test_references_that_cannot_be_built_say_why():
    assert set(CAVEATS) == {"tirosh2016_melanoma", "li2021_cervix"}
    assert "log2(TPM/10+1)" in reference_caveat("tirosh2016_melanoma") and reference_caveat("wu2021_breast") == ""


def test_the_manifest_reader_names_every_problem(tmp_path):
    path = tmp_path / "references.csv"
    rows = list(csv.reader((PROJECT_ROOT / REFERENCE_MANIFEST).open(encoding="utf-8")))
    header = rows[0]
    bad = dict(zip(header, rows[1])) | {"builder": "zip", "labels_from": "annotation", "label_column": ""}
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerow([bad[c] for c in header])
        writer.writerow(rows[1])
    with pytest.raises(InputError, match=r"(?s)builder is 'zip'.*needs a label_column.*'wu2021_breast' is repeated"):
        read_reference_manifest(path)
    path.write_text("name,builder\nx,10x-h5\n")
    with pytest.raises(InputError, match=r"missing column\(s\): tissue_state, organ"):
        read_reference_manifest(path)
