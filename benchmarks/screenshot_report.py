"""The top of the report page (reports/index.html) as a PNG for the README (docs/images/report.png),
taken in headless Chromium at a fixed window size with every network request refused.

Run it after a finished `dvc repro` of the default, so the picture is the current default's report;
it works on any self-contained HTML page (`--page`). It checks what it took: the PNG has the window's
size and is not blank. Needs Debian's chromium (`apt-get install chromium`).
Usage: python benchmarks/screenshot_report.py [--page reports/index.html] [--out docs/images/report.png]
                                              [--width 1250] [--height 1500]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# No network: every host name resolves to nothing, so a page that would fetch a script or font from the
# web shows what an offline reader sees. The report inlines its plots' libraries (docs/decisions/0011).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--force-device-scale-factor=1", "--host-resolver-rules=MAP * ~NOTFOUND"]
WIDTH, HEIGHT = 1250, 1500  # the README's picture: the headline and Tables 4-5
MIN_GREY_SD = 10.0  # a blank or one-colour page has a grey-level SD near 0
TIMEOUT_S = 300


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: Path, out: Path, width: int = WIDTH, height: int = HEIGHT, chromium: str | None = None) -> Path:
    """Render ``page`` in a ``width`` × ``height`` window and write the visible part to ``out`` (PNG)."""
    if not page.is_file():
        raise SystemExit(f"{page}: no such page (run `dvc repro` first for reports/index.html)")
    chromium = chromium or find_chromium()
    if chromium is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        shot = Path(scratch) / "shot.png"
        command = [chromium, *FLAGS, f"--user-data-dir={Path(scratch) / 'profile'}", "--virtual-time-budget=15000",
                   f"--window-size={width},{height}", f"--screenshot={shot}", page.resolve().as_uri()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0 or not shot.is_file():
            raise SystemExit(f"chromium failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        shutil.copyfile(shot, out)
    return out


def check(png: Path, width: int, height: int) -> str:
    """What the PNG holds, or SystemExit when it is not the window's size or is blank."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as image:
        size = image.size
        grey = np.asarray(image.convert("L"), dtype=float)
    if size != (width, height):
        raise SystemExit(f"{png}: {size[0]}×{size[1]} px, expected the window's {width}×{height}")
    if grey.std() < MIN_GREY_SD:
        raise SystemExit(f"{png}: blank (grey-level SD {grey.std():.1f} < {MIN_GREY_SD})")
    return f"{size[0]}×{size[1]} px, grey-level SD {grey.std():.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=ROOT / "reports" / "index.html")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "report.png")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--height", type=int, default=HEIGHT)
    args = parser.parse_args(argv)
    out = screenshot(args.page, args.out, args.width, args.height)
    print(f"wrote {out} ({check(out, args.width, args.height)}) from {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
