"""Two runs of one project at once: a second probe or robustness stage, fetch or download of the same file
stops at once naming the lock the first one holds (and nothing of the first is touched); a killed holder
leaves no stale lock. Two stages logging to one MLflow store at once: tests/unit/runtime/test_tracking.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cellpath.config import TenxConfig
from cellpath.errors import ConcurrentRunError
from cellpath.io.layout import stage_lock
from cellpath.io.locks import exclusive
from cellpath.sources.download import download_file
from cellpath.sources.tenx import FETCH_LOCK, fetch_tenx
from helpers.project import HANG_GUARD_S, PROJECT_ROOT, tiny_params

HOLDER = """
import sys, time
from pathlib import Path
from cellpath.io.locks import exclusive
with exclusive(Path(sys.argv[1]), "a test's first run"):
    Path(sys.argv[2]).touch()
    time.sleep(3600)  # until the test kills it
"""


def _held_by_another_process(lock: Path, tmp_path: Path) -> subprocess.Popen:
    """A process holding ``lock`` (returned once it holds it)."""
    ready = tmp_path / f"{lock.name}.held"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(ready)], start_new_session=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready.exists():
        assert holder.poll() is None and time.monotonic() < deadline, "the lock holder did not start"
        time.sleep(0.01)
    return holder


def _kill(holder: subprocess.Popen) -> None:
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)


@pytest.mark.parametrize("stage", ["probe", "robustness"])
def test_a_second_stage_stops_naming_the_lock_and_a_killed_holder_frees_it(stage, tmp_path):
    import importlib

    run = importlib.import_module(f"cellpath.stages.{stage}").run
    data_dir, reports = tmp_path / "data", tmp_path / "reports"
    lock = stage_lock(data_dir, stage)
    holder = _held_by_another_process(lock, tmp_path)
    try:
        with pytest.raises(ConcurrentRunError) as err:
            run(tiny_params(), data_dir, reports)
        assert str(err.value) == (f"{lock}: the {stage} stage of this project is under way in another process, which "
                                  "holds this lock; wait for it to finish (or stop it) and rerun")
        assert not reports.exists()  # it stopped before anything
    finally:
        _kill(holder)
    with exclusive(lock, "the next run"):  # SIGKILL left no stale lock
        pass


def test_a_second_fetch_and_a_second_download_of_one_file_stop(tmp_path):
    manifest = PROJECT_ROOT / "data" / "manifests" / "xenium_datasets.csv"
    downloads = tmp_path / "downloads"
    holder = _held_by_another_process(downloads / FETCH_LOCK, tmp_path)
    try:
        config = TenxConfig(manifest=manifest, sections=["xenium_v1_hliver_nondiseased_section_ffpe"],
                            lock=tmp_path / "lock.csv")
        with pytest.raises(ConcurrentRunError, match=r"a fetch of this project's 10x sections is under way"):
            fetch_tenx(config, tmp_path / "raw", downloads)
        assert not (tmp_path / "raw").exists()
    finally:
        _kill(holder)
    source = tmp_path / "served.bin"
    source.write_bytes(b"x" * 1000)
    dest = tmp_path / "cache" / "served.bin"
    holder = _held_by_another_process(dest.with_name(dest.name + ".lock"), tmp_path)
    try:
        with pytest.raises(ConcurrentRunError, match=rf"the download of {source.as_uri()} is under way"):
            download_file(source.as_uri(), dest, retries=0, timeout_s=10, max_bytes=10**6)
        assert not dest.exists()
    finally:
        _kill(holder)
    assert download_file(source.as_uri(), dest, retries=0, timeout_s=10, max_bytes=10**6).size == 1000
