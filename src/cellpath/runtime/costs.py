"""The cost model of the heavy stages: per-unit costs measured by the benchmarks, stored with the code
(``cellpath/data/costs.json``, written by ``benchmarks/bench_scale.py --calibrate``), and the
estimates built from them (``cellpath plan``; ``bench_scale`` puts each estimate beside its
measurement).

Units: seconds of wall time on one worker of the calibration machine (``machine`` in the file)
running as the stage runs there (the probe engine on one thread, so one core each; extraction and
robustness on every core of the worker), bytes. Widths are design columns
(features, + 1 for the probe's intercept). A device whose costs were never measured has no entry,
and its estimates are ``None``, never guessed.

Probe fit, per run (its whole C grid), mode = in memory or streamed as ``fit_tasks`` chooses from the budget::

    seconds = w · (n_train · iterations · s_iteration + (n_train + n_val + n_test) · s_pass)

(``iterations``: the L-BFGS iterations of the run's slowest C at its training size, :class:`Iterations`,
the engine iterating every C of a run in one product; ``s_iteration`` measured with the default's C grid and nine classes; ``s_pass``: one
read, standardisation and product of a row, as the standardiser, preconditioner and scoring make). Robustness, per scored unit of n
cells of width w: ``n² · w · s_full`` when n ≤ ``full_max_cells``, else ``anchors · n · w ·
s_anchor``; heap ``base + queries · w · b_query + n · b_cell`` (queries: n or the anchors). Extraction: ``patches · GFLOP per patch · s_per_gflop``, the GFLOP of a ViT patch
being 2 · parameters · tokens (the linear layers; attention adds under 10 % at 256 tokens for
ViT-B and wider). Where a device's entry has a rate per autocast precision and a read floor (the
``cuda`` entry, ``benchmarks/gpu/merge_costs.py``): ``patches · max(GFLOP · s_per_gflop[precision],
s_read · (input / 224)²)``, the forward pass and the CPU workers' reading overlapping.

The ``cuda`` entry is in seconds of one GPU (its ``cores`` is 1: core-seconds there are GPU-seconds),
measured by ``benchmarks/gpu/run.sh``; what it copies from the ``cpu`` entry (host heap, patches
per cell, iterations) its ``source`` says. A plan may take its iterations from a pilot run instead
(:func:`pilot_iterations`).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from cellpath.errors import ConfigError

COSTS_PATH = Path(__file__).resolve().parents[1] / "data" / "costs.json"
PROBE_MODES = ("in_memory", "streamed")
FEATURE_BYTES = 2  # float16 per stored feature value (features.store)


@dataclass(frozen=True)
class Iterations:
    """L-BFGS iterations of a run's slowest C (every C of a run iterates together) by training size:
    the median and p25–p75 at each measured ``n_train``, interpolated linearly in log n between them
    and held beyond the ends; ``source`` says what was measured (problems like real features, or a
    pilot run on them, never the simulated default)."""

    n_train: tuple[float, ...]
    median: tuple[float, ...]
    p25: tuple[float, ...]
    p75: tuple[float, ...]
    source: str

    def at(self, n_train: float) -> tuple[float, float, float]:
        """(median, p25, p75) at a training size."""
        where = math.log(max(n_train, 1.0))
        sizes = [math.log(n) for n in self.n_train]
        if where <= sizes[0] or len(sizes) == 1:
            return self.median[0], self.p25[0], self.p75[0]
        if where >= sizes[-1]:
            return self.median[-1], self.p25[-1], self.p75[-1]
        i = next(i for i in range(1, len(sizes)) if where <= sizes[i])
        share = (where - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return tuple(row[i - 1] + share * (row[i] - row[i - 1]) for row in (self.median, self.p25, self.p75))

    def describe(self) -> str:
        """The table in words, for the plan's source lines."""
        points = ", ".join(f"{m:g} at {n:,.0f}" for n, m in zip(self.n_train, self.median))
        return f"L-BFGS iterations of a run's slowest C by training size (median {points}): {self.source}"


@dataclass(frozen=True)
class ProbeCosts:
    """Seconds per training row and design column: per L-BFGS iteration and per read pass, by mode."""

    seconds_per_iteration: dict[str, float]
    seconds_per_pass: dict[str, float]
    iterations: Iterations
    heap_base_bytes: float           # the stage's heap beyond the fit budget: interpreter, torch, ...
    heap_bytes_per_cell: float       # ... and the panel's cell table and plan, per panel cell
    source: str


