"""Rank intervals validated by simulation: the paired construction (``cellpath.published.ranking``)
against the independent one it replaced (decision 0046 before 2026-12-07, ``independent_rank_interval``
below), on per-unit results drawn to match the paper's.

Per protocol, the truth is the paper's headline condition (Tfine, Nuc, Macro-F1, 20×, S25): the 30
published means are the true means, the published SDs the spreads across balanced units, and the
units share one effect with the correlation fitted to the published wins (IS: the median of the
cross-domain fits). Per replicate, the paper's evaluation is redrawn on its units (IS and LOOO: 11
organs; MOCV: 5 folds; IOCD: 23 held-out sections in 9 organs, averaged within organ) and seeds
(seed noise ``--seed-ratio`` times a model's own per-unit spread): the balanced means, their SDs
and the paired Wilcoxon wins a paper would print. Then each of the 30 models in turn is placed among
the other 29 as a user's model would be, run beside the default anchors (``PLACEMENT_ANCHORS``, the
other one when it is itself an anchor) on the same units with fresh seed noise and, in the
"shifted" scenario, every model of the run 1.5 pp lower than the paper's (a reproduction shift).

Recorded per scenario and protocol, for both constructions: the coverage of the true rank (1 + the
true means above), the median interval width (ranks in the interval), and how the models each
separates below itself compares with the paper's wins, and the model whose true rank is covered least
often (median |separated − wins|). Also how the
simulated wins agree with the published ones (the truth's check). Scenarios: "paper" (the fit's
correlation), "shifted", and "rho" (the truth's correlation away from the one the method uses:
IS, which cannot fit it, and the cross-domain protocols, which refit it from the simulated wins).

Writes benchmarks/results/placement.json.
Usage: python benchmarks/bench_placement.py [--replicates R] [--seed-ratio F] [--out PATH]
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from cellpath.features.encoders.registry import load_registry
from cellpath.probing.stats import hierarchical_bootstrap
from cellpath.published import load_published
from cellpath.published.ranking import fit_unit_correlation, paired_rank_interval
from cellpath.published.reference import published_condition, unit_correlations
from cellpath.vocabulary import (HEADLINE_MAGNIFICATION, PAPER_BALANCED_UNITS, PAPER_SEEDS, PAPER_WILCOXON_UNITS,
                                 PLACEMENT_ANCHORS, PROTOCOLS)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "data" / "manifests" / "xenium_datasets.csv"
BOOTSTRAP = 1000  # replicates of the placed model's mean in the old construction
SHIFT_PP = -1.5  # the "shifted" scenario's reproduction shift, common to the run's models
LEVEL = 0.95


def independent_rank_interval(means: np.ndarray, sds: np.ndarray, replicates: np.ndarray, n_units: int,
                              rng: np.random.Generator) -> tuple[int, int, int]:
    """The old construction: every published mean drawn independently from Normal(mean, SD/√n) and
    paired with one bootstrap replicate of the placed model's mean; the equal-tailed 95 % range of
    1 + the means above. Returns (low, high, separated below: models above it in < 2.5 % of draws)."""
    draws = means + sds / np.sqrt(n_units) * rng.standard_normal((len(replicates), len(means)))
    above = draws > replicates[:, None]
    ranks = 1 + above.sum(axis=1)
    share = above.mean(axis=0)
    return (int(np.quantile(ranks, 0.025, method="lower")), int(np.quantile(ranks, 0.975, method="higher")),
            int((share < 0.025).sum()))


def anchor_names() -> list[str]:
    """The default anchors by the paper's model names (registry rows of ``PLACEMENT_ANCHORS``)."""
    registry = load_registry(ROOT / "models" / "encoders.yaml")
    by_slug = {spec.slug: spec.name for spec in registry.values()}
    return [by_slug[slug] for slug in PLACEMENT_ANCHORS]


def iocd_organs() -> list[int]:
    """Sections per organ of the paper's IOCD: the S25 organs with two or more sections (manifest)."""
    with MANIFEST.open(encoding="utf-8") as handle:
        counts = Counter(row["organ"] for row in csv.DictReader(handle) if row["panel_s25"] == "1")
    return sorted((c for c in counts.values() if c >= 2), reverse=True)


