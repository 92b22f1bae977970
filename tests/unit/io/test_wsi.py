"""Slide access: tiatoolbox's below-ERROR chatter ("Read: Scale > 1", objective power inferred from
mpp) reaches no log — in a process whose logging nobody configured, as a stage's workers are."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import numpy as np
import tifffile

from cellpath.io.wsi import TiatoolboxBelowError
from helpers.project import HANG_GUARD_S, PROJECT_ROOT


def _slide(path) -> None:
    """A tiled RGB TIFF, 256 px a side (tiatoolbox reads its pixel size from the mpp override)."""
    image = np.random.default_rng(0).integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    tifffile.imwrite(path, image, tile=(64, 64), photometric="rgb")


def test_a_read_finer_than_the_slide_logs_nothing_in_an_unconfigured_process(tmp_path):
    _slide(tmp_path / "slide.tif")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from cellpath.io.wsi import open_slide
        slide = open_slide(Path({str(tmp_path / "slide.tif")!r}), mpp=0.5)
        patch = slide.read_rect((0, 0), (32, 32), resolution=0.25, units="mpp")  # 2x finer: "Scale > 1"
        print("read", patch.shape)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PROJECT_ROOT,
                         timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr
    assert "read (32, 32, 3)" in run.stdout
    for chatter in ("Scale > 1", "Objective power", "objective power"):
        assert chatter not in run.stdout + run.stderr, run.stdout + run.stderr


def test_the_filter_drops_only_tiatoolboxs_records_below_error():
    def record(pathname: str, level: int) -> logging.LogRecord:
        return logging.LogRecord("root", level, pathname, 1, "message", None, None)

    quiet = TiatoolboxBelowError()
    reader = "/venv/lib/python3.11/site-packages/tiatoolbox/wsicore/wsireader/base.py"
    assert not quiet.filter(record(reader, logging.WARNING))
    assert quiet.filter(record(reader, logging.ERROR))
    assert quiet.filter(record("/project/src/cellpath/stages/extract.py", logging.WARNING))
