"""The failure gallery's crops, read and written: the sections they come from (opened once each, on
first use) and each list's cells cropped from the registered H&E into JPEG files beside the model's
page. What is shown, and how it is captioned, is chosen in :mod:`cellpath.report.gallery` (pure)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.errors import InputError
from cellpath.io.layout import raw_dir, section_labels
from cellpath.io.sections import read_section_index, read_section_meta, read_section_obs
from cellpath.io.wsi import open_slide
from cellpath.report.gallery import (Crop, Entry, GalleryList, cell_lines, condition_rows, crop_geometry, file_stem,
                                     list_conditions, list_text, neighbour_lines, outline_crop_px, polygon_vertices,
                                     read_crop, thumbnail)
from cellpath.vocabulary import MAGNIFICATION_MPP


class SectionCache:
    """Per section, read on first use: the slide reader, nucleus positions (level-0 px), outlines
    (µm) and labels."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.index = read_section_index(data_dir).set_index("section_id")
        self._open: dict[str, dict] = {}
        self.circles = 0  # cells drawn with a circle of their nucleus area (no polygon in the bundle)

    def section(self, section_id: str) -> dict:
        """The section's reader, ``he_mpp`` (µm/px), alignment, ``pixel_size_um``, obs, outlines and labels."""
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


def model_lists(model: str, low: pd.DataFrame, wrong: pd.DataFrame, sections: SectionCache, crop_um: float,
                out: Path) -> list[GalleryList]:
    """The model's lists, condition by condition (margins first), their crops written under ``out``;
    ``low`` / ``wrong``: its lowest margins and most confident errors; ``crop_um``: a crop's side (µm)."""
    lists = []
    folder = out / file_stem(model)
    folder.mkdir(exist_ok=True)
    for condition in list_conditions(low if len(low) else wrong):
        for kind, frame in (("margins", low), ("errors", wrong)):
            rows = condition_rows(frame, condition)
            if not len(rows):
                continue
            number = len(lists) + 1
            title, note = list_text(kind, condition, len(rows))
            entries = [entry(rank, row, condition, sections, crop_um, folder, f"{number:02d}-{rank:02d}")
                       for rank, row in enumerate(rows.to_dict("records"), 1)]
            lists.append(GalleryList(kind, {k: str(v) for k, v in condition.items()}, title, note, entries))
    return lists


def entry(rank: int, row: dict, condition: dict, sections: SectionCache, crop_um: float, folder: Path,
          stem: str) -> Entry:
    """One gallery cell's crops (the cell, its SO and OS neighbours) written as JPEG files."""
    mpp = MAGNIFICATION_MPP[condition["magnification"]]
    labels = sections.section(row["section_id"])["labels"]
    label = labels.loc[row["cell_id"]] if row["cell_id"] in labels.index else None
    result = Entry(rank, Crop(row["section_id"], row["cell_id"],
                              write_crop(sections, row["section_id"], row["cell_id"], mpp, crop_um, folder,
                                         f"{stem}-cell"), cell_lines(row, label)))
    for kind in ("so", "os"):
        section_id, cell_id = row.get(f"{kind}_section_id"), row.get(f"{kind}_cell_id")
        if not isinstance(section_id, str) or not isinstance(cell_id, str):
            continue
        neighbour_labels = sections.section(section_id)["labels"]
        kind_label = neighbour_labels.loc[cell_id, condition["taxonomy"]] if cell_id in neighbour_labels.index else "?"
        caption = neighbour_lines(kind, section_id, cell_id, kind_label, row[f"{kind}_distance"])
        setattr(result, kind, Crop(section_id, cell_id, write_crop(sections, section_id, cell_id, mpp, crop_um, folder,
                                                                   f"{stem}-{kind}"), caption))
    return result


def write_crop(sections: SectionCache, section_id: str, cell_id: str, mpp: float, crop_um: float, folder: Path,
               stem: str) -> str:
    """Read, outline and write one crop (``crop_um`` µm at ``mpp`` µm/px); its path relative to the gallery folder."""
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
