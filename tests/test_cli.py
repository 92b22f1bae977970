import subprocess
import sys
from pathlib import Path

from cellpath.cli import build_parser, main
from conftest import HANG_GUARD_S, PROJECT_ROOT


def test_validate_accepts_the_project_params(capsys):
    assert main(["validate", "--params", str(PROJECT_ROOT / "params.yaml")]) == 0
    assert "valid (source=synthetic, 12 simulated sections)" in capsys.readouterr().out


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
