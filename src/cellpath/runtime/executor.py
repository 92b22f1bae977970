"""Run a stage's independent tasks: in this process, on a local process pool, or on a Dask cluster.

The contract (docs/decisions/0010-executor.md). A :class:`Task` is a module-level function
``fn(out, *args)`` that reads its inputs and writes one output (a file or a folder) to the path
``out`` it is given; the executor renames that path to ``task.output`` when ``fn`` returns
(:func:`cellpath.io.atomic.atomic_output`), so an output exists only when it is complete. A task whose
output is already complete is never redone, so rerunning a stage after a crash or a lost worker
resumes where it stopped. Tasks communicate only through their outputs: :func:`run_tasks` returns
one :class:`Outcome` per task, in task order, and the stage reads the outputs in that order, so what
a stage writes does not depend on the executor or on the order in which tasks finished.

Thread pools change floating-point results (torch, BLAS and OpenMP reductions split differently),
so a task runs with the thread counts of the process that called :func:`run_tasks`, wherever it
runs (:func:`thread_settings`). Backends (``executor`` in params.yaml):

- ``local``, ``workers: 1``: a plain loop in this process (what a stage did before the executor);
- ``local``, ``workers: N``: a ``ProcessPoolExecutor`` of N processes forked from a forkserver
  (a clean single-threaded process that has imported the tasks' modules once, so workers start
  at once and inherit no torch / OpenMP threads); a dead worker stops the stage with an
  :class:`ExecutorError` naming the unfinished tasks (rerunning resumes);
- ``dask``: ``Client.submit`` / ``gather`` on an existing scheduler (``address``), a
  ``LocalCluster`` or a ``dask_jobqueue.SLURMCluster`` (:mod:`cellpath.runtime.slurm`); Dask reruns
  the task of a lost worker. With no worker connected for ``executor.startup_timeout_s`` (none
  started, or every one was lost) the stage fails with an :class:`ExecutorError` saying why.

A task that asks for a GPU (``Task.gpu``) gets one: each local worker process sees one GPU
(``CUDA_VISIBLE_DEVICES``), and on Dask it needs the resource ``GPU: 1`` when the workers
advertise GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from cellpath.config import ExecutorConfig
from cellpath.errors import ExecutorError
from cellpath.io.atomic import atomic_output

log = logging.getLogger(__name__)

DASK_RETRIES = 2  # reruns of a task that raised (a worker that died is rescheduled by Dask itself)
WATCH_S = 2.0  # how often a Dask run checks that some worker is still connected
TASK_GATE_VARIABLE = "CELLPATH_TASK_GATE"  # tests only: a folder where finished tasks wait (see wait_at_gate)
_THREAD_VARIABLES = {"openmp": ("OMP_NUM_THREADS",), "blas": ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def output_exists(path: Path) -> bool:
    """The default completion test: outputs are renamed into place when complete."""
    return path.exists()


@dataclass(frozen=True)
class Task:
    """One unit of work: ``fn(out, *args)`` writes ``output`` (picklable: a module-level ``fn``)."""

    key: str  # stable and unique within a run: names the task in logs, errors and on Dask
    fn: Callable[..., None]
    args: tuple
    output: Path  # absolute, so that workers with another working directory find it
    is_complete: Callable[[Path], bool] = output_exists
    gpu: bool = False  # runs on one GPU where there are GPUs


@dataclass(frozen=True)
class Outcome:
    """What became of a task: ``computed`` False when its output was already complete."""

    key: str
    output: Path
    computed: bool
    seconds: float


def thread_settings() -> dict[str, int]:
    """This process's thread counts: torch's intra-op pool and each threadpoolctl API (blas, openmp)."""
    import torch
    from threadpoolctl import threadpool_info

    settings = {"torch": torch.get_num_threads()}
    for library in threadpool_info():
        api = library["user_api"]
        settings[api] = max(settings.get(api, 1), int(library["num_threads"]))
    return settings


@contextlib.contextmanager
def pinned_threads(settings: dict[str, int]) -> Iterator[None]:
    """Run with ``settings``' thread counts: libraries loaded later read the environment variables."""
    import torch
    from threadpoolctl import threadpool_limits

    saved_env = {name: os.environ.get(name) for names in _THREAD_VARIABLES.values() for name in names}
    saved_torch = torch.get_num_threads()
    for api, names in _THREAD_VARIABLES.items():
        for name in names:
            if api in settings:
                os.environ[name] = str(settings[api])
    try:
        with threadpool_limits({api: n for api, n in settings.items() if api in _THREAD_VARIABLES}):
            torch.set_num_threads(settings["torch"])
            yield
    finally:
        torch.set_num_threads(saved_torch)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def execute(task: Task, threads: dict[str, int] | None = None) -> Outcome:
    """Run one task where this is called, unless its output is complete (checked again here, so a
    task rescheduled after its worker died just after finishing is not redone)."""
    started = time.perf_counter()
    if task.is_complete(task.output):
        return Outcome(task.key, task.output, False, 0.0)
    with pinned_threads(threads) if threads else contextlib.nullcontext():
        with atomic_output(task.output) as out:
            task.fn(out, *task.args)
            wait_at_gate(task.key)
    return Outcome(task.key, task.output, True, time.perf_counter() - started)


