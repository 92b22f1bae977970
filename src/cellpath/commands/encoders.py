"""``cellpath encoders list`` and ``cellpath encoders check NAME [--weights PATH]`` (no DVC stage).

``list`` prints every registry row with its loader, input, grid and where its weights are;
``check`` builds one row's encoder, loads its weights strictly and runs one synthetic tile
(:mod:`cellpath.features.encoders.check`), failing with every problem it found.
"""

from __future__ import annotations

from pathlib import Path

from cellpath.config import Params
from cellpath.errors import EncoderLoadError
from cellpath.features.encoders.check import check_encoder, weights_status
from cellpath.features.encoders.registry import load_registry, resolve_encoder


def run_list(params: Params) -> str:
    """One line per registry row: slug, name, loader, input px / grid, prefix tokens, width, weights."""
    cfg = params.extract
    lines = [f"{'slug':<22}{'name':<26}{'loader':<22}{'input/grid':>11}{'prefix':>7}{'width':>6}  weights"]
    for spec in load_registry(cfg.registry).values():
        grid = f"{spec.input_size}/{spec.grid_size}"
        lines.append(f"{spec.slug:<22}{spec.name:<26}{spec.loader:<22}{grid:>11}{spec.num_prefix_tokens:>7}"
                     f"{spec.embed_dim:>6}  {weights_status(spec, weights_dir=Path(cfg.weights_dir))}")
    return "\n".join(lines)


def run_check(params: Params, name: str, weights: Path | None = None) -> str:
    """The check's report; raises EncoderLoadError (exit 2) with the report when a check fails."""
    cfg = params.extract
    spec = resolve_encoder(load_registry(cfg.registry), name, where="encoders check", source=cfg.registry,
                           accept_names=True)
    check = check_encoder(spec, weights_dir=Path(cfg.weights_dir), weights_path=weights, device=cfg.device)
    if check.problems:
        raise EncoderLoadError(f"{spec.name} failed its check:\n{check.render()}")
    return check.render()
