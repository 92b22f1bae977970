"""The ``gallery`` stage: where each model fails, as a static page per model.

Reads ``reports/robustness/margins.parquet`` (every scored cell's CRoMa margin and nearest SO / OS
neighbours), ``reports/probe/is_errors.parquet`` (the IS test cells each run misclassified most
confidently), the ingested sections (nucleus positions, alignment), the labels and the registered
H&E slides. Writes ``reports/gallery/`` atomically: ``<model>.html`` per model (no server needed:
thumbnails load lazily from ``<model>/``), ``cells.csv`` (every crop: list, condition, rank, role,
section, cell id, file) and ``index.json`` (the pages and their counts, for the report's links). Domain code: :mod:`cellpath.report.gallery`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output
from cellpath.io.layout import (gallery_dir, gallery_index_json, probe_is_errors_parquet, raw_dir, robustness_margins_parquet,
                                section_labels)
from cellpath.io.sections import read_section_index, read_section_meta, read_section_obs
from cellpath.io.wsi import open_slide
from cellpath.report.gallery import (LIST_KEYS, Crop, Entry, GalleryList, cell_table, crop_geometry, file_stem, lowest_margins,
                                     most_confident_errors, outline_crop_px, page_path, polygon_vertices, read_crop,
                                     render_page, thumbnail)
from cellpath.vocabulary import MAGNIFICATION_MPP, MAGNIFICATIONS, READOUTS, TAXONOMIES, TAXONOMY_LABELS

log = logging.getLogger(__name__)

#: margins.parquet columns naming the neighbours that decided a margin.
#: Every crop of every page, one row each (:func:`cellpath.report.gallery.cell_table`).
CELLS_NAME = "cells.csv"
NEIGHBOUR_COLUMNS = ["so_section_id", "so_cell_id", "so_distance", "os_section_id", "os_cell_id", "os_distance"]


class SectionCache:
    """Per section, opened on first use: the slide reader, nucleus positions (level-0 px), outlines
    (µm) and labels."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.index = read_section_index(data_dir).set_index("section_id")
        self._open: dict[str, dict] = {}
        self.circles = 0  # cells drawn with a circle of their nucleus area (no polygon in the bundle)

    def section(self, section_id: str) -> dict:
        if section_id not in self._open:
            from cellpath.io.scverse import nucleus_shapes

            if section_id not in self.index.index:
                raise InputError("a gallery cell's section is not in the section index; rerun the pipeline "
                                 "(dvc repro)", section=section_id)
            row = self.index.loc[section_id]
            meta = read_section_meta(self.data_dir, section_id)
            obs = read_section_obs(self.data_dir, section_id).set_index("cell_id", drop=False)
            raw_folder = raw_dir(self.data_dir) / row["raw_folder"]
            shapes = nucleus_shapes(raw_folder, obs, section_id)
            self.circles += shapes.n_without_polygon
            labels = pd.read_parquet(section_labels(self.data_dir, section_id)).set_index("cell_id")
            self._open[section_id] = {
                "reader": open_slide(raw_folder / row["he_image"], mpp=float(row["he_mpp"])),
                "he_mpp": float(row["he_mpp"]), "alignment": np.asarray(meta["alignment_he_to_morphology_px"], float),
                "pixel_size_um": float(meta["pixel_size_um"]), "obs": obs, "shapes": shapes.shapes.geometry,
                "labels": labels}
        return self._open[section_id]


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
    panel_margins = margins[margins["scope"] == "panel"][[*LIST_KEYS, "section_id", "cell_id", "margin",
                                                          *NEIGHBOUR_COLUMNS]]
    wrong = most_confident_errors(errors, cfg.cells).merge(panel_margins, how="left",
                                                            on=[*LIST_KEYS, "section_id", "cell_id"])
    sections = SectionCache(data_dir)
    models = sorted(set(margins["model"]) | set(errors["model"]))
    index, tables = {}, []
    with atomic_output(gallery_dir(reports)) as out:
        out.mkdir(parents=True)
        for model in models:
            lists = model_lists(model, low[low["model"] == model], wrong[wrong["model"] == model], sections, cfg.crop_um,
                                out)
            page = page_path(out, model)
            page.write_text(render_page(model, lists, cfg.crop_um, params.robustness.m))
            tables.append(cell_table(lists))
            index[model] = {"page": page.name, "lists": [{"kind": g.kind, "title": g.title, "cells": len(g.entries)}
                                                         for g in lists]}
            log.info("gallery %s: %d lists, %d cells", model, len(lists), sum(len(g.entries) for g in lists))
        pd.concat([cell_table([]), *tables], ignore_index=True).to_csv(out / CELLS_NAME, index=False)
        (out / gallery_index_json(reports).name).write_text(json.dumps({"crop_um": cfg.crop_um, "models": index,
                                                  "nuclei_drawn_as_circles": sections.circles}, indent=2) + "\n")
    if sections.circles:
        log.warning("gallery: %d nuclei had no polygon in their bundle and are outlined as circles of their area",
                    sections.circles)
    return index


def _read(path: Path, stage: str) -> pd.DataFrame:
    if not path.is_file():
        raise InputError(f"not found; run the {stage} stage first (dvc repro {stage})", path=path)
    return pd.read_parquet(path)