@dataclass(frozen=True)
class RobustnessCosts:
    """Seconds per (cell, candidate) pair and feature column; heap: a fixed part (with one candidate
    chunk of ``robustness.batch_memory_mb``), per query row and feature column (the anchors', or
    every cell's when scored in full: float32 rows and results), and per unit cell (labels, groups,
    margins, the panel table)."""

    seconds_per_pair_full: float
    seconds_per_pair_anchor: float
    heap_base_bytes: float
    heap_bytes_per_query_feature: float
    heap_bytes_per_cell: float
    cores: int                          # the BLAS threads the measurement ran on
    source: str


@dataclass(frozen=True)
class ExtractCosts:
    """Seconds per GFLOP of encoder forward pass, and patches per cell at input 224 per magnification.

    Optional (a GPU's entry): seconds per GFLOP per autocast precision (``fp32``, ``bf16``, ``fp16``;
    a precision not listed uses ``seconds_per_gflop``) and the seconds the read-ahead workers take to
    deliver one 224-px patch (the floor of a patch's time, scaled by its area at other input sizes).
    """

    seconds_per_gflop: float
    patches_per_cell_224: dict[str, float]
    cores: int
    source: str
    seconds_per_gflop_by_precision: dict[str, float] | None = None
    seconds_per_patch_read: float | None = None


@dataclass(frozen=True)
class SectionCosts:
    """A stage that runs once per section, as lines in the section's cells: seconds
    ``seconds_base + seconds_per_cell · cells`` and peak RSS ``heap_base_bytes + heap_bytes_per_cell
    · cells`` of its process, fitted by least squares on sections of the sizes in ``cells``. For
    ``extract``: one encoder at one magnification less its forward pass (:func:`extract_seconds`),
    i.e. reading the H&E, placing the cells, pooling and writing."""

    seconds_base: float
    seconds_per_cell: float
    heap_base_bytes: float
    heap_bytes_per_cell: float
    cells: tuple[int, ...]
    cores: int
    source: str


@dataclass(frozen=True)
class ExpressionCosts:
    """An expression run's exact ridge (``cellpath.expression.ridge``) per design of width w over n rows
    (train + validation + test): ``n · w² · seconds_per_row_width2`` (the Gram pass and the scoring
    rows' product with the eigenbasis) + ``w³ · seconds_per_width3`` (the eigendecomposition), fitted
    by least squares on ``benchmarks/bench_expression.py``'s runs; peak memory: three float64 w × w
    matrices and two float64 read blocks of w columns (``read_rows`` rows)."""

    seconds_per_row_width2: float
    seconds_per_width3: float
    cores: int
    source: str


#: The stages :class:`SectionCosts` price, in pipeline order.
SECTION_STAGES = ("ingest", "annotate", "concordance", "extract")


@dataclass(frozen=True)
class DeviceCosts:
    probe: ProbeCosts | None = None
    robustness: RobustnessCosts | None = None
    extract: ExtractCosts | None = None
    sections: dict[str, SectionCosts] | None = None  # stage → its per-section costs
    expression: ExpressionCosts | None = None


@dataclass(frozen=True)
class StorageCosts:
    """DVC's rates on a feature store, in bytes per second of one ``dvc`` process
    (``benchmarks/bench_dvc_storage.py``): hashing every byte again (``dvc status`` after mtimes
    changed); per cache type (``copy``, ``links``: hardlink or symlink), a stage's outputs into the
    cache, a checkout, and a push to a folder remote on the same disk."""

    hash_bytes_per_second: float
    add_bytes_per_second: dict[str, float]
    checkout_bytes_per_second: dict[str, float]
    push_bytes_per_second: dict[str, float]
    source: str


@dataclass(frozen=True)
class CostModel:
    """Per device (``cpu``, ``cuda``): the measured costs, and the machine they were measured on;
    DVC's storage rates where measured."""

    machine: dict
    devices: dict[str, DeviceCosts] = field(default_factory=dict)
    storage: StorageCosts | None = None

    def costs(self, device: str) -> DeviceCosts:
        return self.devices.get(device, DeviceCosts())


#: Fields a device's entry may leave out (their default, None, is not written).
_OPTIONAL = ("seconds_per_gflop_by_precision", "seconds_per_patch_read")


