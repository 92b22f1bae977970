"""Build a frozen encoder from its registry row and read its token grid.

Weights for a ``timm`` or ``transformers`` row come, in this order, from a local checkpoint
``<weights_dir>/<slug>/{model.safetensors, pytorch_model.bin}`` (with its ``config.json`` for a
transformers row) or from a snapshot already in the Hugging Face cache (looked up on disk only:
nothing is downloaded). Both are loaded strictly into the architecture the row describes, so a
wrong row is an error, not silently different features (beit3 rows: see beit3_format; a timm
row with ``lora``: see lora_format). ``custom:`` rows raise
:class:`EncoderUnavailable` saying what they need; ``offline:`` rows need no weights.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import timm
import torch
from torch import nn

from cellpath.errors import CellPathError, EncoderLoadError, EncoderUnavailable
from cellpath.features.encoders.beit3_format import Beit3Tokens, vision_state
from cellpath.features.encoders.convstem import ConvStem
from cellpath.features.encoders.filterbank import FilterBankEncoder
from cellpath.features.encoders.lora_format import holds_every_weight, wrap_for_lora_checkpoint
from cellpath.features.encoders.open_clip_format import build_open_clip_visual
from cellpath.features.encoders.registry import ENTRY_POINT_GROUP, EncoderSpec
from cellpath.features.encoders.transformers_format import build_transformers_module
from cellpath.features.encoders.weights import (CHECKPOINT_FILENAMES, WeightsFile, find_weights, locate_weights,
                                                portable_path)

log = logging.getLogger(__name__)

TIMM_LAYERS: dict[str, type[nn.Module]] = {
    "Mlp": timm.layers.Mlp,
    "SwiGLU": timm.layers.SwiGLU,
    "SwiGLUPacked": timm.layers.SwiGLUPacked,
    "GELU": nn.GELU,
    "SiLU": nn.SiLU,
    "ConvStem": ConvStem,
}
#: A timm key (part) → the row field that shapes it: named when a strict load fails on that key.
TIMM_KEY_FIELDS = {
    "pos_embed": "img_size (pos_embed holds one entry per grid token; dynamic_img_size resamples it)",
    "patch_embed.proj": "patch_size / embed_dim",
    "reg_token": "reg_tokens (registers)",
    "cls_token": "class_token",
    "mlp.fc1": "mlp_ratio (the MLP's hidden width = embed_dim × mlp_ratio) or mlp_layer",
    "mlp.w12": "mlp_layer / mlp_ratio",
    ".ls1.": "init_values (LayerScale)",
    "blocks.": "depth",
}
TRAINING_TEACHER = "teacher"  # the top-level key of a DINO/DINOv2 training checkpoint's teacher network
#: The autocast dtype of a row's ``precision`` on CUDA (None: fp32).
AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


@dataclass(eq=False)
class Encoder:
    """A frozen encoder in eval mode with the provenance of its weights."""

    spec: EncoderSpec
    module: nn.Module
    device: torch.device
    weights: str  # where the weights came from
    revision: str  # the resolved revision, for feature sidecars
    warnings: tuple[str, ...] = ()  # what disagrees without stopping the load (a hub config against the row)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Autocast dtype: the row's precision on CUDA, none (fp32) elsewhere."""
        return AUTOCAST_DTYPES[self.spec.precision] if self.device.type == "cuda" else None

    @torch.inference_mode()
    def forward_tokens(self, images: np.ndarray | torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Images → (cls (B, D) or None, grid (B, H, W, D)), float32 on the encoder's device.

        ``images``: (B, S, S, 3) RGB patches read at the target mpp, S = ``spec.input_size``; uint8
        in 0-255 or float in [0, 1]. Grid cell (i, j) is the token of input px rows
        [i·p, (i+1)·p) and columns [j·p, (j+1)·p), p = ``spec.patch_size``.
        """
        pixels = images_to_tensor(images, self.spec, self.device)
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            tokens = self.module.forward_features(pixels)
        return split_tokens(self.spec, tokens.float())


def load_encoder(spec: EncoderSpec, *, weights_dir: Path = Path("models"), device: str | torch.device = "cpu",
                 hf_cache_dir: Path | None = None, weights_path: Path | None = None) -> Encoder:
    """Build ``spec``'s encoder on ``device`` with its weights (see the module docstring for where
    they are looked up; ``hf_cache_dir`` defaults to the Hugging Face hub cache; ``weights_path``, a
    checkpoint file or a folder holding one, is used instead of looking)."""
    device = torch.device(device)
    warnings: list[str] = []
    if spec.loader.startswith("custom:"):
        raise EncoderUnavailable(
            f"{spec.name}: cellpath has no loader for {spec.loader!r} yet; it needs {spec.requires}. "
            "Leave this model out of the extract matrix until that adapter exists."
        )
    if spec.loader == "offline:filterbank":
        module, weights, revision = FilterBankEncoder(token_stride=spec.patch_size), "none (weight-free)", "weight-free"
    elif spec.loader == "offline:random-vit":
        with torch.random.fork_rng(devices=[]):  # built on the CPU: the same weights on any device
            torch.manual_seed(spec.init_seed)
            module = build_timm_module(spec)
        weights = f"random initialisation (seed {spec.init_seed})"
        revision = f"init_seed={spec.init_seed};torch={torch.__version__};timm={timm.__version__}"
    elif spec.loader.startswith("entry-point:"):
        module, weights, revision = build_entry_point_module(spec, weights_path, weights_dir, hf_cache_dir)
    else:
        found = locate_weights(spec, weights_path, weights_dir, hf_cache_dir)
        warnings = hub_config_warnings(spec, found)
        for warning in warnings:
            log.warning(warning)
        module, revision = _build_with_weights(spec, found, device, weights_dir, hf_cache_dir)
        weights = portable_path(found.path, hf_cache_dir)
    check_module(spec, module)
    module.eval().requires_grad_(False).to(device)
    return Encoder(spec=spec, module=module, device=device, weights=weights, revision=revision,
                   warnings=tuple(warnings))


def _build_with_weights(spec: EncoderSpec, found: WeightsFile, device: torch.device, weights_dir: Path,
                        hf_cache_dir: Path | None) -> tuple[nn.Module, str]:
    """A file loader's module with the checkpoint ``found`` loaded strictly, and the revision of
    what was read (a LoRA row's base weights, when its file lacks them, are the base row's)."""
    if spec.loader == "transformers":
        return build_transformers_module(spec, found.path.parent, found.path), found.revision
    if spec.loader == "open_clip":
        module = build_open_clip_visual(spec)
        load_weights_strict(module.visual, read_state_dict(found.path, spec), spec, found.path)
        return module, found.revision
    if spec.loader == "beit3":
        with device:
            module = Beit3Tokens(spec)
        load_weights_strict(module, vision_state(read_state_dict(found.path, spec)), spec, found.path)
        return module, found.revision
    with device:  # initialise on the target device: a GPU builds a 1B-parameter ViT in a moment
        module = build_timm_module(spec)
    state = read_state_dict(found.path, spec)
    if spec.lora is not None:
        base = lora_base_weights(spec, state, found.path, module, weights_dir, hf_cache_dir)
        base_state = None if base is None else read_state_dict(base.path, spec.lora.base_row)
        wrapped, state = wrap_for_lora_checkpoint(module, state, spec, found.path, base_state)
        load_weights_strict(wrapped, state, spec, found.path)
        return wrapped.merge_and_unload(), _lora_revision(spec, found, base)
    if spec.checkpoint.resample_pos_embed:
        state = resample_position_embeddings(module, state)
    if spec.checkpoint.timm_filter:
        state = sys.modules[type(module).__module__].checkpoint_filter_fn(state, module)
    load_weights_strict(module, state, spec, found.path)
    return module, found.revision


def lora_base_weights(spec: EncoderSpec, state: dict[str, torch.Tensor], path: Path, architecture: nn.Module,
                      weights_dir: Path, hf_cache_dir: Path | None) -> WeightsFile | None:
    """None when the LoRA checkpoint ``state`` (read from ``path``) holds every weight of the row's
    ``architecture``; else the ``lora.base`` row's checkpoint, which supplies the rest."""
    if holds_every_weight(state, architecture, spec.lora.adapter):
        return None
    if spec.lora.base_row is None:
        raise EncoderLoadError(
            f"{spec.name}: checkpoint {path} holds only part of {spec.timm_model}'s weights (the LoRA-adapted "
            "part) and the row names no lora.base: name the registry row of the base model whose checkpoint "
            "supplies the rest")
    return find_weights(spec.lora.base_row, weights_dir=weights_dir, hf_cache_dir=hf_cache_dir)


