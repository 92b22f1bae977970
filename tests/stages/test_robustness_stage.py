"""The robustness stage on the tiny simulated panel: summaries, margins, enrichment, shortcut, MLflow."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cellpath.robustness.neighbours import ArrayRows
from cellpath.robustness.panel import cell_groups, scoring_units
from cellpath.stages.robustness import run as run_robustness_stage
from helpers.stage_params import robustness_params


@pytest.fixture(scope="module")
def stage(tiny_features, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("robustness")
    params = robustness_params(tiny_features["params"], tmp)
    summary = run_robustness_stage(params, tiny_features["data_dir"], tmp / "reports", root=tmp)
    return {"summary": summary, "reports": tmp / "reports", "tmp": tmp, "params": params}


def test_summary_rows_per_condition_and_unit(stage):
    summary = stage["summary"]
    # panel scope: one unit; organ scope: only Breast has two sections (the confounder needs two levels).
    assert sorted(zip(summary["readout"], summary["scope"], summary["unit"])) == [
        ("Mean", "organ", "Breast"), ("Mean", "panel", "panel"), ("Nuc", "organ", "Breast"), ("Nuc", "panel", "panel")]
    for column in ("croma_median", "f0", "ltm", "ri", "mari", "bio_bacc", "conf_bacc"):
        assert summary[column].notna().all()
    assert ((summary["f0"] >= 0) & (summary["f0"] <= 1)).all()
    assert (summary["ltm"] <= summary["croma_median"]).all()
    assert (summary["k"] >= 1).all()
    on_disk = pd.read_csv(stage["reports"] / "robustness" / "summary.csv")
    assert len(on_disk) == len(summary)


def test_sensitivity_sweeps_reproduce_the_headline_at_its_m_and_alpha(stage):
    reports = stage["reports"] / "robustness"
    sweep = pd.read_csv(reports / "sensitivity.csv", keep_default_na=False, na_values=[""])
    summary = stage["summary"].set_index(["readout", "scope", "unit"])
    assert len(sweep) == len(summary) * (3 + 6)  # three alphas and m = 1..6 per scored condition
    for (readout, scope, unit, parameter), part in sweep.groupby(["readout", "scope", "unit", "parameter"]):
        row = summary.loc[(readout, scope, unit)]
        at = part.set_index("value")
        if parameter == "alpha":
            assert at.loc[0.1, "ltm"] == pytest.approx(row["ltm"], abs=1e-12)
            assert at.loc[0.05, "ltm"] <= at.loc[0.1, "ltm"] <= at.loc[0.2, "ltm"]
        else:
            assert sorted(at.index) == [1, 2, 3, 4, 5, 6]
            assert at.loc[5, "croma_median"] == pytest.approx(row["croma_median"], abs=1e-12)
            assert at.loc[5, "n_undefined"] == row["n_undefined"]
    agreement = pd.read_csv(reports / "sensitivity_agreement.csv")
    alpha_pairs = agreement[agreement["parameter"] == "alpha"][["x", "y"]].drop_duplicates().values.tolist()
    m_pairs = agreement[agreement["parameter"] == "m"][["x", "y"]].drop_duplicates().values.tolist()
    assert alpha_pairs == [[0.05, 0.1], [0.05, 0.2], [0.1, 0.2]] and m_pairs == [[5, 1], [5, 6], [1, 6]]
    assert (agreement["n_models"] == 1).all() and agreement["rho"].isna().all()  # one model: no ranking


def test_margins_cover_every_cell_and_undefined_ones_are_counted(stage, tiny_features):
    margins = pd.read_parquet(stage["reports"] / "robustness" / "margins.parquet")
    summary = stage["summary"].set_index(["readout", "scope", "unit"])
    for (readout, scope, unit), part in margins.groupby(["readout", "scope", "unit"]):
        row = summary.loc[(readout, scope, unit)]
        assert len(part) == row["n_samples"]
        assert int(part["margin"].isna().sum()) == row["n_undefined"]
        assert np.nanmedian(part["margin"]) == pytest.approx(row["croma_median"], abs=1e-9)
    assert margins["margin"].dropna().between(-1, 1).all()


def test_margins_name_the_nearest_so_and_os_neighbours_that_decided_them(stage, tiny_features):
    """SO: same type, other section; OS: other type, same section (the confounder is the section); never
    the cell's own tile; the nearest distance is at most the mean of the m that make the margin."""
    margins = pd.read_parquet(stage["reports"] / "robustness" / "margins.parquet")
    panel = margins[margins["scope"] == "panel"]
    types = panel.drop_duplicates(["section_id", "cell_id"]).set_index(["section_id", "cell_id"])["cell_type"]
    defined = panel[panel["margin"].notna()]
    assert defined[["so_cell_id", "os_cell_id"]].notna().all().all()
    so_type = types.reindex(pd.MultiIndex.from_arrays([defined["so_section_id"], defined["so_cell_id"]])).to_numpy()
    os_type = types.reindex(pd.MultiIndex.from_arrays([defined["os_section_id"], defined["os_cell_id"]])).to_numpy()
    assert (so_type == defined["cell_type"].to_numpy()).all()
    assert (defined["so_section_id"] != defined["section_id"]).all()
    assert (os_type != defined["cell_type"].to_numpy()).all()
    assert (defined["os_section_id"] == defined["section_id"]).all()
    assert defined[["so_distance", "os_distance"]].ge(0).all().all()
    from cellpath.features.panel import load_panel_cells

    cells = load_panel_cells(tiny_features["data_dir"], stage["params"].panel).cells
    tile = (cells["section_id"] + ":" + (cells["x_um"] // 40.0).astype(int).astype(str) + ":"
            + (cells["y_um"] // 40.0).astype(int).astype(str))
    tile = pd.Series(tile.to_numpy(), index=pd.MultiIndex.from_arrays([cells["section_id"], cells["cell_id"]]))
    own = tile.reindex(pd.MultiIndex.from_arrays([defined["section_id"], defined["cell_id"]])).to_numpy()
    for kind in ("so", "os"):
        theirs = tile.reindex(pd.MultiIndex.from_arrays([defined[f"{kind}_section_id"], defined[f"{kind}_cell_id"]]))
        assert (theirs.to_numpy() != own).all()  # never a cell of its own tile (the group)


def test_a_margin_is_recomputed_from_its_two_mean_distances_and_they_from_the_features(stage, tiny_features):
    """margins.parquet carries d_SO and d_OS, the means over the m nearest SO / OS neighbours: the margin
    is (d_OS - d_SO) / (d_OS + d_SO) of them, and both equal a dense scipy cosine search over the stored
    features (same type other section / other type same section, never the cell's own 40 µm tile)."""
    from scipy.spatial.distance import cdist

    from cellpath.features.panel import PanelFeatures, load_panel_cells, panel_matrix

    margins = pd.read_parquet(stage["reports"] / "robustness" / "margins.parquet")
    defined = margins[margins["margin"].notna()]
    assert len(defined) and margins.loc[margins["margin"].isna(), ["d_so", "d_os"]].isna().all().all()
    recomputed = (defined["d_os"] - defined["d_so"]) / (defined["d_os"] + defined["d_so"])
    np.testing.assert_allclose(recomputed.to_numpy(), defined["margin"].to_numpy(), rtol=0, atol=1e-12)

    params = stage["params"]
    panel = load_panel_cells(tiny_features["data_dir"], params.panel)
    cells = panel.cells
    x = panel_matrix(PanelFeatures(tiny_features["data_dir"] / "features", "filterbank-dense", "10x", panel)
                     .readout("Nuc")).astype(np.float64)
    distance = cdist(x, x, "cosine")
    tile = (cells["section_id"] + ":" + (cells["x_um"] // 40.0).astype(int).astype(str) + ":"
            + (cells["y_um"] // 40.0).astype(int).astype(str)).to_numpy()
    kind, section = cells["coarse"].to_numpy(), cells["section_id"].to_numpy()
    chosen = margins[(margins["readout"] == "Nuc") & (margins["scope"] == "panel")].reset_index(drop=True)
    assert (chosen["cell_id"].to_numpy() == cells["cell_id"].to_numpy()).all()  # every cell, in panel order
    m = params.robustness.m
    for i in range(0, len(cells), 7):
        allowed = tile != tile[i]
        so = np.sort(distance[i, allowed & (kind == kind[i]) & (section != section[i])])[:m]
        os_ = np.sort(distance[i, allowed & (kind != kind[i]) & (section == section[i])])[:m]
        if len(so) == m and len(os_) == m:
            assert chosen.at[i, "d_so"] == pytest.approx(so.mean(), abs=1e-5)
            assert chosen.at[i, "d_os"] == pytest.approx(os_.mean(), abs=1e-5)
        else:
            assert np.isnan(chosen.at[i, "d_so"]) and np.isnan(chosen.at[i, "margin"])


def test_low_margin_enrichment_and_shortcut(stage):
    reports = stage["reports"] / "robustness"
    enrichment = pd.read_csv(reports / "low_margin_enrichment.csv")
    assert set(enrichment["column"]) == {"cell_type", "organ", "section_id"}
    for _, part in enrichment.groupby(["readout", "scope", "unit", "column"]):
        assert part["share_low"].sum() == pytest.approx(1.0)
    shortcut = pd.read_csv(reports / "shortcut_summary.csv")
    assert set(shortcut["setting"]) == {"in_domain"}  # three sections: too few to hold one out here
    assert shortcut["nipd"].notna().all()
    assert (reports / "agreement.csv").is_file()
    curves = pd.read_csv(reports / "shortcut.csv")
    assert sorted(curves["cramers_v"].round(1).unique())[0] == 0.0
    metrics = json.loads((stage["reports"] / "robustness_metrics.json").read_text())
    assert metrics["magnification"] == "10x" and "filterbank-dense" in metrics
    # the report's names (LTM10, F(0), nIPD ...), not the code's (ltm, f0, nipd_in_domain)
    assert set(metrics["filterbank-dense"]) <= {"CRoMa median", "F(0)", "LTM10", "LTM10 n_tail", "RI", "MaRI",
                                                "k-NN BAcc biology", "k-NN BAcc confounder", "nIPD in domain",
                                                "nIPD held out"}
    # beside LTM, how many margins it averages: every one at or below its quantile, ties included
    on_disk = pd.read_csv(reports / "summary.csv")
    margins = pd.read_parquet(reports / "margins.parquet")
    assert list(on_disk.columns).index("n_tail") == list(on_disk.columns).index("ltm") + 1
    for row in on_disk.itertuples():
        mine = margins[(margins["readout"] == row.readout) & (margins["scope"] == row.scope)
                       & (margins["unit"] == row.unit)]["margin"]
        assert row.n_tail == int((mine <= row.q_alpha).sum()) >= 1
    assert "nIPD in domain" in metrics["filterbank-dense"]


def test_conditions_are_logged_to_mlflow_with_margins(stage):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{stage['tmp']}/mlflow.db")
    experiment = client.get_experiment_by_name("rob")
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if r.data.tags["cellpath.kind"] == "condition"]
    assert len(children) == len(stage["summary"])
    artifacts = [a.path for a in client.list_artifacts(children[0].info.run_id)]
    assert artifacts == ["margins.parquet"]
    for child in children:
        params, metrics = child.data.params, child.data.metrics
        assert {"croma_median", "f0", "ltm", "ri", "mari", "bio_bacc"} <= set(metrics)
        assert not {"m", "k", "magnification", "unit"} & set(metrics)  # settings are params, not metrics again
        name = child.info.run_name.split(" · ")[0]
        expected = [params["model"], params["magnification"], params["readout"], params["taxonomy"]]
        if params["scope"] != "panel":
            expected += [params["scope"], params["unit"]]
        assert name == " ".join(expected)  # no "panel panel"
    shortcut = pd.read_csv(stage["reports"] / "robustness" / "shortcut_summary.csv").set_index("setting")
    paired = [c for c in children if c.data.params["scope"] == "panel"
              and c.data.params["readout"] == shortcut["readout"].iloc[0]
              and c.data.params["taxonomy"] == shortcut["taxonomy"].iloc[0]]
    assert paired and all(c.data.metrics["nipd_in_domain"] == pytest.approx(shortcut.loc["in_domain", "nipd"])
                          and c.data.metrics["nipd_in_domain_low"] <= c.data.metrics["nipd_in_domain"]
                          for c in paired)
    assert not any("nipd_in_domain" in c.data.metrics for c in children if c not in paired)
    sampled = [c for c in children if "croma_median_low" in c.data.metrics]  # anchor-scored units carry intervals
    assert all(c.data.metrics["croma_median_low"] <= c.data.metrics["croma_median"] for c in sampled)


def test_patch_groups_match_the_extraction_tiling(tiny_features):
    from cellpath.features.encoders.registry import load_registry
    from cellpath.features.panel import load_panel_cells
    from helpers.project import PROJECT_ROOT

    spec = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")["filterbank-dense"]
    params = robustness_params(tiny_features["params"], tiny_features["root"], group="patch")
    panel = load_panel_cells(tiny_features["data_dir"], params.panel)
    groups = cell_groups(tiny_features["data_dir"], panel, spec, "10x", params.robustness)
    sidecar = json.loads((tiny_features["data_dir"] / "features" / "filterbank-dense" / "10x" / "breast_a"
                          / "sidecar.json").read_text())
    in_breast_a = panel.cells["section_id"].to_numpy() == "breast_a"
    assert len(set(groups[in_breast_a])) <= sidecar["n_patches"]
    assert all(g.startswith("breast_a:") for g in groups[in_breast_a])
    # Cells sharing a patch share its Mean readout exactly: the reason a patch is a group.
    from cellpath.features.panel import PanelFeatures, panel_matrix

    mean = panel_matrix(PanelFeatures(tiny_features["data_dir"] / "features", "filterbank-dense", "10x",
                                      panel).readout("Mean"))
    first = groups[0]
    same = np.flatnonzero(groups == first)
    assert len(same) > 1 and np.allclose(mean[same], mean[same[0]])


def test_organ_scope_needs_two_confounder_levels():
    cells = pd.DataFrame({"organ": ["A", "A", "B", "B"], "section_id": ["a1", "a2", "b1", "b1"]})
    assert [name for name, _ in scoring_units(cells, "organ", "section_id")] == ["A"]
    assert [name for name, _ in scoring_units(cells, "panel", "section_id")] == ["panel"]


def test_k_selected_is_each_models_own_k_and_the_shortcut_records_its_condition(stage, tiny_features):
    """``k_selected`` is the model's own k* (the first maximiser of its biological k-NN accuracy, as
    score_embeddings selects it alone), and the shortcut summary names its confounder and runs."""
    from cellpath.features.panel import PanelFeatures, load_panel_cells, panel_matrix
    from cellpath.robustness import score_embeddings

    params = stage["params"]
    summary = stage["summary"]
    panel = load_panel_cells(tiny_features["data_dir"], params.panel)
    row = summary[(summary["readout"] == "Nuc") & (summary["scope"] == "panel")].iloc[0]
    x = panel_matrix(PanelFeatures(tiny_features["data_dir"] / "features", "filterbank-dense", "10x",
                                   panel).readout("Nuc"))
    groups = cell_groups(tiny_features["data_dir"], panel, None, "10x", params.robustness)
    alone = score_embeddings(x, panel.cells["coarse"].to_numpy(), panel.cells["section_id"].to_numpy(), groups)
    assert row["k_selected"] == alone.k
    assert (summary["confounder"] == "section_id").all()
    shortcut = pd.read_csv(stage["reports"] / "robustness" / "shortcut_summary.csv")
    assert (shortcut[["confounder", "n_runs"]].drop_duplicates().values.tolist() == [["section_id", 2]])
    assert (shortcut["nipd_low"] <= shortcut["nipd"]).all() and (shortcut["nipd"] <= shortcut["nipd_high"]).all()


def test_models_scored_together_share_k_but_keep_their_own_k_star():
    """Three stand-in models whose own k* differ: RI/MaRI use the shared k (the lower median of the
    k*), while each row's k_selected is that model's own k* (before, the shared k was reported)."""
    from types import SimpleNamespace

    from cellpath.config import RobustnessConfig
    from cellpath.robustness import score_embeddings, shared_k
    from cellpath.robustness.panel import UnitData, score_models

    rng = np.random.default_rng(0)
    n = 240
    biology = np.repeat([0, 1, 2], n // 3)
    confounder = np.tile([0, 1], n // 2)
    groups = np.arange(n)
    specs, features = [], {}
    for i, noise in enumerate((0.3, 1.0, 2.5)):  # cleaner features → a smaller best k
        x = np.eye(3)[biology] * 2.0 + rng.normal(0, noise, (n, 3))
        x = np.concatenate([x, rng.normal(0, 1, (n, 5))], axis=1).astype(np.float32)
        specs.append(SimpleNamespace(slug=f"model-{i}"))
        features[f"model-{i}"] = x
    own = [score_embeddings(features[s.slug], biology, confounder, groups).k for s in specs]
    assert len(set(own)) > 1, own  # the case worth testing
    unit = UnitData({slug: ArrayRows(x) for slug, x in features.items()}, biology, confounder,
                     {s.slug: groups for s in specs}, None)
    scored = score_models(specs, unit, RobustnessConfig(confounder="section_id"))
    k = int(shared_k(own))
    assert [result.k for _, result, _, _ in scored] == [k, k, k]
    assert [own_k for _, _, own_k, _ in scored] == own


def test_a_unit_above_full_max_cells_is_scored_on_anchors_with_intervals(stage, tiny_features, tmp_path):
    """The panel unit (every evaluated cell) above ``full_max_cells``: 300 stratified anchors, each
    scored exactly as in the full run, with bootstrap intervals; the smaller organ unit stays full."""
    full = stage["summary"].set_index(["readout", "taxonomy", "scope", "unit"])
    n_panel = int(full.loc[("Nuc", "coarse", "panel", "panel"), "n_samples"])
    n_breast = int(full.loc[("Nuc", "coarse", "organ", "Breast"), "n_samples"])
    assert n_breast < n_panel
    params = robustness_params(tiny_features["params"], tmp_path, full_max_cells=max(100, n_breast), anchors=300,
                               bootstrap=100, sensitivity={"alphas": [], "m_max": None},
                               shortcut={"enabled": False})
    sampled = run_robustness_stage(params, tiny_features["data_dir"], tmp_path / "reports", root=tmp_path)
    sampled = sampled.set_index(["readout", "taxonomy", "scope", "unit"])
    panel, breast = sampled.loc[("Nuc", "coarse", "panel", "panel")], sampled.loc[("Nuc", "coarse", "organ", "Breast")]
    assert panel["n_samples"] == 300 and panel["n_cells"] == n_panel
    assert breast["n_samples"] == breast["n_cells"] == n_breast and np.isnan(breast["ri_low"])
    for name in ("croma_median", "f0", "ltm", "ri", "mari"):
        assert panel[f"{name}_low"] <= panel[name] <= panel[f"{name}_high"]
    assert breast["croma_median"] == full.loc[("Nuc", "coarse", "organ", "Breast"), "croma_median"]
    margins = pd.read_parquet(tmp_path / "reports" / "robustness" / "margins.parquet")
    chosen = margins[(margins["readout"] == "Nuc") & (margins["taxonomy"] == "coarse") & (margins["scope"] == "panel")]
    assert len(chosen) == 300 and chosen["cell_id"].is_unique
    every = pd.read_parquet(stage["reports"] / "robustness" / "margins.parquet")
    every = every[(every["readout"] == "Nuc") & (every["taxonomy"] == "coarse") & (every["scope"] == "panel")]
    exact = every.set_index(["section_id", "cell_id"])["margin"]
    np.testing.assert_allclose(chosen.set_index(["section_id", "cell_id"])["margin"],
                               exact.loc[chosen.set_index(["section_id", "cell_id"]).index], atol=1e-12)
