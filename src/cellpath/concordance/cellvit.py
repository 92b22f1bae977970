"""Read CellViT++ (and CellViT v1) nucleus detections and map their PanNuke classes to Tcoarse.

CellViT++ writes, per slide ``<wsi>`` (the slide's file name without its extension, inner dots
kept: ``wsi_path.stem``), into its output folder (older releases) or into a sub-folder per slide
(newer ones):

- ``<wsi>_cells.json`` / ``cells.json``: ``{"wsi_metadata": {...}, "type_map": {"1": "Neoplastic",
  ...}, "cells": [{"bbox", "centroid": [x, y], "contour", "type_prob", "type", ...}, ...]}``;
- ``<wsi>_cell_detection.json`` / ``cell_detection.json``: the same with bbox, centroid and type;
- ``<wsi>_cells.geojson`` / ``<wsi>_cell_detection.geojson`` with ``--geojson``: a list (or a
  FeatureCollection) of Features, one per class, whose geometry is a MultiPolygon (contours) or a
  MultiPoint (centroids) and whose class is ``properties.classification.name``;
- any of these with ``.snappy`` appended with ``--compression`` (raw snappy blocks).

Coordinates are level-0 px of the slide CellViT++ was run on. ``type_map`` maps class id → name
(ids are strings in the file, the cells' ``type`` integers).

CellViT v1 (TIO-IKIM/CellViT, ``cell_segmentation/inference/cell_detection.py``) writes the same
documents into ``<outdir>/<wsi>/cell_detection/[<subdir>/]{cells,cell_detection}.json``, with two
differences: its ``type_map`` is the inverse, name → id (PanNuke's ``nuclei_types``), and its
coordinates are px of the patches it ran on — patch offsets ``row · patch_size · downsampling``
plus in-patch positions — which are level-0 px only when the patches were neither rescaled nor
downsampled. With ``downsampling`` 1 they are scaled to level 0 by ``target_patch_mpp /
base_mpp`` (both in its ``wsi_metadata``); a file whose patches were downsampled mixes two scales
and is refused. The default PanNuke classes map to Tcoarse as in ``PANNUKE_TO_COARSE``; Dead nuclei
have no Tcoarse class and are dropped (and counted).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import ijson
import numpy as np

from cellpath.annotation.ontology import COARSE_CLASSES
from cellpath.concordance.detections import Detections
from cellpath.errors import InputError

EPITHELIAL, IMMUNE, STROMAL = COARSE_CLASSES

# PanNuke class → Tcoarse class; None: no Tcoarse class (dropped).
PANNUKE_TO_COARSE: dict[str, str | None] = {
    "Neoplastic": EPITHELIAL,
    "Epithelial": EPITHELIAL,
    "Inflammatory": IMMUNE,
    "Connective": STROMAL,
    "Dead": None,
}
# Output kinds in order of preference, and the file names CellViT++ gives them.
OUTPUT_KINDS: tuple[str, ...] = ("cells.json", "cell_detection.json", "cells.geojson", "cell_detection.geojson")
MPP_TOLERANCE = 0.05  # relative difference allowed between the detections' and the slide's mpp
_MPP_KEYS = ("base_mpp", "slide_mpp", "mpp")
_SNAPPY_FRAMED_MAGIC = b"\xff\x06\x00\x00sNaPpY"


def read_cellvit(path: Path | str, *, slide_mpp: float | None = None,
                 slide_dimensions: tuple[int, int] | None = None) -> Detections:
    """Read one CellViT++ output file (any of the formats in the module docstring).

    ``slide_mpp`` (µm per level-0 px of the H&E) is checked against the mpp CellViT++ recorded in
    ``wsi_metadata``; ``slide_dimensions`` (level-0 width, height in px) against the detections'
    extent. Raises InputError naming the file for anything malformed or inconsistent.
    """
    path = Path(path)
    if _is_geojson(path):
        names, xy = _geojson_detections(_load_json(path), path)
    else:
        header, cells = _stream_cells_json(path)
        _check_mpp(header, slide_mpp, path)
        names, xy = _json_detections(header, cells, path)
        if _is_v1_type_map(header["type_map"]):
            xy = xy * _v1_level0_scale(header, path)
    if len(names) == 0:
        raise InputError("the CellViT++ output holds no detections; rerun CellViT++ on this slide or "
                         "check that the tissue was found", path=path)
    if slide_dimensions is not None:
        _check_inside(xy, slide_dimensions, path)
    classes = {name: _coarse_class(name, path) for name in set(names)}
    coarse = np.array([classes[name] for name in names], dtype=object)
    kept = np.array([c is not None for c in coarse], dtype=bool)
    return Detections(x_px=xy[kept, 0], y_px=xy[kept, 1], label=np.asarray(names, dtype=object)[kept],
                      coarse=coarse[kept], n_dropped=int((~kept).sum()), source=str(path))


def find_cellvit_output(folder: Path | str, section_id: str, *, wsi_name: str | None = None) -> Path:
    """The CellViT++ output file for one section in a CellViT++ output folder.

    A file belongs to the section when its slide name (``<wsi>`` in ``<wsi>_cells.json``, the
    sub-folder holding ``cells.json``, or CellViT v1's ``<wsi>/cell_detection/[<subdir>/]``), less a
    trailing ``.ome`` and ``_he_image``, equals ``section_id``, or equals ``wsi_name`` (the H&E file
    name, e.g. ``X_he_image.ome.tif`` or ``TCGA-….57401526-….svs``) without its extension — the
    ``wsi_path.stem`` CellViT names its outputs by, inner dots kept — or up to its first dot.
    Preference: cells.json, cell_detection.json, cells.geojson, cell_detection.geojson; an
    uncompressed file before its ``.snappy`` variant.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError("CellViT++ output folder not found; set it to the folder CellViT++ wrote (--outdir)",
                         path=folder, section=section_id)
    wanted = {_slide_key(section_id)}
    if wsi_name is not None:
        name = Path(wsi_name).name
        wanted |= {_slide_key(Path(name).stem), _slide_key(name.split(".")[0])}
    candidates: dict[tuple[int, bool], list[Path]] = {}
    for file in sorted(folder.rglob("*")):
        kind = _output_kind(file.name)
        if kind is None or not file.is_file():
            continue
        if file.name.removesuffix(".snappy") == kind:  # folder layout: <outdir>/<wsi>/cells.json
            slide = _folder_slide(file, folder)
        else:
            slide = file.name.removesuffix(".snappy")[: -len(kind) - 1]
        if slide is not None and _slide_key(slide) in wanted:
            rank = (OUTPUT_KINDS.index(kind), file.name.endswith(".snappy"))
            candidates.setdefault(rank, []).append(file)
    if not candidates:
        raise InputError(f"no CellViT++ output for this section (looked for <slide>_{{{', '.join(OUTPUT_KINDS)}}}"
                         f"[.snappy] with slide name {sorted(wanted)}); run CellViT++ on its H&E or rename the "
                         f"output", path=folder, section=section_id)
    best = candidates[min(candidates)]
    if len(best) > 1:
        raise InputError(f"several CellViT++ outputs match this section: {[str(p) for p in best]}; keep one",
                         path=folder, section=section_id)
    return best[0]


def _folder_slide(file: Path, folder: Path) -> str | None:
    """The slide a ``cells.json``-style file belongs to by its folders: ``<wsi>/`` (CellViT++) or
    ``<wsi>/cell_detection/[<subdir>/]`` (CellViT v1); None for a file directly in ``folder``."""
    parents = file.relative_to(folder).parts[:-1]
    if "cell_detection" in parents:
        index = len(parents) - 1 - parents[::-1].index("cell_detection")
        return parents[index - 1] if index >= 1 else None
    return parents[-1] if parents else None


def _output_kind(name: str) -> str | None:
    base = name.removesuffix(".snappy")
    for kind in OUTPUT_KINDS:
        if base == kind or base.endswith("_" + kind):
            return kind
    return None


def _slide_key(slide: str) -> str:
    """A slide name without the ``.ome`` and ``_he_image`` that 10x H&E file names carry."""
    return re.sub(r"(_he_image)?(\.ome)?$", "", slide)


def _is_geojson(path: Path) -> bool:
    return path.name.removesuffix(".snappy").endswith(".geojson")


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when it is ``.snappy``."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read the CellViT++ output ({exc.strerror})", path=path) from None
    return _snappy_decompress(raw, path) if path.name.endswith(".snappy") else raw


