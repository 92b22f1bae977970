"""The plan (:func:`cellpath.planning.build.build_plan`) as a readable text table."""

from __future__ import annotations

import shlex

from cellpath.runtime.planning import DEVICES, GPU_STAGES, STAGES


def _number(value: int | None) -> str:
    """A count with thousands separators; ``—`` when unknown."""
    return "—" if value is None else f"{value:,}"


def _bytes(size: float | None) -> str:
    """Bytes in kB, MB, GB or TB (powers of 1000); ``tables`` when None (a stage that writes tables only)."""
    if size is None:
        return "tables"
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB")):
        if size >= scale:
            return f"{size / scale:,.1f} {name}"
    return f"{size / 1e3:,.1f} kB"


def _features(plan: dict) -> list[str]:
    """The header, the panel, and the features per encoder and magnification with the patch store."""
    panel = plan["panel"]
    models = plan.get("models")
    share = (f"; {', '.join(models)}: {len(models)} of its {plan['configured_encoders']} encoders, their runs only"
             if models else "")
    lines = [f"cellpath plan ({plan['preset']}{share}) on {plan['hardware']['cpus']} CPUs, "
             f"{plan['hardware']['gpus']} GPUs",
             f"panel {panel['name']}: {panel['sections']} sections, {panel['organs']} organs, {panel['cells']:,} cells"
             + (f" ({panel['evaluated_cells']:,} evaluated)" if panel["evaluated_cells"] else "")
             + f"  [{panel['source']}]",
             _staged_line(plan["staged_sections"]), "",
             f"{'encoder':<24}{'mag':>5}{'sections':>10}{'cells':>13}{'patches':>12}{'features':>12}  source"]
    for row in plan["features"]:
        lines.append(f"{row['encoder']:<24}{row['magnification']:>5}{row['sections']:>10}{row['cells']:>13,}"
                     f"{_number(row['patches']):>12}{_bytes(row['bytes']):>12}  {row['source']}")
    total_bytes = sum(row["bytes"] for row in plan["features"])
    return lines + [f"{'all':<24}{'':>5}{'':>10}{'':>13}{'':>12}{_bytes(total_bytes):>12}",
                    f"shared patch store (data/.work/patches, one copy per magnification and input size): "
                    f"{_bytes(plan['patch_cache_bytes']) if plan['patch_cache_bytes'] else 'off'}"]


def _staged_line(staged: dict) -> str:
    """The sections ingest, annotate and concordance read: how many, their cells, the largest."""
    return (f"ingest, annotate, concordance: {staged['sections']} sections, {staged['cells']:,} cells (largest "
            f"{staged['largest']:,})  [{staged['source']}]")


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 360 else f"{seconds / 60:,.1f} min"


def _disk(plan: dict) -> list[str]:
    """Bytes per place (workspace, DVC cache, remote, patch store) and DVC's time on the features."""
    disk = plan["disk"]
    raw = disk["raw"]
    raw_text = (f"{_bytes(raw['bytes'])} for {raw['known_sections']} of {raw['sections']} sections; from "
                f"{raw['source']}" if raw["known_sections"] else f"unknown: {raw['source']}")
    copy = disk["cache_extra_bytes"]["copy"]
    lines = ["disk per place (docs/scaling.md, Storage)",
             f"  {'raw sections (data/raw)':<34}{raw_text}",
             f"  {'features (data/features)':<34}{_bytes(disk['features_bytes'])}",
             f"  {'workspace under DVC':<34}{_bytes(disk['workspace_bytes'])}: features + the raw sections priced "
             "(ingested sections, labels and reports are small beside them, not priced)",
             f"  {'DVC cache':<34}"
             + (f"no extra bytes: outputs are links into it (cache.type {disk['cache_type']}); "
                f"with cache.type copy {_bytes(copy)} more, every output twice" if disk["links"] else
                f"{_bytes(copy)} more: every output twice (cache.type {disk['cache_type']}); none with "
                "cache.type hardlink,symlink (docs/decisions/0041)"),
             f"  {'remote (dvc push)':<34}{_bytes(disk['remote_bytes'])} per pushed version",
             f"  {'shared patch store (data/.work)':<34}"
             f"{_bytes(disk['patch_store_bytes']) if disk['patch_store_bytes'] else 'off'}, not under DVC"]
    seconds = disk["seconds"]
    if seconds is None:
        return lines + ["  DVC's time on the features: not measured (benchmarks/bench_dvc_storage.py --calibrate)"]
    rates = disk["rates"]
    mine, other = ("links", "copy") if disk["links"] else ("copy", "links")
    return lines + [
        "  DVC's time on the features, one dvc process at measured rates:",
        f"    hash every byte (each extract stage's end; dvc status after mtimes change)  "
        f"{_hours(seconds['hash'])} at {rates['hash'] / 1e6:,.0f} MB/s",
        f"    into the cache (dvc repro, dvc commit): {_hours(seconds['add'][mine])} with {mine}, "
        f"{_hours(seconds['add'][other])} with {other}",
        f"    dvc checkout of another clone: {_hours(seconds['checkout'][mine])} with {mine}, "
        f"{_hours(seconds['checkout'][other])} with {other}",
        f"    dvc push to a folder on the same disk: {_hours(seconds['push'][mine])} with {mine}, "
        f"{_hours(seconds['push'][other])} with {other} (a network remote adds its transfer)",
        f"  source: {disk['source']}"]


