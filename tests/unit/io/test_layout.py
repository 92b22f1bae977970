"""Every path under data/ and reports/ comes from cellpath.io.layout: no other module builds one."""

from __future__ import annotations

import ast

import pytest

from cellpath.io import layout
from helpers.project import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "src" / "cellpath"
ROOT_NAMES = {"data_dir", "reports", "reports_dir"}  # what every stage calls the two folders
FOLDER_LITERALS = ("data", "reports")


def _root_of_division(node: ast.BinOp) -> ast.AST:
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        node = node.left
    return node


def _is_folder(node: ast.AST) -> bool:
    """``data_dir``, ``reports``, ``Path(data_dir)`` or ``Path(...).resolve()`` of one of them."""
    if isinstance(node, ast.Name):
        return node.id in ROOT_NAMES
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "resolve":
            return _is_folder(node.func.value)
        if isinstance(node.func, ast.Name) and node.func.id == "Path" and node.args:
            return _is_folder(node.args[0])
    return False


def _is_folder_literal(node: ast.AST) -> bool:
    """``Path("data/…")`` or ``Path("reports") / …``: the folders named by hand."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path" and node.args:
        first = node.args[0]
        return isinstance(first, ast.Constant) and isinstance(first.value, str) \
            and first.value.split("/")[0] in FOLDER_LITERALS
    return False


def hand_built_paths(source: str) -> list[int]:
    """Lines of ``source`` that join a path onto the data or reports folder, or name one by hand."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            root = _root_of_division(node)
            if _is_folder(root) or _is_folder_literal(root):
                lines.add(node.lineno)
        elif _is_folder_literal(node):
            lines.add(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("snippet", [
    'labels = data_dir / "labels"',
    'index = Path(data_dir) / "sections" / "sections.csv"',
    'features = Path(data_dir).resolve() / "features"',
    'out = reports / "probe" / "timing.json"',
    'manifest = Path("data/manifests/xenium_datasets.csv")',
    'default = Path("reports") / "index.html"',
])
def test_the_check_finds_a_hand_built_path(snippet):
    assert hand_built_paths(snippet) == [1]


@pytest.mark.parametrize("snippet", [
    'labels = labels_dir(data_dir) / f"{section_id}.parquet"',
    'slide = raw_dir(data_dir) / row.raw_folder / row.he_image',
    'table = outcome.output / "summary.parquet"',
    'read(Path(data_dir))',
])
def test_the_check_passes_paths_built_from_the_layout(snippet):
    assert hand_built_paths(snippet) == []


def test_no_module_but_the_layout_builds_a_data_or_reports_path():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "io" / "layout.py":
            continue
        lines = hand_built_paths(path.read_text())
        if lines:
            found[str(path.relative_to(PROJECT_ROOT))] = lines
    assert not found, f"paths under data/ or reports/ built outside cellpath.io.layout (file: lines): {found}"


def test_every_layout_path_lies_in_its_folder(tmp_path):
    data, reports = tmp_path / "data", tmp_path / "reports"
    helpers = {name: getattr(layout, name) for name in dir(layout)
               if callable(getattr(layout, name)) and getattr(getattr(layout, name), "__module__", "") == layout.__name__}
    assert len(helpers) >= 20
    for name, helper in helpers.items():
        argument_names = helper.__code__.co_varnames[:helper.__code__.co_argcount]
        folder = data if argument_names[0] == "data_dir" else reports
        path = helper(folder, *(["sec_1"] * (len(argument_names) - 1)))
        assert folder in path.parents, name
    assert layout.section_labels(data, "sec_1") == data / "labels" / "sec_1.parquet"
    assert layout.section_index_csv(data) == data / "sections" / "sections.csv"
    assert layout.probe_runs_parquet(reports) == reports / "probe" / "runs.parquet"
