"""End to end: `dvc repro` on a very small simulated panel in a temporary git repository.

Checks that the pipeline runs from dvc.yaml through the `cellpath` CLI (through the probe stage
and its MLflow runs), that a second `dvc repro` reruns nothing, that `dvc push` / `dvc pull`
round-trip the data into a fresh clone, and that `dvc exp run -S protocol=mocv` runs only MOCV
and `dvc exp show` lists its metrics.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers.browser import CHROMIUM, dump_dom
from helpers.dvc_project import dvc_env, run
from helpers.project import HANG_GUARD_S

pytestmark = pytest.mark.slow

STAGES = {"validate", "fetch", "ingest", "annotate", "concordance", "extract@filterbank-dense-10x",
          "extract@filterbank-dense-20x", "probe", "expression", "robustness", "gallery", "report"}


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def repo(tiny_dvc_run, tmp_path_factory) -> dict[str, Path]:
    """A copy of the shared completed run, with a DVC remote."""
    root = tmp_path_factory.mktemp("e2e")
    work = root / "work"
    shutil.copytree(tiny_dvc_run["completed"], work)
    run(["dvc", "remote", "add", "-d", "store", str(root / "store")], work)
    run(["git", "add", "-A"], work)  # the completed run is the commit the tests start from (dvc.lock, metrics)
    run(["git", "commit", "-qm", "completed run"], work)
    return {"work": work, "store": root / "store", "root": root, "first": tiny_dvc_run["log"]}


def test_repro_runs_both_stages_and_writes_outputs(repo):
    work = repo["work"]
    for stage in STAGES:
        assert f"Running stage '{stage}'" in repo["first"]
    warnings = [line for line in repo["first"].splitlines() if line.startswith("WARNING:")]
    assert not warnings, warnings  # a first `dvc repro` that a newcomer reads as broken
    assert sorted(p.name for p in (work / "data" / "raw").iterdir()) == ["colon_t", "skin_t"]
    assert sorted(p.name for p in (work / "data" / "references").iterdir()) == ["colon.h5ad", "skin.h5ad"]
    sections = sorted(p.name for p in (work / "data" / "sections").iterdir())
    assert sections == ["colon_t.zarr", "sections.csv", "skin_t.zarr"]
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    assert set(lock["stages"]) == STAGES
    panels = (work / "data" / "panels.csv").read_text().splitlines()
    assert panels[0].startswith("section_id,organ,score") and len(panels) == 3
    for magnification in ("10x", "20x"):
        features = work / "data" / "features" / "filterbank-dense" / magnification
        assert sorted(p.name for p in features.iterdir()) == ["colon_t", "skin_t"]
    assert sorted(p.name for p in (work / "data" / "labels").iterdir()) == [
        "colon_t.parquet", "marker_qc.csv", "skin_t.parquet", "summary.csv"]
    assert (work / "reports" / "annotation" / "metrics.json").is_file()
    runs = pd.read_parquet(work / "reports" / "probe" / "runs.parquet")
    assert set(runs["protocol"]) == {"is", "mocv", "looo"}  # IOCD: no organ has two sections
    assert (runs["status"] == "ok").sum() > 0
    assert (work / "mlflow.db").is_file()  # the default tracking URI, relative to the project root
    gallery = json.loads((work / "reports" / "gallery" / "index.json").read_text())
    assert set(gallery["models"]) == {"filterbank-dense"}  # one page per model (this project has one)
    assert all((work / "reports" / "gallery" / page["page"]).is_file() for page in gallery["models"].values())
    for stage in ("fetch", "probe", "robustness", "report"):  # every stage writes its log
        assert "finished in" in (work / "reports" / "logs" / f"{stage}.log").read_text()
    robustness = pd.read_csv(work / "reports" / "robustness" / "summary.csv")
    assert len(robustness) == 1 and robustness["croma_median"].between(-1, 1).all()
    assert "/probe" in (work / "reports" / ".gitignore").read_text()  # tracked by DVC
    ignored = (work / "data" / ".gitignore").read_text()
    assert "/raw" in ignored and "/sections" in ignored  # data are tracked by DVC, not git
    page = (work / "reports" / "index.html").read_text()
    assert '<table id="headline">' in page and "filterbank-dense" in page
    assert (work / "reports" / "tables" / "headline.csv").is_file()


def test_dvc_metrics_and_plots_show(repo):
    work = repo["work"]
    metrics = run(["dvc", "metrics", "show"], work)
    assert "reports/metrics.json" in metrics and "reports/robustness_metrics.json" in metrics
    assert "reports/expression_metrics.json" in metrics and "filterbank-dense.LOOO r" in metrics
    plots = run(["dvc", "plots", "show", "-o", str(repo["root"] / "plots")], work)
    assert "index.html" in plots
    page = (repo["root"] / "plots" / "index.html").read_text()
    assert "reports/figures/landscape.png" in page and "croma_median" in page
    # offline: no script or style is loaded from anywhere (the vega libraries are inlined)
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?(https?:)?//", page), "a remote resource"
    assert "cdn.jsdelivr" not in page
    if CHROMIUM:  # and with every network request refused, each interactive plot draws
        dom = dump_dom((repo["root"] / "plots" / "index.html").as_uri(), repo["root"] / "profile")
        assert dom.count('class="vega-embed') == page.count("vegaEmbed(") > 0


def test_second_repro_reruns_nothing(repo):
    work = repo["work"]
    before = _digest(work / "data")
    out = run(["dvc", "repro"], work)
    assert "Running stage" not in out
    assert "didn't change" in out or "up to date" in out
    assert _digest(work / "data") == before


def test_push_and_pull_round_trip_into_a_fresh_clone(repo):
    work, store = repo["work"], repo["store"]
    run(["dvc", "push"], work)
    clone = repo["root"] / "clone"
    run(["git", "clone", "-q", str(work), str(clone)], repo["root"])
    assert not (clone / "data" / "raw").exists()
    run(["dvc", "pull"], clone)
    assert _digest(clone / "data" / "raw") == _digest(work / "data" / "raw")
    assert _digest(clone / "data" / "references") == _digest(work / "data" / "references")
    status = run(["dvc", "status"], clone)
    assert "up to date" in status.lower()
    assert any(store.rglob("*"))


def _find_experiment(node, name: str):
    """The `dvc exp show --json` entry of experiment ``name`` (searched recursively)."""
    if isinstance(node, dict):
        if node.get("name") == name and "data" in node:
            return node
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = _find_experiment(child, name)
        if found is not None:
            return found
    return None


def test_one_protocol_as_a_dvc_experiment(repo):
    work = repo["work"]
    out = run(["dvc", "exp", "run", "-S", "protocol=mocv", "-n", "mocv-only"], work)
    assert "Running stage 'probe'" in out and "Running stage 'fetch'" not in out
    assert "Running stage 'robustness'" not in out  # the protocol is not one of its parameters
    assert "Running stage 'report'" in out  # the report follows the probe outputs
    runs = pd.read_parquet(work / "reports" / "probe" / "runs.parquet")
    assert set(runs["protocol"]) == {"mocv"}
    show = subprocess.run(["dvc", "exp", "show", "--json"], cwd=work, env=dvc_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert show.returncode == 0, show.stderr
    shown = json.loads(show.stdout)
    experiment = _find_experiment(shown, "mocv-only")
    assert experiment is not None, shown
    metrics = experiment["data"]["metrics"]["reports/metrics.json"]["data"]
    assert set(metrics["filterbank-dense"]) == {"MOCV"}
    assert 0.0 <= metrics["filterbank-dense"]["MOCV"] <= 100.0  # percentage points, as the report
    assert experiment["data"]["params"]["params.yaml"]["data"]["protocol"] == "mocv"
    expression = experiment["data"]["metrics"]["reports/expression_metrics.json"]["data"]
    # the expression stage reran too, under MOCV alone (dvc exp show leaves the interval's list out)
    assert "MOCV r" in expression["filterbank-dense"]
    assert set(expression["filterbank-dense"]) <= {"MOCV r", "MOCV r_ci95"}
    written = json.loads((work / "reports" / "expression_metrics.json").read_text())
    assert "MOCV r" in written["filterbank-dense"]
    assert {key.split()[0] for key in written["filterbank-dense"]} <= {"MOCV", "CRA"}  # no other protocol
    # the table a person reads: every changed column of the type probes and robustness, none cut, in a
    # 200-column terminal (the expression probes' columns, 5 per model and 4 in all, are dropped here)
    table = subprocess.run(["dvc", "exp", "show", "--only-changed", "--no-pager", "--drop", ".* r$"], cwd=work,
                           env=dvc_env() | {"COLUMNS": "200"}, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "…" not in table.stdout and max(len(line.rstrip()) for line in lines) <= 200, table.stdout
    header = next(line for line in lines if "Experiment" in line)
    assert "protocol" in header and "filterbank-dense.MOCV" not in header  # unchanged: the same MOCV fits
