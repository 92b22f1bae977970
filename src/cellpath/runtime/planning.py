"""Pricing a workload with the cost model: per stage and device the seconds, core-seconds, the largest
task's peak memory and the disk, and the workers that finish every stage within a deadline.

The workload is plain numbers (:class:`Workload`; ``cellpath.planning`` counts it from the params and
the data); the formulas are those of :mod:`cellpath.runtime.costs`. Units: seconds on one worker of
the calibration machine, bytes, core-hours. A device without measured costs gets no estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cellpath.runtime.costs import (CostModel, ExpressionCosts, ExtractCosts, Iterations, ProbeCosts, RobustnessCosts,
                                    SectionCosts, expression_heap_bytes, expression_seconds, extract_seconds,
                                    patch_gflop, probe_fit_seconds, probe_heap_bytes,
                                    robustness_heap_bytes, robustness_seconds, section_heap_bytes, section_seconds,
                                    workers_needed)

STAGES = ("ingest", "annotate", "concordance", "extract", "probe", "expression", "robustness")
PER_SECTION_STAGES = ("ingest", "annotate", "concordance")  # priced by SectionCosts alone; CPU stages
GPU_STAGES = ("extract", "probe", "expression", "robustness")  # the stages a GPU runs
DEVICES = ("cpu", "cuda")
EXTRACT_WORKING_BYTES = 2e9  # an extraction worker beyond the fp32 weights: batches, read-ahead (not measured)


@dataclass(frozen=True)
class ExtractJob:
    """One encoder's extraction over every magnification: its ViT shape (parameters, input and patch
    px, prefix tokens), the patches it reads and the feature bytes it writes."""

    encoder: str
    parameters: float
    input_size: int
    patch_size: int
    prefix_tokens: int
    patches: int
    disk_bytes: int
    precision: str = "fp32"  # the registry's autocast precision on a GPU (a CPU runs fp32)
    section_cells: tuple[int, ...] = ()  # cells of each (section, magnification) it reads


@dataclass(frozen=True)
class Workload:
    """What the heavy stages would do. ``probe_shapes``: rows of encoder, width, n_train, n_val,
    n_test, n_classes, row_bytes (working bytes of one training row), state_bytes (the part of them a
    streamed fit keeps for every row) and runs; ``robustness_units``: rows of
    encoder, width, n_cells and scorings. The rest are the params the formulas take."""

    extract: list[ExtractJob]
    probe_shapes: list[dict]
    robustness_units: list[dict]
    n_panel_cells: int
    probe_budget_mb: float  # a probe group's design held within it, else streamed (probing.fit.probe_budget_mb)
    c_grid_size: int
    full_max_cells: int
    anchors: int
    section_cells: list[int] = field(default_factory=list)  # cells of every section ingest, annotate, concordance read
    probe_group_mb: float | None = None  # tasks grouped within it (probing.fit.group_budget_mb); None: probe_budget_mb
    #: every expression design fit by shape: encoder, width (design columns), n_rows (train + val + test), fits
    expression_shapes: list[dict] = field(default_factory=list)
    expression_read_rows: int = 16384


def extract_estimate(costs: ExtractCosts, device: str, job: ExtractJob, reading: SectionCosts | None = None) -> dict:
    """One encoder's extraction: forward-pass seconds from its GFLOP per patch, plus — where measured
    (``reading``) — the work around it per section and magnification (reading the H&E, placing the
    cells, pooling, writing); peak memory: its fp32 weights plus the largest section's measured heap
    (else a working set not measured); its features as disk."""
    gflop = patch_gflop(job.parameters, job.input_size, job.patch_size, job.prefix_tokens)
    seconds = extract_seconds(costs, job.patches, gflop, job.precision, job.input_size)
    working = EXTRACT_WORKING_BYTES
    source = f"{gflop:.1f} GFLOP per patch; {costs.source}"
    if reading is not None and job.section_cells:
        seconds += sum(section_seconds(reading, cells) for cells in job.section_cells)
        working = max(section_heap_bytes(reading, cells) for cells in job.section_cells)
        source += f"; reading, placing and writing per section: {reading.source}"
    return {"stage": "extract", "what": job.encoder, "device": device, "units": job.patches, "unit": "patch",
            "seconds": seconds, "core_seconds": seconds * costs.cores,
            "peak_memory_bytes": job.parameters * 4 + working, "disk_bytes": job.disk_bytes, "source": source}


def section_estimate(costs: SectionCosts, device: str, stage: str, section_cells: list[int]) -> dict:
    """A per-section stage over every section: the sum of their seconds, the largest one's peak RSS."""
    seconds = sum(section_seconds(costs, cells) for cells in section_cells)
    return {"stage": stage, "what": "every section", "device": device, "units": len(section_cells),
            "unit": "section", "seconds": seconds, "core_seconds": seconds * costs.cores,
            "peak_memory_bytes": section_heap_bytes(costs, max(section_cells)), "disk_bytes": None,
            "source": costs.source}


