"""benchmarks/screenshot_report.py: the report page as a PNG of a fixed size, retaken by anyone with
chromium (the README's docs/images/report.png)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from helpers.benchmark_scripts import load_benchmark_script

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>report</title>
<script src="https://cdn.example.org/never-fetched.js"></script></head>
<body style="margin:0;font-family:sans-serif"><h1 style="background:#234;color:#fff;padding:24px">Headline</h1>
<table border="1"><tr><th>model</th><th>IS</th></tr><tr><td>filterbank-dense</td><td>58.3</td></tr></table>
<div style="height:4000px;background:linear-gradient(#fff,#39c)"></div></body></html>"""


@pytest.fixture(scope="module")
def script():
    return load_benchmark_script("screenshot_report")


def test_a_page_becomes_a_png_of_the_window_size(script, tmp_path):
    if script.find_chromium() is None:
        assert not (os.environ.get("CI") or os.environ.get("CELLPATH_REQUIRE_CHROMIUM")), \
            "chromium is required here: .ci/run installs Debian's package where apt-get exists"
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    page = tmp_path / "index.html"
    page.write_text(PAGE, encoding="utf-8")
    out = tmp_path / "images" / "report.png"
    assert script.main(["--page", str(page), "--out", str(out), "--width", "640", "--height", "480"]) == 0
    with Image.open(out) as image:
        assert image.size == (640, 480)
        pixels = np.asarray(image.convert("RGB"))
    assert pixels[40, 320].tolist() != pixels[470, 320].tolist()  # the heading's band and the page below it


def test_a_missing_page_is_named(script, tmp_path):
    with pytest.raises(SystemExit, match="no such page"):
        script.screenshot(tmp_path / "reports" / "index.html", tmp_path / "out.png")


def test_a_blank_or_wrongly_sized_picture_is_refused(script, tmp_path):
    blank = tmp_path / "blank.png"
    Image.new("RGB", (64, 48), "white").save(blank)
    with pytest.raises(SystemExit, match="blank"):
        script.check(blank, 64, 48)
    with pytest.raises(SystemExit, match="expected the window's 80×48"):
        script.check(blank, 80, 48)
    busy = tmp_path / "busy.png"
    Image.fromarray((np.indices((48, 64)).sum(axis=0) % 2 * 255).astype(np.uint8)).save(busy)
    assert script.check(busy, 64, 48).startswith("64×48 px")
