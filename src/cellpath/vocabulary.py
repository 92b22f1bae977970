"""The project's vocabulary, defined once: protocols, readouts, taxonomies and magnifications.

The config's ``Literal`` types, the split code, the readout maths, the run counts and the report all
take their names from here.
"""

from __future__ import annotations

from typing import Literal, get_args

#: The four evaluation protocols (CellPath-Bench, Methods): in-section (IS), in-organ cross-domain
#: (IOCD), multi-organ cross-validation (MOCV), leave-one-organ-out (LOOO).
ProtocolName = Literal["is", "iocd", "mocv", "looo"]
PROTOCOLS: tuple[ProtocolName, ...] = get_args(ProtocolName)
#: The cross-domain protocols whose Tfine Nuc win counts average into CRT (Eq. 5).
CROSS_DOMAIN_PROTOCOLS: tuple[ProtocolName, ...] = ("iocd", "mocv", "looo")
PROTOCOL_LABELS: dict[str, str] = {"is": "IS", "iocd": "IOCD", "mocv": "MOCV", "looo": "LOOO"}
#: params.yaml's ``protocol``: one of them, or all four.
ProtocolChoice = Literal["all", "is", "iocd", "mocv", "looo"]
assert get_args(ProtocolChoice)[1:] == PROTOCOLS, "ProtocolChoice must list PROTOCOLS after 'all'"

#: Per-cell readouts: the nuclear token (Nuc), the patch mean (Mean), the CLS token (Cls), and their
#: sums (+) and concatenations (||).
ReadoutName = Literal["Nuc", "Mean", "Cls", "N+M", "N+C", "N||M", "N||C"]
READOUTS: tuple[ReadoutName, ...] = get_args(ReadoutName)
#: Readouts that need a CLS token (unavailable for encoders without one, and counted as such).
CLS_READOUTS: frozenset[str] = frozenset({"Cls", "N+C", "N||C"})

#: The two label taxonomies: 9-class Tfine and 3-class Tcoarse.
TaxonomyName = Literal["fine", "coarse"]
TAXONOMIES: tuple[TaxonomyName, ...] = get_args(TaxonomyName)
TAXONOMY_LABELS: dict[str, str] = {"fine": "Tfine", "coarse": "Tcoarse"}

#: The expression probes' run tables name their target set in the taxonomy column (their rows have the
#: type probes' condition keys, so the same statistics apply): each cell's measured expression.
EXPRESSION_TARGET = "expression"

#: Magnification labels and the target resolution each is read at (µm per pixel).
MagnificationName = Literal["40x", "20x", "10x"]
MAGNIFICATIONS: tuple[MagnificationName, ...] = get_args(MagnificationName)
MAGNIFICATION_MPP: dict[str, float] = {"40x": 0.25, "20x": 0.5, "10x": 1.0}

#: The headline condition: the paper's headline numbers, its wins and CRT are Tfine, Nuc, 20×.
HEADLINE_MAGNIFICATION: MagnificationName = "20x"
HEADLINE_TAXONOMY: TaxonomyName = "fine"
HEADLINE_READOUT: ReadoutName = "Nuc"

#: The paper's configuration (Table 3 and Supplementary C): the evaluated panel, its nested sizes,
#: the probe seeds per protocol, the MOCV folds and the class gates (cells per class, train / test).
PAPER_PANEL = "S25"
PAPER_PANEL_SIZES: tuple[int, ...] = (10, 15, 20, 25)
PAPER_SEEDS: dict[str, int] = {"is": 5, "iocd": 3, "mocv": 3, "looo": 3}
PAPER_MOCV_FOLDS = 5
PAPER_MIN_TRAIN_CELLS: dict[str, int] = {"fine": 500, "coarse": 100}
PAPER_MIN_TEST_CELLS: dict[str, int] = {"fine": 200, "coarse": 100}
#: The paper's balanced units on S25 (the n of each mean ± SD): 11 organs for IS and LOOO, the 9 organs
#: with two or more sections for IOCD, 5 folds for MOCV; and the units its cross-domain Wilcoxon tests
#: pair, each once per seed (Table 5's legend: 23 held-out sections for IOCD, 11 held-out organs for
#: LOOO; the 5 MOCV folds).
PAPER_BALANCED_UNITS: dict[str, int] = {"is": 11, "iocd": 9, "mocv": 5, "looo": 11}
PAPER_WILCOXON_UNITS: dict[str, int] = {"iocd": 23, "mocv": 5, "looo": 11}
#: The paper's models a placement re-runs beside the user's by default: the two cheapest public
#: checkpoints with a timm or transformers loader (21M and 86M parameters, ViT/16, no gated access).
PLACEMENT_ANCHORS: tuple[str, ...] = ("kaiko-vit-s-16", "phikon")

#: The configurations ``cellpath plan`` and ``cellpath validate`` take (``--preset``): the params as
#: they are, the paper's, or placement (the paper's, at the headline condition only, for the
#: encoders the user lists); the last two are on the paper's panel.
PRESETS = ("current", "paper", "placement")
PAPER_PANEL_PRESETS = ("paper", "placement")


def headline_magnification(magnifications: list[str]) -> str:
    """The magnification of the headline numbers and CRT: 20× (the paper's) when evaluated, else the first."""
    return HEADLINE_MAGNIFICATION if HEADLINE_MAGNIFICATION in magnifications else magnifications[0]

#: Where a scRNA-seq reference keeps its raw counts (``annotate.reference_counts``): ``auto``
#: (``layers["counts"]`` if present, else ``X``), ``X``, ``raw`` (``.raw.X`` with ``.raw.var_names``)
#: or ``layers/<name>``.
REFERENCE_COUNT_SOURCE_PATTERN = r"^(auto|X|raw|layers/[\w.-]+)$"

#: Vintages of the Xenium output bundle the simulator can write and ingest reads
#: (:data:`cellpath.io.xenium.LAYOUTS` says what each looks like and where that comes from).
XeniumLayoutName = Literal["xoa-1.0", "xoa-1.4", "xoa-1.9", "xoa-2.0", "xoa-3.0", "xenium-prime-5k",
                           "xenium-ranger-3.0"]
XENIUM_LAYOUTS: tuple[XeniumLayoutName, ...] = get_args(XeniumLayoutName)
DEFAULT_XENIUM_LAYOUT: XeniumLayoutName = "xoa-3.0"