def load_costs(path: Path = COSTS_PATH) -> CostModel:
    """The stored cost model (``ConfigError`` naming the file when it is missing or malformed)."""
    try:
        raw = json.loads(Path(path).read_text())
        devices = {}
        for device, parts in raw["devices"].items():
            probe = parts.get("probe")
            devices[device] = DeviceCosts(
                probe=None if probe is None else ProbeCosts(**{**probe, "iterations": iterations_from(
                    probe["iterations"])}),
                robustness=None if parts.get("robustness") is None else RobustnessCosts(**parts["robustness"]),
                extract=None if parts.get("extract") is None else ExtractCosts(**parts["extract"]),
                sections=None if parts.get("sections") is None else {
                    stage: SectionCosts(**{**entry, "cells": tuple(entry["cells"])})
                    for stage, entry in parts["sections"].items()},
                expression=None if parts.get("expression") is None else ExpressionCosts(**parts["expression"]))
        storage = raw.get("storage")
        return CostModel(machine=raw["machine"], devices=devices,
                         storage=None if storage is None else StorageCosts(**storage))
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not a readable cost model ({error}); rewrite it with "
                          "`python benchmarks/bench_scale.py --calibrate`") from error


def iterations_from(data: dict) -> Iterations:
    """An :class:`Iterations` from its JSON form (lists for the tuples)."""
    return Iterations(**{key: value if key == "source" else tuple(value) for key, value in data.items()})


def _device_dict(costs: DeviceCosts) -> dict:
    """A device's costs as JSON: an optional field left unset (None) is not written, nor ``sections``
    where it was never measured."""
    out = {name: None if part is None else {key: value for key, value in asdict(part).items()
                                            if value is not None or key not in _OPTIONAL}
           for name, part in ((f.name, getattr(costs, f.name)) for f in fields(DeviceCosts)
                              if f.name not in ("sections", "expression"))}
    if costs.expression is not None:
        out["expression"] = asdict(costs.expression)
    if costs.sections is not None:
        out["sections"] = {stage: {**asdict(entry), "cells": list(entry.cells)} for stage, entry in costs.sections.items()}
    return out