def model_lists(model: str, low: pd.DataFrame, wrong: pd.DataFrame, sections: SectionCache, crop_um: float,
                out: Path) -> list[GalleryList]:
    """The model's lists, condition by condition (margins first), their crops written under ``out``."""
    conditions = list_conditions(low if len(low) else wrong)
    lists = []
    folder = out / file_stem(model)
    folder.mkdir(exist_ok=True)
    for keys in conditions:
        where = dict(keys)
        name = f"{keys['magnification']} {keys['readout']} {TAXONOMY_LABELS.get(keys['taxonomy'], keys['taxonomy'])}"
        for kind, frame in (("margins", low), ("errors", wrong)):
            rows = frame[np.logical_and.reduce([frame[k] == v for k, v in where.items()])]
            if not len(rows):
                continue
            number = len(lists) + 1
            title = (f"Lowest CRoMa margins · {name}" if kind == "margins"
                     else f"Most confident IS errors · {name}")
            note = (f"The {len(rows)} cells with the lowest defined margins (panel scope), lowest first; beside "
                    "each, its nearest same-type/other-section (SO) and other-type/same-section (OS) neighbours."
                    if kind == "margins" else
                    f"The {len(rows)} IS test cells misclassified with the highest predicted-class probability "
                    "(over every unit and seed; a cell once, at its most confident), with their SO and OS "
                    "neighbours where the robustness stage scored them.")
            entries = [entry(rank, row, keys, sections, crop_um, folder, f"{number:02d}-{rank:02d}")
                       for rank, row in enumerate(rows.to_dict("records"), 1)]
            lists.append(GalleryList(kind, {k: str(v) for k, v in keys.items()}, title, note, entries))
    return lists


def list_conditions(frame: pd.DataFrame) -> list[dict]:
    """The (magnification, readout, taxonomy) conditions of a model's lists, in the vocabulary's order:
    those the robustness stage scored (so each margin list has its error list beside it), or the
    probe's where robustness scored none."""
    order = {"magnification": MAGNIFICATIONS, "readout": READOUTS, "taxonomy": TAXONOMIES}
    rows = frame[LIST_KEYS].drop_duplicates().to_dict("records")
    return sorted(rows, key=lambda row: [list(order[k]).index(row[k]) if row[k] in order[k] else len(order[k])
                                         for k in order])


def entry(rank: int, row: dict, keys: dict, sections: SectionCache, crop_um: float, folder: Path, stem: str) -> Entry:
    """One gallery cell's crops (the cell, its SO and OS neighbours) written as JPEG files."""
    mpp = MAGNIFICATION_MPP[keys["magnification"]]
    taxonomy = keys["taxonomy"]
    labels = sections.section(row["section_id"])["labels"]
    label = labels.loc[row["cell_id"]] if row["cell_id"] in labels.index else None
    lines = [f"{row['section_id']} · {row['cell_id']}"]
    if label is not None:
        lines.append(f"68-type: {label['type_68']}; Tfine: {label['fine']}")
    if "predicted_class" in row and isinstance(row.get("predicted_class"), str):
        lines.append(f"true {row['true_class']} → predicted {row['predicted_class']} ({row['confidence']:.2f})")
    if pd.notna(row.get("margin")):
        lines.append(f"CRoMa margin {row['margin']:.3f}")
    result = Entry(rank, Crop(row["section_id"], row["cell_id"], _write_crop(sections, row["section_id"], row["cell_id"],
                                                                             mpp, crop_um, folder, f"{stem}-cell"), lines))
    for kind in ("so", "os"):
        section_id, cell_id = row.get(f"{kind}_section_id"), row.get(f"{kind}_cell_id")
        if not isinstance(section_id, str) or not isinstance(cell_id, str):
            continue
        neighbour_labels = sections.section(section_id)["labels"]
        kind_label = neighbour_labels.loc[cell_id, taxonomy] if cell_id in neighbour_labels.index else "?"
        distance = row[f"{kind}_distance"]  # cosine; 3 significant digits, so a near-duplicate does not read as 0
        caption = [f"{kind.upper()} · {section_id} · {cell_id}", f"{kind_label}; cosine distance {distance:.3g}"]
        setattr(result, kind, Crop(section_id, cell_id, _write_crop(sections, section_id, cell_id, mpp, crop_um, folder,
                                                                    f"{stem}-{kind}"), caption))
    return result


def _write_crop(sections: SectionCache, section_id: str, cell_id: str, mpp: float, crop_um: float, folder: Path,
                stem: str) -> str:
    """Read, outline and write one crop; its path relative to the gallery folder."""
    section = sections.section(section_id)
    if cell_id not in section["obs"].index:
        raise InputError(f"cell {cell_id!r} of the gallery is not in the ingested section; rerun the pipeline "
                         "(dvc repro)", section=section_id)
    cell = section["obs"].loc[cell_id]
    geometry = crop_geometry((float(cell["he_x_px"]), float(cell["he_y_px"])), section["he_mpp"], mpp, crop_um)
    image = read_crop(section["reader"], geometry, mpp)
    polygon = polygon_vertices(section["shapes"].get(cell_id))
    outline = None if polygon is None else outline_crop_px(polygon, section["alignment"], section["pixel_size_um"],
                                                           geometry)
    path = folder / f"{stem}.jpg"
    path.write_bytes(thumbnail(image, outline))
    return f"{folder.name}/{path.name}"
