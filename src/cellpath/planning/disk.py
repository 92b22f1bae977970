"""The disk a configuration needs, per place, and the time DVC spends on its features.

Places: the workspace's DVC-tracked outputs (raw sections and features priced; ingested sections,
labels and reports are small beside them and not priced), the DVC cache (no extra bytes where
outputs are links into it, docs/decisions/0041; every output a second time with ``cache.type
copy``), a remote (one copy of each pushed version) and the shared patch store (``data/.work``, not
under DVC). Times: the features' bytes over the rates ``benchmarks/bench_dvc_storage.py`` measured
(:class:`cellpath.runtime.costs.StorageCosts`), one ``dvc`` process. Bytes are bytes; times seconds.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from cellpath.runtime.costs import StorageCosts

RAW_FILE_BYTES = ("bundle_bytes", "he_image_bytes", "he_alignment_bytes")  # the manifest's per-file sizes
LINK_TYPES = ("hardlink", "symlink", "reflink")


def manifest_raw_bytes(manifest: Path, section_ids: list[str]) -> dict:
    """The raw downloads of ``section_ids`` from the manifest's file sizes: bytes of the sections whose
    every size is known, how many those are, and of how many."""
    table = pd.read_csv(manifest).set_index("section_id").reindex(section_ids)
    sizes = table[[c for c in RAW_FILE_BYTES if c in table.columns]]
    known = sizes.notna().all(axis=1) & (len(sizes.columns) == len(RAW_FILE_BYTES))
    return {"bytes": int(sizes[known].sum().sum()), "known_sections": int(known.sum()),
            "sections": len(section_ids), "source": f"{manifest}, {' + '.join(RAW_FILE_BYTES)}"}


def folder_raw_bytes(raw: Path, section_ids: list[str]) -> dict:
    """The raw downloads already in the data folder (``data/raw/<section>/``), as the files' sizes."""
    folders = [raw / s for s in section_ids if (raw / s).is_dir()]
    total = sum(p.stat().st_size for folder in folders for p in folder.rglob("*") if p.is_file())
    return {"bytes": total, "known_sections": len(folders), "sections": len(section_ids), "source": str(raw)}


def project_cache_type(dvc_dir: Path = Path(".dvc")) -> str | None:
    """``cache.type`` as this project's DVC config sets it (``config.local`` over ``config``), or None
    (DVC's default: reflink, else copy)."""
    from configobj import ConfigObj, ConfigObjError  # DVC's own config reader

    found = None
    for name in ("config", "config.local"):
        try:
            config = ConfigObj(str(dvc_dir / name), file_error=False)
        except ConfigObjError:
            continue
        value = config.get("cache", {}).get("type", found)
        found = ",".join(value) if isinstance(value, list) else value
    return found.strip() if found else None


def links_cache(cache_type: str | None) -> bool:
    """Whether outputs are links into the cache (no second copy) under this ``cache.type``: every
    listed type tried before a copy is a link type."""
    types = [t.strip() for t in (cache_type or "reflink,copy").split(",") if t.strip()]
    return bool(types) and "copy" not in types and all(t in LINK_TYPES for t in types)


def disk_plan(features_bytes: int, patch_store_bytes: int, raw: dict, storage: StorageCosts | None,
              cache_type: str | None) -> dict:
    """Bytes per place and DVC's seconds on the features (None where the rates were not measured)."""
    cached = features_bytes + raw["bytes"]
    plan = {"raw": raw, "features_bytes": features_bytes, "workspace_bytes": cached,
            "cache_type": cache_type or "reflink,copy (DVC's default)", "links": links_cache(cache_type),
            "cache_extra_bytes": {"links": 0, "copy": cached}, "remote_bytes": cached,
            "patch_store_bytes": patch_store_bytes, "seconds": None, "source": None}
    if storage is not None:
        plan["seconds"] = {
            "hash": features_bytes / storage.hash_bytes_per_second,
            "add": {side: features_bytes / rate for side, rate in storage.add_bytes_per_second.items()},
            "checkout": {side: features_bytes / rate for side, rate in storage.checkout_bytes_per_second.items()},
            "push": {side: features_bytes / rate for side, rate in storage.push_bytes_per_second.items()}}
        plan["rates"] = {"hash": storage.hash_bytes_per_second, "push": storage.push_bytes_per_second,
                         "add": storage.add_bytes_per_second, "checkout": storage.checkout_bytes_per_second}
        plan["source"] = storage.source
    return plan
