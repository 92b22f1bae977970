"""validate: check params.yaml and everything it points to before any stage removes an output
(docs/decisions/0014); its record ``data/validated.json`` is a dependency of every other stage.

For ``source: 10x``, and for the paper's panel (``--preset paper``, or ``--preset placement``: that
panel at the headline condition; ``--models``: for these encoders), it shows the panel's readiness:
per section what is in place and the one action each gap needs (:mod:`cellpath.readiness`)."""

from __future__ import annotations

import json
from pathlib import Path

from cellpath.errors import ConfigError
from cellpath.io.atomic import atomic_output
from cellpath.preflight import check_params, read_params
from cellpath.readiness import check_readiness, paper_panel_params, render
from cellpath.vocabulary import PAPER_PANEL_PRESETS, PLACEMENT_ANCHORS

NOTHING_REMOVED = "no stage has run or removed anything"


def run(params_path: Path, data_dir: Path, record: Path | None = None, preset: str = "current",
        models: list[str] | None = None, anchors: list[str] | None = None) -> str:
    """Raise ConfigError listing every problem at once (for a 10x panel: its readiness table); else
    write ``record`` (when given) and return what was validated. ``models`` (registry slugs): with a
    paper-panel preset, the encoders checked instead of the configuration's; ``anchors``: with the
    placement preset, the paper's models checked beside them (default: ``PLACEMENT_ANCHORS``)."""
    if preset in PAPER_PANEL_PRESETS and record is not None:
        raise ConfigError("--record is the validate stage's output, which checks params.yaml as it is; "
                          f"leave out --preset {preset} there")
    if models and preset not in PAPER_PANEL_PRESETS:
        raise ConfigError(f"--models chooses the encoders of --preset {' or '.join(PAPER_PANEL_PRESETS)}; "
                          "for params.yaml as it is, set extract.encoders")
    params, problems = read_params(params_path)
    root = Path(".")
    if params is not None and not problems and (preset in PAPER_PANEL_PRESETS or params.source == "10x"):
        paper, notes = preset in PAPER_PANEL_PRESETS, []
        if paper:
            params, notes = paper_panel_params(params, root, placement=preset == "placement", encoders=models,
                                               anchors=PLACEMENT_ANCHORS if anchors is None else tuple(anchors))
        report = check_readiness(params, root, data_dir, paper=paper, placement=preset == "placement",
                                 notes=tuple(notes))
        text = render(report)
        if not report.ready:
            raise ConfigError(f"the panel is not ready ({NOTHING_REMOVED}):\n{text}")
        _write_record(record, params_path)
        return text
    if params is not None:
        problems += check_params(params, root, Path(data_dir))
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"{len(problems)} problem(s); fix them and rerun ({NOTHING_REMOVED}):\n{listed}")
    _write_record(record, params_path)
    return f"{params_path}: valid (source={params.source}, encoders: {', '.join(params.extract.encoders)})"


def _write_record(record: Path | None, params_path: Path) -> None:
    if record is not None:  # every other stage depends on the record, so its content is fixed
        with atomic_output(record) as tmp:
            tmp.write_text(json.dumps({"params": str(params_path), "valid": True}) + "\n")
