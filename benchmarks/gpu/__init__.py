"""The GPU measurement: one command (``benchmarks/gpu/run.sh``) that measures what the cost model's
``cuda`` entry needs, and the merge of its JSON into ``src/cellpath/data/costs.json``
(``benchmarks/gpu/merge_costs.py``). See benchmarks/gpu/README.md.

Every module here imports only what a bare GPU machine has (torch, timm, numpy, tifffile, yaml, the
standard library and the few ``cellpath`` modules that need nothing else): no pydantic, tiatoolbox,
faiss, mlflow or dvc. Each part is a module with ``measure(device, sizes, budget_s) -> dict``.
"""