def weights_revision(spec: EncoderSpec, found: WeightsFile, weights_dir: Path, hf_cache_dir: Path | None) -> str:
    """The revision load_encoder records for a file loader's row whose checkpoint is ``found``
    (a LoRA row's names its base's too when the base supplies weights)."""
    if spec.lora is None:
        return found.revision
    with torch.device("meta"):  # the key names only
        architecture = build_timm_module(spec)
    base = lora_base_weights(spec, read_state_dict(found.path, spec), found.path, architecture, weights_dir,
                             hf_cache_dir)
    return _lora_revision(spec, found, base)


def _lora_revision(spec: EncoderSpec, found: WeightsFile, base: WeightsFile | None) -> str:
    return found.revision if base is None else f"{found.revision};base {spec.lora.base}={base.revision}"


def build_entry_point_module(spec: EncoderSpec, weights_path: Path | None, weights_dir: Path,
                             hf_cache_dir: Path | None) -> tuple[nn.Module, str, str]:
    """An encoder a package provides: the entry point ``<name>`` of group ``cellpath.encoders`` is a
    callable ``build(spec, weights) -> nn.Module`` whose ``forward_features(pixels)`` returns the
    tokens as timm's do; ``weights`` is the checkpoint found for the row (``None`` for a row without
    a hub_id, whose package brings its own), and the revision records it or the package's version."""
    from importlib.metadata import entry_points

    name = spec.loader.removeprefix("entry-point:")
    found = [point for point in entry_points(group=ENTRY_POINT_GROUP) if point.name == name]
    if not found:
        raise EncoderUnavailable(f"{spec.name}: no installed package provides the entry point {name!r} in group "
                                 f"{ENTRY_POINT_GROUP!r}; install the package that defines it")
    point = found[0]
    weights = None
    if weights_path is not None or spec.hub_id is not None:
        weights = locate_weights(spec, weights_path, weights_dir, hf_cache_dir)
    try:
        module = point.load()(spec, None if weights is None else weights.path)
    except CellPathError:
        raise
    except Exception as exc:  # noqa: BLE001 - a third-party builder's failure, named with its entry point
        raise EncoderLoadError(f"{spec.name}: the entry point {point.value} failed ({type(exc).__name__}: {exc})") \
            from None
    package = f"{point.dist.name}=={point.dist.version}" if point.dist is not None else point.value
    if weights is None:
        return module, f"built by {point.value}", package
    return module, portable_path(weights.path, hf_cache_dir), f"{weights.revision};{package}"


