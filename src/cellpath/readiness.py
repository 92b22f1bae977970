"""Readiness of a 10x panel: per section, what is in place to run it and the one action each gap needs.

``cellpath validate`` shows it for ``source: 10x`` (the sections ``tenx.sections`` selects) and for
``--preset paper`` (the manifest's ``panel_s25`` rows with the paper's configuration,
:func:`cellpath.planning.paper.paper_params`). Per section it reads the manifest and local files
only, never the network:

- **downloads**: where each file's URL comes from (``seen`` with a source, ``derived`` by 10x's naming
  and never requested, or missing), the host it is fetched from (``tenx.mirror``'s when set), which
  of MD5, SHA-256 and size the download is checked against, and whether the files are already in
  ``data/raw/<section>/`` or the download cache;
- **reference**: the reference annotate will read (:func:`cellpath.preflight.section_reference`: the
  manifest rule or an ``annotate.references`` override), whether ``data/references/<name>.h5ad``
  exists and is usable, and whether ``label_aliases.csv`` has its label vocabulary;
- **CellViT++**: an output for the section's H&E in ``concordance.cellvit_dir``, or the built-in detector.

Each check is ``ok``, ``check`` (worth a look but not blocking: a derived URL, the built-in detector
where the paper used CellViT++) or ``missing`` (the run would stop); a section is ready when nothing
is missing. The problems that are about no single section (encoders, executor, panel sizes) come from
:func:`cellpath.preflight.general_problems`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from cellpath.config import Params, parse_params
from cellpath.errors import CellPathError, InputError, Problem
from cellpath.io.layout import downloads_dir, raw_dir, reference_h5ad, references_dir
from cellpath.preflight import PlannedSection, general_problems, reference_file_problems, section_reference
from cellpath.references.manifest import REFERENCE_MANIFEST, ReferenceEntry, read_reference_manifest
from cellpath.sources.lock import FIRST_USE, NOT_YET, PUBLISHED, Lock, read_lock
from cellpath.sources.tenx import (FILE_KINDS, SECTION_MARKER, ManifestSection, check_downloads, is_fetched,
                                   lock_conflicts, mirror_base, mirror_url, read_manifest, verification_counts)
from cellpath.vocabulary import PLACEMENT_ANCHORS

OK, CHECK, MISSING = "ok", "check", "missing"
KIND_NAMES = {"bundle": "bundle", "he_image": "H&E image", "he_alignment": "alignment CSV"}
ALIAS_TABLE_PATH = "src/cellpath/annotation/data/label_aliases.csv"


@dataclass(frozen=True)
class Check:
    """One check of a section: what the table shows, its level, and the one action it needs (when not ok)."""

    cell: str
    level: str = OK
    action: str = ""


@dataclass(frozen=True)
class SectionReadiness:
    """One section of the panel: its downloads, reference, labels and CellViT++ output."""

    section_id: str
    host: str  # where its files are fetched from
    sums: str  # per file (bundle/H&E/alignment): M md5, S sha256, B bytes, - none
    local: str  # data/raw, cache n/3, or no
    reference: str  # the reference's name, "-" when the rule has none
    downloads: Check
    reference_file: Check
    labels: Check
    cellvit: Check

    @property
    def checks(self) -> dict[str, Check]:
        return {"downloads": self.downloads, "reference": self.reference_file, "labels": self.labels,
                "CellViT++": self.cellvit}

    @property
    def ready(self) -> bool:
        return all(check.level != MISSING for check in self.checks.values())

    def actions(self, level: str) -> list[str]:
        """The actions of the checks at ``level``, in table order."""
        return [check.action for check in self.checks.values() if check.level == level and check.action]


@dataclass(frozen=True)
class _Run:
    """What every section's checks read: the params, the project root, the data folder (relative to
    it), the reference manifest's rows and whether this is the paper's configuration."""

    params: Params
    root: Path
    data_dir: Path
    references: dict[str, ReferenceEntry]
    paper: bool
    lock: Lock


@dataclass(frozen=True)
class PanelReadiness:
    """The panel's sections and the problems that concern no single section."""

    title: str
    sections: tuple[SectionReadiness, ...]
    problems: tuple[Problem, ...]
    mirror: str | None = None
    notes: tuple[str, ...] = ()
    #: files by what verifies them: published checksum, first use (the lock), not yet downloaded
    verification: tuple[tuple[str, int], ...] = ()
    lock: Path | None = None

    @property
    def ready(self) -> bool:
        return bool(self.sections) and not self.problems and all(s.ready for s in self.sections)


