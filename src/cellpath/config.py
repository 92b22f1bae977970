"""params.yaml → typed, validated configuration objects.

The file is read and validated once (``load_params``); stages receive the resulting objects, never
raw dictionaries. Every validation failure becomes one :class:`ConfigError` that names the key path
(e.g. ``synthetic.sections[2].organ``), what was wrong and the allowed values.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from cellpath.errors import ConfigError, Problem
from cellpath.io.layout import DEFAULT_MANIFEST
from cellpath.io.text import NotUtf8, read_utf8
from cellpath.vocabulary import (DEFAULT_XENIUM_LAYOUT, MAGNIFICATIONS, PAPER_MIN_TEST_CELLS, PAPER_MIN_TRAIN_CELLS,
                                 PAPER_MOCV_FOLDS, PAPER_SEEDS, PROTOCOLS, READOUTS, REFERENCE_COUNT_SOURCE_PATTERN,
                                 MagnificationName, ProtocolChoice, ProtocolName, ReadoutName, TaxonomyName,
                                 XeniumLayoutName)

# Organs the simulator has tissue programs for, and the statuses each one can be simulated with.
SIMULATED_ORGAN_STATUSES: dict[str, tuple[str, ...]] = {
    "Breast": ("Breast cancer", "Normal"),
    "Colon": ("Colorectal cancer", "Normal"),
    "Lung": ("Lung cancer", "Normal"),
    "Liver": ("Liver cancer", "Normal"),
    "Skin": ("Melanoma", "Normal"),
    "Lymphoid": ("Lymphoid hyperplasia",),
}

SECTION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


#: Numbers and switches as YAML writes them, nothing coerced: ``true`` is no integer, ``3.0`` or ``"3"`` no
#: count, ``.inf`` and ``.nan`` no number (pydantic's lax mode takes each of them silently).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Bool = Annotated[bool, Strict()]


#: Where each tool reads a secret instead, for the message that refuses one inside a URL.
CREDENTIAL_PLACES = ("MLflow reads MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
                     "from the environment, a PostgreSQL store PGPASSWORD or ~/.pgpass, and a DVC remote its "
                     "credentials from `dvc remote modify --local`")
_URL_SECRET = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#@\s]*:[^/?#@\s]*@|[?&](password|passwd|token|secret|"
                         r"access_token|api_key|x-amz-signature|sig)=", re.IGNORECASE)


def has_credentials(url: str) -> bool:
    """Whether a URL carries a secret: a password in its user part, or a token or signature in its query."""
    return bool(_URL_SECRET.search(url))


def _without_credentials(url: str | None) -> str | None:
    if url is not None and has_credentials(url):
        raise ValueError(f"holds a password or token, which would be copied into dvc.lock, MLflow's params and "
                         f"logs; leave it out of the URL: {CREDENTIAL_PLACES}")
    return url


NoSecrets = AfterValidator(_without_credentials)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimulatedSection(_Strict):
    """One simulated tissue section. Unset quality knobs are drawn from the panel-wide ranges."""

    section_id: Annotated[str, Field(pattern=SECTION_ID_PATTERN)]
    organ: Literal["Breast", "Colon", "Lung", "Liver", "Skin", "Lymphoid"]
    status: str
    n_cells: Annotated[Int, Field(ge=50, le=2_000_000)] | None = None
    registration_jitter_um: Annotated[Float, Field(ge=0.0, le=20.0)] | None = None
    morphology_strength: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    #: which vintage of the Xenium bundle to write (cellpath.io.xenium.LAYOUTS); ingest reads them all
    xenium_layout: XeniumLayoutName = DEFAULT_XENIUM_LAYOUT
    #: the H&E's pose against the Xenium frame: "scanner" (rotated 2-8°, at synthetic.he_mpp), or "any" (any
    #: rotation, mirrored half the time, scanned at he_mpp × 0.9-1.1), as a lab's own scan (docs/decisions/0051)
    he_pose: Literal["scanner", "any"] = "scanner"
    #: write 10x's he_imagealignment.csv; without it ingest registers the section (the true matrix is kept in
    #: simulation.json)
    alignment_file: bool = True
    #: section.json's "registration" where there is an alignment file: "given" (used as it is), "propose" (ingest
    #: registers the section too and records both, placing with the given one) or "accept" (placing with the
    #: registered one)
    registration: Literal["given", "propose", "accept"] = "given"

    @model_validator(mode="after")
    def _status_matches_organ(self) -> "SimulatedSection":
        allowed = SIMULATED_ORGAN_STATUSES[self.organ]
        if self.status not in allowed:
            raise ValueError(
                f"status {self.status!r} is not simulated for organ {self.organ!r}; "
                f"allowed: {', '.join(repr(s) for s in allowed)}"
            )
        return self


def _ordered_pair(lo_hi: tuple[float, float]) -> tuple[float, float]:
    if lo_hi[0] > lo_hi[1]:
        raise ValueError("range must be [low, high] with low <= high")
    return lo_hi


JitterRange = Annotated[
    tuple[Annotated[Float, Field(ge=0.0, le=20.0)], Annotated[Float, Field(ge=0.0, le=20.0)]],
    AfterValidator(_ordered_pair),
]
UnitRange = Annotated[
    tuple[Annotated[Float, Field(ge=0.0, le=1.0)], Annotated[Float, Field(ge=0.0, le=1.0)]],
    AfterValidator(_ordered_pair),
]


class SyntheticConfig(_Strict):
    """The embedded default: a seeded simulator writing real Xenium + H&E file formats."""

    cells_per_section: Annotated[Int, Field(ge=50, le=2_000_000)] = 3000
    he_mpp: Annotated[Float, Field(gt=0.1, le=2.0)] = 0.2738
    panel_genes: Annotated[Int, Field(ge=150, le=5000)] = 300
    reference_cells_per_type: Annotated[Int, Field(ge=20, le=20_000)] = 150
    registration_jitter_um: JitterRange = (1.0, 3.0)
    morphology_strength: UnitRange = (0.75, 1.0)
    stain_variation: Annotated[Float, Field(ge=0.0, le=3.0)] = 1.0
    #: strength of the within-type proliferation program (cellpath.simulation.expression), in the
    #: sections and the references alike: 0 = none, the panel exactly as simulated without it (the default
    #: run's params.yaml sets 1)
    proliferation: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.0
    #: the sections to simulate: a list, or in params.yaml the path of a YAML file holding that list
    #: (relative to the working directory, like every path in params; read by :func:`params_problems`)
    sections: Annotated[list[SimulatedSection], Field(min_length=1)]

    @model_validator(mode="after")
    def _check(self) -> "SyntheticConfig":
        ids = [s.section_id for s in self.sections]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"section_id must be unique; repeated: {', '.join(dupes)}")
        return self


class TenxConfig(_Strict):
    """The real path: 10x Genomics Xenium bundles listed in a manifest with per-file URLs."""

    manifest: Path = DEFAULT_MANIFEST
    #: each file's size and digests as first downloaded (trust on first use; cellpath.sources.lock), to commit;
    #: None: beside the manifest, <manifest name>.lock.csv
    lock: Path | None = None
    sections: list[Annotated[str, Field(pattern=SECTION_ID_PATTERN)]] = []
    retries: Annotated[Int, Field(ge=0, le=20)] = 3
    timeout_s: Annotated[Float, Field(gt=0, le=3600)] = 60.0
    max_file_bytes: Annotated[Int, Field(gt=0, le=2**50)] = 200 * 1024**3  # ≤ 1 PiB
    #: a copy of 10x's files laid out as <XOA version>/<Name>/<file>: an http(s):// or file:// base URL,
    #: or a folder (relative to the project); it replaces each URL's root up to /samples/xenium/
    mirror: Annotated[Annotated[str, Field(min_length=1)] | None, NoSecrets] = None

    @property
    def lock_file(self) -> Path:
        """The download lock: ``lock``, else beside the manifest, ``xenium_datasets.csv`` →
        ``xenium_datasets.lock.csv`` (relative paths from the project root)."""
        return self.lock if self.lock is not None else self.manifest.with_name(f"{self.manifest.stem}.lock.csv")

    @model_validator(mode="after")
    def _mirror_scheme(self) -> "TenxConfig":
        scheme, separator, _ = (self.mirror or "").partition("://")
        if separator and scheme not in ("http", "https", "file"):
            raise ValueError(f"mirror {self.mirror!r} must be an http://, https:// or file:// URL, or a folder path")
        return self


class AnnotateConfig(_Strict):
    """Reference-guided label transfer, eligibility and marker QC (the ``annotate`` stage)."""

    references: dict[Annotated[str, Field(pattern=SECTION_ID_PATTERN)], str] = {}
    label_column: str = "cell_type"
    label_vocabulary: str | None = None
    #: where each reference keeps its raw counts: auto (layers["counts"], else X), X, raw, layers/<name>
    reference_counts: Annotated[str, Field(pattern=REFERENCE_COUNT_SOURCE_PATTERN)] = "auto"
    #: the var column holding gene symbols; None: var_names, or when they are Ensembl ids the first of
    #: feature_name / gene_symbols / gene_symbol (genes sharing a symbol are summed)
    gene_symbols: Annotated[str, Field(min_length=1)] | None = None
    regularisation_c: Annotated[Float, Field(gt=0.0, le=1e4)] = 5.0
    confidence_threshold: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.4
    min_shared_genes: Annotated[Int, Field(ge=1, le=100_000)] = 20
    min_cells_per_coarse_class: Annotated[Int, Field(ge=1, le=10_000_000)] = 10
    marker_min_cells: Annotated[Int, Field(ge=2, le=10_000_000)] = 10
    marker_min_log_fold_change: Annotated[Float, Field(ge=0.0, le=100.0)] = 0.25
    #: reference coverage (annotation/coverage.py): a cell whose smoothed profile correlates below
    #: this with every reference type is unmatched; a section with a larger unmatched share is flagged
    coverage_min_similarity: Annotated[Float, Field(ge=-1.0, le=1.0)] = 0.15
    coverage_max_unmatched: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.15
    coverage_neighbours: Annotated[Int, Field(ge=1, le=200)] = 15
    coverage_max_cells: Annotated[Int, Field(ge=100, le=100_000_000)] = 20000


class ConcordanceConfig(_Strict):
    """Morphology-annotation concordance and the nested panels (the ``concordance`` stage)."""

    cellvit_dir: Path | None = None  # CellViT++ output folder; None = the built-in detector
    max_match_distance_um: Annotated[Float, Field(gt=0.0, le=50.0)] = 4.0
    panel_sizes: Annotated[list[Annotated[Int, Field(ge=1, le=10_000)]], Field(min_length=1)] = [6, 8, 10, 12]
    #: registration QC (concordance/registration.py, docs/decisions/0037): nuclei are matched within this
    #: radius (µm, wider than max_match_distance_um, which would truncate the distances measured) ...
    registration_radius_um: Annotated[Float, Field(gt=0.0, le=50.0)] = 10.0
    #: ... and a section is flagged (informational) when the median or the 90th percentile of the matched
    #: H&E-to-Xenium distances exceeds these (µm)
    registration_max_median_um: Annotated[Float, Field(gt=0.0, le=50.0)] = 2.7
    registration_max_p90_um: Annotated[Float, Field(gt=0.0, le=50.0)] = 4.7

    @model_validator(mode="after")
    def _increasing(self) -> "ConcordanceConfig":
        if sorted(set(self.panel_sizes)) != list(self.panel_sizes):
            raise ValueError("panel_sizes must be distinct and increasing, e.g. [10, 15, 20, 25]")
        return self

    @model_validator(mode="after")
    def _registration_radius_covers_the_match_cap(self) -> "ConcordanceConfig":
        if self.registration_radius_um < self.max_match_distance_um:
            raise ValueError(f"registration_radius_um ({self.registration_radius_um} µm) must be at least "
                             f"max_match_distance_um ({self.max_match_distance_um} µm): a smaller radius truncates "
                             "the distances registration QC measures")
        return self


class ExtractConfig(_Strict):
    """Frozen-encoder feature extraction (the ``extract`` stage, a DVC matrix encoder × magnification)."""

    encoders: Annotated[list[str], Field(min_length=1)] = ["random-vit-t16", "filterbank-dense"]
    magnifications: Annotated[list[MagnificationName], Field(min_length=1)] = list(MAGNIFICATIONS)
    registry: Path = Path("models/encoders.yaml")
    weights_dir: Path = Path("models")
    batch_size: Annotated[Int, Field(ge=1, le=4096)] = 32
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: Annotated[Int, Field(ge=0, le=256)] = 0  # 0: torch's default
    patch_cache: Bool = True  # share read patches between encoders (data/.work/patches; results unchanged)




class ClassGate(_Strict):
    """Minimum training and test cells for a class to be scored in a unit (per taxonomy)."""

    fine: Annotated[Int, Field(ge=1, le=10_000_000)]
    coarse: Annotated[Int, Field(ge=1, le=10_000_000)]


class ProbeConfig(_Strict):
    """Linear probes under the four protocols (the ``probe`` stage). Paper values in comments."""

    taxonomies: Annotated[list[TaxonomyName], Field(min_length=1)] = ["fine", "coarse"]
    readouts: Annotated[list[ReadoutName], Field(min_length=1)] = list(READOUTS)
    magnifications: list[MagnificationName] | None = None  # None: every extract.magnifications
    seeds: dict[ProtocolName, Annotated[Int, Field(ge=1, le=100)]] = dict(PAPER_SEEDS)
    mocv_folds: Annotated[Int, Field(ge=2, le=50)] = PAPER_MOCV_FOLDS
    is_roi_fraction: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.5
    is_buffer_um: Annotated[Float, Field(ge=0.0, le=5000.0)] = 25.0
    val_fraction: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.2
    min_train_cells: ClassGate = ClassGate(**PAPER_MIN_TRAIN_CELLS)
    min_test_cells: ClassGate = ClassGate(**PAPER_MIN_TEST_CELLS)
    max_train_cells: Annotated[Int, Field(ge=10, le=100_000_000)] | None = None  # None: every training cell (the paper)
    c_grid: Annotated[list[Annotated[Float, Field(gt=0.0, le=1e6)]], Field(min_length=1)] = [0.01, 0.1, 1.0, 10.0]
    max_iter: Annotated[Int, Field(ge=1, le=100_000)] = 10000 # L-BFGS iterations per (run, C) fit
    tol: Annotated[Float, Field(gt=0.0, le=1e-2)] = 1e-8  # converged: largest |gradient entry| ≤ tol (sklearn's tol)
    #: design memory of one group of probe fits (MiB): tasks are grouped within it and a group is held within
    #: it, else stored once in a file in TMPDIR and streamed from there (the same result). "auto": grouped
    #: within 1,024 MiB on any machine, held within half the worker's available memory when the fits start
    batch_memory_mb: Annotated[Int, Field(ge=16, le=1_000_000)] | Literal["auto"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: Annotated[Int, Field(ge=0, le=256)] = 0  # 0: torch's default
    #: per fitted IS run, the misclassified test cells kept with the highest predicted-class probability
    #: (probe/is_errors.parquet, the failure gallery's second list); 0 keeps none
    is_errors: Annotated[Int, Field(ge=0, le=100_000)] = 50

    @model_validator(mode="after")
    def _every_protocol_has_seeds(self) -> "ProbeConfig":
        missing = [p for p in PROTOCOLS if p not in self.seeds]
        if missing:
            raise ValueError(f"seeds needs a count for every protocol; missing: {', '.join(missing)}")
        return self


class ExpressionConfig(_Strict):
    """Label-free expression probes (the ``expression`` stage): ridge regression of each cell's measured
    expression on its features, under the type probes' protocols, units, seeds and training cap
    (``probe``); docs/decisions/0049."""

    genes: Annotated[Int, Field(ge=1, le=10_000)] = 50  # per probe run, the most variable genes of its training cells
    min_counts: Annotated[Int, Field(ge=0, le=1_000_000)] = 10  # cells with fewer transcripts are excluded (counted)
    #: ridge penalties per training cell (alpha = lambda · n_train), strictly ascending; chosen per gene on validation
    penalties: Annotated[list[Annotated[Float, Field(gt=0.0, le=1e6)]], Field(min_length=1)] = \
        [1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0]
    readouts: Annotated[list[ReadoutName], Field(min_length=1)] = ["Nuc", "Mean"]
    magnifications: list[MagnificationName] | None = None  # None: every extract.magnifications entry
    device: Literal["cpu", "cuda"] = "cpu"
    read_rows: Annotated[Int, Field(ge=1024, le=10_000_000)] = 16384  # feature rows read at a time (memory only)

    @model_validator(mode="after")
    def _penalties_ascend(self) -> "ExpressionConfig":
        if any(b <= a for a, b in zip(self.penalties, self.penalties[1:])):
            raise ValueError(f"penalties must be strictly ascending, got {self.penalties}")
        return self


class ShortcutConfig(_Strict):
    """The confounder-biased shortcut probe (APD, nIPD) on one readout and taxonomy per encoder."""

    enabled: Bool = True
    readout: ReadoutName = "Nuc"
    taxonomy: TaxonomyName = "coarse"
    confounder: Literal["section_id", "organ"] = "section_id"  # the acquisition batch, as CRoMa's
    # The confounder levels the probe trains on, in order: level i is aligned with the i-th class (sorted) as V -> 1.
    # None: every level but the last `held_out` (sorted). Levels not trained on are the held-out setting.
    train_levels: Annotated[list[str], Field(min_length=2)] | None = None
    held_out: Annotated[Int, Field(ge=0, le=10_000)] | None = None     # with train_levels None: levels never trained on (None: 1)
    pool_size: Annotated[Int, Field(ge=4, le=100_000_000)] = 600            # training + validation cells at every V
    n_runs: Annotated[Int, Field(ge=1, le=100)] = 20        # resampling runs (the paper's 20)

    @property
    def held_out_levels(self) -> int:
        """How many sorted levels are held out when ``train_levels`` is None."""
        return 1 if self.held_out is None else self.held_out

    @model_validator(mode="after")
    def _one_way_to_choose_levels(self) -> "ShortcutConfig":
        if self.train_levels is not None and self.held_out is not None:
            raise ValueError("set either train_levels (the levels trained on) or held_out (how many sorted levels are "
                             "not), not both")
        if self.train_levels is not None and len(set(self.train_levels)) != len(self.train_levels):
            raise ValueError(f"train_levels repeats a level: {self.train_levels}")
        return self


class SensitivityConfig(_Strict):
    """Optional sweeps of CRoMa's m and LTM's alpha (the CRoMa paper's Tables S1, S2): how much the model ranking
    depends on them. Off by default."""

    alphas: list[Annotated[Float, Field(gt=0.0, le=1.0)]] = []  # LTM tail fractions; the paper: 0.05, 0.10, 0.20
    m_max: Annotated[Int, Field(ge=2, le=100)] | None = None    # every integer m in [1, m_max]; the paper: 20


class RobustnessConfig(_Strict):
    """CRoMa, F(0), LTM, RI, MaRI and k-NN probes per encoder (the ``robustness`` stage)."""

    taxonomies: Annotated[list[TaxonomyName], Field(min_length=1)] = ["fine", "coarse"]
    readouts: Annotated[list[ReadoutName], Field(min_length=1)] = ["Nuc", "Mean"]
    magnifications: list[MagnificationName] | None = None  # None: every extract.magnifications
    confounder: Literal["section_id", "organ"] = "section_id"  # the acquisition batch a cell came from
    scopes: Annotated[list[Literal["panel", "organ"]], Field(min_length=1)] = ["panel"]  # organ: within each organ
    group: Literal["patch", "tile"] = "patch"  # never a neighbour of itself: the encoder patch, or a spatial tile
    tile_um: Annotated[Float, Field(gt=0.0, le=10_000.0)] = 56.0  # tile side when group is "tile"
    m: Annotated[Int, Field(ge=1, le=100)] = 5       # typed neighbours averaged per CRoMa margin
    alpha: Annotated[Float, Field(gt=0.0, le=1.0)] = 0.10  # LTM tail fraction
    k: Annotated[Int, Field(ge=1, le=10_000)] | None = None     # None: the paper's k selection (lower median of per-model k*)
    low_margin_fraction: Annotated[Float, Field(gt=0.0, le=1.0)] = 0.10
    #: above this many cells in a scoring unit, score a stratified sample of anchors (robustness/sampling.py)
    full_max_cells: Annotated[Int, Field(ge=100, le=100_000_000)] = 100_000
    anchors: Annotated[Int, Field(ge=100, le=100_000_000)] = 20_000   # anchors per unit above full_max_cells
    bootstrap: Annotated[Int, Field(ge=20, le=10_000)] = 200  # stratified resamples for the anchors' intervals
    #: MiB for one chunk of candidates read from the store at a time (changes no number; memory only)
    batch_memory_mb: Annotated[Int, Field(ge=16, le=1_000_000)] = 1024
    shortcut: ShortcutConfig = ShortcutConfig()
    sensitivity: SensitivityConfig = SensitivityConfig()


class ReportConfig(_Strict):
    """The HTML report (``report`` stage)."""

    title: Annotated[str, Field(min_length=1)] = "CellPath-Bench report"
    thumbnails: Annotated[Int, Field(ge=0, le=50)] = 3  # H&E crops in the data section (best-ranked sections)
    thumbnail_um: Annotated[Float, Field(gt=0.0, le=5_000.0)] = 250.0  # crop side, µm
    thumbnail_mpp: Annotated[Float, Field(gt=0.0, le=50.0)] = 1.0     # crop resolution, µm/px


class GalleryConfig(_Strict):
    """The failure gallery (``gallery`` stage): a page per model of its worst-represented cells."""

    cells: Annotated[Int, Field(ge=1, le=200)] = 12  # per list: lowest CRoMa margins, most confident IS errors
    crop_um: Annotated[Float, Field(gt=0.0, le=500.0)] = 40.0  # crop side around the nucleus, µm


#: Dask protocols that authenticate and encrypt (certificates in Dask's configuration, distributed.comm.tls.*)
ENCRYPTED_DASK_PROTOCOLS = ("tls", "wss")
LOOPBACK_HOSTS = re.compile(r"^(127(\.\d{1,3}){3}|localhost|\[::1\]|::1)$")


def _scheduler_address(address: str) -> str:
    match = re.fullmatch(r"([a-z][a-z0-9+.-]*)://(\[[^\]]+\]|[^:/\s]+)(\S*)", address)
    if match is None:
        raise ValueError("expected a Dask scheduler address with its protocol, e.g. tls://10.0.0.5:8786")
    protocol, host = match.group(1), match.group(2)
    if protocol not in ENCRYPTED_DASK_PROTOCOLS and not LOOPBACK_HOSTS.match(host):
        raise ValueError(f"a {protocol}:// scheduler takes unauthenticated connections: anyone who reaches {host} can "
                         "run code as you on its workers. Use a tls:// scheduler, with its certificates in Dask's "
                         "configuration (distributed.comm.tls.ca-file, .client.cert, .client.key; docs/scaling.md), "
                         f"or reach it through an SSH tunnel at {protocol}://127.0.0.1:<port>")
    return address


class ExecutorConfig(_Strict):
    """Where the extract, probe and robustness stages run their tasks. Never changes a result, so it
    is not a DVC parameter of any stage: switching executors does not invalidate cached stages."""

    backend: Literal["local", "dask"] = "local"
    workers: Annotated[Int, Field(ge=1, le=10_000)] = 1  # local: processes (1 = in this process); dask: workers/jobs
    address: Annotated[str, AfterValidator(_scheduler_address), NoSecrets] | None = None  # an existing Dask scheduler
    cluster: Literal["local", "slurm"] = "local"  # dask without an address: a LocalCluster or a SLURMCluster
    slurm: dict[str, Any] = {}  # dask_jobqueue.SLURMCluster keyword arguments (queue, cores, memory, walltime, ...)
    # dask: seconds to wait for a first worker, and for one to come back when every worker is gone
    startup_timeout_s: Annotated[Float, Field(gt=0, le=7 * 86_400)] = 600.0
    #: dask: where the scheduler's dashboard (no authentication) listens, host:port (port 0: any free one);
    #: loopback unless you ask (reach it with ssh -L)
    dashboard_address: Annotated[str, Field(pattern=r"^\S+:\d+$")] = "127.0.0.1:0"

    @model_validator(mode="after")
    def _dask_settings_need_dask(self) -> "ExecutorConfig":
        if self.backend == "local" and (self.address is not None or self.cluster != "local"):
            raise ValueError("address and cluster: slurm are Dask settings; set backend: dask to use them")
        return self


class MlflowConfig(_Strict):
    """Where probe and robustness results are tracked. Relative paths are from the project root."""

    enabled: Bool = True
    tracking_uri: Annotated[str, NoSecrets] = "sqlite:///mlflow.db"  # any MLflow URI: sqlite:///…, http://host:5000, file:…
    artifact_location: Annotated[str, NoSecrets] = "mlartifacts"     # used when the experiment is created
    experiment: Annotated[str, Field(min_length=1)] = "cellpath"


class Params(_Strict):
    """Top level of params.yaml."""

    source: Literal["synthetic", "10x"] = "synthetic"
    seed: Annotated[Int, Field(ge=0, le=2**31 - 1)] = 0
    synthetic: SyntheticConfig
    tenx: TenxConfig = TenxConfig()
    annotate: AnnotateConfig = AnnotateConfig()
    concordance: ConcordanceConfig = ConcordanceConfig()
    panel: Annotated[str, Field(pattern=r"^S[0-9]+$")] = "S12"
    extract: ExtractConfig = ExtractConfig()
    protocol: ProtocolChoice = "all"
    probe: ProbeConfig = ProbeConfig()
    expression: ExpressionConfig = ExpressionConfig()
    robustness: RobustnessConfig = RobustnessConfig()
    report: ReportConfig = ReportConfig()
    gallery: GalleryConfig = GalleryConfig()
    mlflow: MlflowConfig = MlflowConfig()
    executor: ExecutorConfig = ExecutorConfig()

    @property
    def protocols(self) -> tuple[str, ...]:
        """The protocols the probe stage runs (``protocol: all`` → all four, in the paper's order)."""
        return PROTOCOLS if self.protocol == "all" else (self.protocol,)

    def stage_magnifications(self, chosen: list[str] | None) -> list[str]:
        """A stage's magnifications: ``chosen`` (validated ⊆ extract.magnifications) or all extracted."""
        return list(chosen or self.extract.magnifications)

    @model_validator(mode="after")
    def _stage_magnifications_are_extracted(self) -> "Params":
        for stage, chosen in (("probe", self.probe.magnifications), ("expression", self.expression.magnifications),
                              ("robustness", self.robustness.magnifications)):
            missing = [m for m in chosen or [] if m not in self.extract.magnifications]
            if missing:
                raise ValueError(f"{stage}.magnifications: {', '.join(missing)} not in extract.magnifications "
                                 f"({', '.join(self.extract.magnifications)})")
        return self

    @model_validator(mode="after")
    def _panel_is_built(self) -> "Params":
        built = [f"S{size}" for size in self.concordance.panel_sizes]
        if self.panel not in built:
            raise ValueError(f"panel {self.panel!r} is not one of the panels concordance builds: "
                             f"{', '.join(built)} (set concordance.panel_sizes)")
        return self


def _key_path(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """A pydantic error location less its internal union / validator branch names (not user keys)."""
    internal = r"(function-after|literal|tuple|list)\[.*\]|int|float|none|str"
    return tuple(part for part in loc if isinstance(part, int) or not re.fullmatch(internal, str(part)))


def _format_location(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in _key_path(loc):
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _problem(err: dict, source: str) -> Problem:
    key = _format_location(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(tuple(err["loc"][:-1]))
        match = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1, cutoff=0.6)
        hint = f"did you mean `{match[0]}`? " if match else ""
        return Problem(f"{source}: unknown key `{key}`", f"{hint}allowed keys here: {', '.join(allowed)}")
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = f" (got {value!r})" if not isinstance(value, (dict, list)) or len(repr(value)) < 60 else ""
    if isinstance(value, str) and has_credentials(value):
        shown = ""  # never echo a secret into the terminal or a log
    fix = TYPE_FIXES.get(err["type"], "")
    return Problem(f"{source}: key `{key}`", f"{msg}{shown}{fix}")


#: What to write instead, for the strict types' refusals (:data:`Int`, :data:`Float`, :data:`Bool`).
TYPE_FIXES = {"int_type": "; write a whole number, without quotes or a decimal point (true/false are not numbers)",
              "float_type": "; write a number, without quotes (true/false are not numbers)",
              "finite_number": "; write a finite number (.inf and .nan are not allowed)",
              "bool_type": "; write true or false"}


def _allowed_keys(parent_loc: tuple) -> list[str]:
    model: type[BaseModel] = Params
    for part in parent_loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            break
        annotation = field.annotation
        inner = getattr(annotation, "__args__", (annotation,))
        nested = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            break
        model = nested[0]
    return list(model.model_fields)


def _nested_model(annotation: object) -> type[BaseModel] | None:
    """The model a field holds (directly, optionally, or as list elements), else None."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        for inner in (candidate, *getattr(candidate, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _field_path(loc: tuple[str | int, ...], extra: bool) -> tuple[str | int, ...]:
    """The key path down to the deepest model field on ``loc`` (or to the unknown key itself):
    removing that key lets the field's default apply without inventing a value inside it."""
    path, model, keep = _key_path(loc), Params, 0
    for i, part in enumerate(path):
        if isinstance(part, int):
            continue  # a list element: the list's element model
        if model is None or part not in model.model_fields:
            keep = i + 1 if extra and i == len(path) - 1 else keep
            break
        keep, model = i + 1, _nested_model(model.model_fields[part].annotation)
    return path[:keep]


def _remove(data: dict, path: tuple[str | int, ...]) -> None:
    """Delete the key at ``path`` (nothing when an enclosing key is gone already)."""
    container = data
    for part in path[:-1]:
        try:
            container = container[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(container, dict):
        container.pop(path[-1], None)


SECTION_FILE_KEY = ("synthetic", "sections")


def _read_section_file(data: dict, source: str) -> tuple[Path | None, Problem | None]:
    """Replace a ``synthetic.sections`` path in ``data`` by the YAML list the file holds; return the
    file (None when the sections are listed inline) and the problem reading it, if any. A relative
    path is taken from the working directory (the project root), like every path in params."""
    synthetic = data.get("synthetic")
    if not isinstance(synthetic, dict) or not isinstance(synthetic.get("sections"), str):
        return None, None
    path = Path(synthetic["sections"])
    where = f"{source}: key `synthetic.sections`"
    if not path.is_file():
        return path, Problem(where, f"section file {path} not found (paths in params are relative to the project "
                                    "root: run from there); write the list there or inline it")
    try:
        listed = yaml.safe_load(read_utf8(path))
    except NotUtf8 as exc:
        return path, Problem(where, str(exc))
    except (OSError, yaml.YAMLError) as exc:
        return path, Problem(where, f"{path} is not readable YAML: {' '.join(str(exc).split())}")
    if not isinstance(listed, list):
        return path, Problem(where, f"{path} must hold a YAML list of sections ({{section_id, organ, status, "
                                    f"...}} each), found {type(listed).__name__}")
    synthetic["sections"] = listed
    return path, None


def params_problems(data: object, source: str = "params.yaml") -> tuple[Params | None, list[Problem]]:
    """Every schema problem of a parsed params mapping, and the Params the rest of it makes.

    Pydantic reports every field error of one pass, but a model's own checks run only once its
    fields are valid. So each pass's faulty fields are removed (their defaults apply) and the rest
    is validated again, until it validates (returned, for the checks that need Params) or a faulty
    field has no default (None). A field missing only because a pass removed it is not reported.
    A ``synthetic.sections`` path is read first; problems inside that file name it."""
    if not isinstance(data, dict):
        return None, [Problem(source, f"expected a mapping at the top level, got {type(data).__name__}")]
    remaining, problems, removed = copy.deepcopy(data), [], []
    section_file, problem = _read_section_file(remaining, source)
    if problem is not None:
        problems.append(problem)
        _remove(remaining, SECTION_FILE_KEY)
        removed.append(SECTION_FILE_KEY)
    while True:
        try:
            return Params.model_validate(remaining), problems
        except ValidationError as exc:
            repairable = True
            for err in exc.errors():
                path = _field_path(tuple(err["loc"]), extra=err["type"] == "extra_forbidden")
                if err["type"] == "missing" and any(path[:len(r)] == r for r in removed):
                    repairable = False  # required, and removed by an earlier pass: already reported
                    continue
                in_file = section_file is not None and tuple(err["loc"][:2]) == SECTION_FILE_KEY
                problems.append(_problem(err, f"{source} → {section_file}" if in_file else source))
                if not path or err["type"] == "missing":
                    repairable = False
                    continue
                _remove(remaining, path)
                removed.append(path)
            if not repairable:
                return None, problems


def parse_params(data: object, source: str = "params.yaml") -> Params:
    """Validate a parsed params mapping; raise one ConfigError listing every problem."""
    params, problems = params_problems(data, source)
    if problems or params is None:
        raise ConfigError("\n".join(map(str, problems)))
    return params


def load_params(path: Path | str = "params.yaml") -> Params:
    """Read and validate params.yaml (or another file with the same schema)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: parameter file not found; run from the project root or pass --params")
    try:
        data = yaml.safe_load(read_utf8(path))
    except NotUtf8 as exc:
        raise ConfigError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_params(data, source=str(path))
