"""DVC's SSH remote with the server's host key verified and the ssh-agent never forwarded.

``dvc-ssh`` 4.3 connects through ``sshfs``, which passes ``known_hosts=None`` to asyncssh (every host
key accepted: a man in the middle gets the data) and asks for ``agent_forwarding=True`` (the server, or
whoever impersonates it, may use the user's loaded keys); DVC's configuration schema has no key for
either. This patch of ``dvc_ssh.SSHFileSystem`` — applied in every Python of the project's environment
by a startup file (:mod:`cellpath.io.import_hooks`) — connects with:

- ``known_hosts``: the file ``CELLPATH_SSH_KNOWN_HOSTS`` names, else ``~/.ssh/known_hosts``. A server
  whose key is not listed there for its host and port is refused before anything is sent, with its key's
  fingerprint and the one command that adds it (after comparing the fingerprint with the one the
  server's administrator gives);
- ``agent_forwarding=False`` (authenticating with a key the agent holds, DVC's ``allow_agent``, still works).

docs/decisions/0048-untrusted-inputs.md says why a patch, and docs/scaling.md how to add a server's key.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from types import ModuleType

from cellpath.io import import_hooks

DVC_SSH = "dvc_ssh"
KNOWN_HOSTS_ENV = "CELLPATH_SSH_KNOWN_HOSTS"
MARK = "__cellpath_verified_host__"
STARTUP_FILE = "cellpath_ssh_remote.pth"


def install() -> None:
    """Make DVC's SSH remote verify host keys and not forward the agent (now, or once dvc_ssh loads)."""
    import_hooks.patch_now_or_when_loaded(DVC_SSH, patch)


def write_startup_file(site_packages: str | None = None) -> str:
    """Write :data:`STARTUP_FILE` into ``site_packages`` (default: this interpreter's purelib); returns its path."""
    return import_hooks.write_startup_file(STARTUP_FILE, "ssh_remote", site_packages)


def known_hosts_file() -> Path:
    """The known-hosts file host keys are checked against: ``$CELLPATH_SSH_KNOWN_HOSTS``, else ``~/.ssh/known_hosts``."""
    return Path(os.environ.get(KNOWN_HOSTS_ENV) or Path("~/.ssh/known_hosts").expanduser())


def patch(module: ModuleType) -> None:
    """Wrap ``module.SSHFileSystem._prepare_credentials`` (``module`` is ``dvc_ssh``), once."""
    filesystem = module.SSHFileSystem
    original = filesystem._prepare_credentials
    if getattr(original, MARK, False):
        return

    def _prepare_credentials(self, **config):  # type: ignore[no-untyped-def]
        login = original(self, **config)
        return verified_login(login)

    setattr(_prepare_credentials, MARK, True)
    _prepare_credentials.__wrapped__ = original
    filesystem._prepare_credentials = _prepare_credentials


def verified_login(login: dict) -> dict:
    """``login`` (asyncssh connect arguments) with the host key checked and the agent not forwarded."""
    known_hosts = known_hosts_file()
    return {**login, "agent_forwarding": False, "known_hosts": [str(known_hosts)] if known_hosts.is_file() else [],
            "client_factory": _refusing_unknown_keys(login["client_factory"], known_hosts)}


def _refusing_unknown_keys(factory: type, known_hosts: Path) -> type:
    """``factory`` (an asyncssh client class) whose fallback for a key ``known_hosts`` does not list
    refuses it with a message saying how to add it."""

    class VerifyingClient(factory):  # type: ignore[misc, valid-type]
        def validate_host_public_key(self, host: str, addr: str, port: int, key) -> bool:  # type: ignore[no-untyped-def]
            fingerprint = key.get_fingerprint("sha256")
            algorithm = key.get_algorithm()
            listed = "is not in" if known_hosts.is_file() else "cannot be checked: there is no"
            target = f"[{host}]:{port}" if port != 22 else host
            add = (f"ssh-keyscan -p {port} -t {algorithm} {shlex.quote(host)} >> "
                   f"{shlex.quote(str(known_hosts))}")
            raise ValueError(
                f"the SSH server's host key ({algorithm} {fingerprint}) {listed} {known_hosts} for {target}: the "
                f"connection is refused (an unknown or changed key may be a man in the middle). Compare that "
                f"fingerprint with the one the server's administrator gives, then add the key with: {add} "
                f"(or name another file in ${KNOWN_HOSTS_ENV}); refused")

    VerifyingClient.__name__ = f"Verifying{factory.__name__}"
    VerifyingClient.__qualname__ = VerifyingClient.__name__
    return VerifyingClient
