"""Dependencies point one way (docs/architecture.md): stages and commands → domain packages → io,
runtime, config, vocabulary, errors. Read from the source with cellpath.runtime.code_deps (nothing is
imported)."""

from __future__ import annotations

import ast

import pytest
import yaml

from cellpath.runtime.code_deps import PACKAGE_DIR, imported_modules
from helpers.project import PROJECT_ROOT

DOMAIN = ("annotation", "concordance", "expression", "features", "planning", "probing", "published", "references",
          "registration", "report", "robustness", "simulation", "sources")
TOP = ("stages", "commands")  # what cli.py dispatches to: the DVC stages and the other commands


def _imports(relative: str) -> set[str]:
    path = PACKAGE_DIR / relative
    return imported_modules(ast.parse(path.read_text()), PACKAGE_DIR)


def _package(name: str) -> str:
    """The top-level package of module ``name`` under cellpath (``cellpath.a.b`` → ``a``)."""
    return name.partition(".")[2].partition(".")[0]


def _modules(folder: str) -> list[str]:
    return sorted(str(p.relative_to(PACKAGE_DIR)) for p in (PACKAGE_DIR / folder).rglob("*.py"))


@pytest.mark.parametrize("module", _modules("stages"))
def test_no_stage_imports_another_stage(module):
    own = "cellpath." + module.removesuffix(".py").replace("/", ".")
    others = {name for name in _imports(module) if name.startswith("cellpath.stages.") and name != own}
    assert not others, f"{module} imports {others}: shared code belongs in a domain package"


@pytest.mark.parametrize("module", _modules("runtime") + _modules("io"))
def test_runtime_and_io_import_nothing_of_the_domain(module):
    domain = {name for name in _imports(module) if _package(name) in (*DOMAIN, *TOP)}
    assert not domain, f"{module} imports {domain}: runtime/ and io/ sit below the domain packages"


@pytest.mark.parametrize("module", [m for folder in DOMAIN for m in _modules(folder)])
def test_no_domain_package_imports_a_stage_or_a_command(module):
    above = {name for name in _imports(module) if _package(name) in TOP}
    assert not above, f"{module} imports {above}: stages/ and commands/ sit on top of the domain packages"


@pytest.mark.parametrize("module", _modules("commands"))
def test_no_command_imports_a_stage_or_another_command(module):
    own = "cellpath." + module.removesuffix(".py").replace("/", ".")
    others = {name for name in _imports(module) if _package(name) in TOP and name != own}
    assert not others, f"{module} imports {others}: shared code belongs in a domain package"


@pytest.mark.parametrize("module", _modules("stages"))
def test_no_stage_imports_a_command(module):
    commands = {name for name in _imports(module) if name.startswith("cellpath.commands")}
    assert not commands, f"{module} imports {commands}: shared code belongs in a domain package"


def test_the_stages_folder_holds_exactly_the_dvc_stages():
    stages = set(yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"])
    modules = {m.removeprefix("stages/").removesuffix(".py") for m in _modules("stages")} - {"__init__"}
    assert modules == stages, f"not a DVC stage (commands/ holds those): {sorted(modules - stages)}; " \
                              f"a stage without a module: {sorted(stages - modules)}"


def test_the_xenium_reader_takes_the_format_from_io_not_from_the_simulator():
    imported = _imports("io/ingest.py")
    assert "cellpath.io.xenium" in imported
    assert not {name for name in imported if _package(name) in ("sources", "simulation")}