def _invalid_json(path: Path, error: Exception) -> InputError:
    reason = str(error).splitlines()[0].strip() if str(error).strip() else type(error).__name__
    return InputError(f"the CellViT++ output is not valid JSON ({reason}); it may be truncated — rerun "
                      f"CellViT++ or copy the file again", path=path)


def _load_json(path: Path):
    try:
        return json.loads(_read_bytes(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _invalid_json(path, exc) from None


@contextmanager
def _json_stream(path: Path) -> Iterator[BinaryIO]:
    """The JSON bytes as a seekable binary stream: the file itself, or a ``.snappy`` file decompressed
    into memory (its JSON bytes, not Python objects)."""
    if path.name.endswith(".snappy"):
        yield io.BytesIO(_read_bytes(path))
        return
    try:
        stream = path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot read the CellViT++ output ({exc.strerror})", path=path) from None
    with stream:
        yield stream


class _StrictJSONError(Exception):
    """ijson refused the bytes (raised from its error)."""


def _first(stream: BinaryIO, prefix: str):
    """The value at ``prefix`` (``None`` when absent), parsed up to it; the stream rewound first."""
    stream.seek(0)
    try:
        return next(ijson.items(stream, prefix, use_float=True), None)
    except (ijson.JSONError, UnicodeDecodeError) as exc:
        raise _StrictJSONError() from exc


def _stream_cells_json(path: Path) -> tuple[dict, list[dict | None]]:
    """A cells.json / cell_detection.json read one cell at a time (ijson): the document's small keys
    (``wsi_metadata``, ``type_map``), and per cell only its ``centroid`` and ``type`` (``None`` for a
    cell without them) — contours and bounding boxes are parsed and dropped, so memory grows with the
    number of cells, not the file. Passes: the two small keys (each read up to where it stands, at
    the start in CellViT++'s files), then the cells. A file that only Python's own parser accepts
    (``NaN`` or ``Infinity``, which ``json.dump`` writes for a non-finite float) is read whole."""
    try:
        return _cells_json_passes(path)
    except _StrictJSONError as strict:
        try:
            document = json.loads(_read_bytes(path))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _invalid_json(path, strict.__cause__) from None
        return _whole_cells_json(document, path)


def _whole_cells_json(document, path: Path) -> tuple[dict, list[dict | None]]:
    if not isinstance(document, dict):
        raise InputError("expected a JSON object with keys wsi_metadata, type_map and cells", path=path)
    _check_keys(document.get("type_map"), "cells" in document, isinstance(document.get("cells"), list), path)
    return ({k: document[k] for k in ("wsi_metadata", "type_map") if k in document},
            [_centroid_and_type(cell) for cell in document["cells"]])


def _check_keys(type_map, has_cells: bool, cells_is_list: bool, path: Path) -> None:
    """A cells.json must have a ``type_map`` object and a ``cells`` list."""
    missing = [k for k, present in (("type_map", type_map is not None), ("cells", has_cells)) if not present]
    if missing:
        raise InputError(f"missing key(s) {missing}; is this a CellViT++ cells.json / cell_detection.json?",
                         path=path)
    if not isinstance(type_map, dict) or not cells_is_list:
        raise InputError("type_map must be an object and cells a list", path=path)


def _centroid_and_type(cell) -> dict | None:
    return {"centroid": cell["centroid"], "type": cell["type"]} \
        if isinstance(cell, dict) and "centroid" in cell and "type" in cell else None


def _cells_json_passes(path: Path) -> tuple[dict, list[dict | None]]:
    with _json_stream(path) as stream:
        start = stream.read(64).lstrip()
        if not start.startswith(b"{"):
            if not start:
                raise _invalid_json(path, ValueError("the file is empty"))
            raise InputError("expected a JSON object with keys wsi_metadata, type_map and cells", path=path)
        header = {key: _first(stream, key) for key in ("wsi_metadata", "type_map")}
        stream.seek(0)
        cells: list[dict] = []
        found = False
        try:
            for prefix, event, _ in ijson.parse(stream):
                if prefix == "cells":
                    found = event
                    break
            if found == "start_array":
                stream.seek(0)
                cells = [_centroid_and_type(cell) for cell in ijson.items(stream, "cells.item", use_float=True)]
        except (ijson.JSONError, UnicodeDecodeError) as exc:
            raise _StrictJSONError() from exc
    _check_keys(header["type_map"], bool(found), found == "start_array", path)
    return {k: v for k, v in header.items() if v is not None}, cells


def _snappy_decompress(data: bytes, path: Path) -> bytes:
    """Raw (CellViT++'s ``snappy.compress``) or framed snappy data, decompressed."""
    decompress = _snappy_codec(path)
    try:
        return decompress(data, data.startswith(_SNAPPY_FRAMED_MAGIC))
    except Exception as exc:  # python-snappy and cramjam raise their own error types
        raise InputError(f"the .snappy file could not be decompressed ({type(exc).__name__}); it may be "
                         f"truncated or not snappy-compressed", path=path) from None


def _snappy_codec(path: Path) -> Callable[[bytes, bool], bytes]:
    """decompress(data, framed) from python-snappy, else from cramjam (which python-snappy ≥ 0.7 uses)."""
    try:
        import snappy

        return lambda data, framed: (snappy.StreamDecompressor().decompress(data) if framed
                                     else snappy.decompress(data))
    except ImportError:
        pass
    try:
        import cramjam

        return lambda data, framed: bytes(cramjam.snappy.decompress(data) if framed
                                          else cramjam.snappy.decompress_raw(data))
    except ImportError:
        raise InputError("reading .snappy CellViT++ outputs needs python-snappy: pip install python-snappy "
                         "(or decompress the file and pass the .json)", path=path) from None


def _check_mpp(document, slide_mpp: float | None, path: Path) -> None:
    if slide_mpp is None or not isinstance(document, dict) or not isinstance(document.get("wsi_metadata"), dict):
        return
    metadata = document["wsi_metadata"]
    recorded = next((metadata[k] for k in _MPP_KEYS if metadata.get(k) is not None), None)
    if recorded is None:
        return
    try:
        recorded = float(recorded)
    except (TypeError, ValueError):
        raise InputError(f"wsi_metadata mpp is not a number: {recorded!r}", path=path) from None
    if abs(recorded - slide_mpp) > MPP_TOLERANCE * slide_mpp:
        raise InputError(f"CellViT++ ran on a slide of {recorded:g} µm/px but the section's H&E is "
                         f"{slide_mpp:g} µm/px (more than {MPP_TOLERANCE:.0%} apart); rerun CellViT++ on this "
                         f"section's H&E image", path=path)


def _json_detections(header: dict, cells: list[dict | None], path: Path) -> tuple[list[str], np.ndarray]:
    """Class names and (N, 2) centroids from a cells.json / cell_detection.json's ``type_map`` and its
    cells' centroid and type (``None``: a cell without them)."""
    type_map = header["type_map"]
    if _is_v1_type_map(type_map):  # CellViT v1: name → id
        if len(set(type_map.values())) != len(type_map):
            raise InputError(f"type_map gives one id to several classes: {type_map}", path=path)
        type_map = {str(class_id): name for name, class_id in type_map.items()}
    if None in cells:
        raise InputError(f"cell {cells.index(None)} has no centroid or type", path=path)
    centroids = [cell["centroid"] for cell in cells]
    keys = [str(cell["type"]) for cell in cells]
    unknown = set(keys) - set(type_map)
    if unknown:
        first = next(i for i, k in enumerate(keys) if k in unknown)
        raise InputError(f"cell {first} has class id {cells[first]['type']!r}, which type_map does not list "
                         f"(ids: {sorted(type_map)})", path=path)
    return [str(type_map[k]) for k in keys], _points(centroids, path, "cell")


def _is_v1_type_map(type_map: dict) -> bool:
    """CellViT v1's name → id map (``{"Background": 0, "Neoplastic": 1, …}``), not CellViT++'s id → name."""
    return bool(type_map) and all(isinstance(v, int) and not isinstance(v, bool) for v in type_map.values()) \
        and not all(str(k).isdigit() for k in type_map)


def _v1_level0_scale(document: dict, path: Path) -> float:
    """Level-0 px per px of CellViT v1's coordinates (``target_patch_mpp / base_mpp``; see the module docstring)."""
    metadata = document.get("wsi_metadata") if isinstance(document.get("wsi_metadata"), dict) else {}
    try:
        downsampling = float(metadata.get("downsampling", 1))
        base, target = metadata.get("base_mpp"), metadata.get("target_patch_mpp")
        scale = 1.0 if base is None or target is None else float(target) / float(base)
    except (TypeError, ValueError, ZeroDivisionError):
        raise InputError("CellViT v1 wsi_metadata: downsampling, base_mpp and target_patch_mpp must be numbers",
                         path=path) from None
    if downsampling != 1:
        raise InputError(f"this CellViT v1 output was computed on patches downsampled {downsampling:g}×, and CellViT "
                         "v1 then adds in-patch positions at that scale to level-0 patch offsets, so its "
                         "coordinates mix two scales; rerun CellViT at the slide's base magnification "
                         "(downsampling 1) or with CellViT++", path=path)
    return scale


def _points(values: list, path: Path, what: str) -> np.ndarray:
    """(N, 2) float array of [x, y] pairs; InputError naming the first bad one."""
    if len(values) == 0:
        return np.empty((0, 2))
    try:
        xy = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        xy = None
    if xy is None or xy.shape != (len(values), 2) or not np.all(np.isfinite(xy)):
        for i, value in enumerate(values):
            _point(value, path, f"{what} {i}")
    return xy


def _geojson_detections(document, path: Path) -> tuple[list[str], np.ndarray]:
    """Class names and (N, 2) centres from GeoJSON Features (polygons give their centroid)."""
    if isinstance(document, dict) and document.get("type") == "FeatureCollection":
        document = document.get("features")
    if not isinstance(document, list):
        raise InputError("expected a GeoJSON FeatureCollection or a list of Features", path=path)
    names, blocks = [], []
    for i, feature in enumerate(document):
        try:
            name = str(feature["properties"]["classification"]["name"])
            geometry = feature["geometry"]
            kind, coordinates = geometry["type"], geometry["coordinates"]
        except (KeyError, TypeError):
            raise InputError(f"feature {i} lacks geometry.type, geometry.coordinates or "
                             f"properties.classification.name", path=path) from None
        points = _geometry_points(kind, coordinates, path, f"feature {i}")
        names.extend([name] * len(points))
        blocks.append(points)
    return names, np.concatenate(blocks) if blocks else np.empty((0, 2))


def _geometry_points(kind: str, coordinates, path: Path, where: str) -> np.ndarray:
    """(N, 2) centres of one geometry: its points, or its polygons' outer-ring centroids."""
    try:
        if kind == "Point":
            return _point(coordinates, path, where)[None, :]
        if kind == "MultiPoint":
            return _points(coordinates, path, f"{where} point")
        if kind == "Polygon":
            return _polygon_centroid(coordinates[0], path, where)[None, :]
        if kind == "MultiPolygon":
            return np.array([_polygon_centroid(polygon[0], path, where) for polygon in coordinates]).reshape(-1, 2)
    except (TypeError, IndexError):
        raise InputError(f"{where}: malformed {kind} coordinates", path=path) from None
    raise InputError(f"{where}: unsupported geometry {kind!r} (expected Point, MultiPoint, Polygon or "
                     f"MultiPolygon)", path=path)


def _point(value, path: Path, where: str) -> np.ndarray:
    try:
        point = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        point = None
    if point is None or point.shape != (2,) or not np.all(np.isfinite(point)):
        raise InputError(f"{where} must be two finite numbers [x, y], got {value!r}", path=path)
    return point


def _polygon_centroid(ring, path: Path, where: str) -> np.ndarray:
    """Area centroid of a closed or open ring of [x, y] vertices (vertex mean if degenerate)."""
    vertices = _points(ring, path, f"{where} vertex")
    if len(vertices) == 0:
        raise InputError(f"{where}: empty polygon", path=path)
    x, y = vertices[:, 0], vertices[:, 1]
    xn, yn = np.roll(x, -1), np.roll(y, -1)
    cross = x * yn - xn * y
    area = cross.sum() / 2.0
    if abs(area) < 1e-12:
        return vertices.mean(axis=0)
    return np.array([((x + xn) * cross).sum(), ((y + yn) * cross).sum()]) / (6.0 * area)


def _coarse_class(name: str, path: Path) -> str | None:
    if name not in PANNUKE_TO_COARSE:
        raise InputError(f"class {name!r} is not a PanNuke class ({', '.join(PANNUKE_TO_COARSE)}); run CellViT++ "
                         f"with the default PanNuke taxonomy", path=path)
    return PANNUKE_TO_COARSE[name]


def _check_inside(xy: np.ndarray, slide_dimensions: tuple[int, int], path: Path) -> None:
    width, height = slide_dimensions
    outside = (xy[:, 0] < 0) | (xy[:, 0] > width) | (xy[:, 1] < 0) | (xy[:, 1] > height)
    if outside.any():
        first = xy[np.argmax(outside)]
        raise InputError(f"{int(outside.sum())} detection(s) lie outside the {width}×{height} px slide (first at "
                         f"x={first[0]:g}, y={first[1]:g}); CellViT++ was run on a different image or level",
                         path=path)
