"""Debian's headless Chromium for tests that render a page (.ci/run installs it), with every
network request refused so that a page that needs the internet fails visibly."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from helpers.project import HANG_GUARD_S

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: The flags that keep Chromium from phoning home here (the machine's network is closed) and make
#: any host lookup fail, so a remote script or style cannot load.
OFFLINE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9"]


def dump_dom(url: str, profile: Path, wait_ms: int = 5000) -> str:
    """The DOM of ``url`` after its scripts ran (``wait_ms`` of virtual time)."""
    done = subprocess.run([CHROMIUM, *OFFLINE_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={wait_ms}",
                           "--dump-dom", url], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(url: str, profile: Path, out: Path, size: tuple[int, int], wait_ms: int = 5000) -> Path:
    """A PNG of ``url`` at ``size`` (width, height) px."""
    subprocess.run([CHROMIUM, *OFFLINE_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={wait_ms}",
                    f"--window-size={size[0]},{size[1]}", f"--screenshot={out}", url],
                   capture_output=True, timeout=HANG_GUARD_S, check=True)
    return out
