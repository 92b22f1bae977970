"""A one-node SLURM cluster on this machine, for the tests that run stages through dask-jobqueue.

It installs nothing (``.ci/run`` installs Debian's slurm-wlm and munge). Where the daemons exist,
:func:`slurm_cluster` writes a ``slurm.conf`` for this machine (its cores and memory as ``slurmd -C``
reads them, the node named as ``hostname -s``, reached on 127.0.0.1), generates a munge key, and
starts munged, slurmctld and slurmd as root, each in its own process group, with every socket, key,
state, spool, log and pid file in one temporary folder: nothing under /etc or /var is read for the
cluster or written. Cores and memory are consumable (``select/cons_tres``, ``CR_Core_Memory``), so a
job that asks for more memory than the node has is refused as on a real cluster. Without slurmdbd,
``sacct -c`` reads finished jobs from the job completion log (``jobcomp/filetxt``).

On leaving, every job is cancelled and every daemon's process group is ended (also when a test
failed), then :func:`leftover_processes` must find none of ours, and the folder is removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "sbatch", "squeue", "scancel", "sacct", "scontrol", "mungekey")
START_GUARD_S = 120  # hang guard: the node must be idle within this (it takes seconds)
STOP_GUARD_S = 60    # hang guard: cancelled jobs and stopped daemons must be gone within this
SEARCH_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin", "/usr/local/bin")


def _which(name: str) -> str | None:
    """``name`` on PATH or in the system folders (daemons live in sbin, often off a user's PATH)."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SEARCH_PATH))


def missing_programs() -> list[str]:
    """The daemons and client commands the cluster needs that this machine lacks."""
    return [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]


def skip_reason() -> str | None:
    """One line saying why the SLURM tests cannot run here, or None when they can."""
    missing = missing_programs()
    if missing:
        return (f"SLURM ({', '.join(missing)}) is not installed; .ci/run installs Debian's slurm-wlm and "
                "munge")
    if os.geteuid() != 0:
        return "the one-node SLURM cluster starts slurmd, which must run as root; run the tests as root"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_line() -> tuple[str, int, int]:
    """``slurmd -C``'s NodeName line for this machine (its real sockets, cores, threads and memory),
    with the number of CPUs and the memory in MB."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True, timeout=60).stdout
    line = next(line for line in out.splitlines() if line.startswith("NodeName="))
    cpus = int(re.search(r"\bCPUs=(\d+)", line).group(1))
    memory = int(re.search(r"\bRealMemory=(\d+)", line).group(1))
    return line, cpus, memory


@dataclass
class Slurm:
    """A running one-node cluster: ``env()`` is what its client commands (and dask-jobqueue) need."""

    root: Path
    conf: Path
    node: str
    cpus: int
    memory_mb: int
    partition: str = "debug"

    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` naming this cluster's configuration."""
        return dict(os.environ) | {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        result = subprocess.run([_which(command[0]), *command[1:]], env=self.env(), capture_output=True,
                                text=True, timeout=STOP_GUARD_S)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}{result.stdout}"
                               f"\n{self.logs()}")
        return result

    def queued(self) -> dict[str, str]:
        """Job id → state of every job the controller still lists (squeue)."""
        out = self.run("squeue", "-h", "-o", "%i %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def accounted(self) -> dict[str, str]:
        """Job id → final state of every job that ended, from the job completion log (``sacct -c``)."""
        out = self.run("sacct", "-c", "-n", "-P", "-o", "jobid,state").stdout
        return dict(line.split("|")[:2] for line in out.splitlines() if line.strip())

    def logs(self) -> str:
        """The daemons' logs, for an error message."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)

    def cancel_all(self) -> None:
        """Cancel every job and wait (hang-guarded) until the controller lists none."""
        self.run("scancel", "--full", "--user", "root", check=False)
        deadline = time.monotonic() + STOP_GUARD_S
        while self.queued():
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs still listed {STOP_GUARD_S} s after scancel: {self.queued()}")
            time.sleep(0.5)


def _write_config(root: Path) -> Slurm:
    """The munge key and ``slurm.conf`` for a one-node cluster on this machine, under ``root``."""
    for sub in ("munge", "state", "spool", "log", "run"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    subprocess.run([_which("mungekey"), "--create", "--keyfile", str(key)], check=True, capture_output=True,
                   timeout=60)
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    line, cpus, memory = node_line()
    line = re.sub(r"^NodeName=\S+", f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node}", line)
    line = re.sub(r"\s*UpTime=\S+", "", line)  # not a configuration key
    (root / "plugstack.conf").write_text("")
    settings = {
        "ClusterName": "cellpathtest",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": _free_port(),
        "SlurmdPort": _free_port(),
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={root / 'munge' / 'munge.socket'}",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "StateSaveLocation": root / "state",
        "SlurmdSpoolDir": root / "spool",
        "SlurmctldPidFile": root / "run" / "slurmctld.pid",
        "SlurmdPidFile": root / "run" / "slurmd.pid",
        "SlurmctldLogFile": root / "log" / "slurmctld.log",
        "SlurmdLogFile": root / "log" / "slurmd.log",
        "PlugStackConfig": root / "plugstack.conf",
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core_Memory",
        "DefMemPerCPU": 500,
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/filetxt",
        "JobCompLoc": root / "log" / "jobcomp.txt",
        "MpiDefault": "none",
        "ReturnToService": 2,
        "KillWait": 5,  # seconds from a cancelled job's SIGTERM to its SIGKILL
        "MailProg": "/bin/true",
        "SlurmctldDebug": "info",
        "SlurmdDebug": "info",
    }
    text = "".join(f"{name}={value}\n" for name, value in settings.items())
    text += f"{line}\nPartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n"
    conf = root / "slurm.conf"
    conf.write_text(text)
    return Slurm(root, conf, node, cpus, memory)


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A daemon in the foreground, in its own process group, its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def _wait_until_idle(cluster: Slurm, daemons: list[subprocess.Popen]) -> None:
    """Until sinfo shows the node idle; a dead daemon or the hang guard raises with the daemons' logs."""
    deadline = time.monotonic() + START_GUARD_S
    state = ""
    while True:
        dead = [" ".join(d.args[:1]) for d in daemons if d.poll() is not None]
        if dead:
            raise RuntimeError(f"SLURM test cluster: {', '.join(dead)} exited at start\n{cluster.logs()}")
        result = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        state = (result.stdout or result.stderr).strip()
        if result.returncode == 0 and state == "idle":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"SLURM test cluster: node {cluster.node} not idle after {START_GUARD_S} s "
                               f"(sinfo: {state!r})\n{cluster.logs()}")
        time.sleep(0.5)


