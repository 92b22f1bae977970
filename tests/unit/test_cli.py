import json
import subprocess
import sys
from pathlib import Path

import yaml

from cellpath.cli import build_parser, main
from helpers.project import HANG_GUARD_S, PROJECT_ROOT


def test_validate_accepts_the_project_params(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(PROJECT_ROOT)
    record = tmp_path / "validated.json"
    assert main(["validate", "--params", str(PROJECT_ROOT / "params.yaml"), "--record", str(record)]) == 0
    assert "params.yaml: valid (source=synthetic, encoders: random-vit-t16, filterbank-dense)" in capsys.readouterr().out
    assert json.loads(record.read_text()) == {"params": str(PROJECT_ROOT / "params.yaml"), "valid": True}


def test_validate_lists_every_problem_at_once(capsys, monkeypatch, tmp_path):
    """Three problems of different kinds in one file: a typo, an unknown encoder, too many MOCV folds."""
    monkeypatch.chdir(PROJECT_ROOT)
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    params["probe"]["max_train_cell"] = 100
    params["extract"]["encoders"] = ["filterbank-dense", "random-vit-t61"]
    params["probe"]["mocv_folds"] = 13
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(params, sort_keys=False))
    record = tmp_path / "validated.json"
    assert main(["validate", "--params", str(bad), "--record", str(record)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cellpath validate: error: 3 problem(s)"), err
    assert f"{bad}: unknown key `probe.max_train_cell`: did you mean `max_train_cells`?" in err
    assert "extract.encoders: 'random-vit-t61': not a slug in models/encoders.yaml; did you mean 'random-vit-t16'?" in err
    assert "probe.mocv_folds: 13 folds need at least as many sections; panel S12 has 12" in err
    assert not record.exists()


def test_bad_params_exit_2_with_one_message(tmp_path, capsys):
    bad = tmp_path / "params.yaml"
    bad.write_text("source: synthetic\nsynthetic:\n  sections: []\n  colour: red\n")
    assert main(["validate", "--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key `synthetic.colour`" in err
    assert "synthetic.sections" in err and "at least 1 item" in err
    assert "Traceback" not in err


def test_ingest_without_fetch_names_the_folder(tmp_path, capsys):
    assert main(["ingest", "--params", str(PROJECT_ROOT / "params.yaml"), "--data-dir", str(tmp_path)]) == 2
    assert f"{tmp_path / 'raw'}: no raw data; run `cellpath fetch`" in capsys.readouterr().err


def test_every_stage_has_help():
    parser = build_parser()
    stages = parser._subparsers._group_actions[0].choices
    assert {"fetch", "ingest", "validate"} <= set(stages)


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "cellpath"
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0 and "fetch" in result.stdout