def paper_panel_params(params: Params, root: Path = Path("."), *, placement: bool = False,
                       encoders: list[str] | None = None,
                       anchors: tuple[str, ...] | list[str] = PLACEMENT_ANCHORS) -> tuple[Params, list[str]]:
    """The paper's configuration (:func:`paper_params`; ``placement``: :func:`placement_params`, for
    ``params``' encoders at the headline condition beside the ``anchors``; ``encoders``: these slugs
    instead of the configuration's) on the manifest's ``panel_s25`` sections, and a
    note per setting of ``params`` left out because it names sections outside that panel (the simulated
    run's ``annotate.references`` entries, or its shortcut probe's ``train_levels``: that probe is then
    not checked)."""
    from cellpath.planning.paper import paper_params, placement_params

    data = (placement_params(params, encoders, anchors) if placement else paper_params(params)).model_dump(mode="json")
    if encoders and not placement:
        data["extract"]["encoders"] = list(encoders)
    rows = [s for s in read_manifest(root / params.tenx.manifest) if s.panel_s25]
    data["tenx"]["sections"] = [s.section_id for s in rows]
    notes = []
    references = data["annotate"]["references"]
    outside = sorted(set(references) - set(data["tenx"]["sections"]))
    if outside:
        data["annotate"]["references"] = {k: v for k, v in references.items() if k not in outside}
        notes.append(f"annotate.references: left out {', '.join(outside)} (not sections of the paper's panel)")
    shortcut = data["robustness"]["shortcut"]
    levels = {str(getattr(s, shortcut["confounder"])) for s in rows}
    if shortcut["enabled"] and shortcut["train_levels"] and not set(shortcut["train_levels"]) <= levels:
        shortcut["enabled"] = False
        notes.append(f"robustness.shortcut: not checked, its train_levels {shortcut['train_levels']} are no "
                     f"{shortcut['confounder']} of the paper's panel; for a 10x run choose two of the panel's")
    return parse_params(data), notes


def check_readiness(params: Params, root: Path, data_dir: Path, *, paper: bool = False, placement: bool = False,
                    notes: tuple[str, ...] = ()) -> PanelReadiness:
    """The readiness of ``params``' 10x panel (``paper``: the paper's panel and configuration, see
    :func:`paper_panel_params`, whose ``notes`` are shown; ``placement``: its placement configuration)."""
    manifest = root / params.tenx.manifest
    title, mirror = _title(params, paper, placement), params.tenx.mirror
    try:
        rows = read_manifest(manifest)
        check_downloads([], params.tenx, root)  # tenx.mirror: a folder that exists, or a web URL
    except CellPathError as exc:
        return PanelReadiness(title, (), (Problem("source: 10x", str(exc)),), mirror, tuple(notes))
    chosen, problems = _chosen(rows, list(params.tenx.sections), params.tenx.manifest)
    if not chosen and not problems:
        problems.append(Problem("source: 10x", f"no section of {params.tenx.manifest} has a bundle_url yet; fill in "
                                               "the URL columns from the dataset pages (data/manifests/README.md)"))
    planned = [PlannedSection(s.section_id, s.organ, s.status, s.he_image_name) for s in chosen]
    problems += general_problems(params, root, planned)
    if paper:
        problems = _one_encoder_problem(problems, len(params.extract.encoders))
    try:
        references = read_reference_manifest(root / REFERENCE_MANIFEST)
    except InputError as exc:
        references = {}
        problems.append(Problem("references", str(exc)))
    try:
        lock = read_lock(root / params.tenx.lock_file)
    except InputError as exc:
        lock = {}
        problems.append(Problem("tenx.lock", str(exc)))
    problems += [Problem(f"tenx.lock {params.tenx.lock_file}", conflict) for conflict in lock_conflicts(chosen, lock)]
    run = _Run(params, root, Path(data_dir), references, paper, lock)
    sections = tuple(_section(section, plan, run) for section, plan in zip(chosen, planned))
    counts = tuple(verification_counts(chosen, lock).items())
    return PanelReadiness(title, sections, tuple(problems), mirror, tuple(notes), counts, params.tenx.lock_file)


