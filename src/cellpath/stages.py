"""Stage entry points: bind validated params to the modules and do the stage's I/O bookkeeping."""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
import pandas as pd

from cellpath.atomic import atomic_output, prune_other_folders, remove_stale_temporaries
from cellpath.config import Params
from cellpath.errors import InputError
from cellpath.sections import read_section_index, read_section_table, sections_dir

log = logging.getLogger(__name__)


def raw_dir(data_dir: Path) -> Path:
    return data_dir / "raw"


def references_dir(data_dir: Path) -> Path:
    return data_dir / "references"


def labels_dir(data_dir: Path) -> Path:
    return data_dir / "labels"


def run_fetch(params: Params, data_dir: Path) -> dict:
    """fetch: simulate (source: synthetic) or download (source: 10x) the raw panel."""
    if params.source == "synthetic":
        from cellpath.sources.synthetic import fetch_synthetic

        summary = fetch_synthetic(params.synthetic, params.seed, raw_dir(data_dir), references_dir(data_dir))
        log.info("fetch: %d simulated sections, %d references → %s, %s", len(summary["sections"]),
                 len(summary["references"]), raw_dir(data_dir), references_dir(data_dir))
        return summary
    from cellpath.sources.tenx import fetch_tenx

    references_dir(data_dir).mkdir(parents=True, exist_ok=True)
    return fetch_tenx(params.tenx, raw_dir(data_dir), data_dir / ".downloads")


def raw_section_folders(data_dir: Path) -> list[Path]:
    """Raw section folders (those holding section.json), sorted by name."""
    root = raw_dir(data_dir)
    if not root.is_dir():
        raise InputError("no raw data; run `cellpath fetch` (or `dvc repro fetch`) first", path=root)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise InputError("no section folders; run `cellpath fetch` first", path=root)
    return folders


