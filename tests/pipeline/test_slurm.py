"""The probe and robustness stages on a real one-node SLURM cluster, through dask-jobqueue.

One cluster (tests/helpers/slurm.py: munged, slurmctld and slurmd on this machine, everything in a
temporary folder) serves the module. Each test copies the tiny DVC project after its local run
(``tiny_dvc_run``: the reference), removes the probe and robustness task shards and reruns those
stages with ``executor: {backend: dask, cluster: slurm, workers: 2}``: every Dask worker is a SLURM
job running this virtual environment's Python, talking TLS with its scheduler. Checked: the outputs equal
the local run's; the jobs
the cluster submitted end up in the job completion log (``sacct -c``); a worker job cancelled
mid-task (``scancel``) is survived (Dask reruns the task on the other worker), and with every
worker job cancelled the stage fails once ``executor.startup_timeout_s`` has passed, keeps its
finished task and resumes from it; a job that asks for more memory than the node has fails the
stage at once naming ``executor.slurm.memory``, and a job that can never start fails it after the
startup timeout naming the job's state. Tasks are held mid-way with the executor's test gate
(``CELLPATH_TASK_GATE``), never by timing; time limits here are hang guards or the startup
timeout under test, which only ever waits for a worker that cannot come.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml

from cellpath.runtime.executor import TASK_GATE_VARIABLE, gate_name
from helpers.dvc_project import dvc_env
from helpers.project import HANG_GUARD_S
from helpers.slurm import Slurm, skip_reason, slurm_cluster

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]
if (SKIP := skip_reason()) is not None:
    if os.environ.get("CELLPATH_REQUIRE_SLURM"):  # set by .ci/run where apt-get could install SLURM
        pytest.fail(f"SLURM is required here (CELLPATH_REQUIRE_SLURM): {SKIP}", pytrace=False)
    pytest.skip(SKIP, allow_module_level=True)  # one line in the summary, whichever tests were selected

JOBS = re.compile(r"executor: Dask workers in SLURM job\(s\) ([0-9, ]+)")
TASKS = re.compile(r"executor dask \(2 worker\(s\)\): (\d+) task\(s\), (\d+) already complete")
LOST_TIMEOUT_S = 60  # startup_timeout_s where every worker job gets cancelled: generous for a worker to start


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    with slurm_cluster() as cluster:
        yield cluster


def _results(work: Path) -> dict:
    """Every probe and robustness output, tables as frames (fit times left out), the rest as text."""
    found = {}
    for stage in ("probe", "robustness"):
        for path in sorted((work / "reports" / stage).iterdir()):
            if path.name == "timing.json":  # wall times and the executor
                continue
            if path.suffix == ".parquet":
                frame = pd.read_parquet(path)
                found[f"{stage}/{path.name}"] = frame.drop(columns=[c for c in frame.columns if c.endswith("_seconds")])
            else:
                found[f"{stage}/{path.name}"] = path.read_text()
    return found


def _assert_equal(results: dict, reference: dict, stages: tuple[str, ...] = ("probe", "robustness")) -> None:
    names = [name for name in reference if name.split("/")[0] in stages]
    assert names and set(names) <= set(results), (sorted(reference), sorted(results))
    for name in names:
        if isinstance(reference[name], pd.DataFrame):
            pd.testing.assert_frame_equal(results[name], reference[name], check_exact=True, obj=name)
        else:
            assert results[name] == reference[name], name


@pytest.fixture(scope="module")
def reference(tiny_dvc_run) -> dict:
    """The outputs of the local executor's run."""
    return _results(tiny_dvc_run["completed"])


def _project(tiny_dvc_run, slurm: Slurm, work: Path, executor: dict | None = None) -> Path:
    """The completed tiny project without its probe and robustness shards, on the SLURM executor: two
    jobs of one core each, memory that fits the node twice over, this venv's Python, loopback only."""
    shutil.copytree(tiny_dvc_run["completed"], work, symlinks=True)
    for stage in ("probe", "robustness"):
        shutil.rmtree(work / "data" / ".work" / stage)
    params = yaml.safe_load((work / "params.yaml").read_text())
    settings = {"cores": 1, "processes": 1, "memory": f"{min(2048, slurm.memory_mb // 4)}MB",
                "walltime": "00:30:00", "interface": "lo", "python": sys.executable,
                "local_directory": str(work.parent / "dask-scratch"), "log_directory": str(work.parent / "slurm-logs")}
    executor = dict(executor or {})
    params["executor"] = {"backend": "dask", "cluster": "slurm", "workers": 2,
                          "slurm": settings | executor.pop("slurm", {}), **executor}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return work


