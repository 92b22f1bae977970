"""The placement walkthrough (docs/placement.md) as a new user follows it on the simulated default.

A private timm ViT-S/16 — docs/encoders.md's row, no hub id, its state dict written to
``models/my-vit-s16/model.safetensors`` — then the commands of the walkthrough's "simulated default"
section, read from the document and run in its order on a copy of the tiny project's completed run:
`encoders check` (the model and its anchor), `validate --preset placement --models --anchors`,
`plan --preset placement --models --anchors`, the `dvc exp run` that adds the model and the anchor
(Kaiko ViT-S/16, whose seeded checkpoint of the registry's architecture the test writes in its
``models/`` folder, as a user copies the downloaded one), and `dvc metrics show`. The model and the
anchor must come out beside the paper's 30, unranked, with the reasons, in the report's table, `dvc
metrics` and MLflow.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from helpers.dvc_project import PROJECT_ROOT, dvc_env, run
from helpers.project import HANG_GUARD_S

pytestmark = pytest.mark.slow

SLUG = "my-vit-s16"
ANCHOR = "kaiko-vit-s-16"
WALKTHROUGH = PROJECT_ROOT / "docs" / "placement.md"
ENCODERS_DOC = PROJECT_ROOT / "docs" / "encoders.md"
VENV_BIN = Path(sys.executable).parent


def _documented_row() -> str:
    """docs/encoders.md's private ViT-S/16 row, as the user copies it into models/encoders.yaml."""
    found = re.search(rf"```yaml\n(  - name: {SLUG}\n.*?)```", ENCODERS_DOC.read_text(), re.S)
    assert found, f"docs/encoders.md shows no registry row for {SLUG}"
    return found.group(1)


def _default_commands() -> list[list[str]]:
    """The bash block of the walkthrough's "simulated default" section, one argv per line (comments dropped)."""
    section = WALKTHROUGH.read_text().split("## 6. Trying it on the simulated default", 1)
    assert len(section) == 2, "docs/placement.md has no 'Trying it on the simulated default' section"
    block = re.search(r"```bash\n(.*?)```", section[1], re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _local(argv: list[str]) -> list[str]:
    """``.venv/bin/<tool>`` → this test's environment's tool (the clone's .venv is this one)."""
    return [str(VENV_BIN / argv[0].removeprefix(".venv/bin/")), *argv[1:]]


def _run(argv: list[str], work: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_local(argv), cwd=work, env=dvc_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)


def _write_private_model(work: Path) -> None:
    """Step 1: the row appended to the registry, a ViT-S/16 state dict (seeded, not pretrained) in
    models/<slug>/; and the anchor's weights (the same architecture, another seed) in models/<anchor>/."""
    import timm
    import torch
    from safetensors.torch import save_file

    with (work / "models" / "encoders.yaml").open("a") as registry:
        registry.write(_documented_row())
    for seed, slug in enumerate([SLUG, ANCHOR]):
        torch.manual_seed(seed)
        model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0)
        (work / "models" / slug).mkdir()
        save_file(model.state_dict(), work / "models" / slug / "model.safetensors")


def _report_run(work: Path) -> tuple[dict[str, float], dict[str, str]]:
    """The newest report stage run in the project's MLflow store: its metrics and params."""
    with sqlite3.connect(work / "mlflow.db") as db:
        (run_id,) = db.execute("SELECT r.run_uuid FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE "
                               "t.key = 'cellpath.stage' AND t.value = 'report' ORDER BY r.start_time DESC "
                               "LIMIT 1").fetchone()
        metrics = dict(db.execute("SELECT key, value FROM latest_metrics WHERE run_uuid = ?", (run_id,)).fetchall())
        params = dict(db.execute("SELECT key, value FROM params WHERE run_uuid = ?", (run_id,)).fetchall())
    return metrics, params


@pytest.fixture(scope="module")
def walked(tiny_dvc_run, tmp_path_factory) -> dict:
    """The walkthrough's commands run in order; each one's result."""
    work = tmp_path_factory.mktemp("placement") / "work"
    shutil.copytree(tiny_dvc_run["completed"], work)
    _write_private_model(work)
    run(["git", "add", "-A"], work)  # the user's registry row and the completed run: what `dvc exp run` starts from
    run(["git", "commit", "-qm", "completed run, a private model"], work)
    commands = _default_commands()
    return {"work": work, "commands": commands, "results": [_run(argv, work) for argv in commands]}


