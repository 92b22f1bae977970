"""MLflow tracking of a pipeline run, organised for comparing models: one run per stage execution,
and beside it one run per comparable condition (tagged ``cellpath.stage_run`` with the stage run's
id, not nested under it: the UI collapses nested runs under their parent).

A condition is what two models are compared on: for the probe stage (model, magnification,
readout, taxonomy, protocol), for robustness (model, magnification, readout, taxonomy, scope,
unit). The condition is the child's params (and so columns of the runs table); its metric names
never contain the model, so the UI's compare and chart views line models up on the same keys
(docs/decisions/0028). Runs are named with the DVC experiment and the git commit
(``<condition> · <experiment>@<commit>[+dirty]``) and tagged with the commit, the experiment
(``DVC_EXP_NAME`` during ``dvc exp run``) and a digest of each dvc.lock stage entry. A child's
start and end times are those of its computation. The stage's log file is attached to the parent.
Logging goes through ``MlflowClient`` batches in one background thread; the time the stage spends
blocked on it is measured (``seconds``) so the stage can report logging overhead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import yaml

from cellpath.config import MlflowConfig
from cellpath.io.layout import DEFAULT_REPORTS_DIR
from cellpath.io.locks import LOCK_SUFFIX, waiting

STORE_LOCK_TIMEOUT_S = 600.0  # a write waits this long for another stage's write to a local store
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_key(*parts: str) -> str:
    """An MLflow-safe metric key from parts (MLflow allows alphanumerics, _ - . space and /)."""
    return "/".join(_KEY_UNSAFE.sub("_", str(p)) for p in parts)


def project_root() -> Path:
    """The DVC project root (``DVC_ROOT`` under ``dvc exp run``), else the working directory."""
    return Path(os.environ.get("DVC_ROOT") or os.getcwd())


def resolve_tracking_uri(uri: str, root: Path) -> str:
    """Make a relative ``sqlite:///file`` or plain-path URI absolute against the project root."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{(root / uri.removeprefix('sqlite:///')).resolve()}"
    if "://" not in uri and not uri.startswith("file:"):
        return (root / uri).resolve().as_uri()
    return uri