def _title(params: Params, paper: bool, placement: bool = False) -> str:
    manifest, listed = params.tenx.manifest, params.tenx.sections
    if placement:
        return (f"the paper's panel: the panel_s25 sections of {manifest}, in the placement configuration (the "
                f"paper's at its headline condition) for {', '.join(params.extract.encoders)}")
    if paper:
        return f"the paper's panel: the panel_s25 sections of {manifest}, in the paper's configuration"
    if listed:
        return f"the 10x panel: the {len(listed)} section(s) tenx.sections lists from {manifest}"
    return f"the 10x panel: every section of {manifest} with a bundle_url (tenx.sections is empty)"


def _chosen(rows: list[ManifestSection], wanted: list[str], manifest: Path) -> tuple[list[ManifestSection],
                                                                                    list[Problem]]:
    """The sections of the panel (``wanted``, else every row with a bundle URL) and the unknown ids."""
    if not wanted:
        return [row for row in rows if row.bundle.url is not None], []
    by_id = {row.section_id: row for row in rows}
    unknown = [w for w in wanted if w not in by_id]
    problems = [Problem("tenx.sections", f"not in {manifest}: {', '.join(unknown)}")] if unknown else []
    return [by_id[w] for w in wanted if w in by_id], problems


def _one_encoder_problem(problems: list[Problem], n_encoders: int) -> list[Problem]:
    """The configuration's encoders that cannot run here as one problem (each one's reason: ``cellpath
    encoders check``)."""
    encoders = [p for p in problems if p.where.startswith("extract.encoders: ")]
    if not encoders:
        return problems
    names = ", ".join(p.where.removeprefix("extract.encoders: ").strip("'") for p in encoders)
    summary = Problem("extract.encoders", f"{len(encoders)} of the configuration's {n_encoders} encoders cannot run "
                                          "here "
                                          f"({names}); `cellpath encoders list` shows where weights are looked for, "
                                          "docs/encoders.md how to provide them")
    return [summary, *(p for p in problems if p not in encoders)]


def _section(section: ManifestSection, planned: PlannedSection, run: _Run) -> SectionReadiness:
    local, have = _local_files(section, run.root / run.data_dir, run.lock)
    try:
        name = section_reference(run.params, planned)
    except InputError as exc:
        name, reference, labels = "-", Check("none", MISSING, f"map the section to a reference in "
                                                                f"annotate.references ({exc})"), Check("-")
    else:
        reference, labels = _reference_check(name, run), _labels_check(name, run)
    return SectionReadiness(
        section_id=section.section_id, host=_host(section, run), sums=_sums(section, run.lock), local=local, reference=name,
        downloads=_downloads_check(section, run, have), reference_file=reference, labels=labels,
        cellvit=_cellvit_check(section, run))


def _local_files(section: ManifestSection, data_dir: Path, lock: Lock) -> tuple[str, set[str]]:
    """Where the section's files are already (``data/raw``, the download cache, nowhere) and which kinds."""
    folder = raw_dir(data_dir) / section.section_id
    if is_fetched(folder, section, lock):
        return "data/raw", set(FILE_KINDS)
    cache = downloads_dir(data_dir) / section.section_id
    names = {"bundle": "bundle", "he_image": section.he_image_name, "he_alignment": section.he_alignment_name}
    have = {kind for kind, name in names.items() if (cache / name).is_file()}
    if have:
        return f"cache {len(have)}/{len(FILE_KINDS)}", have
    return ("outdated" if (folder / SECTION_MARKER).is_file() else "no"), have


def _sums(section: ManifestSection, lock: Lock) -> str:
    cells = []
    for kind in FILE_KINDS:
        remote, locked = getattr(section, kind), (section.section_id, kind) in lock
        known = "".join(letter for letter, value in (("M", remote.md5), ("S", remote.sha256), ("B", remote.size),
                                                     ("L", locked or None)) if value is not None)
        cells.append(known or "-")
    return "/".join(cells)


def _host(section: ManifestSection, run: _Run) -> str:
    url = section.bundle.url
    if url is None:
        return "-"
    if run.params.tenx.mirror is not None:
        url = mirror_url(url, run.params.tenx.mirror, run.root) or url
    parsed = urlparse(url)
    return parsed.netloc if parsed.scheme in ("http", "https") else "local files"


def _url_state(section: ManifestSection, kind: str) -> str:
    remote = getattr(section, kind)
    return "none" if remote.url is None else "derived" if remote.derived else "seen"


