"""The whole plan of a configuration: its workload (:mod:`cellpath.planning.workload`) priced with the
cost model (:mod:`cellpath.runtime.planning`), as one JSON-serialisable dict.

For the current params, or the paper's configuration (``preset="paper"``: its run count is derived
with ``count_runs`` on the 25 sections of the manifest and compared with Table 3). Data in the data
folder is used only for the current params. With ``models``, the plan is one encoder's (or a few
encoders') share of that configuration: the same panel and protocols, their runs only.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import ConfigError
from cellpath.features.encoders.registry import EncoderSpec, selected_encoders
from cellpath.features.panel import load_panel_cells
from cellpath.io.layout import DEFAULT_REPORTS_DIR, panels_csv, probe_runs_parquet, raw_dir
from cellpath.planning.disk import disk_plan, folder_raw_bytes, manifest_raw_bytes, project_cache_type
from cellpath.planning.paper import (overrides, paper_comparison, paper_params, placement_encoders,
                                     placement_params)
from cellpath.planning.workload import (expression_workload, extract_jobs, extracted_sections, feature_rows,
                                        panel_summary, patch_cache_bytes, probe_counts, probe_workload,
                                        robustness_workload, staged_sections)
from cellpath.probing.fit import group_budget_mb, probe_budget_mb
from cellpath.runtime.costs import COSTS_PATH, Iterations, load_costs, pilot_iterations
from cellpath.runtime.planning import (Workload, gpu_node_summary, not_estimated, stage_estimates, this_machine,
                                       week_summary)
from cellpath.vocabulary import PAPER_PANEL_PRESETS, PLACEMENT_ANCHORS


def chosen_encoders(encoders: list[EncoderSpec], models: list[str] | None, preset: str) -> list[EncoderSpec]:
    """The configuration's encoders, or only those named by ``models`` (slugs, in the configuration's
    order); an unknown slug raises a ConfigError listing the configuration's slugs."""
    if not models:
        return encoders
    known = [spec.slug for spec in encoders]
    unknown = [slug for slug in models if slug not in known]
    if unknown:
        close = [match for slug in unknown for match in difflib.get_close_matches(slug, known, n=1, cutoff=0.6)]
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"--models: no encoder {', '.join(repr(s) for s in unknown)} in the {preset} "
                          f"configuration{hint}; its {len(known)} slugs: {', '.join(known)}")
    return [spec for spec in encoders if spec.slug in models]


def pilot_iterations_for(params: Params, reports_dir: Path, pilot: Path | None) -> Iterations | None:
    """The probe iterations a plan takes from a pilot run on real features: the run table ``pilot``
    (``--pilot``), else the project's own (``reports/probe/runs.parquet``) when its sections are
    real (``source: 10x``) and it has one; None: the cost model's, measured on problems shaped like
    real features (``benchmarks/bench_real_shaped.py``), never the simulated default."""
    path = pilot if pilot is not None else probe_runs_parquet(reports_dir) if params.source == "10x" else None
    if path is None or (pilot is None and not path.is_file()):
        return None
    needed = ["status", "n_train", "lbfgs_iterations", "converged"]
    try:
        runs = pd.read_parquet(path, columns=needed)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{path}: not a probe run table with columns {', '.join(needed)} ({error}); give "
                          "--pilot the reports/probe/runs.parquet of a probe run on real features") from error
    fitted = runs[(runs["status"] == "ok") & runs["converged"].fillna(False).astype(bool)]
    return pilot_iterations(fitted["n_train"].astype(int).tolist(), fitted["lbfgs_iterations"].astype(int).tolist(),
                            str(path))


def raw_bytes(params: Params, data_dir: Path, preset: str, section_ids: list[str]) -> dict:
    """The raw downloads of the sections: on disk where they were fetched, else the manifest's file
    sizes (the paper's panel, or ``source: 10x``); simulated sections not yet written are unknown."""
    if preset == "current" and raw_dir(data_dir).is_dir():
        return folder_raw_bytes(raw_dir(data_dir), section_ids)
    if preset in PAPER_PANEL_PRESETS or params.source == "10x":
        return manifest_raw_bytes(params.tenx.manifest, section_ids)
    return {"bytes": 0, "known_sections": 0, "sections": len(section_ids), "source": "not fetched yet"}


