"""The project's text rules for README.md and docs/: a README that reads in five minutes, dates and
commits instead of the project's own working periods, no machine's paths and no pointer outside the
repository, and links that lead somewhere."""

from __future__ import annotations

import re

import pytest

from helpers.project import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
MAX_README_LINES = 200
MAX_README_LINE_CHARS = 120
DOCS = sorted([README, *(PROJECT_ROOT / "docs").rglob("*.md"), PROJECT_ROOT / "benchmarks" / "README.md",
               PROJECT_ROOT / "benchmarks" / "gpu" / "README.md",
               PROJECT_ROOT / "src" / "cellpath" / "data" / "published" / "README.md"])
FORBIDDEN = {
    "a working period instead of a date and commit": re.compile(r"session [0-9]|issue #?[0-9]", re.IGNORECASE),
    "a machine's absolute path": re.compile(r"/work/|/root/|/home/"),
    "a pointer outside the repository": re.compile(r"\.\./shared"),
}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _name(path) -> str:
    return str(path.relative_to(PROJECT_ROOT))


def test_the_readme_reads_in_five_minutes():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_README_LINE_CHARS]
    assert not long, f"README.md lines over {MAX_README_LINE_CHARS} characters: {long}"


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_no_working_periods_machine_paths_or_outside_pointers(path):
    hits = [f"{_name(path)}:{number}: {what}: {line.strip()[:100]}"
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
            for what, pattern in FORBIDDEN.items() if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_the_rules_catch_what_they_are_for():
    machine_paths = ["in " + "/".join(["", "work", "main", "data"]), "/".join(["", "root", "x"]),
                     "/".join(["", "home", "me"])]  # built here, so that this file holds no such path
    caught = ["as measured in session 16", "see Issue #21", "issue 7", *machine_paths, "../shared/seeds/"]
    missed = ["2026-12-04 (8d7f58f)", "the issue of scale", "docs/real-data.md"]
    assert all(any(p.search(text) for p in FORBIDDEN.values()) for text in caught)
    assert not any(p.search(text) for p in FORBIDDEN.values() for text in missed)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_relative_links_lead_to_files_of_the_repository(path):
    missing = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists() or (resolved != PROJECT_ROOT and PROJECT_ROOT not in resolved.parents):
            missing.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text(encoding="utf-8")):
            missing.append(target)
    assert not missing, f"{_name(path)}: links to nothing in the repository: {missing}"
