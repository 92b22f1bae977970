"""Determinism on the CPU path: the same params and inputs give bitwise-identical results.

Two runs of each stage go into two separate copies of the inputs (without ``.work``, so the
second run cannot reuse the first one's task outputs) and two report folders; only the public
stage functions are called. Timing columns (``fit_seconds``) and ``probe/timing.json`` are the only
things allowed to differ.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cellpath.config import parse_params

SECTION = "breast_a"
TIMING_COLUMNS = ("fit_seconds",)


def extract_inputs(panel: dict, data_dir: Path, section: str = SECTION) -> Path:
    """What the extract stage reads for one section: its H&E, its zarr, one-row sections.csv and
    labels/summary.csv. Returns ``data_dir``."""
    source = panel["data_dir"]
    index = pd.read_csv(source / "sections" / "sections.csv")
    row = index[index["section_id"] == section]
    raw = data_dir / "raw" / row["raw_folder"].iloc[0]
    raw.mkdir(parents=True)
    shutil.copy2(source / "raw" / row["raw_folder"].iloc[0] / row["he_image"].iloc[0], raw)
    shutil.copytree(source / "sections" / f"{section}.zarr", data_dir / "sections" / f"{section}.zarr")
    row.to_csv(data_dir / "sections" / "sections.csv", index=False)
    (data_dir / "labels").mkdir()
    summary = pd.read_csv(source / "labels" / "summary.csv")
    summary[summary["section_id"] == section].to_csv(data_dir / "labels" / "summary.csv", index=False)
    return data_dir


def _copy_data(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".work"))
    return target


def _assert_tables_identical(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Exactly equal, column by column, and bitwise for float columns (so -0.0 ≠ 0.0, NaN payloads)."""
    assert list(a.columns) == list(b.columns)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    for column in a.columns:
        if pd.api.types.is_float_dtype(a[column]):
            assert a[column].to_numpy().tobytes() == b[column].to_numpy().tobytes(), column


def _assert_files_identical(a: Path, b: Path, skip: tuple[str, ...] = ()) -> int:
    """Every file under ``a`` has a byte-identical twin under ``b`` (and no extra ones); returns the count."""
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name not in skip)
    assert names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name not in skip)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return len(names)


@pytest.fixture(scope="module")
def twin_runs(tiny_features, tmp_path_factory) -> list[dict]:
    """The probe and robustness stages run twice each, MLflow off, on two copies of the features."""
    from cellpath.probe_stage import run_probe_stage
    from cellpath.robustness_stage import run_robustness_stage
    from test_probe_stage import _params as probe_params
    from test_robustness_stage import _params as robustness_params

    runs = []
    for name in ("first", "second"):
        tmp = tmp_path_factory.mktemp(f"determinism-{name}")
        data_dir = _copy_data(tiny_features["data_dir"], tmp / "data")
        probe = probe_params(tiny_features["params"], tmp).model_dump(mode="json")
        probe["probe"]["readouts"] = ["Nuc"]  # every protocol and taxonomy, one readout: ~1/3 of the fitting
        robustness = robustness_params(tiny_features["params"], tmp, readouts=["Nuc"]).model_dump(mode="json")
        params = parse_params(probe | {"robustness": robustness["robustness"], "mlflow": {"enabled": False}})
        reports = tmp / "reports"
        runs.append({"probe": run_probe_stage(params, data_dir, reports, root=tmp),
                     "robustness": run_robustness_stage(params, data_dir, reports, root=tmp), "reports": reports})
    return runs


def test_probe_run_tables_are_identical(twin_runs):
    first, second = twin_runs
    a = pd.read_parquet(first["reports"] / "probe_runs.parquet")
    b = pd.read_parquet(second["reports"] / "probe_runs.parquet")
    assert len(a) > 0 and (a["status"] == "ok").sum() > 0
    timing = [c for c in TIMING_COLUMNS if c in a.columns]
    assert timing == ["fit_seconds"]  # the one column that may differ; everything else must not
    _assert_tables_identical(a.drop(columns=timing), b.drop(columns=timing))
    _assert_tables_identical(first["probe"].drop(columns=timing), a.drop(columns=timing))  # returned = written
    # The summaries computed from the run table, and the headline metrics, byte for byte.
    assert _assert_files_identical(first["reports"] / "probe", second["reports"] / "probe", skip=("timing.json",)) >= 7
    assert (first["reports"] / "metrics.json").read_bytes() == (second["reports"] / "metrics.json").read_bytes()


def test_robustness_summary_and_margins_are_identical(twin_runs):
    first, second = twin_runs
    _assert_tables_identical(first["robustness"], second["robustness"])
    a = pd.read_parquet(first["reports"] / "robustness" / "margins.parquet")
    b = pd.read_parquet(second["reports"] / "robustness" / "margins.parquet")
    assert len(a) > 0 and a["margin"].notna().any()
    _assert_tables_identical(a, b)
    assert _assert_files_identical(first["reports"] / "robustness", second["reports"] / "robustness") == 5
    assert ((first["reports"] / "robustness_metrics.json").read_bytes()
            == (second["reports"] / "robustness_metrics.json").read_bytes())


def _extract(panel: dict, data_dir: Path, encoder: str) -> Path:
    from cellpath.stages import run_extract

    result = run_extract(panel["params"], extract_inputs(panel, data_dir), encoder, "10x")
    assert result["computed"] == [SECTION]
    return data_dir / "features" / encoder / "10x" / SECTION


def test_extraction_of_one_section_is_byte_identical(tiny_panel, tiny_features, tmp_path):
    """A torch ViT twice from scratch; the filter bank once more against the session's extraction."""
    first = _extract(tiny_panel, tmp_path / "a", "random-vit-t16")
    second = _extract(tiny_panel, tmp_path / "b", "random-vit-t16")
    assert _assert_files_identical(first, second) == 4  # Nuc, Mean, Cls and the sidecar
    assert np.isfinite(np.load(first / "Nuc.npy").astype(np.float32)).all()
    again = _extract(tiny_panel, tmp_path / "c", "filterbank-dense")
    assert _assert_files_identical(again, tiny_features["data_dir"] / "features" / "filterbank-dense" / "10x"
                                   / SECTION) == 3  # Nuc, Mean and the sidecar (no CLS token)
