"""The readiness view of `cellpath validate` for a 10x panel (`source: 10x`, `--preset paper`): per
section what is in place, the one action each gap needs, a summary line, and exit 0 only when ready.
Read from the manifest and local files only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import yaml

from cellpath.cli import main
from cellpath.config import parse_params
from cellpath.readiness import CHECK, MISSING, Check, check_readiness, paper_panel_params, render
from cellpath.sources.tenx import MANIFEST_COLUMNS, OPTIONAL_COLUMNS, read_manifest
from cellpath.sources.tenx import _section_record as section_record
from helpers.project import PROJECT_ROOT

HOST = "https://cf.10xgenomics.com/samples/xenium/2.0.0"
SUFFIXES = {"bundle": "_outs.zip", "he_image": "_he_image.ome.tif", "he_alignment": "_he_imagealignment.csv"}
SOURCE = "someone/repo:urls.csv@0123abc"
# (section_id, organ, status, {kind: url source}): ready with every file local; without its reference;
# with a derived H&E URL
SECTIONS = (("liver_a", "Liver", "Normal", {}),
            ("lung_b", "Lung", "Lung cancer", {}),
            ("colon_c", "Colon", "Normal", {"he_image": "derived"}))
BUILD_KIM = ("cellpath references build kim2020_lung --from FILE… (the files data/manifests/references.csv lists "
             "for it)")


def _row(section_id: str, organ: str, status: str, sources: dict[str, str]) -> dict[str, str]:
    name = section_id.capitalize()
    row = dict.fromkeys((*MANIFEST_COLUMNS, *OPTIONAL_COLUMNS), "")
    row.update(section_id=section_id, dataset=name, organ=organ, status=status, cells="10", panel_s25="1",
               page_url=f"https://example.org/{section_id}", prefix=f"{name}_", xoa_version="2.0.0",
               bundle_md5="0" * 32, bundle_bytes="100")
    for kind, suffix in SUFFIXES.items():
        row[f"{kind}_url"] = f"{HOST}/{name}/{name}{suffix}"
        row[f"{kind}_url_source"] = sources.get(kind, SOURCE)
    return row


def _reference(path: Path, vocabulary: str = "cell-ontology/1", column: str = "cell_type") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    adata = ad.AnnData(np.array([[3, 0], [1, 7], [0, 2]], dtype=np.float32),
                       obs=pd.DataFrame({column: ["T cell", "B cell", "T cell"]}, index=["c1", "c2", "c3"]))
    adata.uns["reference"] = {"label_vocabulary": vocabulary}
    adata.write_h5ad(path)


def _params(project: Path, **changes):
    data = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    data.update(source="10x", tenx={"manifest": str(project / "manifest.csv")}, panel="S3",
                concordance={**data["concordance"], "panel_sizes": [1, 2, 3]}, probe={**data["probe"], "mocv_folds": 2})
    data["robustness"]["shortcut"] = {"confounder": "section_id"}
    for key, value in changes.items():
        data[key] = data[key] | value if isinstance(data.get(key), dict) else value
    return data


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project root with the registry, the reference manifest, a 3-row 10x manifest, the first
    section fetched into data/raw and the reference of the first and third sections built."""
    for name in ("models/encoders.yaml", "data/manifests/references.csv", "data/manifests/synthetic_sections.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PROJECT_ROOT / name, tmp_path / name)
    pd.DataFrame([_row(*section) for section in SECTIONS]).to_csv(tmp_path / "manifest.csv", index=False)
    fetched = tmp_path / "data" / "raw" / "liver_a"
    fetched.mkdir(parents=True)
    first = read_manifest(tmp_path / "manifest.csv")[0]
    files = {kind: {"url": getattr(first, kind).url, "bytes": 100 if kind == "bundle" else 7,
                    "md5": "0" * 32 if kind == "bundle" else "1" * 32, "sha256": "2" * 64,
                    "verified": "published checksum" if kind == "bundle" else "first use"} for kind in SUFFIXES}
    (fetched / "section.json").write_text(json.dumps({**section_record(first), "files": files}))
    _reference(tmp_path / "data" / "references" / "tabula_sapiens_normal.h5ad")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _readiness(project: Path, **changes):
    return check_readiness(parse_params(_params(project, **changes)), project, Path("data"))


def test_three_sections_ready_without_reference_and_with_a_derived_url(project):
    report = _readiness(project)
    assert report.problems == ()
    ready, lung, colon = report.sections
    assert [(s.section_id, s.host, s.sums, s.local, s.reference) for s in report.sections] == [
        ("liver_a", "cf.10xgenomics.com", "MB/-/-", "data/raw", "tabula_sapiens_normal"),
        ("lung_b", "cf.10xgenomics.com", "MB/-/-", "no", "kim2020_lung"),
        ("colon_c", "cf.10xgenomics.com", "MB/-/-", "no", "tabula_sapiens_normal")]
    assert ready.checks == {"downloads": Check("seen/seen/seen"), "reference": Check("present"),
                            "labels": Check("known"), "CellViT++": Check("built-in")}
    assert lung.checks["reference"] == Check("missing", MISSING, BUILD_KIM)
    assert lung.checks["labels"] == Check("known")  # the manifest's vocabulary for it has rows
    assert colon.checks["downloads"] == Check("seen/derived/seen", CHECK, "check https://example.org/colon_c for the "
                                              "H&E image (derived URL, not checked online)")
    assert [s.ready for s in report.sections] == [True, False, True] and not report.ready
    text = render(report)
    assert text.splitlines()[-1] == "2 of 3 sections ready; 1 with something to check: the panel is not ready"
    assert f"  - {BUILD_KIM}\n      for: lung_b" in text
    assert "To check (not blocking):\n  - check https://example.org/colon_c for the H&E image" in text
    rows = {line.split()[0]: line.split()[-2:] for line in text.splitlines() if line.startswith(("liver_a", "lung_"))}
    assert rows == {"liver_a": ["built-in", "ready"], "lung_b": ["not", "ready"]}


def test_validate_counts_how_each_file_is_verified_and_refuses_a_conflicting_lock(project):
    lock = project / "manifest.lock.csv"
    rows = [f"liver_a,{kind},https://x/{kind},{100 if kind == 'bundle' else 7},{'0' * 32 if kind == 'bundle' else '1' * 32},"
            f"{'2' * 64}" for kind in SUFFIXES]
    lock.write_text("section_id,kind,url,bytes,md5,sha256\n" + "\n".join(rows) + "\n")
    report = _readiness(project)
    assert report.problems == () and report.sections[0].sums == "MBL/L/L"
    assert (f"Checksums of the 9 files: 3 verified by a published checksum, 2 verified by first use "
            f"({project / 'manifest.lock.csv'}), 4 not yet downloaded") in render(report)
    lock.write_text(lock.read_text().replace("0" * 32, "9" * 32))  # the lock's bundle MD5 against the manifest's
    (problem,) = _readiness(project).problems
    assert problem.where == f"tenx.lock {project / 'manifest.lock.csv'}"
    assert problem.message == (f"section liver_a: bundle_md5 is {'0' * 32} in the manifest, but the file first "
                               f"downloaded from https://x/bundle had {'9' * 32}")


def test_a_derived_url_already_downloaded_needs_no_check(project):
    cache = project / "data" / ".downloads" / "colon_c"
    cache.mkdir(parents=True)
    (cache / "Colon_c_he_image.ome.tif").write_bytes(b"tif")
    colon = _readiness(project).sections[2]
    assert colon.local == "cache 1/3" and colon.checks["downloads"] == Check("seen/derived/seen")


def test_validate_exits_2_with_the_table_until_the_panel_is_ready(project, capsys):
    (project / "params.yaml").write_text(yaml.safe_dump(_params(project), sort_keys=False))
    assert main(["validate", "--record", "data/validated.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cellpath validate: error: the panel is not ready (no stage has run or removed anything):\n"
                          "Readiness of the 10x panel: every section of"), err
    assert err.rstrip().endswith("2 of 3 sections ready; 1 with something to check: the panel is not ready")
    assert "Traceback" not in err and not (project / "data" / "validated.json").exists()
    _reference(project / "data" / "references" / "kim2020_lung.h5ad", vocabulary="kim2020_lung.Cell_type/1")
    assert main(["validate", "--record", "data/validated.json"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("3 of 3 sections ready; 1 with something to check: the panel is ready")
    assert json.loads((project / "data" / "validated.json").read_text())["valid"] is True


def test_missing_urls_rule_without_reference_and_unknown_vocabulary(project):
    rows = pd.read_csv(project / "manifest.csv", dtype=str, keep_default_na=False)
    rows.loc[0, ["he_alignment_url", "he_alignment_url_source"]] = ["", "none found"]  # fetched, but fetch refuses it
    rows.loc[1, ["organ", "status"]] = ["Heart", "Heart failure"]
    rows.to_csv(project / "manifest.csv", index=False)
    _reference(project / "data" / "references" / "tabula_sapiens_normal.h5ad", vocabulary="mine/1")
    liver, heart, _ = _readiness(project).sections
    assert liver.checks["downloads"] == Check("seen/seen/none", MISSING, "fill in he_alignment_url from "
                                              "https://example.org/liver_a (data/manifests/README.md)")
    assert liver.checks["labels"] == Check("unknown", MISSING, "add the rows of vocabulary 'mine/1' to "
                                           "src/cellpath/annotation/data/label_aliases.csv (or set "
                                           "annotate.label_vocabulary)")
    assert heart.reference == "-" and heart.checks["reference"].level == MISSING
    assert heart.checks["reference"].action.startswith("map the section to a reference in annotate.references "
                                                       "(section lung_b: no reference for organ 'Heart'")


def test_override_references_and_their_files(project):
    _reference(project / "data" / "references" / "mylung.h5ad", column="celltype")
    lung = _readiness(project, annotate={"references": {"lung_b": "mylung"}}).sections[1]
    assert lung.reference == "mylung" and lung.checks["reference"] == Check(
        "unusable", MISSING, f"annotate.label_column: 'cell_type': not a column of {project}/data/references/"
                             "mylung.h5ad (obs columns: celltype); did you mean 'celltype'?")
    other = _readiness(project, annotate={"references": {"lung_b": "elsewhere"}}).sections[1]
    assert other.checks["reference"] == Check("missing", MISSING, "put the labelled elsewhere.h5ad in data/references/ "
                                                                  "or change annotate.references")
    assert other.checks["labels"] == Check("-")
    melanoma = _readiness(project, annotate={"references": {"lung_b": "tirosh2016_melanoma"}}).sections[1]
    assert melanoma.checks["reference"].action.startswith("GSE72056 (Tirosh et al. 2016) publishes only")


def test_cellvit_outputs_per_section(project):
    folder = project / "cellvit"
    folder.mkdir()
    (folder / "Liver_a_he_image.ome_cells.json").write_text("{}")
    sections = _readiness(project, concordance={"cellvit_dir": "cellvit"}).sections
    assert sections[0].checks["CellViT++"] == Check("found")
    assert sections[1].checks["CellViT++"] == Check(
        "missing", MISSING, "run CellViT++ on Lung_b_he_image.ome.tif (output into cellvit)")
    absent = _readiness(project, concordance={"cellvit_dir": "nowhere"}).sections[0]
    assert absent.checks["CellViT++"] == Check(
        "no folder", MISSING, "set concordance.cellvit_dir to the folder CellViT++ wrote (--outdir); nowhere does not "
                              "exist")


def test_a_mirror_folder_serves_what_it_holds(project):
    mirror = project / "mirror"
    for name in ("Lung_b", "Colon_c"):
        for suffix in SUFFIXES.values():
            (mirror / "2.0.0" / name).mkdir(parents=True, exist_ok=True)
            (mirror / "2.0.0" / name / f"{name}{suffix}").write_bytes(b"x")
    (mirror / "2.0.0" / "Lung_b" / "Lung_b_outs.zip").unlink()
    report = _readiness(project, tenx={"manifest": str(project / "manifest.csv"), "mirror": "mirror"})
    liver, lung, colon = report.sections
    assert report.mirror == "mirror" and lung.host == "local files"
    assert liver.checks["downloads"] == Check("seen/seen/seen")  # fetched: nothing to serve
    assert lung.checks["downloads"] == Check("seen/seen/seen", MISSING, "copy 2.0.0/Lung_b/Lung_b_outs.zip into the "
                                                                       "mirror (mirror)")
    assert colon.checks["downloads"] == Check("seen/derived/seen")  # the mirror holds it: nothing to check online
    assert "Downloads from tenx.mirror mirror, not from 10x." in render(report)
    gone = _readiness(project, tenx={"manifest": str(project / "manifest.csv"), "mirror": "absent"})
    assert gone.sections == () and "folder not found" in str(gone.problems[0])


def test_paper_preset_lists_the_25_panel_sections_and_fails_without_references(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(PROJECT_ROOT)
    assert main(["validate", "--preset", "paper", "--data-dir", str(tmp_path / "data")]) == 2
    lines = capsys.readouterr().err.splitlines()
    panel = [s.section_id for s in read_manifest(PROJECT_ROOT / "data" / "manifests" / "xenium_datasets.csv")
             if s.panel_s25]
    listed = [line.split()[0] for line in lines if line.split() and line.split()[0] in panel]
    assert len(panel) == 25 and listed == panel
    assert lines[-1].startswith("0 of 25 sections ready") and lines[-1].endswith("the panel is not ready")
    assert main(["validate", "--preset", "paper", "--record", str(tmp_path / "v.json")]) == 2
    assert "leave out --preset paper" in capsys.readouterr().err


def test_placement_preset_checks_the_paper_panel_for_the_users_encoders(monkeypatch, tmp_path, capsys):
    """`--preset placement`: the same 25 sections, titled with the placement configuration and the
    encoders of params.yaml and the default anchors (not the paper's 30), whose weights are not here;
    with ``--anchors`` alone, none; --record refused as for the paper's preset."""
    monkeypatch.chdir(PROJECT_ROOT)
    assert main(["validate", "--preset", "placement", "--data-dir", str(tmp_path / "data")]) == 2
    text = capsys.readouterr().err
    lines = text.splitlines()
    encoders = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())["extract"]["encoders"]
    assert lines[1].endswith(f"in the placement configuration (the paper's at its headline condition) for "
                             f"{', '.join(encoders + ['kaiko-vit-s-16', 'phikon'])}")
    assert lines[-1].startswith("0 of 25 sections ready")
    assert "2 of the configuration's 4 encoders cannot run here (kaiko-vit-s-16, phikon)" in text
    assert main(["validate", "--preset", "placement", "--anchors", "--data-dir", str(tmp_path / "data")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].endswith(f"for {', '.join(encoders)}")
    assert not any("of the configuration's" in line for line in lines)  # the default's encoders need no weights
    assert main(["validate", "--preset", "placement", "--record", str(tmp_path / "v.json")]) == 2
    assert "leave out --preset placement" in capsys.readouterr().err


def test_placement_preset_checks_the_encoders_of_models(monkeypatch, tmp_path, capsys):
    """`--models`: the placement's encoders named on the command line; one without weights here is the
    configuration's problem, named; --models without a paper-panel preset is refused."""
    monkeypatch.chdir(PROJECT_ROOT)
    assert main(["validate", "--preset", "placement", "--models", "filterbank-dense", "--anchors", "--data-dir",
                 str(tmp_path / "data")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].endswith("(the paper's at its headline condition) for filterbank-dense")
    assert not any("of the configuration's" in line for line in lines)
    assert main(["validate", "--preset", "placement", "--models", "uni2", "--anchors", "--data-dir",
                 str(tmp_path / "data")]) == 2
    text = capsys.readouterr().err
    assert "for uni2" in text and "1 of the configuration's 1 encoders cannot run here (uni2)" in text
    assert main(["validate", "--models", "uni2"]) == 2
    assert "--models chooses the encoders of --preset paper or placement" in capsys.readouterr().err


def test_paper_panel_params_leave_out_what_names_simulated_sections(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    data = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    data["annotate"]["references"] = {"breast_cancer_1": "breast"}
    params, notes = paper_panel_params(parse_params(data))
    assert params.source == "10x" and len(params.tenx.sections) == 25 and params.annotate.references == {}
    assert params.panel == "S25" and not params.robustness.shortcut.enabled
    assert notes[0] == "annotate.references: left out breast_cancer_1 (not sections of the paper's panel)"
    assert notes[1].startswith("robustness.shortcut: not checked, its train_levels")


def test_a_manifest_without_bundle_urls_is_a_problem_not_an_empty_ready_panel(project):
    rows = pd.read_csv(project / "manifest.csv", dtype=str, keep_default_na=False)
    rows["bundle_url"] = ""
    rows.to_csv(project / "manifest.csv", index=False)
    report = _readiness(project)
    assert report.sections == () and not report.ready
    assert [p.where for p in report.problems] == ["source: 10x"]
    assert "has a bundle_url yet" in report.problems[0].message
    assert render(report).splitlines()[-1] == "0 of 0 sections ready; 1 other problem(s): the panel is not ready"
