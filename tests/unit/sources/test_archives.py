"""safe_extract on hostile archives: each class refused in every order of its members, with nothing
created, changed or removed anywhere around the destination afterwards."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from cellpath.errors import DownloadError
from cellpath.sources.archives import archive_format, safe_extract


@dataclass(frozen=True)
class Entry:
    """One archive member: a file (``data``), a folder, or a link / special file (``kind``, ``target``)."""

    name: str
    data: bytes = b""
    kind: str = "file"  # file | folder | symlink | hardlink | char | block | fifo
    target: str = ""


NUL_STAND_IN = "\x01"  # zipfile cuts a name it writes at a NUL: written as this, then patched to a NUL


def _zip(path: Path, entries: list[Entry]) -> Path:
    modes = {"file": stat.S_IFREG | 0o644, "folder": stat.S_IFDIR | 0o755, "symlink": stat.S_IFLNK | 0o777,
             "char": stat.S_IFCHR | 0o644, "block": stat.S_IFBLK | 0o644, "fifo": stat.S_IFIFO | 0o644}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for entry in entries:
            info = zipfile.ZipInfo(entry.name.replace("\0", NUL_STAND_IN) + ("/" if entry.kind == "folder" else ""))
            info.external_attr = modes[entry.kind] << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with _quiet_duplicates():
                zf.writestr(info, entry.target.encode() if entry.kind == "symlink" else entry.data)
    data = path.read_bytes()
    for entry in entries:  # the name in the local and the central header
        if "\0" in entry.name:
            data = data.replace(entry.name.replace("\0", NUL_STAND_IN).encode(), entry.name.encode())
    path.write_bytes(data)
    return path


def _tar(path: Path, entries: list[Entry]) -> Path:
    types = {"file": tarfile.REGTYPE, "folder": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
             "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}
    with tarfile.open(path, "w:gz") as tf:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.type = types[entry.kind]
            info.linkname = entry.target
            info.size = len(entry.data) if entry.kind == "file" else 0
            tf.addfile(info, io.BytesIO(entry.data) if entry.kind == "file" else None)
    return path


class _quiet_duplicates:
    """zipfile warns when a name repeats; the repeat is the point of some cases."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", UserWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def _snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every path under ``root`` (links not followed): its kind and its content or link target."""
    found: dict[str, tuple[str, str]] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_file():
                found[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                found[rel] = ("folder", "")
    return found


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """A project around the destination: a victim file and a site-packages folder that an escaping
    member would write into, and the folder the archive is unpacked beside."""
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "victim.txt").write_text("untouched")
    (tmp_path / "raw").mkdir()
    (tmp_path / "archives").mkdir()
    return tmp_path


def _hostile_cases(world: Path) -> dict[str, list[Entry]]:
    victim_dir = str(world / "site-packages")
    victim = str(world / "site-packages" / "victim.txt")
    ok = Entry("outs/cells.parquet", b"cells")
    return {
        "symlink-then-file-of-its-name": [ok, Entry("outs/link", kind="symlink", target=victim_dir),
                                          Entry("outs/link/evil.pth", b"import os")],
        "symlink-then-file-same-name": [ok, Entry("outs/x.txt", kind="symlink", target=victim),
                                        Entry("outs/x.txt", b"overwritten")],
        "relative-symlink-inside-looking": [ok, Entry("outs/up", kind="symlink", target="../../site-packages"),
                                            Entry("outs/up/evil.pth", b"import os")],
        "chained-symlinks": [Entry("outs/a", kind="symlink", target="."), Entry("outs/b", kind="symlink", target="a/.."),
                             Entry("outs/c", kind="symlink", target="b/../.."), Entry("outs/c/evil.pth", b"x")],
        "symlink-inside": [ok, Entry("outs/soft", kind="symlink", target="cells.parquet")],
        "hardlink-outside-then-file": [ok, Entry("outs/h", kind="hardlink", target=victim),
                                       Entry("outs/h", b"overwritten")],
        "hardlink-inside": [ok, Entry("outs/h", kind="hardlink", target="outs/cells.parquet")],
        "dotdot": [ok, Entry("outs/../../site-packages/evil.pth", b"x")],
        "dotdot-top": [ok, Entry("../site-packages/evil.pth", b"x")],
        "dotdot-backslash": [ok, Entry("outs\\..\\..\\site-packages\\evil.pth", b"x")],
        "absolute": [ok, Entry(victim_dir + "/evil.pth", b"x")],
        "absolute-drive": [ok, Entry("C:\\site-packages\\evil.pth", b"x")],
        "absolute-unc": [ok, Entry("//server/share/evil.pth", b"x")],
        "char-device": [ok, Entry("outs/tty", kind="char")],
        "block-device": [ok, Entry("outs/disk", kind="block")],
        "fifo": [ok, Entry("outs/pipe", kind="fifo")],
        "repeated-name": [ok, Entry("outs/a.txt", b"first"), Entry("outs/a.txt", b"second")],
        "repeated-name-by-case": [ok, Entry("outs/A.txt", b"first"), Entry("outs/a.txt", b"second")],
        "file-then-folder-of-its-name": [ok, Entry("outs/a", b"file"), Entry("outs/a/b.txt", b"inside")],
        "nul-in-name": [ok, Entry("outs/a\0.txt", b"x")],  # zip only: a tar header cannot hold a NUL
    }


#: Classes a format cannot express (zip has no hard links; a tar name ends at its first NUL).
CANNOT = {"zip": {"hardlink-outside-then-file", "hardlink-inside"}, "tar": {"nul-in-name"}}


def _cases(fmt: str) -> list[tuple[str, str]]:
    names = _hostile_cases(Path("/x")).keys()
    return [(fmt, name) for name in names if name not in CANNOT[fmt]]


@pytest.mark.parametrize(("fmt", "case"), _cases("zip") + _cases("tar"))
def test_hostile_archive_is_refused_in_every_member_order(fmt: str, case: str, world: Path) -> None:
    entries = _hostile_cases(world)[case]
    for order, members in enumerate(itertools.permutations(entries)):
        make, suffix = (_zip, ".zip") if fmt == "zip" else (_tar, ".tar.gz")
        archive = make(world / "archives" / f"{case}-{order}{suffix}", list(members))
        before = _snapshot(world)
        with pytest.raises(DownloadError, match="refusing to extract") as err:
            safe_extract(archive, world / "raw" / "sec")
        assert str(archive) in str(err.value)
        assert _snapshot(world) == before, f"{case}, order {order}: something changed around the destination"
        assert (world / "site-packages" / "victim.txt").read_text() == "untouched"


@pytest.mark.parametrize("make,suffix", [(_zip, ".zip"), (_tar, ".tar.gz")], ids=["zip", "tar"])
def test_member_count_past_the_bound_is_refused(make, suffix: str, world: Path) -> None:
    archive = make(world / "archives" / f"many{suffix}", [Entry(f"outs/{i}.txt", b"x") for i in range(11)])
    before = _snapshot(world)
    with pytest.raises(DownloadError, match="11 members, above the bound of 10"):
        safe_extract(archive, world / "raw" / "sec", max_members=10)
    assert _snapshot(world) == before
    safe_extract(archive, world / "raw" / "sec", max_members=11)
    assert len(list((world / "raw" / "sec").iterdir())) == 11


@pytest.mark.parametrize("make,suffix", [(_zip, ".zip"), (_tar, ".tar.gz")], ids=["zip", "tar"])
def test_expansion_ratio_past_the_bound_is_refused(make, suffix: str, world: Path) -> None:
    archive = make(world / "archives" / f"zeros{suffix}", [Entry("outs/zeros.bin", bytes(4_000_000))])
    ratio = 4_000_000 / archive.stat().st_size
    assert ratio > 200  # zeros deflate about 1,000 to 1
    before = _snapshot(world)
    with pytest.raises(DownloadError, match="more than 200 times the archive"):
        safe_extract(archive, world / "raw" / "sec")
    assert _snapshot(world) == before
    safe_extract(archive, world / "raw" / "sec", max_expansion_ratio=ratio + 1)
    assert (world / "raw" / "sec" / "zeros.bin").stat().st_size == 4_000_000


@pytest.mark.parametrize("make,suffix", [(_zip, ".zip"), (_tar, ".tar.gz")], ids=["zip", "tar"])
def test_uncompressed_size_cap(make, suffix: str, world: Path) -> None:
    archive = make(world / "archives" / f"big{suffix}", [Entry("outs/a.bin", os.urandom(100_000))])
    before = _snapshot(world)
    with pytest.raises(DownloadError, match="above the cap of 50000 bytes"):
        safe_extract(archive, world / "raw" / "sec", max_total_bytes=50_000)
    assert _snapshot(world) == before


def _corrupt(archive: Path, how: str) -> None:
    data = bytearray(archive.read_bytes())
    if how == "truncated":
        archive.write_bytes(bytes(data[: len(data) * 2 // 3]))
    else:  # one flipped byte inside the first member's compressed data
        data[60] ^= 0xFF
        archive.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "flipped-byte"])
@pytest.mark.parametrize("make,suffix", [(_zip, ".zip"), (_tar, ".tar.gz")], ids=["zip", "tar"])
def test_truncated_or_corrupt_archive_is_one_download_error(make, suffix: str, how: str, world: Path) -> None:
    archive = make(world / "archives" / f"bundle{suffix}",
                   [Entry("outs/a.bin", os.urandom(20_000)), Entry("outs/b.bin", os.urandom(20_000))])
    _corrupt(archive, how)
    before = _snapshot(world)
    with pytest.raises(DownloadError, match="truncated or corrupt") as err:
        safe_extract(archive, world / "raw" / "sec")
    assert str(archive) in str(err.value)
    assert _snapshot(world) == before


def test_a_page_saved_under_an_archive_name_is_not_opened(world: Path) -> None:
    page = world / "archives" / "bundle.zip"
    page.write_bytes(b"<!DOCTYPE html><html>Access denied</html>")
    with pytest.raises(DownloadError, match="starts with an HTML page"):
        safe_extract(page, world / "raw" / "sec")


def test_the_format_follows_the_name_not_the_content(world: Path) -> None:
    tar = _tar(world / "archives" / "real.tar.gz", [Entry("outs/a.txt", b"a")])
    as_zip = world / "archives" / "bundle.zip"
    as_zip.write_bytes(tar.read_bytes())
    with pytest.raises(DownloadError, match="named as a zip archive"):
        safe_extract(as_zip, world / "raw" / "sec")
    unnamed = world / "archives" / "bundle"
    unnamed.write_bytes(tar.read_bytes())
    with pytest.raises(DownloadError, match="not named as a zip or tar archive"):
        safe_extract(unnamed, world / "raw" / "sec")
    files = safe_extract(unnamed, world / "raw" / "sec", archive_name="Xenium_outs.tar.gz")
    assert files == [world / "raw" / "sec" / "a.txt"]


@pytest.mark.parametrize(("name", "fmt"), [("x_outs.zip", "zip"), ("X.TAR.GZ", "r:gz"), ("a.tgz", "r:gz"),
                                           ("a.tar", "r:"), ("a.tar.xz", "r:xz"), ("a.tar.bz2", "r:bz2"),
                                           ("a.zip.html", None), ("bundle", None)])
def test_archive_format_by_name(name: str, fmt: str | None) -> None:
    assert archive_format(name) == fmt


BUNDLE = [Entry("outs", kind="folder"), Entry("outs/cells.parquet", b"cells"), Entry("outs/experiment.xenium", b"{}"),
          Entry("outs/sub/a.txt", b"a")]


@pytest.mark.parametrize("make,suffix", [(_zip, ".zip"), (_tar, ".tar.gz")], ids=["zip", "tar"])
def test_single_top_folder_is_flattened_and_nothing_else_is_written(make, suffix: str, world: Path) -> None:
    archive = make(world / "archives" / f"bundle{suffix}", BUNDLE)
    before = _snapshot(world)
    dest = world / "raw" / "sec"
    files = safe_extract(archive, dest)
    assert sorted(files) == sorted(dest / p for p in ("cells.parquet", "experiment.xenium", "sub/a.txt"))
    assert (dest / "cells.parquet").read_bytes() == b"cells"
    after = _snapshot(world)
    assert {k: v for k, v in after.items() if not k.startswith("raw/sec/")} == {**before, "raw/sec": ("folder", "")}
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o777 & ~mask  # not the private staging folder's 0700
    assert stat.S_IMODE((dest / "cells.parquet").stat().st_mode) == 0o666 & ~mask


def test_several_top_level_entries_are_kept(world: Path) -> None:
    archive = _zip(world / "archives" / "b.zip", [Entry("cells.parquet", b"c"), Entry("outs/x.txt", b"x")])
    dest = world / "raw" / "sec"
    safe_extract(archive, dest)
    assert (dest / "cells.parquet").is_file() and (dest / "outs" / "x.txt").is_file()
    assert sorted(p.name for p in (world / "raw").iterdir()) == ["sec"]


def test_a_refused_archive_leaves_the_previous_destination(world: Path) -> None:
    dest = world / "raw" / "sec"
    safe_extract(_zip(world / "archives" / "good.zip", [Entry("outs/a.txt", b"old")]), dest)
    bad = _zip(world / "archives" / "bad.zip", [Entry("outs/a.txt", b"new"), Entry("../evil", b"x")])
    with pytest.raises(DownloadError, match="contains '..'"):
        safe_extract(bad, dest)
    assert (dest / "a.txt").read_bytes() == b"old"
    assert sorted(p.name for p in (world / "raw").iterdir()) == ["sec"]
