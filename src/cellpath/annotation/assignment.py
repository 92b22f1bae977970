"""Which scRNA-seq reference labels which section: the paper's Table 1 as a rule.

The paper matched references "by organ and disease state" (Table 1: one normal atlas, 13 cancer
references). ``data/manifests/references.csv`` lists the 14 references; the rule below is its
``organ`` and ``tissue_state`` columns, and a test keeps the two equal:

- a section whose status is ``Normal`` (any organ) → the Tabula Sapiens normal-tissue subset;
- any other section → the reference whose tissue/disease state is the section's status
  (``Breast cancer`` → Wu 2021, ``Lymphoid hyperplasia`` → the Tabula Sapiens lymphoid subset, ...),
  provided the reference's organ is the section's organ.

``annotate.references`` (section id → file stem) overrides the rule per section. Simulated sections
keep their own default: the simulator writes one reference per organ, ``<organ>.h5ad``.
"""

from __future__ import annotations

from collections.abc import Mapping

from cellpath.errors import InputError

NORMAL_STATUS = "Normal"
NORMAL_REFERENCE = "tabula_sapiens_normal"

#: status (Table 1's tissue/disease state, the ``status`` of xenium_datasets.csv) → (organ, reference)
CANCER_REFERENCES: dict[str, tuple[str, str]] = {
    "Breast cancer": ("Breast", "wu2021_breast"),
    "Lymphoid hyperplasia": ("Lymphoid", "tabula_sapiens_lymphoid"),
    "Ovarian cancer": ("Ovary", "vazquez_garcia2022_ovarian"),
    "Lung cancer": ("Lung", "kim2020_lung"),
    "Melanoma": ("Skin", "tirosh2016_melanoma"),
    "Pancreatic cancer": ("Pancreas", "moncada2020_pancreas"),
    "Colorectal cancer": ("Colon", "pelka2021_colorectal"),
    "Kidney cancer": ("Kidney", "zhang2021_kidney"),
    "Cervical cancer": ("Cervix", "li2021_cervix"),
    "Prostate cancer": ("Prostate", "hirz2023_prostate"),
    "Glioblastoma": ("Brain", "ruiz_moreno2025_glioblastoma"),
    "Leukemia": ("Bone BM", "caron2020_leukaemia"),
    "Liver cancer": ("Liver", "ma2019_liver"),
}

#: references the rule can name but that cannot be built as annotate needs them, and why
CAVEATS: dict[str, str] = {
    "tirosh2016_melanoma": "GSE72056 (Tirosh et al. 2016) publishes only log2(TPM/10+1) values, no raw counts, so "
                           "`cellpath references build` refuses it; build a melanoma reference that has raw UMI "
                           "counts under a name of your own and map the melanoma sections to it in "
                           "annotate.references",
    "li2021_cervix": "the accession of Li et al. 2021 is not confirmed (GSE168652 is a candidate) and no author "
                     "cell-type annotation was found; check the accession and label the cells before building it",
}


def reference_for(organ: str, status: str) -> str:
    """The Table 1 reference for a section of ``organ`` with disease ``status``; InputError naming
    both when the table has none."""
    if status == NORMAL_STATUS:
        return NORMAL_REFERENCE
    if status in CANCER_REFERENCES:
        expected_organ, name = CANCER_REFERENCES[status]
        if expected_organ == organ:
            return name
        raise InputError(f"status {status!r} has reference {name!r} for organ {expected_organ!r}, but the section's "
                         f"organ is {organ!r}; map the section to a reference in annotate.references")
    raise InputError(f"no reference for organ {organ!r} with status {status!r}: the paper's Table 1 "
                     f"(data/manifests/references.csv) covers {NORMAL_STATUS!r} and "
                     f"{', '.join(map(repr, CANCER_REFERENCES))}; map the section in annotate.references")


def reference_name(overrides: Mapping[str, str], source: str, section_id: str, organ: str, status: str) -> str:
    """The reference file stem for one section: ``annotate.references`` if it names the section,
    else ``<organ>`` (lower case) for simulated sections, else :func:`reference_for`."""
    if section_id in overrides:
        return overrides[section_id]
    if source == "synthetic":
        return organ.lower()
    return reference_for(organ, status)


def reference_caveat(name: str) -> str:
    """Why a reference of the rule may be missing (empty when nothing is known against it)."""
    return f"; {name}: {CAVEATS[name]}" if name in CAVEATS else ""