def build_timm_module(spec: EncoderSpec) -> nn.Module:
    """The row's timm architecture, randomly initialised (``pretrained=False``: no download)."""
    kwargs = {key: TIMM_LAYERS[value] if key in ("mlp_layer", "act_layer", "embed_layer") else value
              for key, value in spec.timm_kwargs.items()}
    try:
        return timm.create_model(spec.timm_model, pretrained=False, **kwargs)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise EncoderLoadError(
            f"{spec.name}: timm cannot build {spec.timm_model!r} with timm_kwargs {spec.timm_kwargs} ({exc}); "
            "fix this row in models/encoders.yaml"
        ) from None


def read_state_dict(path: Path, spec: EncoderSpec) -> dict[str, torch.Tensor]:
    """A flat state dict from a .safetensors or torch pickle (weights_only) file, taken from under
    ``checkpoint.state_dict_key`` when the file wraps it, with ``checkpoint.drop`` left out."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint gets the same actionable message
        raise EncoderLoadError(f"{spec.name}: cannot read checkpoint {path} ({type(exc).__name__}: {exc})") from None
    key = spec.checkpoint.state_dict_key
    if isinstance(state, dict) and not _flat(state) and TRAINING_TEACHER in state and key not in state:
        if not spec.checkpoint.dinov2_teacher:
            raise EncoderLoadError(f"{spec.name}: checkpoint {path} is a training checkpoint (top-level "
                                   f"{TRAINING_TEACHER!r}), not the released weights the row reads; use "
                                   f"{_released_file(spec)}")
        state = dinov2_teacher_backbone(state[TRAINING_TEACHER])
    elif key is not None and isinstance(state, dict) and not _flat(state):
        if key not in state:
            raise EncoderLoadError(f"{spec.name}: checkpoint {path} has no {key!r} entry (checkpoint.state_dict_key); "
                                   f"its top-level keys: {', '.join(map(str, list(state)[:8]))}")
        state = state[key]
    if not isinstance(state, dict) or not _flat(state):
        raise EncoderLoadError(f"{spec.name}: checkpoint {path} is not a flat state dict of tensors "
                               "(save model.state_dict() itself, or name its entry in checkpoint.state_dict_key)")
    state = timm.models.clean_state_dict(state)  # a DataParallel (module.) or compiled (_orig_mod.) model's keys
    prefix = spec.checkpoint.keep_prefix
    if prefix is not None:
        if not any(k.startswith(prefix) for k in state):
            raise EncoderLoadError(f"{spec.name}: checkpoint {path} has no key under {prefix!r} "
                                   f"(checkpoint.keep_prefix); its first keys: {', '.join(list(state)[:5])}")
        state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    dropped = tuple(spec.checkpoint.drop)
    return {k: v for k, v in state.items() if not k.startswith(dropped)} if dropped else state


def dinov2_teacher_backbone(teacher: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone of a DINOv2 training checkpoint's teacher as a timm ViT's state dict: keys under
    ``backbone.`` with the prefix removed, chunked blocks (``blocks.<chunk>.<i>.``) renumbered
    ``blocks.<i>.``, the mask token (training only) and the DINO/iBOT heads left out."""
    backbone = {k.removeprefix("backbone."): v for k, v in teacher.items() if k.startswith("backbone.")}
    return {re.sub(r"^blocks\.\d+\.(\d+)\.", r"blocks.\1.", k): v for k, v in backbone.items() if k != "mask_token"}


