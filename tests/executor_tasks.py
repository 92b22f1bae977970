"""Light task functions for tests/test_executor.py: worker processes import this module, not the test."""

from __future__ import annotations

import json
import time


def write_value(out, value: str, delay: float) -> None:
    """Sleep ``delay`` s, then write ``value`` and the thread counts this task ran with."""
    from cellpath.executor import thread_settings

    time.sleep(delay)
    out.write_text(json.dumps({"value": value, "threads": thread_settings()}))


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