def test_the_walkthrough_runs_the_documented_commands_in_order(walked):
    names = [" ".join(argv[:3]) for argv in walked["commands"]]
    assert [name.removeprefix(".venv/bin/") for name in names] == [
        "cellpath encoders check", "cellpath encoders check", "cellpath validate --preset", "cellpath plan --preset",
        "dvc exp run", "dvc metrics show"]
    check, check_anchor, validate, plan, experiment, metrics = walked["results"]
    for checked in (check, check_anchor):
        assert checked.returncode == 0 and checked.stdout.rstrip().endswith("ok"), checked.stdout + checked.stderr
    assert experiment.returncode == 0, experiment.stdout + experiment.stderr
    assert metrics.returncode == 0, metrics.stdout + metrics.stderr


def test_validate_says_the_panel_is_not_here_and_the_model_can_run(walked):
    validate = walked["results"][2]
    assert validate.returncode == 2, validate.stdout + validate.stderr
    text = validate.stdout + validate.stderr
    assert f"in the placement configuration (the paper's at its headline condition) for {SLUG}, {ANCHOR}" in text
    assert "0 of 25 sections ready: the panel is not ready" in text
    assert "encoders cannot run" not in text  # the private model's and the anchor's weights were found and load


def test_plan_prices_the_placement_as_a_fraction_of_the_papers_share(walked):
    plan = walked["results"][3]
    assert plan.returncode == 0, plan.stdout + plan.stderr
    line = next(row for row in plan.stdout.splitlines() if row.strip().startswith("CPU core-hours:"))
    placement, paper = (float(total.replace(",", "")) for total in re.findall(r"→ ([\d,.]+)", line))
    assert 0 < placement < 0.1 * paper, line  # the headline condition only: a few per cent of the paper's share
    assert f"placement of {SLUG}, {ANCHOR}:" in plan.stdout
    assert f"-S 'extract.encoders=[{SLUG}, {ANCHOR}]'" in plan.stdout and "to run it: dvc exp run -S source=10x" in plan.stdout


def test_the_model_is_shown_beside_the_paper_unranked_with_the_reasons(walked):
    work = walked["work"]
    placed = json.loads((work / "reports" / "placement_metrics.json").read_text())
    assert placed["comparable"] is False
    assert any(reason.startswith("simulated panel") for reason in placed["not_comparable"]), placed
    summary = pd.read_csv(work / "reports" / "probe" / "summary.csv")
    ours = summary[(summary["model"] == SLUG) & (summary["readout"] == "Nuc") & (summary["taxonomy"] == "fine")
                   & (summary["magnification"] == "20x") & (summary["metric"] == "macro_f1")]
    assert len(ours) and set(placed[SLUG]) == {p.upper() for p in ours["protocol"]}
    for row in ours.itertuples():
        entry = placed[SLUG][row.protocol.upper()]
        assert entry == {"mean": round(100.0 * row.mean, 2)}  # no rank: not comparable
    assert set(placed[ANCHOR]) == set(placed[SLUG])  # the anchor ran under the same protocols
    beside = pd.read_csv(work / "reports" / "tables" / "published_this_run.csv", index_col=0)
    assert {SLUG, "Kaiko ViT-S/16"} <= set(beside.index)
    assert not (work / "reports" / "tables" / "published_rank_intervals.csv").exists()
    caption = (work / "reports" / "tables" / "published_this_run.md").read_text()
    assert "Not comparable, so not ranked" in caption and "simulated panel" in caption
    shown = walked["results"][5].stdout
    assert all(f"{SLUG}.{protocol}.mean" in shown for protocol in placed[SLUG]), shown


def test_mlflow_records_the_placement_on_the_report_run(walked):
    metrics, params = _report_run(walked["work"])
    placed = json.loads((walked["work"] / "reports" / "placement_metrics.json").read_text())
    assert params["placement.comparable"] == "False"
    assert params["placement.not_comparable"] == "; ".join(placed["not_comparable"])
    logged = {key: value for key, value in metrics.items() if key.startswith(f"placement/{SLUG}/")}
    assert logged == {f"placement/{SLUG}/{protocol}/mean": pytest.approx(entry["mean"])
                      for protocol, entry in placed[SLUG].items()}
