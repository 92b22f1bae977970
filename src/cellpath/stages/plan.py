"""``cellpath plan``: what a configuration implies, and how long it should take on this machine.

For the current params, or the paper's configuration (``--preset paper``): sections and cells,
patches and feature bytes per encoder and magnification, probe runs per protocol, and time
estimates from measured per-unit costs. Every number says where it came from: the data folder
(feature sidecars, ``probing.plan.plan_runs`` on the panel's cells), the params
(``probing.plan.count_runs`` where no data exists) or a measurement file; a cost with no measurement is reported as missing,
never guessed. The paper preset's run count is derived (``count_runs`` on the 25 sections of the
manifest) and compared with the paper's Table 3.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from cellpath.config import Params, parse_params
from cellpath.features.encoders.registry import EncoderSpec, load_registry, selected_encoders
from cellpath.features.readouts import readout_available
from cellpath.io.layout import (COUNTS_NAME, TIMING_NAME, features_dir, panels_csv, probe_reports, section_index_csv,
                                work_root)
from cellpath.probing.plan import count_runs
from cellpath.vocabulary import CLS_READOUTS, MAGNIFICATIONS, READOUTS

PAPER_TABLE_3 = {"is": 157_500, "iocd": 86_940, "mocv": 18_900, "looo": 41_580}  # CellPath-Bench, Table 3
PAPER_RUNS = 304_920
FEATURE_BYTES = 2  # float16 per stored value (feature_store)


def paper_params(params: Params) -> Params:
    """``params`` with the paper's values (those params.yaml gives in its comments, and Table 3)."""
    data = params.model_dump(mode="json")
    registry = load_registry(params.extract.registry)
    data["extract"].update(encoders=[s.slug for s in registry.values() if s.type != "control"],
                           magnifications=list(MAGNIFICATIONS))
    data["concordance"]["panel_sizes"] = [10, 15, 20, 25]
    data.update(panel="S25", protocol="all", source="10x")
    data["probe"].update(taxonomies=["fine", "coarse"], readouts=list(READOUTS), magnifications=None,
                         seeds={"is": 5, "iocd": 3, "mocv": 3, "looo": 3}, mocv_folds=5, max_train_cells=None,
                         min_train_cells={"fine": 500, "coarse": 100}, min_test_cells={"fine": 200, "coarse": 100})
    data["robustness"].update(taxonomies=["fine", "coarse"], magnifications=None)
    data["robustness"]["shortcut"]["n_runs"] = 20
    return parse_params(data)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


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
                 sections: list[dict]) -> list[dict]:
    """Per encoder and magnification: cells, patches and feature bytes, measured where data exists."""
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
                size = cells * spec.embed_dim * n_readouts * FEATURE_BYTES
                source = ("estimated: float16 " + ("Nuc, Mean, Cls" if spec.has_cls else "Nuc, Mean") + "; patches "
                          + ("from the section tables" if patches is not None else "need the slides"))
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


def extract_cost(spec: EncoderSpec, magnification: str, work: Path, bench: Path) -> tuple[float, str] | None:
    """Measured seconds per patch for an encoder: the extract stage's own timing (``magnification``
    first, else another), else the extraction benchmark if it measured this encoder."""
    candidates = [work / f"{spec.slug}-{magnification}.timing.json", *sorted(work.glob(f"{spec.slug}-*.timing.json"))]
    for path in candidates:
        record = _read_json(path)
        if record and sum(s["patches"] for s in record["sections"]):
            seconds = sum(s["seconds"] for s in record["sections"]) / sum(s["patches"] for s in record["sections"])
            return seconds, f"{path} (extract stage, {record['magnification']}, {record['cpus']} CPUs)"
    record = _read_json(bench)
    if record and record.get("encoder") == spec.slug:
        return 1.0 / record["pipeline_patches_per_s"], f"{bench} ({record['magnification']}, " \
                                                       f"{record['machine']['cpus']} CPUs)"
    return None


def probe_cost(reports: Path, bench: Path) -> tuple[float, str] | None:
    """Measured fitting seconds per fitted run: the probe stage's own timing, else the benchmark."""
    timing, counts = _read_json(probe_reports(reports) / TIMING_NAME), _read_json(probe_reports(reports) / COUNTS_NAME)
    if timing and counts and counts["total"]["ok"]:
        return (timing["fit_seconds"] / counts["total"]["ok"],
                f"{reports}/probe/timing.json ÷ counts.json ({counts['total']['ok']} runs)")
    record = _read_json(bench)
    if record and record.get("ours", {}).get("runs_per_s"):
        return 1.0 / record["ours"]["runs_per_s"], f"{bench} ({record['runs']} runs)"
    return None


def robustness_cost(n_cells: int, bench: Path, full_max_cells: int, anchors: int) -> tuple[float, str] | None:
    """Seconds to score one model on one condition of ``n_cells``, from the benchmark's nearest size
    n₀ (a full, exact scoring: n₀² anchor–candidate pairs): × (n / n₀)² up to ``full_max_cells``; above,
    the stage scores ``anchors`` anchors against all n cells, so × anchors·n / n₀²."""
    record = _read_json(bench)
    measured = [r for r in (record or {}).get("runs", []) if r.get("ours_seconds")]
    if not measured:
        return None
    nearest = min(measured, key=lambda r: abs(r["n"] - n_cells))
    n0 = nearest["n"]
    source = f"{bench} (n = {n0:,}, d = {record['settings']['d']}; "
    if n_cells <= full_max_cells:
        return nearest["ours_seconds"] * (n_cells / n0) ** 2, source + f"× (n / {n0:,})², exact search is quadratic)"
    return (nearest["ours_seconds"] * anchors * n_cells / n0**2,
            source + f"× {anchors:,} anchors · n / {n0:,}²: anchors above {full_max_cells:,} cells)")


