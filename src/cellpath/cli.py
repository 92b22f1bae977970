"""Command line: ``cellpath <stage>``. dvc.yaml calls only these commands.

Each stage reads params.yaml once through :mod:`cellpath.config`, logs what it read and wrote,
and exits with status 2 and a one-paragraph message (no traceback) on a user-facing error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cellpath.errors import CellPathError
from cellpath.io import native_parquet
from cellpath.io.layout import DEFAULT_DATA_DIR, DEFAULT_REPORTS_DIR, stage_log
from cellpath.runtime.costs import COSTS_PATH
from cellpath.vocabulary import PLACEMENT_ANCHORS, PRESETS

log = logging.getLogger("cellpath")

# numpy picks SIMD kernels for the CPU when it is imported; its exp, sin, cos and arctan2 differ in
# the last bit between the AVX2 (x86-64-v3) and AVX-512 kernels. `cellpath fetch` disables the
# AVX-512 ones so that the simulator writes the same bytes on every x86-64-v3 machine
# (docs/decisions/0015-reproducible-across-machines.md). Names a CPU lacks are ignored by numpy.
PORTABLE_NUMPY_DISPATCH = ("X86_V4", "AVX512_ICL", "AVX512_SPR")


def pin_numpy_dispatch() -> None:
    """Disable numpy's AVX-512 kernels in this process (before numpy is imported)."""
    if "numpy" in sys.modules:
        raise RuntimeError("pin_numpy_dispatch must run before numpy is imported")
    listed = os.environ.get("NPY_DISABLE_CPU_FEATURES", "").replace(",", " ").split()
    os.environ["NPY_DISABLE_CPU_FEATURES"] = " ".join(dict.fromkeys([*listed, *PORTABLE_NUMPY_DISPATCH]))


