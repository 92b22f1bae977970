"""Which of cellpath's source files a stage runs: the static import closure of its command.

One notion of "the code a stage depends on" serves both places that need it: dvc.yaml's code
dependencies (``tests/unit/runtime/test_code_deps.py`` fails when a stage's closure has a file its ``deps`` do
not cover, or lists one outside it) and the shard keys of the probe and robustness stages
(:func:`stage_fingerprint`), so editing a module reruns exactly the stages and tasks that import it.

A stage's command is ``cellpath <stage>``; its handler in ``cli.py`` (``_<stage>``) imports the
stage's modules inside its body. The closure follows every ``import cellpath…`` and ``from
cellpath… import …`` of those modules (also inside functions: code a stage may run), adds the
``__init__.py`` of every package on the way (importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__``), and leaves out ``cli.py``, the dispatcher every stage shares. Read from the
source as text (``ast``): nothing is imported, so it works for any stage on any machine.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/cellpath
#: Data folders of the package that a module reads at run time (not imports): module → folder.
RESOURCES = {"annotation/ontology.py": "annotation/data", "published/__init__.py": "data/published",
             "report/render.py": "report/templates", "report/gallery.py": "report/templates"}
#: Numerical libraries whose versions enter a fingerprint: they change results as code does.
LIBRARIES = ("numpy", "scipy", "pandas", "pyarrow", "torch", "timm", "scikit-learn", "faiss-cpu", "faiss-gpu-cu12")


def module_file(name: str, root: Path = PACKAGE_DIR) -> Path | None:
    """The file of module ``name`` (``cellpath.a.b``) under ``root``: ``a/b.py`` or ``a/b/__init__.py``."""
    parts = name.split(".")
    if parts[0] != root.name:
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(tree: ast.AST, root: Path = PACKAGE_DIR) -> set[str]:
    """Names of the package's modules a syntax tree imports (absolute imports only, as the package uses)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == root.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != root.name:
                continue
            names.add(node.module)
            # `from cellpath.x import y` imports module cellpath.x.y when y is one
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if module_file(f"{node.module}.{alias.name}", root) is not None)
    return {name for name in names if module_file(name, root) is not None}


def _with_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_closure(modules: Iterable[str], root: Path = PACKAGE_DIR) -> set[Path]:
    """Every file of the package that importing ``modules`` runs, their packages' ``__init__`` included."""
    seen: set[str] = set()
    pending = [package for name in modules for package in _with_packages(name)]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name, root)
        if path is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        pending.extend(package for found in imported_modules(tree, root) for package in _with_packages(found))
    return {path for name in seen if (path := module_file(name, root)) is not None}


def _handler(stage: str, root: Path) -> ast.FunctionDef:
    cli = root / "cli.py"
    for node in ast.parse(cli.read_text(), filename=str(cli)).body:
        if isinstance(node, ast.FunctionDef) and node.name == f"_{stage}":
            return node
    raise KeyError(f"{cli} has no handler _{stage} for the stage {stage!r}")


def stage_files(stage: str, root: Path = PACKAGE_DIR) -> set[Path]:
    """The source files the command ``cellpath <stage>`` runs, ``cli.py`` left out."""
    closure = import_closure(imported_modules(_handler(stage, root), root), root)
    return closure - {root / "cli.py"}


@lru_cache(maxsize=None)
def stage_fingerprint(stage: str) -> dict[str, object]:
    """A digest of the stage's source files (:func:`stage_files`) and the numerical libraries' versions."""
    source = hashlib.sha256()
    for path in sorted(stage_files(stage)):
        source.update(str(path.relative_to(PACKAGE_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"source": source.hexdigest()[:16], "libraries": versions}


def stage_names(root: Path = PACKAGE_DIR) -> list[str]:
    """The commands of ``cli.py``'s ``STAGES`` table, in table order (each has a handler ``_<name>``)."""
    tree = ast.parse((root / "cli.py").read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "STAGES" and isinstance(node.value, ast.Dict):
            return [key.value for key in node.value.keys if isinstance(key, ast.Constant)]
    raise KeyError(f"{root / 'cli.py'} has no STAGES table")


def dvc_entries(files: set[Path], root: Path = PACKAGE_DIR) -> list[str]:
    """``files`` as dvc.yaml ``deps`` paths relative to the project, with the data folders their
    modules read (:data:`RESOURCES`): a subpackage whose every module is in ``files`` becomes its
    folder (which then covers its data files too, e.g. the report's templates); other files stay."""
    project = root.parents[1]
    entries: set[Path] = set()
    for path in files:
        whole = [folder for folder in path.parents if root in folder.parents
                 and all(module in files for module in folder.rglob("*.py"))]
        entries.add(whole[-1] if whole else path)  # the outermost such folder
        entries.update(root / resource for module, resource in RESOURCES.items() if path == root / module)
    return sorted(str(entry.relative_to(project)) for entry in entries)


def main() -> None:
    """Print each stage's source files as dvc.yaml ``deps`` entries (``python -m cellpath.runtime.code_deps``)."""
    for stage in stage_names():
        print(f"{stage}:")
        for entry in dvc_entries(stage_files(stage)):
            print(f"  - {entry}")


if __name__ == "__main__":
    main()
