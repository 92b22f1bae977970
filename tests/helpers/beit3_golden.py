"""The golden BEiT-3 case (``tests/unit/features/golden/beit3_tiny.json``): its weights and input,
drawn from numpy's seeded generator so the reference script and the test make the same ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).parents[1] / "unit" / "features" / "golden" / "beit3_tiny.json"
SEED = 20261202


def golden_weights(shapes: dict[str, list[int]], seed: int = SEED) -> dict[str, np.ndarray]:
    """Every tensor 0.2·N(0, 1), drawn in sorted key order from one seeded generator."""
    rng = np.random.default_rng(seed)
    return {key: np.asarray(0.2 * rng.standard_normal(shapes[key]), dtype=np.float32) for key in sorted(shapes)}


def golden_input(img_size: int, seed: int = SEED) -> np.ndarray:
    """(2, 3, S, S) normalised pixels, N(0, 1)."""
    return np.random.default_rng(seed + 1).standard_normal((2, 3, img_size, img_size)).astype(np.float32)


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())
