"""Benchmark (GPU): one real-size model per loader family through the autocast path, in img/s.

For each family — timm (UNI2), transformers (Phikon-v2), open_clip (OmiCLIP), beit3 (MUSK),
timm + LoRA (SEAL (UNI2)) — writes a checkpoint of random weights in the model's published file
layout (no download), loads it through ``load_encoder`` strictly, as a real checkpoint would be,
and times ``forward_tokens`` (autocast at the row's precision on CUDA) on batches of random
uint8 tiles after a warm-up (``gpu.encoders.compare_precisions``, the timing of benchmarks/gpu/run.sh). The baseline, in the same run and under the same conditions, is
the same module's ``forward_features`` in fp32 on the same tiles: ``speedup`` = fp32 time /
autocast time. Writes ``$OUT/encoder_gpu.json`` (or benchmarks/results/) with img/s, the speedup,
peak GPU memory, whether the tokens are finite and the grid shape.

Usage (on a machine with a GPU): python benchmarks/bench_encoder_gpu.py [--device cuda]
[--batch 64] [--batches 10]; ``--device cpu --batch 2 --batches 1`` is the smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

from cellpath.features.encoders.beit3_format import Beit3Tokens
from cellpath.features.encoders.loading import build_timm_module, images_to_tensor, load_encoder
from cellpath.features.encoders.registry import EncoderSpec, load_registry

from gpu.encoders import compare_precisions
from provenance import run_stamp, with_provenance

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"timm": "UNI2", "transformers": "Phikon-v2", "open_clip": "OmiCLIP", "beit3": "MUSK",
            "timm+lora": "SEAL (UNI2)"}


def write_checkpoint(spec: EncoderSpec, folder: Path) -> Path:
    """Random weights of ``spec``'s real-size architecture, in its published file layout."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    if spec.loader == "transformers":  # Phikon-v2: a DINOv2 ViT-L/16 at 224 (its hub config.json)
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                              intermediate_size=4096, patch_size=16, image_size=224, layerscale_value=1e-5)
        Dinov2Model(config).save_pretrained(folder)
        return folder
    if spec.loader == "open_clip":
        import open_clip

        visual = open_clip.create_model(spec.open_clip_model, pretrained=None).visual
        torch.save({"state_dict": {f"visual.{k}": v for k, v in visual.state_dict().items()}},
                   folder / spec.checkpoint.filename)
        return folder / spec.checkpoint.filename
    if spec.loader == "beit3":
        from safetensors.torch import save_file

        save_file(Beit3Tokens(spec).state_dict(), folder / "model.safetensors")
        return folder / "model.safetensors"
    state = build_timm_module(spec).state_dict()
    if spec.lora is None:
        from safetensors.torch import save_file

        save_file(state, folder / "model.safetensors")
        return folder / "model.safetensors"
    prefix, adapted = spec.checkpoint.keep_prefix, {}
    for module in ("blocks.23.attn.qkv", "blocks.23.attn.proj", "blocks.23.mlp.fc1", "blocks.23.mlp.fc2"):
        out_features, in_features = state[f"{module}.weight"].shape
        adapted |= {f"{prefix}{module}.base_layer.weight": state.pop(f"{module}.weight"),
                    f"{prefix}{module}.base_layer.bias": state.pop(f"{module}.bias"),
                    f"{prefix}{module}.lora_A.default.weight": torch.randn(8, in_features) * 0.01,
                    f"{prefix}{module}.lora_B.default.weight": torch.randn(out_features, 8) * 0.01}
    torch.save({"state_dict": {prefix + k: v for k, v in state.items()} | adapted}, folder / spec.checkpoint.filename)
    return folder / spec.checkpoint.filename


def bench(spec: EncoderSpec, device: torch.device, batch: int, n_batches: int, work: Path) -> dict:
    weights = write_checkpoint(spec, work / spec.slug)
    encoder = load_encoder(spec, weights_path=weights, device=device, weights_dir=work / "none",
                           hf_cache_dir=work / "hub")
    rng = np.random.default_rng(0)
    tiles = [rng.integers(0, 256, size=(batch, spec.input_size, spec.input_size, 3), dtype=np.uint8)
             for _ in range(n_batches)]
    # the same tiles, converted the same way, without autocast (the timing of benchmarks/gpu/encoders.py)
    rates = compare_precisions(encoder.forward_tokens,
                               lambda t: encoder.module.forward_features(images_to_tensor(t, spec, device)),
                               tiles, device)
    cls, grid = encoder.forward_tokens(tiles[0])
    return {"model": spec.name, "loader": spec.loader + ("+lora" if spec.lora else ""), "precision": spec.precision,
            "autocast_dtype": str(encoder.autocast_dtype), "input_size": spec.input_size,
            "grid": list(grid.shape[1:3]), "tokens_finite": bool(torch.isfinite(grid).all()
                                                                  and (cls is None or torch.isfinite(cls).all())),
            "autocast_img_per_s": round(rates["autocast"]["img_per_s"], 1),
            "fp32_img_per_s": round(rates["fp32"]["img_per_s"], 1),
            "speedup_fp32_over_autocast": round(rates["speedup_fp32_over_autocast"], 2),
            "peak_gpu_bytes": rates["autocast"]["peak_gpu_bytes"],
            "fp32_peak_gpu_bytes": rates["fp32"]["peak_gpu_bytes"], "revision": encoder.revision[:20]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    stamp = run_stamp()
    device = torch.device(args.device)
    registry = load_registry(ROOT / "models" / "encoders.yaml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            rows.append(bench(registry[FAMILIES[family]], device, args.batch, args.batches, Path(tmp) / family))
            print(json.dumps(rows[-1]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {"benchmark": "encoder_gpu", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or "cpu", "batch": args.batch, "batches": args.batches, "models": rows,
              "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    result = with_provenance(result | {"machine": {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads()}}, stamp)
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results") / "encoder_gpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
