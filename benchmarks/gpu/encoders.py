"""Part (a): encoder forward rates at the registry's precision against fp32, and peak GPU memory.

One row of ``models/encoders.yaml`` per ViT size (``SIZES["models"]``: a ViT-S, a ViT-L and a
ViT-g), built with timm from the row's ``timm_model`` and ``timm_kwargs`` with random weights at
their real size (no download; built directly on the device). The row is read as YAML, not through
``cellpath.features.encoders`` (which needs pydantic), so only timm rows without the project's own
layers (ConvStem) can be measured here. Each model runs ``forward_features`` on batches of random
uint8 tiles, normalised with the row's mean and std as ``Encoder.forward_tokens`` does, under
autocast at the row's precision, then in fp32 on the same batches: images per second, peak
``torch.cuda.max_memory_allocated`` (bytes), and the speedup (fp32 seconds / autocast seconds).
``gflop_per_patch`` is the cost model's figure for the row (``cellpath.runtime.costs.patch_gflop``
of its registry ``params``), so a rate here is a seconds-per-GFLOP there.

:func:`timed` and :func:`compare_precisions` are the timing ``benchmarks/bench_encoder_gpu.py``
uses as well (one implementation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from cellpath.runtime.costs import parameter_count, patch_gflop

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "models" / "encoders.yaml"
AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
#: Registry rows of the three sizes: a ViT-S/16 (fp32), a ViT-L/16 (bf16) and a ViT-g/14 (fp16).
MODELS = {"ViT-S": "Kaiko ViT-S/16", "ViT-L": "UNI", "ViT-g": "H-Optimus-0"}
_LAYERS = ("mlp_layer", "act_layer", "embed_layer")


def registry_rows(path: Path = REGISTRY) -> dict[str, dict]:
    """The registry's rows keyed by model name, as plain YAML (no validation: that needs pydantic)."""
    import yaml

    return {row["name"]: row for row in yaml.safe_load(Path(path).read_text())["encoders"]}


def _layer(name: str) -> type[nn.Module]:
    """A layer class named in ``timm_kwargs`` (timm's MLPs, torch's activations)."""
    import timm.layers

    if hasattr(timm.layers, name):
        return getattr(timm.layers, name)
    if hasattr(nn, name):
        return getattr(nn, name)
    raise ValueError(f"timm_kwargs names layer {name!r}, which only cellpath's loader builds")


def build_module(row: dict, device: torch.device, depth: int | None = None) -> nn.Module:
    """The row's timm architecture with random weights, built on ``device``, in eval mode;
    ``depth`` (blocks) replaces the row's for a quick dry run."""
    import timm

    kwargs = {key: _layer(value) if key in _LAYERS else value for key, value in (row.get("timm_kwargs") or {}).items()}
    if depth is not None:
        kwargs["depth"] = depth
    torch.manual_seed(0)
    with torch.device(device):
        module = timm.create_model(row["timm_model"], pretrained=False, **kwargs)
    return module.eval().requires_grad_(False)


