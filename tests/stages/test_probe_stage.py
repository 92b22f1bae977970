"""The probe stage on the tiny simulated panel: run table, summaries, metrics.json and MLflow."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from cellpath.config import parse_params
from cellpath.errors import InputError
from cellpath.probing.plan import RUN_COLUMNS
from cellpath.stages.probe import run as run_probe_stage
from helpers.stage_params import probe_params


@pytest.fixture(scope="module")
def probe_data(tiny_features):
    return tiny_features


@pytest.fixture(scope="module")
def all_protocols(probe_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    params = probe_params(probe_data["params"], tmp)
    runs = run_probe_stage(params, probe_data["data_dir"], tmp / "reports", root=tmp)
    return {"runs": runs, "reports": tmp / "reports", "params": params, "tmp": tmp}


def test_run_table_has_one_row_per_planned_run(all_protocols):
    runs = all_protocols["runs"]
    on_disk = pd.read_parquet(all_protocols["reports"] / "probe" / "runs.parquet")
    assert list(on_disk.columns) == RUN_COLUMNS and len(on_disk) == len(runs)
    # 3 sections (Breast ×2, Lymphoid ×1): IS 3 units × 2 seeds, IOCD 2 × 1, MOCV 3 folds × 1, LOOO 2 × 1,
    # for 3 available readouts (Cls is unavailable for the filterbank) × 2 taxonomies.
    per_readout_taxonomy = {"is": 6, "iocd": 2, "mocv": 3, "looo": 2}
    counts = runs.groupby("protocol").size().to_dict()
    assert counts == {p: n * 3 * 2 for p, n in per_readout_taxonomy.items()}
    assert set(runs["readout"]) == {"Nuc", "Mean", "N||M"}
    ok = runs[runs["status"] == "ok"]
    assert len(ok) > 0.5 * len(runs)
    assert ok[["macro_f1", "macro_auroc", "macro_auprc"]].notna().all().all()
    assert ((ok["macro_f1"] >= 0) & (ok["macro_f1"] <= 1)).all()
    assert (ok["n_classes"] >= 2).all() and (ok["chosen_c"].isin([0.01, 0.1, 1.0, 10.0])).all()
    skipped = runs[runs["status"] == "skipped"]
    assert skipped["macro_f1"].isna().all() and (skipped["skip_reason"] != "").all()
    # LOOO on the lymphoid organ: tested on tonsil, trained on breast only; its classes pass the gates
    # only where both organs have them.
    counts_json = json.loads((all_protocols["reports"] / "probe" / "counts.json").read_text())
    assert counts_json["total"]["ok"] == len(ok) and counts_json["total"]["skipped"] == len(skipped)
    assert counts_json["total"]["unavailable"] == sum(per_readout_taxonomy.values()) * 2  # Cls × 2 taxonomies
    # every fitted run records its iterations and whether it converged; the counts say how many did not
    assert ok["converged"].notna().all() and ((ok["lbfgs_iterations"] >= 1) & (ok["lbfgs_iterations"] <= 30)).all()
    assert skipped["converged"].isna().all() and skipped["lbfgs_iterations"].isna().all()
    # how many Cs tied at the chosen C's validation Macro-F1: 1 (no tie) to the whole grid; NA when skipped
    assert runs["c_tied"].dtype == "Int64" and ok["c_tied"].between(1, 4).all() and skipped["c_tied"].isna().all()
    assert counts_json["total"]["not_converged"] == int((~ok["converged"].astype(bool)).sum())
    assert sum(counts_json[p]["not_converged"] for p in ("is", "iocd", "mocv", "looo")) == \
        counts_json["total"]["not_converged"]


def test_every_runs_chosen_c_and_tie_count_follow_from_its_stored_per_c_scores(all_protocols):
    """probe/c_scores.parquet keeps every C of every fitted run with its exact validation Macro-F1:
    recomputed from it, the smallest of the Cs whose fraction equals the best, and how many do, are
    the run table's chosen_c and c_tied on every run; the largest tied C would not be."""
    from fractions import Fraction

    from cellpath.probing.tasks import C_SCORE_KEYS

    reports = all_protocols["reports"] / "probe"
    runs = pd.read_parquet(reports / "runs.parquet")
    c_scores = pd.read_parquet(reports / "c_scores.parquet")
    assert list(c_scores.columns) == C_SCORE_KEYS
    keys = ["model", "magnification", "readout", "taxonomy", "protocol", "unit", "seed"]
    grid = all_protocols["params"].probe.c_grid
    ok = runs[runs["status"] == "ok"].set_index(keys)
    recomputed, largest = {}, {}
    for key, part in c_scores.groupby(keys, sort=False):
        assert part["c"].tolist() == grid  # every C, in grid order
        exact = [Fraction(text) for text in part["val_macro_f1_exact"]]
        assert part["val_macro_f1"].tolist() == [float(value) for value in exact]
        tied = [c for c, value in zip(part["c"], exact) if value == max(exact)]
        recomputed[key] = (min(tied), len(tied), float(max(exact)))
        largest[key] = max(tied)
    assert sorted(recomputed) == sorted(ok.index) and len(c_scores) == len(grid) * len(ok)  # skipped: no rows
    for key, (chosen, tied, val_f1) in recomputed.items():
        assert (ok.loc[key, "chosen_c"], ok.loc[key, "c_tied"], ok.loc[key, "val_macro_f1"]) == (chosen, tied, val_f1)
    assert (ok["c_tied"] > 1).any()  # ties to decide: the largest tied C gives another table
    assert any(largest[key] != ok.loc[key, "chosen_c"] for key in recomputed)


