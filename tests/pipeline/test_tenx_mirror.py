"""`dvc repro` on the 10x source from a local mirror: three tiny simulated sections of three XOA vintages,
zipped and laid out as 10x serves them (``<XOA version>/<Name>/<Name>_outs.zip``, the H&E image and its
alignment beside it) on a server at 127.0.0.1, listed in a manifest under 10x's own URLs, two of them with
MD5 sums. With ``tenx.mirror`` pointing at the server, validate, fetch, ingest and annotate run end to
end, and every file is asked of the mirror once (a corrupted file is refused by its MD5 in
tests/unit/sources/test_tenx_downloads.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from cellpath.config import parse_params
from cellpath.io.layout import label_summary_csv, raw_dir, section_index_csv, section_labels, section_zarr
from cellpath.sources.lock import read_lock
from cellpath.sources.synthetic import fetch_synthetic
from helpers.dvc_project import make_tiny_project, run
from helpers.http_server import serving
from helpers.tenx_mirror import ServedSection, manifest_row, serve_simulated, write_manifest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]

# (the section as 10x would publish it, the simulator's bundle vintage)
SECTIONS = (
    (ServedSection("mini_colon_v1", "Xenium_V1_Mini_Colon", "1.0.2", "Colon", "Colorectal cancer"), "xoa-1.0"),
    (ServedSection("mini_skin_v19", "Xenium_V1_Mini_Skin", "1.9.0", "Skin", "Normal"), "xoa-1.9"),
    (ServedSection("mini_colon_v3", "Xenium_Prime_Mini_Colon", "3.0.0", "Colon", "Normal"), "xoa-3.0"),
)
VERSIONS = {"xoa-1.0": "1.0.2", "xoa-1.9": "1.9.0.1", "xoa-3.0": "3.0.0.15"}  # the bundles' analysis_sw_version


def _simulate(params: dict, out: Path) -> Path:
    """The three sections and their organs' references, written by the simulator under ``out``."""
    synthetic = dict(params["synthetic"], sections=[
        {"section_id": s.section_id, "organ": s.organ, "status": s.status, "xenium_layout": layout}
        for s, layout in SECTIONS])
    config = parse_params({**params, "synthetic": synthetic}).synthetic
    fetch_synthetic(config, params["seed"], raw_dir(out), out / "references")
    return out


def _tenx_project(work: Path, simulated: Path, served: Path, mirror: str) -> Path:
    """The tiny project switched to the 10x source: a three-row manifest, tenx.mirror, the simulated
    references (mapped to the sections by name)."""
    rows = [manifest_row(section, served, md5=index != 1, rank=index + 1)
            for index, (section, _) in enumerate(SECTIONS)]
    rows[0]["he_alignment_url_source"] = "derived"  # as in the shipped manifest: fetched like any other URL
    write_manifest(work / "data" / "manifests" / "xenium_datasets.csv", rows)
    shutil.copytree(simulated / "references", work / "data" / "references")
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["source"] = "10x"
    params["tenx"].update(sections=[], retries=0, mirror=mirror)
    params["annotate"]["references"] = {section.section_id: section.organ.lower() for section, _ in SECTIONS}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return work


def test_dvc_repro_fetches_ingests_and_annotates_from_a_mirror(tmp_path: Path) -> None:
    work = make_tiny_project(tmp_path / "work")
    simulated = _simulate(yaml.safe_load((work / "params.yaml").read_text()), tmp_path / "simulated")
    served = tmp_path / "served"
    for section, _ in SECTIONS:
        serve_simulated(served, section, raw_dir(simulated) / section.section_id)
    with serving(served) as server:
        _tenx_project(work, simulated, served, server.base_url)
        log = run(["dvc", "repro", "annotate"], work)
    for stage in ("validate", "fetch", "ingest", "annotate"):
        assert f"Running stage '{stage}'" in log, log
    expected = sorted(section.relative(kind) for section, _ in SECTIONS
                      for kind in ("bundle", "he_image", "he_alignment"))
    assert sorted(path for path, _ in server.requests) == expected  # each file once, all from the mirror

    data = work / "data"
    index = pd.read_csv(section_index_csv(data)).set_index("section_id")
    assert sorted(index.index) == sorted(section.section_id for section, _ in SECTIONS)
    for index_row, (section, layout) in enumerate(SECTIONS):
        record = json.loads((raw_dir(data) / section.section_id / "section.json").read_text())
        assert record["source"] == "10x" and record["prefix"] == f"{section.name}_"
        assert record["files"]["bundle"]["verified"] == ("published checksum" if index_row != 1 else "first use")
        assert index.loc[section.section_id, "xenium_software"] == f"xenium-{VERSIONS[layout]}"
        assert section_zarr(data, section.section_id).is_dir()
        assert len(pd.read_parquet(section_labels(data, section.section_id))) > 0
    assert sorted(pd.read_csv(label_summary_csv(data))["section_id"]) == sorted(index.index)
    assert [p.name for p in (data / ".downloads").iterdir()] == [".fetch.lock"]  # each section's cache removed
    lock = read_lock(work / "data" / "manifests" / "xenium_datasets.lock.csv")  # every file's first download
    assert sorted(lock) == sorted((section.section_id, kind) for section, _ in SECTIONS
                                  for kind in ("bundle", "he_image", "he_alignment"))