def save_costs(model: CostModel, path: Path = COSTS_PATH) -> None:
    data = {"machine": model.machine,
            "devices": {device: _device_dict(costs) for device, costs in model.devices.items()},
            **({"storage": asdict(model.storage)} if model.storage else {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(path).with_suffix(".json.tmp")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)


# --- probe ------------------------------------------------------------------------------------------------------

def pilot_iterations(n_train: list[int], iterations: list[int], source: str) -> Iterations:
    """Iterations measured on a pilot run's fitted, converged runs (their training sizes and the
    iterations of each run's slowest C): the median and p25–p75 at every size."""
    if not iterations:
        raise ConfigError(f"{source}: no fitted, converged probe run to take iterations from")
    q25, q50, q75 = (float(v) for v in _quantiles(iterations))
    return Iterations((float(statistics.median(n_train)),), (q50,), (q25,), (q75,),
                      f"{source}: {len(iterations):,} converged runs on real features, n_train "
                      f"{min(n_train):,}–{max(n_train):,}")


def _quantiles(values: list[int]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return tuple(statistics.quantiles(ordered, n=4, method="inclusive")) if len(ordered) > 1 else (ordered[0],) * 3


def probe_mode(n_train: int, row_bytes: int, budget_mb: float) -> str:
    """``in_memory`` when the task's design fits ``budget_mb``, else ``streamed``; ``row_bytes``: a
    training row's working bytes (``probing.fit.design_row_bytes``)."""
    chunk_rows = max(1, int(budget_mb * 1024**2) // row_bytes)
    return "in_memory" if n_train <= chunk_rows else "streamed"


def probe_fit_seconds(costs: ProbeCosts, *, n_train: int, n_val: int, n_test: int, width: int, row_bytes: int,
                      iterations: float, budget_mb: float) -> float:
    """Seconds of one run's fits and scoring; ``width`` = features; ``iterations``: the run's slowest C
    (the engine iterates every C of a run together, docs/decisions/0038)."""
    mode = probe_mode(n_train, row_bytes, budget_mb)
    columns = width + 1
    return columns * (n_train * iterations * costs.seconds_per_iteration[mode]
                      + (n_train + n_val + n_test) * costs.seconds_per_pass[mode])


def probe_fit_bytes(n_train: int, row_bytes: int, state_bytes: int, budget_mb: float, tasks: int = 1,
                    group_mb: float | None = None) -> float:
    """Working bytes of a fit's group: the ``tasks`` of its size a group stacks within ``group_mb``
    (default ``budget_mb``; ``probing.fit.group_budget_mb``), ``row_bytes`` per row of each. Held
    (within ``budget_mb``): their designs and fit state; streamed: one chunk of the budget's design
    rows and the fit state of every row (``state_bytes`` per row: the float64 logits and their
    line-search companions, kept whole so that a trial step needs no read)."""
    budget, task_bytes = int(budget_mb * 1024**2), n_train * row_bytes
    stacked = min(max(tasks, 1), max(1, int((budget_mb if group_mb is None else group_mb) * 1024**2)
                                    // max(task_bytes, 1)))
    if stacked * task_bytes <= budget:
        return stacked * task_bytes
    chunk_rows = max(1, budget // row_bytes)
    return chunk_rows * (row_bytes - state_bytes) + stacked * n_train * state_bytes


def probe_heap_bytes(costs: ProbeCosts, n_panel_cells: int, budget_mb: float, *, n_train: int,
                     row_bytes: int, state_bytes: int, tasks: int = 1, group_mb: float | None = None) -> float:
    """Peak heap of a probe worker: the fixed part, the panel's cell table, and the largest group's
    working bytes (:func:`probe_fit_bytes`)."""
    return (costs.heap_base_bytes + costs.heap_bytes_per_cell * n_panel_cells
            + probe_fit_bytes(n_train, row_bytes, state_bytes, budget_mb, tasks, group_mb))


# --- robustness -------------------------------------------------------------------------------------------------

def robustness_seconds(costs: RobustnessCosts, n_cells: int, width: int, *, full_max_cells: int,
                       anchors: int) -> float:
    """Seconds to score one unit of ``n_cells`` at ``width``: exact (n²) or anchor-sampled (anchors · n)."""
    if n_cells <= full_max_cells:
        return costs.seconds_per_pair_full * n_cells**2 * width
    return costs.seconds_per_pair_anchor * min(anchors, n_cells) * n_cells * width


def robustness_heap_bytes(costs: RobustnessCosts, n_cells: int, width: int, *, full_max_cells: int,
                          anchors: int) -> float:
    """Peak heap of scoring one unit: the fixed part, the query rows (every cell up to
    ``full_max_cells``, else the anchors) at ``width``, and the per-cell part. Candidates are read in
    chunks, so the unit's matrix itself is never held."""
    queries = n_cells if n_cells <= full_max_cells else min(anchors, n_cells)
    return (costs.heap_base_bytes + costs.heap_bytes_per_query_feature * queries * width
            + costs.heap_bytes_per_cell * n_cells)


# --- expression -------------------------------------------------------------------------------------------------

def expression_seconds(costs: ExpressionCosts, n_rows: int, width: int) -> float:
    """Seconds of one design's ridge over ``n_rows`` rows (train + val + test) of ``width`` columns."""
    return n_rows * width**2 * costs.seconds_per_row_width2 + width**3 * costs.seconds_per_width3


def expression_heap_bytes(width: int, read_rows: int) -> float:
    """Working bytes of one design's fit: three float64 w × w matrices and two float64 read blocks."""
    return 3 * 8 * width**2 + 2 * 8 * read_rows * width


def fit_expression_costs(runs: list[tuple[int, int, float]], *, cores: int, source: str) -> ExpressionCosts:
    """``seconds = n · w² · a + w³ · b`` through measured (n_rows, width, seconds) runs, least squares in
    relative error (the runs span orders of magnitude), from two shapes at least; a negative a or b,
    which no measurement has, is refused."""
    if len({(n, w) for n, w, _ in runs}) < 2:
        raise ConfigError(f"{source}: the expression cost needs runs of two shapes at least")
    rows = [(n * w**2 / t, w**3 / t) for n, w, t in runs]  # each run's equation divided by its seconds (= 1)
    sxx, sxy, syy = (sum(x * x for x, _ in rows), sum(x * y for x, y in rows), sum(y * y for _, y in rows))
    sx1, sy1 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = sxx * syy - sxy * sxy
    a, b = (sx1 * syy - sy1 * sxy) / det, (sy1 * sxx - sx1 * sxy) / det
    if a < 0 or b < 0:
        raise ConfigError(f"{source}: measured runs fit a = {a:.3g}, b = {b:.3g}; rerun the measurement on a quiet machine")
    return ExpressionCosts(a, b, cores, source)


# --- extraction -------------------------------------------------------------------------------------------------

_PARAMS = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMB]?)\s*$", re.IGNORECASE)


def parameter_count(text: str) -> float | None:
    """``"632M"`` → 6.32e8, ``"1.1B"`` → 1.1e9, ``"0"`` → 0; None when the registry gives no count."""
    match = _PARAMS.match(str(text))
    if not match:
        return None
    return float(match.group(1)) * {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9}[match.group(2).upper()]


def patch_gflop(parameters: float, input_size: int, patch_size: int, prefix_tokens: int) -> float:
    """GFLOP of one patch through a ViT: 2 · parameters · tokens (tokens = grid + prefix)."""
    tokens = (input_size // patch_size) ** 2 + prefix_tokens
    return 2.0 * parameters * tokens / 1e9


def extract_patches(costs: ExtractCosts, n_cells: int, magnification: str, input_size: int) -> float:
    """Patches a tiling of ``n_cells`` reads at ``magnification`` for an input of ``input_size`` px
    (patches per cell scale with the patch area)."""
    return n_cells * costs.patches_per_cell_224[magnification] * (224 / input_size) ** 2


def extract_seconds(costs: ExtractCosts, patches: float, gflop_per_patch: float, precision: str = "fp32",
                    input_size: int = 224) -> float:
    """Seconds to encode ``patches``: GFLOP × seconds per GFLOP (at ``precision`` where the entry has
    a rate per precision), or the read floor per patch (× (input_size / 224)²) when that is longer."""
    per_gflop = (costs.seconds_per_gflop_by_precision or {}).get(precision, costs.seconds_per_gflop)
    per_patch = gflop_per_patch * per_gflop
    if costs.seconds_per_patch_read is not None:
        per_patch = max(per_patch, costs.seconds_per_patch_read * (input_size / 224) ** 2)
    return patches * per_patch


def feature_bytes(n_cells: int, width: int, n_readouts: int) -> int:
    """Bytes of the float16 feature store: cells × width × stored readouts (Nuc, Mean and Cls when present)."""
    return int(n_cells) * int(width) * int(n_readouts) * FEATURE_BYTES


# --- per-section stages ----------------------------------------------------------------------------------------

def section_seconds(costs: SectionCosts, n_cells: int) -> float:
    """Seconds of one section of ``n_cells`` cells through the stage."""
    return costs.seconds_base + costs.seconds_per_cell * n_cells


def section_heap_bytes(costs: SectionCosts, n_cells: int) -> float:
    """Peak RSS (bytes) of the stage's process on one section of ``n_cells`` cells."""
    return costs.heap_base_bytes + costs.heap_bytes_per_cell * n_cells


def fit_section_costs(cells: list[int], seconds: list[float], peak_bytes: list[float], *, cores: int,
                      source: str) -> SectionCosts:
    """The least-squares lines of seconds and peak bytes in cells over measured sections (two sizes
    at least); a negative slope or intercept, which no stage has, is refused."""
    if len(set(cells)) < 2:
        raise ConfigError(f"{source}: a per-section cost needs sections of two sizes at least (got {sorted(set(cells))})")
    lines = []
    for values in (seconds, peak_bytes):
        slope, intercept = statistics.linear_regression(cells, values)
        if slope < 0 or intercept < 0:
            raise ConfigError(f"{source}: measured {values} at {cells} cells fit a line of slope {slope:.3g} and "
                              f"intercept {intercept:.3g}; a stage's cost does not fall with more cells: rerun the "
                              "measurement on a quiet machine")
        lines.append((intercept, slope))
    return SectionCosts(seconds_base=lines[0][0], seconds_per_cell=lines[0][1], heap_base_bytes=lines[1][0],
                        heap_bytes_per_cell=lines[1][1], cells=tuple(sorted(cells)), cores=cores, source=source)


# --- workers ----------------------------------------------------------------------------------------------------

def workers_needed(core_seconds: float, cores_per_worker: int, deadline_seconds: float) -> int:
    """Workers of ``cores_per_worker`` cores to spend ``core_seconds`` within ``deadline_seconds``,
    assuming the work divides into tasks finer than the deadline (ideal packing: a lower bound)."""
    if core_seconds <= 0:
        return 0
    return math.ceil(core_seconds / (cores_per_worker * deadline_seconds))