def gate_name(key: str) -> str:
    """A task key as a file name in the gate folder."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def wait_at_gate(key: str) -> None:
    """A test hook, inert unless ``CELLPATH_TASK_GATE`` names a folder: a task that has written its
    output (not yet renamed into place) announces ``<name>.waiting`` there (its key; ``<name>.pid``,
    written first, names the waiting process) and waits until ``<name>.go`` exists. A test can so
    interrupt a run at an exact task on any machine, however fast, instead of racing the clock
    (tests/pipeline/test_interruption.py; test_slurm.py cancels the SLURM job of that process)."""
    folder = os.environ.get(TASK_GATE_VARIABLE)
    if not folder:
        return
    name = gate_name(key)
    for suffix, text in ((".pid", str(os.getpid())), (".waiting", key)):
        with atomic_output(Path(folder) / f"{name}{suffix}") as tmp:
            tmp.write_text(text)
    release = Path(folder) / f"{name}.go"
    while not release.exists():
        time.sleep(0.01)


class TaskProgress:
    """Progress over a stage's pending tasks: a tqdm bar on a terminal, and one log line per finished
    task as it finishes, with the elapsed time and an estimate of what is left (the mean wall time
    per finished task so far × the tasks left; with parallel workers this is wall time, not CPU time)."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.total, self.done = total, 0
        self.started = time.perf_counter()
        self.bar = tqdm(total=total, unit="task", disable=None, leave=False, dynamic_ncols=True)

    def finished(self, outcome: Outcome) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.done * (self.total - self.done)
        self.bar.update(1)
        log.info("task %d/%d finished in %.1f s: %s; %.0f s elapsed, about %.0f s left", self.done, self.total,
                 outcome.seconds, outcome.key, elapsed, left)

    def close(self) -> None:
        self.bar.close()


def run_tasks(tasks: list[Task], cfg: ExecutorConfig) -> list[Outcome]:
    """Run every task whose output is not complete yet; one outcome per task, in task order. Each
    finished task is logged as it finishes (:class:`TaskProgress`)."""
    keys = [task.key for task in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"task keys must be unique; repeated: {sorted({k for k in keys if keys.count(k) > 1})}")
    pending = [task for task in tasks if not task.is_complete(task.output)]
    log.info("executor %s (%d worker(s)): %d task(s), %d already complete", cfg.backend, cfg.workers, len(tasks),
             len(tasks) - len(pending))
    progress = TaskProgress(len(pending))
    try:
        if not pending:
            done = []
        elif cfg.backend == "dask":
            done = _run_dask(pending, cfg, thread_settings(), progress)
        elif cfg.workers == 1:
            done = []
            for number, task in enumerate(pending, 1):
                log.info("task %d/%d started: %s", number, len(pending), task.key)
                done.append(execute(task))
                progress.finished(done[-1])
        else:
            done = _run_pool(pending, cfg, thread_settings(), progress)
    finally:
        progress.close()
    by_key = {outcome.key: outcome for outcome in done}
    return [by_key.get(task.key, Outcome(task.key, task.output, False, 0.0)) for task in tasks]