def _released_file(spec: EncoderSpec) -> str:
    """Where the row's released weights are, in words, for an error message."""
    name = spec.checkpoint.filename or " or ".join(CHECKPOINT_FILENAMES)
    return f"{name} from {spec.hub_repo}" if spec.hub_repo else name


def resample_position_embeddings(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's ``pos_embed`` resampled (bilinear) to ``module``'s patch grid, prefix entries kept."""
    if "pos_embed" not in state or state["pos_embed"].shape == module.pos_embed.shape:
        return state
    prefix = 0 if getattr(module, "no_embed_class", False) else module.num_prefix_tokens
    resampled = timm.layers.resample_abs_pos_embed(state["pos_embed"], new_size=module.patch_embed.grid_size,
                                                    num_prefix_tokens=prefix, interpolation="bilinear",
                                                    antialias=False, verbose=False)
    return state | {"pos_embed": resampled}


def _flat(state: dict) -> bool:
    return all(isinstance(v, torch.Tensor) for v in state.values())


def load_weights_strict(module: nn.Module, state: dict[str, torch.Tensor], spec: EncoderSpec, path: Path) -> None:
    """Load ``state`` into ``module``; any missing, unexpected or misshapen key is an error."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    misshapen = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
                 if k in state and state[k].shape != v.shape]
    if missing or unexpected or misshapen:
        hints = sorted({field for key in [*missing, *unexpected, *misshapen] for part, field in TIMM_KEY_FIELDS.items()
                        if part in key})
        raise EncoderLoadError(
            f"{spec.name}: checkpoint {path} does not match {_architecture(spec)}: {_first(missing, 'missing')}; "
            f"{_first(unexpected, 'unexpected')}; "
            f"{_first(misshapen, 'misshapen (checkpoint vs model)')}. "
            + (f"The field(s) these keys are shaped by: {'; '.join(hints)}. " if hints else "")
            + "Fix timm_kwargs in models/encoders.yaml or provide the checkpoint of this model."
        )
    module.load_state_dict(state, strict=True)


def hub_config_warnings(spec: EncoderSpec, found: WeightsFile) -> list[str]:
    """Where a timm row's cached hub ``config.json`` disagrees with the row: the architecture,
    model_args present in both, and (for a row whose mean/std follow the hub config) the pretrained
    mean/std, each printed with both values. Warnings, not errors: a port's config may carry other
    values than the model card while its weights are right, and whether weights fit the architecture
    is the strict load's to decide (an error there)."""
    config_path = found.path.parent / "config.json"
    if spec.loader != "timm" or found.origin != "hf-cache" or spec.lora is not None or not config_path.is_file():
        return []  # a LoRA repo's config.json is not the timm model's
    config = json.loads(config_path.read_text())
    problems = []
    if config.get("architecture") not in (None, spec.timm_model):
        problems.append(f"architecture {config['architecture']!r} vs timm_model {spec.timm_model!r}")
    for key, value in (config.get("model_args") or {}).items():
        if key in spec.timm_kwargs and not _same(spec.timm_kwargs[key], value):
            problems.append(f"model_args.{key} {value!r} vs timm_kwargs.{key} {spec.timm_kwargs[key]!r}")
    # a row whose mean/std follow the model card is not held to the hub config's (recorded in its notes)
    pretrained = (config.get("pretrained_cfg") or {}) if spec.mean_std_source == "hub-config" else {}
    for key in ("mean", "std"):
        if key in pretrained and not _same(tuple(pretrained[key]), getattr(spec, key)):
            problems.append(f"pretrained_cfg.{key} {pretrained[key]} vs {key} {list(getattr(spec, key))}")
    card = "; where the model card agrees with the row, record mean_std_source: model-card"
    return [f"{spec.name}: the hub config {config_path} disagrees with models/encoders.yaml: {problem}. The row's "
            f"value is used: check it against the model card{card if 'pretrained_cfg' in problem else ''}"
            for problem in problems]