def robustness_conditions(params: Params, encoders: list[EncoderSpec], panel: dict) -> list[int]:
    """Cells of every (model, magnification, readout, taxonomy, unit) the robustness stage scores."""
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
    models = sum(1 for readout in cfg.readouts for s in encoders if readout_available(s, readout))
    repeats = models * len(params.stage_magnifications(cfg.magnifications)) * len(cfg.taxonomies)
    return units * repeats


def build_plan(params: Params, data_dir: Path, reports: Path, benchmarks: Path, preset: str = "current") -> dict:
    """The whole plan as a JSON-serialisable dict (see the module docstring)."""
    import torch

    if preset == "paper":
        params = paper_params(params)
    data_dir, reports = Path(data_dir), Path(reports)
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
    features = feature_rows(encoders, magnifications, data_dir if preset == "current" else None, sections)
    probe = probe_counts(params, encoders, magnifications, panel, evaluated, preset)
    estimates = []
    work = work_root(data_dir) / "extract"
    for spec in encoders:  # a patch costs the same at every magnification (same input size)
        patches = [row["patches"] for row in features if row["encoder"] == spec.slug]
        cost = extract_cost(spec, magnifications[0], work, benchmarks / "extract.json")
        estimates.append(_estimate(f"extract {spec.slug}", None if None in patches else sum(patches), "patch", cost))
    fitted = probe["total"]["fitted"] if probe["total"]["fitted"] is not None else \
        probe["total"]["runs"] - probe["total"]["unavailable"]
    estimates.append(_estimate("probe", fitted, "fitted run", probe_cost(reports, benchmarks / "probe.json"),
                               None if preset == "current" else "runs uncapped (max_train_cells: null): the measured "
                               "cost is of runs of at most the default's training cells, so this is a lower bound"))
    conditions = robustness_conditions(params, encoders, panel)
    costs = [robustness_cost(n, benchmarks / "robustness.json", params.robustness.full_max_cells,
                             params.robustness.anchors) for n in sorted(set(conditions))]
    by_n = dict(zip(sorted(set(conditions)), costs))
    if conditions and all(by_n.values()):
        seconds = sum(by_n[n][0] for n in conditions)
        estimates.append(_estimate("robustness", len(conditions), "model × condition",
                                   (seconds / len(conditions), by_n[conditions[0]][1]), "first pass; models whose k* "
                                   "differs from the shared k are scored again"))
    else:
        estimates.append(_estimate("robustness", len(conditions), "model × condition", None))
    known = [e["seconds"] for e in estimates if e["seconds"] is not None]
    workers = params.executor.workers
    return {"preset": preset, "hardware": {"cpus": os.cpu_count(), "gpus": torch.cuda.device_count()},
            "panel": {**panel, "sections": len(panel["sections"]),
                      "organs": len({s["organ"] for s in panel["sections"]}),
                      "cells": int(sum(s["cells"] for s in panel["sections"]))},
            "encoders": len(encoders), "magnifications": magnifications, "features": features, "probe": probe,
            "estimates": estimates, "missing": [e["what"] for e in estimates if e["seconds"] is None],
            "total_seconds": sum(known), "executor": {"backend": params.executor.backend, "workers": workers,
                                                      "ideal_seconds": sum(known) / workers}}


def _estimate(what: str, units: int | None, unit: str, cost: tuple[float, str] | None, note: str | None = None) -> dict:
    if units is None or cost is None:
        reason = "no measured cost" if cost is None else f"number of {unit}es unknown"
        return {"what": what, "units": units, "unit": unit, "seconds_per_unit": None, "seconds": None,
                "source": f"missing: {reason}", "note": note}
    return {"what": what, "units": units, "unit": unit, "seconds_per_unit": cost[0], "seconds": units * cost[0],
            "source": cost[1], "note": note}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for size, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:,.1f} {name}"
    return f"{seconds:.1f} s"


def _number(value) -> str:
    return "—" if value is None else f"{value:,}"


def _bytes(size: float) -> str:
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
    lines += [f"{'all':<24}{'':>5}{'':>10}{'':>13}{'':>12}{_bytes(total_bytes):>12}", "",
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
    lines += ["", "estimated time on this machine (serial), from measured per-unit costs",
              f"{'what':<34}{'units':>12}{'s / unit':>11}{'time':>12}  source"]
    for e in plan["estimates"]:
        per_unit = "—" if e["seconds_per_unit"] is None else f"{e['seconds_per_unit']:.3g}"
        lines.append(f"{e['what']:<34}{_number(e['units']):>12}{per_unit:>11}{_duration(e['seconds']):>12}  "
                     f"{e['source']}" + (f" ({e['note']})" if e["note"] else ""))
    executor = plan["executor"]
    lines += [f"{'total (measured parts)':<34}{'':>12}{'':>11}{_duration(plan['total_seconds']):>12}",
              f"with executor {executor['backend']} × {executor['workers']} worker(s), ideal: "
              f"{_duration(executor['ideal_seconds'])}"]
    if plan["missing"]:
        lines.append(f"not estimated (no measured cost or size): {', '.join(plan['missing'])}")
    return "\n".join(lines)
