"""Encoders published in the transformers format: ``config.json`` plus ``model.safetensors`` or
``pytorch_model.bin`` (Phikon: ``ViTModel``; Phikon-v2: ``Dinov2Model``; Hibou: DINOv2 with four
registers, ``Dinov2WithRegistersModel``; PLIP: the vision tower of a CLIP checkpoint,
``CLIPVisionModel``).

The architecture comes from the checkpoint's own ``config.json``, checked against the registry row
(token width, patch size, register count, input size); the weights are read by transformers'
``from_pretrained`` (which maps the legacy key names the hub files carry), and every key must
load: a missing or misshapen weight is an error, and so is a checkpoint key the row does not name
in ``checkpoint.drop`` (e.g. PLIP's text tower, Phikon's pooler). Tokens are the model's
``last_hidden_state``: CLS, then the registers, then the grid in row-major order.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cellpath.errors import EncoderLoadError
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.encoders.weights import CONFIG_FILENAME

#: Families whose forward pass interpolates the position embeddings to any input size (as DINOv2's
#: reference implementation does); the others must be fed the size their config was trained at.
INTERPOLATING_CLASSES = ("Dinov2Model", "Dinov2WithRegistersModel")


class TransformersTokens(nn.Module):
    """A transformers vision model behind the encoder interface: ``forward_features`` → all tokens."""

    def __init__(self, model: nn.Module, num_prefix_tokens: int, num_features: int):
        super().__init__()
        self.model = model
        self.num_prefix_tokens = num_prefix_tokens
        self.num_features = num_features

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).last_hidden_state


def _model_class(spec: EncoderSpec):
    import transformers

    return getattr(transformers, spec.transformers_class)


def config_problems(spec: EncoderSpec, config) -> list[str]:
    """How ``config`` (the checkpoint's, a transformers vision config) disagrees with the row."""
    registers = int(getattr(config, "num_register_tokens", 0) or 0)
    image_size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    patch_size = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    problems = [f"{key} = {value} vs {field} = {expected}" for key, value, field, expected in (
        ("hidden_size", config.hidden_size, "embed_dim", spec.embed_dim),
        ("patch_size", patch_size, "patch_size", spec.patch_size),
        ("1 + num_register_tokens", 1 + registers, "num_prefix_tokens", spec.num_prefix_tokens),
    ) if value != expected]
    if image_size != spec.input_size and spec.transformers_class not in INTERPOLATING_CLASSES:
        problems.append(f"image_size = {image_size} vs input_size = {spec.input_size} "
                        f"({spec.transformers_class} does not interpolate its position embeddings)")
    return problems


def build_transformers_module(spec: EncoderSpec, folder: Path, source: Path) -> nn.Module:
    """The row's model from ``folder`` (its config.json and the weights file ``source``), every key checked."""
    from transformers.utils import logging as hf_logging

    model_class = _model_class(spec)
    config = model_class.config_class.from_pretrained(folder, local_files_only=True)
    if problems := config_problems(spec, config):
        raise EncoderLoadError(f"{spec.name}: {folder / CONFIG_FILENAME} disagrees with models/encoders.yaml: "
                    f"{'; '.join(problems)}. Fix the registry row or provide this model's checkpoint.")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report is checked below, not printed
    try:
        model, info = model_class.from_pretrained(folder, config=config, local_files_only=True,
                                                  output_loading_info=True, **spec.transformers_kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        raise EncoderLoadError(
            f"{spec.name}: transformers cannot load {source} ({type(exc).__name__}: {exc})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    dropped = tuple(spec.checkpoint.drop)
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith(dropped))
    missing, mismatched = sorted(info["missing_keys"]), sorted(str(k) for k in info["mismatched_keys"])
    if missing or unexpected or mismatched or info.get("error_msgs"):
        raise EncoderLoadError(
            f"{spec.name}: checkpoint {source} does not match transformers {spec.transformers_class} with its "
            f"config.json: {_listed(missing, 'missing')}; {_listed(unexpected, 'unexpected')} (keys the row "
            f"drops: {list(dropped) or 'none'}); {_listed(mismatched, 'misshapen')}. Fix checkpoint.drop or "
            "transformers_kwargs in models/encoders.yaml, or provide this model's checkpoint."
        )
    return TransformersTokens(model.float(), spec.num_prefix_tokens, config.hidden_size)


def _listed(keys: list[str], what: str, shown: int = 5) -> str:
    if not keys:
        return f"no {what} keys"
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} {what}: {', '.join(keys[:shown])}{more}"
