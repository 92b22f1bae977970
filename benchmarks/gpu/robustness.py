"""Part (d): robustness margins with an exact k-NN on the device (torch; faiss-gpu is not installed on
a bare GPU machine), against the CPU's exact search on the same cells, and its time per pair.

Cells are synthetic: ``n_types`` cell types (biology) and ``n_sections`` sections (confounder) as
centroids and shifts in ``width`` dimensions plus unit noise, L2-normalised; groups (the encoder
patch, never a neighbour) of ``cells_per_group`` cells of one section. The stage's search per
anchor: the k-NN (``k``: the largest of the k grid, 91) and the m nearest SO and OS neighbours, in
one pass over the candidates (:func:`gpu.knn.torch_search`).

Comparison (``compare_anchors`` anchors among ``compare_cells`` cells): the device's search against
:func:`gpu.knn.numpy_search` on the CPU and, where it imports (faiss; not on a bare GPU machine),
against ``cellpath.robustness.neighbours`` as the robustness stage searches: largest distance and
margin differences, and ``agrees`` (every difference within ``tolerance``, inf and NaN in the same
places). Timing: every cell a query at ``full_cells`` (the stage's exact mode), and ``anchors``
anchors against ``anchor_cells`` cells (its anchor mode), candidates read from host memory block by
block; ``seconds_per_pair_feature`` is seconds / (queries × candidates × width), the unit of the
cost model's robustness entry.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu.encoders import synchronise
from gpu.knn import Hits, Labels, agreement, numpy_search, torch_search


def synthetic_cells(n: int, sizes: dict, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, Labels]:
    """(n, width) L2-normalised float32 rows on ``device`` and their labels (see the module docstring)."""
    rng = np.random.default_rng(seed)
    group = np.arange(n) // sizes["cells_per_group"]
    confounder = rng.integers(0, sizes["n_sections"], group[-1] + 1)[group]
    biology = rng.integers(0, sizes["n_types"], n)
    generator = torch.Generator(device=device).manual_seed(seed)
    width = sizes["width"]
    centroids = torch.randn(sizes["n_types"], width, device=device, generator=generator) * 0.6
    shifts = torch.randn(sizes["n_sections"], width, device=device, generator=generator) * 0.3
    rows = torch.empty(n, width, device=device)
    for start in range(0, n, 262_144):
        stop = min(n, start + 262_144)
        block = torch.randn(stop - start, width, device=device, generator=generator)
        block += centroids[torch.as_tensor(biology[start:stop], device=device)]
        block += shifts[torch.as_tensor(confounder[start:stop], device=device)]
        rows[start:stop] = block / (block.norm(dim=1, keepdim=True) + 1e-12)
    return rows, Labels(group=group, biology=biology, confounder=confounder)


def _search_kwargs(sizes: dict) -> dict:
    return {"k": sizes["k"], "m": sizes["m"], "candidate_block": sizes["candidate_block"],
            "query_block": sizes["query_block"]}


def product_search(rows: np.ndarray, labels: Labels, anchors: np.ndarray, k: int, m: int) -> Hits:
    """The robustness stage's own search (faiss) for the same anchors: raises ImportError without faiss."""
    from cellpath.robustness.neighbours import knn_excluding_groups, typed_neighbours

    knn = knn_excluding_groups(rows, labels.group, k, anchors=anchors)
    typed = typed_neighbours(rows, labels.biology, labels.confounder, labels.group, m, anchors=anchors)
    # the stage's k-NN also lists the neighbours tied with the k-th; the device search keeps k
    return Hits(knn.distance[:, :k], knn.index[:, :k], typed.so, typed.so_index, typed.os, typed.os_index)


def _agrees(compared: dict, tolerance: float) -> bool:
    kinds = [compared[name] for name in ("knn", "so", "os")]
    return (all(kind["max_abs_distance_difference"] <= tolerance and kind["same_missing"] for kind in kinds)
            and compared["margins"]["max_abs_difference"] <= tolerance and compared["margins"]["same_defined"])


def compare(device: torch.device, sizes: dict) -> dict:
    """The device's search against numpy's (and the stage's faiss search where it imports) on the same cells."""
    rows, labels = synthetic_cells(sizes["compare_cells"], sizes, device, seed=1)
    anchors = np.sort(np.random.default_rng(2).choice(len(rows), sizes["compare_anchors"], replace=False))
    started = time.perf_counter()
    found = torch_search(rows[torch.as_tensor(anchors, device=device)], labels.take(anchors), rows, labels,
                         **_search_kwargs(sizes))
    device_s = time.perf_counter() - started
    host = rows.cpu().numpy()
    started = time.perf_counter()
    reference = numpy_search(host[anchors], labels.take(anchors), host, labels, k=sizes["k"], m=sizes["m"],
                             candidate_block=sizes["candidate_block"])
    out = {"cells": len(rows), "anchors": len(anchors), "device_s": device_s, "numpy_s": time.perf_counter() - started,
           "against_numpy": agreement(found, reference)}
    out["agrees"] = _agrees(out["against_numpy"], sizes["tolerance"])
    try:
        stage = product_search(host, labels, anchors, sizes["k"], sizes["m"])
    except ImportError as error:
        out["against_stage_search"] = f"not importable here: {type(error).__name__}: {error}"
    else:
        out["against_stage_search"] = agreement(found, stage)
        out["agrees_with_stage_search"] = _agrees(out["against_stage_search"], sizes["tolerance"])
    return out


def timing(device: torch.device, sizes: dict, n: int, anchors: int | None) -> dict:
    """Seconds of one search of ``anchors`` (None: every cell) among ``n`` cells read from host memory."""
    rows, labels = synthetic_cells(n, sizes, device, seed=3)
    queries = rows if anchors is None else rows[:anchors].clone()
    query_labels = labels if anchors is None else labels.take(np.arange(anchors))
    host = rows.cpu()
    del rows
    if device.type == "cuda":
        host = host.pin_memory()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronise(device)
    started = time.perf_counter()
    torch_search(queries, query_labels, host, labels, **_search_kwargs(sizes))
    synchronise(device)
    seconds = time.perf_counter() - started
    pairs = len(queries) * n
    return {"cells": n, "queries": len(queries), "width": sizes["width"], "seconds": seconds,
            "seconds_per_pair": seconds / pairs, "seconds_per_pair_feature": seconds / (pairs * sizes["width"]),
            "peak_gpu_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None}


def measure(device: str, sizes: dict, budget_s: float) -> dict:
    """Part (d): the comparison, then the exact (every cell a query) and anchor timings, each skipped
    when the part's budget is spent."""
    dev = torch.device(device)
    end = time.perf_counter() + budget_s
    out = {"k": sizes["k"], "m": sizes["m"], "tolerance": sizes["tolerance"],
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "search": "gpu.knn.torch_search (torch exact, blocked; faiss-gpu absent)",
           "compare": compare(dev, sizes)}
    print(f"part d: compare {out['compare']}", flush=True)
    for name, n, anchors in (("full", sizes["full_cells"], None), ("anchors", sizes["anchor_cells"], sizes["anchors"])):
        if time.perf_counter() > end:
            out[name] = {"skipped": "out of the part's time budget"}
            continue
        out[name] = timing(dev, sizes, n, anchors)
        print(f"part d: {name} {out[name]}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out