def _downloads_check(section: ManifestSection, run: _Run, have: set[str]) -> Check:
    """The URLs: missing ones stop fetch (it refuses the section even when fetched), as do files a mirror
    folder lacks; derived ones not yet downloaded are to check (unless a mirror folder holds them)."""
    cell = "/".join(_url_state(section, kind) for kind in FILE_KINDS)
    page = section.page_url or "the section's dataset page"
    missing = [f"{kind}_url" for kind in FILE_KINDS if getattr(section, kind).url is None]
    if missing:
        return Check(cell, MISSING, f"fill in {', '.join(missing)} from {page} (data/manifests/README.md)")
    mirror = run.params.tenx.mirror
    if mirror is not None:
        problem = _mirror_problem(section, mirror, run.root, have)
        if problem:
            return Check(cell, MISSING, problem)
    derived = [KIND_NAMES[kind] for kind in FILE_KINDS if kind not in have and getattr(section, kind).derived]
    if derived and not (mirror is not None and urlparse(mirror_base(mirror, run.root)).scheme == "file"):
        return Check(cell, CHECK, f"check {page} for the {' and '.join(derived)} (derived URL, not checked online)")
    return Check(cell)


def _mirror_problem(section: ManifestSection, mirror: str, root: Path, have: set[str]) -> str:
    """What stops ``tenx.mirror`` from serving the section's files (empty when nothing does)."""
    unserved = [f"{kind}_url" for kind in FILE_KINDS
                if any(mirror_url(url, mirror, root) is None for url in getattr(section, kind).urls)]
    if unserved:
        return (f"give {', '.join(unserved)} a URL in 10x's layout (…/samples/xenium/<XOA version>/<Name>/<file>) "
                "or set tenx.mirror: null")
    absent = []
    for kind in FILE_KINDS:
        parsed = urlparse(mirror_url(getattr(section, kind).url, mirror, root))
        if kind not in have and parsed.scheme == "file" and not Path(url2pathname(parsed.path)).is_file():
            absent.append("/".join(parsed.path.rsplit("/", 3)[-3:]))
    return f"copy {', '.join(absent)} into the mirror ({mirror})" if absent else ""


def _reference_check(name: str, run: _Run) -> Check:
    from cellpath.annotation.assignment import CAVEATS

    path = run.root / reference_h5ad(run.data_dir, name)
    if path.is_file():
        problems = reference_file_problems(path, run.params)
        return Check("unusable", MISSING, str(problems[0])) if problems else Check("present")
    if name in CAVEATS:
        return Check("missing", MISSING, CAVEATS[name])
    if name in run.references:
        return Check("missing", MISSING, f"cellpath references build {name} --from FILE… (the files "
                                         f"{REFERENCE_MANIFEST} lists for it)")
    return Check("missing", MISSING, f"put the labelled {name}.h5ad in {references_dir(run.data_dir)}/ or change "
                                     "annotate.references")


def _labels_check(name: str, run: _Run) -> Check:
    """Whether label_aliases.csv has the vocabulary annotate will map the reference's labels with."""
    from cellpath.annotation.ontology import ONTOLOGY_VOCABULARY, label_aliases, unmapped_labels

    path, entries = run.root / reference_h5ad(run.data_dir, name), run.references
    vocabulary = (run.params.annotate.label_vocabulary or (_recorded_vocabulary(path) if path.is_file() else None)
                  or (entries[name].label_vocabulary if name in entries else None))
    if vocabulary in (*label_aliases(), *unmapped_labels(), ONTOLOGY_VOCABULARY):
        return Check("known")
    if vocabulary:
        return Check("unknown", MISSING, f"add the rows of vocabulary {vocabulary!r} to {ALIAS_TABLE_PATH} "
                                         "(or set annotate.label_vocabulary)")
    if path.is_file():
        return Check("ontology", CHECK, "its labels must be the ontology's names (the file records no vocabulary); "
                                        "else set annotate.label_vocabulary")
    if name in entries:
        return Check("none", MISSING, f"label the reference's cells and add their vocabulary to {ALIAS_TABLE_PATH} "
                                      "(data/manifests/references.md)")
    return Check("-")  # a reference of your own, not built yet: its own check says so


