"""An interrupted `dvc repro` (SIGINT, as Ctrl-C sends it, and SIGKILL, to the whole process group):
the rerun completes, gives the results of an uninterrupted run and reuses the work that was finished.

No test here races the clock. Extract and probe run with the executor's test gate
(``CELLPATH_TASK_GATE``): every task that has written its output waits there until the test releases
it, so the signal lands while a chosen task is mid-way (its output written but not yet in place) on
any machine, however fast or loaded. Extract and probe are interrupted four times in a row on the
tiny project (SIGINT and SIGKILL in each). Fetch (the 10x source) is interrupted while the local
server holds the second section's download after its first MiB. The only time limits are hang guards
(minutes, far above any run's length). See docs/decisions/0013-interruption-and-persistent-outputs.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import yaml

from cellpath.runtime.executor import TASK_GATE_VARIABLE
from helpers.dvc_project import dvc_env
from helpers.http_server import FaultyServer, serving
from helpers.project import HANG_GUARD_S

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]

# Run a command as a terminal's foreground job has it: SIGINT at its default. A shell that starts the
# suite in the background without job control (`make test &` in a script, nohup) passes SIGINT on
# as ignored, and Python then never turns it into KeyboardInterrupt: Ctrl-C would do nothing.
WITH_DEFAULT_SIGINT = (sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execvp(sys.argv[1], sys.argv[1:])")
REUSED = re.compile(r"executor local \(1 worker\(s\)\): (\d+) task\(s\), (\d+) already complete")


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def _results(work: Path) -> dict:
    runs = pd.read_parquet(work / "reports" / "probe" / "runs.parquet").drop(columns=["fit_seconds"])
    return {"runs": runs, "robustness": (work / "reports" / "robustness" / "summary.csv").read_text(),
            "features": _digest(work / "data" / "features"), "raw": _digest(work / "data" / "raw")}


def _repro(work: Path, *targets: str) -> str:
    """`dvc repro` to completion; its stdout and stderr as one stream (stage logs between their headers)."""
    result = subprocess.run(["dvc", "repro", *targets], cwd=work, env=dvc_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, f"dvc repro failed ({result.returncode}):\n{result.stdout}"
    return result.stdout


def _stage_log(log: str, stage: str) -> str | None:
    """The part of a `dvc repro` log written by ``stage`` (None when the stage did not run)."""
    parts = re.split(r"^Running stage '([^']+)':$", log, flags=re.MULTILINE)
    for name, text in zip(parts[1::2], parts[2::2]):
        if name == stage:
            return text
    return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _interrupt(work: Path, held: Callable[[dict], bool], finished: Callable[[], list[str]], sig: int,
               command: tuple[str, ...] = ("dvc", "repro"), env: dict[str, str] | None = None,
               after: Callable[[], None] = lambda: None) -> tuple[list[str], str]:
    """Run ``command`` in ``work`` until ``held(state)`` says it is held at the interruption point, record
    ``finished()``, send ``sig`` to its process group, call ``after()`` and wait for every process of the
    group to end. ``state`` holds ``process`` and the run's ``log`` so far. Returns what was finished and
    the run's log."""
    log_path = work.parent / f"{work.name}.{len(list(work.parent.glob(f'{work.name}.*.log')))}.log"
    with open(log_path, "w") as out:
        process = subprocess.Popen([*WITH_DEFAULT_SIGINT, *command], cwd=work, env=env or dvc_env(), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + HANG_GUARD_S
        while not held({"process": process, "log": log_path.read_text()}):
            assert process.poll() is None, f"{command} ended before the interruption point:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"hang guard: no interruption point after {HANG_GUARD_S} s"
            time.sleep(0.01)
        done = finished()
        os.killpg(process.pid, sig)
        after()
        process.wait(timeout=HANG_GUARD_S)
        deadline = time.monotonic() + HANG_GUARD_S
        while _group_alive(process.pid):  # e.g. a stage command still removing its partial outputs
            assert time.monotonic() < deadline, "hang guard: processes of the interrupted run did not end"
            time.sleep(0.05)
    text = log_path.read_text()
    assert process.returncode != 0, f"{command} was not interrupted:\n{text}"
    if sig == signal.SIGINT:  # the stage command itself received it (dvc ignores SIGINT while a command runs)
        assert "interrupted after" in text and "rerun to resume" in text, text
    return done, text


# --- extract and probe: a tiny simulated panel at two magnifications ------------------------------------


class Gate:
    """The executor's test gate (``cellpath.runtime.executor.wait_at_gate``) seen from the test: tasks that wait
    are released one by one, except the ``ordinal``-th task whose key starts with ``prefix``, which is
    held (the interruption point)."""

    def __init__(self, folder: Path, prefix: str, ordinal: int):
        self.folder, self.prefix, self.ordinal = folder, prefix, ordinal
        folder.mkdir(parents=True)
        self.released: list[str] = []

    def env(self) -> dict[str, str]:
        return dvc_env() | {TASK_GATE_VARIABLE: str(self.folder)}

    def held(self, state: dict) -> bool:
        """Release every waiting task but the chosen one; True once the chosen one waits."""
        for waiting in sorted(self.folder.glob("*.waiting")):
            key = waiting.read_text()
            if key in self.released:
                continue
            if key.startswith(self.prefix) and sum(k.startswith(self.prefix) for k in self.released) + 1 == self.ordinal:
                return True
            (self.folder / f"{waiting.stem}.go").touch()
            self.released.append(key)
        return False


def _finished_sections(work: Path, magnification: str) -> Callable[[], list[str]]:
    folder = work / "data" / "features" / "filterbank-dense" / magnification
    return lambda: sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _finished_shards(work: Path) -> Callable[[], list[str]]:
    folder = work / "data" / ".work" / "probe"
    return lambda: sorted(p.name for p in folder.glob("probe-*") if p.is_dir())  # complete (partials are hidden)


@pytest.fixture(scope="module")
def pristine(tiny_dvc_run) -> Path:
    """The tiny project before any run (two magnifications give the probe two tasks)."""
    return tiny_dvc_run["pristine"]


def _without_extract_and_probe(completed: Path, work: Path) -> Path:
    """A copy of the completed run without the outputs of extract and probe, their entries in
    dvc.lock (else DVC checks the outputs out of its cache), DVC's run cache and the probe's finished
    tasks: `dvc repro` there runs both extracts and the probe from nothing, on the inputs the stages
    before them made (as a first run would, without running those stages again)."""
    shutil.copytree(completed, work, symlinks=True)
    shutil.rmtree(work / ".dvc" / "cache" / "runs")
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    for stage in ("extract@filterbank-dense-10x", "extract@filterbank-dense-20x", "probe"):
        del lock["stages"][stage]
    (work / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    for magnification in ("10x", "20x"):
        shutil.rmtree(work / "data" / "features" / "filterbank-dense" / magnification)
    shutil.rmtree(work / "reports" / "probe")
    shutil.rmtree(work / "data" / ".work" / "probe")
    return work


@pytest.fixture(scope="module")
def reference(tiny_dvc_run) -> dict:
    """The results of an uninterrupted run."""
    return _results(tiny_dvc_run["completed"])


def _assert_reused(log: str, stage: str, finished: list[str]) -> None:
    """The rerun of ``stage`` found exactly the tasks recorded as finished, and not all of them."""
    text = _stage_log(log, stage)
    assert text is not None, f"stage {stage} did not rerun:\n{log}"
    reused = REUSED.search(text)
    assert reused is not None, f"no executor line in the rerun of {stage}:\n{text}"
    total, complete = map(int, reused.groups())
    assert complete == len(finished) < total, (finished, text)


def test_interrupted_extract_and_probe_resume_identically(tiny_dvc_run, reference, tmp_path):
    """Four interruptions in a row, each in the middle of a task, each rerun picking up the work left."""
    work = _without_extract_and_probe(tiny_dvc_run["completed"], tmp_path / "work")
    at_10x, at_20x = "extract@filterbank-dense-10x", "extract@filterbank-dense-20x"

    def interrupt(prefix: str, ordinal: int, finished: Callable[[], list[str]], sig: int) -> tuple[list[str], str]:
        gate = Gate(tmp_path / f"gate-{len(list(tmp_path.glob('gate-*')))}", prefix, ordinal)
        return _interrupt(work, gate.held, finished, sig, env=gate.env())

    sections_10x, _ = interrupt("extract-filterbank-dense-10x-", 2, _finished_sections(work, "10x"), signal.SIGINT)
    assert len(sections_10x) == 1, sections_10x  # held while the second section was being extracted
    sections_20x, log = interrupt("extract-filterbank-dense-20x-", 2, _finished_sections(work, "20x"), signal.SIGKILL)
    _assert_reused(log, at_10x, sections_10x)
    assert len(sections_20x) == 1, sections_20x
    shards, log = interrupt("probe-", 2, _finished_shards(work), signal.SIGINT)
    _assert_reused(log, at_20x, sections_20x)
    assert len(shards) == 1, shards  # held while the second shard was being fitted
    still, log = interrupt("probe-", 1, _finished_shards(work), signal.SIGKILL)
    _assert_reused(log, "probe", shards)
    assert still == shards
    rerun = _repro(work)
    _assert_reused(rerun, "probe", shards)
    assert _stage_log(rerun, at_10x) is None and _stage_log(rerun, at_20x) is None  # finished earlier
    results = _results(work)
    pd.testing.assert_frame_equal(results["runs"], reference["runs"], check_exact=True)
    assert results["robustness"] == reference["robustness"]
    assert results["features"] == reference["features"]
    assert results["raw"] == reference["raw"]
    assert "Running stage" not in _repro(work)  # and the pipeline is complete


# --- fetch: the 10x source against a throttled local server ---------------------------------------------


SECTIONS = ("sec_a", "sec_b")
PREFIX = "Xenium_V1_Test_"


def _serve_sections(root: Path) -> None:
    """Per section a 2 MiB bundle (incompressible: two full download chunks), an image, an alignment."""
    rng = random.Random(0)
    for section in SECTIONS:
        folder = root / section
        folder.mkdir(parents=True)
        with zipfile.ZipFile(folder / "outs.zip", "w", compression=zipfile.ZIP_STORED) as zf:
            zf.writestr("outs/experiment.xenium", json.dumps({"pixel_size": 0.2125, "section": section}))
            zf.writestr("outs/transcripts.bin", rng.randbytes(2 * 1024 * 1024))
        (folder / "he_image.ome.tif").write_bytes(b"II*\x00" + rng.randbytes(4096))
        (folder / "he_imagealignment.csv").write_text("1,0,0\n0,1,0\n0,0,1\n")


def _manifest_rows(root: Path, base_url: str) -> list[dict[str, str]]:
    from cellpath.sources.tenx import MANIFEST_COLUMNS

    rows = []
    for section in SECTIONS:
        row = dict.fromkeys(MANIFEST_COLUMNS, "")
        row.update(section_id=section, dataset=f"Dataset {section}", organ="Liver", status="Normal", cells="10",
                   agr_bacc="0.5", rank=str(SECTIONS.index(section) + 1), panel_s25="1",
                   page_url="https://example.org", prefix=PREFIX)
        for kind, name in (("bundle", "outs.zip"), ("he_image", "he_image.ome.tif"),
                           ("he_alignment", "he_imagealignment.csv")):
            data = (root / section / name).read_bytes()
            row.update({f"{kind}_url": f"{base_url}/{section}/{name}", f"{kind}_sha256": hashlib.sha256(data).hexdigest(),
                        f"{kind}_bytes": str(len(data))})
        rows.append(row)
    return rows


def _fetch_project(pristine: Path, work: Path, rows: list[dict[str, str]]) -> Path:
    """The tiny project on the 10x source, with a reference in place for its sections (validate asks for it;
    annotate.references maps them to it instead of the manifest's Tabula Sapiens rule)."""
    import anndata as ad
    import numpy as np

    shutil.copytree(pristine, work)
    pd.DataFrame(rows).to_csv(work / "data" / "manifests" / "xenium_datasets.csv", index=False)
    (work / "data" / "references").mkdir(parents=True)
    ad.AnnData(np.ones((2, 2), dtype=np.float32), obs=pd.DataFrame({"cell_type": ["a", "b"]}, index=["c1", "c2"])
               ).write_h5ad(work / "data" / "references" / "liver.h5ad")
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["source"] = "10x"
    params["tenx"].update(retries=0, timeout_s=60.0)
    params["annotate"]["references"] = {row["section_id"]: "liver" for row in rows}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return work


@pytest.fixture(scope="module")
def fetch_server(tmp_path_factory) -> Iterator[tuple[Path, FaultyServer]]:
    served = tmp_path_factory.mktemp("served")
    _serve_sections(served)
    with serving(served) as server:
        yield served, server


@pytest.fixture(scope="module")
def fetched(pristine, fetch_server, tmp_path_factory) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The manifest rows and the digest of `data/raw` after an uninterrupted fetch."""
    served, server = fetch_server
    rows = _manifest_rows(served, server.base_url)
    expected = _fetch_project(pristine, tmp_path_factory.mktemp("fetched") / "work", rows)
    with pytest.MonkeyPatch.context() as patch:  # as loopback_only, for this module-scoped run
        for var in ("no_proxy", "NO_PROXY"):
            patch.setenv(var, "*")
        _repro(expected, "fetch")
    return rows, _digest(expected / "data" / "raw")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_interrupted_fetch_keeps_finished_sections_and_resumes_the_download(pristine, fetch_server, fetched, tmp_path,
                                                                             sig):
    """The server holds sec_b's bundle after its first MiB and a bit: the downloader has written one
    full chunk to the partial file and waits in its next read until the signal arrives."""
    from cellpath.sources.download import CHUNK_BYTES

    _, server = fetch_server
    rows, expected = fetched
    work = _fetch_project(pristine, tmp_path / "work", rows)
    part = work / "data" / ".downloads" / "sec_b" / "bundle.part"
    release = threading.Event()
    server.hold["sec_b/outs.zip"] = (CHUNK_BYTES + 64 * 1024, release)

    def held(state: dict) -> bool:
        return part.is_file() and part.stat().st_size >= CHUNK_BYTES

    def finished() -> list[str]:
        return sorted(p.name for p in (work / "data" / "raw").iterdir() if not p.name.startswith("."))

    try:
        done, _ = _interrupt(work, held, finished, sig, command=("dvc", "repro", "fetch"), after=release.set)
    finally:
        release.set()
        server.hold.clear()
    assert done == ["sec_a"]
    resumed_from = part.stat().st_size
    assert resumed_from == CHUNK_BYTES  # what the downloader had written: the held bytes never reach the file
    server.requests.clear()
    rerun = _repro(work, "fetch")
    assert "section sec_a: already fetched, skipping" in rerun
    assert not any(path.startswith("sec_a/") for path, _ in server.requests), server.requests  # reused
    assert server.ranges("sec_b/outs.zip") == [f"bytes={resumed_from}-"]  # resumed, not restarted
    assert _digest(work / "data" / "raw") == expected
    assert "Running stage" not in _repro(work, "fetch")
