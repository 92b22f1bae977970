"""MLflow helpers: URIs resolved against the project root, provenance tags, metric keys."""

from __future__ import annotations

import subprocess

import yaml

from cellpath.runtime.tracking import metric_key, provenance_tags, resolve_artifact_location, resolve_tracking_uri


def test_relative_uris_resolve_against_the_project_root(tmp_path):
    assert resolve_tracking_uri("sqlite:///mlflow.db", tmp_path) == f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri("sqlite:////abs/m.db", tmp_path) == "sqlite:////abs/m.db"
    assert resolve_tracking_uri("http://127.0.0.1:5000", tmp_path) == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("mlruns", tmp_path) == (tmp_path / "mlruns").as_uri()
    assert resolve_artifact_location("mlartifacts", tmp_path) == (tmp_path / "mlartifacts").as_uri()
    assert resolve_artifact_location("s3://bucket/x", tmp_path) == "s3://bucket/x"


def test_provenance_tags_name_commit_experiment_and_lock_stages(tmp_path, monkeypatch):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=tmp_path, check=True)
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "fetch": {"cmd": "cellpath fetch", "outs": [{"path": "data/raw", "md5": "abc.dir"}]}}}))
    monkeypatch.setenv("DVC_EXP_NAME", "mocv-only")
    tags = provenance_tags(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head
    assert tags["dvc.experiment"] == "mocv-only"
    assert len(tags["dvc.lock.fetch"]) == 12
    monkeypatch.delenv("DVC_EXP_NAME")
    assert provenance_tags(tmp_path)["dvc.experiment"] == "workspace"


def test_metric_keys_keep_only_characters_mlflow_accepts():
    assert metric_key("unit", "breast_cancer_1", "macro_f1") == "unit/breast_cancer_1/macro_f1"
    assert metric_key("N||M", "Immune/Inflammatory") == "N__M/Immune/Inflammatory"


def test_a_new_experiment_opens_on_the_runs_table_in_the_ui(tmp_path):
    from mlflow.tracking import MlflowClient

    from cellpath.config import MlflowConfig
    from cellpath.runtime.tracking import Tracker

    cfg = MlflowConfig(tracking_uri="sqlite:///store.db", artifact_location="artifacts", experiment="kind-test")
    tracker = Tracker(cfg, "probe", tmp_path)
    tracker.finish({}, {})
    experiment = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}").get_experiment_by_name("kind-test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_stage_log_is_attached_to_the_parent_even_when_the_stage_fails(tmp_path):
    from mlflow.tracking import MlflowClient

    from cellpath.config import MlflowConfig
    from cellpath.runtime.tracking import Tracker

    log_file = tmp_path / "logs" / "probe.log"
    log_file.parent.mkdir()
    log_file.write_text("probe: task 1/2 finished\n")
    cfg = MlflowConfig(tracking_uri="sqlite:///store.db", artifact_location="artifacts", experiment="logs")
    try:
        with Tracker(cfg, "probe", tmp_path, log_file):
            raise RuntimeError("the stage broke")
    except RuntimeError:
        pass
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("logs").experiment_id])
    assert run.info.status == "FAILED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["probe.log"]


def test_a_runs_own_outputs_do_not_make_the_tree_dirty_but_an_edited_param_does(tmp_path):
    """``dvc repro`` rewrites dvc.lock and the git-tracked reports while it runs: the report of a run of a
    committed tree must not say "uncommitted changes" because of them."""
    import subprocess

    from cellpath.runtime.tracking import provenance_tags

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    for name in ("params.yaml", "dvc.lock", "reports/metrics.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("a: 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    (tmp_path / "dvc.lock").write_text("a: 2\n")
    (tmp_path / "reports" / "metrics.json").write_text("a: 2\n")
    assert provenance_tags(tmp_path)["git.dirty"] == "false"
    (tmp_path / "params.yaml").write_text("a: 2\n")
    assert provenance_tags(tmp_path)["git.dirty"] == "true"


TWO_STAGES = """
import sys, time
from pathlib import Path
from cellpath.config import MlflowConfig
from cellpath.runtime.tracking import Tracker

uri, stage, gate = sys.argv[1], sys.argv[2], Path(sys.argv[3])
(gate / f"{stage}.ready").touch()
while not (gate / "go").exists():  # both processes start their writes together
    time.sleep(0.01)
cfg = MlflowConfig(tracking_uri=uri, experiment="shared")
with Tracker(cfg, stage, root=gate) as tracker:
    for i in range(20):
        tracker.log_child(f"{stage}-{i}", {"i": i}, {"m": float(i)})
    tracker.finish({"stage": stage}, {"n": 20.0})
"""


def test_two_stages_logging_at_once_to_a_new_sqlite_store_both_land(tmp_path):
    """Two stages of one project (two `dvc repro`s, or a queue of two) create and fill one new SQLite store
    at the same moment: the store's lock orders their writes, and every run of both arrives."""
    import sys
    import time

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = tmp_path / "stage.py"
    script.write_text(TWO_STAGES)
    stages = [subprocess.Popen([sys.executable, str(script), uri, stage, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for stage in ("probe", "robustness")]
    while not all((tmp_path / f"{stage}.ready").exists() for stage in ("probe", "robustness")):
        assert all(s.poll() is None for s in stages), [s.communicate() for s in stages]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    for stage in stages:
        out, err = stage.communicate(timeout=600)
        assert stage.returncode == 0, err
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("shared")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    assert len(runs) == 2 * 21
    assert sorted(r.data.tags["cellpath.stage"] for r in runs if r.data.tags["cellpath.kind"] == "stage") == \
        ["probe", "robustness"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert (tmp_path / "mlflow.db.lock").is_file()


def test_the_store_lock_sits_beside_a_local_store_only(tmp_path):
    from cellpath.runtime.tracking import store_lock

    assert store_lock(f"sqlite:///{tmp_path}/m.db") == tmp_path / "m.db.lock"
    assert store_lock((tmp_path / "mlruns").as_uri()) == tmp_path / "mlruns" / ".cellpath.lock"
    assert store_lock("http://127.0.0.1:5000") is None
    assert store_lock("postgresql://db.lab/mlflow") is None
