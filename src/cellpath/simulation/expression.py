"""Simulated expression: marker programs per cell type, Xenium counts and scRNA-seq references.

Each ontology type has a mean-expression program over the gene panel: its primary markers high,
secondary markers moderate, a few random non-marker genes, and a shared background. Xenium counts
add segmentation spill-over from spatial neighbours and gamma–Poisson noise at Xenium depth; the
reference is drawn from the same programs with a platform effect per gene, higher depth, dropout
and a partly different gene set, so that label transfer is realistic rather than an identity copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.spatial import cKDTree

from cellpath.annotation.ontology import all_marker_genes, cell_types, genes_of

# Real gene symbols often found on Xenium panels that are not ontology markers: panel filler.
FILLER_GENES: tuple[str, ...] = (
    "ACTB", "ADGRE1", "ANKRD30A", "AR", "AREG", "BANK1", "BCL2", "BCL6", "BIRC5", "CCL19", "CCL5", "CCND1",
    "CCNB1", "CD247", "CD27", "CD274", "CD3D", "CD3G", "CD38", "CD52", "CD69", "CD80", "CD83", "CD86", "CD8B",
    "CDH11", "CDK1", "CEACAM6", "CENPF", "CLDN4", "CLEC10A", "CLEC14A", "CTSG", "CTTN", "CX3CL1", "CXCL13",
    "CXCL9", "CXCR4", "DST", "DUSP1", "EGFR", "EGR1", "ELF3", "EPHA2", "ERBB2", "ERBB3", "ESR1", "FASN",
    "FBLN1", "FCER1G", "FGFR1", "FGL2", "FN1", "FOS", "FOXA1", "GATA3", "GPR183", "GZMA", "GZMK", "HAVCR2",
    "HMGB2", "ICOS", "IGF1", "IL2RG", "ITGAM", "ITGB2", "JUN", "KLF5", "KRT15", "KRT16", "KRT17", "KRT23",
    "LAG3", "LGALS3", "LTB", "LY86", "MAP3K8", "MET", "MKI67IP", "MMP1", "MMP12", "MYC", "NDRG1", "NOTCH1",
    "NUSAP1", "OPRPN", "PDCD1", "PDGFB", "PGR", "PIGR", "PLA2G2A", "POLR2J3", "PTGDS", "PTN", "PTPRC",
    "RAMP2", "RUNX1", "S100A4", "S100A8", "S100A9", "SERPINA3", "SFRP1", "SFRP4", "SMS", "SNAI1", "SOX2",
    "SPP1", "SQLE", "STAT1", "TACSTD2", "TCF7", "TCIM", "TENT5C", "TIGIT", "TIMP3", "TPD52", "TRAC", "TUBB2B",
    "TWIST1", "UBE2C", "VEGFB", "WARS1", "ZEB1", "ZEB2", "ZNF562",
)
# Relative expression rates of the type programs (per gene, before scaling to a cell's depth).
BACKGROUND_RATE = 0.1
PRIMARY_MARKER_RATE = (0.7, 2.2)
SECONDARY_MARKER_RATE = (0.25, 0.8)
# The within-type program: proliferation, a continuous per-cell score p in [0, 1] drawn whatever the
# cell's type. Its genes (cell-cycle genes on real Xenium panels that are no ontology type's marker)
# are near silent in every type's program and gain p · PROLIFERATION_RATE each, above a primary
# marker's rate at p = 1, so that, as real cycling genes, they are among a panel's most variable.
# Nuclei grow and darken with p (cellpath.simulation.morphology.proliferating), so what the nucleus
# shows carries expression no type label can.
PROLIFERATION_GENES: tuple[str, ...] = ("BIRC5", "CCNB1", "CDK1", "CENPF", "HMGB2")
PROLIFERATION_RATE = 2.5
PROLIFERATION_BASE_RATE = 0.02     # the program's genes in every type's program (near silent without it)
PROLIFERATION_SHAPE = (0.35, 2.5)  # Beta(a, b) of the score: most cells near 0, a continuous tail of cycling ones
N_NEGATIVE_CONTROL_PROBES = 20
N_NEGATIVE_CONTROL_CODEWORDS = 20
N_UNASSIGNED_CODEWORDS = 10
COUNT_BLOCK_CELLS = 4096  # cells whose rates, noise and counts are held at once (× genes × 8 bytes each)


@dataclass(frozen=True)
class GenePanel:
    """Feature list of a Xenium panel: gene symbols, then control features (10x feature_type)."""

    genes: tuple[str, ...]
    controls: tuple[tuple[str, str], ...]  # (name, feature_type)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.genes + tuple(name for name, _ in self.controls)

    @property
    def feature_types(self) -> tuple[str, ...]:
        return ("Gene Expression",) * len(self.genes) + tuple(kind for _, kind in self.controls)


def build_panel(n_genes: int) -> GenePanel:
    """Every ontology marker gene, then filler genes (real, then numbered) up to ``n_genes``."""
    markers = all_marker_genes()
    if n_genes < len(markers):
        raise ValueError(f"panel_genes = {n_genes} is smaller than the {len(markers)} ontology marker genes")
    filler = [g for g in FILLER_GENES if g not in set(markers)]
    filler += [f"SIMGENE{i:04d}" for i in range(1, max(0, n_genes - len(markers) - len(filler)) + 1)]
    genes = tuple(markers) + tuple(filler[: n_genes - len(markers)])
    controls = (
        tuple((f"NegControlProbe_{i:05d}", "Negative Control Probe") for i in range(N_NEGATIVE_CONTROL_PROBES))
        + tuple((f"NegControlCodeword_{i:04d}", "Negative Control Codeword") for i in range(N_NEGATIVE_CONTROL_CODEWORDS))
        + tuple((f"UnassignedCodeword_{i:04d}", "Unassigned Codeword") for i in range(N_UNASSIGNED_CODEWORDS))
    )
    return GenePanel(genes, controls)


def type_programs(genes: tuple[str, ...], rng: np.random.Generator,
                  proliferation: float = 0.0) -> dict[str, np.ndarray]:
    """Mean expression (relative rate per gene) for every ontology type over ``genes``.

    Drawn from a fixed generator, so that one seed gives the same biology in every section and in
    the references. With the proliferation program on (``proliferation`` > 0) its genes are near
    silent in every type's program (``PROLIFERATION_BASE_RATE``); off, the programs are those of a
    simulator without it.
    """
    index = {g: i for i, g in enumerate(genes)}
    background = rng.lognormal(np.log(BACKGROUND_RATE), 0.6, len(genes))
    programs = {}
    marker_set = set(all_marker_genes())
    non_marker = np.array([i for g, i in index.items() if g not in marker_set])
    for t in cell_types():
        rate = background.copy()
        for g in genes_of(t.primary_markers):
            if g in index:
                rate[index[g]] += rng.uniform(*PRIMARY_MARKER_RATE)
        for g in genes_of(t.secondary_markers):
            if g in index:
                rate[index[g]] += rng.uniform(*SECONDARY_MARKER_RATE)
        if len(non_marker):
            extra = rng.choice(non_marker, size=min(8, len(non_marker)), replace=False)
            rate[extra] += rng.uniform(0.3, 1.5, len(extra))
        if t.is_qc_state:  # necrotic/apoptotic/mitotic: an attenuated epithelial-like program
            rate = 0.5 * rate
        programs[t.name] = rate
    silent = [index[g] for g in PROLIFERATION_GENES if g in index] if proliferation > 0 else []
    for rate in programs.values():  # cell-cycle genes are near silent outside cycling cells, whatever the type
        rate[silent] = PROLIFERATION_BASE_RATE
    return programs


def proliferation_scores(n_cells: int, strength: float, rng: np.random.Generator) -> np.ndarray:
    """Each cell's proliferation score p (n_cells,), Beta(``PROLIFERATION_SHAPE``) × ``strength``
    (0: no within-type program)."""
    return strength * rng.beta(*PROLIFERATION_SHAPE, n_cells)


def proliferation_rates(genes: tuple[str, ...]) -> np.ndarray:
    """Per gene of the panel, the rate a cell of score p = 1 gains: ``PROLIFERATION_RATE`` on the
    program's genes the panel has, 0 elsewhere."""
    return np.array([PROLIFERATION_RATE if g in PROLIFERATION_GENES else 0.0 for g in genes])


