"""The whole plan of a configuration: its workload (:mod:`cellpath.planning.workload`) priced with the
cost model (:mod:`cellpath.runtime.planning`), as one JSON-serialisable dict.

For the current params, or the paper's configuration (``preset="paper"``: its run count is derived
with ``count_runs`` on the 25 sections of the manifest and compared with Table 3). Data in the data
folder is used only for the current params.
"""

from __future__ import annotations

from pathlib import Path

from cellpath.config import Params
from cellpath.features.encoders.registry import selected_encoders
from cellpath.features.panel import load_panel_cells
from cellpath.io.layout import panels_csv
from cellpath.planning.paper import paper_comparison, paper_params
from cellpath.planning.workload import (extract_jobs, extracted_sections, feature_rows, panel_summary,
                                        patch_cache_bytes, probe_counts, probe_workload, robustness_workload)
from cellpath.runtime.costs import COSTS_PATH, load_costs
from cellpath.runtime.planning import Workload, not_estimated, stage_estimates, this_machine, week_summary


def build_plan(params: Params, data_dir: Path, preset: str = "current", *,
               costs_path: Path = COSTS_PATH, worker_cores: int | None = None, worker_memory_gb: float | None = None,
               deadline_days: float = 7.0) -> dict:
    """The plan: panel, features, probe runs, per-stage estimates and the workers to finish within
    ``deadline_days`` days. Workers default to this machine's size (cores, memory in GB)."""
    if preset == "paper":
        params = paper_params(params)
    data_dir = Path(data_dir)
    model = load_costs(costs_path)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    magnifications = list(params.extract.magnifications)
    evaluated = None
    if preset == "current" and panels_csv(data_dir).is_file():
        evaluated = load_panel_cells(data_dir, params.panel).cells
    panel = panel_summary(params, data_dir, preset, evaluated)
    sections = panel["sections"] if evaluated is None else extracted_sections(data_dir)
    features = feature_rows(encoders, magnifications, data_dir if preset == "current" else None, sections,
                            model.costs("cpu").extract)
    probe = probe_counts(params, encoders, magnifications, panel, evaluated)
    if preset == "paper":
        probe["paper"] = paper_comparison({p: row["runs"] for p, row in probe["protocols"].items()},
                                          probe["total"]["runs"])
    work = Workload(
        extract=extract_jobs(encoders, features),
        probe_shapes=probe_workload(params, encoders, params.stage_magnifications(params.probe.magnifications),
                                    panel, evaluated),
        robustness_units=robustness_workload(params, encoders, panel),
        n_panel_cells=panel["evaluated_cells"] or int(sum(s["cells"] for s in panel["sections"])),
        probe_budget_mb=params.probe.batch_memory_mb, c_grid_size=len(params.probe.c_grid),
        full_max_cells=params.robustness.full_max_cells, anchors=params.robustness.anchors)
    estimates = stage_estimates(model, work)
    machine = this_machine()
    worker_memory = worker_memory_gb * 1e9 if worker_memory_gb else machine["memory_bytes"]
    return {"preset": preset, "hardware": {"cpus": machine["cpus"], "gpus": machine["gpus"]},
            "panel": {**panel, "sections": len(panel["sections"]),
                      "organs": len({s["organ"] for s in panel["sections"]}),
                      "cells": int(sum(s["cells"] for s in panel["sections"]))},
            "encoders": len(encoders), "magnifications": magnifications, "features": features,
            "patch_cache_bytes": patch_cache_bytes(encoders, features) if params.extract.patch_cache else 0,
            "probe": probe,
            "cost_model": {"path": str(costs_path), "machine": model.machine, "devices": sorted(model.devices)},
            "estimates": estimates, "not_estimated": not_estimated(estimates),
            "week": week_summary(estimates, worker_cores or machine["cpus"] or 1, worker_memory, deadline_days)}
