"""Regenerate ``beit3_tiny.json``: MUSK's vision path computed by the reference BEiT-3 (torchscale).

MUSK (lilab-stanford/MUSK, ``musk/modeling.py``) is torchscale's ``BEiT3`` with ``vision_head``,
``language_head`` and ``logit_scale`` beside it; its vendored torchscale differs from PyPI's
torchscale 0.3.0 only by flash/dilated attention, off by default. torchscale 0.3.0 pins timm 0.6.13
and fairscale 0.4.0, so it cannot be a dependency of cellpath; run this by hand in a scratch
environment (``pip install --no-deps torchscale==0.3.0``, and either fairscale 0.4.0 or a stub
``fairscale.nn`` whose ``checkpoint_wrapper``/``wrap`` return the module: neither runs without
checkpoint_activations / fsdp). The JSON holds the reduced config, every state-dict key with its
shape, and ``encoder_out`` of ``beit3(visual_tokens=x)`` for weights and input drawn from numpy's
seeded generator (``tests/helpers/beit3_golden.py``, which the test uses too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchscale.architecture.config import EncoderConfig
from torchscale.model.BEiT3 import BEiT3

sys.path.insert(0, str(Path(__file__).parents[3]))  # tests/: the shared golden inputs
from helpers.beit3_golden import GOLDEN, SEED, golden_input, golden_weights  # noqa: E402

CONFIG = dict(img_size=32, patch_size=16, vocab_size=11, multiway=True, layernorm_embedding=False,
              normalize_output=True, no_output_layer=True, drop_path_rate=0.0, encoder_embed_dim=32,
              encoder_attention_heads=4, encoder_ffn_embed_dim=64, encoder_layers=2, max_source_positions=16)


class MuskLike(nn.Module):
    """MUSK's parameter layout: the BEiT-3 under ``beit3.`` and the two contrastive heads."""

    def __init__(self, args: EncoderConfig):
        super().__init__()
        self.beit3 = BEiT3(args)
        width = args.encoder_embed_dim
        self.language_head = nn.Linear(width, width, bias=False)
        self.vision_head = nn.Linear(width, width, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]))


def main() -> None:
    model = MuskLike(EncoderConfig(**CONFIG)).eval()
    shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
    weights = golden_weights(shapes)
    model.load_state_dict({key: torch.from_numpy(value) for key, value in weights.items()}, strict=True)
    with torch.no_grad():
        out = model.beit3(visual_tokens=torch.from_numpy(golden_input(CONFIG["img_size"])))["encoder_out"]
    document = {"source": "torchscale 0.3.0 BEiT3 (PyPI), MUSK's parameter layout", "seed": SEED,
                "config": CONFIG, "shapes": shapes, "encoder_out": np.round(out.numpy(), 6).tolist()}
    GOLDEN.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
