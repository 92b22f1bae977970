"""A mistyped or impossible parameter never costs a result: after a completed `dvc repro`, each bad
change below makes the next `dvc repro` stop at the validate stage, exit non-zero with one message
naming the problem, and leave every earlier output byte-identical, `cache: false` ones included
(docs/decisions/0014-validate-before-any-output-is-removed.md)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from helpers.dvc_project import dvc_env
from helpers.project import HANG_GUARD_S

pytestmark = pytest.mark.slow


def _digest(work: Path) -> dict[str, str]:
    """Every file of the project but git's and DVC's own bookkeeping, and params.yaml (the edit)."""
    skip = (".git", ".dvc")
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(work.rglob("*"))
            if p.is_file() and p.relative_to(work).parts[0] not in skip and p.name != "params.yaml"}


def _empty_cellvit_dir(params: dict, work: Path) -> None:
    (work / "cellvit-out").mkdir(exist_ok=True)
    params["concordance"]["cellvit_dir"] = "cellvit-out"


# (change to params.yaml, text the message must hold)
CHANGES: dict[str, tuple[Callable[[dict, Path], None], str]] = {
    "unknown-key": (lambda p, _: p["probe"].update(max_train_cell=100),
                    "unknown key `probe.max_train_cell`: did you mean `max_train_cells`?"),
    "bad-value": (lambda p, _: p["probe"].update(val_fraction=1.5),
                  "key `probe.val_fraction`: Input should be less than 1 (got 1.5)"),
    "unknown-encoder": (lambda p, _: p["extract"].update(encoders=["filterbank-dense", "filterbank-dens"]),
                        "extract.encoders: 'filterbank-dens': not a slug in models/encoders.yaml; did you mean "
                        "'filterbank-dense'?"),
    "hub-encoder-without-weights": (lambda p, _: p["extract"].update(encoders=["filterbank-dense", "uni"]),
                                    "extract.encoders: 'uni': UNI: no weights found"),
    "10x-without-urls": (lambda p, _: p.update(source="10x", tenx={"sections": ["xenium_prime_human_ovary_cancer_ff"]}),
                         "fill in bundle_url, he_image_url, he_alignment_url from https://"),
    "empty-cellvit-dir": (_empty_cellvit_dir, "no CellViT++ output for this section"),
    "missing-label-column": (lambda p, _: p["annotate"].update(label_column="celltype"),
                             "annotate.label_column: 'celltype' is not a column of the simulated references"),
    "too-few-sections-for-mocv": (lambda p, _: p["probe"].update(mocv_folds=3),
                                  "probe.mocv_folds: 3 folds need at least as many sections; panel S2 has 2"),
}


@pytest.fixture(scope="module")
def completed(tiny_dvc_run, tmp_path_factory) -> Path:
    """A private copy of the completed tiny project (every row restores its params.yaml)."""
    work = tmp_path_factory.mktemp("validate") / "work"
    shutil.copytree(tiny_dvc_run["completed"], work, symlinks=True)
    return work


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_bad_parameter_stops_dvc_before_any_output_is_touched(completed, change):
    edit, expected = CHANGES[change]
    params_path = completed / "params.yaml"
    original = params_path.read_text()
    before = _digest(completed)
    params = yaml.safe_load(original)
    edit(params, completed)
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        result = subprocess.run(["dvc", "repro"], cwd=completed, env=dvc_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=HANG_GUARD_S)
    finally:
        params_path.write_text(original)
        shutil.rmtree(completed / "cellvit-out", ignore_errors=True)
    log = result.stdout
    assert result.returncode != 0, log
    assert "Running stage 'validate'" in log and "Running stage" not in log.split("Running stage 'validate'")[1], log
    assert log.count("cellpath validate: error:") == 1, log
    assert expected in log, log
    assert "Traceback" not in log, log
    assert _digest(completed) == before
