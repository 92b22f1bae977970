"""The encoder registry: ``models/encoders.yaml`` parsed into validated :class:`EncoderSpec` rows.

A row says how to build an encoder (loader, timm architecture and kwargs), how to feed it (mean/std
of [0, 1] RGB, input size in px at the target mpp) and how to read its tokens (token stride
``patch_size`` in input px, ``num_prefix_tokens`` = CLS + registers before the H×W grid, whether a
CLS token exists). Importing this module does not import torch or timm.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, model_validator

from cellpath.errors import ConfigError

DEFAULT_REGISTRY_PATH = Path("models/encoders.yaml")

# Class names the loader resolves for the timm kwargs ``mlp_layer``, ``act_layer`` and ``embed_layer``.
TIMM_LAYER_NAMES = ("Mlp", "SwiGLU", "SwiGLUPacked", "GELU", "SiLU", "ConvStem")
_LAYER_KWARGS = ("mlp_layer", "act_layer", "embed_layer")

LOADER_PATTERN = (r"^(timm|transformers|open_clip|beit3|entry-point:[A-Za-z0-9_.-]+|custom:[a-z0-9][a-z0-9.-]*"
                  r"|offline:(random-vit|filterbank))$")
#: The entry-point group a package registers its own encoders in (``loader: entry-point:<name>``).
ENTRY_POINT_GROUP = "cellpath.encoders"
#: transformers model classes a ``transformers`` row can name (vision backbones returning last_hidden_state).
TransformersClass = Literal["ViTModel", "Dinov2Model", "Dinov2WithRegistersModel", "CLIPVisionModel"]
HUB_ID_PATTERN = r"^hf-hub:[A-Za-z0-9][\w.-]*/[\w.-]+$"

Rgb = tuple[float, float, float]
KwargValue = bool | int | float | str


class RegistryError(ConfigError):
    """models/encoders.yaml is missing or invalid; the message names the file, model and key."""


class UnknownEncoder(RegistryError):
    """An encoder entry that is not a registry slug (or name, where names are accepted)."""

    def __init__(self, where: str, entry: str, reason: str):
        super().__init__(f"{where}: {entry!r}: {reason}")
        self.reason = reason


class CheckpointSpec(BaseModel):
    """How a row's published checkpoint differs from a bare state dict of its architecture.

    ``filename``: the file's name in the hub repo and in ``models/<slug>/`` when it is not
    ``model.safetensors`` / ``pytorch_model.bin`` (e.g. GPFM's ``GPFM.pth``); ``state_dict_key``: the
    key holding the state dict when the file wraps it in a dict (a file that is already flat is read
    as is); ``keep_prefix``: the encoder's keys sit under this prefix (CONCH's ``visual.trunk.``):
    only they are kept, the prefix stripped; ``drop``: keys (exact, or prefixes ending in ".") of
    other heads or towers, left out (e.g. a CLIP checkpoint's text tower); every other key must load.
    ``resample_pos_embed``: resample the checkpoint's position embeddings to the built model's grid
    before the strict load (bilinear, as CONCH v1.5's reference loader does). ``filename`` may be a
    path inside the hub repo (``models/<slug>/`` holds its last part); ``repo_type`` is ``dataset``
    for a file kept in a dataset repo (CTransPath's in MahmoodLab/hest-bench). ``timm_filter``:
    pass the state dict through the architecture's own timm ``checkpoint_filter_fn``, which converts
    checkpoints of older timm layouts (e.g. Swin's downsample moved to the next stage).
    ``dinov2_teacher``: also accept the DINOv2 training checkpoint the model's authors release (a dict
    with the ``teacher`` network's keys under ``backbone.``, blocks in chunks, DINO/iBOT heads beside
    it): its backbone is read, un-chunked, without the heads and the mask token (GPFM's GitHub
    release ``GPFM.pth``). Keys of a DataParallel or compiled model (``module.``, ``_orig_mod.``) are
    read without that prefix in every row (timm's ``clean_state_dict``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    filename: Annotated[str, Field(pattern=r"^([\w.-]+/)*[\w.-]+\.(safetensors|bin|pth|pt)$")] | None = None
    repo_type: Literal["model", "dataset"] = "model"
    state_dict_key: str | None = None
    keep_prefix: str | None = None
    drop: tuple[str, ...] = ()
    resample_pos_embed: bool = False
    timm_filter: bool = False
    dinov2_teacher: bool = False


class Beit3Kwargs(BaseModel):
    """A BEiT-3 vision path's shape (MUSK's ``_get_large_config``): layers, attention heads and the
    feed-forward width; token width, patch size and input size are the row's own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    depth: PositiveInt
    num_heads: PositiveInt
    ffn_dim: PositiveInt


class LoraSpec(BaseModel):
    """A checkpoint of the row's timm architecture wrapped by peft's LoRA (SEAL): its adapted
    modules hold ``<module>.base_layer.*`` and ``<module>.lora_{A,B}.<adapter>.weight`` (which
    modules, and the rank, are read from the file). The adapters are merged into the weights at
    load, W = W₀ + (alpha / r)·B·A (``alpha / √r`` with ``use_rslora``). ``alpha`` is not in the
    file: it is the training config's. ``base``: the registry row whose checkpoint supplies the
    weights a file holding only the adapted part lacks (a file with every weight needs none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: PositiveFloat
    adapter: Annotated[str, Field(pattern=r"^[\w.-]+$")] = "default"
    use_rslora: bool = False
    base: str | None = None
    #: ``base``'s row, filled in by :func:`parse_rows` (not written in the registry file).
    base_row: EncoderSpec | None = None


class EncoderSpec(BaseModel):
    """One registry row. Units: ``input_size`` and ``patch_size`` in px of the encoder input (the
    patch read at the target mpp); ``native_mpp`` in µm/px; ``mean``/``std`` for [0, 1] RGB."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1)]
    type: Literal["PV", "PVL", "PVO", "GV", "control"]
    architecture: str
    hub_id: Annotated[str, Field(pattern=HUB_ID_PATTERN)] | None
    revision: Annotated[str, Field(min_length=1)]
    loader: Annotated[str, Field(pattern=LOADER_PATTERN)]
    timm_model: str | None = None
    timm_kwargs: dict[str, KwargValue] = Field(default_factory=dict)
    transformers_class: TransformersClass | None = None
    transformers_kwargs: dict[str, KwargValue] = Field(default_factory=dict)
    open_clip_model: str | None = None
    beit3_kwargs: Beit3Kwargs | None = None
    checkpoint: CheckpointSpec = CheckpointSpec()
    lora: LoraSpec | None = None
    #: Where mean/std come from: the cached hub config (checked against the row when present), or
    #: the model card where the two disagree (the hub config's values are then not compared).
    mean_std_source: Literal["hub-config", "model-card"] = "hub-config"
    requires: str | None = None
    init_seed: int | None = None
    mean: Rgb
    std: tuple[PositiveFloat, PositiveFloat, PositiveFloat]
    input_size: PositiveInt
    patch_size: PositiveInt
    num_prefix_tokens: Annotated[int, Field(ge=0)]
    has_cls: bool
    embed_dim: PositiveInt
    native_mpp: PositiveFloat | None
    pretrain_magnification: str | None
    precision: Literal["fp16", "bf16", "fp32"]
    #: Table 6's input size where the row departs from it (the reason is in ``notes``).
    paper_input_size: PositiveInt | None = None
    params: str | None
    pretrain_wsi_equivalent: str | None
    notes: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> "EncoderSpec":
        if self.input_size % self.patch_size:
            raise ValueError(f"input_size {self.input_size} is not a multiple of patch_size {self.patch_size}")
        if self.has_cls and self.num_prefix_tokens < 1:
            raise ValueError("has_cls is true but num_prefix_tokens is 0 (the CLS token is a prefix token)")
        builds_timm = self.loader in ("timm", "offline:random-vit")
        if builds_timm != (self.timm_model is not None):
            raise ValueError(f"timm_model is required for loader {self.loader!r}" if builds_timm
                             else f"timm_model is only used by timm loaders, not {self.loader!r}")
        if self.timm_kwargs and not builds_timm:
            raise ValueError(f"timm_kwargs are only used by timm loaders, not {self.loader!r}")
        if (self.loader == "transformers") != (self.transformers_class is not None):
            raise ValueError("transformers_class is required for loader 'transformers'"
                             if self.loader == "transformers" else
                             f"transformers_class is only used by the transformers loader, not {self.loader!r}")
        if (self.loader == "open_clip") != (self.open_clip_model is not None):
            raise ValueError("open_clip_model is required for loader 'open_clip'" if self.loader == "open_clip"
                             else f"open_clip_model is only used by the open_clip loader, not {self.loader!r}")
        if (self.loader == "beit3") != (self.beit3_kwargs is not None):
            raise ValueError("beit3_kwargs are required for loader 'beit3'" if self.loader == "beit3"
                             else f"beit3_kwargs are only used by the beit3 loader, not {self.loader!r}")
        if self.lora is not None and self.loader != "timm":
            raise ValueError(f"lora is read into a timm architecture; loader {self.loader!r} cannot take it")
        if self.transformers_kwargs and self.loader != "transformers":
            raise ValueError(f"transformers_kwargs are only used by the transformers loader, not {self.loader!r}")
        if self.loader.startswith("custom:") != (self.requires is not None):
            raise ValueError("requires (what the custom loader needs) must be given exactly for custom: loaders")
        if (self.loader == "offline:random-vit") != (self.init_seed is not None):
            raise ValueError("init_seed must be given exactly for loader offline:random-vit")
        if self.paper_input_size == self.input_size:
            raise ValueError("paper_input_size is only given where the row departs from Table 6's input size")
        resized = self.timm_kwargs.get("dynamic_img_size") is True  # position embeddings resampled to the input
        for key, expected in (("img_size", self.input_size), ("patch_size", self.patch_size),
                              ("embed_dim", self.embed_dim)):
            if key == "img_size" and resized:
                continue
            if key in self.timm_kwargs and self.timm_kwargs[key] != expected:
                field = key.replace("img_", "input_")
                raise ValueError(f"timm_kwargs.{key} = {self.timm_kwargs[key]!r} disagrees with {field} = {expected}")
        for key in _LAYER_KWARGS:
            if key in self.timm_kwargs and self.timm_kwargs[key] not in TIMM_LAYER_NAMES:
                raise ValueError(f"timm_kwargs.{key} = {self.timm_kwargs[key]!r} is not one of "
                                 f"{', '.join(TIMM_LAYER_NAMES)}")
        return self

    @property
    def grid_size(self) -> int:
        """Side of the token grid (tokens per row and per column)."""
        return self.input_size // self.patch_size

    @property
    def slug(self) -> str:
        """File-system name: weights in ``models/<slug>/``, features in ``data/features/<slug>/``."""
        return model_slug(self.name)

    @property
    def hub_repo(self) -> str | None:
        """The Hugging Face repo id without the ``hf-hub:`` prefix."""
        return None if self.hub_id is None else self.hub_id.removeprefix("hf-hub:")


LoraSpec.model_rebuild()


def model_slug(name: str) -> str:
    """``"Kaiko ViT-L/14"`` → ``"kaiko-vit-l-14"``: lower case, runs of other characters → ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def load_registry(path: Path | str | None = None) -> dict[str, EncoderSpec]:
    """Read and validate the registry (default ``models/encoders.yaml`` under the working directory).

    Returns the rows keyed by model name, in file order. Raises RegistryError naming the file, the
    model and the key at fault.
    """
    path = Path(path) if path is not None else DEFAULT_REGISTRY_PATH
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read the encoder registry ({exc.strerror}); run from the "
                            "project root or pass the registry path") from None
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(document, dict) or set(document) != {"notes", "encoders"} \
            or not isinstance(document["encoders"], list):
        found = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise RegistryError(f"{path}: expected exactly the top-level keys 'notes' and 'encoders' "
                            f"(a list of rows), found {found}")
    return parse_rows(document["encoders"], source=str(path))


def resolve_encoder(registry: dict[str, EncoderSpec], entry: str, *, where: str = "extract.encoders",
                    source: Path | str = "the encoder registry", accept_names: bool = False) -> EncoderSpec:
    """The registry row whose slug is ``entry`` (or, with ``accept_names``, whose name is).

    The one name-or-slug resolver. ``extract.encoders`` lists slugs, since a slug names the DVC
    output folder ``data/features/<slug>/`` of its matrix stage; ``cellpath extract --encoder``
    accepts a name too. An unknown entry raises a RegistryError naming ``where``, the closest slug
    and every known one (``source``: the registry file); a name where a slug is needed names its slug.
    """
    by_slug = {spec.slug: spec for spec in registry.values()}
    if entry in by_slug:
        return by_slug[entry]
    if entry in registry:
        if accept_names:
            return registry[entry]
        raise UnknownEncoder(where, entry, f"a registry name; list its slug {registry[entry].slug!r} instead "
                                           "(the slug names the DVC output folder data/features/<slug>)")
    close = difflib.get_close_matches(entry, sorted(by_slug), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownEncoder(where, entry, f"not a slug in {source}{hint} (known: {', '.join(sorted(by_slug))})")


def selected_encoders(registry_path: Path | str, slugs: list[str]) -> list[EncoderSpec]:
    """The registry rows of ``extract.encoders`` (slugs), in the listed order: what every stage evaluates."""
    registry = load_registry(registry_path)
    return [resolve_encoder(registry, slug, source=registry_path) for slug in slugs]


def parse_rows(rows: list, source: str = "encoder registry") -> dict[str, EncoderSpec]:
    """Validate registry rows (dicts); names and slugs must be unique. Errors name ``source``."""
    registry: dict[str, EncoderSpec] = {}
    slugs: dict[str, str] = {}
    for position, row in enumerate(rows):
        label = f"encoder {row.get('name')!r}" if isinstance(row, dict) and row.get("name") else f"row {position}"
        if not isinstance(row, dict):
            raise RegistryError(f"{source}: {label}: a row must be a mapping of keys to values")
        try:
            spec = EncoderSpec.model_validate(row)
        except ValidationError as exc:
            raise RegistryError(f"{source}: {label}: {_describe(exc)}") from None
        if spec.name in registry or spec.slug in slugs:
            other = spec.name if spec.name in registry else slugs[spec.slug]
            raise RegistryError(f"{source}: {label}: duplicates {other!r} (names and their slugs must be unique)")
        registry[spec.name] = spec
        slugs[spec.slug] = spec.name
    for name, spec in registry.items():
        if spec.lora is not None and (spec.lora.base is not None or spec.lora.base_row is not None):
            registry[name] = _with_lora_base(spec, registry, source)
    return registry


def _with_lora_base(spec: EncoderSpec, registry: dict[str, EncoderSpec], source: str) -> EncoderSpec:
    """``spec`` with its ``lora.base`` row attached: a timm row of the same architecture, itself no LoRA."""
    label = f"{source}: encoder {spec.name!r}: key 'lora.base'"
    if spec.lora.base_row is not None:
        raise RegistryError(f"{label}: lora.base_row is filled in from lora.base, not written in the file")
    base = registry.get(spec.lora.base)
    if base is None:
        raise RegistryError(f"{label}: {spec.lora.base!r} is not a registry name")
    if base.loader != "timm" or base.timm_model != spec.timm_model or base.lora is not None:
        raise RegistryError(f"{label}: {base.name!r} must be a timm row of the same timm_model ({spec.timm_model}) "
                            "without a lora of its own")
    return spec.model_copy(update={"lora": spec.lora.model_copy(update={"base_row": base})})


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"])
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        parts.append(f"key {key!r}: {message}" if key else message)
    return "; ".join(parts)
