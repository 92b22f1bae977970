"""validate: check params.yaml and everything it points to before any stage removes an output
(docs/decisions/0014); its record ``data/validated.json`` is a dependency of every other stage."""

from __future__ import annotations

import json
from pathlib import Path

from cellpath.config import load_params
from cellpath.errors import ConfigError
from cellpath.io.atomic import atomic_output
from cellpath.preflight import check_project


def run(params_path: Path, data_dir: Path, record: Path | None = None) -> str:
    """Raise ConfigError listing every problem at once; else write ``record`` (when given) and return
    a one-line summary of what was validated."""
    problems = check_project(params_path, data_dir=data_dir)
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"{len(problems)} problem(s); fix them and rerun (no stage has run or removed "
                          f"anything):\n{listed}")
    params = load_params(params_path)
    if record is not None:  # every other stage depends on the record, so its content is fixed
        with atomic_output(record) as tmp:
            tmp.write_text(json.dumps({"params": str(params_path), "valid": True}) + "\n")
    return f"{params_path}: valid (source={params.source}, encoders: {', '.join(params.extract.encoders)})"
