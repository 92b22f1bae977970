"""Whole-slide access through tiatoolbox, with the project's logging left intact.

Importing tiatoolbox installs its own handlers and format on the root logger; every use of it in
this package goes through here, which undoes that so stage logs stay one line per event.
tiatoolbox also logs *on* the root logger (its ``logger`` is ``logging.getLogger()``): "Read: Scale
> 1" on every read finer than the slide's base, "Objective power inferred from microns-per-pixel"
on every open. Those records are dropped below ERROR by a filter on the root logger itself, which
sees them before any handler does — in a stage's main process and in its worker processes alike,
where no handler is configured and Python's last-resort handler would print them.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path


class TiatoolboxBelowError(logging.Filter):
    """Drops records tiatoolbox's modules log below ERROR; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or f"{os.sep}tiatoolbox{os.sep}" not in record.pathname


def quiet_tiatoolbox() -> None:
    """Install :class:`TiatoolboxBelowError` on the root logger of this process (once)."""
    root = logging.getLogger()
    if not any(isinstance(existing, TiatoolboxBelowError) for existing in root.filters):
        root.addFilter(TiatoolboxBelowError())


def open_slide(path: Path, mpp: float | None = None):
    """A tiatoolbox ``WSIReader`` for ``path`` (OME-TIFF, SVS, …); raises what tiatoolbox raises.

    ``mpp`` (µm/px) overrides the slide's metadata, for slides whose pixel size came from elsewhere.
    """
    quiet_tiatoolbox()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from tiatoolbox.wsicore.wsireader import WSIReader

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return WSIReader.open(Path(path), mpp=(mpp, mpp) if mpp else None, post_proc=None)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.getLogger("tiatoolbox").setLevel(logging.WARNING)