#: Commands that are pipeline stages: each writes its log to reports/logs/<stage>.log as well.
LOGGED_STAGES = ("fetch", "ingest", "annotate", "concordance", "extract", "probe", "robustness", "gallery", "report")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _configure_logging(verbose: bool, log_file: Path | None = None) -> None:
    """Log to stderr and, for a pipeline stage, to ``log_file`` (overwritten each run)."""
    # Configure before tiatoolbox is imported: it adds its own handlers to the root logger.
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="w", encoding="utf-8"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=_LOG_FORMAT, handlers=handlers,
                        force=True)
    for noisy in ("tiatoolbox", "numba", "fsspec", "h5py", "PIL", "matplotlib", "urllib3", "asyncio", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _log_name(args: argparse.Namespace) -> str:
    """The stage's log name: ``extract`` run for one encoder and magnification logs to its own file."""
    if args.stage == "extract" and (args.encoder or args.magnification):
        return "-".join(["extract", *(str(v) for v in (args.encoder, args.magnification) if v)])
    return args.stage


def _fetch(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.fetch import run

    run(load_params(args.params), Path(args.data_dir))


def _ingest(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.ingest import run

    run(load_params(args.params), Path(args.data_dir))


def _annotate(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.annotate import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _concordance(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.concordance import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _extract(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.extract import run

    params = load_params(args.params)
    encoders = [args.encoder] if args.encoder else params.extract.encoders
    magnifications = [args.magnification] if args.magnification else params.extract.magnifications
    for encoder in encoders:
        for magnification in magnifications:
            run(params, Path(args.data_dir), encoder, magnification)


def _probe(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.probe import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _expression(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.expression import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _robustness(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.robustness import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _gallery(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.gallery import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _report(args: argparse.Namespace) -> None:
    from cellpath.config import load_params
    from cellpath.stages.report import run

    run(load_params(args.params), Path(args.data_dir), Path(args.reports_dir))


def _validate(args: argparse.Namespace) -> None:
    from cellpath.stages.validate import run

    print(run(Path(args.params), Path(args.data_dir), Path(args.record) if args.record else None, preset=args.preset,
              models=args.models, anchors=args.anchors))


def _plan(args: argparse.Namespace) -> None:
    from cellpath.commands.plan import run
    from cellpath.config import load_params

    print(run(load_params(args.params), Path(args.data_dir), preset=args.preset, costs_path=Path(args.costs),
              worker_cores=args.worker_cores, worker_memory_gb=args.worker_memory_gb,
              deadline_days=args.deadline_days, as_json=args.json, models=args.models,
              node_gpus=args.node_gpus, reports_dir=Path(args.reports_dir),
              pilot=Path(args.pilot) if args.pilot else None, anchors=args.anchors))


def _register(args: argparse.Namespace) -> None:
    from cellpath.commands.register import register_section
    from cellpath.config import load_params

    register_section(Path(args.folder), load_params(args.params).concordance)


def _export(args: argparse.Namespace) -> None:
    from cellpath.commands.export import run
    from cellpath.config import load_params

    run(load_params(args.params), Path(args.data_dir), sections=args.sections, encoders=args.encoder,
        magnifications=args.magnification, he_downsample=args.he_downsample, images=not args.no_images)


def _encoders(args: argparse.Namespace) -> None:
    from cellpath.commands.encoders import run_check, run_list
    from cellpath.config import load_params

    params = load_params(args.params)
    if args.action == "list":
        print(run_list(params))
    elif not args.name:
        raise CellPathError("encoders check: name the encoder to check (a registry slug or name; "
                            "`cellpath encoders list` shows them)")
    else:
        print(run_check(params, args.name, Path(args.weights) if args.weights else None))


def _references(args: argparse.Namespace) -> None:
    from cellpath.commands.references import run_build, run_list
    from cellpath.references.build import BuildOptions

    if args.action == "list":
        print(run_list(Path(args.data_dir), Path(args.manifest)))
    elif not args.name or not args.sources:
        raise CellPathError("references build: name the reference and its downloaded files: `cellpath references "
                            "build <name> --from FILE…` (`cellpath references list` shows the names)")
    else:
        options = BuildOptions(label_column=args.label_column, barcode_column=args.barcode_column,
                               annotations=tuple(Path(a) for a in args.annotations or ()),
                               vocabulary=args.vocabulary, counts=args.counts, gene_symbols=args.gene_symbols)
        print(run_build(args.name, [Path(s) for s in args.sources], Path(args.data_dir),
                        out=Path(args.out) if args.out else None, manifest=Path(args.manifest), options=options))


STAGES: dict[str, tuple[Callable[[argparse.Namespace], None], str]] = {
    "fetch": (_fetch, "download (source: 10x) or simulate (source: synthetic) the raw Xenium + H&E panel"),
    "ingest": (_ingest, "read every raw bundle into data/sections/<section>.zarr (SpatialData)"),
    "annotate": (_annotate, "transfer 68-type labels from the references; Tfine/Tcoarse, eligibility, marker QC"),
    "concordance": (_concordance, "H&E nuclei (CellViT++ or the built-in detector) vs Xenium labels: AGR-BAcc, ranking, panels"),
    "extract": (_extract, "frozen-encoder features per cell (Nuc, Mean, Cls) at a target magnification"),
    "probe": (_probe, "linear probes under IS / IOCD / MOCV / LOOO: run table, summaries, metrics.json, MLflow"),
    "expression": (_expression, "label-free expression probes: ridge regression of each cell's measured expression on "
                                "its features, its type and both, under the type probes' protocols"),
    "robustness": (_robustness, "CRoMa, F(0), LTM, RI, MaRI, k-NN probes and the shortcut probe (APD, nIPD) per encoder"),
    "gallery": (_gallery, "where each model fails: a page per model of its lowest-margin cells and most confident "
                          "IS errors, as H&E crops with their nearest SO / OS neighbours (reports/gallery/)"),
    "report": (_report, "the HTML report (reports/index.html), its tables (CSV, Markdown) and figures"),
    "validate": (_validate, "check params.yaml and what it points to (encoders, weights, references, CellViT++ "
                            "outputs, URLs, panel sizes); list every problem at once; for source: 10x or --preset "
                            "paper, per section of the panel what is in place and the action each gap needs"),
    "plan": (_plan, "sections, cells, patches, feature bytes, probe runs and estimated time for the params (or the paper's)"),
    "export": (_export, "write data/exports/ for scverse tools: per section a SpatialData (H&E aligned to µm, nucleus "
                        "boundaries, labels) for napari-spatialdata, per encoder the features as AnnData"),
    "register": (_register, "register a raw section's H&E to its Xenium nuclei from any starting pose: writes "
                            "10x's he_imagealignment.csv, or a proposal beside a given one, and a JSON record"),
    "references": (_references, "list the paper's scRNA-seq references (data/manifests/references.csv) or build "
                                "one: its downloaded files → data/references/<name>.h5ad for annotate"),
    "encoders": (_encoders, "list the registry's encoders and their weights, or check one: build it, load its weights "
                            "strictly, run a synthetic tile"),
}


def _references_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``cellpath references list|build``."""
    from cellpath.references.manifest import REFERENCE_MANIFEST

    parser.add_argument("action", choices=["list", "build"])
    parser.add_argument("name", nargs="?", help="build: the reference's name in the manifest")
    parser.add_argument("--from", dest="sources", nargs="+", metavar="FILE",
                        help="build: the reference's downloaded files (matrices, genes, barcodes, tables)")
    parser.add_argument("--out", help="build: the h5ad to write (default: data/references/<name>.h5ad)")
    parser.add_argument("--manifest", default=str(REFERENCE_MANIFEST),
                        help="the reference manifest (default: %(default)s)")
    parser.add_argument("--annotations", nargs="+", metavar="FILE",
                        help="build: the cell annotation table(s) (default: the tables among --from that are no "
                             "count file)")
    parser.add_argument("--label-column", help="build: its label column (default: the manifest's)")
    parser.add_argument("--barcode-column",
                        help="build: its barcode column (default: the manifest's, else the first column)")
    parser.add_argument("--vocabulary", help="build: the label vocabulary to record (default: the manifest's)")
    parser.add_argument("--counts", default="auto", help="build, h5ad: where the raw counts are: X, raw, "
                                                         "layers/<name> (default: raw.X, else layers/counts, else X)")
    parser.add_argument("--gene-symbols", help="build, h5ad: the var column of gene symbols (default: "
                                               "feature_name, gene_symbols or gene_symbol for Ensembl ids)")


def _export_arguments(stage: argparse.ArgumentParser) -> None:
    stage.add_argument("--sections", nargs="+", metavar="SECTION", help="section ids (default: every "
                                                                       "ingested section)")
    stage.add_argument("--encoder", action="append", help="registry slug or name, repeatable (default: "
                                                          "every extract.encoders entry)")
    stage.add_argument("--magnification", action="append", help="40x, 20x or 10x, repeatable (default: "
                                                                "every extract.magnifications entry)")
    stage.add_argument("--he-downsample", type=int, default=1, metavar="N",
                       help="copy the H&E coarsened N× (block mean) to save disk (default: full resolution)")
    stage.add_argument("--no-images", action="store_true", help="write only the embedding AnnData")


PRESET_HELP = {
    "validate": "paper: the readiness of the paper's panel (the manifest's panel_s25 sections, the paper's "
                "configuration); placement: the same panel at the headline condition for the encoders of --models "
                "(else extract.encoders); "
                "source: 10x shows its panel's readiness as well",
    "plan": "paper: the paper's 30 encoders, 3 magnifications, S25 panel and seeds; placement: the paper's "
            "configuration at its headline condition (20×, Nuc, Tfine) for the encoders of --models (else "
            "extract.encoders), priced beside their share of the paper's, with the dvc exp run line that runs it",
}


def _preset_arguments(stage: argparse.ArgumentParser, name: str) -> None:
    stage.add_argument("--preset", choices=PRESETS, default="current", help=PRESET_HELP[name])
    stage.add_argument("--anchors", nargs="*", metavar="SLUG",
                       help="with --preset placement: the paper's models run beside --models, to place them on the "
                            f"paper's scale (default: {' '.join(PLACEMENT_ANCHORS)}; none: --anchors alone)")


def build_parser() -> argparse.ArgumentParser:
    from cellpath import __version__

    parser = argparse.ArgumentParser(
        prog="cellpath", description="CellPath-Bench and CRoMa: what pathology foundation models know about "
                                     "single cells. Each pipeline stage is one command; dvc.yaml calls them.")
    parser.add_argument("--version", action="version", version=f"cellpath {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="stage", required=True, metavar="<stage>")
    for name, (_, help_text) in STAGES.items():
        stage = sub.add_parser(name, help=help_text, description=help_text)
        stage.add_argument("--params", default="params.yaml", help="parameter file (default: params.yaml)")
        stage.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="data folder (default: %(default)s)")
        stage.add_argument("--reports-dir", default=str(DEFAULT_REPORTS_DIR),
                           help="reports folder (default: %(default)s)")
        if name in PRESET_HELP:
            _preset_arguments(stage, name)
        if name == "extract":
            stage.add_argument("--encoder", help="registry slug or name (default: every extract.encoders entry)")
            stage.add_argument("--magnification", help="40x, 20x or 10x (default: every extract.magnifications entry)")
        if name == "validate":
            stage.add_argument("--record", help="on success write this file (the validate stage's DVC output)")
            stage.add_argument("--models", nargs="+", metavar="SLUG",
                               help="with --preset paper or placement: check these encoders (registry slugs) "
                                    "instead of the configuration's")
        if name == "encoders":
            stage.add_argument("action", choices=["list", "check"])
            stage.add_argument("name", nargs="?", help="check: the registry slug or name")
            stage.add_argument("--weights", help="check: a checkpoint file, or a folder holding one, to use instead "
                                                 "of models/<slug>/ and the Hugging Face cache")
        if name == "references":
            _references_arguments(stage)
        if name == "register":
            stage.add_argument("folder", help="the raw section folder (Xenium outputs, H&E OME-TIFF, section.json)")
        if name == "export":
            _export_arguments(stage)
        if name == "plan":
            stage.add_argument("--costs", default=str(COSTS_PATH),
                               help="the cost model (default: the one stored with the code, measured by "
                                    "benchmarks/bench_scale.py)")
            stage.add_argument("--worker-cores", type=int, help="cores per worker (default: this machine's)")
            stage.add_argument("--worker-memory-gb", type=float, help="memory per worker (default: this machine's)")
            stage.add_argument("--deadline-days", type=float, default=7.0,
                               help="finish within this many days (default: %(default)s)")
            stage.add_argument("--json", action="store_true", help="print the plan as JSON")
            stage.add_argument("--models", nargs="+", metavar="SLUG",
                               help="only these encoders' share of the configuration (registry slugs): their "
                                    "extraction and their probe and robustness runs, on the same panel")
            stage.add_argument("--node-gpus", type=int, default=8,
                               help="GPUs of the node whose days the plan prints (default: %(default)s)")
            stage.add_argument("--pilot", metavar="RUNS_PARQUET", help="the probe's L-BFGS iterations from this run "
                               "table on real features (default: the project's own if source is 10x, else costs.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    native_parquet.install()  # local parquet reads that cannot abort the process at exit (decision 0033)
    args = build_parser().parse_args(argv)
    if args.stage == "fetch":
        pin_numpy_dispatch()
    _configure_logging(args.verbose, stage_log(Path(args.reports_dir), _log_name(args))
                       if args.stage in LOGGED_STAGES else None)
    handler, _ = STAGES[args.stage]
    started = time.perf_counter()
    try:
        handler(args)
    except CellPathError as exc:
        print(f"cellpath {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cellpath {args.stage}: interrupted after {time.perf_counter() - started:.1f} s; finished work is "
              "kept and partial outputs are discarded: rerun to resume", file=sys.stderr)
        return 130
    log.info("%s finished in %.1f s", args.stage, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