def xenium_counts(
    cell_type: np.ndarray,
    xy_um: np.ndarray,
    cell_area: np.ndarray,
    programs: dict[str, np.ndarray],
    panel: GenePanel,
    rng: np.random.Generator,
    depth: float = 110.0,
    spillover: float = 0.2,
    dispersion: float = 4.0,
    block_cells: int = COUNT_BLOCK_CELLS,
    proliferation: np.ndarray | None = None,
) -> sparse.csr_matrix:
    """Cells × features integer counts (genes then controls) for one Xenium section.

    depth: mean transcripts per cell; spillover: fraction of each cell's rate taken from its six
    nearest neighbours (segmentation bleed); dispersion: gamma shape of the biological noise;
    proliferation: each cell's score p (:func:`proliferation_scores`), whose rates
    (:func:`proliferation_rates`) are added to the cell's own after the spill-over.

    Computed ``block_cells`` cells at a time, so memory is one block's cells × genes, not the
    section's (at 283,171 cells × 5,000 genes the neighbour rates alone were 68 GB). The draws are the
    ones a whole-section computation makes, in its order: every gamma before every Poisson count.
    The gammas are drawn once to move ``rng`` past them and again, block by block, from a copy of
    its state; so the counts do not depend on ``block_cells``.
    """
    names = sorted(set(cell_type))
    program_rows = np.stack([programs[t] for t in names])
    type_index = np.searchsorted(np.asarray(names, dtype=object), cell_type)
    neighbours = cKDTree(xy_um).query(xy_um, k=7)[1][:, 1:] if spillover > 0 and len(xy_um) > 6 else None
    size = cell_area / np.mean(cell_area) * rng.lognormal(0.0, 0.3, len(cell_type))
    n_genes = program_rows.shape[1]
    within = None if proliferation is None else proliferation_rates(panel.genes)
    blocks = [slice(start, min(start + block_cells, len(cell_type))) for start in range(0, len(cell_type), block_cells)]
    gammas = np.random.Generator(type(rng.bit_generator)())
    gammas.bit_generator.state = rng.bit_generator.state
    for block in blocks:  # move rng past the gammas, as one (cells, genes) draw would
        rng.gamma(dispersion, 1.0 / dispersion, (block.stop - block.start, n_genes))
    gene_counts = []
    for block in blocks:
        rates = program_rows[type_index[block]]
        if neighbours is not None:
            rates = (1 - spillover) * rates + spillover * program_rows[type_index[neighbours[block]]].mean(axis=1)
        if within is not None:
            rates = rates + proliferation[block, None] * within[None, :]
        rates = rates / rates.sum(axis=1, keepdims=True) * (depth * size[block])[:, None]
        noise = gammas.gamma(dispersion, 1.0 / dispersion, rates.shape)
        gene_counts.append(sparse.csr_matrix(rng.poisson(rates * noise).astype(np.int32)))
    control_counts = sparse.csr_matrix(rng.poisson(0.004, (len(cell_type), len(panel.controls))).astype(np.int32))
    return sparse.hstack([sparse.vstack(gene_counts, format="csr"), control_counts], format="csr")


