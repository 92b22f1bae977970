"""The shape of the code a newcomer reads: ``stages/`` is dvc.yaml one to one, stage modules stay
short (read, call the domain, write), and no function in ``src/`` grows past a screen."""

from __future__ import annotations

import ast

import yaml

from cellpath.runtime.code_deps import PACKAGE_DIR
from helpers.project import PROJECT_ROOT

STAGES_DIR = PACKAGE_DIR / "stages"
MAX_STAGE_LINES = 200
MAX_FUNCTION_LINES = 60


def _stage_modules() -> set[str]:
    return {p.stem for p in STAGES_DIR.glob("*.py") if p.name != "__init__.py"}


def test_the_stage_modules_are_exactly_dvc_yamls_stages():
    stages = set(yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"])
    modules = _stage_modules()
    assert modules == stages, (f"stages/ without a DVC stage: {sorted(modules - stages)}; "
                               f"DVC stages without a module: {sorted(stages - modules)}")


def test_every_stage_command_runs_its_own_module():
    """dvc.yaml's ``cmd`` of stage ``<name>`` is ``cellpath <name> …``, which runs ``stages/<name>.py``."""
    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        cmd = stage["do"]["cmd"] if "foreach" in stage else stage["cmd"]
        assert cmd.split()[:2] == ["cellpath", name], f"{name}: {cmd}"


def test_no_stage_module_is_longer_than_a_read_call_write():
    long = {p.name: n for p in STAGES_DIR.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_STAGE_LINES}
    assert not long, f"stage modules over {MAX_STAGE_LINES} lines (move the domain logic to its package): {long}"


def test_no_function_in_the_package_is_longer_than_a_screen():
    long = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE_DIR)}:{node.name} ({length} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
