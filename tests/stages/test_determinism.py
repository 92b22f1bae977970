"""Determinism on the CPU path: the same params and inputs give bitwise-identical results.

Two runs of each stage go into two separate copies of the inputs (without ``.work``, so the
second run cannot reuse the first one's task outputs) and two report folders; only the public
stage functions are called. Timing columns (``fit_seconds``) and ``probe/timing.json`` are the only
things allowed to differ.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cellpath.config import parse_params
from helpers.project import HANG_GUARD_S
from helpers.stage_params import SECTION, extract_inputs

TIMING_COLUMNS = ("fit_seconds",)


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
    from cellpath.stages.probe import run as run_probe_stage
    from cellpath.stages.robustness import run as run_robustness_stage
    from helpers.stage_params import probe_params, robustness_params

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
    a = pd.read_parquet(first["reports"] / "probe" / "runs.parquet")
    b = pd.read_parquet(second["reports"] / "probe" / "runs.parquet")
    assert len(a) > 0 and (a["status"] == "ok").sum() > 0
    timing = [c for c in TIMING_COLUMNS if c in a.columns]
    assert timing == ["fit_seconds"]  # the one column that may differ; everything else must not
    _assert_tables_identical(a.drop(columns=timing), b.drop(columns=timing))
    _assert_tables_identical(first["probe"].drop(columns=timing), a.drop(columns=timing))  # returned = written
    # The summaries computed from the run table, and the headline metrics, byte for byte.
    assert _assert_files_identical(first["reports"] / "probe", second["reports"] / "probe",
                                   skip=("timing.json", "runs.parquet")) >= 7  # runs: compared above, timing aside
    assert (first["reports"] / "metrics.json").read_bytes() == (second["reports"] / "metrics.json").read_bytes()


def test_robustness_summary_and_margins_are_identical(twin_runs):
    first, second = twin_runs
    _assert_tables_identical(first["robustness"], second["robustness"])
    a = pd.read_parquet(first["reports"] / "robustness" / "margins.parquet")
    b = pd.read_parquet(second["reports"] / "robustness" / "margins.parquet")
    assert len(a) > 0 and a["margin"].notna().any()
    _assert_tables_identical(a, b)
    # summary, margins, enrichment, shortcut curves and summary, agreement, sensitivity sweep and its agreement
    assert _assert_files_identical(first["reports"] / "robustness", second["reports"] / "robustness") == 8
    assert ((first["reports"] / "robustness_metrics.json").read_bytes()
            == (second["reports"] / "robustness_metrics.json").read_bytes())


def _extract(panel: dict, data_dir: Path, encoder: str) -> Path:
    from cellpath.stages.extract import run as run_extract

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


# --- across machines: the simulated panel does not depend on the CPU's kernels ---------------------------


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


def _fetch_digest(work: Path, params: Path, env: dict[str, str]) -> dict[str, str]:
    import subprocess
    import sys


    work.mkdir()
    result = subprocess.run([str(Path(sys.executable).parent / "cellpath"), "fetch", "--params", str(params),
                             "--data-dir", str(work / "data")], cwd=work, env=env, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((work / "data").rglob("*")) if p.is_file()}


def test_simulated_panel_is_byte_identical_whatever_blas_and_simd_kernels(tmp_path):
    """Another machine means other OpenBLAS kernels (OPENBLAS_CORETYPE picks them here) and other
    numpy SIMD kernels (AVX-512 or not: NPY_DISABLE_CPU_FEATURES turns them off here). Before the
    simulator avoided BLAS and pinned numpy's dispatch, OpenBLAS's SkylakeX and Haswell kernels and
    numpy's AVX2 and AVX-512 ones each gave files that differed in the last bits."""
    import yaml

    from helpers.dvc_project import dvc_env

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "source": "synthetic", "seed": 3,
        "synthetic": {"cells_per_section": 300, "reference_cells_per_type": 30,
                      "sections": [{"section_id": "breast_a", "organ": "Breast", "status": "Breast cancer"},
                                   {"section_id": "liver_a", "organ": "Liver", "status": "Normal"}]},
        "concordance": {"panel_sizes": [1, 2]}, "panel": "S2",
    }))
    base = {k: v for k, v in dvc_env().items() if not k.startswith(("OPENBLAS_", "NPY_"))}
    variants = {
        "openblas-default": base,
        "openblas-haswell": base | {"OPENBLAS_CORETYPE": "Haswell"},
        "openblas-prescott": base | {"OPENBLAS_CORETYPE": "Prescott"},
        "numpy-avx2": base | {"NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"},
    }
    if "avx512f" in _cpu_flags():
        variants["openblas-skylakex"] = base | {"OPENBLAS_CORETYPE": "SkylakeX"}
    digests = {name: _fetch_digest(tmp_path / name, params, env) for name, env in variants.items()}
    reference = digests["openblas-default"]
    assert len(reference) == 2 * 10 + 2  # ten files per section, one reference per organ
    for name, digest in digests.items():
        assert digest == reference, (name, sorted(k for k in reference if digest.get(k) != reference[k]))


def test_fetch_turns_off_numpy_avx512_kernels():
    import subprocess
    import sys

    code = ("from cellpath.cli import pin_numpy_dispatch; pin_numpy_dispatch(); import numpy, os; "
            "from numpy._core._multiarray_umath import __cpu_features__ as f; "
            "print(os.environ['NPY_DISABLE_CPU_FEATURES'], f['X86_V4'], f['AVX512_ICL'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S,
                            env={k: v for k, v in os.environ.items() if k != "NPY_DISABLE_CPU_FEATURES"})
    assert result.stdout.split() == ["X86_V4", "AVX512_ICL", "AVX512_SPR", "False", "False"], result.stderr