def staged_summary(staged: dict) -> dict:
    """The sections ingest, annotate and concordance read: how many, their cells, the largest, the source."""
    cells = staged["cells"]
    return {"sections": len(cells), "cells": int(sum(cells)), "largest": max(cells, default=0),
            "source": staged["source"]}


def preset_params(params: Params, preset: str, models: list[str] | None,
                  anchors: tuple[str, ...] | list[str] = PLACEMENT_ANCHORS) -> Params:
    """The configuration a preset plans: the params as they are, the paper's, or the placement of
    ``models`` beside the ``anchors``."""
    if preset == "paper":
        return paper_params(params)
    return placement_params(params, models, anchors) if preset == "placement" else params


def build_plan(params: Params, data_dir: Path, preset: str = "current", *,
               costs_path: Path = COSTS_PATH, worker_cores: int | None = None, worker_memory_gb: float | None = None,
               deadline_days: float = 7.0, models: list[str] | None = None, node_gpus: int = 8,
               reports_dir: Path = DEFAULT_REPORTS_DIR, pilot: Path | None = None,
               anchors: tuple[str, ...] | list[str] = PLACEMENT_ANCHORS) -> dict:
    """The plan: panel, features, probe runs, per-stage estimates, the disk per place and DVC's time on
    the features, the workers to finish within ``deadline_days`` days and the days on one node of
    ``node_gpus`` GPUs. Workers default to this machine's size (cores, memory in GB). ``models``
    (slugs): only those encoders' share of the configuration: their extraction and their probe and
    robustness runs, on the same panel (placement: with the ``anchors``). The probe's iterations:
    :func:`pilot_iterations_for`, else the cost model's."""
    iterations = pilot_iterations_for(params, reports_dir, pilot)  # the project's own sections decide
    params = preset_params(params, preset, models, anchors)
    models = placement_encoders(models, anchors) if preset == "placement" and models else models
    data_dir, model = Path(data_dir), load_costs(costs_path)
    configured = selected_encoders(params.extract.registry, params.extract.encoders)
    encoders = chosen_encoders(configured, models, preset)
    magnifications = list(params.extract.magnifications)
    current_panel = preset == "current" and panels_csv(data_dir).is_file()
    evaluated = load_panel_cells(data_dir, params.panel).cells if current_panel else None
    panel = panel_summary(params, data_dir, preset, evaluated)
    sections = panel["sections"] if evaluated is None else extracted_sections(data_dir)
    features = feature_rows(encoders, magnifications, data_dir if preset == "current" else None, sections,
                            model.costs("cpu").extract)
    probe = probe_counts(params, encoders, magnifications, panel, evaluated)
    machine = this_machine()
    worker_memory = (worker_memory_gb * 1e9) if worker_memory_gb else machine["memory_bytes"]
    if preset == "paper" and len(encoders) == len(configured):
        probe["paper"] = paper_comparison({p: row["runs"] for p, row in probe["protocols"].items()},
                                          probe["total"]["runs"])
    staged = staged_sections(params, data_dir, preset)
    work = _workload(params, encoders, features, sections, magnifications, panel, evaluated, staged["cells"],
                     worker_memory)
    estimates = stage_estimates(model, work, iterations)
    raw = raw_bytes(params, data_dir, preset, [s["section_id"] for s in sections])
    patch_bytes = patch_cache_bytes(encoders, features) if params.extract.patch_cache else 0
    return {"preset": preset, "models": [spec.slug for spec in encoders] if models else None,
            "configured_encoders": len(configured),
            "hardware": {"cpus": machine["cpus"], "gpus": machine["gpus"]},
            "panel": {**panel, "sections": len(panel["sections"]),
                      "organs": len({s["organ"] for s in panel["sections"]}),
                      "cells": int(sum(s["cells"] for s in panel["sections"]))},
            "staged_sections": staged_summary(staged),
            "encoders": len(encoders), "magnifications": magnifications, "features": features,
            "patch_cache_bytes": patch_bytes,
            "disk": disk_plan(sum(row["bytes"] for row in features), patch_bytes, raw, model.storage,
                              project_cache_type()),
            "probe": probe,
            "cost_model": {"path": str(costs_path), "machine": model.machine, "devices": sorted(model.devices)},
            "estimates": estimates, "not_estimated": not_estimated(estimates),
            "week": week_summary(estimates, worker_cores or machine["cpus"] or 1, worker_memory, deadline_days),
            "gpu_node": gpu_node_summary(estimates, node_gpus)}


