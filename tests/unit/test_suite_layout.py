"""The suite's own rules: where tests live, what they may import, which are slow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import croma

from helpers.project import PROJECT_ROOT

TESTS = PROJECT_ROOT / "tests"
FOLDERS = ("unit", "stages", "pipeline")  # unit/<package>/: the maths and readers; stages/: one stage; pipeline/: dvc


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_every_test_module_lives_in_one_of_the_three_folders():
    misplaced = [str(p.relative_to(TESTS)) for p in _test_modules() if p.relative_to(TESTS).parts[0] not in FOLDERS]
    assert not misplaced, f"test modules outside {FOLDERS}: {misplaced}"
    assert len(_test_modules()) >= 40


def test_no_test_module_imports_another_or_the_conftest():
    offenders = {}
    for path in [*_test_modules(), *(TESTS / "helpers").glob("*.py")]:
        bad = [name for name in _imported(ast.parse(path.read_text()))
               if name.split(".")[-1].startswith("test_") or name.split(".")[-1] == "conftest"]
        if bad:
            offenders[str(path.relative_to(TESTS))] = bad
    assert not offenders, f"shared code belongs in tests/helpers/, not in a test module: {offenders}"


def test_croma_is_used_through_its_public_api_only():
    public = {*croma.__all__, "__all__"}
    offenders = {}
    for path in _test_modules():
        tree = ast.parse(path.read_text())
        bad = [name for name in _imported(tree) if name.startswith("croma.")]
        bad += [f"croma.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "croma" and node.attr not in public]
        if bad:
            offenders[str(path.relative_to(TESTS))] = bad
    assert not offenders, f"croma's private modules or names (public: {sorted(public)}): {offenders}"


def test_the_slow_tests_are_the_pipeline_folder():
    for path in _test_modules():
        in_pipeline = path.relative_to(TESTS).parts[0] == "pipeline"
        marked = any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                     and any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node.value))
                     for node in ast.parse(path.read_text()).body)
        assert marked == in_pipeline, (f"{path.relative_to(TESTS)}: " + (
            "a pipeline test must be marked slow (pytestmark)" if in_pipeline else
            "a slow test belongs in tests/pipeline/ (make test-fast skips that folder's tests)"))


def test_loadgroup_runs_a_group_on_one_worker(tmp_path):
    """`make test` runs `--dist loadgroup` (docs/decisions/0042): a group's tests on one worker, so that
    its module fixtures (a SLURM cluster, a copy of the tiny project's run) are built once. pytest 9.2
    with pytest-xdist 3.8 grouped nothing, silently: every module fixture was built on both workers."""
    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\npytestmark = pytest.mark.xdist_group('one')\n\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_where(i):\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'workers.txt'), 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                             "-q", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers
