"""``cellpath plan``: what a configuration implies, what it costs, and what it needs to finish in a week.

For the current params, or the paper's configuration (``--preset paper``): sections and cells,
patches and feature bytes per encoder and magnification, probe runs per protocol, and per stage
the core-hours (CPU), GPU-hours, the largest task's peak memory and the disk, from the cost model
stored with the code (``cellpath.runtime.costs``; measured by ``benchmarks/bench_scale.py``, not
by the last run), and the workers of a given size that would finish it within a deadline. Every
number says where it came from: the data folder (feature sidecars, ``probing.plan.plan_runs`` on
the panel's cells), the params (``count_runs`` / ``split_sizes`` where no data exists) or the cost
model; a device the cost model has no measurement for is reported as not measured, never guessed.
The paper preset's run count is derived (``count_runs`` on the 25 sections of the manifest) and
compared with the paper's Table 3.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from cellpath.config import Params, parse_params
from cellpath.features.encoders.registry import EncoderSpec, load_registry, selected_encoders
from cellpath.features.readouts import readout_available
from cellpath.io.layout import features_dir, panels_csv, section_index_csv
from cellpath.probing.fit import design_row_bytes
from cellpath.probing.plan import count_runs
from cellpath.published.reference import (PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS, PAPER_MOCV_FOLDS, PAPER_PANEL,
                                         PAPER_PANEL_SIZES, PAPER_SEEDS)
from cellpath.runtime.costs import (COSTS_PATH, CostModel, ExtractCosts, extract_patches, extract_seconds,
                                    feature_bytes, load_costs, parameter_count, patch_gflop, probe_fit_seconds,
                                    probe_heap_bytes, robustness_heap_bytes, robustness_seconds, workers_needed)
from cellpath.vocabulary import CLS_READOUTS, MAGNIFICATIONS, READOUTS

PAPER_TABLE_3 = {"is": 157_500, "iocd": 86_940, "mocv": 18_900, "looo": 41_580}  # CellPath-Bench, Table 3
PAPER_RUNS = 304_920
EXTRACT_WORKING_BYTES = 2e9  # an extraction worker beyond the fp32 weights: batches, read-ahead (not measured)
STAGES = ("extract", "probe", "robustness")


def paper_params(params: Params) -> Params:
    """``params`` with the paper's values (those params.yaml gives in its comments, and Table 3)."""
    data = params.model_dump(mode="json")
    registry = load_registry(params.extract.registry)
    data["extract"].update(encoders=[s.slug for s in registry.values() if s.type != "control"],
                           magnifications=list(MAGNIFICATIONS))
    data["concordance"]["panel_sizes"] = list(PAPER_PANEL_SIZES)
    data.update(panel=PAPER_PANEL, protocol="all", source="10x")
    data["probe"].update(taxonomies=["fine", "coarse"], readouts=list(READOUTS), magnifications=None,
                         seeds=dict(PAPER_SEEDS), mocv_folds=PAPER_MOCV_FOLDS, max_train_cells=None,
                         min_train_cells=dict(PAPER_MIN_TRAIN_CELLS), min_test_cells=dict(PAPER_MIN_TEST_CELLS))
    data["robustness"].update(taxonomies=["fine", "coarse"], magnifications=None)
    data["robustness"]["shortcut"]["n_runs"] = 20
    return parse_params(data)


def panel_summary(params: Params, data_dir: Path, preset: str, evaluated: pd.DataFrame | None) -> dict:
    """Sections (section_id, organ, cells) the configuration evaluates, and where they came from."""
    if preset == "paper":
        manifest = pd.read_csv(params.tenx.manifest)
        chosen = manifest[manifest["panel_s25"] == 1]
        return {"name": params.panel, "sections": chosen[["section_id", "organ", "cells"]].to_dict("records"),
                "evaluated_cells": None, "source": f"{params.tenx.manifest} (panel_s25; all cells, labels unknown)"}
    if evaluated is not None:
        from cellpath.features.panel import panel_sections

        index = pd.read_csv(section_index_csv(data_dir)).set_index("section_id")
        chosen = panel_sections(data_dir, params.panel)
        rows = [{"section_id": s, "organ": o, "cells": int(index.loc[s, "n_cells"])}
                for s, o in zip(chosen["section_id"], chosen["organ"])]
        return {"name": params.panel, "sections": rows, "evaluated_cells": len(evaluated),
                "source": f"{data_dir}/panels.csv, sections/sections.csv, labels/"}
    sections = params.synthetic.sections
    rows = [{"section_id": s.section_id, "organ": s.organ, "cells": s.n_cells or params.synthetic.cells_per_section}
            for s in sections]
    return {"name": params.panel, "sections": rows, "evaluated_cells": None,
            "source": "params.yaml synthetic.sections (no data yet: every configured section, not the panel)"}


def feature_rows(encoders: list[EncoderSpec], magnifications: list[str], data_dir: Path | None,
                 sections: list[dict], extract_costs: ExtractCosts | None) -> list[dict]:
    """Per encoder and magnification: cells, patches and feature bytes — measured where data exists,
    else patches from the section tables or, without them, from the cost model's patches per cell."""
    from cellpath.features.store import artifact_dir, read_sidecar

    rows = []
    for spec in encoders:
        n_readouts = 3 if spec.has_cls else 2
        for magnification in magnifications:
            cells = sum(s["cells"] for s in sections)
            folders = [] if data_dir is None else [artifact_dir(features_dir(data_dir), spec.slug, magnification,
                                                                s["section_id"]) for s in sections]
            sidecars = [read_sidecar(folder) for folder in folders]
            if folders and all(sidecars):
                patches = sum(int(s["n_patches"]) for s in sidecars)
                size = sum(p.stat().st_size for folder in folders for p in folder.iterdir() if p.is_file())
                source = "measured (feature sidecars and files)"
            else:
                patches = _patches_from_tables(data_dir, spec, magnification, sections)
                how = "from the section tables"
                if patches is None and extract_costs is not None:
                    patches = round(extract_patches(extract_costs, cells, magnification, spec.input_size))
                    how = "from the cost model's patches per cell (simulated tissue density)"
                size = feature_bytes(cells, spec.embed_dim, n_readouts)
                source = ("estimated: float16 " + ("Nuc, Mean, Cls" if spec.has_cls else "Nuc, Mean") + "; patches "
                          + (how if patches is not None else "need the slides"))
            rows.append({"encoder": spec.slug, "magnification": magnification, "sections": len(sections),
                         "cells": cells, "patches": patches, "bytes": size, "source": source})
    return rows


def _patches_from_tables(data_dir: Path | None, spec: EncoderSpec, magnification: str,
                         sections: list[dict]) -> int | None:
    """Patches the extraction's tiling would read, from the ingested section tables (None without them)."""
    if data_dir is None or not section_index_csv(data_dir).is_file():
        return None
    index_path = section_index_csv(data_dir)
    from cellpath.features.tiling import place_section_cells
    from cellpath.io.sections import read_section_obs
    from cellpath.vocabulary import MAGNIFICATION_MPP

    index = pd.read_csv(index_path).set_index("section_id")
    total = 0
    for section in sections:
        if section["section_id"] not in index.index:
            return None
        row = index.loc[section["section_id"]]
        obs = read_section_obs(data_dir, section["section_id"])
        placement = place_section_cells(obs, row, target_mpp=MAGNIFICATION_MPP[magnification],
                                        input_size=spec.input_size)
        total += len(set(placement.patch_index))
    return total


def probe_counts(params: Params, encoders: list[EncoderSpec], magnifications: list[str], panel: dict,
                 evaluated: pd.DataFrame | None, preset: str) -> dict:
    """Runs per protocol: all, unavailable (no CLS token), and — from the planned splits where the
    panel's cells exist — skipped (fewer than two gated classes) and fitted."""
    cfg = params.probe
    readouts = list(cfg.readouts)
    has_cls = [spec.has_cls for spec in encoders]
    n_cls = sum(r in CLS_READOUTS for r in readouts)
    usable = sum(len(readouts) - (0 if cls else n_cls) for cls in has_cls) * len(magnifications)
    rows: dict[str, dict] = {}
    if evaluated is not None:
        from cellpath.probing.plan import plan_runs

        for protocol in params.protocols:
            planned = [run for taxonomy in cfg.taxonomies for run in plan_runs(evaluated, protocol, taxonomy, cfg)]
            per_condition = len(planned)
            skipped = sum(run.task is None for run in planned)
            runs = len(encoders) * len(readouts) * len(magnifications) * per_condition
            rows[protocol] = {"units": len({run.unit for run in planned}), "seeds": cfg.seeds[protocol], "runs": runs,
                              "unavailable": runs - usable * per_condition, "skipped": usable * skipped,
                              "fitted": usable * (per_condition - skipped)}
        source = "probing.plan_runs on the panel's cells (class gates applied)"
    else:
        sections = pd.DataFrame(panel["sections"])
        counted = count_runs(sections, models_with_cls=has_cls, n_magnifications=len(magnifications),
                             n_taxonomies=len(cfg.taxonomies), readouts=tuple(readouts), seeds=cfg.seeds,
                             protocols=params.protocols, n_folds=cfg.mocv_folds)
        for protocol in params.protocols:
            rows[protocol] = {"units": counted.units[protocol], "seeds": cfg.seeds[protocol],
                              "runs": counted.runs[protocol], "unavailable": counted.unavailable[protocol],
                              "skipped": None, "fitted": None}
        source = "probing.plan.count_runs on the section list (class gates need the labels: skipped runs unknown)"
    total = {key: (None if any(r[key] is None for r in rows.values()) else sum(r[key] for r in rows.values()))
             for key in ("runs", "unavailable", "skipped", "fitted")}
    out = {"protocols": rows, "total": total, "source": source}
    if preset == "paper":
        out["paper"] = {"table_3": PAPER_TABLE_3, "total": PAPER_RUNS,
                        "matches": total["runs"] == PAPER_RUNS
                        and all(rows[p]["runs"] == n for p, n in PAPER_TABLE_3.items())}
    return out


def probe_workload(params: Params, encoders: list[EncoderSpec], magnifications: list[str], panel: dict,
                   evaluated: pd.DataFrame | None) -> list[dict]:
    """Every fitted probe run by shape (encoder, width, n_train, n_val, n_test, n_classes) with its
    ``runs`` count. From the planned tasks where the panel's cells exist (class gates applied);
    else from the section list (``split_sizes``: every cell and every class of the taxonomy, so
    upper bounds)."""
    from cellpath.annotation.ontology import COARSE_CLASSES, FINE_CLASSES
    from cellpath.features.readouts import readout_width
    from cellpath.probing.plan import plan_runs, split_sizes

    cfg = params.probe
    shapes: dict[tuple, int] = {}
    for taxonomy in cfg.taxonomies:
        for protocol in params.protocols:
            if evaluated is not None:
                tasks = [(len(r.task.train), len(r.task.val), len(r.task.test), len(r.task.classes))
                         for r in plan_runs(evaluated, protocol, taxonomy, cfg) if r.task is not None]
            else:
                sizes = split_sizes(pd.DataFrame(panel["sections"]), protocol, n_folds=cfg.mocv_folds,
                                    roi_fraction=cfg.is_roi_fraction, val_fraction=cfg.val_fraction)
                n_classes = len(FINE_CLASSES if taxonomy == "fine" else COARSE_CLASSES)
                tasks = [(s.n_train, s.n_val, s.n_test, n_classes)
                         for s in sizes for _ in range(cfg.seeds[protocol])]
            for spec in encoders:
                for readout in cfg.readouts:
                    if not readout_available(spec, readout):
                        continue
                    for task in tasks:
                        key = (spec.slug, readout_width(spec.embed_dim, readout), *task)
                        shapes[key] = shapes.get(key, 0) + len(magnifications)
    return [{"encoder": key[0], "width": key[1], "n_train": key[2], "n_val": key[3], "n_test": key[4],
             "n_classes": key[5], "runs": runs} for key, runs in shapes.items()]


def robustness_workload(params: Params, encoders: list[EncoderSpec], panel: dict) -> list[dict]:
    """Every robustness scoring by shape (encoder, width, cells of the unit) with its count over the
    magnifications and taxonomies (first pass: a model whose k* differs from the shared k is scored again)."""
    from cellpath.features.readouts import readout_width

    cfg = params.robustness
    sections = pd.DataFrame(panel["sections"])
    n_panel = panel["evaluated_cells"] or int(sections["cells"].sum())
    units = []
    for scope in cfg.scopes:
        if scope == "panel":
            units.append(n_panel)
            continue
        per_organ = sections.groupby("organ").agg(n=("section_id", "size"), cells=("cells", "sum"))
        units += [int(row.cells * n_panel / sections["cells"].sum()) for row in per_organ.itertuples() if row.n >= 2]
    repeats = len(params.stage_magnifications(cfg.magnifications)) * len(cfg.taxonomies)
    rows: dict[tuple, int] = {}
    for spec in encoders:
        for readout in cfg.readouts:
            if readout_available(spec, readout):
                for n in units:
                    key = (spec.slug, readout_width(spec.embed_dim, readout), n)
                    rows[key] = rows.get(key, 0) + repeats
    return [{"encoder": k[0], "width": k[1], "n_cells": k[2], "scorings": count} for k, count in rows.items()]


def stage_estimates(params: Params, encoders: list[EncoderSpec], features: list[dict], probe_shapes: list[dict],
                    robustness_units: list[dict], n_panel_cells: int, model: CostModel) -> list[dict]:
    """Per stage and device with measured costs: seconds on one calibration worker, core-seconds,
    the largest task's peak memory (bytes) and the disk written (bytes; None: tables only)."""
    out = []
    for device in sorted(model.devices):
        costs = model.costs(device)
        if costs.extract is not None:
            for spec in encoders:
                parameters = parameter_count(spec.params)
                patches = [r["patches"] for r in features if r["encoder"] == spec.slug]
                if spec.type == "control" or not parameters or None in patches:
                    continue  # weight-free controls have no ViT cost; unknown patch counts are not guessed
                gflop = patch_gflop(parameters, spec.input_size, spec.patch_size, spec.num_prefix_tokens)
                seconds = extract_seconds(costs.extract, sum(patches), gflop)
                out.append({"stage": "extract", "what": spec.slug, "device": device, "units": sum(patches),
                            "unit": "patch", "seconds": seconds, "core_seconds": seconds * costs.extract.cores,
                            "peak_memory_bytes": parameters * 4 + EXTRACT_WORKING_BYTES,
                            "disk_bytes": sum(r["bytes"] for r in features if r["encoder"] == spec.slug),
                            "source": f"{gflop:.1f} GFLOP per patch; {costs.extract.source}"})
        if costs.probe is not None and probe_shapes:
            budget, c_grid = params.probe.batch_memory_mb, len(params.probe.c_grid)
            totals = [sum(row["runs"] * probe_fit_seconds(
                costs.probe, n_train=row["n_train"], n_val=row["n_val"], n_test=row["n_test"], width=row["width"],
                row_bytes=design_row_bytes(row["width"], row["n_classes"]), iterations=iterations * c_grid,
                budget_mb=budget) for row in probe_shapes)
                for iterations in (costs.probe.iterations_per_c, *costs.probe.iterations_range)]
            out.append({"stage": "probe", "what": "every fitted run", "device": device,
                        "units": sum(row["runs"] for row in probe_shapes), "unit": "run", "seconds": totals[0],
                        "core_seconds": totals[0], "core_seconds_range": totals[1:],
                        "peak_memory_bytes": max(probe_heap_bytes(
                            costs.probe, n_panel_cells, budget, n_train=row["n_train"],
                            row_bytes=design_row_bytes(row["width"], row["n_classes"])) for row in probe_shapes),
                        "disk_bytes": None,
                        "source": f"{costs.probe.iterations_per_c:g} L-BFGS iterations per C (range "
                                  f"{costs.probe.iterations_range[0]:g}–{costs.probe.iterations_range[1]:g}) × "
                                  f"{c_grid} C, {costs.probe.iterations_source}; {costs.probe.source}"})
        if costs.robustness is not None and robustness_units:
            cfg = params.robustness
            seconds = sum(row["scorings"] * robustness_seconds(costs.robustness, row["n_cells"], row["width"],
                                                               full_max_cells=cfg.full_max_cells, anchors=cfg.anchors)
                          for row in robustness_units)
            largest = max(robustness_units, key=lambda row: row["n_cells"] * row["width"])
            out.append({"stage": "robustness", "what": "every scoring", "device": device,
                        "units": sum(row["scorings"] for row in robustness_units), "unit": "scoring",
                        "seconds": seconds, "core_seconds": seconds * costs.robustness.cores,
                        "peak_memory_bytes": robustness_heap_bytes(costs.robustness, largest["n_cells"],
                                                                   largest["width"], full_max_cells=cfg.full_max_cells,
                                                                   anchors=cfg.anchors),
                        "disk_bytes": None, "source": costs.robustness.source})
    return out


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


