"""Dependencies point one way (docs/architecture.md): stages → domain packages → io, config,
vocabulary, errors. Read from the source with cellpath.runtime.code_deps (nothing is imported)."""

from __future__ import annotations

import ast

import pytest

from cellpath.runtime.code_deps import PACKAGE_DIR, imported_modules

DOMAIN = ("annotation", "concordance", "features", "probing", "published", "robustness", "report", "simulation",
          "sources")


def _imports(relative: str) -> set[str]:
    path = PACKAGE_DIR / relative
    return imported_modules(ast.parse(path.read_text()), PACKAGE_DIR)


def _modules(folder: str) -> list[str]:
    return sorted(str(p.relative_to(PACKAGE_DIR)) for p in (PACKAGE_DIR / folder).rglob("*.py"))


@pytest.mark.parametrize("module", _modules("stages"))
def test_no_stage_imports_another_stage(module):
    own = "cellpath." + module.removesuffix(".py").replace("/", ".")
    others = {name for name in _imports(module) if name.startswith("cellpath.stages.") and name != own}
    assert not others, f"{module} imports {others}: shared code belongs in a domain package"


@pytest.mark.parametrize("module", _modules("runtime") + _modules("io"))
def test_runtime_and_io_import_nothing_of_the_domain(module):
    domain = {name for name in _imports(module) if name.split(".")[1] in (*DOMAIN, "stages")}
    assert not domain, f"{module} imports {domain}: runtime/ and io/ sit below the domain packages"


@pytest.mark.parametrize("module", [m for folder in DOMAIN for m in _modules(folder)])
def test_no_domain_package_imports_a_stage(module):
    assert not {name for name in _imports(module) if name.startswith("cellpath.stages")}


def test_the_xenium_reader_takes_the_format_from_io_not_from_the_simulator():
    imported = _imports("io/ingest.py")
    assert "cellpath.io.xenium" in imported
    assert not {name for name in imported if name.split(".")[1] in ("sources", "simulation")}