def _recorded_vocabulary(path: Path) -> str | None:
    """The label vocabulary ``cellpath references build`` recorded in the file (``uns["reference"]``)."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            value = handle["uns/reference/label_vocabulary"][()]
    except (OSError, KeyError, TypeError):
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _cellvit_check(section: ManifestSection, run: _Run) -> Check:
    from cellpath.concordance.cellvit import find_cellvit_output

    root, folder = run.root, run.params.concordance.cellvit_dir
    if folder is None:
        if run.paper:
            return Check("built-in", CHECK, "run CellViT++ on the registered H&E images and set "
                                            "concordance.cellvit_dir (the paper's detector)")
        return Check("built-in")
    if not (root / folder).is_dir():
        return Check("no folder", MISSING, f"set concordance.cellvit_dir to the folder CellViT++ wrote (--outdir); "
                                           f"{folder} does not exist")
    try:
        find_cellvit_output(root / folder, section.section_id, wsi_name=section.he_image_name)
    except CellPathError as exc:
        if "several" in str(exc):
            return Check("ambiguous", MISSING, str(exc))
        return Check("missing", MISSING, f"run CellViT++ on {section.he_image_name} (output into {folder})")
    return Check("found")


COLUMNS = ("section", "host", "URLs b/H&E/align", "sums b/H&E/align", "downloaded", "reference", "h5ad", "labels",
           "CellViT++", "status")
LEGEND = ("URLs: seen (with a source in the manifest), derived (10x's naming, never requested), none. "
          "sums: published M md5, S sha256, B size in bytes; L size and digests in the download lock (first use); "
          "- none yet (the first download records them). "
          "Read from the manifest and local files; nothing was checked online.")


def _status(section: SectionReadiness) -> str:
    if not section.ready:
        return "not ready"
    return "ready, check" if section.actions(CHECK) else "ready"


def _row(section: SectionReadiness) -> tuple[str, ...]:
    return (section.section_id, section.host, section.downloads.cell, section.sums, section.local,
            section.reference, section.reference_file.cell, section.labels.cell, section.cellvit.cell,
            _status(section))


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _grouped(sections: Iterable[SectionReadiness], level: str) -> list[str]:
    """Each distinct action once, with the sections it concerns."""
    by_action: dict[str, list[str]] = {}
    for section in sections:
        for action in section.actions(level):
            by_action.setdefault(action, []).append(section.section_id)
    return [f"  - {action}\n      for: {', '.join(ids)}" for action, ids in by_action.items()]


def summary_line(report: PanelReadiness) -> str:
    """``N of M sections ready`` and what else stands in the way."""
    ready = sum(s.ready for s in report.sections)
    to_check = sum(s.ready and bool(s.actions(CHECK)) for s in report.sections)
    parts = [f"{ready} of {len(report.sections)} sections ready"]
    if to_check:
        parts.append(f"{to_check} with something to check")
    if report.problems:
        parts.append(f"{len(report.problems)} other problem(s)")
    verdict = "the panel is ready" if report.ready else "the panel is not ready"
    return f"{'; '.join(parts)}: {verdict}"


def verification_line(report: PanelReadiness) -> str:
    """How the panel's files are checked: counts by published checksum, first use, not yet downloaded."""
    counts = dict(report.verification)
    total = sum(counts.values())
    return (f"Checksums of the {total} files: {counts[PUBLISHED]} verified by a published checksum, "
            f"{counts[FIRST_USE]} verified by first use ({report.lock}), {counts[NOT_YET]} not yet downloaded "
            "(their first download records them in the lock; every later one must match).")


def render(report: PanelReadiness) -> str:
    """The table, the actions (blocking, then to check), the other problems and the summary line."""
    lines = [f"Readiness of {report.title}"]
    if report.mirror is not None:
        lines.append(f"Downloads from tenx.mirror {report.mirror}, not from 10x.")
    if report.sections:
        lines += ["", *_table([COLUMNS, *(_row(s) for s in report.sections)]), "", LEGEND]
    blocking = _grouped(report.sections, MISSING)
    if blocking:
        lines += ["", "To do (each once, for the sections it names):", *blocking]
    checks = _grouped(report.sections, CHECK)
    if checks:
        lines += ["", "To check (not blocking):", *checks]
    if report.problems:
        lines += ["", "Other problems:", *(f"  - {problem}" for problem in report.problems)]
    if report.verification:
        lines += ["", verification_line(report)]
    if report.notes:
        lines += ["", "Notes:", *(f"  - {note}" for note in report.notes)]
    return "\n".join([*lines, "", summary_line(report)])