def _workload(params: Params, encoders: list[EncoderSpec], features: list[dict], sections: list[dict],
              magnifications: list[str], panel: dict, evaluated: pd.DataFrame | None, section_cells: list[int],
              worker_memory: float) -> Workload:
    """What the heavy stages would do, as plain numbers for the cost model."""
    return Workload(
        extract=extract_jobs(encoders, features, sections, magnifications),
        probe_shapes=probe_workload(params, encoders, params.stage_magnifications(params.probe.magnifications),
                                    panel, evaluated),
        robustness_units=robustness_workload(params, encoders, panel),
        n_panel_cells=panel["evaluated_cells"] or int(sum(s["cells"] for s in panel["sections"])),
        probe_budget_mb=probe_budget_mb(params.probe.batch_memory_mb, worker_memory),
        c_grid_size=len(params.probe.c_grid),
        full_max_cells=params.robustness.full_max_cells, anchors=params.robustness.anchors,
        section_cells=section_cells, probe_group_mb=group_budget_mb(params.probe.batch_memory_mb),
        expression_shapes=expression_workload(params, encoders, panel, evaluated),
        expression_read_rows=params.expression.read_rows)


def stage_hours(estimates: list[dict]) -> dict:
    """Per stage, CPU core-hours and GPU-hours (where the cost model has a cuda entry), and their totals."""
    cpu = {e["stage"]: 0.0 for e in estimates if e["device"] == "cpu"}
    gpu = {e["stage"]: 0.0 for e in estimates if e["device"] == "cuda"}
    for e in estimates:
        if e["device"] == "cpu":
            cpu[e["stage"]] += e["core_seconds"] / 3600
        else:
            gpu[e["stage"]] += e["seconds"] / 3600
    return {"cpu_core_hours": cpu, "cpu_total": sum(cpu.values()), "gpu_hours": gpu, "gpu_total": sum(gpu.values())}


def placement_share(plan: dict, params: Params, data_dir: Path,
                    anchors: tuple[str, ...] | list[str] = PLACEMENT_ANCHORS, **options) -> dict:
    """Beside a placement plan (``plan``, built from ``params`` with ``preset="placement"``): its
    hours per stage, the same models' share of the paper's configuration from the same cost model,
    the placement's fraction of it (CPU core-hours; GPU-hours where priced) and the ``dvc exp run
    -S`` arguments that turn ``params`` into the placement configuration (the ``anchors`` included)."""
    models = plan["models"] or placement_encoders([spec.slug for spec in selected_encoders(
        params.extract.registry, params.extract.encoders)], anchors)
    paper = build_plan(params, data_dir, preset="paper", models=models, **options)
    ours, theirs = stage_hours(plan["estimates"]), stage_hours(paper["estimates"])
    return {"models": models, "placement": ours, "paper": theirs,
            "cpu_fraction": ours["cpu_total"] / theirs["cpu_total"] if theirs["cpu_total"] else None,
            "gpu_fraction": ours["gpu_total"] / theirs["gpu_total"] if theirs["gpu_total"] else None,
            "overrides": overrides(params, placement_params(params, models, anchors))}
