"""Light task functions for tests/unit/runtime/test_executor.py: worker processes import this module, not the test."""

from __future__ import annotations

import json
import time


def write_value(out, value: str, delay: float) -> None:
    """Sleep ``delay`` s, then write ``value``, the thread counts this task ran with and the environment
    variables that the executor sets or unsets for workers."""
    import os

    from cellpath.runtime.executor import thread_settings

    time.sleep(delay)
    env = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "MALLOC_TRIM_THRESHOLD_")}
    out.write_text(json.dumps({"value": value, "threads": thread_settings(), "env": env}))


def die_once(out, marker) -> None:
    """The first execution anywhere kills its own process (SIGKILL); later ones write ``out``."""
    import os
    import signal

    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        out.write_text("done")
        return
    os.kill(os.getpid(), signal.SIGKILL)
