"""The evaluated cells of a panel and their features, as one table and matrices in the same row order.

The cell table has one row per eligible cell (a Tfine and a Tcoarse label) of the panel's sections
that annotation did not exclude, with a 0..n-1 index: ``section_id, organ, cell_id, x_um, y_um``
(nucleus centroid in the Xenium frame, µm), ``fine``, ``coarse``. Feature matrices are read from the
feature store for the same rows, after checking that each artifact was written for the section's
cell order (its sidecar's ``cell_order_sha256``) and holds only finite values.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.errors import InputError
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.readouts import compose_readout, readout_available, readout_bases
from cellpath.features.store import artifact_dir, cell_order_digest, open_artifact, read_sidecar
from cellpath.io.layout import features_dir, panels_csv, section_labels
from cellpath.io.sections import read_section_index, read_section_obs
from cellpath.runtime.executor import Task
from cellpath.runtime.shards import file_fingerprint, shard_task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PanelCells:
    """The evaluated cells, and what was left out (counts are reported, never silently dropped)."""

    cells: pd.DataFrame
    section_order: dict[str, np.ndarray]  # section_id → every cell id of the section, in stored order
    rows_in_section: dict[str, np.ndarray]  # section_id → positions (into section_order) of the kept cells
    excluded: dict[str, int]

    def digest(self) -> str:
        """Content digest of the evaluated cells and their rows in every section (part of the shard keys)."""
        hashed = hashlib.sha256(pd.util.hash_pandas_object(self.cells, index=True).to_numpy().tobytes())
        for section_id in sorted(self.section_order):
            hashed.update(section_id.encode() + b"\0")
            hashed.update("\n".join(map(str, self.section_order[section_id])).encode() + b"\0")
            hashed.update(np.asarray(self.rows_in_section[section_id], dtype=np.int64).tobytes())
        return hashed.hexdigest()[:16]


def panel_sections(data_dir: Path, panel: str) -> pd.DataFrame:
    """Sections of ``panel`` (data/panels.csv) that annotation did not exclude: section_id, organ."""
    path = panels_csv(data_dir)
    if not path.is_file():
        raise InputError("no panel table; run `cellpath concordance` first", path=path)
    panels = pd.read_csv(path)
    if panel not in panels.columns:
        built = [c for c in panels.columns if c.startswith("S") and c[1:].isdigit()]
        raise InputError(f"panel {panel!r} was not built (built: {', '.join(built)}); set `panel` in params.yaml "
                         "to one of them or add its size to concordance.panel_sizes", path=path)
    chosen = panels[panels[panel].astype(bool) & ~panels["excluded_by_annotation"].astype(bool)]
    if chosen.empty:
        raise InputError(f"panel {panel!r} has no section to evaluate", path=path)
    return chosen[["section_id", "organ"]].sort_values("section_id").reset_index(drop=True)


def load_panel_cells(data_dir: Path, panel: str) -> PanelCells:
    """Eligible cells of the panel's sections, in (section_id, stored cell order)."""
    data_dir = Path(data_dir)
    sections = panel_sections(data_dir, panel)
    known = set(read_section_index(data_dir)["section_id"])
    frames, order, kept_rows = [], {}, {}
    excluded = {"ineligible_or_uncertain": 0}
    for row in sections.itertuples():
        if row.section_id not in known:
            raise InputError("section in the panel table but not ingested; rerun `dvc repro`",
                             path=panels_csv(data_dir), section=row.section_id)
        labels_path = section_labels(data_dir, row.section_id)
        if not labels_path.is_file():
            raise InputError("no labels; run `cellpath annotate`", path=labels_path, section=row.section_id)
        labels = pd.read_parquet(labels_path, columns=["cell_id", "fine", "coarse", "eligible"])
        obs = read_section_obs(data_dir, row.section_id)
        if not np.array_equal(labels["cell_id"].to_numpy(), obs.index.to_numpy()):
            raise InputError("labels and the section table list different cells (or orders); rerun "
                             "`cellpath annotate`", path=labels_path, section=row.section_id)
        keep = (labels["eligible"].to_numpy(bool) & labels["fine"].notna().to_numpy()
                & labels["coarse"].notna().to_numpy())
        excluded["ineligible_or_uncertain"] += int((~keep).sum())
        order[row.section_id] = labels["cell_id"].to_numpy()
        kept_rows[row.section_id] = np.flatnonzero(keep)
        frames.append(pd.DataFrame({
            "section_id": row.section_id, "organ": row.organ, "cell_id": labels["cell_id"].to_numpy()[keep],
            "x_um": obs["nucleus_x_um"].to_numpy(float)[keep], "y_um": obs["nucleus_y_um"].to_numpy(float)[keep],
            "fine": labels["fine"].to_numpy()[keep], "coarse": labels["coarse"].to_numpy()[keep],
        }))
    cells = pd.concat(frames, ignore_index=True)
    log.info("panel %s: %d sections, %d evaluated cells (%d ineligible or uncertain left out)", panel,
             len(sections), len(cells), excluded["ineligible_or_uncertain"])
    return PanelCells(cells, order, kept_rows, excluded)


