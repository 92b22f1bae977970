"""Preflight (`cellpath validate`): each check finds its problem, names what is at fault, and a valid
project passes. The end-to-end guarantee (DVC stops before any output is removed) is in
tests/pipeline/test_validate_stage.py."""

from __future__ import annotations

import json
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import sparse

from cellpath.config import params_problems, parse_params
from cellpath.preflight import check_params, check_project
from cellpath.sources.tenx import MANIFEST_COLUMNS
from helpers.files import cellvit_document
from helpers.project import PROJECT_ROOT, TINY_SECTIONS


def _params(**changes: dict):
    """The project's params.yaml with ``changes`` merged into its top-level sections."""
    data = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = data[key] | value
        else:
            data[key] = value
    return parse_params(data)


def _tiny(**changes: dict):
    """Three simulated sections (two organs), panels S1-S3: small enough for every check to bite."""
    base = {"synthetic": {"sections": TINY_SECTIONS}, "concordance": {"panel_sizes": [1, 2, 3]}, "panel": "S3",
            "probe": {"mocv_folds": 2}, "robustness": {"shortcut": {"confounder": "section_id"}}}
    for key, value in changes.items():
        base[key] = base.get(key, {}) | value if isinstance(value, dict) else value
    return _params(**base)


def _messages(problems) -> list[str]:
    return [str(p) for p in problems]


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project root with the real registry and an empty weights folder."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "encoders.yaml").write_text((PROJECT_ROOT / "models" / "encoders.yaml").read_text())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path


def test_the_project_params_have_no_problem(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    assert check_project(PROJECT_ROOT / "params.yaml") == []


def test_a_registry_name_gets_its_slug_and_a_typo_the_closest_slug(project):
    problems = _messages(check_params(_tiny(extract={"encoders": ["Kaiko ViT-S/16", "filterbank-dens"]}),
                                      project, Path("data")))
    assert len(problems) == 2, problems
    assert "list its slug 'kaiko-vit-s-16' instead" in problems[0]
    assert "not a slug in models/encoders.yaml; did you mean 'filterbank-dense'?" in problems[1]


def test_hub_encoder_needs_weights_and_custom_loaders_an_adapter(project):
    registry = project / "models" / "encoders.yaml"
    custom = {"name": "Needs Code", "type": "PV", "architecture": "ViT-B/16", "hub_id": None, "revision": "main",
              "loader": "custom:needs-code", "requires": "the needs-code package", "mean": [0.5] * 3,
              "std": [0.5] * 3, "input_size": 224, "patch_size": 16, "num_prefix_tokens": 1, "has_cls": True,
              "embed_dim": 768, "native_mpp": None, "pretrain_magnification": None, "precision": "fp32",
              "params": None, "pretrain_wsi_equivalent": None}
    document = yaml.safe_load(registry.read_text())
    registry.write_text(yaml.safe_dump(document | {"encoders": [*document["encoders"], custom]}))
    params = _tiny(extract={"encoders": ["uni", "needs-code"]})
    problems = _messages(check_params(params, project, Path("data")))
    assert len(problems) == 2, problems
    assert "'uni'" in problems[0] and "UNI: no weights found" in problems[0] and str(project / "models" / "uni") in problems[0]
    assert "'needs-code'" in problems[1] and "no loader for 'custom:needs-code'" in problems[1]
    (project / "models" / "uni").mkdir()
    (project / "models" / "uni" / "model.safetensors").write_bytes(b"weights")
    assert len(check_params(params, project, Path("data"))) == 1  # found: only the adapter remains


def test_too_few_sections_for_panels_folds_and_shortcut_levels(project):
    params = _tiny(concordance={"panel_sizes": [2, 3, 4]}, panel="S3", probe={"mocv_folds": 4},
                   robustness={"shortcut": {"confounder": "organ", "held_out": 1}})
    problems = _messages(check_params(params, project, Path("data")))
    assert problems == [
        "concordance.panel_sizes: panel(s) S4 need more sections than the 3 this run has",
        "probe.mocv_folds: 4 folds need at least as many sections; panel S3 has 3",
        "robustness.shortcut.held_out: organ: 2 level(s) leave 1 to train on (held_out=1); the sweep needs two: "
        "lower held_out or list train_levels",
    ]
    assert check_params(_tiny(protocol="is", probe={"mocv_folds": 4}), project, Path("data")) == []  # no MOCV run


def test_shortcut_train_levels_must_be_sections_of_the_run(project):
    levels = [s["section_id"] for s in TINY_SECTIONS]
    named = _tiny(robustness={"shortcut": {"confounder": "section_id", "train_levels": [levels[1], "nowhere"]}})
    assert _messages(check_params(named, project, Path("data"))) == [
        f"robustness.shortcut.train_levels: section_id: train_levels ['nowhere'] are not among this run's levels: "
        f"{', '.join(sorted(levels))}"]
    good = _tiny(robustness={"shortcut": {"confounder": "section_id", "train_levels": levels[:2]}})
    assert check_params(good, project, Path("data")) == []


def test_simulated_references_have_one_label_column_and_one_name_per_organ(project):
    params = _tiny(annotate={"label_column": "celltype", "references": {"breast_a": "lung", "nowhere": "breast"}})
    problems = _messages(check_params(params, project, Path("data")))
    assert problems == [
        "annotate.references: 'nowhere': not a section of this run",
        "annotate.references: reference 'lung': the simulator writes references breast, lymphoid only",
        "annotate.label_column: 'celltype' is not a column of the simulated references; they label cells in "
        "'cell_type'",
    ]


def test_cellvit_dir_needs_an_output_per_section(project):
    folder = project / "cellvit"
    folder.mkdir()
    params = _tiny(concordance={"cellvit_dir": str(folder)})
    problems = _messages(check_params(params, project, Path("data")))
    assert len(problems) == 3 and all("no CellViT++ output for this section" in p for p in problems), problems
    assert [p.split("section ")[1].split(":")[0] for p in problems] == ["breast_a", "breast_b", "tonsil_a"]
    for section in ("breast_a", "breast_b"):
        (folder / f"{section}_he_image_cells.json").write_text(json.dumps(cellvit_document()))
    problems = _messages(check_params(params, project, Path("data")))
    assert len(problems) == 1 and "section tonsil_a" in problems[0]
    missing = _tiny(concordance={"cellvit_dir": str(project / "absent")})
    assert "folder not found" in _messages(check_params(missing, project, Path("data")))[0]


TENX_SECTIONS = (("liver_x", "Liver", "Normal"), ("lung_x", "Lung", "Lung cancer"), ("lung_y", "Lung", "Lung cancer"))


def _write_manifest(path: Path, with_urls: bool, sections=TENX_SECTIONS) -> None:
    rows = []
    for i, (section, organ, status) in enumerate(sections):
        row = dict.fromkeys(MANIFEST_COLUMNS, "")
        row.update(section_id=section, dataset=section, organ=organ, status=status, cells="10", rank=str(i + 1),
                   panel_s25="1", page_url="https://example.org", prefix=f"{section}_")
        if with_urls:
            for kind in ("bundle", "he_image", "he_alignment"):
                row[f"{kind}_url"] = f"http://127.0.0.1:1/{section}/{kind}" + ("_outs.zip" if kind == "bundle" else "")
        rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)