def reference_counts(
    cell_type: np.ndarray,
    programs: dict[str, np.ndarray],
    panel_genes: tuple[str, ...],
    rng: np.random.Generator,
    depth: float = 1500.0,
    dropped_fraction: float = 0.05,
    n_extra_genes: int = 60,
    donor_effect: float = 0.4,
    proliferation: np.ndarray | None = None,
) -> tuple[sparse.csr_matrix, tuple[str, ...]]:
    """scRNA-seq counts for reference cells and the reference's own gene list.

    The reference misses ``dropped_fraction`` of the panel genes (chosen among non-marker genes:
    a whole-transcriptome reference measures every marker; panel genes it lacks are typically
    naming mismatches of uncharacterised genes), measures ``n_extra_genes`` the panel lacks, has a per-gene platform capture bias, a per-type
    donor effect (lognormal, σ = ``donor_effect``: the reference comes from other patients),
    higher depth and dropout. ``proliferation``: each reference cell's score p, whose program rates
    (:func:`proliferation_rates`, through the same capture bias) are added to its type's — the
    reference's cycling cells are of every type, as in a real atlas.
    """
    markers = set(all_marker_genes())
    droppable = np.array([i for i, g in enumerate(panel_genes) if g not in markers], dtype=int)
    n_drop = min(int(round(dropped_fraction * len(panel_genes))), len(droppable))
    dropped = rng.choice(droppable, n_drop, replace=False) if n_drop else np.array([], dtype=int)
    keep = np.setdiff1d(np.arange(len(panel_genes)), dropped)
    extra = tuple(f"REFGENE{i:04d}" for i in range(1, n_extra_genes + 1))
    genes = tuple(panel_genes[i] for i in keep) + extra
    capture = rng.lognormal(0.0, 0.5, len(keep))
    donor = {t: rng.lognormal(0.0, donor_effect, len(keep)) for t in np.unique(cell_type)}
    extra_programs = {t: rng.lognormal(np.log(0.05), 1.0, n_extra_genes) for t in np.unique(cell_type)}
    rates = np.stack([np.concatenate([programs[t][keep] * donor[t] * capture, extra_programs[t]]) for t in cell_type])
    if proliferation is not None:
        rates[:, :len(keep)] += proliferation[:, None] * (proliferation_rates(panel_genes)[keep] * capture)[None, :]
    size = rng.lognormal(0.0, 0.45, len(cell_type))
    rates = rates / rates.sum(axis=1, keepdims=True) * (depth * size)[:, None]
    counts = rng.poisson(rates * rng.gamma(3.0, 1.0 / 3.0, rates.shape))
    dropout = rng.random(counts.shape) < rng.uniform(0.05, 0.3, len(genes))[None, :]
    counts[dropout] = 0
    return sparse.csr_matrix(counts.astype(np.int32)), genes