def build_plan(params: Params, data_dir: Path, preset: str = "current", *,
               costs_path: Path = COSTS_PATH, worker_cores: int | None = None, worker_memory_gb: float | None = None,
               deadline_days: float = 7.0) -> dict:
    """The whole plan as a JSON-serialisable dict (see the module docstring). Workers default to
    this machine's size."""
    import torch

    if preset == "paper":
        params = paper_params(params)
    data_dir = Path(data_dir)
    model = load_costs(costs_path)
    encoders = selected_encoders(params.extract.registry, params.extract.encoders)
    magnifications = list(params.extract.magnifications)
    evaluated = None
    if preset == "current" and panels_csv(data_dir).is_file():
        from cellpath.features.panel import load_panel_cells

        evaluated = load_panel_cells(data_dir, params.panel).cells
    panel = panel_summary(params, data_dir, preset, evaluated)
    sections = panel["sections"]
    if evaluated is not None:
        from cellpath.io.sections import sections_to_extract

        cells = pd.read_csv(section_index_csv(data_dir)).set_index("section_id")["n_cells"]
        sections = [{"section_id": s, "cells": int(cells[s])} for s in sections_to_extract(data_dir)["section_id"]]
    features = feature_rows(encoders, magnifications, data_dir if preset == "current" else None, sections,
                            model.costs("cpu").extract)
    probe = probe_counts(params, encoders, magnifications, panel, evaluated, preset)
    sizes = {spec.slug: spec.input_size for spec in encoders}
    shared = {(r["magnification"], sizes[r["encoder"]]): r["patches"] for r in features if r["patches"] is not None}
    patch_cache = sum(n * size * size * 3 for (_, size), n in shared.items()) if params.extract.patch_cache else 0
    probe_shapes = probe_workload(params, encoders, params.stage_magnifications(params.probe.magnifications), panel,
                                  evaluated)
    n_panel = panel["evaluated_cells"] or int(sum(s["cells"] for s in panel["sections"]))
    estimates = stage_estimates(params, encoders, features, probe_shapes,
                                robustness_workload(params, encoders, panel), n_panel, model)
    worker_cores = worker_cores or os.cpu_count() or 1
    worker_memory = (worker_memory_gb * 1e9 if worker_memory_gb
                     else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    week = week_plan(estimates, worker_cores, worker_memory, deadline_days * 86400)
    return {"preset": preset, "hardware": {"cpus": os.cpu_count(), "gpus": torch.cuda.device_count()},
            "panel": {**panel, "sections": len(panel["sections"]),
                      "organs": len({s["organ"] for s in panel["sections"]}),
                      "cells": int(sum(s["cells"] for s in panel["sections"]))},
            "encoders": len(encoders), "magnifications": magnifications, "features": features,
            "patch_cache_bytes": patch_cache, "probe": probe,
            "cost_model": {"path": str(costs_path), "machine": model.machine, "devices": sorted(model.devices)},
            "estimates": estimates,
            "not_estimated": {stage: [d for d in ("cpu", "cuda")
                                      if not any(e["stage"] == stage and e["device"] == d for e in estimates)]
                              for stage in STAGES},
            "week": {"deadline_days": deadline_days, "worker_cores": worker_cores,
                     "worker_memory_bytes": worker_memory, "core_hours": sum(row["core_hours"] for row in week),
                     "workers": workers_needed(sum(row["core_hours"] for row in week) * 3600, worker_cores,
                                               deadline_days * 86400),
                     "stages": week}}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for size, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:,.1f} {name}"
    return f"{seconds:.1f} s"


def _number(value) -> str:
    return "—" if value is None else f"{value:,}"


def _bytes(size: float | None) -> str:
    if size is None:
        return "tables"
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB")):
        if size >= scale:
            return f"{size / scale:,.1f} {name}"
    return f"{size / 1e3:,.1f} kB"


