"""Exact nearest neighbours excluding each anchor's own group, with torch (any device) and with numpy
(the CPU reference), and CRoMa margins from them: what part (d) times and compares.

Conventions are ``cellpath.robustness.neighbours``'s: rows are L2-normalised float32, similarity
is the inner product, distance ``d = 1 - <x, y>`` clipped to [0, 2]; a candidate of the anchor's own
group (the anchor included) is never a neighbour. Typed neighbours: SO = same biology, other
confounder; OS = other biology, same confounder (``typed_neighbours``); the k-NN takes every
other-group row (``knn_excluding_groups``). Missing neighbours: distance inf, index -1.
``CRoMa = (mean d_OS - mean d_SO) / (mean d_OS + mean d_SO)`` over the m nearest of each type
(``cellpath.robustness.metrics.croma_margins``; NaN without m of each type).

The torch search scores ``query_block`` anchors against ``candidate_block`` candidates at a time
(one matrix product per pair of blocks, each anchor's running k best merged with the block's):
memory is bounded by ``query_block × candidate_block`` scores and one candidate block, whatever n.
Candidates may live on the host (a numpy array or a CPU tensor, pinned for speed): each block is
copied to the device as it is needed, as the stage reads its feature store chunk by chunk. This
is measurement code: the product's search is faiss (``cellpath.robustness.neighbours``), on the
GPU where faiss-gpu is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Labels:
    """Per row: the group (never a neighbour of its own), the biology and the confounder (int64)."""

    group: np.ndarray
    biology: np.ndarray
    confounder: np.ndarray

    def take(self, rows: np.ndarray) -> Labels:
        return Labels(self.group[rows], self.biology[rows], self.confounder[rows])


@dataclass(frozen=True)
class Hits:
    """Distances (ascending, inf-padded) and candidate rows (-1-padded) per anchor, for the k-NN and the
    m nearest SO and OS neighbours."""

    knn_distance: np.ndarray
    knn_index: np.ndarray
    so_distance: np.ndarray
    so_index: np.ndarray
    os_distance: np.ndarray
    os_index: np.ndarray


def _merge(best: tuple[torch.Tensor, torch.Tensor], scores: torch.Tensor, offset: int,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the running best and a block's scores (columns offset by ``offset``)."""
    take = min(k, scores.shape[1])
    values, columns = scores.topk(take, dim=1)
    values = torch.cat([best[0], values], dim=1)
    rows = torch.cat([best[1], columns + offset], dim=1)
    top, order = values.topk(k, dim=1)
    return top, rows.gather(1, order)


def _masks(q: dict, c: dict) -> dict:
    """(anchors × candidates) booleans, numpy or torch alike: another group; and SO, OS among those."""
    other = q["group"][:, None] != c["group"][None, :]
    same_b = q["biology"][:, None] == c["biology"][None, :]
    same_c = q["confounder"][:, None] == c["confounder"][None, :]
    return {"knn": other, "so": other & same_b & ~same_c, "os": other & ~same_b & same_c}


def _label_dict(labels: Labels, device: torch.device | None = None) -> dict:
    """The labels by name: numpy arrays, or tensors on ``device``."""
    names = ("group", "biology", "confounder")
    if device is None:
        return {name: np.asarray(getattr(labels, name)) for name in names}
    return {name: torch.as_tensor(getattr(labels, name), device=device) for name in names}


