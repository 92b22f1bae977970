"""Part (c): the probe engine on the device — a placeholder until the probe part is written.

The driver (``gpu.run``) calls ``measure(device, sizes, budget_s)`` with ``sizes = SIZES[...]["probe"]``
of ``gpu.run`` and records what it returns as ``parts.probe.result``; ``benchmarks/gpu/merge_costs.py``
turns that into the cost model's ``devices.cuda.probe``. What ``measure`` must return (JSON types):

* ``seconds_per_iteration``: ``{"in_memory": s, "streamed": s}`` — seconds per training row, design
  column (features + 1) and L-BFGS iteration of one fit, as the probe stage runs fits on the device
  (batched fits: the batch's wall time shared over its fits);
* ``seconds_per_pass``: ``{"in_memory": s, "streamed": s}`` — seconds per row (train + val + test)
  and design column of one read pass (standardise, product, scoring);
* ``source``: one line saying what was measured (sizes, iteration caps, solver);

and optionally ``iterations_per_c``, ``iterations_range`` ([p25, p75]) and ``iterations_source``
(the L-BFGS iterations per C of the device's solver; without them the ``cpu`` entry's are used),
``heap_base_bytes`` and ``heap_bytes_per_cell`` (the worker's host heap; without them the ``cpu``
entry's), and anything else worth keeping (e.g. ``peak_gpu_bytes``).
"""

from __future__ import annotations


def measure(device: str, sizes: dict, budget_s: float) -> dict:
    raise NotImplementedError("probe part: not written yet")
