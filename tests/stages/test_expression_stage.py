"""The expression stage on the tiny simulated panel: run and gene tables, summaries, metrics, MLflow,
and what the features decode beyond the type on the simulator's within-type program."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cellpath.config import parse_params
from cellpath.expression.plan import RUN_COLUMNS
from cellpath.simulation.expression import PROLIFERATION_GENES
from cellpath.stages.expression import run as run_expression_stage
from cellpath.stages.extract import run as run_extract
from helpers.project import tiny_params
from helpers.stage_params import probe_params


def _params(base, tmp_path, **expression):
    data = probe_params(base, tmp_path).model_dump(mode="json")
    data["extract"]["magnifications"] = ["20x"]  # a nucleus is 8 filter-bank tokens wide at 20×, 4 at 10×
    data["expression"] = {"genes": 40, "readouts": ["Nuc", "Mean"]} | expression
    data["mlflow"]["experiment"] = "expression"
    return parse_params(data)


@pytest.fixture(scope="module")
def expression_data(tmp_path_factory) -> dict:
    """The tiny panel simulated with the proliferation program on, fetched, ingested, annotated, ranked
    and encoded by the filter bank at 20×."""
    from cellpath.stages.annotate import run as run_annotate
    from cellpath.stages.concordance import run as run_concordance
    from cellpath.stages.fetch import run as run_fetch
    from cellpath.stages.ingest import run as run_ingest

    root = tmp_path_factory.mktemp("expression-data")
    data = tiny_params().model_dump(mode="json")
    data["synthetic"]["proliferation"] = 1.0
    base = parse_params(data)
    data_dir = root / "data"
    run_fetch(base, data_dir)
    run_ingest(base, data_dir)
    run_annotate(base, data_dir, root / "reports")
    run_concordance(base, data_dir, root / "reports")
    run_extract(_params(base, root), data_dir, "filterbank-dense", "20x")
    return {"data_dir": data_dir, "params": base}


@pytest.fixture(scope="module")
def expression_run(expression_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expression")
    params = _params(expression_data["params"], tmp)
    runs = run_expression_stage(params, expression_data["data_dir"], tmp / "reports", root=tmp)
    return {"runs": runs, "reports": tmp / "reports", "params": params, "tmp": tmp, "data": expression_data}


def test_one_row_per_run_of_the_type_probes_units_and_seeds(expression_run):
    runs, reports = expression_run["runs"], expression_run["reports"]
    on_disk = pd.read_parquet(reports / "expression" / "runs.parquet")
    assert list(on_disk.columns) == ["model", "magnification", "readout", "taxonomy", *RUN_COLUMNS]
    # 3 sections (Breast ×2, Lymphoid ×1): IS 3 units × 2 seeds, IOCD 2 × 1, MOCV 3 folds × 1, LOOO 2 × 1; 2 readouts
    assert runs.groupby("protocol").size().to_dict() == {"is": 12, "iocd": 4, "mocv": 6, "looo": 4}
    ok = runs[runs["status"] == "ok"]
    assert (ok["protocol"] != "is").sum() == 14  # every cross-domain run is fitted (7 per readout)
    # IS: in the small sections nearly every cell outside the ROI shares an encoder patch with it (no
    # test cell left, as for the type probes); such runs are kept, skipped, with the reason
    skipped = runs[runs["status"] == "skipped"]
    assert (skipped["protocol"] == "is").all() and (skipped["skip_reason"] == "no test cell").all()
    assert (skipped["n_test"] == 0).all() and skipped["mean_pearson"].isna().all()
    assert (ok["protocol"] == "is").sum() >= 2
    assert ok["mean_pearson"].between(-1, 1).all() and ok["mean_pearson_type"].between(-1, 1).all()
    assert (ok["n_genes"] == 40).all()
    counts = json.loads((reports / "expression" / "counts.json").read_text())
    assert counts["runs"] == {"ok": len(ok), "skipped": len(skipped)} and counts["cells_below_min_counts"] >= 0
    lists = pd.read_csv(reports / "expression" / "gene_lists.csv")
    assert lists.groupby(["protocol", "unit", "seed"]).size().eq(40).all()
    assert len(lists.groupby(["protocol", "unit", "seed"])) == len(ok) // 2  # one list per fitted run (2 readouts)


def test_the_features_decode_the_program_genes_beyond_the_type_and_not_the_type_genes(expression_run):
    genes = pd.read_parquet(expression_run["reports"] / "expression" / "genes.parquet")
    nuc = genes[genes["readout"] == "Nuc"]
    program = nuc[nuc["gene"].isin(PROLIFERATION_GENES)]
    assert program["gene"].nunique() >= 3  # the program's genes vary within types: they are selected
    assert program["pearson"].mean() > program["pearson_type"].mean()
    assert program["pearson_type_features"].mean() > program["pearson_type"].mean() + 0.02  # beyond the label
    typed = nuc[~nuc["gene"].isin(PROLIFERATION_GENES)]
    assert typed["pearson_type"].mean() > typed["pearson"].mean() + 0.05
    mean = genes[genes["readout"] == "Mean"]  # a patch mean does not see one nucleus: no gain on the program
    assert mean[mean["gene"].isin(PROLIFERATION_GENES)]["pearson"].mean() < program["pearson"].mean()


def test_summaries_metrics_and_mlflow(expression_run):
    reports = expression_run["reports"]
    summary = pd.read_csv(reports / "expression" / "summary.csv")
    chosen = summary[(summary["metric"] == "mean_pearson") & (summary["readout"] == "Nuc")]
    assert set(chosen["protocol"]) == {"is", "iocd", "mocv", "looo"}
    assert (chosen["low"] <= chosen["mean"]).all() and (chosen["mean"] <= chosen["high"]).all()
    metrics = json.loads((reports / "expression_metrics.json").read_text())
    entry = metrics["filterbank-dense"]
    assert set(entry) == {f"{p} r{suffix}" for p in ("IS", "IOCD", "MOCV", "LOOO") for suffix in ("", "_ci95")} | {
        "CRA r"}
    assert entry["IS r_ci95"][0] <= entry["IS r"] <= entry["IS r_ci95"][1]
    typed = metrics["type label (Tfine)"]
    assert set(typed) == {"IS r", "IOCD r", "MOCV r", "LOOO r"}
    gain = chosen.set_index("protocol")["mean"]["looo"] - typed["LOOO r"]  # the gain is the difference
    gains = summary[(summary["metric"] == "gain_features_over_type") & (summary["readout"] == "Nuc")]
    assert gains.set_index("protocol")["mean"]["looo"] == pytest.approx(gain, abs=1e-4)  # r(type) rounded to 1e-4
    import mlflow

    mlflow.set_tracking_uri(expression_run["params"].mlflow.tracking_uri)
    found = mlflow.search_runs(experiment_names=["expression"], output_format="pandas")
    children = found[found["tags.mlflow.runName"].str.startswith("expression filterbank-dense")]
    assert len(children) == 8  # 4 protocols × 2 readouts at 20×
    assert children["metrics.mean_pearson"].notna().all() and children["metrics.mean_pearson_type"].notna().all()


def test_a_second_run_reuses_every_shard_and_gives_the_same_tables(expression_run, tmp_path):
    params = _params(expression_run["data"]["params"], tmp_path)
    again = run_expression_stage(params, expression_run["data"]["data_dir"], tmp_path / "reports", root=tmp_path)
    columns = [c for c in again.columns if c != "fit_seconds"]
    pd.testing.assert_frame_equal(again[columns], expression_run["runs"][columns])
    np.testing.assert_array_equal(again["fit_seconds"], expression_run["runs"]["fit_seconds"])  # read, not refitted
