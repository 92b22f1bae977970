"""Dask workers that never come, and SLURM's refusals, as errors that name the setting to change.

These run without SLURM: ``sinfo``, ``sbatch`` and ``squeue`` are stand-in scripts on PATH that print
what Debian's SLURM 22.05 prints (tests/pipeline/test_slurm.py checks the same messages against a
real one-node cluster). A scheduler without workers is a ``LocalCluster`` of none: no worker can
come, so the startup timeout is not raced.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cellpath.config import parse_params
from cellpath.runtime.executor import ExecutorError, Task, run_tasks
from cellpath.runtime.slurm import (check_one_task_per_worker, check_submission, job_states, refusal_message,
                                     start_cluster)
from helpers.executor_tasks import write_value
from helpers.project import TINY_SECTIONS

REFUSED = "sbatch: error: Batch job submission failed: Requested node configuration is not available\n"


def _executor(**executor):
    return parse_params({"synthetic": {"sections": TINY_SECTIONS}, "executor": executor}).executor


@pytest.fixture
def slurm_commands(tmp_path, monkeypatch):
    """Stand-in SLURM commands first on PATH: ``name=(output, exit status)``; the output goes to
    stdout, or to stderr when the status is not 0."""

    def install(**commands: tuple[str, int]) -> None:
        folder = tmp_path / "bin"
        folder.mkdir(exist_ok=True)
        for name, (out, status) in commands.items():
            script = folder / name
            script.write_text(f"#!/bin/sh\nprintf '%s' '{out}' >&{1 if status == 0 else 2}\nexit {status}\n")
            script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    return install


def test_memory_beyond_every_node_names_executor_slurm_memory(slurm_commands):
    slurm_commands(sinfo=("2 24105\n", 0))
    cfg = _executor(backend="dask", cluster="slurm", slurm={"cores": 1, "memory": "10000GB"})
    message = refusal_message(REFUSED, "#SBATCH --cpus-per-task=1\n#SBATCH --mem=9314G\n", cfg)
    assert message == ("sbatch refused the Dask worker job (sbatch: error: Batch job submission failed: Requested node "
                       "configuration is not available); executor.slurm.memory ('10000GB', sbatch --mem=9314G) is more "
                       "than the largest node of the default partition has (24105 MB, sinfo): lower "
                       "executor.slurm.memory")


def test_cores_beyond_every_node_of_the_partition_name_executor_slurm_cores(slurm_commands):
    slurm_commands(sinfo=("2 24105\n16 128000\n", 0))
    cfg = _executor(backend="dask", cluster="slurm", slurm={"queue": "cpu", "cores": 64, "memory": "8GB"})
    message = refusal_message(REFUSED, "#SBATCH --cpus-per-task=64\n#SBATCH --mem=8G\n", cfg)
    assert message.endswith("executor.slurm.cores (64, sbatch --cpus-per-task=64) is more than the largest node of "
                            "partition cpu has (16 CPUs, sinfo): lower executor.slurm.cores")


def test_an_unknown_partition_names_executor_slurm_queue(slurm_commands):
    slurm_commands(sbatch=("sbatch: error: invalid partition specified: gpu\n", 1), sinfo=("", 0))
    cfg = _executor(backend="dask", cluster="slurm", slurm={"queue": "gpu", "cores": 1, "memory": "1GB"})
    with pytest.raises(ExecutorError) as err:
        check_submission("#!/bin/sh\n#SBATCH -p gpu\n", cfg)
    assert str(err.value) == ("sbatch refused the Dask worker job (sbatch: error: invalid partition specified: gpu); "
                              "change executor.slurm.queue (now 'gpu')")


def test_job_states_come_from_squeue_and_ended_jobs_say_so(slurm_commands):
    slurm_commands(squeue=("7 PENDING (JobHeldUser)\n", 0))
    assert job_states(["7", "8"]) == "7 PENDING (JobHeldUser); 8 ended"
    assert job_states([]) == "no job was submitted"


def test_an_unknown_slurmcluster_argument_is_named():
    cfg = _executor(backend="dask", cluster="slurm", slurm={"cores": 1, "memory": "1GB", "memroy": "2GB"})
    with pytest.raises(ExecutorError, match=r"^executor\.slurm: dask_jobqueue\.SLURMCluster refused these settings: "
                                            r"Got unexpected keyword argument 'memroy' \(the keys are its arguments"):
        start_cluster(cfg)


def test_no_worker_within_the_startup_timeout_fails_naming_it(tmp_path: Path):
    from distributed import LocalCluster

    with LocalCluster(n_workers=0, dashboard_address=None) as cluster:
        cfg = _executor(backend="dask", address=cluster.scheduler_address, startup_timeout_s=1)
        with pytest.raises(ExecutorError) as err:
            run_tasks([Task("t", write_value, ("x", 0.0), tmp_path / "t.json")], cfg)
    assert str(err.value) == (f"no Dask worker connected within executor.startup_timeout_s (1 s); start workers for "
                              f"the scheduler at {cluster.scheduler_address}, or check executor.address")
    assert not (tmp_path / "t.json").exists()


def test_a_worker_of_several_threads_is_refused_naming_cores_and_job_cpu():
    """dask-jobqueue gives a worker cores / processes threads: 8 / 1 would run 8 tasks in one process."""
    cfg = _executor(backend="dask", cluster="slurm", slurm={"cores": 8, "processes": 1, "memory": "8GB"})
    script = "python -m distributed.cli.dask_worker tcp://127.0.0.1:1 --nthreads 8 --memory-limit 7.45GiB --nanny\n"
    with pytest.raises(ExecutorError) as err:
        check_one_task_per_worker(script, cfg)
    assert str(err.value).startswith("executor.slurm: cores (8) / processes (1) gives each Dask worker 8 threads")
    assert "cores: 1, processes: 1, job_cpu: 8" in str(err.value)
    check_one_task_per_worker(script.replace("--nthreads 8", "--nthreads 1"), cfg)


def test_every_worker_gone_fails_the_run_once_the_startup_timeout_has_passed(tmp_path, monkeypatch):
    """The only worker is closed while its task waits at the test gate: no worker can come back, so
    the run fails after the startup timeout instead of waiting forever."""
    import threading
    import time

    from distributed import LocalCluster

    from cellpath.runtime.executor import TASK_GATE_VARIABLE
    from helpers.project import HANG_GUARD_S

    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv(TASK_GATE_VARIABLE, str(gate))  # the worker processes inherit it
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        monkeypatch.delenv(TASK_GATE_VARIABLE)
        cfg = _executor(backend="dask", address=cluster.scheduler_address, startup_timeout_s=1)
        failure: list[Exception] = []

        def run() -> None:
            try:
                run_tasks([Task("t", write_value, ("x", 0.0), tmp_path / "t.json")], cfg)
            except Exception as exc:  # handed to the test's thread
                failure.append(exc)

        runner = threading.Thread(target=run)
        runner.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not (gate / "t.waiting").exists():
            assert time.monotonic() < deadline and runner.is_alive(), failure
            time.sleep(0.01)
        cluster.scale(0)
        runner.join(HANG_GUARD_S)
    assert not runner.is_alive() and len(failure) == 1 and isinstance(failure[0], ExecutorError), failure
    assert str(failure[0]) == ("every Dask worker was gone and none came back within executor.startup_timeout_s (1 s), "
                               "1 task(s) unfinished; finished tasks are kept: rerun the stage to resume")
    assert not (tmp_path / "t.json").exists()


def test_the_local_cluster_speaks_tls_on_loopback_and_refuses_plain_connections(tmp_path: Path):
    """The LocalCluster the executor starts: scheduler and dashboard on 127.0.0.1, TLS with throwaway
    certificates, so that another user of the machine cannot submit code through it."""
    from distributed import Client

    from cellpath.runtime.executor import dask_client

    from distributed.comm.utils import get_tcp_server_addresses

    with dask_client(_executor(backend="dask", workers=1), gpus=[]) as client:
        address = client.scheduler.address
        assert address.startswith("tls://127.0.0.1:")
        assert {host for host, _ in get_tcp_server_addresses(client.cluster.scheduler.http_server)} == {"127.0.0.1"}
        assert client.submit(sum, [1, 2]).result() == 3
        plain = "tcp://" + address.removeprefix("tls://")
        with pytest.raises((OSError, TimeoutError)):
            Client(plain, timeout=3)  # no certificate, no TLS: no connection


def test_slurm_workers_get_tls_and_a_loopback_dashboard_unless_executor_slurm_says_otherwise(tmp_path, monkeypatch):
    from cellpath.runtime.slurm import TLS_FOLDER, cluster_arguments

    monkeypatch.setenv("HOME", str(tmp_path))
    arguments = cluster_arguments(_executor(backend="dask", cluster="slurm", slurm={"cores": 1, "memory": "1GB"}))
    folder = tmp_path / TLS_FOLDER
    assert arguments == {"security": True, "cores": 1, "memory": "1GB", "shared_temp_directory": str(folder),
                         "scheduler_options": {"dashboard_address": "127.0.0.1:0"}}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    chosen = cluster_arguments(_executor(backend="dask", cluster="slurm", dashboard_address="0.0.0.0:8787",
                                         slurm={"security": False, "scheduler_options": {"port": 8786}}))
    assert chosen == {"security": False, "scheduler_options": {"dashboard_address": "0.0.0.0:8787", "port": 8786}}


def test_a_slurm_job_script_carries_tls_options_for_its_worker(tmp_path, monkeypatch):
    """dask-jobqueue writes the workers' certificate and key (0600) to the private folder and names them,
    with a tls:// scheduler address, in each worker's command line."""
    from dask_jobqueue import SLURMCluster

    from cellpath.runtime.slurm import cluster_arguments

    monkeypatch.setenv("HOME", str(tmp_path))
    with SLURMCluster(**cluster_arguments(_executor(backend="dask", cluster="slurm", slurm={
            "cores": 1, "memory": "1GB", "log_directory": str(tmp_path / "logs")}))) as cluster:
        script = cluster.job_script()
        assert cluster.scheduler_address.startswith("tls://")
        for option in ("--tls-ca-file", "--tls-cert", "--tls-key"):
            assert option in script
        written = list((tmp_path / ".cache" / "cellpath" / "dask-tls").iterdir())
        assert written and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