def check_module(spec: EncoderSpec, module: nn.Module) -> None:
    """The built module's prefix-token count and token width must match the row."""
    for attribute, field in (("num_prefix_tokens", "num_prefix_tokens"), ("num_features", "embed_dim")):
        # a module without the attribute has no prefix tokens (Swin: a feature map, no CLS)
        value = getattr(module, attribute, 0 if attribute == "num_prefix_tokens" else None)
        if value != getattr(spec, field):
            raise EncoderLoadError(
                f"{spec.name}: the built module has {attribute} = {value}, the registry row says "
                f"{field} = {getattr(spec, field)}; fix {field} or timm_kwargs in models/encoders.yaml"
            )


def images_to_tensor(images: np.ndarray | torch.Tensor, spec: EncoderSpec, device: torch.device) -> torch.Tensor:
    """(B, S, S, 3) uint8 or [0, 1] float RGB → normalised (B, 3, S, S) float32 on ``device``."""
    pixels = torch.as_tensor(images)
    size = spec.input_size
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (size, size, 3):
        raise ValueError(f"{spec.name}: expected images of shape (B, {size}, {size}, 3) (RGB, channels last, "
                         f"read at the target mpp), got {tuple(pixels.shape)}")
    if pixels.dtype == torch.uint8:
        pixels = pixels.to(device).float() / 255.0
    elif pixels.is_floating_point():
        pixels = pixels.to(device, torch.float32)
        if pixels.numel() and (pixels.min() < 0 or pixels.max() > 1):
            raise ValueError(f"{spec.name}: float images must be in [0, 1]; pass uint8 for 0-255 values")
    else:
        raise ValueError(f"{spec.name}: images must be uint8 or float, got {pixels.dtype}")
    mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1)
    return ((pixels.permute(0, 3, 1, 2) - mean) / std).contiguous()


def split_tokens(spec: EncoderSpec, tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(B, prefix + H·W, D) tokens → (CLS (B, D) or None, grid (B, H, W, D)); H = W = spec.grid_size.

    The prefix (CLS first, then registers, as timm orders them) is dropped from the grid. A feature
    map in NHWC (B, H, W, D) — what timm's Swin returns — is read as its H·W tokens in row-major order.
    """
    if tokens.ndim == 4:
        tokens = tokens.flatten(1, 2)
    side, prefix = spec.grid_size, spec.num_prefix_tokens
    if tokens.ndim != 3 or tokens.shape[1] != prefix + side * side or tokens.shape[2] != spec.embed_dim:
        raise EncoderLoadError(
            f"{spec.name}: the encoder returned tokens of shape {tuple(tokens.shape)}; the registry expects "
            f"(B, {prefix} prefix + {side}×{side} grid, {spec.embed_dim}) for input_size {spec.input_size} and "
            f"patch_size {spec.patch_size}. Fix the row in models/encoders.yaml."
        )
    cls = tokens[:, 0] if spec.has_cls else None
    grid = tokens[:, prefix:].reshape(tokens.shape[0], side, side, spec.embed_dim)
    return cls, grid


def _architecture(spec: EncoderSpec) -> str:
    if spec.open_clip_model:
        return f"the vision tower of open_clip {spec.open_clip_model}"
    if spec.beit3_kwargs:
        return f"the BEiT-3 vision path of the row's beit3_kwargs ({spec.beit3_kwargs})"
    if spec.lora:
        return f"timm {spec.timm_model} with the registry's timm_kwargs, wrapped by peft LoRA"
    return f"timm {spec.timm_model} with the registry's timm_kwargs"


def _first(keys: list[str], what: str, shown: int = 5) -> str:
    if not keys:
        return f"no {what.split(' ')[0]} keys"
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} {what}: {', '.join(keys[:shown])}{more}"


def _same(a: object, b: object) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if numbers:
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)
    return a == b