def probe_estimate(costs: ProbeCosts, device: str, work: Workload, iterations: Iterations | None = None) -> dict:
    """Every fitted probe run, one core each, at the iterations of a run's slowest C for its training
    size (``iterations``, else the cost model's) and their p25–p75 range (every C of a run iterates
    together)."""
    table = iterations or costs.iterations
    totals = [sum(row["runs"] * probe_fit_seconds(
        costs, n_train=row["n_train"], n_val=row["n_val"], n_test=row["n_test"], width=row["width"],
        row_bytes=row["row_bytes"], iterations=table.at(row["n_train"])[column], budget_mb=work.probe_budget_mb)
        for row in work.probe_shapes) for column in range(3)]
    return {"stage": "probe", "what": "every fitted run", "device": device,
            "units": sum(row["runs"] for row in work.probe_shapes), "unit": "run", "seconds": totals[0],
            "core_seconds": totals[0], "core_seconds_range": totals[1:],
            "peak_memory_bytes": max(probe_heap_bytes(costs, work.n_panel_cells, work.probe_budget_mb,
                                                      n_train=row["n_train"], row_bytes=row["row_bytes"],
                                                      state_bytes=row["state_bytes"], tasks=row["runs"],
                                                      group_mb=work.probe_group_mb)
                                     for row in work.probe_shapes),
            "disk_bytes": None,
            "source": f"{table.describe()} (its {work.c_grid_size} Cs together); {costs.source}"}


def expression_estimate(costs: ExpressionCosts, device: str, work: Workload) -> dict:
    """Every expression run's three ridge fits (features, type, type + features), on the worker's cores;
    peak memory: the widest design's (:func:`expression_heap_bytes`)."""
    seconds = sum(row["fits"] * expression_seconds(costs, row["n_rows"], row["width"]) for row in work.expression_shapes)
    widest = max(row["width"] for row in work.expression_shapes)
    return {"stage": "expression", "what": "every ridge fit", "device": device,
            "units": sum(row["fits"] for row in work.expression_shapes), "unit": "fit", "seconds": seconds,
            "core_seconds": seconds * costs.cores,
            "peak_memory_bytes": expression_heap_bytes(widest, work.expression_read_rows), "disk_bytes": None,
            "source": costs.source}


def robustness_estimate(costs: RobustnessCosts, device: str, work: Workload) -> dict:
    """Every robustness scoring; peak memory of the unit with the most cells × width."""
    limits = {"full_max_cells": work.full_max_cells, "anchors": work.anchors}
    seconds = sum(row["scorings"] * robustness_seconds(costs, row["n_cells"], row["width"], **limits)
                  for row in work.robustness_units)
    largest = max(work.robustness_units, key=lambda row: row["n_cells"] * row["width"])
    return {"stage": "robustness", "what": "every scoring", "device": device,
            "units": sum(row["scorings"] for row in work.robustness_units), "unit": "scoring",
            "seconds": seconds, "core_seconds": seconds * costs.cores,
            "peak_memory_bytes": robustness_heap_bytes(costs, largest["n_cells"], largest["width"], **limits),
            "disk_bytes": None, "source": costs.source}


