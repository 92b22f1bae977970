"""The run plan: how many probe runs a configuration implies (Table 3 of the paper).

One run is a (model, magnification, readout, taxonomy, protocol, unit, seed). Runs whose readout
needs a CLS token the model lacks are structurally unavailable: counted, not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from cellpath.protocols import protocol_units
from cellpath.vocabulary import CLS_READOUTS, PROTOCOLS, READOUTS



@dataclass(frozen=True)
class PlanCounts:
    """Runs per protocol, and how many of them are unavailable (no CLS token)."""

    runs: dict[str, int]
    unavailable: dict[str, int]
    units: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.runs.values())

    @property
    def total_unavailable(self) -> int:
        return sum(self.unavailable.values())


def count_runs(sections: pd.DataFrame, *, models_with_cls: list[bool], n_magnifications: int, n_taxonomies: int,
               readouts: tuple[str, ...] = READOUTS, seeds: dict[str, int], protocols: tuple[str, ...] = PROTOCOLS,
               n_folds: int = 5) -> PlanCounts:
    """Count runs for a section list (section_id, organ), one bool per model (has a CLS token)."""
    runs, unavailable, units = {}, {}, {}
    n_cls = sum(1 for r in readouts if r in CLS_READOUTS)
    for protocol in protocols:
        n_units = len(protocol_units(sections, protocol, n_folds))
        per_model_readout = n_magnifications * n_taxonomies * n_units * seeds[protocol]
        units[protocol] = n_units
        runs[protocol] = len(models_with_cls) * len(readouts) * per_model_readout
        unavailable[protocol] = sum(1 for has_cls in models_with_cls if not has_cls) * n_cls * per_model_readout
    return PlanCounts(runs, unavailable, units)
