"""The failure gallery: per model, the cells it represents worst, shown.

Two lists per (model, magnification, readout, taxonomy):

- **lowest CRoMa margins** (``reports/robustness/margins.parquet``, panel scope): the defined
  margins lowest first, each with the nearest same-type/other-section (SO) and
  other-type/same-section (OS) neighbours that decided it;
- **most confident IS errors** (``reports/probe/is_errors.parquet``): the misclassified IS test
  cells with the highest predicted-class probability (a cell wrong in several seeds once, at its
  most confident), with the same neighbours where the robustness stage scored the cell.

Crops are squares of ``crop_um`` µm centred on the nucleus centroid (H&E level-0 px, from the
ingested table), read through tiatoolbox at the magnification's mpp (µm/px). A crop pixel is the
block of s = mpp / he_mpp level-0 pixels starting at ``origin + s·i``; the origin is chosen so the
central pixel's centre falls on the nucleus and rounded to a whole level-0 pixel (the centre is
then within 0.5 level-0 px of the nucleus). The nucleus outline is its polygon (Xenium µm) mapped
through the inverse alignment into those crop pixels.

Here: which cells, their captions, the crop geometry and the page; the sections are read and the
crops written by :mod:`cellpath.report.gallery_pages`.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.io.coords import um_to_he_px
from cellpath.vocabulary import MAGNIFICATIONS, READOUTS, TAXONOMIES, TAXONOMY_LABELS

#: The keys a gallery list is drawn for (one list of each kind per model and these).
LIST_KEYS = ["model", "magnification", "readout", "taxonomy"]
#: margins.parquet columns naming the neighbours that decided a margin.
NEIGHBOUR_COLUMNS = ["so_section_id", "so_cell_id", "so_distance", "os_section_id", "os_cell_id", "os_distance"]
#: Glass white, for crop pixels beyond the slide's edge (as feature extraction pads).
GLASS_PAD = 255
#: Thumbnails are upsampled by a whole factor until they are at least this wide (px); the page shows them at 160 px.
MIN_THUMBNAIL_PX = 160
OUTLINE_RGB = (255, 235, 0)


def lowest_margins(margins: pd.DataFrame, n: int) -> pd.DataFrame:
    """Per (model, magnification, readout, taxonomy) of the panel scope, the ``n`` lowest defined
    margins, lowest first (ties by section, then cell id)."""
    panel = margins[(margins["scope"] == "panel") & margins["margin"].notna()]
    ordered = panel.sort_values([*LIST_KEYS, "margin", "section_id", "cell_id"], kind="stable")
    return ordered.groupby(LIST_KEYS, sort=False).head(n).reset_index(drop=True)


def most_confident_errors(errors: pd.DataFrame, n: int) -> pd.DataFrame:
    """Per (model, magnification, readout, taxonomy), the ``n`` misclassified IS test cells with the
    highest predicted-class probability; a cell misclassified in several runs counts once, at its
    most confident (ties by section, then cell id)."""
    ordered = errors.sort_values([*LIST_KEYS, "confidence", "section_id", "cell_id"],
                                 ascending=[True] * len(LIST_KEYS) + [False, True, True], kind="stable")
    unique = ordered.drop_duplicates([*LIST_KEYS, "section_id", "cell_id"])
    return unique.groupby(LIST_KEYS, sort=False).head(n).reset_index(drop=True)


def errors_with_neighbours(errors: pd.DataFrame, margins: pd.DataFrame, n: int) -> pd.DataFrame:
    """The :func:`most_confident_errors` with each cell's panel-scope margin and SO / OS neighbours where
    the robustness stage scored it (NaN where it did not)."""
    keys = [*LIST_KEYS, "section_id", "cell_id"]
    panel = margins[margins["scope"] == "panel"][[*keys, "margin", *NEIGHBOUR_COLUMNS]]
    return most_confident_errors(errors, n).merge(panel, how="left", on=keys)


def list_conditions(frame: pd.DataFrame) -> list[dict]:
    """The (model, magnification, readout, taxonomy) conditions of a model's lists, in the vocabulary's
    order: those the robustness stage scored (so each margin list has its error list beside it), or
    the probe's where robustness scored none."""
    order = {"magnification": MAGNIFICATIONS, "readout": READOUTS, "taxonomy": TAXONOMIES}
    rows = frame[LIST_KEYS].drop_duplicates().to_dict("records")
    return sorted(rows, key=lambda row: [list(order[k]).index(row[k]) if row[k] in order[k] else len(order[k])
                                         for k in order])