def stage_estimates(model: CostModel, work: Workload, iterations: Iterations | None = None) -> list[dict]:
    """Per device the cost model measured, the estimates of every stage it has costs for (extract:
    one per encoder): seconds on one calibration worker, core-seconds, the largest task's peak memory
    (bytes) and the disk written (bytes; None: tables only). ``iterations``: a pilot's, for the
    probe on every device (else each device's own)."""
    out = []
    for device in sorted(model.devices):
        costs = model.costs(device)
        sections = costs.sections or {}
        if work.section_cells:
            out += [section_estimate(sections[stage], device, stage, work.section_cells)
                    for stage in PER_SECTION_STAGES if stage in sections]
        if costs.extract is not None:
            out += [extract_estimate(costs.extract, device, job, sections.get("extract")) for job in work.extract]
        if costs.probe is not None and work.probe_shapes:
            out.append(probe_estimate(costs.probe, device, work, iterations))
        if costs.expression is not None and work.expression_shapes:
            out.append(expression_estimate(costs.expression, device, work))
        if costs.robustness is not None and work.robustness_units:
            out.append(robustness_estimate(costs.robustness, device, work))
    return out


def not_estimated(estimates: list[dict]) -> dict[str, list[str]]:
    """Per stage, the devices without an estimate (not measured, so not guessed); the per-section
    stages run on CPUs only."""
    return {stage: [d for d in (DEVICES if stage in GPU_STAGES else ("cpu",))
                    if not any(e["stage"] == stage and e["device"] == d for e in estimates)]
            for stage in STAGES}


def week_plan(estimates: list[dict], worker_cores: int, worker_memory_bytes: float,
              deadline_seconds: float) -> list[dict]:
    """Per stage on the CPU: workers of ``worker_cores`` cores to finish within the deadline (ideal
    packing, a lower bound), and whether the stage's largest task fits a worker's memory."""
    rows = []
    for stage in STAGES:
        parts = [e for e in estimates if e["stage"] == stage and e["device"] == "cpu"]
        if parts:
            core_seconds = sum(e["core_seconds"] for e in parts)
            peak = max(e["peak_memory_bytes"] for e in parts)
            rows.append({"stage": stage, "core_hours": core_seconds / 3600,
                         "workers": workers_needed(core_seconds, worker_cores, deadline_seconds),
                         "largest_task_bytes": peak, "fits_worker": peak <= worker_memory_bytes})
    return rows


def week_summary(estimates: list[dict], worker_cores: int, worker_memory_bytes: float, deadline_days: float) -> dict:
    """:func:`week_plan` per stage and in all: core-hours and workers to finish every stage within
    ``deadline_days`` days on workers of ``worker_cores`` cores and ``worker_memory_bytes`` bytes."""
    week = week_plan(estimates, worker_cores, worker_memory_bytes, deadline_days * 86400)
    core_hours = sum(row["core_hours"] for row in week)
    return {"deadline_days": deadline_days, "worker_cores": worker_cores, "worker_memory_bytes": worker_memory_bytes,
            "core_hours": core_hours, "workers": workers_needed(core_hours * 3600, worker_cores, deadline_days * 86400),
            "stages": week}


def gpu_node_summary(estimates: list[dict], node_gpus: int) -> dict:
    """Per GPU stage priced on ``cuda``: GPU-hours, and the days one node of ``node_gpus`` GPUs takes for
    them (GPU-hours / node_gpus / 24: ideal packing, so a lower bound); in all over those stages, with
    the stages that have no ``cuda`` cost and the cost model's sources of the figures."""
    rows = []
    for stage in GPU_STAGES:
        parts = [e for e in estimates if e["stage"] == stage and e["device"] == "cuda"]
        if parts:
            hours = sum(e["seconds"] for e in parts) / 3600
            sources = {e["source"].split("; ", 1)[1] if stage == "extract" else e["source"] for e in parts}
            rows.append({"stage": stage, "gpu_hours": hours, "days": hours / node_gpus / 24,
                         "sources": sorted(sources)})
    hours = sum(row["gpu_hours"] for row in rows)
    return {"node_gpus": node_gpus, "stages": rows, "gpu_hours": hours, "days": hours / node_gpus / 24,
            "not_measured": [stage for stage in GPU_STAGES if stage not in {row["stage"] for row in rows}]}


def this_machine() -> dict:
    """This machine's size: ``cpus``, ``gpus`` (CUDA devices) and ``memory_bytes`` (physical memory)."""
    import torch

    return {"cpus": os.cpu_count(), "gpus": torch.cuda.device_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
