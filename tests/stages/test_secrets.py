"""Secrets: a Hugging Face token in the environment never reaches logs, MLflow or feature files;
params.yaml cannot hold one; the MLflow UI listens on loopback only.

cellpath itself never reads a token (``test_source_reads_no_token``): gated weights are
downloaded outside the pipeline (``hf download`` with ``HF_TOKEN`` set) and only read from disk.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cellpath.config import load_params, parse_params
from cellpath.errors import ConfigError
from helpers.project import PROJECT_ROOT, tiny_params

FAKE_TOKEN = "hf_CellPathFakeToken0123456789abcdefXYZ"
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@pytest.fixture
def token_in_env(monkeypatch: pytest.MonkeyPatch) -> str:
    for name in TOKEN_VARIABLES:
        monkeypatch.setenv(name, FAKE_TOKEN)
    return FAKE_TOKEN


@pytest.fixture
def no_git(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracker's provenance tags ask git for the commit; answer for it (a fixed commit, clean)."""
    import cellpath.runtime.tracking as tracking

    def fake_run(args, **kwargs):
        stdout = "0123456789abcdef0123456789abcdef01234567\n" if "rev-parse" in args else ""
        return subprocess.CompletedProcess(args, 0, stdout=stdout, stderr="")

    monkeypatch.setattr(tracking.subprocess, "run", fake_run)


def _files_holding(root: Path, secret: str) -> list[Path]:
    """Every file under ``root`` whose bytes contain ``secret`` (SQLite stores, Parquet, JSON alike)."""
    needle = secret.encode()
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_token_never_reaches_probe_logs_or_mlflow(tiny_features, tmp_path, token_in_env, no_git, caplog, capfd):
    from mlflow.tracking import MlflowClient

    from cellpath.stages.probe import run as run_probe_stage
    from helpers.stage_params import probe_params

    caplog.set_level(logging.DEBUG)
    data = probe_params(tiny_features["params"], tmp_path, protocol="mocv").model_dump(mode="json")
    data["probe"] |= {"readouts": ["Nuc"], "taxonomies": ["coarse"]}
    params = parse_params(data)
    data_dir = tmp_path / "data"
    shutil.copytree(tiny_features["data_dir"], data_dir, ignore=shutil.ignore_patterns(".work"))
    run_probe_stage(params, data_dir, tmp_path / "reports", root=tmp_path)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2  # the stage's parent run and one condition
    for run in runs:
        logged = {**run.data.params, **run.data.tags, "run name": run.info.run_name}
        assert not [k for k, v in logged.items() if token_in_env in f"{k}={v}"], logged
        assert not [k for k in run.data.metrics if token_in_env in k]
    # Everything the run wrote: the SQLite store, MLflow artifacts, reports, shards, copies.
    assert _files_holding(tmp_path, token_in_env) == []
    assert token_in_env not in caplog.text
    captured = capfd.readouterr()
    assert token_in_env not in captured.out + captured.err


def test_token_never_reaches_feature_sidecars_or_extract_logs(tiny_panel, tmp_path, token_in_env, caplog, capfd):
    from cellpath.stages.extract import run as run_extract
    from helpers.stage_params import extract_inputs

    caplog.set_level(logging.DEBUG)
    data_dir = extract_inputs(tiny_panel, tmp_path / "data")
    assert run_extract(tiny_panel["params"], data_dir, "random-vit-t16", "10x")["computed"] == ["breast_a"]
    sidecar = data_dir / "features" / "random-vit-t16" / "10x" / "breast_a" / "sidecar.json"
    assert sidecar.is_file() and token_in_env not in sidecar.read_text()
    assert _files_holding(data_dir / "features", token_in_env) == []
    assert token_in_env not in caplog.text
    captured = capfd.readouterr()
    assert token_in_env not in captured.out + captured.err


def _keys(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in (f"{prefix}{key}", *_keys(value, f"{prefix}{key}."))]
    if isinstance(node, list):
        return [k for item in node for k in _keys(item, prefix)]
    return []


