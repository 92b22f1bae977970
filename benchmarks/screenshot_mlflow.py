"""The MLflow UI's runs table comparing the default's two encoders on one condition, as a PNG for the
README (docs/images/mlflow-runs.png), taken in headless Chromium with every network request refused.

Starts ``mlflow ui`` on the project's store (127.0.0.1, a free port), opens the experiment's runs
table filtered to one probe condition (MOCV, Tfine, Nuc, 20x), and checks the page: both encoders'
run names are in the rendered DOM, and the screenshot is not blank. Needs a finished
`dvc repro` (the store) and Debian's chromium.
Usage: python benchmarks/screenshot_mlflow.py [--store mlflow.db] [--out docs/images/mlflow-runs.png]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FILTER = "params.protocol = 'mocv' and params.taxonomy = 'fine' and params.readout = 'Nuc' and params.magnification = '20x'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read(1)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer at {url} within {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=ROOT / "mlflow.db")
    parser.add_argument("--experiment", default="cellpath")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "mlflow-runs.png")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{args.store.resolve()}"
    experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name(args.experiment)
    runs = MlflowClient(tracking_uri=uri).search_runs([experiment.experiment_id], FILTER.replace("'", '"'))
    names = sorted(r.info.run_name for r in runs)
    if len({r.data.params["model"] for r in runs}) < 2:
        raise SystemExit(f"the store has fewer than two models on the condition {FILTER!r}: {names}")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=args.store.resolve().parent)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(base)
        url = f"{base}/#/experiments/{experiment.experiment_id}/runs?" + urllib.parse.urlencode(
            {"searchFilter": FILTER.replace("'", '"'), "compareRunsMode": "CHART"})
        with tempfile.TemporaryDirectory() as profile:
            common = [chromium, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                      "--window-size=1600,1000"]
            dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=300).stdout
            args.out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([*common, f"--screenshot={args.out}", url], capture_output=True, timeout=300, check=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    missing = [name for name in names if name.split(" · ")[0] not in dom]
    from PIL import Image
    import numpy as np

    pixels = np.asarray(Image.open(args.out).convert("L"))
    print(f"wrote {args.out} ({pixels.shape[1]}×{pixels.shape[0]} px, grey SD {pixels.std():.1f}); "
          f"runs on the condition: {names}; missing from the page: {missing or 'none'}")
    if missing or pixels.std() < 10:
        raise SystemExit("the runs table does not show every run of the condition")


if __name__ == "__main__":
    main()