def condition_rows(frame: pd.DataFrame, condition: dict) -> pd.DataFrame:
    """The rows of ``frame`` whose columns equal ``condition``'s values."""
    return frame[np.logical_and.reduce([frame[k] == v for k, v in condition.items()])]


def list_text(kind: str, condition: dict, n: int) -> tuple[str, str]:
    """The title and note of a list of ``kind`` ("margins" or "errors") with ``n`` cells."""
    taxonomy = TAXONOMY_LABELS.get(condition["taxonomy"], condition["taxonomy"])
    name = f"{condition['magnification']} {condition['readout']} {taxonomy}"
    if kind == "margins":
        return (f"Lowest CRoMa margins · {name}",
                f"The {n} cells with the lowest defined margins (panel scope), lowest first; beside each, its nearest "
                "same-type/other-section (SO) and other-type/same-section (OS) neighbours.")
    return (f"Most confident IS errors · {name}",
            f"The {n} IS test cells misclassified with the highest predicted-class probability (over every unit and "
            "seed; a cell once, at its most confident), with their SO and OS neighbours where the robustness stage "
            "scored them.")


def cell_lines(row: dict, label: pd.Series | None) -> list[str]:
    """A gallery cell's caption: section and cell id, its labels (``label``: its row of the section's
    labels, None if unlabelled), the misclassification and its CRoMa margin where known."""
    lines = [f"{row['section_id']} · {row['cell_id']}"]
    if label is not None:
        lines.append(f"68-type: {label['type_68']}; Tfine: {label['fine']}")
    if "predicted_class" in row and isinstance(row.get("predicted_class"), str):
        lines.append(f"true {row['true_class']} → predicted {row['predicted_class']} ({row['confidence']:.2f})")
    if pd.notna(row.get("margin")):
        lines.append(f"CRoMa margin {row['margin']:.3f}")
    return lines


def neighbour_lines(kind: str, section_id: str, cell_id: str, label: str, distance: float) -> list[str]:
    """An SO / OS neighbour's caption: which cell, its label and its cosine distance (3 significant
    digits, so a near-duplicate does not read as 0)."""
    return [f"{kind.upper()} · {section_id} · {cell_id}", f"{label}; cosine distance {distance:.3g}"]


@dataclass(frozen=True)
class CropGeometry:
    """Where a crop lies on the slide: level-0 ``origin`` (x, y) px, ``side`` crop px, ``scale`` level-0
    px per crop px (mpp / he_mpp)."""

    origin: tuple[int, int]
    side: int
    scale: float

    def to_crop_px(self, xy_level0: np.ndarray) -> np.ndarray:
        """Level-0 px (N, 2) → crop px (N, 2), pixel centres at whole numbers."""
        offset = (self.scale - 1.0) / 2.0  # level-0 centre of crop pixel 0 relative to the origin
        return (np.asarray(xy_level0, dtype=float) - np.asarray(self.origin, dtype=float) - offset) / self.scale


def crop_geometry(centre_level0: tuple[float, float], he_mpp: float, mpp: float, side_um: float) -> CropGeometry:
    """The crop of ``side_um`` µm at ``mpp`` µm/px whose central pixel is centred on ``centre_level0``."""
    side = max(1, int(round(side_um / mpp)))
    scale = mpp / he_mpp
    middle = (side - 1) / 2.0  # crop px of the centre
    origin = tuple(int(np.rint(c - middle * scale - (scale - 1.0) / 2.0)) for c in centre_level0)
    return CropGeometry(origin, side, scale)


