"""Shared fixtures: a tiny seeded simulated panel, fetched and ingested once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Two pytest workers (docs/decisions/0042) each run torch on every core: OpenMP threads that spin while
# waiting took the other worker's cores (an 11 s probe test ran 159 s beside the other worker). Passive
# waiting changes no arithmetic; the `dvc repro` subprocesses of the tests inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from cellpath.io import native_parquet  # noqa: E402
from helpers.project import tiny_params  # noqa: E402

native_parquet.install()  # as every cellpath command does (docs/decisions/0033)


# Under pytest-xdist (`make test` runs two workers; docs/decisions/0042): every test that uses
# `tiny_features` goes to one worker, so that it is built once. `tiny_dvc_run` (the tiny project's
# `dvc repro`) is built once for the whole run, by the first worker that asks, and read by both; its
# tests are spread over the workers a module at a time, so that a module's servers (SLURM, sshd)
# start once.
ONE_WORKER_FIXTURES = ("tiny_features",)
SHARED_RUN_FIXTURE = "tiny_dvc_run"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        shared = [name for name in ONE_WORKER_FIXTURES if name in names]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
        elif SHARED_RUN_FIXTURE in names:
            item.add_marker(pytest.mark.xdist_group(f"{SHARED_RUN_FIXTURE}:{item.module.__name__}"))
    # One module of the shared run first (its worker builds the run), the others last (by the time a
    # worker reaches them the run is built): the other worker takes the rest meanwhile, not the lock.
    run_users = [item for item in items if SHARED_RUN_FIXTURE in getattr(item, "fixturenames", ())]
    if run_users:
        first = run_users[0].module.__name__
        later = [item for item in run_users if item.module.__name__ != first]
        rest = [item for item in items if item not in set(run_users)]
        items[:] = [item for item in run_users if item.module.__name__ == first] + rest + later


@pytest.fixture
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every request on loopback even when the environment names a proxy."""
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(var, "*")


@pytest.fixture(scope="session")
def tiny_panel(tmp_path_factory) -> dict:
    """A fetched, ingested and annotated tiny panel.

    Keys: params, data_dir, reports_dir, sections (ingest index), labels (annotate summary).
    """
    from cellpath.stages.annotate import run as run_annotate
    from cellpath.stages.fetch import run as run_fetch
    from cellpath.stages.ingest import run as run_ingest

    root = tmp_path_factory.mktemp("tiny")
    data_dir, reports_dir = root / "data", root / "reports"
    params = tiny_params()
    run_fetch(params, data_dir)
    index = run_ingest(params, data_dir)
    summary = run_annotate(params, data_dir, reports_dir)
    return {"params": params, "data_dir": data_dir, "reports_dir": reports_dir, "sections": index,
            "labels": summary}


@pytest.fixture(scope="session")
def tiny_features(tiny_panel, tmp_path_factory) -> dict:
    """The tiny panel with its panels table and filterbank-dense 10× features, in a private folder.

    Keys: root, data_dir, params (the tiny panel's).
    """
    import shutil

    from cellpath.stages.concordance import run as run_concordance
    from cellpath.stages.extract import run as run_extract

    root = tmp_path_factory.mktemp("features")
    data_dir = root / "data"
    for sub in ("raw", "sections", "labels"):
        shutil.copytree(tiny_panel["data_dir"] / sub, data_dir / sub)
    run_concordance(tiny_panel["params"], data_dir, root / "reports")
    run_extract(tiny_panel["params"], data_dir, "filterbank-dense", "10x")
    return {"root": root, "data_dir": data_dir, "params": tiny_panel["params"]}


@pytest.fixture(scope="session")
def tiny_dvc_run(tmp_path_factory, worker_id) -> dict:
    """A tiny DVC project and one completed `dvc repro` of it, shared by the tests that run DVC itself
    (they copy it before changing anything), built once per pytest run: in its temporary folder, the
    one above the xdist workers' own."""
    from helpers.dvc_project import shared_tiny_project

    run_root = tmp_path_factory.getbasetemp()
    return shared_tiny_project((run_root if worker_id == "master" else run_root.parent) / "tiny-dvc")
