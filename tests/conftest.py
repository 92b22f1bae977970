"""Shared fixtures: a tiny seeded simulated panel, fetched and ingested once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402

from cellpath.io import native_parquet  # noqa: E402
from helpers.project import tiny_params  # noqa: E402

native_parquet.install()  # as every cellpath command does (docs/decisions/0033)


# Fixtures that run the pipeline once per session: under pytest-xdist (`make test` runs two workers)
# every test that uses one is sent to the same worker, so that each is built once.
ONE_WORKER_FIXTURES = ("tiny_dvc_run", "tiny_features")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        shared = [name for name in ONE_WORKER_FIXTURES if name in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))


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
def tiny_dvc_run(tmp_path_factory) -> dict:
    """A tiny DVC project and one completed `dvc repro` of it, shared by the tests that run DVC itself
    (they copy it before changing anything)."""
    from helpers.dvc_project import run_tiny_project

    return run_tiny_project(tmp_path_factory.mktemp("tiny-dvc"))
