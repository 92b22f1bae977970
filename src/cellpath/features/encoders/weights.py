"""Where an encoder's weights are: the checkpoint a registry row reads, found on disk without
building the model (``<weights_dir>/<slug>/`` or a snapshot already in the Hugging Face cache;
nothing is downloaded), and the revision it resolves to. No torch or timm here, so that
``cellpath validate`` checks every row's weights in well under a second."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache

from cellpath.errors import EncoderUnavailable
from cellpath.features.encoders.registry import EncoderSpec

CHECKPOINT_FILENAMES = ("model.safetensors", "pytorch_model.bin")
CONFIG_FILENAME = "config.json"  # a transformers checkpoint's config, beside its weights (save_pretrained)
FILE_LOADERS = ("timm", "transformers", "open_clip", "beit3")


@dataclass(frozen=True)
class WeightsFile:
    """A checkpoint found on disk and the revision it resolves to."""

    path: Path
    revision: str  # HF snapshot commit hash, or "sha256:<hex>" of a local file
    origin: Literal["local", "hf-cache"]


def portable_path(path: Path, hf_cache_dir: Path | None = None) -> str:
    """Where a checkpoint is, as a sidecar records it without the machine's layout: relative to the project
    (the working directory) when inside it, ``<hf cache>/…`` inside the Hugging Face cache, ``~/…`` in the
    home folder, else absolute (a shared folder the user named)."""
    path = Path(path).absolute()
    cache = Path(hf_cache_dir) if hf_cache_dir is not None else Path(hf_constants.HF_HUB_CACHE)
    for base, label in ((Path.cwd(), ""), (cache.absolute(), "<hf cache>/"), (Path.home(), "~/")):
        if path.is_relative_to(base):
            return label + path.relative_to(base).as_posix()
    return path.as_posix()


def needs_weights_file(spec: EncoderSpec) -> bool:
    """Whether loading the row reads a checkpoint file cellpath looks for: the file loaders, and an
    entry-point row with a hub_id (one without brings its own weights)."""
    return spec.loader in FILE_LOADERS or (spec.loader.startswith("entry-point:") and spec.hub_id is not None)


def locate_weights(spec: EncoderSpec, weights_path: Path | None, weights_dir: Path,
                   hf_cache_dir: Path | None) -> WeightsFile:
    """The checkpoint the user named (``weights_path``), else the one found in the usual places."""
    if weights_path is not None:
        return given_weights(spec, weights_path)
    return find_weights(spec, weights_dir=weights_dir, hf_cache_dir=hf_cache_dir)


def given_weights(spec: EncoderSpec, path: Path) -> WeightsFile:
    """A checkpoint the user names: the file itself, or the row's checkpoint file inside a folder
    (with its ``config.json`` beside it for a transformers row)."""
    path = Path(path)
    if path.is_dir():
        filenames = (spec.checkpoint.filename,) if spec.checkpoint.filename else CHECKPOINT_FILENAMES
        inside = [path / Path(name).name for name in filenames if (path / Path(name).name).is_file()]
        if not inside:
            raise EncoderUnavailable(f"{spec.name}: {path}/ holds none of {', '.join(filenames)}")
        path = inside[0]
    if not path.is_file():
        raise EncoderUnavailable(f"{spec.name}: no checkpoint at {path}")
    if spec.loader == "transformers" and not (path.parent / CONFIG_FILENAME).is_file():
        raise EncoderUnavailable(f"{spec.name}: a transformers checkpoint needs its {CONFIG_FILENAME} beside it "
                                 f"in {path.parent}/ (save_pretrained writes both)")
    return WeightsFile(path, "sha256:" + _sha256(path), "local")


def find_weights(spec: EncoderSpec, *, weights_dir: Path = Path("models"),
                 hf_cache_dir: Path | None = None) -> WeightsFile:
    """The first checkpoint found: ``<weights_dir>/<slug>/`` then, for a row with a ``hub_id``, the HF
    cache snapshot of it at ``spec.revision`` (for a transformers row, a weights file with a
    ``config.json`` beside it); a row without one (a private model) is read from the folder only.
    Raises one EncoderUnavailable naming every place looked in."""
    local_dir = Path(weights_dir) / spec.slug
    needs_config = spec.loader == "transformers"
    filenames = (spec.checkpoint.filename,) if spec.checkpoint.filename else CHECKPOINT_FILENAMES
    for filename in filenames:
        path = local_dir / Path(filename).name
        if path.is_file() and (not needs_config or (local_dir / CONFIG_FILENAME).is_file()):
            return WeightsFile(path, "sha256:" + _sha256(path), "local")
    names = " or ".join(filenames) + (f", with its {CONFIG_FILENAME}," if needs_config else "")
    architecture = f"transformers {spec.transformers_class} checkpoint (save_pretrained)" if needs_config \
        else (f"open_clip {spec.open_clip_model} vision-tower" if spec.open_clip_model else f"timm {spec.timm_model}") \
        + " state dict"
    copy = f"copy a {architecture} into {local_dir}/ as {' or '.join(Path(name).name for name in filenames)}."
    if spec.hub_repo is None:
        raise EncoderUnavailable(f"{spec.name}: no weights found. Looked for {names} in {local_dir}/ (the row has no "
                                 f"hub_id, so nowhere else); {copy}")
    cache_dir = Path(hf_cache_dir) if hf_cache_dir is not None else Path(hf_constants.HF_HUB_CACHE)
    for filename in filenames:
        cached = try_to_load_from_cache(spec.hub_repo, filename, cache_dir=cache_dir, revision=spec.revision,
                                        repo_type=spec.checkpoint.repo_type)
        if isinstance(cached, str) and (not needs_config or (Path(cached).parent / CONFIG_FILENAME).is_file()):
            return WeightsFile(Path(cached), _snapshot_commit(Path(cached)), "hf-cache")
    download_args = "".join([f" {spec.checkpoint.filename}" if spec.checkpoint.filename else "",
                             " --repo-type dataset" if spec.checkpoint.repo_type == "dataset" else ""])
    raise EncoderUnavailable(
        f"{spec.name}: no weights found. Looked for {names} in {local_dir}/ and for "
        f"{spec.hub_repo}@{spec.revision} in the Hugging Face cache {cache_dir}. Provide them with "
        f"`hf download {spec.hub_repo}{download_args} --revision {spec.revision}` (older huggingface_hub: "
        f"`huggingface-cli download`) on a machine with hub access, gated repos after accepting their "
        f"licence with HF_TOKEN set, pointing HF_HUB_CACHE at that cache; or {copy}"
    )


def _snapshot_commit(path: Path) -> str:
    """The commit of the HF cache snapshot a file lies in (``…/snapshots/<commit>/[sub/folders/]file``)."""
    parts = path.parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else path.parent.name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
