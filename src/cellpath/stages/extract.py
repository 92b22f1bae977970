"""extract: frozen-encoder features (Nuc, Mean, Cls) of every cell for one encoder at one
magnification, one executor task per section, into ``data/features/<slug>/<magnification>/``.
Patches are shared between encoders through ``data/.work/patches/`` (``extract.patch_cache``)."""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache, partial
from pathlib import Path

from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.io.atomic import atomic_output, prune_other_folders, remove_stale_temporaries
from cellpath.io.layout import extract_timing_json, features_dir, raw_dir
from cellpath.io.sections import read_section_table, sections_to_extract

log = logging.getLogger(__name__)


def run(params: Params, data_dir: Path, encoder_name: str, magnification: str) -> dict:
    """extract: features of one encoder (registry slug or name) at one magnification, one task per
    section (``executor``), into ``data/features/<slug>/<magnification>/``; sections whose artifact
    already carries the expected sidecar are not redone."""
    import torch

    from cellpath import __version__
    from cellpath.features.encoders.registry import load_registry, resolve_encoder
    from cellpath.features.extract import FEATURE_CODE_VERSION
    from cellpath.features.patch_cache import patch_store_path
    from cellpath.features.store import artifact_dir, expected_sidecar, is_complete
    from cellpath.features.tiling import place_section_cells
    from cellpath.runtime.executor import Task, run_tasks
    from cellpath.runtime.shards import work_dir
    from cellpath.vocabulary import MAGNIFICATION_MPP

    cfg = params.extract
    spec = resolve_encoder(load_registry(cfg.registry), encoder_name, where="--encoder", source=cfg.registry,
                           accept_names=True)
    if magnification not in MAGNIFICATION_MPP:
        raise InputError(f"unknown magnification {magnification!r}; valid: {', '.join(MAGNIFICATION_MPP)}")
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    target_mpp = MAGNIFICATION_MPP[magnification]
    weights_dir = Path(cfg.weights_dir).resolve()
    revision = None
    tasks, sizes = [], []
    root = features_dir(data_dir).resolve()
    for row in sections_to_extract(data_dir).itertuples():
        table = read_section_table(data_dir, row.section_id)
        placement = place_section_cells(table.obs, row._asdict(), target_mpp=target_mpp, input_size=spec.input_size)
        revision = revision or _encoder_revision(spec, weights_dir, cfg.device)
        expected = expected_sidecar(encoder=spec.name, revision=revision, magnification=magnification,
                                    target_mpp=target_mpp, tiling=placement.tiling_record(),
                                    code_version=f"{__version__}+features{FEATURE_CODE_VERSION}",
                                    cell_ids=table.obs_names.to_numpy())
        slide = (raw_dir(data_dir) / row.raw_folder / row.he_image).resolve()
        store = patch_store_path(work_dir(data_dir, "patches"), row.section_id, slide, placement.grid) \
            if cfg.patch_cache else None
        sizes.append((row.section_id, table.n_obs, len(set(placement.patch_index))))
        tasks.append(Task(f"extract-{spec.slug}-{magnification}-{row.section_id}", extract_section,
                          (cfg, weights_dir, spec, slide, float(row.he_mpp), placement, expected,
                           f"{spec.slug} {magnification} {row.section_id}", store),
                          artifact_dir(root, spec.slug, magnification, row.section_id),
                          is_complete=partial(is_complete, expected=expected), gpu=cfg.device == "cuda"))
    stale = prune_other_folders(root / spec.slug / magnification, {section_id for section_id, _, _ in sizes})
    outcomes = run_tasks(tasks, params.executor)
    remove_stale_temporaries(root / spec.slug / magnification)  # left by a worker that died while writing
    done, computed = [], []
    for (section_id, n_cells, n_patches), outcome in zip(sizes, outcomes):
        (computed if outcome.computed else done).append(section_id)
        if outcome.computed:
            log.info("extract %s %s %s: %d cells, %d patches in %.1f s", spec.slug, magnification, section_id,
                     n_cells, n_patches, outcome.seconds)
    if computed:
        _write_timing(params, data_dir, spec.slug, magnification, sizes, outcomes)
    log.info("extract %s %s: %d section(s) computed, %d reused, %d stale removed", spec.slug, magnification,
             len(computed), len(done), len(stale))
    return {"computed": computed, "reused": done, "removed": stale}


def _write_timing(params: Params, data_dir: Path, slug: str, magnification: str, sizes: list[tuple[str, int, int]],
                  outcomes: list) -> None:
    """Per-patch costs of the sections computed, to set beside `cellpath plan`'s estimate (in the work folder: no
    stage output)."""
    import torch

    from cellpath.runtime.shards import work_dir

    cfg = params.extract
    timing = {"encoder": slug, "magnification": magnification, "device": cfg.device,
              "batch_size": cfg.batch_size, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "executor": params.executor.backend, "workers": params.executor.workers,
              "sections": [{"section_id": section_id, "cells": n_cells, "patches": n_patches,
                            "seconds": round(outcome.seconds, 3)}
                           for (section_id, n_cells, n_patches), outcome in zip(sizes, outcomes) if outcome.computed]}
    work_dir(data_dir, "extract")  # created, with the .gitignore of the work folder
    with atomic_output(extract_timing_json(data_dir, slug, magnification)) as tmp:
        tmp.write_text(json.dumps(timing, indent=2) + "\n")


@lru_cache(maxsize=1)
def _cached_encoder(spec_json: str, weights_dir: Path, device: str):
    """The encoder of a process, loaded once for all the sections (tasks) this process extracts."""
    from cellpath.features.encoders.loading import load_encoder
    from cellpath.features.encoders.registry import EncoderSpec

    return load_encoder(EncoderSpec.model_validate_json(spec_json), weights_dir=weights_dir, device=device)


def _encoder_revision(spec, weights_dir: Path, device: str) -> str:
    """The revision load_encoder records for ``spec``, without loading a hub model's weights here."""
    from cellpath.features.encoders.loading import weights_revision
    from cellpath.features.encoders.weights import FILE_LOADERS, find_weights

    if spec.loader in FILE_LOADERS:  # the checkpoint's revision, as load_encoder records it
        return weights_revision(spec, find_weights(spec, weights_dir=weights_dir), weights_dir, None)
    return _cached_encoder(spec.model_dump_json(), weights_dir, device).revision  # offline, entry points


def extract_section(out: Path, cfg, weights_dir: Path, spec, slide: Path, slide_mpp: float, placement, expected: dict,
                    progress: str, patch_store: Path | None = None) -> None:
    """Task: one section's base readouts and sidecar, as the feature artifact folder ``out``; patches
    from (or into) the shared store ``patch_store`` when given."""
    from cellpath.features import store as feature_store
    from cellpath.features.extract import extract_cells
    from cellpath.io.wsi import open_slide

    encoder = _cached_encoder(spec.model_dump_json(), weights_dir, cfg.device)
    if encoder.revision != expected["revision"]:
        raise InputError(f"{spec.name}: the weights changed during extraction (revision {encoder.revision}, "
                         f"expected {expected['revision']}); rerun the extract stage", path=weights_dir)
    readouts = extract_cells(encoder, open_slide(slide, mpp=slide_mpp), placement, batch_size=cfg.batch_size,
                             progress=progress, patch_store=patch_store)
    feature_store.write_artifact(out, readouts, expected | {"weights": encoder.weights,
                                                            "n_patches": int(len(set(placement.patch_index)))})
