"""references: the scRNA-seq references of data/manifests/references.csv (not a DVC stage).

``cellpath references list`` prints the 14 references, their shape and whether
``data/references/<name>.h5ad`` exists; ``cellpath references build <name> --from FILE…`` turns a
reference's downloaded files into that h5ad (cellpath.references.build), which annotate reads.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cellpath.annotation.assignment import CAVEATS
from cellpath.io.layout import reference_h5ad
from cellpath.references.build import BuildOptions, build_reference, write_reference
from cellpath.references.manifest import REFERENCE_MANIFEST, manifest_entry, read_reference_manifest

log = logging.getLogger(__name__)


def run_list(data_dir: Path, manifest: Path = REFERENCE_MANIFEST) -> str:
    """One line per manifest reference: name, state, shape, label column, built or not."""
    entries = read_reference_manifest(manifest)
    width = max(len(name) for name in entries)
    lines = [f"{'name':<{width}}  {'built':<5}  {'builder':<14}  {'labels':<28}  tissue / disease state"]
    for name, entry in entries.items():
        built = "yes" if reference_h5ad(data_dir, name).is_file() else "no"
        labels = f"{entry.labels_from}:{entry.label_column}" if entry.label_column else entry.labels_from or "unknown"
        caveat = " (see notes)" if name in CAVEATS else ""
        lines.append(f"{name:<{width}}  {built:<5}  {entry.builder:<14}  {labels:<28}  {entry.tissue_state}{caveat}")
    return "\n".join(lines)


def run_build(name: str, sources: list[Path], data_dir: Path, *, out: Path | None = None,
              manifest: Path = REFERENCE_MANIFEST, options: BuildOptions = BuildOptions()) -> str:
    """Build reference ``name`` from ``sources`` and write it to ``out`` (default
    ``data/references/<name>.h5ad``); return the build's summary."""
    entry = manifest_entry(read_reference_manifest(manifest), name, manifest)
    built = build_reference(entry, [Path(s) for s in sources], options)
    target = Path(out) if out is not None else reference_h5ad(data_dir, name)
    write_reference(built.adata, target)
    log.info("references: wrote %s", target)
    return "\n".join([*built.summary, f"written: {target}"])
