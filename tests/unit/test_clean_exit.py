"""A process that reads a parquet table, or asks a stage for ``--help``, exits 0: no abort at shutdown.

pandas 2.x hands pyarrow a Python file object for a local path; pyarrow may release it on one of its
threads after ``read_parquet`` has returned, and when that happens while the interpreter shuts down,
the process aborts ("terminate called without an active exception", exit 134) with its work done.
``cellpath.io.native_parquet`` keeps local reads in pyarrow's C++ layer
(docs/decisions/0033-parquet-reads-without-exit-aborts.md). The abort is a race: a few runs in a
hundred. So each check runs many fresh interpreters, and one test checks the mechanism itself,
which does not depend on luck: with the guard, pyarrow is given a path, never a Python file object.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from cellpath.io import native_parquet
from helpers.project import HANG_GUARD_S

RUNS = 30
PARALLEL = 2  # fresh interpreters at a time; the machine may have two cores
STAGES = ("validate", "fetch", "ingest", "annotate", "concordance", "extract", "probe", "robustness", "gallery",
          "report")
#: What every guarded interpreter runs first: what importing cellpath does once the guard is wired in.
GUARD = "import cellpath.io.native_parquet as guard; guard.install(); "


def _frame(rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"model": [f"model_{i % 7}" for i in range(rows)], "macro_f1": rng.random(rows),
                         "classes": [["T cell", "B cell"][: 1 + i % 2] for i in range(rows)]})


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Path]:
    """A one-row table (the read returns soonest, so the abort was likeliest) and a 1,000-row one."""
    folder = tmp_path_factory.mktemp("parquet")
    paths = {"1 row": folder / "one.parquet", "1000 rows": folder / "thousand.parquet"}
    for (name, path), rows in zip(paths.items(), (1, 1000)):
        _frame(rows).to_parquet(path, index=False)
    return paths


def _run_many(commands: list[list[str]]) -> list[str]:
    """Run each command in a fresh process, a few at a time; describe every one that did not exit 0."""
    def run(command: list[str]) -> str | None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)
        return None if done.returncode == 0 else f"{command[-3:]} exit {done.returncode}: {done.stderr[-300:]!r}"

    with ThreadPoolExecutor(PARALLEL) as pool:
        return [failure for failure in pool.map(run, commands) if failure]


@pytest.mark.parametrize("table", ["1 row", "1000 rows"])
def test_read_parquet_of_a_str_path_then_exit_is_clean(tables, table):
    """The one-liner that aborted (``pd.read_parquet('<str>')``), guarded, in 30 fresh interpreters."""
    code = f"{GUARD}import pandas as pd; print(pd.read_parquet({str(tables[table])!r}).shape)"
    failures = _run_many([[sys.executable, "-c", code]] * RUNS)
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit 0: {failures[:3]}"


def test_a_bare_pandas_one_liner_exits_cleanly_where_the_environment_installs_the_guard(tables):
    """Without importing cellpath: clean only where the environment installs the guard at startup."""
    probe = "import pandas.io.parquet, cellpath.io.native_parquet as guard; print(guard.installed())"
    active = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert active.stdout.strip() == "True", (
        "this environment does not install cellpath.io.native_parquet at interpreter start, so a bare "
        "`pd.read_parquet('<str>')` can still abort at exit: run `make install`, which writes the startup file "
        f"(docs/decisions/0033); {active.stderr[-300:]!r}")
    code = f"import pandas as pd; print(pd.read_parquet({str(tables['1 row'])!r}).shape)"
    failures = _run_many([[sys.executable, "-c", code]] * RUNS)
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit 0: {failures[:3]}"


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help_exits_cleanly(stage):
    """``cellpath <stage> --help`` (the console script dvc.yaml calls) in 30 fresh interpreters."""
    exe = Path(sys.executable).parent / "cellpath"
    failures = _run_many([[str(exe), stage, "--help"]] * RUNS)
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit 0: {failures[:3]}"


def test_the_guard_hands_pyarrow_local_paths_and_reads_the_same_frame(tables, monkeypatch):
    """Deterministic: a str or Path reaches pyarrow as a path (C++ file); buffers and writes are untouched."""
    import pandas.io.parquet as pandas_parquet

    path = tables["1000 rows"]
    unguarded = getattr(pandas_parquet._get_path_or_handle, "__wrapped__", pandas_parquet._get_path_or_handle)
    monkeypatch.setattr(pandas_parquet, "_get_path_or_handle", unguarded)  # restored after the test
    expected = pd.read_parquet(str(path))
    native_parquet.patch(pandas_parquet)
    assert native_parquet.installed()
    sources = []
    read_table = pq.read_table

    def spy(source, **kwargs):
        sources.append(type(source).__name__)
        return read_table(source, **kwargs)

    monkeypatch.setattr(pq, "read_table", spy)
    with open(path, "rb") as handle:
        frames = [pd.read_parquet(str(path)), pd.read_parquet(path), pd.read_parquet(handle)]
    assert sources == ["str", "str", "BufferedReader"]
    for frame in frames:
        pd.testing.assert_frame_equal(frame, expected)
    with pytest.raises(FileNotFoundError):
        pd.read_parquet(path.with_name("missing.parquet"))
    written = path.with_name("written.parquet")
    expected.to_parquet(written, index=False)
    pd.testing.assert_frame_equal(pd.read_parquet(written), expected)


def test_install_loads_nothing_heavy_and_patches_pandas_when_it_loads():
    """``cellpath fetch`` sets numpy's CPU dispatch before numpy loads: installing must not import it; the
    finder it leaves patches pandas when pandas loads, then removes itself."""
    code = (f"import sys; {GUARD}heavy = sorted({{'numpy', 'pandas', 'pyarrow'}} & set(sys.modules)); "
            "import pandas; from cellpath.io.import_hooks import PatchWhenLoaded; "
            "print(heavy, guard.installed(), sum(isinstance(f, PatchWhenLoaded) and f.fullname == guard.PANDAS_PARQUET "
            "for f in sys.meta_path))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "True", "0"]
