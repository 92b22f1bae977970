"""The disk a plan prints per place, and DVC's time on the features from the measured rates."""

from __future__ import annotations

import pandas as pd
import pytest

from cellpath.planning.disk import (disk_plan, folder_raw_bytes, links_cache, manifest_raw_bytes,
                                    project_cache_type)
from cellpath.runtime.costs import StorageCosts

STORAGE = StorageCosts(hash_bytes_per_second=200e6, add_bytes_per_second={"links": 250e6, "copy": 100e6},
                       checkout_bytes_per_second={"links": 1e9, "copy": 125e6},
                       push_bytes_per_second={"links": 80e6, "copy": 160e6},
                       source="test rates")


@pytest.mark.parametrize(("cache_type", "links"), [
    ("hardlink,symlink", True), ("symlink", True), ("reflink,hardlink", True),
    (None, False),  # DVC's default, reflink then copy: a copy on ext4, NFS, Lustre, GPFS
    ("reflink,copy", False), ("hardlink,symlink,copy", False), ("copy", False)])
def test_outputs_are_links_only_when_no_copy_is_allowed(cache_type, links):
    assert links_cache(cache_type) is links


def test_the_project_cache_type_with_the_local_config_over_the_shared_one(tmp_path):
    dvc = tmp_path / ".dvc"
    dvc.mkdir()
    assert project_cache_type(dvc) is None
    (dvc / "config").write_text("[core]\n    remote = store\n[cache]\n    # links\n    type = hardlink,symlink\n")
    assert project_cache_type(dvc) == "hardlink,symlink"
    (dvc / "config.local").write_text("[cache]\n    type = copy\n")
    assert project_cache_type(dvc) == "copy"


def test_raw_bytes_count_only_sections_whose_every_file_size_is_known(tmp_path):
    manifest = tmp_path / "manifest.csv"
    pd.DataFrame({"section_id": ["a", "b", "c"], "bundle_bytes": [10, 20, None], "he_image_bytes": [1, 2, 3],
                  "he_alignment_bytes": [100, None, 300]}).to_csv(manifest, index=False)
    raw = manifest_raw_bytes(manifest, ["a", "b", "c", "missing"])
    assert (raw["bytes"], raw["known_sections"], raw["sections"]) == (111, 1, 4)
    (tmp_path / "raw" / "a" / "outs").mkdir(parents=True)
    (tmp_path / "raw" / "a" / "outs" / "cells.parquet").write_bytes(b"x" * 7)
    (tmp_path / "raw" / "a" / "he.ome.tif").write_bytes(b"x" * 5)
    raw = folder_raw_bytes(tmp_path / "raw", ["a", "b"])
    assert (raw["bytes"], raw["known_sections"], raw["sections"]) == (12, 1, 2)


def test_places_and_times_with_links_and_with_copies():
    raw = {"bytes": 40_000_000_000, "known_sections": 1, "sections": 25, "source": "manifest"}
    linked = disk_plan(3_700_000_000_000, 359_000_000_000, raw, STORAGE, "hardlink,symlink")
    assert linked["links"] and linked["workspace_bytes"] == 3_740_000_000_000
    assert linked["cache_extra_bytes"] == {"links": 0, "copy": 3_740_000_000_000}
    assert linked["remote_bytes"] == 3_740_000_000_000 and linked["patch_store_bytes"] == 359_000_000_000
    seconds = linked["seconds"]
    assert seconds["hash"] == pytest.approx(18_500)  # 3.7 TB at 200 MB/s
    assert seconds["add"] == pytest.approx({"links": 14_800, "copy": 37_000})
    assert seconds["checkout"] == pytest.approx({"links": 3_700, "copy": 29_600})
    assert seconds["push"] == pytest.approx({"links": 46_250, "copy": 23_125})
    copied = disk_plan(3_700_000_000_000, 0, raw, STORAGE, None)
    assert not copied["links"] and copied["cache_type"].startswith("reflink,copy")
    assert disk_plan(1, 0, raw, None, "hardlink")["seconds"] is None  # not measured: not guessed