class PanelFeatures:
    """One encoder's base readouts at one magnification over the panel's rows, memory-mapped.

    The per-section float16 files stay on disk; :meth:`take` reads just the requested rows, as
    float32, composing fusions on the fly, so memory is set by what a caller asks for at a time,
    not by the panel. Row ``i`` is row ``i`` of ``panel.cells``. Opening checks every section's
    sidecar (present, written for the section's cell order, shapes); reading checks the rows it
    returns are finite.
    """

    def __init__(self, features_root: Path, encoder_slug: str, magnification: str, panel: PanelCells) -> None:
        self.label = f"encoder {encoder_slug}, {magnification}"
        self._files: list[dict[str, np.ndarray]] = []
        self._folders: list[Path] = []
        for section_id in panel.rows_in_section:
            folder = artifact_dir(features_root, encoder_slug, magnification, section_id)
            sidecar = read_sidecar(folder)
            if sidecar is None:
                raise InputError(f"no features for encoder {encoder_slug} at {magnification}; run "
                                 f"`dvc repro extract@{encoder_slug}-{magnification}`", path=folder, section=section_id)
            if sidecar.get("cell_order_sha256") != cell_order_digest(panel.section_order[section_id]):
                raise InputError(f"features of {encoder_slug} {magnification} were written for another cell order "
                                 "(sidecar cell_order_sha256 differs); rerun the extract stage", path=folder,
                                 section=section_id)
            self._files.append(open_artifact(folder))
            self._folders.append(folder)
        names = [set(files) for files in self._files]
        self.bases = tuple(sorted(set.union(*names))) if names else ()
        missing = [name for name in self.bases if not all(name in files for files in self._files)]
        if missing:
            raise InputError(f"readouts {', '.join(missing)} of {encoder_slug} {magnification} are missing for some "
                             "sections; rerun the extract stage",
                             path=Path(features_root) / encoder_slug / magnification)
        counts = [len(rows) for rows in panel.rows_in_section.values()]
        self._section_of_row = np.repeat(np.arange(len(counts)), counts)
        self._stored_row = (np.concatenate(list(panel.rows_in_section.values())) if counts
                            else np.zeros(0, dtype=np.int64))
        self._section_ids = list(panel.rows_in_section)
        self.n_rows = int(sum(counts))

    def base(self, name: str, rows: np.ndarray) -> np.ndarray:
        """float32 ``(len(rows), D)`` of base readout ``name`` at panel rows ``rows`` (any order)."""
        rows = np.asarray(rows, dtype=np.int64)
        width = self._files[0][name].shape[1] if self._files else 0
        out = np.empty((len(rows), width), dtype=np.float32)
        sections = self._section_of_row[rows]
        for k in np.unique(sections):
            at = np.flatnonzero(sections == k)
            chunk = np.asarray(self._files[k][name][self._stored_row[rows[at]]], dtype=np.float32)
            bad = ~np.isfinite(chunk).all(axis=1)
            if bad.any():
                raise InputError(f"{int(bad.sum())} cells have NaN or infinite {name} features ({self.label}); rerun "
                                 "the extract stage", path=self._folders[k] / f"{name}.npy",
                                 section=self._section_ids[k])
            out[at] = chunk
        return out

    def readout(self, readout: str) -> "ReadoutRows":
        """Rows of one readout (a base or a fusion, composed per request)."""
        return ReadoutRows(self, readout)


