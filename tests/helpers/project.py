"""What the tests share: the project root, the hang guard and the tiny simulated panel's params."""

from __future__ import annotations

from pathlib import Path

from cellpath.config import Params, parse_params

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The only time limit a test may set: a guard against a hang, far above any run on a slow, loaded
# machine. No verdict depends on how fast anything runs.
HANG_GUARD_S = 1800

TINY_SECTIONS = [
    {"section_id": "breast_a", "organ": "Breast", "status": "Breast cancer", "registration_jitter_um": 2.0},
    {"section_id": "breast_b", "organ": "Breast", "status": "Breast cancer", "registration_jitter_um": 0.0},
    {"section_id": "tonsil_a", "organ": "Lymphoid", "status": "Lymphoid hyperplasia"},
]


def tiny_params(seed: int = 7, cells: int = 400, sections: list[dict] | None = None) -> Params:
    """Params for a small panel: few cells, few genes, all else as in params.yaml."""
    return parse_params({
        "source": "synthetic",
        "seed": seed,
        "synthetic": {
            "cells_per_section": cells,
            "panel_genes": 300,
            "reference_cells_per_type": 120,
            "sections": sections or TINY_SECTIONS,
        },
        "concordance": {"panel_sizes": [1, 2, 3]},
        "panel": "S3",
    })
