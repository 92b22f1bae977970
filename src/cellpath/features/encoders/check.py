"""Whether a registry row and its weights make a working encoder: ``cellpath encoders check``.

Builds the row's encoder, loads its weights strictly, runs one synthetic tile and checks what the
readouts rely on: the token grid's side and width, the prefix tokens stripped, finite tokens, and
orientation — a bright dot painted at a known token's pixels must change that token more than any
other (a transposed or flipped grid would put the Nuc readout of every cell on the wrong token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cellpath.errors import CellPathError
from cellpath.features.encoders.loading import load_encoder
from cellpath.features.encoders.registry import EncoderSpec
from cellpath.features.encoders.weights import CHECKPOINT_FILENAMES, find_weights, needs_weights_file

BACKGROUND_RGB = (226, 196, 216)  # an eosin-pink field
DOT_RGB = (40, 20, 90)  # a haematoxylin-dark dot


@dataclass
class EncoderCheck:
    """What ``check_encoder`` found; ``problems`` is empty when everything holds; ``warnings`` (a hub
    config that disagrees with the row, both values printed) do not fail the check."""

    spec: EncoderSpec
    weights: str
    revision: str
    grid: tuple[int, ...]
    width: int
    cls: bool
    dot_token: tuple[int, int]
    dot_found: tuple[int, int] | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def render(self) -> str:
        spec = self.spec
        lines = [f"{spec.name} ({spec.slug}): loader {spec.loader}",
                 f"  weights        {self.weights}",
                 f"  revision       {self.revision}",
                 f"  input          {spec.input_size} px, mean {list(spec.mean)}, std {list(spec.std)}",
                 f"  token grid     {' x '.join(map(str, self.grid))} (patch {spec.patch_size} px), width {self.width}",
                 f"  prefix tokens  {spec.num_prefix_tokens} stripped; CLS {'yes' if self.cls else 'no'}",
                 f"  bright dot     at token {self.dot_token}: strongest change at {self.dot_found}"]
        lines += [f"  WARNING        {warning}" for warning in self.warnings]
        lines += [f"  PROBLEM        {problem}" for problem in self.problems] or ["  ok"]
        return "\n".join(lines)


def _tile(spec: EncoderSpec, dot: tuple[int, int] | None) -> np.ndarray:
    tile = np.empty((1, spec.input_size, spec.input_size, 3), dtype=np.uint8)
    tile[:] = BACKGROUND_RGB
    if dot is not None:
        p, (r, c) = spec.patch_size, dot
        half = max(1, p // 6)
        centre_r, centre_c = r * p + p // 2, c * p + p // 2
        tile[0, centre_r - half:centre_r + half + 1, centre_c - half:centre_c + half + 1] = DOT_RGB
    return tile


def check_encoder(spec: EncoderSpec, *, weights_dir: Path = Path("models"), weights_path: Path | None = None,
                  device: str = "cpu") -> EncoderCheck:
    """Load ``spec`` (raising what ``load_encoder`` raises) and check one synthetic tile."""
    encoder = load_encoder(spec, weights_dir=weights_dir, weights_path=weights_path, device=device)
    side = spec.grid_size
    dot = (side // 3, (2 * side) // 3)  # off-centre and off-diagonal: a transposed grid puts it elsewhere
    cls, before = encoder.forward_tokens(_tile(spec, None))
    _, after = encoder.forward_tokens(_tile(spec, dot))
    change = (after - before).norm(dim=-1)[0]
    found = divmod(int(change.argmax()), change.shape[1]) if torch.isfinite(change).all() else None
    check = EncoderCheck(spec, encoder.weights, encoder.revision, tuple(before.shape[1:3]), int(before.shape[3]),
                         cls is not None, dot, found, warnings=list(encoder.warnings))
    if not (torch.isfinite(before).all() and torch.isfinite(after).all()):
        check.problems.append("the tokens of a synthetic tile are not all finite")
    if found != dot:
        check.problems.append(f"a dot painted at token {dot} changed token {found} most: the token grid is not "
                              "in image order (transposed, flipped or offset), or the model mixes tokens so much "
                              "that the Nuc readout of a cell is not the token under it")
    if cls is not None and not spec.has_cls:
        check.problems.append("the encoder returned a CLS token although the row says has_cls: false")
    return check


def weights_status(spec: EncoderSpec, *, weights_dir: Path = Path("models"),
                   hf_cache_dir: Path | None = None) -> str:
    """Where the row's weights are: a path, 'built in' (offline rows), 'missing', or the adapter it lacks."""
    if spec.loader.startswith("offline:"):
        return "built in (no download)"
    if spec.loader.startswith("custom:"):
        return f"no loader ({spec.loader}): needs {spec.requires}"
    if not needs_weights_file(spec):
        return f"brought by the package of {spec.loader}"
    try:
        return str(find_weights(spec, weights_dir=weights_dir, hf_cache_dir=hf_cache_dir).path)
    except CellPathError:
        names = spec.checkpoint.filename or " or ".join(CHECKPOINT_FILENAMES)
        names += " + config.json" if spec.loader == "transformers" else ""
        where = f" or {spec.hub_repo} in the HF cache" if spec.hub_repo else " (no hub_id: that folder only)"
        return f"missing ({names} in {Path(weights_dir) / spec.slug}/{where})"
