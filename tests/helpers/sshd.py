"""An SSH server on 127.0.0.1, for the tests of a DVC remote over SSH (``dvc-ssh``).

It installs nothing (``.ci/run`` installs Debian's openssh-server). Where ``sshd`` exists,
:func:`ssh_server` generates a host key and a user key, writes an ``sshd_config`` that listens on a
free port of 127.0.0.1 only, accepts that one key (no password, no PAM) for the user running the
tests and serves SFTP in-process (``internal-sftp``), and starts ``sshd -D`` in its own process group
with its key, configuration, pid file and log in one temporary folder. Nothing under /etc/ssh is read
or written. The one system path it may create is ``/run/sshd``, the empty privilege-separation folder
OpenSSH is built to require when it runs as root (Debian's package creates it at boot).

On leaving, the server's process group is ended (also when a test failed) and the folder removed.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

START_GUARD_S = 30  # hang guard: sshd answers within a second where it starts at all
SEARCH_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin", "/usr/local/bin")
PRIVSEP_DIR = Path("/run/sshd")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SEARCH_PATH))


def skip_reason() -> str | None:
    """One line saying why the SSH tests cannot run here, or None when they can."""
    missing = [name for name in ("sshd", "ssh-keygen") if _which(name) is None]
    if missing:
        return f"OpenSSH ({', '.join(missing)}) is not installed; .ci/run installs Debian's openssh-server"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class SSHServer:
    """A running server: log in as ``user`` on 127.0.0.1:``port`` with ``key`` (an ed25519 private key)."""

    port: int
    user: str
    key: Path
    log: Path
    host_key: Path  # the server's public host key (``ssh-ed25519 AAAA…``)

    def url(self, path: Path) -> str:
        """The ``ssh://`` URL of an absolute path on this machine, as a DVC remote's url."""
        return f"ssh://{self.user}@127.0.0.1:{self.port}{path}"

    def known_hosts_line(self) -> str:
        """The server's key as a line of a known_hosts file (``[127.0.0.1]:port ssh-ed25519 AAAA…``)."""
        algorithm, blob = self.host_key.read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {algorithm} {blob}\n"


def _keygen(path: Path) -> None:
    subprocess.run([_which("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True,
                   timeout=60)


def _wait_for_banner(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_GUARD_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"sshd exited with {server.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            if conn.recv(64).startswith(b"SSH-2.0-"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not answer on 127.0.0.1:{port} within {START_GUARD_S} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def ssh_server() -> Iterator[SSHServer]:
    """Start sshd on a free loopback port for the current user; stop it and remove its folder on leaving."""
    root = Path(tempfile.mkdtemp(prefix="cellpath-sshd-"))
    server = None
    try:
        host_key, user_key = root / "host_ed25519", root / "user_ed25519"
        _keygen(host_key)
        _keygen(user_key)
        (root / "authorized_keys").write_text((root / "user_ed25519.pub").read_text())
        (root / "authorized_keys").chmod(0o600)
        port = _free_port()
        log = root / "sshd.log"
        conf = root / "sshd_config"
        conf.write_text("\n".join([
            f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {root / 'sshd.pid'}",
            f"AuthorizedKeysFile {root / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "PermitRootLogin prohibit-password", f"AllowUsers {getpass.getuser()}",
            "StrictModes no",  # the keys live in a temporary folder, not the user's ~/.ssh
            "Subsystem sftp internal-sftp", "AllowAgentForwarding yes",
            "LogLevel DEBUG1", "",  # VERBOSE's logins, and the channel requests (an agent forwarding asked for)
        ]))
        if os.geteuid() == 0:
            PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        server = subprocess.Popen([_which("sshd"), "-D", "-f", str(conf), "-E", str(log)],
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        _wait_for_banner(port, server, log)
        yield SSHServer(port=port, user=getpass.getuser(), key=user_key, log=log,
                        host_key=root / "host_ed25519.pub")
    finally:
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
