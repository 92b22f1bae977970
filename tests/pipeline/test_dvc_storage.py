"""The DVC cache at the paper's scale: outputs are links into the cache, not second copies; a stage
rerun leaves every cached object as it was; two checkouts share one lab cache.

Run on the tiny project with the project's own `.dvc/config` (docs/decisions/0041). On this suite's
filesystems (one ext4 or overlay filesystem for the project and its cache) DVC links with hard
links; the assertions hold for symbolic links too (``os.path.samefile`` follows them).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

from helpers.dvc_project import cached_files, run

pytestmark = pytest.mark.slow


def cache_state(cache_root: Path) -> dict[Path, tuple[str, int]]:
    """Each object file of a cache: the md5 of its bytes and its modification time (ns)."""
    objects = cache_root / "files" / "md5"
    return {p: (hashlib.md5(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(objects.rglob("*")) if p.is_file()}


def assert_intact(state: dict[Path, tuple[str, int]]) -> None:
    """Every object still holds the bytes its name is the md5 of, written no later than before."""
    for path, (digest, mtime) in state.items():
        name = path.parent.name + path.name.removesuffix(".dir")
        assert digest == name, f"{path}: its bytes hash to {digest}"
        assert (hashlib.md5(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns) == (digest, mtime), path


def assert_linked(project: Path) -> dict[Path, Path]:
    files = cached_files(project)
    assert len(files) > 50, files  # the tiny project caches a few hundred files
    for workspace, cached in files.items():
        assert os.path.samefile(workspace, cached), f"{workspace} is a copy of {cached}, not a link to it"
        assert stat.S_IMODE(cached.stat().st_mode) & 0o222 == 0, f"{cached} is writable (DVC protects its links)"
    return files


def test_every_cached_output_is_a_link_into_the_cache(tiny_dvc_run):
    """After `dvc repro` the workspace adds no bytes: every cached output file is the cache's object."""
    files = assert_linked(tiny_dvc_run["completed"])
    workspace = {(p.stat().st_dev, p.stat().st_ino) for p in files}
    assert workspace == {(p.stat().st_dev, p.stat().st_ino) for p in files.values()}


@pytest.fixture()
def relinked(tiny_dvc_run, tmp_path) -> Path:
    """A copy of the completed run whose workspace is linked to its own cache again (a copy breaks links)."""
    work = tmp_path / "work"
    shutil.copytree(tiny_dvc_run["completed"], work, symlinks=True)
    run(["dvc", "checkout", "--relink"], work)
    assert_linked(work)
    return work


def test_stage_reruns_leave_every_cached_object_intact(relinked):
    """A forced rerun of a stage with persistent outputs (DVC copies them out of the cache first), and
    stages run by hand outside DVC over linked outputs (each write must make a new file, never write
    through a link): no object of the cache changes, and the outputs are the same."""
    before = cache_state(relinked / ".dvc" / "cache")
    assert_intact(before)
    out = run(["dvc", "repro", "--force", "--single-item", "fetch"], relinked)
    assert "Running stage 'fetch'" in out
    run(["cellpath", "ingest"], relinked)
    run(["cellpath", "extract", "--encoder", "filterbank-dense", "--magnification", "10x"], relinked)
    assert_intact(before)
    status = run(["dvc", "status"], relinked)
    assert "up to date" in status, status  # deterministic stages: the same bytes, so nothing is stale


def test_two_checkouts_share_one_lab_cache(tiny_dvc_run, tmp_path):
    """A lab's cache on a shared filesystem: the first user moves the outputs into it, a second clone
    links them from it and `dvc repro` there reruns nothing."""
    shared = tmp_path / "lab-cache"
    alice = tmp_path / "alice"
    shutil.copytree(tiny_dvc_run["completed"], alice, symlinks=True)
    run(["dvc", "cache", "dir", str(shared)], alice)
    run(["dvc", "config", "cache.shared", "group"], alice)
    run(["dvc", "commit", "--force"], alice)  # the outputs into the shared cache, linked back
    run(["git", "add", "-A"], alice)
    run(["git", "commit", "-qm", "outputs in the lab cache"], alice)
    alice_files = assert_linked(alice)
    assert all(cached.is_relative_to(shared) for cached in alice_files.values())
    for folder in [shared / "files" / "md5", *(shared / "files" / "md5").iterdir()]:
        mode = stat.S_IMODE(folder.stat().st_mode)
        assert mode & 0o070 == 0o070 and mode & stat.S_ISGID, f"{folder}: {oct(mode)} is not group-writable"

    bob = tmp_path / "bob"
    run(["git", "clone", "-q", str(alice), str(bob)], tmp_path)
    assert not (bob / "data" / "raw").exists()
    run(["dvc", "checkout"], bob)
    bob_files = assert_linked(bob)
    assert {p.relative_to(bob) for p in bob_files} == {p.relative_to(alice) for p in alice_files}
    for path, cached in bob_files.items():
        assert os.path.samefile(path, alice / path.relative_to(bob))  # one copy on disk for both users
    assert "up to date" in run(["dvc", "status"], bob)
    assert "Running stage" not in run(["dvc", "repro"], bob)


def test_dvc_gc_removes_only_what_no_output_uses(relinked):
    """`dvc gc --workspace` over linked outputs: an object no output uses goes, every linked output and
    its object stay as they were, and nothing is stale or missing afterwards."""
    used = {cached: state for cached, state in cache_state(relinked / ".dvc" / "cache").items()
            if cached in set(cached_files(relinked).values())}
    stray = relinked / "stray.bin"
    stray.write_bytes(b"an output of an abandoned experiment\n" * 1000)
    run(["dvc", "add", "stray.bin"], relinked)
    (stray_object,) = set(cached_files(relinked).values()) - set(used)
    (relinked / "stray.bin.dvc").unlink()
    stray.unlink()
    run(["dvc", "gc", "--workspace", "--force"], relinked)
    assert not stray_object.exists()
    assert_intact(used)
    assert_linked(relinked)
    assert "up to date" in run(["dvc", "status"], relinked)
    shutil.rmtree(relinked / "data" / "features")
    run(["dvc", "checkout"], relinked)  # every directory's manifest survived too
    assert_linked(relinked)
