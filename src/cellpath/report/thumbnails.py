"""H&E crops with nuclei coloured by Tfine label, for the report's data section.

The crop is a square of ``side_um`` µm centred on the median nucleus position of the section
(H&E level-0 px from the ingested table), read through tiatoolbox at ``mpp`` µm/px, so its pixel
grid is independent of the scan's own resolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.io.layout import section_labels
from cellpath.io.sections import read_section_obs
from cellpath.io.wsi import open_slide


@dataclass(frozen=True)
class Thumbnail:
    """An RGB crop at ``mpp`` µm/px and the labelled nuclei inside it (crop px: x_px, y_px, fine)."""

    section_id: str
    image: np.ndarray
    points: pd.DataFrame
    mpp: float
    n_unlabelled: int


def crop_bounds(xy_level0: np.ndarray, slide_size: tuple[int, int], side_px: float) -> tuple[int, int, int, int]:
    """Level-0 (x0, y0, x1, y1) of a ``side_px`` square around the median point, kept inside the slide."""
    width, height = slide_size
    side = int(min(side_px, width, height))
    cx, cy = np.median(xy_level0, axis=0)
    x0 = int(np.clip(round(cx - side / 2), 0, width - side))
    y0 = int(np.clip(round(cy - side / 2), 0, height - side))
    return x0, y0, x0 + side, y0 + side


def section_thumbnail(data_dir: Path, raw_dir: Path, section: pd.Series, side_um: float, mpp: float) -> Thumbnail:
    """The crop and its labelled nuclei for one row of the section index."""
    obs = read_section_obs(data_dir, section["section_id"])
    labels = pd.read_parquet(section_labels(data_dir, section["section_id"]), columns=["cell_id", "fine"])
    xy = obs[["he_x_px", "he_y_px"]].to_numpy(float)
    he_mpp = float(section["he_mpp"])
    x0, y0, x1, y1 = crop_bounds(xy, (int(section["he_width_px"]), int(section["he_height_px"])), side_um / he_mpp)
    slide = open_slide(Path(raw_dir) / section["raw_folder"] / section["he_image"], mpp=he_mpp)
    image = np.asarray(slide.read_bounds((x0, y0, x1, y1), resolution=mpp, units="mpp"))[..., :3]
    inside = (xy[:, 0] >= x0) & (xy[:, 0] < x1) & (xy[:, 1] >= y0) & (xy[:, 1] < y1)
    fine = labels.set_index("cell_id")["fine"].reindex(obs.index).to_numpy()
    scale = he_mpp / mpp
    points = pd.DataFrame({"x_px": (xy[inside, 0] - x0) * scale, "y_px": (xy[inside, 1] - y0) * scale,
                           "fine": fine[inside]})
    labelled = points["fine"].notna()
    return Thumbnail(section["section_id"], image, points[labelled].reset_index(drop=True), mpp,
                     int((~labelled).sum()))