def test_probes_learn_the_cell_types(all_protocols):
    """Filterbank Nuc features of the simulated nuclei predict Tcoarse above chance across sections.
    (Not IS here: at 10× a patch is 224 µm, a third of a tiny section, so a leak-free IS split keeps
    about 19 test cells per run, too few for a stable score.)"""
    runs = all_protocols["runs"]
    chosen = runs[(runs["protocol"] != "is") & (runs["readout"] == "Nuc") & (runs["taxonomy"] == "coarse")
                  & (runs["status"] == "ok")]
    assert len(chosen) >= 4
    assert chosen["macro_auroc"].mean() > 0.65


def test_metrics_json_and_summaries(all_protocols):
    """metrics.json is the report's headline table without SDs: the same names, percentage points."""
    reports = all_protocols["reports"]
    metrics = json.loads((reports / "metrics.json").read_text())
    entry = metrics["filterbank-dense"]
    assert metrics["magnification"] == "10x"
    assert set(entry) >= {"IS", "MOCV", "LOOO", "CRA"}
    runs = all_protocols["runs"]
    from cellpath.probing.stats import pooled_cell_representation_advantage, protocol_summary

    nuc = runs[(runs["readout"] == "Nuc") & (runs["taxonomy"] == "fine") & (runs["status"] == "ok")]
    expected = protocol_summary(nuc, "macro_f1").set_index("protocol")["mean"]
    assert entry["IS"] == pytest.approx(100 * expected["is"], abs=0.005)
    cra = pooled_cell_representation_advantage(runs[runs["status"] == "ok"], "macro_f1", "10x").set_index("model")
    assert entry["CRA"] == pytest.approx(100 * cra.loc["filterbank-dense", "cra"], abs=0.005)
    for name in ("summary", "cra", "cra_pooled", "wins", "crt", "rank_agreement", "is_panels", "cra_panels"):
        assert (reports / "probe" / f"{name}.csv").is_file()
    timing = json.loads((reports / "probe" / "timing.json").read_text())
    assert 0 <= timing["mlflow_fraction"] < 1 and timing["mlflow_runs"] == 1 + 3 * 2 * 4  # readouts × taxonomies × protocols