def _finish(values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scores → (distances ascending, inf where missing; rows, -1 where missing)."""
    missing = np.isneginf(values)
    distance = np.where(missing, np.inf, np.clip(1.0 - values.astype(np.float64), 0.0, 2.0))
    return distance, np.where(missing, -1, rows)


def torch_search(queries: torch.Tensor, query_labels: Labels, candidates: torch.Tensor | np.ndarray,
                 candidate_labels: Labels, *, k: int, m: int, candidate_block: int = 65536,
                 query_block: int = 8192) -> Hits:
    """Exact k-NN and typed (m SO, m OS) neighbours of ``queries`` (on the search's device) among
    ``candidates`` (on the device or the host), excluding each query's group; see the module docstring."""
    device = queries.device
    n_q = len(queries)
    q_labels = _label_dict(query_labels, device)
    best = {name: (torch.full((n_q, width), float("-inf"), device=device),
                   torch.full((n_q, width), -1, dtype=torch.long, device=device))
            for name, width in (("knn", k), ("so", m), ("os", m))}
    for start in range(0, len(candidates), candidate_block):
        block = torch.as_tensor(candidates[start:start + candidate_block]).to(device, non_blocking=True)
        c_labels = _label_dict(candidate_labels.take(np.arange(start, start + len(block))), device)
        for q0 in range(0, n_q, query_block):
            rows = slice(q0, q0 + query_block)
            scores = queries[rows] @ block.T
            masks = _masks({key: value[rows] for key, value in q_labels.items()}, c_labels)
            for name, mask in masks.items():
                width = k if name == "knn" else m
                values, index = _merge((best[name][0][rows], best[name][1][rows]),
                                       scores.masked_fill(~mask, float("-inf")), start, width)
                best[name][0][rows], best[name][1][rows] = values, index
    out = {name: _finish(values.cpu().numpy(), rows.cpu().numpy()) for name, (values, rows) in best.items()}
    return Hits(*out["knn"], *out["so"], *out["os"])


def _numpy_top(values: np.ndarray, columns: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``width`` largest values per row (unordered) and their columns: a partition, not a sort."""
    if values.shape[1] <= width:
        return values, np.broadcast_to(columns, values.shape)
    part = np.argpartition(-values, width - 1, axis=1)[:, :width]
    return np.take_along_axis(values, part, axis=1), columns[part]


def numpy_search(queries: np.ndarray, query_labels: Labels, candidates: np.ndarray, candidate_labels: Labels, *,
                 k: int, m: int, candidate_block: int = 65536) -> Hits:
    """The same search in numpy on the CPU (float32 products; each block's best by partition, merged by
    a stable sort): the reference."""
    n_q = len(queries)
    best = {name: (np.full((n_q, width), -np.inf, np.float32), np.full((n_q, width), -1, np.int64))
            for name, width in (("knn", k), ("so", m), ("os", m))}
    q_labels = _label_dict(query_labels)
    for start in range(0, len(candidates), candidate_block):
        block = np.asarray(candidates[start:start + candidate_block], np.float32)
        columns = np.arange(start, start + len(block))
        scores = np.asarray(queries, np.float32) @ block.T
        for name, mask in _masks(q_labels, _label_dict(candidate_labels.take(columns))).items():
            width = best[name][0].shape[1]
            top, rows = _numpy_top(np.where(mask, scores, -np.inf), columns, width)
            values = np.concatenate([best[name][0], top], axis=1)
            rows = np.concatenate([best[name][1], rows], axis=1)
            order = np.argsort(-values, axis=1, kind="stable")[:, :width]
            best[name] = (np.take_along_axis(values, order, axis=1), np.take_along_axis(rows, order, axis=1))
    out = {name: _finish(values, rows) for name, (values, rows) in best.items()}
    return Hits(*out["knn"], *out["so"], *out["os"])


def croma(so_distance: np.ndarray, os_distance: np.ndarray) -> np.ndarray:
    """CRoMa per anchor (NaN without m neighbours of each type, or a zero denominator)."""
    resolved = np.isfinite(so_distance).all(axis=1) & np.isfinite(os_distance).all(axis=1)
    d_so = np.where(resolved, np.where(resolved[:, None], so_distance, 0).mean(axis=1), np.nan)
    d_os = np.where(resolved, np.where(resolved[:, None], os_distance, 0).mean(axis=1), np.nan)
    total = d_so + d_os
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(resolved & (total > 0), (d_os - d_so) / total, np.nan)


def agreement(a: Hits, b: Hits) -> dict:
    """How far two searches' results are apart: per kind the largest distance difference (finite in
    both), whether inf falls in the same places, the share of equal rows; and the margins'."""
    out = {}
    for name in ("knn", "so", "os"):
        da, db = getattr(a, f"{name}_distance"), getattr(b, f"{name}_distance")
        finite = np.isfinite(da) & np.isfinite(db)
        out[name] = {"max_abs_distance_difference": float(np.abs(da - db)[finite].max(initial=0.0)),
                     "same_missing": bool(np.array_equal(np.isfinite(da), np.isfinite(db))),
                     "same_rows": float(np.mean(getattr(a, f"{name}_index") == getattr(b, f"{name}_index")))}
    ma, mb = croma(a.so_distance, a.os_distance), croma(b.so_distance, b.os_distance)
    both = np.isfinite(ma) & np.isfinite(mb)
    out["margins"] = {"max_abs_difference": float(np.abs(ma - mb)[both].max(initial=0.0)),
                      "same_defined": bool(np.array_equal(np.isfinite(ma), np.isfinite(mb))),
                      "defined": int(both.sum()), "anchors": len(ma)}
    return out
