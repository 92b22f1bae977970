"""Preflight: every problem that can be known before a stage runs, found at once.

``cellpath validate`` (the first DVC stage, which every other stage depends on) calls
:func:`check_project`. DVC removes a stage's outputs before it runs the stage, so a problem found
only inside the stage costs the previous results; found here, DVC stops at the validate stage and
every earlier output stays as it was (docs/decisions/0014-validate-before-any-output-is-removed.md).

What is checked, beyond the schema of params.yaml (:mod:`cellpath.config`):

- ``extract.encoders``: each entry a registry slug (it names the DVC output folder), with an
  adapter, and for hub models weights in ``models/<slug>/`` or the Hugging Face cache;
- the sections the run will have: the simulated ones, or for ``source: 10x`` the manifest rows
  selected by ``tenx.sections``, each with its download URLs (and ``tenx.mirror`` able to serve them);
- ``concordance.cellvit_dir``: a CellViT++ output for every section;
- ``annotate``: the reference of each section (``annotation.assignment.reference_name``: the
  manifest rule for 10x sections, ``<organ>`` for simulated ones, or ``annotate.references``) holding
  ``label_column`` and raw counts;
- ``concordance.panel_sizes`` and ``panel`` against the number of sections, ``probe.mocv_folds``
  against the panel's sections, ``robustness.shortcut.train_levels`` / ``held_out`` against the confounder's levels;
- ``executor``: the packages a Dask or SLURM backend needs.

Each :class:`Problem` names the parameter, file or section at fault and what to do.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import yaml

from cellpath.config import Params, params_problems
from cellpath.errors import CellPathError, InputError, Problem
from cellpath.io.layout import DEFAULT_DATA_DIR, references_dir
from cellpath.io.text import NotUtf8, read_utf8

SIMULATED_REFERENCE_LABEL_COLUMN = "cell_type"  # the obs column the simulator's references label cells in


@dataclass(frozen=True)
class PlannedSection:
    """A section the run will have, known before fetch: its id, organ, disease status and H&E file name."""

    section_id: str
    organ: str
    status: str
    he_image: str


def check_project(params_path: Path, root: Path = Path("."), data_dir: Path = DEFAULT_DATA_DIR) -> list[Problem]:
    """Every problem of ``params_path`` and of the files it points to (relative to ``root``)."""
    params, problems = read_params(params_path)
    if params is None:
        return problems
    return problems + check_params(params, Path(root), Path(data_dir))


def read_params(params_path: Path) -> tuple[Params | None, list[Problem]]:
    """``params_path`` parsed, and its schema problems (None: nothing usable could be parsed)."""
    params_path = Path(params_path)
    if not params_path.is_file():
        return None, [Problem(str(params_path), "parameter file not found; run from the project root or pass "
                                                "--params")]
    try:
        data = yaml.safe_load(read_utf8(params_path))
    except NotUtf8 as exc:
        return None, [Problem(str(params_path), str(exc).removeprefix(f"{params_path}: "))]
    except yaml.YAMLError as exc:
        return None, [Problem(str(params_path), f"not valid YAML: {exc}")]
    return params_problems(data, str(params_path))


def check_params(params: Params, root: Path, data_dir: Path) -> list[Problem]:
    """The checks beyond the schema, for parameters that are valid on their own."""
    problems = _check_encoders(params, root)
    sections, section_problems = planned_sections(params, root)
    problems += section_problems
    problems += _check_executor(params)
    if not sections:
        return problems
    problems += _check_cellvit(params, root, sections)
    problems += _check_references(params, root / data_dir, sections)
    problems += _check_panels(params, sections)
    return problems


def general_problems(params: Params, root: Path, sections: list[PlannedSection]) -> list[Problem]:
    """The checks that are about no single section's inputs: encoders, executor, ``annotate.references``
    keys, panel sizes and folds (the readiness view, :mod:`cellpath.readiness`, checks each section's)."""
    problems = _check_encoders(params, root) + _check_executor(params) + unknown_reference_keys(params, sections)
    return problems + (_check_panels(params, sections) if sections else [])


def _close(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _check_encoders(params: Params, root: Path) -> list[Problem]:
    from cellpath.features.encoders.weights import EncoderUnavailable, find_weights, needs_weights_file
    from cellpath.features.encoders.registry import RegistryError, UnknownEncoder, load_registry, resolve_encoder

    cfg = params.extract
    try:
        registry = load_registry(root / cfg.registry)
    except RegistryError as exc:
        return [Problem("extract.registry", str(exc))]
    problems = []
    for entry in cfg.encoders:
        where = f"extract.encoders: {entry!r}"
        try:
            spec = resolve_encoder(registry, entry, source=cfg.registry)
        except UnknownEncoder as exc:
            problems.append(Problem(where, exc.reason))
            continue
        if spec.loader.startswith("custom:"):
            problems.append(Problem(where, f"cellpath has no loader for {spec.loader!r} yet; it needs "
                                           f"{spec.requires}. Leave it out of extract.encoders until that adapter exists"))
        elif needs_weights_file(spec):
            try:
                find_weights(spec, weights_dir=root / cfg.weights_dir)
            except EncoderUnavailable as exc:
                problems.append(Problem(where, str(exc)))
    return problems


def planned_sections(params: Params, root: Path) -> tuple[list[PlannedSection], list[Problem]]:
    """The sections fetch will write: simulated, or the selected 10x manifest rows with URLs."""
    if params.source == "synthetic":
        return [PlannedSection(s.section_id, s.organ, s.status, f"{s.section_id}_he_image.ome.tif")
                for s in params.synthetic.sections], []
    from cellpath.sources.tenx import check_downloads, read_manifest, select_sections

    manifest = root / params.tenx.manifest
    try:
        chosen = select_sections(read_manifest(manifest), list(params.tenx.sections), manifest)
        check_downloads(chosen, params.tenx, root)  # tenx.mirror: an existing folder that can serve every URL
    except CellPathError as exc:
        return [], [Problem("source: 10x", str(exc))]
    return [PlannedSection(s.section_id, s.organ, s.status, s.he_image_name) for s in chosen], []


def _check_cellvit(params: Params, root: Path, sections: list[PlannedSection]) -> list[Problem]:
    from cellpath.concordance.cellvit import find_cellvit_output

    folder = params.concordance.cellvit_dir
    if folder is None:
        return []
    folder = root / folder
    if not folder.is_dir():
        return [Problem("concordance.cellvit_dir", f"{folder}: folder not found; set it to the folder CellViT++ "
                                                   "wrote (--outdir), or null for the built-in detector")]
    problems = []
    for section in sections:
        try:
            find_cellvit_output(folder, section.section_id, wsi_name=section.he_image)
        except CellPathError as exc:
            problems.append(Problem("concordance.cellvit_dir", str(exc)))
    return problems


def section_reference(params: Params, section: PlannedSection) -> str:
    """The reference file stem annotate will read for ``section`` (the same rule: an
    ``annotate.references`` entry, ``<organ>`` for a simulated section, else the manifest's Table 1);
    InputError naming the section when the rule has none."""
    from cellpath.annotation.assignment import reference_name

    try:
        return reference_name(params.annotate.references, params.source, section.section_id, section.organ,
                              section.status)
    except InputError as exc:
        raise InputError(str(exc), section=section.section_id) from None


def unknown_reference_keys(params: Params, sections: list[PlannedSection]) -> list[Problem]:
    """``annotate.references`` entries that name no section of the run."""
    known = sorted(s.section_id for s in sections)
    return [Problem(f"annotate.references: {sid!r}", f"not a section of this run{_close(sid, known)}")
            for sid in params.annotate.references if sid not in known]


def _check_references(params: Params, data_dir: Path, sections: list[PlannedSection]) -> list[Problem]:
    cfg = params.annotate
    problems = unknown_reference_keys(params, sections)
    names: set[str] = set()
    for section in sections:
        try:
            names.add(section_reference(params, section))
        except InputError as exc:
            problems.append(Problem("annotate.references", str(exc)))
    needed = sorted(names)
    if params.source == "synthetic":  # fetch writes one reference per simulated organ
        simulated = sorted({s.organ.lower() for s in sections})
        problems += [Problem(f"annotate.references: reference {name!r}",
                             f"the simulator writes references {', '.join(simulated)} only{_close(name, simulated)}")
                     for name in needed if name not in simulated]
        if cfg.label_column != SIMULATED_REFERENCE_LABEL_COLUMN:
            problems.append(Problem("annotate.label_column", f"{cfg.label_column!r} is not a column of the simulated "
                                    f"references; they label cells in {SIMULATED_REFERENCE_LABEL_COLUMN!r}"))
        return problems
    folder = references_dir(data_dir)
    for name in needed:
        path = folder / f"{name}.h5ad"
        if not path.is_file():
            from cellpath.annotation.assignment import reference_caveat

            available = sorted(p.stem for p in folder.glob("*.h5ad")) if folder.is_dir() else []
            problems.append(Problem(str(path), f"no reference {name!r} (available: {', '.join(available) or 'none'}); "
                                               f"build it (`cellpath references build {name} --from FILE…`) or put "
                                               "a labelled .h5ad there before running (fetch downloads only the 10x "
                                               f"files), or map its sections in annotate.references"
                                               f"{reference_caveat(name)}"))
            continue
        problems += reference_file_problems(path, params)
    return problems


def reference_file_problems(path: Path, params: Params) -> list[Problem]:
    """What annotate would refuse in an existing reference file: unreadable obs, no ``label_column``,
    no raw counts where ``reference_counts`` says."""
    cfg = params.annotate
    columns = _obs_columns(path)
    if columns is None:
        return [Problem(str(path), "cannot read the reference's obs (not an .h5ad file, or truncated)")]
    problems = []
    if cfg.label_column not in columns:
        problems.append(Problem(f"annotate.label_column: {cfg.label_column!r}",
                                f"not a column of {path} (obs columns: {', '.join(columns)})"
                                f"{_close(cfg.label_column, columns)}"))
    if (problem := _counts_problem(path, cfg.reference_counts)) is not None:
        problems.append(Problem(f"annotate.reference_counts: {cfg.reference_counts!r}", f"{path}: {problem}"))
    return problems


COUNT_SAMPLE = 100_000  # values read from the start of a reference's counts to tell counts from normalised data


def _counts_problem(path: Path, source: str) -> str | None:
    """Why the reference's counts at ``source`` are not raw counts (annotate would refuse them), from
    the first ``COUNT_SAMPLE`` stored values; None when they are whole numbers (or unreadable here:
    annotate then names the problem). Read with h5py, without loading the matrix."""
    import h5py
    import numpy as np

    try:
        with h5py.File(path, "r") as handle:
            layers = sorted(handle["layers"].keys()) if "layers" in handle else []
            places = [f"layers/{name}" for name in layers] + (["raw"] if "raw" in handle else [])
            if source == "auto":
                source = "layers/counts" if "counts" in layers else "X"
            key = {"X": "X", "raw": "raw/X"}.get(source, source)
            if key not in handle:
                return f"it has no {source} (it has X{''.join(', ' + p for p in places)})"
            node = handle[key]
            if isinstance(node, h5py.Group):  # a sparse matrix: its stored values
                values = node["data"][:COUNT_SAMPLE]
            else:  # dense: the first rows
                values = node[:max(1, COUNT_SAMPLE // max(1, node.shape[-1]))]
    except (OSError, KeyError, TypeError):
        return None
    values = np.asarray(values, dtype=np.float64).ravel()
    fractional = np.abs(values - np.rint(values)) > 1e-6
    if not fractional.any():
        return None
    return (f"{source} holds values that are not whole numbers (e.g. {values[np.argmax(fractional)]:.4g}): normalised "
            f"or log-transformed data, not raw counts; set annotate.reference_counts to where the counts are "
            f"(it has {', '.join(['X', *places])}) — annotate would stop")


def _obs_columns(path: Path) -> list[str] | None:
    """The obs column names of an .h5ad file, read without loading the matrix (None if unreadable)."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            obs = handle["obs"]
            order = obs.attrs.get("column-order")
            if order is None:  # very old files: a compound dataset
                return [str(n) for n in obs.dtype.names or ()]
            return [str(c) for c in (order.tolist() if hasattr(order, "tolist") else order)]
    except (OSError, KeyError):
        return None


def _check_panels(params: Params, sections: list[PlannedSection]) -> list[Problem]:
    n_sections = len(sections)
    problems = []
    too_large = [size for size in params.concordance.panel_sizes if size > n_sections]
    if too_large:
        problems.append(Problem("concordance.panel_sizes", f"panel(s) {', '.join(f'S{s}' for s in too_large)} need more "
                                                           f"sections than the {n_sections} this run has"))
    panel_size = int(params.panel[1:])
    if "mocv" in params.protocols and params.probe.mocv_folds > min(panel_size, n_sections):
        problems.append(Problem("probe.mocv_folds", f"{params.probe.mocv_folds} folds need at least as many sections; "
                                                    f"panel {params.panel} has {min(panel_size, n_sections)}"))
    shortcut = params.robustness.shortcut
    if shortcut.enabled:
        from cellpath.robustness.shortcut import split_levels, sweep_tables

        levels = sorted({getattr(s, shortcut.confounder) for s in sections})
        try:
            trained, _ = split_levels(levels, shortcut.train_levels, shortcut.held_out_levels)
        except ValueError as exc:
            key = "train_levels" if shortcut.train_levels is not None else "held_out"
            problems.append(Problem(f"robustness.shortcut.{key}", f"{shortcut.confounder}: {exc}"))
        else:
            try:  # two classes: the fewest a sweep has, so a failure here fails for any panel
                sweep_tables(len(trained), 2, shortcut.pool_size)
            except ValueError as exc:
                problems.append(Problem("robustness.shortcut.pool_size",
                                        f"{exc}; raise pool_size or train on fewer {shortcut.confounder} levels"))
    return problems


def _check_executor(params: Params) -> list[Problem]:
    cfg = params.executor
    if cfg.backend != "dask":
        return []
    if importlib.util.find_spec("distributed") is None:
        return [Problem("executor.backend", "dask needs the distributed package: pip install distributed")]
    if cfg.address is None and cfg.cluster == "slurm" and importlib.util.find_spec("dask_jobqueue") is None:
        return [Problem("executor.cluster", "slurm needs dask-jobqueue: pip install dask-jobqueue")]
    return []