def to_pixels(tiles: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(B, S, S, 3) uint8 tiles → normalised (B, 3, S, S) float32 on their device (as images_to_tensor)."""
    mean_t = torch.tensor(mean, device=tiles.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=tiles.device).view(1, 3, 1, 1)
    return ((tiles.float() / 255.0).permute(0, 3, 1, 2) - mean_t).div_(std_t).contiguous()


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[object], object], batches: Sequence, device: torch.device,
          deadline: float | None = None) -> tuple[float, int]:
    """(seconds, batches run) of ``run`` over ``batches`` after one warm-up call on the first (kernel
    selection, autotuning); stops early once ``time.perf_counter()`` passes ``deadline``."""
    run(batches[0])
    synchronise(device)
    started, done = time.perf_counter(), 0
    for batch in batches:
        run(batch)
        done += 1
        if deadline is not None and time.perf_counter() > deadline:
            break
    synchronise(device)
    return time.perf_counter() - started, done


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def compare_precisions(run_autocast: Callable[[object], object], run_fp32: Callable[[object], object],
                       batches: Sequence, device: torch.device, deadline: float | None = None) -> dict:
    """The same batches through ``run_autocast`` then ``run_fp32`` (inference mode): per path img/s,
    images, seconds and peak GPU bytes, and ``speedup_fp32_over_autocast`` (seconds per image)."""
    now = time.perf_counter()
    halfway = None if deadline is None else now + (deadline - now) / 2
    out = {}
    with torch.inference_mode():
        for name, run, until in (("autocast", run_autocast, halfway), ("fp32", run_fp32, deadline)):
            _peak_reset(device)
            seconds, done = timed(run, batches, device, until)
            images = sum(len(batch) for batch in batches[:done])
            out[name] = {"img_per_s": images / seconds, "images": images, "seconds": seconds,
                         "peak_gpu_bytes": _peak(device)}
    out["speedup_fp32_over_autocast"] = out["autocast"]["img_per_s"] / out["fp32"]["img_per_s"]
    return out


def forward(module: nn.Module, row: dict, dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 tiles → tokens, under autocast at ``dtype`` (None: fp32), as ``Encoder.forward_tokens``."""
    def run(tiles: torch.Tensor) -> torch.Tensor:
        pixels = to_pixels(tiles, row["mean"], row["std"])
        with torch.autocast(tiles.device.type, dtype=dtype, enabled=dtype is not None):
            return module.forward_features(pixels)
    return run


def model_gflop(row: dict) -> float:
    """The cost model's GFLOP per patch of a registry row (2 · registry params · tokens)."""
    return patch_gflop(parameter_count(row["params"]), row["input_size"], row["patch_size"], row["num_prefix_tokens"])


def measure_model(label: str, row: dict, device: torch.device, sizes: dict, deadline: float) -> dict:
    """One row's forward rates (see the module docstring), its shapes and its tokens' finiteness."""
    module = build_module(row, device, sizes.get("depth"))
    size, batch = row["input_size"], sizes["batch"]
    generator = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=device, generator=generator)
               for _ in range(sizes["batches"])]
    dtype = AUTOCAST[row["precision"]] if device.type == "cuda" else None
    rates = compare_precisions(forward(module, row, dtype), forward(module, row, None), batches, device, deadline)
    with torch.inference_mode():
        tokens = forward(module, row, dtype)(batches[0])
    return {"label": label, "name": row["name"], "timm_model": row["timm_model"], "precision": row["precision"],
            "autocast_dtype": str(dtype), "input_size": size, "patch_size": row["patch_size"],
            "prefix_tokens": row["num_prefix_tokens"], "embed_dim": row["embed_dim"],
            "registry_params": str(row["params"]), "parameters": sum(p.numel() for p in module.parameters()),
            "depth": sizes.get("depth"), "gflop_per_patch": model_gflop(row), "batch": batch,
            "tokens_shape": list(tokens.shape), "tokens_finite": bool(torch.isfinite(tokens.float()).all()), **rates}


def measure(device: str, sizes: dict, budget_s: float) -> dict:
    """Part (a): every model of ``sizes["models"]`` (label → registry name), each its share of the
    budget; a model that fails is recorded with its error and the others still run."""
    dev = torch.device(device)
    rows = registry_rows(Path(sizes.get("registry", REGISTRY)))
    labels = sizes.get("models", MODELS)
    end = time.perf_counter() + budget_s
    out = []
    for i, (label, name) in enumerate(labels.items()):
        deadline = time.perf_counter() + (end - time.perf_counter()) / (len(labels) - i)
        try:
            out.append(measure_model(label, rows[name], dev, sizes, deadline))
        except Exception as error:  # noqa: BLE001 - one model's failure is recorded, the others still run
            out.append({"label": label, "name": name, "error": f"{type(error).__name__}: {error}"})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"part a: {out[-1]}", flush=True)
    return {"models": out, "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "tiles": "torch.randint uint8, seed 0"}
