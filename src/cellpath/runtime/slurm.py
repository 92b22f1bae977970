"""Dask workers as SLURM jobs (dask-jobqueue): submit them, and say why a job did not start.

``executor.slurm`` holds ``dask_jobqueue.SLURMCluster``'s keyword arguments; ``executor.workers`` is
the number of jobs. The jobs are submitted before the stage goes on, so a job that ``sbatch``
refuses (more memory or cores than a node has, an unknown partition) fails the stage at once with
sbatch's words and the setting to change, and a job that never starts is reported with the reason
``squeue`` gives once ``executor.startup_timeout_s`` has passed (docs/scaling.md). The scheduler and
its workers talk TLS with throwaway certificates, and the dashboard listens on loopback, unless
``executor.slurm`` says otherwise (:func:`cluster_arguments`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from cellpath.config import ExecutorConfig
from cellpath.errors import ExecutorError

PENDING_ADVICE = ("A job pending for Resources or Priority waits its turn (raise executor.startup_timeout_s); another "
                  "reason names the executor.slurm setting to change; a job that ended has its output in "
                  "executor.slurm.log_directory")
MB_PER_UNIT = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}  # SLURM's sizes are binary
#: the workers' copies of the scheduler's throwaway TLS certificate and key, under the home folder, which the
#: nodes of almost every cluster share (elsewhere set executor.slurm.shared_temp_directory)
TLS_FOLDER = Path(".cache") / "cellpath" / "dask-tls"
COMMAND_TIMEOUT_S = 60  # a SLURM client command that hangs longer has lost its controller
# sbatch's refusal → the executor.slurm setting that caused it
REFUSALS = ((r"memory", "memory"), (r"cpu count|cores|tasks", "cores"), (r"partition", "queue"),
            (r"time limit", "walltime"), (r"gres|generic resource|account|qos", "job_extra_directives"))


def start_cluster(cfg: ExecutorConfig):
    """A ``dask_jobqueue.SLURMCluster`` with ``cfg.workers`` jobs submitted; sbatch's refusal raises here."""
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError:
        raise ExecutorError("executor.cluster: slurm needs dask-jobqueue, which is not installed; "
                            "`pip install dask-jobqueue` (it is an optional dependency)") from None
    try:
        cluster = SLURMCluster(**cluster_arguments(cfg))
    except (TypeError, ValueError) as exc:
        first = re.split(r"\.\s", str(exc) or type(exc).__name__)[0]  # its first sentence
        raise ExecutorError(f"executor.slurm: dask_jobqueue.SLURMCluster refused these settings: {first} (the keys "
                            "are its arguments: queue, cores, memory, walltime, ...)") from None
    try:
        check_one_task_per_worker(cluster.job_script(), cfg)
        check_submission(cluster.job_script(), cfg)
    except ExecutorError:
        cluster.close()
        raise
    cluster.scale(jobs=cfg.workers)
    return cluster


def cluster_arguments(cfg: ExecutorConfig) -> dict:
    """``executor.slurm`` with what it leaves out: TLS between the scheduler and its workers (dask-jobqueue's
    ``security=True``: throwaway certificates, the workers' copies in ``~/`` :data:`TLS_FOLDER`, a folder only this
    user can enter, which must be on a filesystem the compute nodes see), the dashboard at
    ``executor.dashboard_address``. A key given in ``executor.slurm`` wins (``security: false`` included)."""
    arguments = {"security": True, **cfg.slurm}
    if arguments["security"] and "shared_temp_directory" not in arguments:
        folder = Path.home() / TLS_FOLDER
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)
        arguments["shared_temp_directory"] = str(folder)
    arguments["scheduler_options"] = {"dashboard_address": cfg.dashboard_address,
                                      **cfg.slurm.get("scheduler_options", {})}
    return arguments