def test_every_run_is_retrievable_from_mlflow(all_protocols):
    from mlflow.tracking import MlflowClient

    from cellpath.runtime.tracking import load_logged_table

    tmp, runs = all_protocols["tmp"], all_protocols["runs"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    found = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in found if r.data.tags["cellpath.kind"] == "stage"]
    children = [r for r in found if r.data.tags.get("cellpath.stage_run") == parents[0].info.run_id]
    assert not any("mlflow.parentRunId" in r.data.tags for r in found)  # flat: the runs table lists every condition
    assert len(parents) == 1 and len(children) == 3 * 2 * 4  # readouts × taxonomies × protocols
    parent = parents[0]
    assert parent.data.tags["dvc.experiment"] == "workspace"
    assert parent.info.run_name.startswith("probe · workspace@")  # the experiment and commit in the name
    assert not any("filterbank" in key for key in parent.data.metrics)  # no model in a metric name
    child = next(c for c in children if c.data.params["readout"] == "Nuc" and c.data.params["taxonomy"] == "fine"
                 and c.data.params["protocol"] == "is")
    assert child.info.run_name.startswith("filterbank-dense is 10x Nuc fine · workspace@")
    table = load_logged_table(f"sqlite:///{tmp}/mlflow.db", child.info.run_id)
    mine = runs[(runs["readout"] == "Nuc") & (runs["taxonomy"] == "fine") & (runs["protocol"] == "is")]
    assert len(table) == len(mine)
    np.testing.assert_allclose(np.sort(table["macro_f1"].dropna()), np.sort(mine["macro_f1"].dropna()))
    assert child.data.metrics["runs_ok"] == (mine["status"] == "ok").sum()
    # percentage points, as the report shows them
    from cellpath.probing.stats import protocol_summary

    assert child.data.metrics["macro_f1"] == pytest.approx(100 * protocol_summary(mine, "macro_f1")["mean"].iloc[0])
    assert {"wins_macro_f1", "cra_macro_f1", "cra_wins"} <= set(child.data.metrics)
    mocv = next(c for c in children if c.data.params["protocol"] == "mocv")
    assert any(key.startswith("unit/fold") for key in mocv.data.metrics)
    # a child spans its fitting time, not the instant it was logged
    fitted = float(runs[(runs["readout"] == mocv.data.params["readout"]) & (runs["protocol"] == "mocv")
                        & (runs["taxonomy"] == mocv.data.params["taxonomy"])]["fit_seconds"].sum())
    assert (mocv.info.end_time - mocv.info.start_time) / 1000 == pytest.approx(fitted, abs=0.01)


def test_mlflow_compares_models_on_one_condition(probe_data, all_protocols, tmp_path):
    """Two models in one experiment: filtering the runs by a condition's params gives one run per
    model with the same metric keys, as the UI's compare view needs."""
    from mlflow.tracking import MlflowClient

    from cellpath.config import MlflowConfig
    from cellpath.runtime.tracking import Tracker
    from cellpath.probing.summary import comparison_metrics, summarise
    from cellpath.stages.probe import log_conditions, nested_panels

    runs = all_protocols["runs"]
    other = runs.assign(model="filterbank-copy", macro_f1=runs["macro_f1"] * 0.9)
    table = pd.concat([runs, other], ignore_index=True)
    tracker = Tracker(MlflowConfig(tracking_uri="sqlite:///store.db", artifact_location="art", experiment="two"),
                      "probe", tmp_path)
    for _, frame in table.groupby(["model", "readout", "taxonomy"], sort=False):
        log_conditions(tracker, frame.reset_index(drop=True), all_protocols["params"])
    summaries = summarise(table, ["10x"], nested_panels(probe_data["data_dir"], all_protocols["params"].panel))
    for name, metrics in comparison_metrics(table, summaries, ["10x"]).items():
        tracker.add_metrics(name, metrics)
    tracker.finish({}, {})
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}")
    experiment = client.get_experiment_by_name("two")
    chosen = client.search_runs([experiment.experiment_id], "params.protocol = 'mocv' and params.readout = 'Nuc' "
                                "and params.taxonomy = 'fine' and params.magnification = '10x'")
    assert sorted(r.data.params["model"] for r in chosen) == ["filterbank-copy", "filterbank-dense"]
    first, second = (set(r.data.metrics) for r in chosen)
    assert first == second and {"macro_f1", "macro_f1_sd", "wins_macro_f1"} <= first
    by_model = {r.data.params["model"]: r.data.metrics["macro_f1"] for r in chosen}
    assert by_model["filterbank-copy"] < by_model["filterbank-dense"]