def _probe(plan: dict) -> list[str]:
    """Probe runs per protocol and in all, and the paper's Table 3 where the plan compares with it."""
    probe = plan["probe"]
    lines = [f"probe runs ({plan['encoders']} encoder{'' if plan['encoders'] == 1 else 's'} × "
             f"{len(plan['magnifications'])} magnifications) "
             f"[{probe['source']}]",
             f"{'protocol':<10}{'units':>7}{'seeds':>7}{'runs':>12}{'unavailable':>13}{'skipped':>10}{'fitted':>12}"]
    for name, row in [*probe["protocols"].items(), ("total", probe["total"])]:
        lines.append(f"{name:<10}{row.get('units', ''):>7}{row.get('seeds', ''):>7}{_number(row['runs']):>12}"
                     f"{_number(row['unavailable']):>13}{_number(row['skipped']):>10}{_number(row['fitted']):>12}")
    if "paper" in probe:
        paper = probe["paper"]
        lines.append(f"paper (Table 3): {', '.join(f'{p} {n:,}' for p, n in paper['table_3'].items())}; total "
                     f"{paper['total']:,} — derived {probe['total']['runs']:,}: "
                     + ("matches" if paper["matches"] else "DIFFERS"))
    return lines


def _estimate_line(stage: str, device: str, parts: list[dict]) -> str:
    """One stage on one device: units, core-hours (CPU) or GPU-hours, the largest task and the disk."""
    if not parts:
        return f"{stage:<12}{device:>7}{'':>16}{'not measured':>24}"
    core = sum(e["core_seconds"] for e in parts) / 3600
    disks = [e["disk_bytes"] for e in parts]
    gpu = f"{sum(e['seconds'] for e in parts) / 3600:,.1f}" if device == "cuda" else "—"
    cpu = f"{core:,.1f}" if device == "cpu" else "—"
    ranges = [e.get("core_seconds_range") for e in parts if e.get("core_seconds_range")]
    return (f"{stage:<12}{device:>7}{sum(e['units'] for e in parts):>16,}{cpu:>13}{gpu:>11}"
            f"{_bytes(max(e['peak_memory_bytes'] for e in parts)):>14}"
            f"{_bytes(None if None in disks else sum(disks)):>11}"
            + (f"  (iterations p25–p75: {ranges[0][0] / 3600:,.0f}–{ranges[0][1] / 3600:,.0f} "
               f"{'GPU' if device == 'cuda' else 'core'}-hours)" if ranges else ""))


def _costs(plan: dict) -> list[str]:
    """The cost per stage and device, and the sources of the cost model's numbers."""
    machine = plan["cost_model"]["machine"]
    estimates = plan["estimates"]
    lines = [f"cost per stage, from the cost model {plan['cost_model']['path']} (measured on "
             f"{machine.get('cpus', '?')} CPUs, {machine.get('memory_gb', '?')} GB)",
             f"{'stage':<12}{'device':>7}{'units':>16}{'core-hours':>13}{'GPU-hours':>11}{'largest task':>14}"
             f"{'disk':>11}"]
    lines += [_estimate_line(stage, device, [e for e in estimates if e["stage"] == stage and e["device"] == device])
              for stage in STAGES for device in (DEVICES if stage in GPU_STAGES else ("cpu",))]
    sources = sorted({e["source"] for e in estimates if e["stage"] != "extract"}
                     | {e["source"].split("; ", 1)[1] for e in estimates if e["stage"] == "extract"})
    return lines + [f"  source: {source}" for source in sources]


