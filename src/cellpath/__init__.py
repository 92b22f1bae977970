"""CellPath-Bench + CRoMa: single-cell evaluation of frozen pathology foundation models."""

__version__ = "0.1.0"