def read_crop(reader, geometry: CropGeometry, mpp: float) -> np.ndarray:
    """(side, side, 3) uint8 RGB of a tiatoolbox reader at ``mpp``; beyond the slide's edge: glass."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiatoolbox warns when reading finer than the slide's mpp
        patch = reader.read_rect(location=geometry.origin, size=(geometry.side, geometry.side), resolution=mpp,
                                 units="mpp", pad_mode="constant", pad_constant_values=GLASS_PAD)
    return np.asarray(patch)[..., :3].astype(np.uint8)


def outline_crop_px(polygon_um: np.ndarray, alignment: np.ndarray, pixel_size_um: float,
                    geometry: CropGeometry) -> np.ndarray:
    """A nucleus polygon (N, 2) in Xenium µm → crop px, through the inverse of the H&E alignment."""
    return geometry.to_crop_px(um_to_he_px(polygon_um, alignment, pixel_size_um))


def thumbnail(image: np.ndarray, outline: np.ndarray | None) -> bytes:
    """A JPEG of the crop upsampled by a whole factor to at least :data:`MIN_THUMBNAIL_PX`, the nucleus
    outline drawn one pixel wide (crop px, pixel centres at whole numbers)."""
    from io import BytesIO

    from PIL import Image, ImageDraw

    factor = max(1, math.ceil(MIN_THUMBNAIL_PX / image.shape[1]))
    picture = Image.fromarray(image).resize((image.shape[1] * factor, image.shape[0] * factor), Image.NEAREST)
    if outline is not None and len(outline) >= 3:
        points = [tuple(p) for p in (np.asarray(outline) * factor + (factor - 1) / 2.0)]
        ImageDraw.Draw(picture).polygon(points, outline=OUTLINE_RGB)
    buffer = BytesIO()
    picture.save(buffer, format="JPEG", quality=90, subsampling=0)  # 4:4:4: a 1-px coloured line stays coloured
    return buffer.getvalue()


def polygon_vertices(geometry) -> np.ndarray | None:
    """The exterior ring (N, 2) of a shapely polygon (the largest part of a multipolygon), None if empty."""
    if geometry is None or geometry.is_empty:
        return None
    if geometry.geom_type == "MultiPolygon":
        geometry = max(geometry.geoms, key=lambda part: part.area)
    return np.asarray(geometry.exterior.coords)[:, :2]


def file_stem(text: str) -> str:
    """A file-name-safe form of a model name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def page_path(folder: Path, model: str) -> Path:
    """``<folder>/<model>.html``, the model's gallery page."""
    return Path(folder) / f"{file_stem(model)}.html"


@dataclass
class Crop:
    """One thumbnail on a page: the cell it shows, the file (relative to the gallery folder) and its
    caption lines."""

    section_id: str
    cell_id: str
    file: str
    lines: list[str]


@dataclass
class Entry:
    """One gallery cell: its crop and, where the robustness stage scored it, its SO and OS neighbours."""

    rank: int
    cell: Crop
    so: Crop | None = None
    os: Crop | None = None


@dataclass
class GalleryList:
    """One list of a page: lowest margins or most confident errors for one condition."""

    kind: str  # "margins" or "errors"
    condition: dict[str, str]  # LIST_KEYS → value
    title: str
    note: str
    entries: list[Entry] = field(default_factory=list)


def index_entry(page: str, lists: list[GalleryList]) -> dict:
    """A model's entry in ``gallery/index.json``: its page and, per list, kind, title and cell count."""
    return {"page": page, "lists": [{"kind": g.kind, "title": g.title, "cells": len(g.entries)} for g in lists]}


def cell_table(lists: list[GalleryList]) -> pd.DataFrame:
    """Every crop of a page's lists, one row each: list number, kind, condition, rank, role (cell, so,
    os), section, cell id and file (``gallery/cells.csv``)."""
    rows = []
    for number, gallery_list in enumerate(lists, 1):
        for entry in gallery_list.entries:
            for role in ("cell", "so", "os"):
                crop = getattr(entry, role)
                if crop is not None:
                    rows.append({"list": number, "kind": gallery_list.kind, **gallery_list.condition,
                                 "rank": entry.rank, "role": role, "section_id": crop.section_id,
                                 "cell_id": crop.cell_id, "file": crop.file})
    return pd.DataFrame(rows, columns=["list", "kind", *LIST_KEYS, "rank", "role", "section_id", "cell_id", "file"])


def render_page(model: str, lists: list[GalleryList], crop_um: float, m: int) -> str:
    """The model's page from ``templates/gallery.html.j2``."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(loader=PackageLoader("cellpath.report", "templates"), autoescape=select_autoescape(["j2"]),
                      trim_blocks=True, lstrip_blocks=True)
    return env.get_template("gallery.html.j2").render(model=model, lists=lists, crop_um=crop_um, m=m)
