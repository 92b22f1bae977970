"""benchmarks/README.md, generated from the measurements in benchmarks/results/*.json.

Every figure the README and docs/ quote from a benchmark lives in one of those JSON files, with the
date, the commit and the machine it was measured on; this script turns them into the one table
people read, so the table cannot drift from the numbers. A JSON file without a row builder here is
an error, not a silent omission.

Usage: python benchmarks/results_table.py            # write benchmarks/README.md
       python benchmarks/results_table.py --check    # exit 1 when benchmarks/README.md is not what the JSONs give
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"


@dataclass(frozen=True)
class Row:
    benchmark: str
    measured: str
    against: str
    headline: str
    date: str
    commit: str
    machine: str


# ------------------------------------------------------------------ formatting


def ratio(spread: dict, unit: str = "×", digits: int = 2) -> str:
    """A median with its range: ``1.07× (1.06–1.09)``."""
    return f"{spread['median']:.{digits}f}{unit} ({spread['min']:.{digits}f}–{spread['max']:.{digits}f})"


def duration(seconds: float) -> str:
    """``542`` → ``9 min 2 s``; under a minute, seconds."""
    seconds = round(seconds)
    minutes, rest = divmod(seconds, 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def thousands(value: float) -> str:
    return f"{value:,.0f}"


def machine_of(record: dict) -> str:
    machine = record["machine"]
    return machine["description"] if isinstance(machine, dict) else machine


def when(record: dict) -> dict:
    return {"date": record["date"], "commit": record["commit"], "machine": machine_of(record)}


def records(data: dict) -> list[dict]:
    """The dated records of one JSON file: its measurements, or the file itself."""
    return data["measurements"] if "measurements" in data else [data]


# --------------------------------------------------------------- row builders


def executor_rows(d: dict) -> list[Row]:
    runs = d["probe_stage"]["runs"]
    one, two, dask = runs["local-1"], runs["local-2"], runs["dask-2"]
    same = "identical run tables" if d["probe_stage"]["identical_run_tables"] else "run tables differ"
    return [Row("executor (`bench_executor.py`)",
                f"the default's probe stage, {one['tasks']} tasks, one thread per worker: local executor with 2 "
                "workers; Dask LocalCluster with 2 workers",
                f"local executor, 1 worker ({one['seconds']:.0f} s)",
                f"local 2 workers {two['speedup_vs_local_1']}× ({two['seconds']:.0f} s); Dask 2 workers "
                f"{dask['speedup_vs_local_1']}× ({dask['seconds']:.0f} s); one run each; {same}; Dask overhead "
                f"{d['dask_overhead']['overhead_ms_per_task']:.1f} ms per task",
                **when(d))]


def cellvit_read_rows(d: dict) -> list[Row]:
    summary, ratios = d["summary"], d["whole_over_streamed"]
    return [Row("CellViT++ reader (`bench_cellvit_read.py`)",
                f"`read_cellvit` streaming a cells.json of {thousands(d['nuclei'])} nuclei with "
                f"{d['contour_points']}-point contours ({d['file_bytes'] / 1e6:,.0f} MB), a fresh process each; "
                f"alternated {d['repeats']}×",
                "`json.loads` of the whole document and the same centroids and classes (the reader before it streamed)",
                f"whole ÷ streamed: time {ratio(ratios['seconds'])}, peak RSS {ratio(ratios['peak_rss'], '×', 1)}: "
                f"{summary['streamed']['seconds']['median']:.1f} s and "
                f"{summary['streamed']['peak_rss_bytes'] / 1e6:,.0f} MB against "
                f"{summary['whole']['seconds']['median']:.1f} s and {summary['whole']['peak_rss_bytes'] / 1e9:,.2f} GB",
                **when(d))]


def real_section_rows(d: dict) -> list[Row]:
    stages = d["stages"]
    def part(name: str, stage: dict) -> str:
        memory = f", {stage['peak_rss_bytes'] / 1e9:.1f} GB" if "peak_rss_bytes" in stage else ""
        failed = ("" if stage["returncode"] == 0 else f" (killed by {stage['killed_by']})" if "killed_by" in stage
                  else f" (exit {stage['returncode']})")
        return f"{name} {duration(stage['seconds'])}{memory}{failed}"

    parts = [part(name, stage) for name, stage in stages.items()]
    over = [name for name, stage in stages.items() if stage.get("peak_rss_bytes", 0) > d["budget_bytes"]
            or stage["returncode"] != 0]
    return [Row("a section of the paper's size (`bench_real_section.py`)",
                f"one simulated section of {thousands(d['cells'])} cells on a {thousands(d['genes'])}-gene panel through "
                f"the stages in order, each a child process (its own peak RSS)",
                f"the {d['budget_bytes'] / 1e9:.0f} GB machine",
                "; ".join(parts) + ("; every stage within the budget" if not over else
                                    f"; over the budget or failed: {', '.join(over)}"),
                **when(d))]


def section_stages_rows(d: dict) -> list[Row]:
    real = d["real_section"]
    sizes = ", ".join(thousands(int(n)) for n in d["runs"])
    parts = []
    for stage, check in real["stages"].items():
        if check.get("measured_seconds") is None:
            parts.append(f"{stage}: not measured at full size")
            continue
        parts.append(f"{stage} {check['seconds_ratio']:.2f}× time ({duration(check['estimated_seconds'])} for "
                     f"{duration(check['measured_seconds'])}), {check['peak_ratio']:.2f}× peak RSS")
    outside = [stage for stage, check in real["stages"].items() if check.get("within_2x") is False]
    return [Row("per-section cost lines (`bench_section_stages.py`)",
                f"lines in a section's cells fitted on simulated sections of {sizes} cells "
                f"({thousands(d['genes'])}-gene panel, a 100,000 × 30,000 reference), predicting the real-size "
                f"section ({thousands(real['cells'])} cells, `real_section.json` at {real['commit']})",
                "the real-size section's measured time and peak RSS",
                "estimate ÷ measured: " + "; ".join(parts)
                + ("; every one within 2×" if not outside else f"; outside 2×: {', '.join(outside)}"),
                **when(d))]


def dvc_storage_rows(d: dict) -> list[Row]:
    summary, store = d["summary"], d["store"]
    sides, ratios, rates = summary["sides"], summary["copy_over_links"], summary["rates"]
    page = "cold" if d["cold_page_cache"] else "warm"
    return [Row("DVC storage (`bench_dvc_storage.py`)",
                f"dvc {d['dvc']} on a synthetic feature store of {store['bytes'] / 1e9:.1f} GB ({store['files']} files, "
                f"float16): add, rehash (`dvc status` after mtimes changed), checkout, push to a folder remote; "
                f"{page} page cache; alternated {d['repeats']}×",
                "`cache.type copy` (DVC's default where there are no reflinks) against the project's "
                "`hardlink,symlink`",
                f"copy ÷ links time: add {ratio(ratios['add'])}, checkout {ratio(ratios['checkout'])}, rehash "
                f"{ratio(ratios['rehash'])}, push {ratio(ratios['push'])}; on disk (workspace + cache) "
                f"{sides['copy']['disk_over_store']:.2f}× the store with copies, "
                f"{sides['links']['disk_over_store']:.2f}× with links; hashing {rates['rehash_mb_per_s']['links']:,.0f} "
                f"MB/s, push {rates['push_mb_per_s']['links']:,.0f} MB/s",
                **when(d))]


def extract_rows(d: dict) -> list[Row]:
    return [
        Row("extraction (`bench_extract.py`)",
            f"the extract pipeline, {d['encoder']} at {d['magnification']}, one section ({d['patches']} patches), "
            f"alternated {d['repeats']}×",
            "the bare forward pass on the same patches (no reading)",
            f"bare ÷ pipeline time {ratio(d['ratio_raw_over_pipeline'], '', 3)} reading ahead, "
            f"{ratio(d['ratio_raw_over_from_store'], '', 3)} from the shared patch store; "
            f"{d['pipeline_patches_per_s']:.1f} patches/s",
            **when(d)),
        Row("patch store (`bench_extract.py`)",
            "patches one reader thread delivers from the shared patch store",
            "tiatoolbox reads from the slide",
            f"{ratio(d['ratio_store_read_rate_over_slide'], '×', 1)}: "
            f"{thousands(d['read_patches_per_s']['shared_store']['median'])} against "
            f"{thousands(d['read_patches_per_s']['slide']['median'])} patches/s",
            **when(d)),
    ]


def fetch_ingest_rows(d: dict) -> list[Row]:
    return [Row("fetch + ingest (`bench_fetch_ingest.py`)",
                f"fetch and ingest of the default panel of that date ({d['sections']} sections, 2,000 cells each)",
                f"the {d['budget_s'] / 60:.0f}-minute budget",
                f"{d['fetch_plus_ingest_s']:.1f} s (fetch {d['fetch_s']:.1f} s + ingest {d['ingest_s']:.1f} s), "
                f"{d['fetch_plus_ingest_s'] / d['budget_s']:.2f} of the budget; one run",
                **when(d))]


def probe_rows(d: dict) -> list[Row]:
    speed, agreement = d["speed"], d["agreement"]
    floor, mlflow = d["floor"], d["mlflow"]["mlflow_share"]

    def setting(name: str, label: str) -> str:
        s = speed[name]
        return (f"{label} ({s['runs']} runs, {thousands(s['training_cells']['min'])}–"
                f"{thousands(s['training_cells']['max'])} training cells) {ratio(s['speedup_vs_sklearn_loop'], digits=3)}, "
                f"the same C on {s['chosen_c_equal_share']:.0%} of runs, Macro-F1 within "
                f"{s['max_abs_macro_f1_difference_points']} pp")

    return [
        Row("probe fits (`bench_probe.py`)",
            f"the probe engine on every planned run × {len(d['probe']['c_grid'])} Cs of ViT-Ti 20× Nuc, one thread "
            "each side, alternated 3×: the paper's uncapped training sets, and the default's (capped at "
            f"{d['probe']['max_train_cells']['default']})",
            "a scikit-learn `LogisticRegression` (lbfgs) loop doing the same fits",
            f"{setting('paper_uncapped', 'uncapped')}; {setting('default', 'capped')}",
            **when(d)),
        Row("probe agreement (`bench_probe.py`)",
            f"the default's tol {d['probe']['tol']:g}: test Macro-F1 and the chosen C of {agreement['fits']} "
            "fits",
            f"scikit-learn at tol {d['reference']['tol']:g}",
            f"{agreement['fit_share_within_0.1pp']:.0%} of fits within 0.1 pp (max "
            f"{agreement['max_abs_difference_points']} pp), the same C on "
            f"{agreement['selection_share_equal']:.0%} of runs, "
            f"{agreement['fits_not_converged']} fits not converged",
            **when(d)),
        Row("probe floor (`bench_probe.py`)",
            f"the largest task's fit ({thousands(floor['training_cells'])} cells, {floor['width']} features, "
            f"{floor['classes']} classes)",
            f"its arithmetic floor ({thousands(floor['products'])} float32 matrix products, each timed at its "
            "shape here)",
            f"{floor['wall_over_floor']:.2f}× the floor",
            **when(d)),
        Row("MLflow cost (`bench_probe.py`)",
            "the probe stage with MLflow tracking, fresh work folders, alternated 3×",
            "the same stage without tracking",
            f"median share {mlflow['median']:.2%} ({mlflow['min']:+.1%} to {mlflow['max']:+.1%})",
            **when(d)),
    ]


def robustness_rows(d: dict) -> list[Row]:
    kinds = d["settings"]["kinds"]
    parts, worst = [], 0.0
    for kind in kinds:
        sizes = [r for r in d["runs"] if r["kind"] == kind and r.get("croma_run")]
        spec = kinds[kind]
        label = (f"{len(spec['type_frequencies'])} balanced types × {spec['n_sections']} sections" if kind == "balanced"
                 else f"{len(spec['type_frequencies'])} skewed types × {spec['n_sections']} sections")
        parts.append(f"{label}: " + ", ".join(f"{ratio(r['speedup_vs_croma'], '×', 1)} at {thousands(r['n'])}"
                                             for r in sorted(sizes, key=lambda r: r["n"])))
        worst = max([worst, *(r["abs_differences"]["per_sample_croma_max_abs"] for r in sizes)])
    return [Row("robustness (`bench_robustness.py`)",
                f"CRoMa + RI + MaRI at d = {d['settings']['d']} on two kinds of data, ours and croma "
                f"{d['machine']['croma']} in one process under the same BLAS, alternated {d['settings']['repeats']}×",
                "croma's public API computing the same metrics",
                "; ".join(parts) + f"; every margin within {worst:.2g} of croma's",
                **when(d))]


def placement_rows(d: dict) -> list[Row]:
    main = d["scenarios"]["paper"]
    labels = {"is": "IS", "iocd": "IOCD", "mocv": "MOCV", "looo": "LOOO"}

    def side(name: str) -> str:
        return ", ".join(f"{labels[p]} {100 * r[name]['coverage']:.1f} % / {r[name]['median_width']:g}"
                         for p, r in main.items())

    lowest = min((r["new"]["lowest_model_coverage"]["coverage"], p) for p, r in main.items())
    rho = ", ".join(f"{labels[p]} {c['rho']:g}" for p, c in d["correlations"].items())
    return [Row("placement rank intervals (`bench_placement.py`)",
                f"each of the paper's 30 models placed among the other 29 with the anchors, on per-unit results "
                f"drawn to match the published means, SDs and wins ({main['is']['replicates']} replicates per "
                f"protocol, unit correlation {rho})",
                "the independent construction it replaced (every published mean drawn alone, a bootstrap of the run)",
                f"coverage of the true rank / median width (ranks), paired: {side('new')}; independent: {side('old')}; "
                f"the least-covered model {100 * lowest[0]:.1f} % ({labels[lowest[1]]})",
                **when(d))]


def expression_rows(d: dict) -> list[Row]:
    compared = [r for r in d["runs"] if r["sklearn_run"]]
    streamed = [r for r in d["runs"] if not r["sklearn_run"]]
    parts = [f"{ratio(r['speedup_vs_sklearn'], '×', 1)} at {thousands(r['rows'])} × {r['width']}" for r in compared]
    alone = "; ".join(f"ours alone {thousands(r['ours_rows_per_second']['median'])} rows/s at {thousands(r['rows'])} "
                      f"× {r['width']} (streamed, peak {r['ours_peak_mib']:,.0f} MiB)" for r in streamed)
    worst = d["summary"]["coefficients_max_relative_difference"]
    return [Row("expression ridge (`bench_expression.py`)",
                f"standardise, fit {len(d['settings']['penalties'])} penalties, choose one per gene on validation and "
                f"predict, {d['settings']['genes']} targets, real-shaped rows; alternated {d['settings']['repeats']}×",
                "scikit-learn's StandardScaler + Ridge(solver='cholesky') per penalty on the held float64 matrix",
                "; ".join(parts) + (f"; {alone}" if alone else "")
                + f"; chosen penalties equal: {'yes' if d['summary']['chosen_penalties_equal_everywhere'] else 'NO'}"
                + (f", coefficients within {worst:.1g} (relative)" if worst is not None else ""),
                **when(d))]


def registration_rows(d: dict) -> list[Row]:
    s = d["summary"]
    sizes = [r["n_cells"] for r in d["sections"]]
    return [Row("registration from the nuclei (`bench_registration.py`)",
                f"{s['sections']} simulated sections of {thousands(min(sizes))}–{thousands(max(sizes))} cells in any "
                "pose (rotation, mirror, own mpp, 1–5 mm shift), 20 % of nuclei missed on each side, 5 % false, "
                "a fold; a fifth showing a third of the section, four with the mpp 5–8 % off; error of the "
                "recovered matrix at the tissue's nuclei against the truth",
                "the QC's displacement mode + trimmed affine from the identity pose (what ingest had)",
                f"{s['within_1um_median_3um_max']} of {s['sections']} within 1 µm median and 3 µm max "
                f"(baseline {s['baseline_within_1um_median_3um_max']}), {s['refused']} refused; worst median "
                f"{s['worst_median_error_um']:.3f} µm, worst max {s['worst_max_error_um']:.3f} µm; "
                f"{duration(s['largest_seconds'])} at {thousands(max(sizes))} cells, at most "
                f"{duration(s['max_seconds'])} (a wrong mpp: the scale search); process peak at most "
                f"{s['max_process_peak_mib']:,.0f} MiB", **when(d))]


def scale_rows(d: dict) -> list[Row]:
    first = d["sizes"][0]
    wall, heap = first["ratio_streamed_over_in_memory"]["wall"], first["ratio_streamed_over_in_memory"]["peak_anon_rss"]
    low, high = d["estimates"]["ratio_range"]
    within = "all within 2×" if d["estimates"]["within_2x"] else "not all within 2×"
    return [
        Row("streamed probe (`bench_scale.py`)",
            f"the probe stage at {thousands(first['n_cells'])} cells, D = {d['width']:,}, streamed "
            f"({d['budget_mb']} MB budget), 3 alternations",
            f"in-memory fits ({d['baseline_budget_mb'] // 1024} GB budget)",
            f"wall {ratio(wall, digits=3)}, heap {ratio(heap, digits=3)}",
            **when(d)),
        Row("cost model (`bench_scale.py`)",
            "the estimates of `cellpath plan`'s cost model "
            f"({len(d['estimates']['rows'])} runs: probe 0.1M–7M cells, robustness 25k–1M)",
            "the measured wall time and heap of each run",
            f"estimate ÷ measured {low:.2f}–{high:.2f}, {within}",
            **when(d)),
    ]


def scale_agreement_rows(d: dict) -> list[Row]:
    return [Row("probe agreement at scale (`bench_scale_agreement.py`)",
                f"the engine on bench_scale's {thousands(d['n_cells'])}-cell panel (D = {d['width']:,}): {d['runs']} "
                f"uncapped LOOO runs, Tfine, Nuc, C grid {', '.join(map(str, d['probe']['c_grid']))}, tol {d['probe']['tol']:g}",
                f"scikit-learn lbfgs per C at tol {d['reference']['tol']:g}, the same selection and test cells",
                f"same C on {d['same_c']}/{d['runs']} runs, test Macro-F1 within {d['max_difference_points']:.4f} pp",
                **when(d))]


def companions_rows(d: dict) -> list[Row]:
    ways = {"alone": "task by task", "one_protocol": "protocol by protocol"}
    parts = []
    for way, total in d["total"].items():
        name = ways.get(way, way.replace("budget_", "a budget of ").replace("_mb", " MB"))
        parts.append(f"{name}: same C on {total['same_c']}/{total['runs']} runs, Macro-F1 bitwise equal on "
                     f"{total['macro_f1_bitwise_equal']} (at most {total['max_macro_f1_difference_points']:.2f} pp "
                     f"apart), iterations equal on {total['iterations_equal']}")
    return [Row("probe results and their company (`bench_companions.py`)",
                f"{len(d['conditions'])} conditions of the default (every model, readout and taxonomy at "
                f"{d['conditions'][0]['magnification']}), C grid {', '.join(map(str, d['probe']['c_grid']))}, "
                f"tol {d['probe']['tol']:g}, {d['torch_threads']} torch thread",
                "the same runs fitted as the probe stage groups them", "; ".join(parts), **when(d))]


def real_shaped_rows(d: dict) -> list[Row]:
    """One row per training size: the problems measured there (spectra × priors)."""
    rows = []
    for n in sorted({p["n_train"] for p in d["problems"]}):
        problems = [p for p in d["problems"] if p["n_train"] == n]
        first = problems[0]
        iterations = sorted(max(p["engine"]["iterations"]) for p in problems)
        parts = [f"slowest-C iterations {iterations[0]}–{iterations[-1]}"]
        before = [max(p["engine_rank_64"]["iterations"]) for p in problems if "engine_rank_64" in p]
        if before:
            parts[0] += f" ({min(before)}–{max(before)} with 64 eigenpairs)"
        parts.append(f"{sum(sum(p['engine']['converged']) for p in problems)}/"
                     f"{sum(len(p['engine']['converged']) for p in problems)} fits converged (float64 check)")
        compared = [p for p in problems if "speedup" in p]
        if compared:
            speedups = [p["speedup"]["median"] for p in compared]
            parts.append(f"scikit-learn ÷ engine {min(speedups):.1f}–{max(speedups):.1f}× (median per problem), "
                         f"the same C on {sum(p['same_c'] for p in compared)}/{len(compared)}, test Macro-F1 within "
                         f"{max(p['macro_f1_difference_points'] for p in compared):.3f} pp")
        streamed = [p for p in problems if "streamed_over_held" in p]
        if streamed:
            parts.append("streamed ÷ held " + ", ".join(ratio(p["streamed_over_held"]) for p in streamed)
                         + " (the same fits to the bit)")
        alphas = sorted({p["alpha"] for p in problems})
        rows.append(Row("probe on real-shaped problems (`bench_real_shaped.py`)",
                        f"{len(problems)} problem(s) of {thousands(n)} training cells, D = 1,280 float16, 9 "
                        f"imbalanced classes, spectra α = {', '.join(f'{a:g}' for a in alphas)}; C grid "
                        f"{', '.join(map(str, d['c_grid']))}, tol {d['tol']:g}, one thread, {first['rounds']} round(s)",
                        "scikit-learn lbfgs per C (one BLAS thread), the same selection and test cells",
                        "; ".join(parts), date=first["date"], commit=first["commit"], machine=machine_of(d)))
    return rows


def slide_read_rows(d: dict) -> list[Row]:
    slide = d["slide"]
    low, high = d["ratio_spread"]
    return [Row("slide reads (`bench_slide_read.py`)",
                f"{d['patches']} patches of {d['patch_px']} px at {d['target_mpp']} µm/px from a 10x-size slide "
                f"({slide['side_px']:,} px a side, {slide['file_bytes'] / 1e6:.0f} MB): {d['pipeline']}, "
                f"alternated {len(d['rounds'])}×",
                f"{d['baseline']}",
                f"baseline ÷ pipeline time {d['median_ratio_baseline_over_pipeline']:.2f} ({low:.2f}–{high:.2f}): "
                f"{d['pipeline_patches_per_s']:.0f} against {d['baseline_patches_per_s']:.0f} patches/s",
                **when(d))]


def pipeline_rows(d: dict) -> list[Row]:
    rows = []
    for m in d["measurements"]:
        kind = m["id"]
        if kind in ("make-run", "dvc-repro", "dvc-repro-force"):
            command = {"make-run": "make run", "dvc-repro": "dvc repro", "dvc-repro-force": "dvc repro -f"}[kind]
            repro = m.get("dvc_repro_seconds", m["seconds"])
            headline = duration(m["seconds"])
            if "dvc_repro_seconds" in m:
                headline += f", of which the install {duration(m['install_seconds'])} and `dvc repro` {duration(repro)}"
            headline += f" ({repro / m['budget_seconds']:.2f} of the budget)"
            rows.append(Row(f"pipeline: `{command}`", m["what"], "the 10-minute budget for the default's `dvc repro`",
                            headline, **when(m)))
        elif kind == "probe-stage":
            rows.append(Row("pipeline: probe stage", m["what"], "—",
                            f"{duration(m['seconds'])} ({duration(m['fit_seconds'])} fitting): {m['runs_fitted']} "
                            f"runs fitted, {m['runs_unavailable']} unavailable, {m['mlflow_runs']} MLflow runs",
                            **when(m)))
        elif kind == "dask-dvc-repro":
            same = "every output equal" if m["identical_to_local"] else "outputs differ"
            rows.append(Row("pipeline: Dask executor", m["what"], "the local executor's outputs",
                            f"{duration(m['seconds'])}, {same}; the first such run {duration(m['first_run_seconds'])}",
                            **when(m)))
        elif kind == "dask-malloc-trim":
            rows.append(Row("pipeline: Dask worker memory", m["what"], "glibc's adaptive mmap",
                            f"{m['slowdown']}× slower", **when(m)))
        elif kind in ("make-test", "make-test-fast"):
            command = "make test" if kind == "make-test" else "make test-fast"
            if "seconds_each" in m:
                each = m["seconds_each"]
                headline = (f"{duration(min(each))} – {duration(max(each))} over {len(each)} runs, the suite "
                            f"{duration(m['suite_seconds_range'][0])} – {duration(m['suite_seconds_range'][1])}")
            else:
                headline = duration(m["seconds"])
                if "suite_seconds" in m:
                    headline += f", the suite {duration(m['suite_seconds'])}"
            if "passed" in m:
                headline += f"; {m['passed']} passed"
            rows.append(Row(f"pipeline: `{command}`", m["what"], "—", headline, **when(m)))
        elif kind == "dvc-exp-show-width":
            rows.append(Row("pipeline: `dvc exp show` width", m["what"], "a 200-column terminal",
                            f"{m['columns']} columns", **when(m)))
        else:
            raise SystemExit(f"pipeline.json: no row for measurement id {kind!r} (add it to {Path(__file__).name})")
    return rows


BUILDERS: dict[str, Callable[[dict], list[Row]]] = {
    "cellvit_read": cellvit_read_rows, "companions": companions_rows, "dvc_storage": dvc_storage_rows,
    "executor": executor_rows, "expression": expression_rows, "extract": extract_rows, "fetch_ingest": fetch_ingest_rows, "probe": probe_rows,
    "placement": placement_rows, "registration": registration_rows,
    "real_section": real_section_rows, "real_shaped": real_shaped_rows, "robustness": robustness_rows,
    "scale": scale_rows, "scale_agreement": scale_agreement_rows, "section_stages": section_stages_rows,
    "slide_read": slide_read_rows,
    "pipeline": pipeline_rows,
}


# ------------------------------------------------------------------- rendering


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))}


def stage_table(pipeline: dict) -> list[str]:
    stages = ["fetch", "ingest", "annotate", "concordance", "extract", "probe", "robustness", "gallery", "report"]
    rows = []
    for m in pipeline["measurements"]:
        if "stage_seconds" not in m:
            continue
        times = m["stage_seconds"]
        shown = [" + ".join(f"{t}" for t in times[s]) if isinstance(times.get(s), list)
                 else (f"{times[s]}" if s in times else "") for s in stages]
        rows.append([f"`{m['id']}`", m["date"], m["commit"], *shown, f"{m.get('dvc_repro_seconds', m['seconds'])}"])
    return table(["run", "date", "commit", *stages, "`dvc repro`"], rows)


def scale_table(scale: dict) -> list[str]:
    groups: dict[tuple, list[dict]] = {}
    for r in scale["estimates"]["rows"]:
        groups.setdefault((r["stage"], r["mode"], r["n_cells"]), []).append(r)

    def span(values: list[float], fmt: str) -> str:
        low, high = min(values), max(values)
        return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{format(low, fmt)}–{format(high, fmt)}"

    rows = []
    for (stage, mode, n), group in groups.items():
        rows.append([stage, mode, thousands(n), str(len(group)),
                     span([g["measured_s"] for g in group], ".1f"), span([g["estimate_s"] for g in group], ".1f"),
                     span([g["ratio_s"] for g in group], ".2f"),
                     span([g["measured_heap_mb"] for g in group], ".0f"),
                     span([g["estimate_heap_mb"] for g in group], ".0f"),
                     span([g["ratio_heap"] for g in group], ".2f")])
    return table(["stage", "mode", "cells", "runs", "wall s", "estimate s", "estimate ÷ wall", "heap MB",
                  "estimate MB", "estimate ÷ heap"], rows)


def render(results: dict[str, dict]) -> str:
    rows: list[Row] = []
    for name, data in sorted(results.items(), key=lambda item: (item[0] != "pipeline", item[0])):
        benchmark = data.get("benchmark", name)
        if benchmark not in BUILDERS:
            raise SystemExit(f"{name}.json: no row builder for benchmark {benchmark!r} in {Path(__file__).name}")
        rows += BUILDERS[benchmark](data)
    lines = [
        "# Benchmarks: what was measured, against what, when and where",
        "",
        "Generated by `python benchmarks/results_table.py` from `benchmarks/results/*.json`; do not edit by hand",
        "(`--check` fails, and so does `tests/unit/docs/test_benchmarks_readme.py`, when this file and the JSONs",
        "disagree). Each JSON records the date, the commit and the machine of its numbers; `commit` is the code",
        "measured where the record names it, else the commit that wrote the numbers (`recorded_in`). Ratios are",
        "medians with their range over the alternated repeats; a single run says so. The scripts that write",
        "the JSONs are beside this file (`bench_*.py`); the pipeline's timings come from the commits that",
        "recorded them.",
        "",
        *table(["benchmark", "measured", "against", "headline (spread)", "date", "commit", "machine"],
               [[r.benchmark, r.measured, r.against, r.headline, r.date, f"`{r.commit}`", r.machine] for r in rows]),
    ]
    if "pipeline" in results:
        lines += ["", "## Stage times of the end-to-end runs (seconds)", "", *stage_table(results["pipeline"])]
        notes = [m for m in results["pipeline"]["measurements"] if m.get("notes")]
        lines += ["", *[f"- `{m['id']}` ({m['date']}, `{m['commit']}`): {m['notes']}." for m in notes]]
    if "scale" in results:
        lines += ["", "## The cost model against the scale runs (`scale.json`)", "",
                  "Synthetic panels written straight into the feature store (D = 1,280); the probe ran LOOO, Tfine,",
                  "Nuc, the default's three Cs, fits capped at 3 L-BFGS iterations (cost per iteration, not scores); robustness ran",
                  "Nuc, Tfine, the panel scope. Heap is the anonymous RSS. Each size records the commit it ran at.",
                  "", *scale_table(results["scale"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when benchmarks/README.md differs")
    args = parser.parse_args(argv)
    text = render(load_results())
    if args.check:
        current = README.read_text(encoding="utf-8") if README.exists() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "benchmarks/README.md (committed)",
                                        "benchmarks/README.md (from the JSONs)", lineterm="", n=0)
            print("\n".join(list(diff)[:40]), file=sys.stderr)
            print("benchmarks/README.md is stale: run python benchmarks/results_table.py", file=sys.stderr)
            return 1
        print("benchmarks/README.md is up to date")
        return 0
    README.write_text(text, encoding="utf-8")
    print(f"wrote {README.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
