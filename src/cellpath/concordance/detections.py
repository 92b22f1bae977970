"""Nuclei detected on an H&E slide: the type CellViT++'s reader and the built-in detector both return."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True, eq=False)
class Detections:
    """Nuclei detected on one H&E slide: centres in level-0 px and their classes.

    ``label`` is the detector's own class name (PanNuke for CellViT++), ``coarse`` its Tcoarse
    class. Nuclei whose class has no Tcoarse class are not in the arrays; ``n_dropped`` counts them.
    """

    x_px: np.ndarray
    y_px: np.ndarray
    label: np.ndarray
    coarse: np.ndarray
    n_dropped: int = 0
    source: str = ""  # the file the detections were read from or made for

    def __post_init__(self) -> None:
        arrays = {"x_px": np.array(self.x_px, dtype=float), "y_px": np.array(self.y_px, dtype=float),
                  "label": np.array(self.label, dtype=object), "coarse": np.array(self.coarse, dtype=object)}
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1 or any(a.ndim != 1 for a in arrays.values()):
            raise ValueError(f"Detections arrays must be 1-D and of one length, got "
                             f"{ {k: a.shape for k, a in arrays.items()} }")
        for name, array in arrays.items():
            array.flags.writeable = False
            object.__setattr__(self, name, array)

    def __len__(self) -> int:
        return len(self.x_px)

    @property
    def xy(self) -> np.ndarray:
        """(N, 2) centres, level-0 px, columns x, y."""
        return np.column_stack([self.x_px, self.y_px])

    def to_frame(self) -> pd.DataFrame:
        """One row per nucleus: x_px, y_px, label, coarse."""
        return pd.DataFrame({"x_px": self.x_px, "y_px": self.y_px, "label": self.label, "coarse": self.coarse})
