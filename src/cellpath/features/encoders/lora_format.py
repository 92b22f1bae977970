"""Checkpoints of a timm model fine-tuned with LoRA (SEAL: ``MahmoodLab/SEAL``, ``seal_*_vision.pth``).

SEAL wraps its base encoder (UNI2-h, CONCH's trunk) with peft's LoRA on the last block's attention
and MLP linears and saves the whole training module: the encoder's keys sit under
``encoder.base_model.model.`` (the row's ``checkpoint.keep_prefix``), beside a reconstruction
decoder that is not kept. An adapted linear's weights are ``<module>.base_layer.{weight,bias}``,
``<module>.lora_A.<adapter>.weight`` (r × in) and ``<module>.lora_B.<adapter>.weight`` (out × r).

The adapted modules and each one's rank are read from the file; peft (``LoraModel``) wraps exactly
those modules of the row's freshly built timm model, the file loads strictly into it, and
``merge_and_unload`` folds every adapter into its linear — W = W₀ + (alpha / r)·B·A — giving back the
plain timm model, whose tokens are read as for any timm row. A file that holds only the adapted
part takes every other weight from the ``lora.base`` row's checkpoint (the base model itself).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cellpath.errors import EncoderLoadError
from cellpath.features.encoders.registry import EncoderSpec

BASE_LAYER = ".base_layer."
PEFT_PREFIX = "model."  # LoraModel holds the wrapped model as .model


def adapted_modules(state: dict[str, torch.Tensor], adapter: str) -> dict[str, int]:
    """Module name → LoRA rank, for every ``<module>.lora_A.<adapter>.weight`` in ``state``."""
    suffix = f".lora_A.{adapter}.weight"
    return {key.removesuffix(suffix): int(value.shape[0]) for key, value in state.items() if key.endswith(suffix)}


def with_base_weights(state: dict[str, torch.Tensor], base_state: dict[str, torch.Tensor],
                      expected: list[str]) -> dict[str, torch.Tensor]:
    """``state`` completed from the base model's ``base_state`` for every ``expected`` key it lacks
    (an adapted module's ``base_layer`` weights come from the base's plain key)."""
    filled = dict(state)
    for key in expected:
        plain = key.replace(BASE_LAYER, ".")
        if key not in filled and plain in base_state:
            filled[key] = base_state[plain]
    return filled


def wrap_for_lora_checkpoint(module: nn.Module, state: dict[str, torch.Tensor], spec: EncoderSpec, path: Path,
                             base_state: dict[str, torch.Tensor] | None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``module`` (the row's timm architecture) wrapped by peft's ``LoraModel`` on the modules the
    LoRA checkpoint ``state`` adapts, and ``state`` keyed for it (completed from ``base_state`` when
    given): load it strictly, then ``merge_and_unload()`` gives the merged timm model."""
    from peft import LoraConfig, LoraModel

    lora = spec.lora
    ranks = adapted_modules(state, lora.adapter)
    if not ranks:
        raise EncoderLoadError(
            f"{spec.name}: checkpoint {path} holds no LoRA weights (keys ending .lora_A.{lora.adapter}.weight "
            f"under {spec.checkpoint.keep_prefix!r}); it is not a LoRA checkpoint of this row's model, or "
            "lora.adapter names another adapter")
    rank = max(ranks.values(), key=list(ranks.values()).count)  # peft: r, with rank_pattern for the others
    config = LoraConfig(r=rank, lora_alpha=lora.alpha, target_modules=sorted(ranks), lora_dropout=0.0,
                        use_rslora=lora.use_rslora, rank_pattern={name: r for name, r in ranks.items() if r != rank})
    try:
        wrapped = LoraModel(module, config, lora.adapter)
    except ValueError as exc:  # a module the file adapts that the row's architecture lacks
        raise EncoderLoadError(f"{spec.name}: checkpoint {path} adapts modules that timm {spec.timm_model} with "
                               f"the row's timm_kwargs does not have ({exc})") from None
    state = {PEFT_PREFIX + key: value for key, value in state.items()}
    if base_state is not None:
        state = with_base_weights(state, {PEFT_PREFIX + key: value for key, value in base_state.items()},
                                  list(wrapped.state_dict()))
    return wrapped, state


def holds_every_weight(state: dict[str, torch.Tensor], module: nn.Module, adapter: str) -> bool:
    """Whether the LoRA checkpoint ``state`` carries all of ``module``'s weights (else a base is needed)."""
    adapted = adapted_modules(state, adapter)
    for key in module.state_dict():
        owner, _, leaf = key.rpartition(".")
        if (f"{owner}{BASE_LAYER}{leaf}" if owner in adapted else key) not in state:
            return False
    return True