def check_one_task_per_worker(script: str, cfg: ExecutorConfig) -> None:
    """Each Dask worker process must run one task at a time (one thread, as on a LocalCluster): a task
    sets its process's thread counts, which results depend on, and concurrent tasks would reset
    each other's. dask-jobqueue gives each worker ``cores / processes`` threads."""
    threads = re.search(r"--nthreads[= ](\d+)", script)
    if threads and int(threads.group(1)) > 1:
        raise ExecutorError(
            f"executor.slurm: cores ({cfg.slurm.get('cores')}) / processes ({cfg.slurm.get('processes', 'default')}) "
            f"gives each Dask worker {threads.group(1)} threads, so it would run {threads.group(1)} tasks at once in "
            "one process; set cores equal to processes (one task per worker process) and book the job's CPUs with "
            "job_cpu, e.g. cores: 1, processes: 1, job_cpu: 8 (with probe.torch_threads: 8)")


def check_submission(script: str, cfg: ExecutorConfig) -> None:
    """``sbatch --test-only`` on a worker's job script: what sbatch would refuse fails here, at once.
    (A refusal when the cluster itself submits is only logged, and the stage would wait for workers
    that never come.)"""
    try:
        result = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExecutorError(f"executor.cluster: slurm needs sbatch here (run on a SLURM login node): {exc}") from None
    if result.returncode != 0:
        raise ExecutorError(refusal_message(result.stderr + result.stdout, script, cfg))


def job_ids(cluster) -> list[str]:
    """The SLURM job ids of a SLURMCluster's workers."""
    return [str(job.job_id) for job in cluster.workers.values() if getattr(job, "job_id", None)]


def refusal_message(error: str, script: str, cfg: ExecutorConfig) -> str:
    """What sbatch said when it refused a worker job, and the ``executor.slurm`` key to change: the
    request that exceeds every node (sinfo), else the key sbatch's words point to."""
    said = "; ".join(line.strip() for line in error.splitlines() if line.strip()) or "no message"
    hint = beyond_nodes(script, cfg.slurm)
    if hint is None:
        key = next((key for pattern, key in REFUSALS if re.search(pattern, said, re.IGNORECASE)), None)
        hint = (f"change executor.slurm.{key} (now {cfg.slurm.get(key)!r})" if key else
                "check executor.slurm (queue, cores, memory, walltime, job_extra_directives) against `sinfo`")
    return f"sbatch refused the Dask worker job ({said}); {hint}"


def beyond_nodes(script: str, slurm: dict) -> str | None:
    """Which of the job's requests (``--mem``, ``--cpus-per-task``) no node of the partition can
    meet, from sinfo's CPUs and memory (MB) per node; None when both fit or sinfo cannot say."""
    queue = slurm.get("queue")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%c %m", *(["-p", queue] if queue else [])], capture_output=True,
                             text=True, timeout=COMMAND_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    nodes = [tuple(int(n) for n in re.findall(r"\d+", line)[:2]) for line in out.splitlines() if line.strip()]
    memory = re.search(r"--mem=(\d+)([KMGT]?)", script)
    cpus = re.search(r"--cpus-per-task=(\d+)", script)
    if not nodes:
        return None
    where = f"partition {queue}" if queue else "the default partition"
    most_cpus, most_mb = max(n[0] for n in nodes), max(n[1] for n in nodes)
    if memory and int(memory.group(1)) * MB_PER_UNIT[memory.group(2)] > most_mb:
        return (f"executor.slurm.memory ({slurm.get('memory')!r}, sbatch --mem={memory.group(1)}{memory.group(2)}) is "
                f"more than the largest node of {where} has ({most_mb} MB, sinfo): lower executor.slurm.memory")
    if cpus and int(cpus.group(1)) > most_cpus:
        return (f"executor.slurm.cores ({slurm.get('cores')!r}, sbatch --cpus-per-task={cpus.group(1)}) is more than "
                f"the largest node of {where} has ({most_cpus} CPUs, sinfo): lower executor.slurm.cores")
    return None


def job_states(ids: list[str]) -> str:
    """Each job's state and reason from squeue (``12 PENDING (Resources)``), or ``12 ended`` when
    squeue no longer lists it."""
    if not ids:
        return "no job was submitted"
    try:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T (%r)"], capture_output=True,
                             text=True, timeout=COMMAND_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    listed = {line.split()[0]: line.strip() for line in out.splitlines() if line.strip()}
    return "; ".join(listed.get(job, f"{job} ended") for job in ids)
