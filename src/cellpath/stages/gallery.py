"""The ``gallery`` stage: where each model fails, as a static page per model.

Reads ``reports/robustness/margins.parquet`` (every scored cell's CRoMa margin and nearest SO / OS
neighbours), ``reports/probe/is_errors.parquet`` (the IS test cells each run misclassified most
confidently), the ingested sections (nucleus positions, alignment), the labels and the registered
H&E slides. Writes ``reports/gallery/`` atomically: ``<model>.html`` per model (no server needed:
thumbnails load lazily from ``<model>/``), ``cells.csv`` (every crop: list, condition, rank, role,
section, cell id, file) and ``index.json`` (the pages and their counts, for the report's links).
Domain code: :mod:`cellpath.report.gallery` (what is shown) and :mod:`cellpath.report.gallery_pages`
(the crops read and written).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (gallery_cells_csv, gallery_dir, gallery_index_json, probe_is_errors_parquet,
                                robustness_margins_parquet)
from cellpath.report.gallery import (NEIGHBOUR_COLUMNS, cell_table, errors_with_neighbours, index_entry,
                                     lowest_margins, page_path, render_page)
from cellpath.report.gallery_pages import SectionCache, model_lists

log = logging.getLogger(__name__)


def run(params: Params, data_dir: Path, reports: Path) -> dict:
    """gallery: a page per model of its lowest-margin cells and most confident IS errors."""
    cfg = params.gallery
    margins = _read(robustness_margins_parquet(reports), "robustness")
    errors = _read(probe_is_errors_parquet(reports), "probe")
    missing = [c for c in NEIGHBOUR_COLUMNS if c not in margins.columns]
    if missing:
        raise InputError(f"margins.parquet has no {', '.join(missing)} (written before neighbours were recorded); "
                         "rerun the robustness stage (dvc repro robustness)", path=robustness_margins_parquet(reports))
    low = lowest_margins(margins, cfg.cells)
    wrong = errors_with_neighbours(errors, margins, cfg.cells)
    sections = SectionCache(data_dir)
    index, tables = {}, []
    with atomic_output(gallery_dir(reports)) as out:
        out.mkdir(parents=True)
        for model in sorted(set(margins["model"]) | set(errors["model"])):
            lists = model_lists(model, low[low["model"] == model], wrong[wrong["model"] == model], sections,
                                cfg.crop_um, out)
            page = page_path(out, model)
            page.write_text(render_page(model, lists, cfg.crop_um, params.robustness.m))
            tables.append(cell_table(lists))
            index[model] = index_entry(page.name, lists)
            log.info("gallery %s: %d lists, %d cells", model, len(lists), sum(len(g.entries) for g in lists))
        pd.concat([cell_table([]), *tables], ignore_index=True).to_csv(out / gallery_cells_csv(reports).name,
                                                                       index=False)
        (out / gallery_index_json(reports).name).write_text(json.dumps(
            {"crop_um": cfg.crop_um, "models": index, "nuclei_drawn_as_circles": sections.circles}, indent=2) + "\n")
    if sections.circles:
        log.warning("gallery: %d nuclei had no polygon in their bundle and are outlined as circles of their area",
                    sections.circles)
    return index


def _read(path: Path, stage: str) -> pd.DataFrame:
    if not path.is_file():
        raise InputError(f"not found; run the {stage} stage first (dvc repro {stage})", path=path)
    return pd.read_parquet(path)