@contextlib.contextmanager
def oversubscription_guard(workers: int, threads: dict[str, int]) -> Iterator[None]:
    """Around starting worker processes: when ``workers`` × torch threads exceed the CPUs, warn and let
    the workers started inside wait passively (``OMP_WAIT_POLICY=PASSIVE``, unless the environment sets
    it). OpenMP threads otherwise spin while waiting for each other: on 2 CPUs, two processes of 2
    threads ran the filter bank 16× slower than two of 1 thread; with passive waiting 1.1×. The wait
    policy changes no arithmetic, so results are unchanged. Local pool workers fork from a forkserver
    that starts once per process, with the environment of that start (a stage run from the CLI starts
    its own inside this guard)."""
    cpus = os.cpu_count() or 1
    oversubscribed = workers * threads["torch"] > cpus
    if oversubscribed:
        log.warning("executor: %d workers × %d threads each on %d CPUs oversubscribe them (workers wait "
                    "passively); for throughput set probe.torch_threads / extract.torch_threads (and "
                    "OMP_NUM_THREADS) to %d — results depend on thread counts, never on the executor",
                    workers, threads["torch"], cpus, max(1, cpus // workers))
    if not oversubscribed or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read by each worker's OpenMP runtime when it loads
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def visible_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else 0..n-1 (none without CUDA)."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in listed.split(",") if i.strip()] if listed else [str(i) for i in range(count)]
    return ids[:count]


def _pin_gpu(gpu_slots) -> None:
    """Pool initializer: this worker sees one GPU (before torch initialises CUDA here)."""
    if gpu_slots is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_slots.get()


def _run_pool(tasks: list[Task], cfg: ExecutorConfig, threads: dict[str, int], progress: TaskProgress) -> list[Outcome]:
    """A forkserver process pool (safe with torch / faiss thread pools); results in task order."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(sorted({task.fn.__module__ for task in tasks}))  # until the server starts
    workers = min(cfg.workers, len(tasks))
    gpus = visible_gpus() if any(task.gpu for task in tasks) else []
    slots = None
    if gpus:
        slots = context.SimpleQueue()
        for i in range(workers):
            slots.put(gpus[i % len(gpus)])
    with oversubscription_guard(workers, threads):
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_pin_gpu, initargs=(slots,))
        futures = [pool.submit(execute, task, threads) for task in tasks]
        try:
            for future in as_completed(futures):
                progress.finished(future.result())
            return [future.result() for future in futures]
        except BrokenProcessPool:
            lost = [task.key for task, future in zip(tasks, futures)
                    if isinstance(future.exception(), BrokenProcessPool)]
            raise ExecutorError(
                f"a local worker process died (killed, out of memory or crashed) while running; unfinished "
                f"task(s): {', '.join(lost)}. Finished tasks are kept: rerun the stage to resume") from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _one_gpu_per_worker(gpus: list[str]):
    """A Dask worker plugin for a LocalCluster: worker ``i`` sees GPU ``gpus[i % len(gpus)]``."""
    from distributed import WorkerPlugin

    class OneGpuPerWorker(WorkerPlugin):
        def setup(self, worker) -> None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker.name) % len(gpus)]

    return OneGpuPerWorker()


@contextlib.contextmanager
def dask_client(cfg: ExecutorConfig, gpus: list[str]) -> Iterator[object]:
    """A ``distributed.Client`` on the configured scheduler or a cluster started (and closed) here."""
    from distributed import Client, LocalCluster

    if cfg.address is not None:
        with Client(cfg.address) as client:
            yield client
        return
    if cfg.cluster == "slurm":
        from cellpath.runtime.slurm import start_cluster

        with start_cluster(cfg) as cluster, Client(cluster) as client:
            log.info("executor: Dask slurm cluster, scheduler %s, dashboard %s", client.scheduler.address,
                     dashboard_address(cluster))
            yield client
        return
    import dask

    # Dask gives its workers MALLOC_TRIM_THRESHOLD_=65536, which also turns off glibc's adaptive mmap
    # threshold: every large temporary is mapped and unmapped again. The filter bank ran 3.7x slower.
    with (_environment_kept(), dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}),
          LocalCluster(n_workers=cfg.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                       dashboard_address=cfg.dashboard_address, security=True,  # TLS with throwaway certificates
                       resources={"GPU": 1} if gpus else None) as cluster, Client(cluster) as client):
        if gpus:
            client.register_plugin(_one_gpu_per_worker(gpus))
        log.info("executor: Dask local cluster, scheduler %s, dashboard %s", client.scheduler.address,
                 dashboard_address(cluster))
        yield client


def dashboard_address(cluster) -> str:
    """Where a cluster's dashboard really listens (``client.dashboard_link`` shows the scheduler's host,
    whatever address the dashboard was bound to)."""
    from distributed.comm.utils import get_tcp_server_addresses

    server = getattr(getattr(cluster, "scheduler", None), "http_server", None)
    if server is None:
        return "not started here"
    host, port = get_tcp_server_addresses(server)[0][:2]
    return f"http://{host}:{port}/status"


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """This process's environment as it was, once the block ends: a Dask nanny sets its
    ``pre-spawn-environ`` (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, …) in the process that starts its
    worker and never unsets it, so every later child of this process — a test's ``dvc repro`` — would
    start on one thread."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)


def _run_dask(tasks: list[Task], cfg: ExecutorConfig, threads: dict[str, int], progress: TaskProgress) -> list[Outcome]:
    """Submit every task (pure=False, keyed by the task key, retried) and gather in task order."""
    from distributed import KilledWorker

    local = cfg.address is None and cfg.cluster == "local"  # workers started here, on this machine
    gpus = visible_gpus() if local and any(task.gpu for task in tasks) else []
    guard = oversubscription_guard(cfg.workers, threads) if local else contextlib.nullcontext()
    with guard, dask_client(cfg, gpus) as client:
        jobs = _wait_for_a_worker(client, cfg)
        advertised = any("GPU" in worker.get("resources", {}) for worker in client.scheduler_info()["workers"].values())
        futures = [client.submit(execute, task, threads, key=task.key, pure=False, retries=DASK_RETRIES,
                                 resources={"GPU": 1} if task.gpu and advertised else None) for task in tasks]
        try:
            _watch(client, futures, cfg, progress, jobs)
            return client.gather(futures)
        except KilledWorker as exc:
            raise ExecutorError(
                f"task {exc.task} was on {exc.allowed_failures + 1} Dask workers that died (killed, out of memory "
                "or crashed); finished tasks are kept: rerun the stage to resume") from None


def _slurm_jobs(client, cfg: ExecutorConfig) -> list[str] | None:
    """The job ids of the SLURMCluster started here (None for any other cluster)."""
    if cfg.address is not None or cfg.cluster != "slurm":
        return None
    from cellpath.runtime.slurm import job_ids

    return job_ids(client.cluster)


def _wait_for_a_worker(client, cfg: ExecutorConfig) -> list[str] | None:
    """Until a first worker connects; past ``executor.startup_timeout_s`` an error says why none did.
    Returns (and logs) the SLURM job ids of the workers, None when they are no SLURM jobs."""
    try:
        client.wait_for_workers(1, timeout=cfg.startup_timeout_s)
    except TimeoutError:
        jobs = _slurm_jobs(client, cfg)
        if jobs is None:
            why = f"start workers for the scheduler at {client.scheduler.address}, or check executor.address"
        else:
            from cellpath.runtime.slurm import PENDING_ADVICE, job_states

            why = f"SLURM jobs: {job_states(jobs)}. {PENDING_ADVICE}"
        raise ExecutorError(f"no Dask worker connected within executor.startup_timeout_s "
                            f"({cfg.startup_timeout_s:g} s); {why}") from None
    jobs = _slurm_jobs(client, cfg)
    if jobs is not None:
        log.info("executor: Dask workers in SLURM job(s) %s", ", ".join(jobs))
    return jobs


def _watch(client, futures: list, cfg: ExecutorConfig, progress: TaskProgress, jobs: list[str] | None) -> None:
    """Until every future is done, logging each as it finishes; when every worker has been gone for
    ``executor.startup_timeout_s`` (SLURM ``jobs`` cancelled or past their walltime: Dask starts no
    new ones), an error says so instead of waiting forever."""
    from distributed import wait

    pending, gone_since = set(futures), None
    while pending:
        try:
            done, pending = wait(pending, timeout=WATCH_S, return_when="FIRST_COMPLETED")
        except TimeoutError:
            done = set()
        for future in done:
            progress.finished(future.result())
        if client.nthreads():
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > cfg.startup_timeout_s:
            raise ExecutorError(_all_gone(cfg, len(pending), jobs))


def _all_gone(cfg: ExecutorConfig, unfinished: int, jobs: list[str] | None) -> str:
    """The error once every worker has been gone for ``executor.startup_timeout_s``."""
    text = (f"every Dask worker was gone and none came back within executor.startup_timeout_s "
            f"({cfg.startup_timeout_s:g} s), {unfinished} task(s) unfinished; finished tasks are kept: rerun the "
            "stage to resume")
    if jobs is None:
        return text
    from cellpath.runtime.slurm import job_states

    return f"{text} (SLURM jobs: {job_states(jobs)}; a longer executor.slurm.walltime keeps them to a stage's end)"