def _stop(process: subprocess.Popen) -> None:
    """End a daemon's whole process group: SIGTERM, then SIGKILL if it outlives half the guard."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + STOP_GUARD_S / 2
        while (process.poll() is None or _group_alive(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is not None and not _group_alive(process.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def leftover_processes(root: Path) -> list[str]:
    """Processes that belong to the cluster under ``root``: a daemon or job step whose command line
    or environment names the folder (the job processes and slurmstepd inherit ``SLURM_CONF``)."""
    marker = str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not readable
            continue
        if marker in cmdline or marker in environ:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{entry.name}: {command}")
    return found


@contextlib.contextmanager
def slurm_cluster() -> Iterator[Slurm]:
    """A running one-node cluster in a new temporary folder; everything stopped and removed on exit."""
    root = Path(tempfile.mkdtemp(prefix="cellpath-slurm-"))
    daemons: list[subprocess.Popen] = []
    cluster = None
    try:
        cluster = _write_config(root)
        env = cluster.env()
        munge = root / "munge"
        daemons.append(_start([_which("munged"), "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
                               f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}", f"--log-file={root / 'log' / 'munged.log'}"],
                              root / "log" / "munged.out.log", env))
        _wait_for_file(munge / "munge.socket", daemons[0], cluster)
        daemons.append(_start([_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)],
                              root / "log" / "slurmctld.out.log", env))
        daemons.append(_start([_which("slurmd"), "-D", "-f", str(cluster.conf), "-N", cluster.node],
                              root / "log" / "slurmd.out.log", env))
        _wait_until_idle(cluster, daemons)
        yield cluster
    finally:
        try:
            if cluster is not None and len(daemons) == len(DAEMONS):
                with contextlib.suppress(Exception):
                    cluster.cancel_all()
            for process in reversed(daemons):
                _stop(process)
            _kill_leftovers(root)
            left = leftover_processes(root)
            if left:
                raise RuntimeError(f"SLURM test cluster: processes left after stopping it: {left}")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _wait_for_file(path: Path, daemon: subprocess.Popen, cluster: Slurm) -> None:
    deadline = time.monotonic() + START_GUARD_S
    while not path.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"SLURM test cluster: munged did not open its socket {path}\n{cluster.logs()}")
        time.sleep(0.1)


def _kill_leftovers(root: Path) -> None:
    """SIGKILL whatever of the cluster outlived its daemons (a job step orphaned by slurmd's end) and
    wait, hang-guarded, until it is gone."""
    deadline = time.monotonic() + STOP_GUARD_S
    while (left := leftover_processes(root)) and time.monotonic() < deadline:
        for line in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        time.sleep(0.2)