def render(plan: dict) -> str:
    """The plan as a readable text table."""
    panel = plan["panel"]
    lines = [f"cellpath plan ({plan['preset']}) on {plan['hardware']['cpus']} CPUs, {plan['hardware']['gpus']} GPUs",
             f"panel {panel['name']}: {panel['sections']} sections, {panel['organs']} organs, {panel['cells']:,} cells"
             + (f" ({panel['evaluated_cells']:,} evaluated)" if panel["evaluated_cells"] else "")
             + f"  [{panel['source']}]", "",
             f"{'encoder':<24}{'mag':>5}{'sections':>10}{'cells':>13}{'patches':>12}{'features':>12}  source"]
    for row in plan["features"]:
        lines.append(f"{row['encoder']:<24}{row['magnification']:>5}{row['sections']:>10}{row['cells']:>13,}"
                     f"{_number(row['patches']):>12}{_bytes(row['bytes']):>12}  {row['source']}")
    total_bytes = sum(row["bytes"] for row in plan["features"])
    lines += [f"{'all':<24}{'':>5}{'':>10}{'':>13}{'':>12}{_bytes(total_bytes):>12}",
              f"shared patch store (data/.work/patches, one copy per magnification and input size): "
              f"{_bytes(plan['patch_cache_bytes']) if plan['patch_cache_bytes'] else 'off'}", "",
              f"probe runs ({plan['encoders']} encoders × {len(plan['magnifications'])} magnifications) "
              f"[{plan['probe']['source']}]",
              f"{'protocol':<10}{'units':>7}{'seeds':>7}{'runs':>12}{'unavailable':>13}{'skipped':>10}{'fitted':>12}"]
    for name, row in [*plan["probe"]["protocols"].items(), ("total", plan["probe"]["total"])]:
        lines.append(f"{name:<10}{row.get('units', ''):>7}{row.get('seeds', ''):>7}{_number(row['runs']):>12}"
                     f"{_number(row['unavailable']):>13}{_number(row['skipped']):>10}{_number(row['fitted']):>12}")
    if "paper" in plan["probe"]:
        paper = plan["probe"]["paper"]
        lines.append(f"paper (Table 3): {', '.join(f'{p} {n:,}' for p, n in paper['table_3'].items())}; total "
                     f"{paper['total']:,} — derived {plan['probe']['total']['runs']:,}: "
                     + ("matches" if paper["matches"] else "DIFFERS"))
    machine = plan["cost_model"]["machine"]
    lines += ["", f"cost per stage, from the cost model {plan['cost_model']['path']} (measured on "
                  f"{machine.get('cpus', '?')} CPUs, {machine.get('memory_gb', '?')} GB)",
              f"{'stage':<12}{'device':>7}{'units':>16}{'core-hours':>13}{'GPU-hours':>11}{'largest task':>14}"
              f"{'disk':>11}"]
    for stage in STAGES:
        for device in ("cpu", "cuda"):
            parts = [e for e in plan["estimates"] if e["stage"] == stage and e["device"] == device]
            if not parts:
                lines.append(f"{stage:<12}{device:>7}{'':>16}{'not measured':>24}")
                continue
            core = sum(e["core_seconds"] for e in parts) / 3600
            disks = [e["disk_bytes"] for e in parts]
            gpu = f"{sum(e['seconds'] for e in parts) / 3600:,.1f}" if device == "cuda" else "—"
            cpu = f"{core:,.1f}" if device == "cpu" else "—"
            ranges = [e.get("core_seconds_range") for e in parts if e.get("core_seconds_range")]
            lines.append(f"{stage:<12}{device:>7}{sum(e['units'] for e in parts):>16,}{cpu:>13}{gpu:>11}"
                         f"{_bytes(max(e['peak_memory_bytes'] for e in parts)):>14}"
                         f"{_bytes(None if None in disks else sum(disks)):>11}"
                         + (f"  (iterations p25–p75: {ranges[0][0] / 3600:,.0f}–{ranges[0][1] / 3600:,.0f} "
                            "core-hours)" if ranges else ""))
    sources = sorted({e["source"] for e in plan["estimates"] if e["stage"] != "extract"}
                     | {e["source"].split("; ", 1)[1] for e in plan["estimates"] if e["stage"] == "extract"})
    lines += [f"  source: {source}" for source in sources]
    week = plan["week"]
    lines += ["", f"to finish within {week['deadline_days']:g} days on workers of {week['worker_cores']} cores and "
                  f"{_bytes(week['worker_memory_bytes'])} (CPU; ideal packing, so a lower bound):"]
    for row in week["stages"]:
        lines.append(f"  {row['stage']:<12}{row['core_hours']:>14,.0f} core-hours  → {row['workers']:>6,} workers"
                     + ("" if row["fits_worker"] else f"  — its largest task needs {_bytes(row['largest_task_bytes'])}"
                        ", more than a worker has"))
    lines.append(f"  {'all':<12}{week['core_hours']:>14,.0f} core-hours  → {week['workers']:>6,} workers "
                 "(every stage within the deadline)")
    missing = [f"{stage} ({', '.join(devices)})" for stage, devices in plan["not_estimated"].items() if devices]
    if missing:
        lines.append("not measured, so not estimated: " + "; ".join(missing))
    return "\n".join(lines)
