"""Feature store: per (encoder, magnification, section) base readouts on disk, with a sidecar.

Layout: ``data/features/<encoder>/<mag>/<section_id>/`` holding ``Nuc.npy``, ``Mean.npy`` and
(when the encoder has a CLS token) ``Cls.npy`` — float16, cells × D, rows in the section's cell
order — and ``sidecar.json`` describing how they were made. The folder is one artifact: it is
built under a temporary name and renamed when complete, so a crash leaves either the previous
artifact or none. Fusions (N+M, N+C, N∥M, N∥C) are computed on load, never stored.

A stored artifact is reused only when its sidecar matches what the caller would compute now
(encoder id and revision, magnification, tiling, code version, cell order); otherwise reading it
is an error naming the field that differs, and the extract stage recomputes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output

SIDECAR = "sidecar.json"
FEATURE_FORMAT_VERSION = 1
MATCHED_FIELDS = ("format", "encoder", "revision", "magnification", "target_mpp", "tiling", "code_version",
                  "cell_order_sha256")


def cell_order_digest(cell_ids: np.ndarray) -> str:
    """SHA-256 of the newline-joined cell ids: identifies the row order of every stored matrix."""
    return hashlib.sha256("\n".join(map(str, cell_ids)).encode()).hexdigest()


def artifact_dir(root: Path, encoder: str, magnification: str, section_id: str) -> Path:
    return Path(root) / encoder / magnification / section_id


def expected_sidecar(*, encoder: str, revision: str, magnification: str, target_mpp: float, tiling: dict,
                     code_version: str, cell_ids: np.ndarray) -> dict:
    """The sidecar fields an artifact must carry to be reused for this configuration."""
    return {
        "format": FEATURE_FORMAT_VERSION,
        "encoder": encoder,
        "revision": revision,
        "magnification": magnification,
        "target_mpp": float(target_mpp),
        "tiling": tiling,
        "code_version": code_version,
        "cell_order_sha256": cell_order_digest(cell_ids),
        "n_cells": int(len(cell_ids)),
    }


def write_artifact(folder: Path, readouts: dict[str, np.ndarray], sidecar: dict) -> None:
    """Write base readouts (float16) and the sidecar as one atomic folder."""
    n_cells = sidecar["n_cells"]
    shapes = {}
    with atomic_output(folder) as tmp:
        tmp.mkdir()
        for name, matrix in readouts.items():
            matrix = np.asarray(matrix)
            if matrix.ndim != 2 or matrix.shape[0] != n_cells:
                raise ValueError(f"{folder}: {name}: expected {n_cells} rows, got shape {matrix.shape}")
            if not np.all(np.isfinite(matrix)):
                raise ValueError(f"{folder}: {name}: {int((~np.isfinite(matrix)).any(axis=1).sum())} cells have NaN "
                                 f"or infinite features (encoder {sidecar.get('encoder')}); nothing was written")
            np.save(tmp / f"{name}.npy", matrix.astype(np.float16))
            shapes[name] = list(matrix.shape)
        (tmp / SIDECAR).write_text(json.dumps(sidecar | {"readouts": shapes}, indent=2, sort_keys=True) + "\n")


def read_sidecar(folder: Path) -> dict | None:
    path = Path(folder) / SIDECAR
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def sidecar_mismatch(found: dict | None, expected: dict) -> str | None:
    """None when ``found`` may be reused for ``expected``; else which field differs."""
    if found is None:
        return "no sidecar"
    for field in MATCHED_FIELDS:
        if found.get(field) != expected.get(field):
            return f"{field} is {found.get(field)!r}, expected {expected.get(field)!r}"
    return None


def is_complete(folder: Path, expected: dict) -> bool:
    """Whether a finished artifact for exactly this configuration exists (used to resume)."""
    return sidecar_mismatch(read_sidecar(folder), expected) is None


def open_artifact(folder: Path) -> dict[str, np.ndarray]:
    """The base readouts memory-mapped (float16, read-only), checked against the sidecar's shapes."""
    folder = Path(folder)
    sidecar = read_sidecar(folder)
    if sidecar is None:
        raise InputError("no feature artifact (sidecar.json missing or unreadable); run `cellpath extract`",
                         path=folder)
    out = {}
    for name, shape in sidecar["readouts"].items():
        try:
            matrix = np.load(folder / f"{name}.npy", mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read {name}.npy ({exc}); rerun `cellpath extract`", path=folder) from None
        if list(matrix.shape) != shape:
            raise InputError(f"{name}.npy has shape {list(matrix.shape)}, sidecar says {shape}", path=folder)
        out[name] = matrix
    return out


def read_artifact(folder: Path, expected: dict | None = None) -> dict[str, np.ndarray]:
    """Load the base readouts as float32; with ``expected``, refuse a stale or foreign artifact."""
    folder = Path(folder)
    if expected is not None:
        problem = sidecar_mismatch(read_sidecar(folder), expected)
        if problem and problem != "no sidecar":
            raise InputError(f"stale feature artifact: {problem}; rerun `cellpath extract`", path=folder / SIDECAR)
    return {name: np.asarray(matrix, dtype=np.float32) for name, matrix in open_artifact(folder).items()}
