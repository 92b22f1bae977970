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
