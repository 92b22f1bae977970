"""An interrupted `dvc repro` (SIGINT, as Ctrl-C sends it, and SIGKILL, to the whole process group):
the rerun completes, gives the results of an uninterrupted run and reuses the work that was finished.

Interruption points are mid-stage: the process group is frozen (SIGSTOP) once a stage has started a
task while an earlier one is finished, what was finished is recorded, then the signal is sent.
Extract and probe are interrupted four times in a row on the tiny project (SIGINT and SIGKILL in
each); fetch (the 10x source) while it downloads a second section from a throttled server on
127.0.0.1. See docs/decisions/0013-interruption-and-persistent-outputs.md.
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
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import yaml
from dvc_project import dvc_env
from http_server import FaultyServer, serving

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]

REUSED = re.compile(r"executor local \(1 worker\(s\)\): (\d+) task\(s\), (\d+) already complete")


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def _results(work: Path) -> dict:
    runs = pd.read_parquet(work / "reports" / "probe_runs.parquet").drop(columns=["fit_seconds"])
    return {"runs": runs, "robustness": (work / "reports" / "robustness" / "summary.csv").read_text(),
            "features": _digest(work / "data" / "features"), "raw": _digest(work / "data" / "raw")}


def _repro(work: Path, *targets: str) -> str:
    """`dvc repro` to completion; its stdout and stderr as one stream (stage logs between their headers)."""
    result = subprocess.run(["dvc", "repro", *targets], cwd=work, env=dvc_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=600)
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


def _interrupt(work: Path, ready: Callable[[str], bool], finished: Callable[[], list[str]], sig: int,
               command: tuple[str, ...] = ("dvc", "repro"), timeout: float = 300) -> tuple[list[str], str]:
    """Run ``command`` in ``work``; once ``ready(log so far)`` holds, freeze its process group, record
    ``finished()`` and send ``sig``. Returns what was finished and the run's log."""
    log_path = work.parent / f"{work.name}.{len(list(work.parent.glob(f'{work.name}.*.log')))}.log"
    with open(log_path, "w") as out:
        process = subprocess.Popen(list(command), cwd=work, env=dvc_env(), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ready(log_path.read_text()):
            assert process.poll() is None, f"{command} ended before the interruption point:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, "the interruption point was never reached"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGSTOP)
        done = finished()
        os.killpg(process.pid, sig)
        if sig != signal.SIGKILL:
            os.killpg(process.pid, signal.SIGCONT)
        process.wait(timeout=120)
        deadline = time.monotonic() + 60
        while _group_alive(process.pid):  # e.g. a stage command still removing its partial outputs
            assert time.monotonic() < deadline, "processes of the interrupted run did not end"
            time.sleep(0.05)
    text = log_path.read_text()
    assert process.returncode != 0, f"{command} was not interrupted:\n{text}"
    if sig == signal.SIGINT:  # the stage command itself received it (dvc ignores SIGINT while a command runs)
        assert "interrupted after" in text and "rerun to resume" in text, text
    return done, text


# --- extract and probe: a tiny simulated panel at two magnifications ------------------------------------


def _mid_task(stage: str, task: str) -> Callable[[str], bool]:
    """Ready once ``stage`` has started task ``task`` (e.g. "2/2") and has not finished."""
    def ready(log: str) -> bool:
        text = _stage_log(log, stage)
        return text is not None and f"task {task} started" in text and "finished in" not in text
    return ready


def _finished_sections(work: Path, magnification: str) -> Callable[[], list[str]]:
    folder = work / "data" / "features" / "filterbank-dense" / magnification
    return lambda: sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _finished_shards(work: Path) -> Callable[[], list[str]]:
    folder = work / "data" / ".work" / "probe"
    return lambda: sorted(p.name for p in folder.glob("*.parquet"))


@pytest.fixture(scope="module")
def pristine(tiny_dvc_run) -> Path:
    """The tiny project before any run (two magnifications give the probe two tasks)."""
    return tiny_dvc_run["pristine"]


@pytest.fixture(scope="module")
def reference(tiny_dvc_run) -> dict:
    """The results of an uninterrupted run."""
    return _results(tiny_dvc_run["completed"])


def _assert_reused(log: str, stage: str, finished: list[str]) -> None:
    """The rerun of ``stage`` found at least the tasks recorded as finished, and not all of them."""
    text = _stage_log(log, stage)
    assert text is not None, f"stage {stage} did not rerun:\n{log}"
    reused = REUSED.search(text)
    assert reused is not None, f"no executor line in the rerun of {stage}:\n{text}"
    total, complete = map(int, reused.groups())
    assert len(finished) <= complete < total, (finished, text)


def test_interrupted_extract_and_probe_resume_identically(pristine, reference, tmp_path):
    """Four interruptions in a row, each in the middle of a stage, each rerun picking up the work left."""
    work = tmp_path / "work"
    shutil.copytree(pristine, work)
    at_10x, at_20x = "extract@filterbank-dense-10x", "extract@filterbank-dense-20x"
    sections_10x, _ = _interrupt(work, _mid_task(at_10x, "2/2"), _finished_sections(work, "10x"), signal.SIGINT)
    assert len(sections_10x) == 1, sections_10x  # frozen while the second section was being extracted
    sections_20x, log = _interrupt(work, _mid_task(at_20x, "2/2"), _finished_sections(work, "20x"), signal.SIGKILL)
    _assert_reused(log, at_10x, sections_10x)
    assert len(sections_20x) == 1, sections_20x
    shards, log = _interrupt(work, _mid_task("probe", "2/2"), _finished_shards(work), signal.SIGINT)
    _assert_reused(log, at_20x, sections_20x)
    assert len(shards) == 1, shards  # frozen while the second shard was being fitted
    still, log = _interrupt(work, _mid_task("probe", "1/1"), _finished_shards(work), signal.SIGKILL)
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
    """Per section a 2 MiB bundle (incompressible, so the download takes time), an image, an alignment."""
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
    shutil.copytree(pristine, work)
    pd.DataFrame(rows).to_csv(work / "data" / "manifests" / "xenium_datasets.csv", index=False)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["source"] = "10x"
    params["tenx"].update(retries=0, timeout_s=10.0)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return work


@pytest.fixture(scope="module")
def fetch_server(tmp_path_factory) -> Iterator[tuple[Path, FaultyServer]]:
    served = tmp_path_factory.mktemp("served")
    _serve_sections(served)
    with serving(served, chunk_bytes=32 * 1024, chunk_delay_s=0.02) as server:  # ~1.3 s per bundle
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
    _, server = fetch_server
    rows, expected = fetched
    work = _fetch_project(pristine, tmp_path / "work", rows)
    part = work / "data" / ".downloads" / "sec_b" / "bundle.part"

    def ready(log: str) -> bool:
        return (work / "data" / "raw" / "sec_a" / "section.json").is_file() and part.is_file() \
            and part.stat().st_size >= 128 * 1024

    def finished() -> list[str]:
        return sorted(p.name for p in (work / "data" / "raw").iterdir() if not p.name.startswith("."))

    done, _ = _interrupt(work, ready, finished, sig, command=("dvc", "repro", "fetch"))
    assert done == ["sec_a"]
    resumed_from = part.stat().st_size
    assert 0 < resumed_from < 2 * 1024 * 1024
    server.requests.clear()
    rerun = _repro(work, "fetch")
    assert "section sec_a: already fetched, skipping" in rerun
    assert not any(path.startswith("sec_a/") for path, _ in server.requests), server.requests  # reused
    assert server.ranges("sec_b/outs.zip") == [f"bytes={resumed_from}-"]  # resumed, not restarted
    assert _digest(work / "data" / "raw") == expected
    assert "Running stage" not in _repro(work, "fetch")
