"""Whole-slide access through tiatoolbox, with the project's logging left intact.

Importing tiatoolbox installs its own handlers and format on the root logger; every use of it in
this package goes through here, which undoes that so stage logs stay one line per event.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path


def open_slide(path: Path, mpp: float | None = None):
    """A tiatoolbox ``WSIReader`` for ``path`` (OME-TIFF, SVS, …); raises what tiatoolbox raises.

    ``mpp`` (µm/px) overrides the slide's metadata, for slides whose pixel size came from elsewhere.
    """
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
