"""The workload a configuration implies: its sections and cells, patches and feature bytes per encoder
and magnification, probe runs per protocol and by fit shape, robustness scorings by unit size.

Each count says where it came from: the data folder (feature sidecars, ``probing.plan.plan_runs`` on
the panel's cells), the params (``count_runs`` / ``split_sizes`` where no data exists) or the cost
model's patches per cell. Bytes are bytes; cells, patches and runs are counts.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from cellpath.annotation.ontology import COARSE_CLASSES, FINE_CLASSES
from cellpath.config import Params
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.panel import panel_sections
from cellpath.features.readouts import readout_available, readout_width
from cellpath.features.store import artifact_dir, read_sidecar
from cellpath.features.tiling import place_section_cells
from cellpath.io.layout import features_dir, section_index_csv
from cellpath.io.sections import read_section_obs, sections_to_extract
from cellpath.probing.fit import design_row_bytes, state_row_bytes
from cellpath.probing.plan import capped_training, count_runs, plan_runs, split_sizes
from cellpath.probing.protocols import make_splits
from cellpath.runtime.costs import ExtractCosts, extract_patches, feature_bytes, parameter_count
from cellpath.runtime.planning import ExtractJob
from cellpath.sources.tenx import read_manifest, select_sections
from cellpath.vocabulary import CLS_READOUTS, MAGNIFICATION_MPP, PAPER_PANEL_PRESETS


def panel_summary(params: Params, data_dir: Path, preset: str, evaluated: pd.DataFrame | None) -> dict:
    """Sections (section_id, organ, cells) the configuration evaluates, and where they came from."""
    if preset in PAPER_PANEL_PRESETS:
        manifest = pd.read_csv(params.tenx.manifest)
        chosen = manifest[manifest["panel_s25"] == 1]
        return {"name": params.panel, "sections": chosen[["section_id", "organ", "cells"]].to_dict("records"),
                "evaluated_cells": None, "source": f"{params.tenx.manifest} (panel_s25; all cells, labels unknown)"}
    if evaluated is not None:
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


def staged_sections(params: Params, data_dir: Path, preset: str) -> dict:
    """Cells of every section ingest, annotate and concordance run on (all the fetched sections, not
    the panel alone: concordance ranks them all), and where the counts came from: the ingested
    section table, else the 10x manifest's rows ``tenx.sections`` selects (the paper's: every row with
    a download), else the simulated sections of the params."""
    if preset == "current" and section_index_csv(data_dir).is_file():
        cells = pd.read_csv(section_index_csv(data_dir))["n_cells"].astype(int).tolist()
        return {"cells": cells, "source": f"{section_index_csv(data_dir)} (ingested)"}
    if params.source == "10x":
        manifest = params.tenx.manifest
        chosen = select_sections(read_manifest(manifest), list(params.tenx.sections), manifest)
        return {"cells": [s.cells for s in chosen], "source": f"{manifest} (the cells column of "
                + ("every row with a download)" if not params.tenx.sections else "the rows tenx.sections lists)")}
    cells = [s.n_cells or params.synthetic.cells_per_section for s in params.synthetic.sections]
    return {"cells": cells, "source": "params.yaml synthetic.sections"}


def extracted_sections(data_dir: Path) -> list[dict]:
    """Every section extraction reads (the panel's and the rest annotation kept), with its cells."""
    cells = pd.read_csv(section_index_csv(data_dir)).set_index("section_id")["n_cells"]
    return [{"section_id": s, "cells": int(cells[s])} for s in sections_to_extract(data_dir)["section_id"]]


def feature_rows(encoders: list[EncoderSpec], magnifications: list[str], data_dir: Path | None,
                 sections: list[dict], extract_costs: ExtractCosts | None) -> list[dict]:
    """Per encoder and magnification: cells, patches and feature bytes — measured where data exists,
    else patches from the section tables or, without them, from the cost model's patches per cell."""
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
    index = pd.read_csv(section_index_csv(data_dir)).set_index("section_id")
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


def patch_cache_bytes(encoders: list[EncoderSpec], features: list[dict]) -> int:
    """Bytes of the shared patch store: one uint8 RGB copy per (magnification, input size) of known patches."""
    sizes = {spec.slug: spec.input_size for spec in encoders}
    shared = {(r["magnification"], sizes[r["encoder"]]): r["patches"] for r in features if r["patches"] is not None}
    return sum(n * size * size * 3 for (_, size), n in shared.items())


def extract_jobs(encoders: list[EncoderSpec], features: list[dict], sections: list[dict],
                 magnifications: list[str]) -> list[ExtractJob]:
    """The extractions the cost model can price: ViTs with a parameter count (the pretrained models and
    the randomly initialised ViT control; weight-free controls have no ViT cost), each reading every
    section at every magnification; unknown patch counts are not guessed."""
    jobs = []
    for spec in encoders:
        parameters = parameter_count(spec.params)
        patches = [r["patches"] for r in features if r["encoder"] == spec.slug]
        if not parameters or None in patches:
            continue
        jobs.append(ExtractJob(encoder=spec.slug, parameters=parameters, input_size=spec.input_size,
                               patch_size=spec.patch_size, prefix_tokens=spec.num_prefix_tokens, patches=sum(patches),
                               disk_bytes=sum(r["bytes"] for r in features if r["encoder"] == spec.slug),
                               precision=spec.precision,
                               section_cells=tuple(s["cells"] for s in sections for _ in magnifications)))
    return jobs


def probe_counts(params: Params, encoders: list[EncoderSpec], magnifications: list[str], panel: dict,
                 evaluated: pd.DataFrame | None) -> dict:
    """Runs per protocol: all, unavailable (no CLS token), and — from the planned splits where the
    panel's cells exist — skipped (fewer than two gated classes) and fitted."""
    cfg = params.probe
    readouts = list(cfg.readouts)
    has_cls = [spec.has_cls for spec in encoders]
    n_cls = sum(r in CLS_READOUTS for r in readouts)
    usable = sum(len(readouts) - (0 if cls else n_cls) for cls in has_cls) * len(magnifications)
    rows: dict[str, dict] = {}
    if evaluated is not None:
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
        counted = count_runs(pd.DataFrame(panel["sections"]), models_with_cls=has_cls,
                             n_magnifications=len(magnifications), n_taxonomies=len(cfg.taxonomies),
                             readouts=tuple(readouts), seeds=cfg.seeds, protocols=params.protocols,
                             n_folds=cfg.mocv_folds)
        for protocol in params.protocols:
            rows[protocol] = {"units": counted.units[protocol], "seeds": cfg.seeds[protocol],
                              "runs": counted.runs[protocol], "unavailable": counted.unavailable[protocol],
                              "skipped": None, "fitted": None}
        source = "probing.plan.count_runs on the section list (class gates need the labels: skipped runs unknown)"
    total = {key: (None if any(r[key] is None for r in rows.values()) else sum(r[key] for r in rows.values()))
             for key in ("runs", "unavailable", "skipped", "fitted")}
    return {"protocols": rows, "total": total, "source": source}


def _probe_tasks(params: Params, panel: dict, evaluated: pd.DataFrame | None, protocol: str,
                 taxonomy: str) -> list[tuple[int, int, int, int]]:
    """(n_train, n_val, n_test, n_classes) of every fitted task of one protocol and taxonomy: from the
    planned tasks where the panel's cells exist, else from the section list (every cell and every
    class of the taxonomy, so upper bounds)."""
    cfg = params.probe
    if evaluated is not None:
        return [(len(r.task.train), len(r.task.val), len(r.task.test), len(r.task.classes))
                for r in plan_runs(evaluated, protocol, taxonomy, cfg) if r.task is not None]
    sizes = split_sizes(pd.DataFrame(panel["sections"]), protocol, n_folds=cfg.mocv_folds,
                        roi_fraction=cfg.is_roi_fraction, val_fraction=cfg.val_fraction)
    n_classes = len(FINE_CLASSES if taxonomy == "fine" else COARSE_CLASSES)
    return [(s.n_train, s.n_val, s.n_test, n_classes) for s in sizes for _ in range(cfg.seeds[protocol])]


def probe_workload(params: Params, encoders: list[EncoderSpec], magnifications: list[str], panel: dict,
                   evaluated: pd.DataFrame | None) -> list[dict]:
    """Every fitted probe run by shape (encoder, width, n_train, n_val, n_test, n_classes; row_bytes and
    state_bytes: a training row's working and fit-state bytes at the C grid) with its ``runs`` count."""
    cfg = params.probe
    shapes: dict[tuple, int] = {}
    for taxonomy in cfg.taxonomies:
        for protocol in params.protocols:
            tasks = _probe_tasks(params, panel, evaluated, protocol, taxonomy)
            for spec in encoders:
                for readout in cfg.readouts:
                    if not readout_available(spec, readout):
                        continue
                    for task in tasks:
                        key = (spec.slug, readout_width(spec.embed_dim, readout), *task)
                        shapes[key] = shapes.get(key, 0) + len(magnifications)
    return [{"encoder": key[0], "width": key[1], "n_train": key[2], "n_val": key[3], "n_test": key[4],
             "n_classes": key[5], "row_bytes": design_row_bytes(key[1], len(cfg.c_grid) * key[5]),
             "state_bytes": state_row_bytes(len(cfg.c_grid) * key[5]), "runs": runs}
            for key, runs in shapes.items()]


def _expression_splits(params: Params, panel: dict, evaluated: pd.DataFrame | None, protocol: str) -> list[int]:
    """Rows (train + val + test) of every expression run of one protocol: the type probes' splits on the
    panel's cells where they exist (low-count cells not known here: an upper bound), else from the
    section list."""
    cfg = params.probe
    if evaluated is not None:
        splits = make_splits(evaluated, protocol, cfg.seeds[protocol], n_folds=cfg.mocv_folds,
                             roi_fraction=cfg.is_roi_fraction, buffer_um=cfg.is_buffer_um, val_fraction=cfg.val_fraction)
        return [len(capped_training(s.train, cfg.max_train_cells, s)) + len(s.val) + len(s.test) for s in splits]
    sizes = split_sizes(pd.DataFrame(panel["sections"]), protocol, n_folds=cfg.mocv_folds,
                        roi_fraction=cfg.is_roi_fraction, val_fraction=cfg.val_fraction)
    cap = cfg.max_train_cells
    return [min(s.n_train, cap or s.n_train) + s.n_val + s.n_test for s in sizes for _ in range(cfg.seeds[protocol])]


def expression_workload(params: Params, encoders: list[EncoderSpec], panel: dict,
                        evaluated: pd.DataFrame | None) -> list[dict]:
    """Every expression design fit by shape (encoder, width, n_rows) with its count: per run and usable
    readout, the features (width w), the type (the Tfine classes) and both (w + classes)."""
    cfg = params.expression
    n_types = len(FINE_CLASSES)
    magnifications = len(params.stage_magnifications(cfg.magnifications))
    rows = [n for protocol in params.protocols for n in _expression_splits(params, panel, evaluated, protocol)]
    shapes: dict[tuple, int] = {}
    for spec in encoders:
        for readout in cfg.readouts:
            if not readout_available(spec, readout):
                continue
            width = readout_width(spec.embed_dim, readout)
            for n in rows:
                for design_width in (width, n_types, width + n_types):
                    key = (spec.slug, design_width, n)
                    shapes[key] = shapes.get(key, 0) + magnifications
    return [{"encoder": k[0], "width": k[1], "n_rows": k[2], "fits": fits} for k, fits in shapes.items()]


def robustness_workload(params: Params, encoders: list[EncoderSpec], panel: dict) -> list[dict]:
    """Every robustness scoring by shape (encoder, width, cells of the unit) with its count over the
    magnifications and taxonomies (first pass: a model whose k* differs from the shared k is scored again)."""
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
