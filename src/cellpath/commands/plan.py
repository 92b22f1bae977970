"""``cellpath plan``: what a configuration implies, what it costs, and what it needs to finish in a week.

For the current params, the paper's configuration (``--preset paper``) or the placement
configuration (``--preset placement``: the paper's at its headline condition, priced beside the same
models' share of the paper's, with the ``dvc exp run -S`` arguments that run it): sections and cells,
patches and feature bytes per encoder and magnification, probe runs per protocol, and per stage
the core-hours (CPU), GPU-hours, the largest task's peak memory and the disk, from the cost model
stored with the code (``cellpath.runtime.costs``; measured by ``benchmarks/bench_scale.py``, not
by the last run), the workers of a given size that would finish it within a deadline and the days
on one GPU node (``--node-gpus``). The probe's L-BFGS iterations come from a pilot run on real
features (``--pilot``, or the project's own run table when ``source: 10x``), else from the cost
model's problems shaped like real features; the plan says which. ``--models`` prices one
encoder's share of the configuration (its extraction, its probe and robustness runs) instead of
all of them. Every number says where it came from (:mod:`cellpath.planning.workload`); a device the cost model has no
measurement for is reported as not measured, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

from cellpath.config import Params
from cellpath.io.layout import DEFAULT_REPORTS_DIR
from cellpath.planning.build import build_plan, placement_share
from cellpath.planning.render import render
from cellpath.runtime.costs import COSTS_PATH
from cellpath.vocabulary import PLACEMENT_ANCHORS


def run(params: Params, data_dir: Path, *, preset: str = "current", costs_path: Path = COSTS_PATH,
        worker_cores: int | None = None, worker_memory_gb: float | None = None, deadline_days: float = 7.0,
        as_json: bool = False, models: list[str] | None = None, node_gpus: int = 8,
        reports_dir: Path = DEFAULT_REPORTS_DIR, pilot: Path | None = None,
        anchors: list[str] | None = None) -> str:
    """The plan as a text table, or as JSON (``as_json``); workers default to this machine's size.
    ``models`` (registry slugs): only those encoders' share of the configuration; ``node_gpus``: the
    GPUs of the node whose days the plan prints; ``pilot``: a probe run table on real features to
    take the probe's iterations from (else the project's own when ``source: 10x``, else the cost
    model's, measured on problems shaped like real features); ``anchors``: with the placement preset,
    the paper's models run beside ``models`` (default: ``PLACEMENT_ANCHORS``; empty: none)."""
    options = {"costs_path": costs_path, "worker_cores": worker_cores, "worker_memory_gb": worker_memory_gb,
               "deadline_days": deadline_days, "node_gpus": node_gpus, "reports_dir": reports_dir, "pilot": pilot}
    anchors = PLACEMENT_ANCHORS if anchors is None else tuple(anchors)
    plan = build_plan(params, data_dir, preset=preset, models=models, anchors=anchors, **options)
    if preset == "placement":
        plan["placement"] = placement_share(plan, params, data_dir, anchors=anchors, **options)
    return json.dumps(plan, indent=2) if as_json else render(plan)