def run_ingest(params: Params, data_dir: Path) -> pd.DataFrame:
    """ingest: every raw section → data/sections/<section_id>.zarr, plus data/sections/sections.csv."""
    from cellpath.ingest import ingest_section

    out = sections_dir(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    rows = [ingest_section(folder, out) for folder in raw_section_folders(data_dir)]
    index = pd.DataFrame(rows).sort_values("section_id").reset_index(drop=True)
    with atomic_output(out / "sections.csv") as tmp:
        index.to_csv(tmp, index=False)
    log.info("ingest: %d sections, %d cells → %s", len(index), int(index["n_cells"].sum()), out)
    return index



def _reference_path(params: Params, data_dir: Path, section_id: str, organ: str) -> Path:
    name = params.annotate.references.get(section_id, organ.lower())
    path = references_dir(data_dir) / f"{name}.h5ad"
    if not path.is_file():
        available = sorted(p.stem for p in references_dir(data_dir).glob("*.h5ad"))
        raise InputError(
            f"no reference {name!r} for organ {organ!r} (available: {', '.join(available) or 'none'}); "
            f"add one to {references_dir(data_dir)} or map the section in annotate.references",
            path=path, section=section_id)
    return path


def run_annotate(params: Params, data_dir: Path, reports: Path) -> pd.DataFrame:
    """annotate: labels per section, the per-section summary, marker QC, and (simulated) accuracy."""
    from cellpath.annotate import against_truth, label_frame, section_summary
    from cellpath.marker_qc import marker_enrichment
    from cellpath.transfer import UNCERTAIN, check_counts, fit_transfer, load_reference, transfer_labels

    cfg = params.annotate
    index = read_section_index(data_dir)
    models: dict[tuple[str, tuple[str, ...]], object] = {}
    references: dict[Path, object] = {}
    summaries, qc_tables, truth_rows = [], [], []
    with atomic_output(labels_dir(data_dir)) as out:
        out.mkdir()
        for row in index.itertuples():
            section_id = row.section_id
            table = read_section_table(data_dir, section_id)
            counts = check_counts(table.X, "Xenium counts", sections_dir(data_dir) / f"{section_id}.zarr", section_id)
            genes = tuple(map(str, table.var_names))
            ref_path = _reference_path(params, data_dir, section_id, row.organ)
            if ref_path not in references:
                references[ref_path] = load_reference(ref_path, cfg.label_column, cfg.label_vocabulary)
            reference = references[ref_path]
            key = (reference.name, genes)
            if key not in models:
                models[key] = fit_transfer(reference, genes, regularisation_c=cfg.regularisation_c,
                                           min_shared_genes=cfg.min_shared_genes, section=section_id)
            transferred = transfer_labels(models[key], counts, genes, cfg.confidence_threshold)
            labels = label_frame(section_id, table.obs_names.to_numpy(), transferred)
            labels.to_parquet(out / f"{section_id}.parquet", index=False)
            summary = section_summary(labels, organ=row.organ, reference=reference.name,
                                      min_cells_per_coarse_class=cfg.min_cells_per_coarse_class)
            summaries.append(summary)
            qc = marker_enrichment(labels["type_68"].to_numpy(), counts, genes, min_cells=cfg.marker_min_cells,
                                   min_log_fold_change=cfg.marker_min_log_fold_change, skip=(UNCERTAIN,))
            qc_tables.append(qc.assign(section_id=section_id))
            truth_path = raw_dir(data_dir) / section_id / "simulation_truth.parquet"
            if truth_path.is_file():
                truth_rows.append(against_truth(labels, pd.read_parquet(truth_path)))
            log.info("annotate %s: %d cells, %d eligible, %d uncertain, mapping %s%s", section_id,
                     summary["n_cells"], summary["n_eligible"], summary["n_uncertain"], summary["mapping"],
                     f", EXCLUDED: {summary['exclusion_reason']}" if summary["excluded"] else "")
        summary_frame = pd.DataFrame(summaries)
        summary_frame.to_csv(out / "summary.csv", index=False)
        qc_frame = pd.concat(qc_tables, ignore_index=True)
        qc_frame = qc_frame[["section_id", *[c for c in qc_frame.columns if c != "section_id"]]]
        qc_frame.to_csv(out / "marker_qc.csv", index=False)
    flagged = qc_frame[qc_frame["status"] == "not_enriched"]
    log.info("annotate: %d sections (%d excluded), %d type(s) flagged by marker QC", len(summary_frame),
             int(summary_frame["excluded"].sum()), len(flagged))
    _write_truth_report(truth_rows, reports / "annotation")
    return summary_frame


def _write_truth_report(rows: list[dict], folder: Path) -> None:
    """reports/annotation/: transfer quality against the simulator's truth (empty for real data)."""
    frame = pd.DataFrame(rows)
    with atomic_output(folder) as out:
        out.mkdir()
        frame.to_csv(out / "against_truth.csv", index=False)
        metrics = {"sections_with_truth": len(frame)}
        if len(frame):
            metrics |= {f"mean_{k}": round(float(frame[k].mean()), 4)
                        for k in ("accuracy_68", "tfine_accuracy", "tfine_macro_f1", "uncertain_fraction")}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def features_dir(data_dir: Path) -> Path:
    return data_dir / "features"


def sections_to_extract(data_dir: Path) -> pd.DataFrame:
    """Ingested sections that annotation did not exclude (with their H&E geometry)."""
    index = read_section_index(data_dir)
    summary_path = labels_dir(data_dir) / "summary.csv"
    if not summary_path.is_file():
        raise InputError("no label summary; run `cellpath annotate` first", path=summary_path)
    summary = pd.read_csv(summary_path)
    excluded = set(summary.loc[summary["excluded"], "section_id"])
    if excluded:
        log.info("extract: skipping %d section(s) excluded by annotation: %s", len(excluded), ", ".join(sorted(excluded)))
    return index[~index["section_id"].isin(excluded)].reset_index(drop=True)


def run_extract(params: Params, data_dir: Path, encoder_name: str, magnification: str) -> dict:
    """extract: features of one encoder at one magnification, one task per section (``executor``);
    sections whose artifact already carries the expected sidecar are not redone."""
    import torch

    from cellpath import __version__
    from cellpath.encoders.registry import load_registry
    from cellpath.executor import Task, run_tasks
    from cellpath.feature_store import artifact_dir, expected_sidecar, is_complete
    from cellpath.features import FEATURE_CODE_VERSION, MAGNIFICATIONS, place_cells

    cfg = params.extract
    registry = load_registry(cfg.registry)
    by_slug = {spec.slug: spec for spec in registry.values()}
    spec = by_slug.get(encoder_name)
    if spec is None:
        hint = f"; use its slug {registry[encoder_name].slug!r} (it names the DVC output folder)" \
            if encoder_name in registry else f"; known: {', '.join(sorted(by_slug))}"
        raise InputError(f"extract.encoders: unknown encoder slug {encoder_name!r}{hint}", path=cfg.registry)
    if magnification not in MAGNIFICATIONS:
        raise InputError(f"unknown magnification {magnification!r}; valid: {', '.join(MAGNIFICATIONS)}")
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    target_mpp = MAGNIFICATIONS[magnification]
    weights_dir = Path(cfg.weights_dir).resolve()
    revision = None
    tasks, sizes = [], []
    root = features_dir(data_dir).resolve()
    for row in sections_to_extract(data_dir).itertuples():
        table = read_section_table(data_dir, row.section_id)
        placement = place_cells(
            table.obs[["he_x_px", "he_y_px"]].to_numpy(), table.obs["nucleus_area"].to_numpy(dtype=float),
            slide_size=(int(row.he_width_px), int(row.he_height_px)), slide_mpp=float(row.he_mpp),
            target_mpp=target_mpp, input_size=spec.input_size)
        revision = revision or _encoder_revision(spec, weights_dir, cfg.device)
        expected = expected_sidecar(encoder=spec.name, revision=revision, magnification=magnification,
                                    target_mpp=target_mpp, tiling=placement.tiling_record(),
                                    code_version=f"{__version__}+features{FEATURE_CODE_VERSION}",
                                    cell_ids=table.obs_names.to_numpy())
        slide = (raw_dir(data_dir) / row.raw_folder / row.he_image).resolve()
        sizes.append((row.section_id, table.n_obs, len(set(placement.patch_index))))
        tasks.append(Task(f"extract-{spec.slug}-{magnification}-{row.section_id}", extract_section,
                          (cfg, weights_dir, spec, slide, float(row.he_mpp), placement, expected,
                           f"{spec.slug} {magnification} {row.section_id}"),
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
    if computed:  # per-patch costs for `cellpath plan` (the work folder: no stage output)
        from cellpath.shards import work_dir

        timing = {"encoder": spec.slug, "magnification": magnification, "device": cfg.device,
                  "batch_size": cfg.batch_size, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                  "executor": params.executor.backend, "workers": params.executor.workers,
                  "sections": [{"section_id": section_id, "cells": n_cells, "patches": n_patches,
                                "seconds": round(outcome.seconds, 3)}
                               for (section_id, n_cells, n_patches), outcome in zip(sizes, outcomes)
                               if outcome.computed]}
        with atomic_output(work_dir(data_dir, "extract") / f"{spec.slug}-{magnification}.timing.json") as tmp:
            tmp.write_text(json.dumps(timing, indent=2) + "\n")
    log.info("extract %s %s: %d section(s) computed, %d reused, %d stale removed", spec.slug, magnification,
             len(computed), len(done), len(stale))
    return {"computed": computed, "reused": done, "removed": stale}


@lru_cache(maxsize=1)
def _cached_encoder(spec_json: str, weights_dir: Path, device: str):
    """The encoder of a process, loaded once for all the sections (tasks) this process extracts."""
    from cellpath.encoders.loading import load_encoder
    from cellpath.encoders.registry import EncoderSpec

    return load_encoder(EncoderSpec.model_validate_json(spec_json), weights_dir=weights_dir, device=device)


def _encoder_revision(spec, weights_dir: Path, device: str) -> str:
    """The revision load_encoder records for ``spec``, without loading a hub model's weights here."""
    from cellpath.encoders.loading import find_weights

    if spec.loader == "timm":
        return find_weights(spec, weights_dir=weights_dir).revision
    return _cached_encoder(spec.model_dump_json(), weights_dir, device).revision  # offline: cheap to build


def extract_section(out: Path, cfg, weights_dir: Path, spec, slide: Path, slide_mpp: float, placement, expected: dict,
                    progress: str) -> None:
    """Task: one section's base readouts and sidecar, as the feature artifact folder ``out``."""
    from cellpath import feature_store
    from cellpath.features import extract_cells
    from cellpath.wsi import open_slide

    encoder = _cached_encoder(spec.model_dump_json(), weights_dir, cfg.device)
    if encoder.revision != expected["revision"]:
        raise InputError(f"{spec.name}: the weights changed during extraction (revision {encoder.revision}, "
                         f"expected {expected['revision']}); rerun the extract stage", path=weights_dir)
    readouts = extract_cells(encoder, open_slide(slide, mpp=slide_mpp), placement, batch_size=cfg.batch_size,
                             progress=progress)
    feature_store.write_artifact(out, readouts, expected | {"weights": encoder.weights,
                                                            "n_patches": int(len(set(placement.patch_index)))})


def _detections_for(params: Params, data_dir: Path, row) -> object:
    """CellViT++ detections when concordance.cellvit_dir is set, else the built-in detector's."""
    slide = raw_dir(data_dir) / row.raw_folder / row.he_image
    cellvit_dir = params.concordance.cellvit_dir
    if cellvit_dir is not None:
        from cellpath.cellvit import find_cellvit_output, read_cellvit

        path = find_cellvit_output(cellvit_dir, row.section_id, wsi_name=row.he_image)
        return read_cellvit(path, slide_mpp=float(row.he_mpp),
                            slide_dimensions=(int(row.he_width_px), int(row.he_height_px)))
    from cellpath.detector import detect_nuclei

    return detect_nuclei(slide, mpp=float(row.he_mpp))


def run_concordance(params: Params, data_dir: Path, reports: Path) -> pd.DataFrame:
    """concordance: AGR-BAcc per section, the ranking, and the nested panels (data/panels.csv)."""
    from cellpath.concordance import agr_bacc, mutual_nearest_neighbours, nested_panels, rank_sections

    cfg = params.concordance
    index = read_section_index(data_dir)
    summary = pd.read_csv(labels_dir(data_dir) / "summary.csv").set_index("section_id")
    rows = []
    for row in index.itertuples():
        table = read_section_table(data_dir, row.section_id)
        labels = pd.read_parquet(labels_dir(data_dir) / f"{row.section_id}.parquet").set_index("cell_id")
        coarse = labels.loc[table.obs_names, "coarse"].to_numpy()
        detections = _detections_for(params, data_dir, row)
        cap_px = cfg.max_match_distance_um / float(row.he_mpp)
        pairs, pred_unmatched, ref_unmatched = mutual_nearest_neighbours(
            detections.xy, table.obs[["he_x_px", "he_y_px"]].to_numpy(), cap_px)
        truth = coarse[pairs[:, 1]]
        scored = np.array([c is not None and c == c for c in truth], dtype=bool)
        excluded = bool(summary.loc[row.section_id, "excluded"])
        score = None if excluded else agr_bacc(truth[scored], detections.coarse[pairs[scored, 0]])
        rows.append({"section_id": row.section_id, "organ": row.organ, "score": score,
                     "n_detected": len(detections), "n_dropped_detections": detections.n_dropped,
                     "n_xenium": table.n_obs, "n_matched": len(pairs), "n_matched_scored": int(scored.sum()),
                     "n_detected_unmatched": pred_unmatched, "n_xenium_unmatched": ref_unmatched,
                     "excluded_by_annotation": excluded, "cells": table.n_obs})
        log.info("concordance %s: %d detected, %d matched (%d with a Tcoarse label), AGR-BAcc %s", row.section_id,
                 len(detections), len(pairs), int(scored.sum()), "undefined" if score is None else f"{score:.3f}")
    ranked = rank_sections(pd.DataFrame(rows))
    try:
        panels = nested_panels(ranked, list(cfg.panel_sizes))
    except ValueError as exc:  # more panel sections than ranked ones (annotation excluded some)
        from cellpath.errors import ConfigError

        raise ConfigError(f"concordance.panel_sizes: {exc} (sections excluded by annotation have no score)") from None
    with atomic_output(data_dir / "panels.csv") as tmp:
        panels.to_csv(tmp, index=False)
    with atomic_output(reports / "concordance") as out:
        out.mkdir()
        panels.to_csv(out / "concordance.csv", index=False)
        metrics = {"sections_ranked": int(panels["rank"].notna().sum()),
                   "mean_agr_bacc": round(float(panels["score"].mean()), 4),
                   "panel": params.panel, "panel_sections": int(panels[params.panel].sum())}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("concordance: %d sections ranked; %s", metrics["sections_ranked"],
             ", ".join(f"{c}={int(panels[c].sum())}" for c in panels.columns if c.startswith("S")))
    return panels