@dataclass
class Run:
    returncode: int
    log: str

    def jobs(self) -> list[list[str]]:
        """The job ids each stage's cluster submitted, from the stages' logs."""
        return [[job.strip() for job in ids.split(",")] for ids in JOBS.findall(self.log)]


def _repro(work: Path, slurm: Slurm, stages: tuple[str, ...], env: dict[str, str] | None = None,
           on_poll: Callable[[], None] = lambda: None) -> Run:
    """`dvc repro --force --single-item <stages>` on the SLURM cluster, calling ``on_poll`` while it runs."""
    log = work.parent / f"{work.name}.{len(list(work.parent.glob(f'{work.name}.*.log')))}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(["dvc", "repro", "--force", "--single-item", *stages], cwd=work,
                                   env=(env or dvc_env()) | {"SLURM_CONF": str(slurm.conf)}, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + HANG_GUARD_S
            while process.poll() is None:
                assert time.monotonic() < deadline, f"hang guard: dvc repro still running:\n{log.read_text()}"
                on_poll()
                time.sleep(0.2)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return Run(process.returncode, log.read_text())


def _assert_accounted(slurm: Slurm, jobs: list[str]) -> dict[str, str]:
    """Every job in the completion log once it ended (the cluster cancels its jobs on closing); their states."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not set(jobs) <= set(slurm.accounted()) or set(jobs) & set(slurm.queued()):
        assert time.monotonic() < deadline, f"jobs {jobs} never ended: {slurm.queued()}, {slurm.accounted()}"
        time.sleep(0.5)
    return {job: slurm.accounted()[job] for job in jobs}


def test_probe_and_robustness_on_slurm_give_the_local_results(tiny_dvc_run, reference, slurm, tmp_path):
    work = _project(tiny_dvc_run, slurm, tmp_path / "work")
    run = _repro(work, slurm, ("probe", "robustness"))
    assert run.returncode == 0, run.log
    # each stage's scheduler spoke TLS with its workers, its dashboard on loopback (docs/decisions/0048)
    assert len(re.findall(r"Dask slurm cluster, scheduler tls://\S+, dashboard http://127\.0\.0\.1:", run.log)) == 2, \
        run.log
    jobs = run.jobs()
    assert len(jobs) == 2 and all(len(ids) == 2 for ids in jobs), run.log  # two worker jobs per stage
    states = _assert_accounted(slurm, [job for ids in jobs for job in ids])
    assert set(states.values()) <= {"CANCELLED", "COMPLETED"}, states  # ended when each stage closed its cluster
    assert sorted(TASKS.findall(run.log)) == [("1", "0"), ("2", "0")], run.log  # robustness's task, probe's two
    timing = yaml.safe_load((work / "reports" / "probe" / "timing.json").read_text())["executor"]
    assert timing == {"backend": "dask", "workers": 2, "tasks": 2, "tasks_computed": 2}
    _assert_equal(_results(work), reference)


class SlurmGate:
    """The executor's test gate seen from a test on SLURM: each task that waits there is recorded with
    the SLURM job of its process (``SLURM_JOB_ID`` of the pid it announces), its announcement is taken
    away (so a rerun of the task announces again) and ``decide(key, job)`` says whether to release it."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        self.arrivals: list[tuple[str, str]] = []

    def env(self) -> dict[str, str]:
        return dvc_env() | {TASK_GATE_VARIABLE: str(self.folder)}

    def poll(self, decide: Callable[[str, str], bool]) -> None:
        for waiting in sorted(self.folder.glob("*.waiting")):
            key = waiting.read_text()
            pid = (self.folder / f"{waiting.stem}.pid").read_text()
            waiting.unlink()
            job = _job_of(int(pid))
            if job is not None:  # else its process ended before it was seen (a worker of a cancelled job that
                self.arrivals.append((key, job))  # its nanny restarted): Dask reruns the task elsewhere
        for key, job in self.arrivals:
            if decide(key, job):
                self.release(key)

    def release(self, key: str) -> None:
        (self.folder / f"{gate_name(key)}.go").touch()