def store_lock(tracking_uri: str) -> Path | None:
    """The lock beside a local store that two stages writing at once take in turn (``<file>.db.lock`` for
    SQLite, ``.cellpath.lock`` in a file store's folder); None for a tracking server, which orders them."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    if tracking_uri.startswith("sqlite:///"):
        database = Path(tracking_uri.removeprefix("sqlite:///").split("?", 1)[0])
        return database.with_name(database.name + LOCK_SUFFIX)
    if tracking_uri.startswith("file:"):
        return Path(url2pathname(urlparse(tracking_uri).path)) / f".cellpath{LOCK_SUFFIX}"
    return None


def resolve_artifact_location(location: str, root: Path) -> str:
    return location if "://" in location or location.startswith("file:") else (root / location).resolve().as_uri()


#: What ``dvc repro`` itself rewrites in a git checkout: a run's own outputs do not make its tree dirty.
PIPELINE_WRITTEN = ("dvc.lock", str(DEFAULT_REPORTS_DIR))


def provenance_tags(root: Path) -> dict[str, str]:
    """git commit (+ dirty flag: a tracked file changed outside :data:`PIPELINE_WRITTEN`), DVC experiment
    name and a short digest of every dvc.lock stage entry."""
    tags = {"dvc.experiment": os.environ.get("DVC_EXP_NAME", "workspace")}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                    *(f":(exclude){path}" for path in PIPELINE_WRITTEN)], cwd=root,
                                   capture_output=True, text=True, timeout=30)
            tags["git.dirty"] = str(bool(dirty.stdout.strip())).lower()
    except (OSError, subprocess.SubprocessError):
        pass
    lock = root / "dvc.lock"
    if lock.is_file():
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        for name, entry in stages.items():
            digest = hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()[:12]
            tags[f"dvc.lock.{name}"] = digest
    return tags


#: MLflow 3's UI opens an experiment of this kind on its runs table (model training), not on the
#: GenAI trace views it shows by default.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def run_label(tags: dict[str, str]) -> str:
    """``<DVC experiment>@<short commit>`` (``+dirty`` when the tree had uncommitted changes)."""
    commit = tags.get("mlflow.source.git.commit", "")[:7] or "no-git"
    return f"{tags.get('dvc.experiment', 'workspace')}@{commit}{'+dirty' if tags.get('git.dirty') == 'true' else ''}"


class Tracker:
    """Parent/child MLflow runs for one stage execution; a no-op when tracking is disabled.

    A context manager: ``with Tracker(cfg, stage) as tracker:`` opens the parent run, the block
    logs children and closes it with ``finish(params, metrics, artifacts)``; a block left by an
    exception closes the parent as FAILED (a block left without ``finish``: FINISHED, without
    params). Child runs are written by one background thread while the stage goes on computing;
    ``finish`` waits for them. ``seconds`` is the time the stage spent blocked on MLflow (setup,
    queueing, the final wait); ``busy_seconds`` the logging thread's total work.
    """

    def __init__(self, cfg: MlflowConfig, stage: str, root: Path | None = None, log_file: Path | None = None):
        self.enabled = cfg.enabled
        self.seconds = 0.0
        self.busy_seconds = 0.0
        self.children = 0
        self._pending: list = []
        self._run_ids: dict[str, str] = {}
        self._log_file = log_file
        self._finished = False
        if not self.enabled:
            return
        with self._timed():
            from concurrent.futures import ThreadPoolExecutor

            from mlflow.tracking import MlflowClient

            root = root or project_root()
            self.tracking_uri = resolve_tracking_uri(cfg.tracking_uri, root)
            self._store_lock = store_lock(self.tracking_uri)
            with self._writing():
                self._open(MlflowClient, cfg, root, stage)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow")

    def _open(self, client_class, cfg: MlflowConfig, root: Path, stage: str) -> None:
        """The client (a new SQLite store is created here), the experiment and the stage's parent run."""
        from mlflow.exceptions import MlflowException

        self._client = client_class(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            try:
                self._client.create_experiment(cfg.experiment, artifact_location=resolve_artifact_location(
                    cfg.artifact_location, root), tags=EXPERIMENT_TAGS)
            except MlflowException:  # a stage of another run made it meanwhile (a tracking server: no lock)
                pass
            experiment = self._client.get_experiment_by_name(cfg.experiment)
        self._experiment_id = experiment.experiment_id
        if not set(EXPERIMENT_TAGS) & set(experiment.tags):
            for key, value in EXPERIMENT_TAGS.items():  # stores made before the tag existed
                self._client.set_experiment_tag(self._experiment_id, key, value)
        self._tags = provenance_tags(root) | {"cellpath.stage": stage}
        self.label = run_label(self._tags)
        parent = self._client.create_run(self._experiment_id, run_name=f"{stage} · {self.label}",
                                         tags=self._tags | {"cellpath.kind": "stage"})
        self.parent_run_id = parent.info.run_id

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if not self._finished:
            self.finish({}, {}, failed=exc_type is not None)

    @contextmanager
    def _writing(self):
        """Hold the local store's lock (when it has one) while writing: two stages may log at once."""
        if self._store_lock is None:
            yield
            return
        with waiting(self._store_lock, "writing to the MLflow store", STORE_LOCK_TIMEOUT_S):
            yield

    @contextmanager
    def _timed(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def log_child(self, name: str, params: dict, metrics: dict[str, float],
                  tables: dict[str, pd.DataFrame] | None = None, seconds: float | None = None) -> None:
        """Queue one child run under the parent: the condition ``params``, finite metrics and tables
        as artifacts. ``seconds``: how long the condition's computation took (its run then spans
        that time, ending now); ``name`` identifies the run for :meth:`add_metrics`.

        A table named ``*.json`` is written as MLflow's logged-table JSON (listed as a table in the
        UI); ``*.parquet`` as a Parquet file.
        """
        if not self.enabled:
            return
        with self._timed():
            ended = int(time.time() * 1000)
            started = ended - int(round(1000 * seconds)) if seconds is not None else ended
            copies = {file: frame.copy() for file, frame in (tables or {}).items()}
            self._pending.append(self._worker.submit(self._write_child, name, dict(params), dict(metrics), copies,
                                                     started, ended))

    def add_metrics(self, name: str, metrics: dict[str, float]) -> None:
        """Queue more metrics for the child run ``name`` (logged earlier), e.g. those that need
        every model's results, such as significant wins."""
        if not self.enabled:
            return
        with self._timed():
            self._pending.append(self._worker.submit(self._write_metrics, name, dict(metrics)))

    def _write_metrics(self, name: str, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        started = time.perf_counter()
        now = int(time.time() * 1000)
        metric_list = [Metric(k, float(v), now, 0) for k, v in metrics.items() if pd.notna(v)]
        with self._writing():
            for start in range(0, len(metric_list), 1000):  # MLflow's batch limit
                self._client.log_batch(self._run_ids[name], metrics=metric_list[start:start + 1000])
        self.busy_seconds += time.perf_counter() - started

    def _write_child(self, name: str, params: dict, metrics: dict[str, float], tables: dict[str, pd.DataFrame],
                     started_ms: int, ended_ms: int) -> None:
        import tempfile

        from mlflow.entities import Metric, Param
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        started = time.perf_counter()
        # not MLflow's parentRunId: nested runs are collapsed under their parent in the runs table, and a
        # condition run should sit beside the other models' runs of the same condition
        tags = self._tags | {"cellpath.stage_run": self.parent_run_id, "cellpath.kind": "condition",
                             "cellpath.condition": name}
        json_tables = [file for file in tables if file.endswith(".json")]
        if json_tables:  # what MLflow's log_table records, so the UI lists them as tables
            tags["mlflow.loggedArtifacts"] = json.dumps([{"path": file, "type": "table"} for file in json_tables])
        metric_list = [Metric(k, float(v), ended_ms, 0) for k, v in metrics.items() if pd.notna(v)]
        param_list = [Param(k, str(v)) for k, v in params.items()]
        with self._writing():
            run = self._client.create_run(self._experiment_id, run_name=f"{name} · {self.label}", tags=tags,
                                          start_time=started_ms)
            run_id = run.info.run_id
            self._run_ids[name] = run_id
            for start in range(0, max(len(metric_list), 1), 1000):  # MLflow's batch limit
                self._client.log_batch(run_id, metrics=metric_list[start:start + 1000],
                                       params=param_list if start == 0 else [])
        # The run's artifact repository straight from its URI: MlflowClient.log_artifact would look
        # the run up again for every file.
        repository = get_artifact_repository(run.info.artifact_uri)
        with tempfile.TemporaryDirectory() as folder:
            for file, frame in tables.items():
                path = Path(folder) / file
                if file.endswith(".json"):
                    path.write_text(frame.to_json(orient="split", index=False))
                else:
                    frame.to_parquet(path, index=False)
                repository.log_artifact(str(path))
        with self._writing():
            self._client.set_terminated(run_id, end_time=ended_ms)
        self.children += 1
        self.busy_seconds += time.perf_counter() - started

    def finish(self, params: dict, metrics: dict[str, float], artifacts: list[Path] = (), failed: bool = False) -> None:
        """Wait for the child runs, then close the parent with the stage's params, metrics and files
        (and the stage's log file as it stands, also when the stage failed)."""
        if not self.enabled or self._finished:
            return
        self._finished = True
        from mlflow.entities import Metric, Param

        with self._timed():
            self._worker.shutdown(wait=True)
            errors = [f.exception() for f in self._pending if f.exception() is not None]
            run_id = self.parent_run_id
            now = int(time.time() * 1000)
            with self._writing():
                self._client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()
                                                        if pd.notna(v)][:1000],
                                       params=[Param(k, str(v)[:6000]) for k, v in params.items()])
            for path in [*artifacts, *([self._log_file] if self._log_file and self._log_file.is_file() else [])]:
                with self._writing():
                    self._client.log_artifact(run_id, str(path))
            with self._writing():
                self._client.set_terminated(run_id, status="FAILED" if failed or errors else "FINISHED")
        if errors and not failed:
            raise errors[0]


def load_logged_table(tracking_uri: str, run_id: str, name: str = "probe_runs.json") -> pd.DataFrame:
    """A table a child run logged (``MlflowClient.load_table`` cannot find it on a SQLite store)."""
    import tempfile

    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as folder:
        path = MlflowClient(tracking_uri=tracking_uri).download_artifacts(run_id, name, folder)
        payload = json.loads(Path(path).read_text())
    return pd.DataFrame(payload["data"], columns=payload["columns"])


def flat_metrics(metrics: dict, prefix: str = "") -> dict[str, float]:
    """Nested headline metrics → flat MLflow keys (numbers only)."""
    flat = {}
    for key, value in metrics.items():
        name = metric_key(f"{prefix}{key}")
        if isinstance(value, dict):
            flat |= flat_metrics(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            flat[name] = float(value)
    return flat
