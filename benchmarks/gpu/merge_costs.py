"""Merge a GPU run's JSON (``benchmarks/gpu/run.sh``) into the cost model's ``devices.cuda``.

    python benchmarks/gpu/merge_costs.py gpu.json [--costs src/cellpath/data/costs.json]

Each part of the run that succeeded becomes a part of the ``cuda`` entry (a part the run lacks
keeps what the file has; every other device is left as it is, byte for byte). Units are those of
``cellpath.runtime.costs``, in seconds of one GPU (``cores`` 1):

* ``extract`` from part (a): per autocast precision ``p``, ``seconds_per_gflop_by_precision[p] =
  1 / (img/s × GFLOP per patch)`` of the slowest model measured at ``p`` (the registry's precision
  under autocast; every model's fp32 pass counts for ``fp32``), GFLOP being the cost model's
  ``patch_gflop`` of the row; ``seconds_per_gflop`` = the fp32 figure (for any other precision).
  From part (b): ``seconds_per_patch_read = 1 / (best read-only patches/s) × (224 / input)²``, the
  floor of a patch's time. ``patches_per_cell_224`` is the ``cpu`` entry's (a property of the tissue).
* ``probe`` from part (c) (``gpu.probe_part``): its ``seconds_per_iteration`` and ``seconds_per_pass``
  per mode; iterations and host heap its own where it gives them, else the ``cpu`` entry's.
* ``expression`` from part (e), only when its fits agreed with the CPU's: the least-squares line
  ``n · w² · a + w³ · b`` through its timings (``cellpath.runtime.costs.fit_expression_costs``), cores 1.
* ``robustness`` from part (d), only when its search agreed with the CPU's: ``seconds_per_pair_full``
  and ``seconds_per_pair_anchor`` = the timings' seconds / (queries × candidates × width); host heap
  the ``cpu`` entry's.

Each part's ``source`` names the JSON, its date, commit and GPU, and what it copies. A dry run
(``--tiny``, or any model cut in depth) or a run on another device is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from cellpath.errors import ConfigError
from cellpath.runtime.costs import COSTS_PATH, PROBE_MODES, CostModel, fit_expression_costs, load_costs

CUDA = "cuda"
_ORDER = ("probe", "robustness", "extract", "expression")  # as save_costs writes a device


class MergeError(Exception):
    """The JSON cannot be merged (a dry run, another device, a malformed part)."""


def _origin(record: dict, name: str) -> str:
    return f"{name} ({record['date']}, {record['commit']}, {record['device_name']})"


def _check_run(record: dict) -> None:
    if not str(record.get("device", "")).startswith(CUDA):
        raise MergeError(f"measured on {record.get('device')!r}, not a CUDA device: only a GPU's run fills "
                         "devices.cuda")
    models = (record["parts"].get("encoders", {}).get("result") or {}).get("models", [])
    if record.get("preset") != "device" or any(m.get("depth") is not None for m in models):
        raise MergeError("a dry run (--tiny: models cut to one block, tiny sizes): its figures are no costs")


def extract_entry(record: dict, name: str, model: CostModel) -> dict:
    """``devices.cuda.extract`` from parts (a) and (b) (see the module docstring)."""
    cpu = model.costs("cpu").extract
    if cpu is None:
        raise MergeError("the cost model has no cpu extract entry to take the patches per cell from")
    slowest: dict[str, tuple[float, str]] = {}
    for row in record["parts"]["encoders"]["result"]["models"]:
        if "autocast" not in row:
            continue
        for precision, rate in ((row["precision"], row["autocast"]["img_per_s"]), ("fp32", row["fp32"]["img_per_s"])):
            seconds = 1.0 / (rate * row["gflop_per_patch"])
            if seconds > slowest.get(precision, (0.0, ""))[0]:
                slowest[precision] = (seconds, row["name"])
    if "fp32" not in slowest:
        raise MergeError("part a measured no model")
    by_precision = {p: seconds for p, (seconds, _) in sorted(slowest.items())}
    summary, read = record.get("extraction_summary"), None
    text = ", ".join(f"{p} {s:.3g} ({who})" for p, (s, who) in sorted(slowest.items()))
    source = (f"{_origin(record, name)}: forward passes, seconds per GFLOP {text}, the slowest model per "
              "precision")
    if summary:
        size = record["parts"]["extraction"]["result"]["input_size"]
        read = (224 / size) ** 2 / summary["read_patches_per_s"]
        source += (f"; read floor {summary['read_patches_per_s']:,.0f} patches/s ({summary['read_workers']} "
                   f"workers, tifffile tiles); the ViT-L delivered {summary['delivered_patches_per_s']:,.0f} "
                   f"patches/s, forward alone {summary['forward_alone_patches_per_s']:,.0f}")
    return {"seconds_per_gflop": by_precision["fp32"], "patches_per_cell_224": dict(cpu.patches_per_cell_224),
            "cores": 1, "source": source + "; patches per cell: the cpu entry's",
            "seconds_per_gflop_by_precision": by_precision, "seconds_per_patch_read": read}


def probe_entry(record: dict, name: str, model: CostModel) -> dict:
    """``devices.cuda.probe`` from part (c)'s result (``gpu.probe_part`` says what it holds)."""
    result, cpu = record["parts"]["probe"]["result"], model.costs("cpu").probe
    equality = result.get("equality") or {}
    if not equality.get("agrees"):
        raise MergeError(f"part c's fits on the device differ from the CPU's (or were not compared): {equality}")
    for key in ("seconds_per_iteration", "seconds_per_pass"):
        missing = [mode for mode in PROBE_MODES if mode not in (result.get(key) or {})]
        if missing:
            raise MergeError(f"part c's result has no {key} for {', '.join(missing)} (needs {', '.join(PROBE_MODES)})")
    own = result.get("iterations")
    heap = {key: result[key] for key in ("heap_base_bytes", "heap_bytes_per_cell") if key in result}
    if (own is None or len(heap) < 2) and cpu is None:
        raise MergeError("part c gives no iterations or heap, and the cost model has no cpu probe entry to take "
                         "them from")
    iterations = {"iterations": own if own is not None else {
        **{key: list(value) for key, value in asdict(cpu.iterations).items() if key != "source"},
        "source": f"the cpu entry's: {cpu.iterations.source}"}}
    heap_measured = len(heap) == 2
    heap = heap if heap_measured else {"heap_base_bytes": cpu.heap_base_bytes,
                                        "heap_bytes_per_cell": cpu.heap_bytes_per_cell}
    return {"seconds_per_iteration": dict(result["seconds_per_iteration"]),
            "seconds_per_pass": dict(result["seconds_per_pass"]), **iterations, **heap,
            "source": f"{_origin(record, name)}: {result.get('source', 'part c')}; heap: "
                      f"{'measured there' if heap_measured else 'the cpu entry (host)'}"}


