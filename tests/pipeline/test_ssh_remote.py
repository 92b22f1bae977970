"""A DVC remote over SSH (DVC's ``dvc-ssh``) against Debian's sshd on 127.0.0.1: the tiny project's
outputs pushed, pulled into a fresh clone that then reruns nothing; a push that failed mid-way, and
one killed, completed by their reruns with nothing lost.

The server (``helpers.sshd``) has its own host key, a key generated for the test and a free port.
Where openssh-server is missing the tests skip saying so; ``.ci/run`` installs it and sets
``CELLPATH_REQUIRE_SSH``, which makes them fail instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellpath.io.ssh_remote import KNOWN_HOSTS_ENV
from helpers.dvc_project import cached_files, dvc_env, run
from helpers.project import HANG_GUARD_S
from helpers.sshd import SSHServer, skip_reason, ssh_server

pytestmark = pytest.mark.slow

if (SKIP := skip_reason()) is not None:
    if os.environ.get("CELLPATH_REQUIRE_SSH"):  # set by .ci/run where apt-get could install openssh-server
        pytest.fail(f"OpenSSH is required here (CELLPATH_REQUIRE_SSH): {SKIP}", pytrace=False)
    pytest.skip(SKIP, allow_module_level=True)


@pytest.fixture(scope="module")
def sshd() -> Iterator[SSHServer]:
    with ssh_server() as server:
        yield server


@pytest.fixture
def known(sshd: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A known_hosts file that lists the server's key, named in CELLPATH_SSH_KNOWN_HOSTS for the `dvc` runs."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd.known_hosts_line())
    monkeypatch.setenv(KNOWN_HOSTS_ENV, str(known_hosts))
    return known_hosts


def _small_repo(server: SSHServer, where: Path) -> tuple[Path, Path]:
    """A git + DVC repository with one tracked file and an SSH remote; the repository and the remote's folder."""
    repo, store = where / "repo", where / "store"
    repo.mkdir()
    store.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    (repo / "data.txt").write_text("cells\n" * 100)
    run(["dvc", "add", "-q", "data.txt"], repo)
    run(["dvc", "remote", "add", "--default", "lab", server.url(store)], repo)
    run(["dvc", "remote", "modify", "--local", "lab", "keyfile", str(server.key)], repo)
    return repo, store


def _logins(server: SSHServer) -> int:
    return server.log.read_text().count("Accepted publickey")


def test_an_unknown_host_key_is_refused_with_the_command_that_adds_it(sshd, tmp_path, monkeypatch):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    monkeypatch.setenv(KNOWN_HOSTS_ENV, str(known_hosts))
    repo, store = _small_repo(sshd, tmp_path)
    logins = _logins(sshd)
    output = _fails(["dvc", "push"], repo)
    fingerprint = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(sshd.host_key)], capture_output=True,
                                 text=True, check=True).stdout.split()[1]
    assert f"host key (ssh-ed25519 {fingerprint}) is not in {known_hosts} for [127.0.0.1]:{sshd.port}" in output
    command = f"ssh-keyscan -p {sshd.port} -t ssh-ed25519 127.0.0.1 >> {known_hosts}"
    assert command in output
    assert _logins(sshd) == logins and not list(store.iterdir())  # refused before logging in: nothing sent
    subprocess.run(command, shell=True, check=True, capture_output=True, timeout=HANG_GUARD_S)  # the one command
    assert "1 file pushed" in run(["dvc", "push"], repo)
    assert _logins(sshd) == logins + 1


def test_a_changed_host_key_is_refused(sshd, tmp_path, monkeypatch):
    other = tmp_path / "other_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=60)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{sshd.port} " + " ".join(other.with_suffix(".pub").read_text().split()[:2]))
    monkeypatch.setenv(KNOWN_HOSTS_ENV, str(known_hosts))
    repo, store = _small_repo(sshd, tmp_path)
    assert "an unknown or changed key may be a man in the middle" in _fails(["dvc", "push"], repo)
    assert not list(store.iterdir())


def test_the_agent_is_not_forwarded(sshd, known, tmp_path, monkeypatch):
    """With an ssh-agent running and holding the user's key, a push asks the server for no agent
    forwarding; the control (asyncssh asked to forward, as dvc-ssh does unpatched) shows the server
    logs that request, so its absence is not a blind spot of the log."""
    socket = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(socket)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not socket.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(socket))
        subprocess.run(["ssh-add", "-q", str(sshd.key)], check=True, capture_output=True, timeout=60)
        repo, _ = _small_repo(sshd, tmp_path)
        start = len(sshd.log.read_text())
        assert "1 file pushed" in run(["dvc", "push"], repo)
        pushed = sshd.log.read_text()[start:]
        assert "Accepted publickey" in pushed and "auth-agent-req" not in pushed
        start = len(sshd.log.read_text())
        _sftp_listing(sshd, known, agent_forwarding=True)
        assert "auth-agent-req" in sshd.log.read_text()[start:]  # the control: a forwarding request is logged
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(timeout=30)


def _sftp_listing(server: SSHServer, known_hosts: Path, *, agent_forwarding: bool) -> None:
    import asyncio

    import asyncssh

    async def listing() -> None:
        async with asyncssh.connect("127.0.0.1", port=server.port, username=server.user,
                                    client_keys=[str(server.key)], known_hosts=str(known_hosts),
                                    agent_forwarding=agent_forwarding) as conn:
            async with conn.start_sftp_client() as sftp:
                await sftp.listdir("/")

    asyncio.run(listing())