@dataclass(frozen=True)
class ReadoutRows:
    """One readout of :class:`PanelFeatures` as a row source: ``take(rows)`` → float32 (rows × width)."""

    features: PanelFeatures
    name: str

    def take(self, rows: np.ndarray) -> np.ndarray:
        """float32 ``(len(rows), width)``: only the base readouts this readout is made of are read."""
        missing = [name for name in readout_bases(self.name) if name not in self.features.bases]
        if missing:
            raise ValueError(f"readout {self.name} needs {', '.join(missing)}, which {self.features.label} lacks")
        bases = {name: self.features.base(name, rows) for name in readout_bases(self.name)}
        return np.asarray(compose_readout(self.name, bases.get("Nuc"), bases.get("Mean"), bases.get("Cls")),
                          dtype=np.float32)

    @property
    def width(self) -> int:
        return self.take(np.zeros(1, dtype=np.int64)).shape[1] if self.features.n_rows else 0

    def __len__(self) -> int:
        return self.features.n_rows


def panel_matrix(rows: ReadoutRows) -> np.ndarray:
    """A readout over every panel row, in memory (float32): for computations that need the whole matrix."""
    return rows.take(np.arange(len(rows)))


def encoder_patch_ids(data_dir: Path, panel: PanelCells, input_size: int, magnification: str) -> np.ndarray:
    """Per evaluated cell, ``"<section>:<patch index>"`` of the encoder patch that holds its nucleus
    at ``magnification`` for encoders with ``input_size`` px patches: the placement extraction uses
    (:func:`cellpath.features.tiling.place_section_cells`), recomputed from the section's geometry. Cells with the
    same id share every patch-level readout (Mean, Cls)."""
    from cellpath.features.tiling import place_section_cells
    from cellpath.vocabulary import MAGNIFICATION_MPP

    index = read_section_index(data_dir).set_index("section_id")
    parts = []
    for section_id, rows in panel.rows_in_section.items():
        obs = read_section_obs(data_dir, section_id)
        geometry = index.loc[section_id]
        placement = place_section_cells(obs, geometry, target_mpp=MAGNIFICATION_MPP[magnification],
                                        input_size=input_size)
        parts.append(np.char.add(f"{section_id}:", placement.patch_index[rows].astype(str)))
    return np.concatenate(parts) if parts else np.array([], dtype=str)


def feature_block_tasks(stage: str, basis: dict, context: Path, data_dir: Path, panel: PanelCells,
                        encoders: list[EncoderSpec], magnifications: list[str], readouts: list[str],
                        body: Callable[..., None], cfg: object, work: Path, *, gpu: bool) -> list[Task]:
    """One shard task per (encoder, magnification) with at least one of ``readouts`` available, as the
    probe and expression stages make them: ``body(out, context, features, spec, magnification, cfg)``,
    keyed by ``basis`` plus the encoder's registry row, the magnification and a fingerprint of the
    panel sections' feature files (so a shard is reused only for exactly these features)."""
    features = features_dir(data_dir).resolve()
    tasks = []
    for spec in encoders:
        if not any(readout_available(spec, readout) for readout in readouts):
            continue
        for magnification in magnifications:
            inputs = file_fingerprint([artifact_dir(features, spec.slug, magnification, section_id)
                                       for section_id in panel.rows_in_section])
            material = basis | {"encoder": spec.model_dump(mode="json"), "magnification": magnification,
                                "features": inputs}
            tasks.append(shard_task(stage, f"{spec.slug} {magnification}", material, body,
                                    (context, features, spec, magnification, cfg), work, gpu=gpu))
    return tasks