def robustness_entry(record: dict, name: str, model: CostModel) -> dict:
    """``devices.cuda.robustness`` from part (d)'s timings, when its search agreed with the CPU's."""
    result, cpu = record["parts"]["robustness"]["result"], model.costs("cpu").robustness
    if not result["compare"]["agrees"]:
        raise MergeError(f"part d's search differs from the CPU's beyond {result['tolerance']}: "
                         f"{result['compare']['against_numpy']}")
    if "seconds_per_pair_feature" not in result["full"] or "seconds_per_pair_feature" not in result["anchors"]:
        raise MergeError("part d needs both timings (every cell a query, and anchors)")
    if cpu is None:
        raise MergeError("the cost model has no cpu robustness entry to take the host heap from")
    full, anchors = result["full"], result["anchors"]
    return {"seconds_per_pair_full": full["seconds_per_pair_feature"],
            "seconds_per_pair_anchor": anchors["seconds_per_pair_feature"],
            "heap_base_bytes": cpu.heap_base_bytes, "heap_bytes_per_query_feature": cpu.heap_bytes_per_query_feature,
            "heap_bytes_per_cell": cpu.heap_bytes_per_cell, "cores": 1,
            "source": f"{_origin(record, name)}: torch exact search (blocked; faiss-gpu absent there), the k-NN "
                      f"(k = {result['k']}) and m = {result['m']} SO/OS in one pass, candidates copied from host "
                      f"memory; full at n = {full['cells']:,}, {anchors['queries']:,} anchors at n = "
                      f"{anchors['cells']:,}, width {full['width']}; agrees with the CPU's exact search within "
                      f"{result['tolerance']:g}; search only (no store reads); heap: the cpu entry's (host)"}


def expression_entry(record: dict, name: str, model: CostModel) -> dict:
    """``devices.cuda.expression`` from part (e)'s timings, when its fits agreed with the CPU's."""
    result = record["parts"]["expression"]["result"]
    if not result["equality"]["agrees"]:
        raise MergeError(f"part e's ridge differs from the CPU's: {result['equality']}")
    runs = [(t["rows"], t["width"], t["seconds"]) for t in result["timings"]]
    try:
        costs = fit_expression_costs(runs, cores=1, source=f"{_origin(record, name)}: {result['source']}")
    except ConfigError as error:
        raise MergeError(str(error)) from None
    return asdict(costs)


BUILDERS = {"extract": ("encoders", extract_entry), "probe": ("probe", probe_entry),
            "robustness": ("robustness", robustness_entry), "expression": ("expression", expression_entry)}


def cuda_entry(record: dict, name: str, model: CostModel, current: dict | None) -> tuple[dict, list[str]]:
    """The ``cuda`` entry: this run's parts that succeeded, else what ``current`` (the file's) has;
    and one line per stage saying which."""
    _check_run(record)
    entry, notes = {}, []
    for stage in _ORDER:
        part, build = BUILDERS[stage]
        status = record["parts"].get(part, {}).get("status", "not run")
        if status == "ok":
            entry[stage] = build(record, name, model)
            notes.append(f"{stage}: from part {part}")
        else:
            entry[stage] = (current or {}).get(stage)
            notes.append(f"{stage}: part {part} {status}; " + ("kept the file's" if entry[stage] else "not measured"))
    return entry, notes


def merge(record_path: Path, costs_path: Path = COSTS_PATH) -> list[str]:
    """Write ``devices.cuda`` of ``costs_path`` from ``record_path``; the notes of what it wrote."""
    record = json.loads(Path(record_path).read_text())
    model = load_costs(costs_path)
    raw = json.loads(Path(costs_path).read_text())
    entry, notes = cuda_entry(record, Path(record_path).name, model, raw["devices"].get(CUDA))
    if not any(entry.values()):
        raise MergeError("no part of the run succeeded: nothing to merge")
    raw["devices"][CUDA] = {stage: {k: v for k, v in part.items() if v is not None} if part else None
                            for stage, part in entry.items()}
    partial = Path(costs_path).with_suffix(".json.tmp")
    partial.write_text(json.dumps(raw, indent=2) + "\n")
    try:
        load_costs(partial)  # what is written must load
    except Exception:
        partial.unlink()
        raise
    partial.replace(costs_path)
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help="the gpu.json of benchmarks/gpu/run.sh")
    parser.add_argument("--costs", type=Path, default=COSTS_PATH, help="the cost model (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        notes = merge(args.record, args.costs)
    except MergeError as error:
        print(f"merge_costs: {args.record}: {error}", file=sys.stderr)
        return 1
    print("\n".join([f"wrote devices.cuda of {args.costs}", *notes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