def test_the_patch_is_in_every_python_of_the_environment():
    """`dvc` runs in a Python of its own: the startup file `make install` writes patches dvc_ssh there too."""
    code = ("import dvc_ssh; from cellpath.io.ssh_remote import MARK; "
            "print(getattr(dvc_ssh.SSHFileSystem._prepare_credentials, MARK, False))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.stdout.strip() == "True", done.stderr


def _checkout_with_remote(tiny_dvc_run, server: SSHServer, where: Path) -> tuple[Path, Path]:
    """A copy of the completed tiny run, committed, whose default remote is an SSH folder (its URL
    committed, the key in ``.dvc/config.local`` as a user keeps it); the copy and the remote's folder."""
    work, store = where / "work", where / "remote"
    shutil.copytree(tiny_dvc_run["completed"], work, symlinks=True)
    store.mkdir()
    run(["dvc", "remote", "add", "--force", "--default", "lab", server.url(store)], work)
    run(["dvc", "remote", "modify", "--local", "lab", "keyfile", str(server.key)], work)
    run(["git", "add", "-A"], work)  # dvc.lock and the .gitignore files of the run, the remote's URL
    run(["git", "commit", "-qm", "the completed run, an SSH remote"], work)
    return work, store


def remote_objects(store: Path) -> dict[str, Path]:
    """Each object file in a remote's folder by its id (two-hex prefix folder + file name); a push's
    temporary files (``.<random>.tmp``) are not objects."""
    objects = store / "files" / "md5"
    return {p.parent.name + p.name: p for p in objects.glob("*/*") if p.is_file() and not p.name.startswith(".")}


def assert_every_object_whole(store: Path, expected: set[str]) -> None:
    """The remote holds exactly the workspace's objects, each the bytes its id is the md5 of (temporary
    files a killed push left are not objects: DVC never reads them)."""
    objects = remote_objects(store)
    assert set(objects) == expected
    for oid, path in objects.items():
        assert hashlib.md5(path.read_bytes()).hexdigest() == oid.removesuffix(".dir"), path


def workspace_ids(project: Path) -> set[str]:
    """The ids of every object the workspace's outputs reference, directory manifests included."""
    from dvc.repo import Repo

    ids = {cached.parent.name + cached.name for cached in cached_files(project).values()}
    with Repo(str(project)) as repo:
        return ids | {out.hash_info.value for out in repo.index.outs if out.use_cache and out.is_dir_checksum}


def _pull_into_fresh_clone(work: Path, server: SSHServer, where: Path) -> None:
    clone = where / "clone"
    run(["git", "clone", "-q", str(work), str(clone)], where)
    run(["dvc", "remote", "modify", "--local", "lab", "keyfile", str(server.key)], clone)
    run(["dvc", "pull"], clone)
    assert "up to date" in run(["dvc", "status"], clone)
    assert "Running stage" not in run(["dvc", "repro"], clone)
    for path, cached in cached_files(clone).items():
        assert os.path.samefile(path, cached), f"{path} was pulled as a copy, not linked to the cache"
        assert path.read_bytes() == (work / path.relative_to(clone)).read_bytes(), path


def _fails(cmd: list[str], cwd: Path) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=dvc_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode != 0, f"{' '.join(cmd)} succeeded:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def _kill_once_objects_arrive(work: Path, store: Path) -> None:
    """Start `dvc push` and kill its process group (SIGKILL: no cleanup) as soon as an object has landed."""
    push = subprocess.Popen(["dvc", "push"], cwd=work, env=dvc_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while not remote_objects(store) and push.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(push.pid, signal.SIGKILL)
    push.wait(timeout=60)


def test_ssh_push_interrupted_completes_on_rerun_and_a_fresh_clone_pulls_it(tiny_dvc_run, sshd, known, tmp_path):
    """`dvc push` over SSH (through sshd, not the local filesystem). A push that fails mid-way (one
    object cannot be written: a folder stands at its path) sends every other file and no directory
    manifest that lists the missing one; the rerun sends the rest. A push killed outright leaves at
    most temporary files (DVC writes each object to a temporary name over SFTP, then renames it), and
    its rerun completes. Every object whole; a fresh clone pulls them and `dvc repro` reruns nothing."""
    work, store = _checkout_with_remote(tiny_dvc_run, sshd, tmp_path)
    expected = workspace_ids(work)
    assert len(expected) > 50
    blocked = min(cached.parent.name + cached.name for cached in cached_files(work).values())
    blocker = store / "files" / "md5" / blocked[:2] / blocked[2:]
    (blocker / "in-the-way").mkdir(parents=True)
    assert "failed to push" in _fails(["dvc", "push"], work).lower()
    arrived = set(remote_objects(store))
    assert blocked not in arrived and len(arrived) > len(expected) // 2, arrived
    assert arrived < expected
    shutil.rmtree(blocker)
    assert f"{len(expected - arrived)} file" in run(["dvc", "push"], work)  # only what was missing
    assert_every_object_whole(store, expected)

    shutil.rmtree(store / "files")
    _kill_once_objects_arrive(work, store)
    for leftover in (store / "files" / "md5").glob("*/.*"):
        assert leftover.name.endswith(".tmp"), leftover  # a half-written object only under a temporary name
    landed = set(remote_objects(store))
    assert f"{len(expected - landed)} file" in run(["dvc", "push"], work)
    assert_every_object_whole(store, expected)
    assert "Accepted publickey" in sshd.log.read_text()  # DVC went through sshd, not the local filesystem
    _pull_into_fresh_clone(work, sshd, tmp_path)
