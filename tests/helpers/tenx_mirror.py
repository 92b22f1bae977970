"""A folder laid out as 10x serves Xenium files, and the manifest rows that name them, for tests of the
10x source: ``<XOA version>/<Name>/<Name>_outs.zip`` (the bundle, its members under ``outs/``),
``<Name>_he_image.ome.tif`` and ``<Name>_he_imagealignment.csv`` beside it."""

from __future__ import annotations

import csv
import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cellpath.sources.tenx import FILE_KINDS, SHIPPED_COLUMNS, TENX_SUFFIXES

TENX_ROOT = "https://cf.10xgenomics.com/samples/xenium"  # what tenx.mirror replaces in the test manifests
SIMULATOR_ONLY = ("section.json", "simulation.json", "simulation_truth.parquet")  # no 10x bundle has them


@dataclass(frozen=True)
class ServedSection:
    """One section as 10x publishes it: ``name`` is 10x's ``<Name>``, ``version`` the XOA version folder."""

    section_id: str
    name: str
    version: str
    organ: str = "Liver"
    status: str = "Normal"

    def relative(self, kind: str) -> str:
        """The file's path below the ``samples/xenium`` root."""
        return f"{self.version}/{self.name}/{self.name}{TENX_SUFFIXES[kind]}"


def write_served(root: Path, section: ServedSection, bundle: dict[str, bytes], he_image: bytes,
                 alignment: bytes) -> None:
    """Write the section's three files under ``root``; ``bundle`` maps member names (below ``outs/``) to bytes."""
    folder = root / section.version / section.name
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(root / section.relative("bundle"), "w") as zf:
        for name, data in sorted(bundle.items()):
            zf.writestr(f"outs/{name}", data)
    (root / section.relative("he_image")).write_bytes(he_image)
    (root / section.relative("he_alignment")).write_bytes(alignment)


def serve_simulated(root: Path, section: ServedSection, simulated: Path) -> None:
    """Package a simulated section folder (``cellpath.sources.synthetic``) as 10x ships it."""
    he_image = next(simulated.glob("*he_image.ome.tif"))
    alignment = next(simulated.glob("*he_imagealignment.csv"))
    bundle = {p.name: p.read_bytes() for p in sorted(simulated.iterdir())
              if p.is_file() and p not in (he_image, alignment) and p.name not in SIMULATOR_ONLY}
    write_served(root, section, bundle, he_image.read_bytes(), alignment.read_bytes())


def manifest_row(section: ServedSection, root: Path, *, md5: bool, rank: int = 1,
                 url_root: str = TENX_ROOT) -> dict[str, str]:
    """The manifest row naming the section's files at ``url_root``; with their MD5 sums when ``md5``."""
    row = dict.fromkeys(SHIPPED_COLUMNS, "")
    row.update(section_id=section.section_id, dataset=f"Dataset {section.name}", organ=section.organ,
               status=section.status, cells="100", agr_bacc="0.5", rank=str(rank), panel_s25="1",
               page_url=f"https://www.10xgenomics.com/datasets/{section.section_id}", prefix=f"{section.name}_",
               xoa_version=section.version)
    for kind in FILE_KINDS:
        row[f"{kind}_url"] = f"{url_root}/{section.relative(kind)}"
        row[f"{kind}_url_source"] = "test"
        if md5:
            row[f"{kind}_md5"] = hashlib.md5((root / section.relative(kind)).read_bytes()).hexdigest()
    return row


def write_manifest(path: Path, rows: list[dict[str, str]]) -> Path:
    """Write ``rows`` as a manifest CSV with the shipped manifest's columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=SHIPPED_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return path