def _tenx(project: Path, **changes):
    return _params(source="10x", tenx={"manifest": str(project / "manifest.csv")},
                   concordance={"panel_sizes": [1, 2, 3]}, panel="S3", probe={"mocv_folds": 2},
                   robustness={"shortcut": {"confounder": "section_id"}}, **changes)


def test_10x_sections_need_urls(project):
    _write_manifest(project / "manifest.csv", with_urls=False)
    problems = _messages(check_params(_tenx(project), project, Path("data")))
    assert len(problems) == 1 and problems[0].startswith("source: 10x: ") and "no section has a bundle_url yet" \
        in problems[0], problems


def _reference(path: Path, column: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    adata = ad.AnnData(np.ones((3, 2), dtype=np.float32), obs=pd.DataFrame({column: ["a", "b", "c"]},
                                                                             index=["c1", "c2", "c3"]))
    adata.write_h5ad(path)


def test_10x_references_must_exist_and_hold_the_label_column(project):
    """A 10x section's reference is the one annotate picks: the manifest rule by status and organ
    (annotation.assignment.reference_name), not ``<organ>.h5ad``."""
    _write_manifest(project / "manifest.csv", with_urls=True)
    params = _tenx(project)
    problems = _messages(check_params(params, project, Path("data")))
    assert len(problems) == 2 and "no reference 'kim2020_lung'" in problems[0] \
        and "cellpath references build kim2020_lung --from FILE…" in problems[0] \
        and "no reference 'tabula_sapiens_normal'" in problems[1], problems
    _reference(project / "data" / "references" / "tabula_sapiens_normal.h5ad", "cell_type")
    _reference(project / "data" / "references" / "kim2020_lung.h5ad", "celltype")
    problems = _messages(check_params(params, project, Path("data")))
    assert problems == [f"annotate.label_column: 'cell_type': not a column of {project}/data/references/"
                        "kim2020_lung.h5ad (obs columns: celltype); did you mean 'celltype'?"]
    (project / "data" / "references" / "kim2020_lung.h5ad").write_bytes(b"not hdf5")
    assert "cannot read the reference's obs" in _messages(check_params(params, project, Path("data")))[0]
    _reference(project / "data" / "references" / "lung.h5ad", "cell_type")  # an override names any file stem
    assert check_params(_tenx(project, annotate={"references": {"lung_x": "lung", "lung_y": "lung"}}), project,
                        Path("data")) == []


def test_10x_section_without_a_reference_in_the_rule_is_named(project):
    _write_manifest(project / "manifest.csv", with_urls=True, sections=(
        ("liver_x", "Liver", "Normal"), ("lung_x", "Lung", "Lung cancer"), ("heart_x", "Heart", "Heart failure")))
    for name in ("tabula_sapiens_normal", "kim2020_lung"):
        _reference(project / "data" / "references" / f"{name}.h5ad", "cell_type")
    problems = _messages(check_params(_tenx(project), project, Path("data")))
    assert len(problems) == 1 and problems[0].startswith(
        "annotate.references: section heart_x: no reference for organ 'Heart' with status 'Heart failure': the "
        "paper's Table 1 (data/manifests/references.csv) covers 'Normal' and 'Breast cancer'"), problems
    assert problems[0].endswith("; map the section in annotate.references")
    mapped = _tenx(project, annotate={"references": {"heart_x": "tabula_sapiens_normal"}})
    assert check_params(mapped, project, Path("data")) == []


def test_10x_references_must_hold_raw_counts_where_annotate_reference_counts_says(project):
    _write_manifest(project / "manifest.csv", with_urls=True)
    references = project / "data" / "references"
    references.mkdir(parents=True)
    counts = np.array([[3.0, 0.0], [1.0, 7.0], [0.0, 2.0]], dtype=np.float32)
    logged = ad.AnnData(np.log1p(counts), obs=pd.DataFrame({"cell_type": ["a", "b", "c"]}, index=["c1", "c2", "c3"]),
                        layers={"raw_counts": sparse.csr_matrix(counts)})
    logged.write_h5ad(references / "kim2020_lung.h5ad")
    logged.write_h5ad(references / "tabula_sapiens_normal.h5ad")
    problems = _messages(check_params(_tenx(project), project, Path("data")))
    assert problems == [f"annotate.reference_counts: 'auto': {references}/{name}.h5ad: X holds values that are not "
                        "whole numbers (e.g. 1.386): normalised or log-transformed data, not raw counts; set "
                        "annotate.reference_counts to where the counts are (it has X, layers/raw_counts) — "
                        "annotate would stop" for name in ("kim2020_lung", "tabula_sapiens_normal")], problems
    assert check_params(_tenx(project, annotate={"reference_counts": "layers/raw_counts"}), project, Path("data")) == []
    assert "it has no layers/counts (it has X, layers/raw_counts)" in _messages(check_params(
        _tenx(project, annotate={"reference_counts": "layers/counts"}), project, Path("data")))[0]


def test_schema_problems_of_several_passes_are_all_listed():
    """A field error hides a model's own check until it is fixed: both are reported, and a field
    removed by the repair is not reported again as missing."""
    data = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    data["probe"]["seeds"]["is"] = 0                  # field error
    data["executor"]["cluster"] = "slurm"             # the executor model's own check
    data["synthetic"]["sections"] = yaml.safe_load((PROJECT_ROOT / data["synthetic"]["sections"]).read_text())
    data["synthetic"]["sections"][0]["organ"] = "Brain"  # a required field: no repair past it
    params, problems = params_problems(data)
    assert params is None
    text = _messages(problems)
    assert len(text) == 3, text
    assert any("synthetic.sections[0].organ" in t for t in text)
    assert any("probe.seeds.is" in t for t in text)
    assert any("address and cluster: slurm are Dask settings" in t for t in text)
    assert not any("Field required" in t for t in text)


def test_dask_executor_needs_its_packages(project, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "dask_jobqueue" else real(name))
    params = _tiny(executor={"backend": "dask", "cluster": "slurm"})
    assert _messages(check_params(params, project, Path("data"))) == [
        "executor.cluster: slurm needs dask-jobqueue: pip install dask-jobqueue"]


def test_shortcut_pool_too_small_for_the_confounder_levels(project):
    """The project's 12 sections as acquisition batches, one held out: 11 trained levels need
    10·11² = 1,210 pool rows for distinct Cramér's V steps of 0.1."""
    params = _params(robustness={"shortcut": {"confounder": "section_id", "held_out": 1, "pool_size": 600}})
    problems = _messages(check_params(params, project, Path("data")))
    assert len(problems) == 1 and problems[0].startswith("robustness.shortcut.pool_size: a pool of 600 rows cannot "
                                                         "realise distinct Cramér's V values for 11 confounder levels")
    assert "it needs at least 1210" in problems[0]
    enough = _params(robustness={"shortcut": {"confounder": "section_id", "held_out": 1, "pool_size": 1210}})
    assert check_params(enough, project, Path("data")) == []
