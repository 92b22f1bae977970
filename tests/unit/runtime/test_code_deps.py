"""The code a stage depends on: its import closure, computed from the source, equals dvc.yaml's code deps."""

from pathlib import Path

import pytest
import yaml

from cellpath.runtime.code_deps import PACKAGE_DIR, dvc_entries, import_closure, stage_files, stage_names
from helpers.project import PROJECT_ROOT


def _dvc_code_deps() -> dict[str, list[str]]:
    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, body in stages.items():
        command = body["cmd"].split()
        assert command[:2] == ["cellpath", name], f"stage {name} runs {body['cmd']!r}, not `cellpath {name}`"
        out[name] = sorted(dep for dep in body.get("deps", []) if dep.startswith("src/"))
    return out


@pytest.mark.parametrize("stage", sorted(_dvc_code_deps()))
def test_dvc_yaml_lists_exactly_the_code_each_stage_runs(stage):
    listed = _dvc_code_deps()[stage]
    computed = dvc_entries(stage_files(stage))
    missing, stale = sorted(set(computed) - set(listed)), sorted(set(listed) - set(computed))
    assert not missing and not stale, (
        f"dvc.yaml stage {stage!r}: code deps missing {missing}, listed but not run {stale}; "
        f"`python -m cellpath.runtime.code_deps` prints every stage's entries")


def test_no_stage_depends_on_an_empty_file():
    """DVC warns "'<file>' is empty" for every empty dependency at every `dvc repro`: each package's
    __init__.py has its one-line docstring instead."""
    empty = sorted({dep for deps in _dvc_code_deps().values() for dep in deps
                    if (PROJECT_ROOT / dep).is_file() and (PROJECT_ROOT / dep).stat().st_size == 0})
    assert not empty, f"empty files listed as dvc.yaml deps (DVC warns about each): {empty}"


def test_every_dvc_stage_is_a_cli_stage():
    assert set(_dvc_code_deps()) <= set(stage_names())


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_closure_follows_function_level_and_from_imports_and_adds_packages(tmp_path):
    pkg = _package(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "import os\n\ndef f():\n    from pkg.b import thing\n    return thing\n",
        "b.py": "from pkg.sub import c\nthing = 1\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.sub.deep.e\n",
        "sub/d.py": "",  # never imported
        "sub/deep/__init__.py": "",
        "sub/deep/e.py": "",
        "unrelated.py": "import pkg.a\n",  # imports a, but nothing imports it
    })
    closure = {str(p.relative_to(pkg)) for p in import_closure(["pkg.a"], pkg)}
    assert closure == {"__init__.py", "a.py", "b.py", "sub/__init__.py", "sub/c.py", "sub/deep/__init__.py",
                       "sub/deep/e.py"}
    # sub/deep is imported whole, so it becomes one folder entry; sub is not (d.py is missing)
    entries = dvc_entries(import_closure(["pkg.a"], pkg), pkg)
    assert [e.split("pkg/", 1)[1] for e in entries] == ["__init__.py", "a.py", "b.py", "sub/__init__.py", "sub/c.py",
                                                        "sub/deep"]


def test_a_stage_does_not_depend_on_another_stages_code():
    probe = {str(p.relative_to(PACKAGE_DIR)) for p in stage_files("probe")}
    assert {"stages/probe.py", "probing/fit.py", "probing/stats.py", "probing/protocols.py"} <= probe
    assert not any(p.startswith(("report/", "robustness/", "stages/robustness", "stages/report")) for p in probe)
    assert "cli.py" not in probe
    assert not [p for p in stage_files("fetch") if p.name in ("probe.py", "transfer.py", "detector.py")]