class Design:
    """One protocol's units: ``groups[i]`` the balanced unit of test unit i; seeds per unit."""

    def __init__(self, protocol: str):
        if protocol == "iocd":
            self.groups = np.repeat(np.arange(len(iocd_organs())), iocd_organs())
        else:
            self.groups = np.arange(PAPER_BALANCED_UNITS[protocol])
        self.n_balanced = int(self.groups.max()) + 1
        self.seeds = PAPER_SEEDS[protocol]
        # a test unit's spread such that balanced-unit scores have the published SD
        self.unit_scale = 1.0 / np.sqrt(np.mean(1.0 / np.bincount(self.groups)))

    def draw_units(self, mu: np.ndarray, sd: np.ndarray, rho: float, rng: np.random.Generator) -> np.ndarray:
        """Per-unit true scores, models × test units (the one-factor model)."""
        n = len(self.groups)
        shared = rng.standard_normal(n)
        own = rng.standard_normal((len(mu), n))
        return mu[:, None] + (sd * self.unit_scale)[:, None] * (np.sqrt(rho) * shared + np.sqrt(1 - rho) * own)

    def with_seeds(self, units: np.ndarray, seed_sd: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """models × test units × seeds."""
        return units[:, :, None] + seed_sd[:, None, None] * rng.standard_normal((*units.shape, self.seeds))

    def balanced(self, values: np.ndarray) -> np.ndarray:
        """models × balanced units: seeds averaged, test units averaged within their balanced unit."""
        per_unit = values.mean(axis=2)
        return np.stack([per_unit[:, self.groups == g].mean(axis=1) for g in range(self.n_balanced)], axis=1)

    def bootstrap_frame(self, values: np.ndarray) -> pd.DataFrame:
        """One model's test units × seeds as :func:`hierarchical_bootstrap`'s input."""
        units, seeds = np.meshgrid(np.arange(values.shape[0]), np.arange(values.shape[1]), indexing="ij")
        return pd.DataFrame({"balanced_unit": self.groups[units.ravel()], "unit": units.ravel(),
                             "value": values.ravel()})


def wins(values: np.ndarray) -> np.ndarray:
    """Per model, the others it beats: two-sided paired Wilcoxon over every (test unit, seed) pair,
    p < 0.05 and the median difference in its favour (the paper's rule)."""
    flat = values.reshape(values.shape[0], -1)
    j, k = np.triu_indices(len(flat), 1)
    differences = flat[j] - flat[k]
    p = stats.wilcoxon(differences, axis=-1).pvalue
    median = np.median(differences, axis=1)
    won = np.zeros(len(flat), int)
    np.add.at(won, j, (p < 0.05) & (median > 0))
    np.add.at(won, k, (p < 0.05) & (median < 0))
    return won


def simulate(protocol: str, paper: pd.DataFrame, rho_true: float, rho_method: float | None, replicates: int,
             seed_ratio: float, shift: float, rng: np.random.Generator) -> dict:
    """One scenario for one protocol. ``rho_method``: the correlation the paired method assumes
    (None: refit from each replicate's simulated wins, as for a cross-domain protocol)."""
    design = Design(protocol)
    names = paper["model"].to_numpy(str)
    mu, sd = paper["mean"].to_numpy(float), paper["sd"].to_numpy(float)
    seed_sd = seed_ratio * sd * design.unit_scale * np.sqrt(1 - rho_true)
    true_rank = 1 + (mu[None, :] > mu[:, None]).sum(axis=1)
    pairs = len(design.groups) * design.seeds
    anchor_list = anchor_names()
    rows, simulated_wins, fitted = [], [], []
    for _ in range(replicates):
        units = design.draw_units(mu, sd, rho_true, rng)
        paper_values = design.with_seeds(units, seed_sd, rng)
        balanced = design.balanced(paper_values)
        means, sds = balanced.mean(axis=1), balanced.std(axis=1, ddof=1)
        won = wins(paper_values)
        simulated_wins.append(won)
        rho = rho_method if rho_method is not None else fit_unit_correlation(means, sds, won, pairs, "sim").rho
        fitted.append(rho)
        run_values = design.with_seeds(units, seed_sd, rng) + shift
        run_balanced = design.balanced(run_values)
        for j in range(len(names)):
            others = np.arange(len(names)) != j
            table = pd.DataFrame({"model": names[others], "mean": means[others], "sd": sds[others]})
            anchors = {a: run_balanced[list(names).index(a)] for a in anchor_list if a != names[j]}
            new = paired_rank_interval(table, run_balanced[j], anchors, rho, rng, LEVEL)
            boot = hierarchical_bootstrap(design.bootstrap_frame(run_values[j]), BOOTSTRAP, rng)
            low, high, separated = independent_rank_interval(means[others], sds[others], boot, design.n_balanced, rng)
            rows.append({"model": names[j], "true": int(true_rank[j]), "wins": int(won[j]),
                         "new_low": new.low, "new_high": new.high, "new_separated": new.beats,
                         "old_low": low, "old_high": high, "old_separated": separated})
    frame = pd.DataFrame(rows)
    out = {"replicates": replicates, "intervals": len(frame), "rho_true": rho_true,
           "rho_method": rho_method if rho_method is not None else {"median_fitted": float(np.median(fitted)),
                                                                   "range": [float(min(fitted)), float(max(fitted))]}}
    for side in ("new", "old"):
        covered = (frame[f"{side}_low"] <= frame["true"]) & (frame["true"] <= frame[f"{side}_high"])
        width = frame[f"{side}_high"] - frame[f"{side}_low"] + 1
        per_model = covered.groupby(frame["model"]).mean()
        out[side] = {"coverage": round(float(covered.mean()), 4), "median_width": float(width.median()),
                     "lowest_model_coverage": {"model": str(per_model.idxmin()),
                                               "coverage": round(float(per_model.min()), 4)},
                     "width_quartiles": [float(width.quantile(0.25)), float(width.quantile(0.75))],
                     "median_abs_separated_minus_wins": float((frame[f"{side}_separated"] - frame["wins"]).abs()
                                                              .median()),
                     "median_separated": float(frame[f"{side}_separated"].median())}
    out["median_simulated_wins"] = float(np.median(np.concatenate(simulated_wins)))
    return out | {"simulated_mean_wins": np.mean(simulated_wins, axis=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicates", type=int, default=40)
    parser.add_argument("--seed-ratio", type=float, default=0.3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "placement.json"))
    args = parser.parse_args()
    from provenance import run_stamp, with_provenance  # benchmarks/, on sys.path when this runs as a script

    stamp = run_stamp()
    started = time.perf_counter()
    published = load_published()
    correlations = unit_correlations(published, magnification=HEADLINE_MAGNIFICATION)
    result: dict = {"level": LEVEL, "seed_ratio": args.seed_ratio, "anchors": anchor_names(),
                    "correlations": {p: {"rho": c.rho, "source": c.source, "wins_rmse": c.wins_rmse}
                                     for p, c in correlations.items()}, "scenarios": {}}
    scenarios = [("paper", 0.0, 0.0), ("shifted", SHIFT_PP, 0.0), ("rho -0.10", 0.0, -0.10), ("rho +0.03", 0.0, 0.03)]
    for label, shift, rho_offset in scenarios:
        result["scenarios"][label] = {}
        for offset, protocol in enumerate(PROTOCOLS):
            paper = published_condition(published, protocol=protocol, magnification=HEADLINE_MAGNIFICATION,
                                        readout="Nuc", taxonomy="fine")
            rho = correlations[protocol].rho
            rng = np.random.default_rng([20261207, offset, len(result["scenarios"])])
            found = simulate(protocol, paper, min(rho + rho_offset, 0.99), rho if protocol == "is" else None,
                             args.replicates, args.seed_ratio, shift, rng)
            mean_wins = found.pop("simulated_mean_wins")
            if protocol != "is":
                found["simulated_vs_published_wins_rmse"] = float(np.sqrt(np.mean((mean_wins - paper["wins"]) ** 2)))
            result["scenarios"][label][protocol] = found
            print(label, protocol, json.dumps({k: found[k] for k in ("new", "old")}), flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result = with_provenance(result, stamp)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

if __name__ == "__main__":
    main()