def _week(plan: dict) -> list[str]:
    """The workers to finish within the deadline, per stage and in all, and what was not estimated."""
    week = plan["week"]
    lines = [f"to finish within {week['deadline_days']:g} days on workers of {week['worker_cores']} cores and "
             f"{_bytes(week['worker_memory_bytes'])} (CPU; ideal packing, so a lower bound):"]
    for row in week["stages"]:
        too_big = f"  — its largest task needs {_bytes(row['largest_task_bytes'])}, more than a worker has"
        lines.append(f"  {row['stage']:<12}{row['core_hours']:>14,.0f} core-hours  → {row['workers']:>6,} workers"
                     + ("" if row["fits_worker"] else too_big))
    lines.append(f"  {'all':<12}{week['core_hours']:>14,.0f} core-hours  → {week['workers']:>6,} workers "
                 "(every stage within the deadline)")
    missing = [f"{stage} ({', '.join(devices)})" for stage, devices in plan["not_estimated"].items() if devices]
    if missing:
        lines.append("not measured, so not estimated: " + "; ".join(missing))
    return lines


def _gpu_node(plan: dict) -> list[str]:
    """GPU-hours per stage priced on cuda and the days on one node of that many GPUs, with their sources."""
    node = plan["gpu_node"]
    head = f"on one {node['node_gpus']}-GPU node (cuda; ideal packing, so a lower bound)"
    if not node["stages"]:
        return [f"{head}: not measured (the cost model has no cuda costs)"]
    lines = [f"{head}:"]
    for row in node["stages"]:
        lines.append(f"  {row['stage']:<12}{row['gpu_hours']:>14,.1f} GPU-hours   → {row['days']:>8,.2f} days")
    lines.append(f"  {'all':<12}{node['gpu_hours']:>14,.1f} GPU-hours   → {node['days']:>8,.2f} days"
                 + (f" (not measured on cuda: {', '.join(node['not_measured'])})" if node["not_measured"] else ""))
    sources = sorted({source for row in node["stages"] for source in row["sources"]})
    return lines + [f"  source: {source}" for source in sources]


def _placement(share: dict) -> list[str]:
    """The placement's hours beside the same models' share of the paper's, and how to run it."""
    def hours(part: dict, key: str) -> str:
        stages = part[key]
        return (", ".join(f"{stage} {value:,.1f}" for stage, value in stages.items())
                + f" → {sum(stages.values()):,.1f}")

    ours, theirs = share["placement"], share["paper"]
    lines = [f"placement of {', '.join(share['models'])}: the paper's configuration at its headline condition "
             "(20×, Nuc, Tfine; all four protocols; robustness at the same condition)",
             f"  CPU core-hours: {hours(ours, 'cpu_core_hours')}, against {hours(theirs, 'cpu_core_hours')} for the "
             "same models in the paper's configuration"
             + (f" ({100 * share['cpu_fraction']:.1f} %)" if share["cpu_fraction"] is not None else "")]
    if ours["gpu_hours"]:
        lines.append(f"  GPU-hours: {hours(ours, 'gpu_hours')}, against {hours(theirs, 'gpu_hours')}"
                     + (f" ({100 * share['gpu_fraction']:.1f} %)" if share["gpu_fraction"] is not None else ""))
    else:
        lines.append("  GPU-hours: not measured (the cost model has no cuda costs)")
    arguments = " ".join(f"-S {shlex.quote(item)}" for item in share["overrides"])
    return lines + [f"  to run it: dvc exp run {arguments}" if arguments else
                    "  to run it: dvc exp run (params.yaml is already the placement configuration)"]


def render(plan: dict) -> str:
    """The plan as a readable text table: features, disk per place, probe runs, cost per stage, workers
    for the deadline, the days on one GPU node and, for a placement, its share of the paper's cost."""
    placement = ["", *_placement(plan["placement"])] if "placement" in plan else []
    return "\n".join([*_features(plan), "", *_disk(plan), "", *_probe(plan), "", *_costs(plan), "", *_week(plan), "",
                      *_gpu_node(plan), *placement])