def _job_of(pid: int) -> str | None:
    """The SLURM job a process runs in; None when the process has ended."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return next(item.split(b"=", 1)[1].decode() for item in environ if item.startswith(b"SLURM_JOB_ID="))


def _shards(work: Path) -> list[str]:
    return sorted(p.name for p in (work / "data" / ".work" / "probe").glob("probe-*") if p.is_dir())


def test_cancelled_worker_jobs_on_slurm(tiny_dvc_run, reference, slurm, tmp_path):
    """Every worker job cancelled while the probe's second task is mid-way: the stage fails after the
    startup timeout, its first task kept. The rerun reuses it, and when the job running the other
    task is cancelled mid-way, Dask reruns that task on the other worker job: the stage completes
    by itself, with the uninterrupted results."""
    work = _project(tiny_dvc_run, slurm, tmp_path / "work", {"startup_timeout_s": LOST_TIMEOUT_S})
    gate, cancelled = SlurmGate(tmp_path / "gate-1"), []

    def first_released_then_all_cancelled(key: str, job: str) -> bool:
        first = key == gate.arrivals[0][0]
        if not first and not cancelled and _shards(work):  # the first is in place, the second waits
            cancelled.extend(sorted(slurm.queued()))
            slurm.run("scancel", *cancelled)
        return first

    run = _repro(work, slurm, ("probe",), env=gate.env(), on_poll=lambda: gate.poll(first_released_then_all_cancelled))
    gone = "; ".join(f"{job} ended" for job in run.jobs()[0])
    assert run.returncode != 0, run.log
    assert "every Dask worker was gone" in run.log and f"(SLURM jobs: {gone};" in run.log, run.log
    assert len(gate.arrivals) == 2 and len(_shards(work)) == 1, (gate.arrivals, _shards(work))
    assert set(cancelled) == set(run.jobs()[0]), (cancelled, run.log)
    assert set(_assert_accounted(slurm, cancelled).values()) == {"CANCELLED"}

    gate, lost = SlurmGate(tmp_path / "gate-2"), []

    def held_job_cancelled_then_released(key: str, job: str) -> bool:
        if not lost:
            lost.append(job)
            slurm.run("scancel", job)
        # released once the task waits again on the other job (recorded while its process lives) and the
        # cancelled job has ended (so its process cannot finish the task instead)
        return len(gate.arrivals) > 1 and lost[0] not in slurm.queued()

    rerun = _repro(work, slurm, ("probe",), env=gate.env(), on_poll=lambda: gate.poll(held_job_cancelled_then_released))
    assert rerun.returncode == 0, rerun.log
    assert TASKS.findall(rerun.log) == [("2", "1")], rerun.log  # the finished task was reused
    (key, job), (again, other) = gate.arrivals  # the held task, then the same task on the other job
    assert key == again and job == lost[0] and other != job and other in rerun.jobs()[0], gate.arrivals
    assert _assert_accounted(slurm, lost)[job] == "CANCELLED"
    _assert_equal(_results(work), reference, stages=("probe",))


@pytest.mark.parametrize(("settings", "expected"), [
    ({"slurm": {"memory": "10000GB"}, "startup_timeout_s": HANG_GUARD_S},
     [r"sbatch refused the Dask worker job \(.*Requested node configuration is not available",
      r"executor\.slurm\.memory \('10000GB', sbatch --mem=9314G\) is more than the largest node of the default "
      r"partition has \({memory} MB, sinfo\): lower executor\.slurm\.memory"]),
    ({"slurm": {"job_extra_directives": ["--hold"]}, "startup_timeout_s": 30},
     [r"no Dask worker connected within executor\.startup_timeout_s \(30 s\); SLURM jobs: \d+ PENDING \(JobHeldUser\); "
      r"\d+ PENDING \(JobHeldUser\)\. A job pending for Resources or Priority waits its turn"]),
], ids=["memory-beyond-the-node", "job-never-starts"])
def test_a_worker_job_that_cannot_start_fails_the_stage(tiny_dvc_run, slurm, tmp_path, settings, expected):
    """Refused at submission: the stage fails at once (its startup timeout is the hang guard, so only
    the refusal can end it). Accepted but held forever: it fails after the startup timeout."""
    work = _project(tiny_dvc_run, slurm, tmp_path / "work", settings)
    run = _repro(work, slurm, ("probe",))
    assert run.returncode != 0
    for pattern in expected:
        assert re.search(pattern.format(memory=slurm.memory_mb), run.log), run.log
    assert not slurm.queued()  # the held jobs were cancelled when the stage closed its cluster