def test_params_hold_no_token_and_refuse_one(tmp_path):
    keys = _keys(yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text()))
    assert len(keys) > 50
    assert not [k for k in keys if re.search(r"token|secret|password|credential|api_key", k, re.I)]
    for where in ("extract", "mlflow", None):
        data = tiny_params().model_dump(mode="json")
        (data[where] if where else data)["hf_token"] = FAKE_TOKEN
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(data))
        key = f"{where}.hf_token" if where else "hf_token"
        with pytest.raises(ConfigError, match=rf"unknown key `{re.escape(key)}`") as err:
            load_params(path)
        assert FAKE_TOKEN not in str(err.value)  # the message names the key, not the value


@pytest.mark.parametrize(("key", "url"), [
    (("mlflow", "tracking_uri"), "http://alice:s3cretPass@mlflow.lab:5000"),
    (("mlflow", "tracking_uri"), "postgresql://mlflow:s3cretPass@db.lab/mlflow"),
    (("mlflow", "artifact_location"), "s3://bucket/runs?X-Amz-Signature=s3cretPass"),
    (("tenx", "mirror"), "https://alice:s3cretPass@mirror.lab/xenium"),
    (("executor", "address"), "tls://alice:s3cretPass@scheduler.lab:8786"),
])
def test_a_url_with_a_password_or_token_is_refused_without_echoing_it(key, url):
    data = tiny_params().model_dump(mode="json")
    data[key[0]][key[1]] = url
    if key[0] == "executor":
        data["executor"]["backend"] = "dask"
    with pytest.raises(ConfigError) as err:
        parse_params(data)
    message = str(err.value)
    assert f"key `{'.'.join(key)}`: holds a password or token" in message
    assert "MLFLOW_TRACKING_PASSWORD" in message and "PGPASSWORD" in message
    assert "s3cretPass" not in message


def test_a_manifest_url_with_a_password_is_refused(tmp_path):
    from cellpath.errors import InputError
    from cellpath.sources.tenx import MANIFEST_COLUMNS, read_manifest

    row = dict.fromkeys(MANIFEST_COLUMNS, "")
    row |= {"section_id": "s1", "cells": "1", "panel_s25": "1", "prefix": "S_",
            "bundle_url": "https://alice:s3cretPass@cf.example/S_outs.zip"}
    path = tmp_path / "manifest.csv"
    path.write_text(",".join(MANIFEST_COLUMNS) + "\n" + ",".join(row[c] for c in MANIFEST_COLUMNS) + "\n")
    with pytest.raises(InputError, match="column bundle_url: a URL that holds a password or token") as err:
        read_manifest(path)
    assert "s3cretPass" not in str(err.value)


def test_source_reads_no_token():
    """No module reads a token variable or passes a token to huggingface_hub; weights come from disk."""
    reads = re.compile(r"(environ|getenv)\b[^\n]*TOKEN|\b(token|use_auth_token)\s*=|get_token\(|\blogin\(")
    found = [f"{path.relative_to(PROJECT_ROOT)}:{number}: {line.strip()}"
             for path in sorted((PROJECT_ROOT / "src" / "cellpath").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if reads.search(line)]
    assert found == []


def _make_targets(text: str) -> dict[str, list[str]]:
    """Makefile target → its recipe lines (tab-indented lines after ``target:``)."""
    targets, current = {}, None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            targets[current].append(line.strip())
        elif (match := re.match(r"^([A-Za-z][\w.-]*)\s*:(?!=)", line)):
            current = match.group(1)
            targets[current] = []
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def test_mlflow_ui_binds_to_loopback_only():
    targets = _make_targets((PROJECT_ROOT / "Makefile").read_text())
    recipe = " ".join(targets["ui"])
    assert "mlflow ui" in recipe or "mlflow server" in recipe
    assert re.search(r"--host[ =]127\.0\.0\.1\b", recipe), recipe
    assert "0.0.0.0" not in recipe and "--host 0" not in recipe
    serving = [name for name, lines in targets.items() if re.search(r"mlflow (ui|server)", " ".join(lines))]
    assert serving == ["ui"]  # no other target starts a server
