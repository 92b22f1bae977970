"""fetch: simulate (``source: synthetic``) or download (``source: 10x``) the raw panel into
``data/raw`` and ``data/references``."""

from __future__ import annotations

import logging
from pathlib import Path

from cellpath.config import Params
from cellpath.io.layout import downloads_dir, raw_dir, references_dir

log = logging.getLogger(__name__)


def run(params: Params, data_dir: Path) -> dict:
    """fetch: simulate (source: synthetic) or download (source: 10x) the raw panel."""
    if params.source == "synthetic":
        from cellpath.sources.synthetic import fetch_synthetic

        summary = fetch_synthetic(params.synthetic, params.seed, raw_dir(data_dir), references_dir(data_dir))
        log.info("fetch: %d simulated sections, %d references → %s, %s", len(summary["sections"]),
                 len(summary["references"]), raw_dir(data_dir), references_dir(data_dir))
        return summary
    from cellpath.sources.tenx import fetch_tenx

    references_dir(data_dir).mkdir(parents=True, exist_ok=True)
    return fetch_tenx(params.tenx, raw_dir(data_dir), downloads_dir(data_dir))