def test_one_protocol_runs_only_that_protocol(probe_data, all_protocols, tmp_path):
    params = probe_params(probe_data["params"], tmp_path, protocol="mocv")
    params = parse_params(params.model_dump(mode="json") | {"mlflow": {"enabled": False}})
    runs = run_probe_stage(params, probe_data["data_dir"], tmp_path / "reports", root=tmp_path)
    assert set(runs["protocol"]) == {"mocv"}
    # the experiment reproduces the full run's MOCV rows to the fit tolerance: a run's fits share batched
    # float32 products with other runs (others here than in the full run), so its weights differ by
    # rounding within probe.tol's reach; the chosen C and the Macro-F1s are equal (0.1 pp), and the ranking
    # metrics within 1 pp (on this tiny panel one swapped pair of near-tied test cells moves AUROC 0.6 pp)
    # except on runs where every C ties on validation: those probes are at chance (one of them, Macro-F1
    # 0.05, ranks its test cells by probability differences of float32 rounding, and under OpenBLAS's
    # Haswell kernels with torch at AVX2 its AUROC moved 3.7 pp; docs/decisions/0039)
    keys = ["model", "magnification", "readout", "taxonomy", "unit", "seed"]
    full = all_protocols["runs"][all_protocols["runs"]["protocol"] == "mocv"]
    joined = runs.merge(full, on=keys, suffixes=("", "_full"), validate="one_to_one")
    assert len(joined) == len(runs) == len(full)
    assert (joined["status"] == joined["status_full"]).all()
    fitted = joined[joined["status"] == "ok"]
    assert len(fitted) and (fitted["chosen_c"] == fitted["chosen_c_full"]).all()
    decided = fitted[fitted["c_tied"] < len(params.probe.c_grid)]
    assert len(decided) >= 0.5 * len(fitted)  # 12 of 18 on 2026-12-05
    for metric, tolerance in (("val_macro_f1", 1e-3), ("macro_f1", 1e-3)):
        assert (fitted[metric] - fitted[f"{metric}_full"]).abs().max() <= tolerance, metric
    for metric in ("macro_auroc", "macro_auprc"):
        assert (decided[metric] - decided[f"{metric}_full"]).abs().max() <= 1e-2, metric
    metrics = json.loads((tmp_path / "reports" / "metrics.json").read_text())
    # no CRA (needs IS) or CRT (needs all three); MOCV's mean with its 95% interval, in pp
    assert set(metrics["filterbank-dense"]) == {"MOCV", "MOCV_ci95"}
    low, high = metrics["filterbank-dense"]["MOCV_ci95"]
    assert low <= metrics["filterbank-dense"]["MOCV"] <= high
    assert not (tmp_path / "mlflow.db").exists()


def test_nan_features_are_reported_with_section_and_encoder(probe_data, tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(probe_data["data_dir"], data_dir)
    path = data_dir / "features" / "filterbank-dense" / "10x" / "breast_b" / "Nuc.npy"
    matrix = np.load(path)
    matrix[:, 0] = np.nan  # every cell, so evaluated ones too
    np.save(path, matrix)
    data = probe_params(probe_data["params"], tmp_path).model_dump(mode="json")
    params = parse_params(data | {"mlflow": {"enabled": False}})
    with pytest.raises(InputError, match=r"breast_b.*NaN or infinite Nuc features \(encoder filterbank-dense, 10x\)"):
        run_probe_stage(params, data_dir, tmp_path / "reports", root=tmp_path)
    assert not (tmp_path / "reports" / "probe").exists()


def test_too_many_mocv_folds_names_the_parameter(probe_data, tmp_path):
    from cellpath.errors import ConfigError

    data = probe_params(probe_data["params"], tmp_path).model_dump(mode="json")
    data["probe"]["mocv_folds"] = 5
    data["mlflow"] = {"enabled": False}
    with pytest.raises(ConfigError, match="probe.mocv_folds"):
        run_probe_stage(parse_params(data), probe_data["data_dir"], tmp_path / "reports", root=tmp_path)


def test_no_is_test_cell_shares_an_encoder_patch_with_a_training_or_validation_cell(probe_data, all_protocols):
    """On the tiny panel's real patch grids (224 px at 10×, 224 µm patches) and at 40× (56 µm): for
    every IS run, the encoder patches of its test cells and of its train + val cells are disjoint, and
    the run table counts the test cells each rule removed."""
    from cellpath.features.encoders.registry import selected_encoders
    from cellpath.features.panel import encoder_patch_ids, load_panel_cells
    from cellpath.probing.tasks import plan_magnification

    params = all_protocols["params"]
    data_dir = probe_data["data_dir"]
    panel = load_panel_cells(data_dir, params.panel)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    for magnification in ("10x", "40x"):
        groups = encoder_patch_ids(data_dir, panel, encoders[0].input_size, magnification)
        plans = plan_magnification(params, data_dir, panel, encoders, magnification)
        is_runs = [r for runs in plans.values() for r in runs if r.protocol == "is" and r.task is not None]
        assert is_runs
        for run in is_runs:
            fit = np.concatenate([run.task.train, run.task.val])
            assert not set(groups[run.task.test]) & set(groups[fit]), (magnification, run.unit, run.seed)
    runs = all_protocols["runs"]
    is_rows = runs[runs["protocol"] == "is"]
    assert (is_rows["n_test_excluded_shared_patch"] > 0).all()  # 224 µm patches straddle every ROI border
    assert (is_rows["n_test_excluded_buffer"] > 0).all()
    assert (runs.loc[runs["protocol"] != "is", ["n_test_excluded_buffer", "n_test_excluded_shared_patch"]] == 0).all().all()
