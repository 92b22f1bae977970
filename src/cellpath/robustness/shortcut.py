"""Downstream shortcut probe: a confounder-biased linear-probe sweep over Cramér's V, and its
reductions APD (PathoROB) and nIPD (CRoMa paper), matching ``croma.apd`` / ``croma.nipd``.

Design (after ``croma.downstream.probe`` / PathoROB): a logistic-regression probe predicts the
biology from frozen features. Its training pool (training + validation rows) has a fixed size and
fixed marginal class and confounder frequencies (see :func:`composition`); only the joint
composition moves, from independence (V = 0) to complete dependence (V = 1), the i-th training
confounder level (in the order given) paired with the i-th class (sorted). Each run fixes the test rows first,
then walks the V grid on nested prefixes of the same shuffled rows, so across V only the training
composition changes. Regularisation C is chosen from ``C_GRID`` (15 values, 1e-8..1e4) by
validation balanced accuracy (first best), then the probe is refitted on the training rows.
Accuracies are balanced accuracies: in domain (unseen groups of the training confounders, every
confounder x class cell weighted equally, :func:`cell_balanced_accuracy`) and held out (every row
of the confounders not trained on).
Features are used as given (no scaling), as in PathoROB.

Deviations from croma's sweep, on purpose:
* croma walks PathoROB's per-dataset slide schedules; here the composition is the linear family
  ``(1 - t) * independent + t * fully aligned`` at any requested V (Cramér's V of that table is
  exactly t; see :func:`composition`), which exists for any numbers of confounders and classes.
  For two centres x two classes and 7 slides per cell it is PathoROB's Camelyon schedule at
  V = split / 7 (class order swapped). When neither count divides the other, V = 1 forces
  unequal marginals on the shorter axis (they stay fixed across V).
* croma shuffles whole slides inside each (confounder, class) cell and cuts the test tail from the
  same cells. Here the unit kept whole is the *group* (patch / tile), which may span several
  classes, so the in-domain test rows are a random share of the groups (``test_fraction``), drawn
  before any training rows, and never shared with training or validation. Groups are taken in a
  random order, skipping any that would leave a cell short of the sweep's largest request for it:
  with cell types clustered in few patches, a plain draw can take most of a class's patches (see
  docs/decisions/0018). As the groups' test rows cannot be equal per cell, each cell is weighted
  equally in the in-domain accuracy instead (the same estimand).
* Validation rows are a ``validation_fraction`` share of each cell's pool rows (the paper's 10%
  of a fixed pool) rather than PathoROB's ``1 / max_train_slides`` extra rows.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy.integrate import trapezoid
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from cellpath.robustness.metrics import balanced_accuracy
from cellpath.robustness.neighbours import DEFAULT_CANDIDATE_ROWS, RowSource
from cellpath.robustness.validation import check_at_least_one, encode, feature_rows

#: Cramér's V values of the sweep: 0, 0.1, ..., 1.
CRAMERS_V_GRID: tuple[float, ...] = tuple(round(0.1 * step, 1) for step in range(11))
#: PathoROB's regularisation grid: 15 values of C log-spaced from 1e-8 to 1e4.
C_GRID: tuple[float, ...] = tuple(10 ** np.linspace(-8, 4, 15))


@dataclass(frozen=True)
class ShortcutSweep:
    """Balanced accuracies of the sweep, one row per Cramér's V and one column per run.

    ``cramers_v`` is the V each training table realises (integer counts), ``tables`` the
    (confounder x class) training-pool counts, ``chance`` = 1 / number of classes. ``held_out``
    is None when every confounder was trained on.
    """

    cramers_v: np.ndarray
    tables: tuple[np.ndarray, ...]
    in_domain: np.ndarray
    held_out: np.ndarray | None
    chance: float

    def summary(self) -> dict[str, float]:
        """APD and nIPD of each evaluation setting."""
        out = {"apd_in_domain": apd(self.in_domain), "nipd_in_domain": nipd(self.in_domain, self.cramers_v, self.chance)}
        if self.held_out is not None:
            out["apd_held_out"] = apd(self.held_out)
            out["nipd_held_out"] = nipd(self.held_out, self.cramers_v, self.chance)
        return out


def cramers_v(table: ArrayLike) -> float:
    """Cramér's V of a contingency table (no continuity correction)."""
    counts = np.asarray(table, dtype=float)
    expected = np.outer(counts.sum(axis=1), counts.sum(axis=0)) / counts.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    return float(np.sqrt(chi2 / (counts.sum() * (min(counts.shape) - 1))))


def composition(n_confounders: int, n_classes: int, pool_size: int, v: float) -> np.ndarray:
    """Training-pool counts (confounder x class) at Cramér's V ~= v with fixed marginals.

    Along the longer axis (L levels) each level is aligned with one level of the shorter axis,
    level l with level l % S; the marginals are those of that fully aligned table (uniform on the
    longer axis; uniform on both when S divides L). The table is the mixture
    ``(1 - t) * independent + t * aligned`` with integer cells: every off-aligned cell holds
    ``n_s * u`` (``n_s``: longer-axis levels aligned with its shorter-axis level s, and
    ``u = round((1 - v) * N / L**2)``), aligned cells the rest. Marginals are exact at every v
    and Cramér's V is exactly ``1 - u * L**2 / N``. N is ``pool_size`` rounded down to a multiple
    of ``L**2``, which makes V = 0 exact.
    """
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"Cramér's V must lie in [0, 1], got {v}")
    long, short = max(n_confounders, n_classes), min(n_confounders, n_classes)
    if pool_size < long**2:
        raise ValueError(f"pool_size must be at least max(#confounders, #classes)^2 = {long**2}, got {pool_size}")
    per_long = pool_size // long**2 * long  # rows per level of the longer axis
    aligned_to = np.arange(long) % short
    n_aligned = np.bincount(aligned_to, minlength=short)
    u = int(round((1.0 - v) * per_long / long))
    table = np.tile(n_aligned * u, (long, 1))
    table[np.arange(long), aligned_to] = per_long - (long - n_aligned[aligned_to]) * u
    return table if n_confounders >= n_classes else table.T


def _accuracy_matrix(accuracies: ArrayLike) -> np.ndarray:
    acc = np.asarray(accuracies, dtype=float)
    if acc.ndim != 2 or acc.shape[0] < 2 or acc.shape[1] < 1:
        raise ValueError(f"accuracies must be (n_v >= 2, n_runs >= 1), got shape {acc.shape}")
    if not np.isfinite(acc).all():
        raise ValueError("accuracies must be finite")
    return acc


def apd(accuracies: ArrayLike) -> float:
    """PathoROB's average performance drop: mean over runs of mean_{V>0} acc(V)/acc(0), minus 1."""
    acc = _accuracy_matrix(accuracies)
    if not (acc[0] > 0).all():
        raise ValueError("every run's baseline accuracy (row 0) must be positive")
    return float(np.mean((acc[1:] / acc[0]).mean(axis=0) - 1.0))


def nipd(accuracies: ArrayLike, cramers_v_values: ArrayLike, chance: float) -> float:
    """Normalised integrated performance degradation: the trapezoid area over V in [0, 1] of
    ``g(V) = (acc(V) - acc(0)) / (acc(0) - chance)``, acc averaged over runs first."""
    acc = _accuracy_matrix(accuracies)
    v = np.asarray(cramers_v_values, dtype=float)
    if v.shape != (len(acc),) or not np.all(np.diff(v) > 0) or not (np.isclose(v[0], 0) and np.isclose(v[-1], 1)):
        raise ValueError("cramers_v must hold one strictly increasing value per row, from 0 to 1")
    if not 0.0 <= chance < 1.0:
        raise ValueError(f"chance must lie in [0, 1), got {chance}")
    mean = acc.mean(axis=1)
    if mean[0] <= chance:
        raise ValueError(f"baseline accuracy {mean[0]} is not above chance {chance}")
    return float(trapezoid((mean - mean[0]) / (mean[0] - chance), v))


def sweep_tables(n_confounders: int, n_classes: int, pool_size: int,
                 cramers_v_grid: Sequence[float] = CRAMERS_V_GRID) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The training-pool tables of a sweep and the Cramér's V each realises. Raises ValueError, saying
    the smallest pool that works, when the integer tables cannot realise strictly increasing V (a
    grid step of 0.1 needs about 10·L² rows, L = max(#confounders, #classes))."""
    tables = tuple(composition(n_confounders, n_classes, pool_size, float(v)) for v in cramers_v_grid)
    realised = np.array([cramers_v(t) for t in tables])
    if not np.all(np.diff(realised) > 0):
        longest = max(n_confounders, n_classes)
        enough = next(size for size in range(longest**2, 10**7, longest**2)
                      if np.all(np.diff([cramers_v(composition(n_confounders, n_classes, size, float(v)))
                                         for v in cramers_v_grid]) > 0))
        raise ValueError(f"a pool of {pool_size} rows cannot realise distinct Cramér's V values for {n_confounders} "
                         f"confounder levels x {n_classes} classes (got {realised.round(3).tolist()}); it needs at "
                         f"least {enough}")
    return tables, realised


def split_levels(levels: Sequence[str], train_levels: Sequence[str] | None,
                 held_out: int) -> tuple[list[str], list[str]]:
    """The confounder levels trained on and held out: ``train_levels`` as given (each must be one of
    ``levels``), else every sorted level but the last ``held_out``. Raises ValueError naming the
    problem when a level is unknown or fewer than two are trained on."""
    ordered = sorted(levels)
    if train_levels is None:
        trained = ordered[:max(len(ordered) - held_out, 0)]
    else:
        unknown = [level for level in train_levels if level not in ordered]
        if unknown:
            raise ValueError(f"train_levels {unknown} are not among this run's levels: {', '.join(ordered)}")
        trained = list(train_levels)
    if len(trained) < 2:
        raise ValueError(f"{len(ordered)} level(s) leave {len(trained)} to train on (held_out={held_out}); the sweep "
                         f"needs two: lower held_out or list train_levels")
    return trained, [level for level in ordered if level not in trained]


def nipd_interval(accuracies: ArrayLike, cramers_v_values: ArrayLike, chance: float, *, n_boot: int = 2000,
                  level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`nipd` over resampling runs: runs (columns) drawn with
    replacement ``n_boot`` times, nIPD recomputed on each draw's mean curve. Seeded: the same
    accuracies give the same interval. With one run the interval is that run's nIPD."""
    acc = _accuracy_matrix(accuracies)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, acc.shape[1], size=(n_boot, acc.shape[1]))
    values = [nipd(acc[:, columns], cramers_v_values, chance) for columns in draws]
    low, high = np.quantile(values, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high)


def _fit_probe(x_train, y_train, x_val, y_val, c_grid: Sequence[float]) -> LogisticRegression:
    """Logistic regression on the training rows with C chosen by validation balanced accuracy (first
    best). The grid is walked in increasing C with warm starts (each fit starts from the previous
    solution, as a regularisation path), and the fit at the chosen C is the returned probe: the
    same model as refitting on the training rows, at a fraction of the iterations."""
    best, best_score = None, -np.inf
    probe = LogisticRegression(C=c_grid[0], warm_start=True, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for c in sorted(c_grid):
            probe.set_params(C=c).fit(x_train, y_train)
            score = balanced_accuracy(y_val, probe.predict(x_val))
            if score > best_score:
                best, best_score = copy.deepcopy(probe), score
    return best


@dataclass(frozen=True)
class _Layout:
    """Which rows the sweep trains and tests on. ``classes``: class code per row (sorted classes of
    the training rows; -1 for classes no training confounder has); ``cells``:
    confounder x class cell per training-confounder row (-1 elsewhere)."""

    classes: np.ndarray
    cells: np.ndarray
    levels: list[object]
    class_names: list[object]
    held_out_rows: np.ndarray

    @property
    def n_cells(self) -> int:
        return len(self.levels) * len(self.class_names)


def _layout(biology: ArrayLike, confounder: ArrayLike, n: int, train_confounders: Sequence[object] | None) -> _Layout:
    conf, bio = np.asarray(confounder), np.asarray(biology)
    for name, values in (("biology", bio), ("confounder", conf)):
        if values.ndim != 1 or len(values) != n:
            raise ValueError(f"{name} must be a 1-D array with one entry per sample ({n}), got shape {values.shape}")
    present = list(dict.fromkeys(conf.tolist()))
    levels = present if train_confounders is None else list(train_confounders)
    unknown = [level for level in levels if level not in present]
    if unknown:
        raise ValueError(f"train_confounders {unknown} do not occur in confounder")
    in_train = np.isin(conf, levels)
    class_names = sorted(set(bio[in_train].tolist()))
    classes = np.array([class_names.index(b) if b in class_names else -1 for b in bio.tolist()])
    conf_code = np.array([levels.index(c) if t else -1 for c, t in zip(conf.tolist(), in_train)])
    cells = np.where(in_train, conf_code * len(class_names) + classes, -1)
    return _Layout(classes, cells, levels, class_names, np.flatnonzero(~in_train & (classes >= 0)))


def _cell_orders(cells: np.ndarray, groups: np.ndarray, rng: np.random.Generator, n_cells: int) -> list[np.ndarray]:
    """Per cell, its rows ordered by a random group order (group rows contiguous, shuffled within)."""
    group_rank = rng.permutation(int(groups.max()) + 1)[groups]
    order = np.lexsort((rng.random(len(cells)), group_rank))
    return [order[cells[order] == cell] for cell in range(n_cells)]


def _in_domain_test(cells: np.ndarray, rows: np.ndarray, n_cells: int) -> np.ndarray:
    """The in-domain test rows; raises ValueError when a cell has none (its accuracy is undefined)."""
    if np.any(np.bincount(cells[rows], minlength=n_cells) == 0):
        raise ValueError("some confounder x class cell has no in-domain test rows (its cells are all needed for the "
                         "training pool); lower pool_size")
    return rows


def cell_balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray, cells: np.ndarray, n_classes: int) -> float:
    """Balanced accuracy with every (confounder x class) cell weighted equally: per class, the mean
    over confounders of the cell's recall; then the mean over classes. ``cells`` = confounder code x
    ``n_classes`` + class. The estimand of balanced accuracy on a test set with equal rows per cell
    (PathoROB's in-domain design), from every test row instead of a subsample of the smallest cell's
    size."""
    support = np.bincount(cells, minlength=cells.max() + 1)
    hits = np.bincount(cells[y_true == y_pred], minlength=len(support))
    present = support > 0
    recall = np.where(present, hits / np.maximum(support, 1), np.nan).reshape(-1, n_classes)
    return float(np.mean(np.nanmean(recall, axis=0)))


def _check_pool(totals: np.ndarray, largest: np.ndarray, layout: _Layout) -> None:
    """Raise when a cell has fewer rows in all than the sweep's largest request for it."""
    n_classes = len(layout.class_names)
    for cell, (total, count) in enumerate(zip(totals, largest)):
        if count > total:
            raise ValueError(
                f"confounder {layout.levels[cell // n_classes]!r} x biology {layout.class_names[cell % n_classes]!r} "
                f"needs {count} training-pool rows but has {total} cells in all; lower pool_size"
            )


def _pool_rows(orders: list[np.ndarray], counts: np.ndarray, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation rows: each cell's first ``count`` rows, the last share of them validation."""
    train, val = [], []
    for order, count in zip(orders, counts):
        n_val = int(round(validation_fraction * count))
        train.append(order[: count - n_val])
        val.append(order[count - n_val : count])
    return np.concatenate(train), np.concatenate(val)


def _test_groups(cells: np.ndarray, groups: np.ndarray, need: np.ndarray, rng: np.random.Generator,
                 test_fraction: float) -> np.ndarray:
    """The in-domain test groups: ``test_fraction`` of the training confounders' groups, taken in a
    random order, skipping any group whose rows would leave a (confounder x class) cell fewer
    non-test rows than the sweep's largest request for it (``need``, per cell). A cell left without
    test rows then gets the first group (same order) that holds it and still fits."""
    in_train = cells >= 0
    names, codes = np.unique(groups[in_train], return_inverse=True)
    per_group = np.zeros((len(names), len(need)), dtype=np.int64)
    np.add.at(per_group, (codes, cells[in_train]), 1)
    target = int(np.ceil(test_fraction * len(names)))
    spare = per_group.sum(axis=0) - need
    order = rng.permutation(len(names))
    chosen = np.zeros(len(names), dtype=bool)

    def take(g: int) -> None:
        nonlocal spare
        chosen[g] = True
        spare = spare - per_group[g]

    for g in order:
        if chosen.sum() == target:
            break
        if np.all(per_group[g] <= spare):
            take(g)
    for cell in range(len(need)):
        if per_group[chosen, cell].sum() == 0:
            fitting = [g for g in order if not chosen[g] and per_group[g, cell] > 0 and np.all(per_group[g] <= spare)]
            if fitting:
                take(fitting[0])
    return names[chosen]


def _run(x: RowSource, groups: np.ndarray, layout: _Layout, tables: tuple[np.ndarray, ...], rng: np.random.Generator,
         validation_fraction: float, test_fraction: float,
         c_grid: Sequence[float]) -> tuple[list[float], list[LogisticRegression]]:
    """One resampling run: in-domain balanced accuracy at every table, and the probe of each table."""
    y, cells = layout.classes, layout.cells
    largest = np.max(tables, axis=0).ravel()
    _check_pool(np.bincount(cells[cells >= 0], minlength=layout.n_cells), largest, layout)
    test_groups = _test_groups(cells, groups, largest, rng, test_fraction)
    is_test = (cells >= 0) & np.isin(groups, test_groups)
    test_rows = _in_domain_test(cells, np.flatnonzero(is_test), layout.n_cells)
    x_test = x.take(test_rows)
    orders = _cell_orders(np.where(is_test, -1, cells), groups, rng, layout.n_cells)
    in_domain, probes = [], []
    for table in tables:
        train, val = _pool_rows(orders, table.ravel(), validation_fraction)
        probe = _fit_probe(x.take(train), y[train], x.take(val), y[val], c_grid)
        in_domain.append(cell_balanced_accuracy(y[test_rows], probe.predict(x_test), cells[test_rows],
                                                len(layout.class_names)))
        probes.append(probe)
    return in_domain, probes


def _held_out_accuracies(x: RowSource, probes: list[list[LogisticRegression]], layout: _Layout,
                         chunk_rows: int) -> np.ndarray:
    """(tables, runs) balanced accuracy of every run's probes on the held-out rows (as
    :func:`~cellpath.robustness.metrics.balanced_accuracy`), in one pass over them, ``chunk_rows``
    rows at a time."""
    rows = layout.held_out_rows
    y = layout.classes[rows]
    n_classes = len(layout.class_names)
    hits = np.zeros((len(probes[0]), len(probes), n_classes), dtype=np.int64)
    for start in range(0, len(rows), chunk_rows):
        chunk, truth = x.take(rows[start:start + chunk_rows]), y[start:start + chunk_rows]
        for run, run_probes in enumerate(probes):
            for table, probe in enumerate(run_probes):
                hits[table, run] += np.bincount(truth[probe.predict(chunk) == truth], minlength=n_classes)
    support = np.bincount(y, minlength=n_classes)
    present = support > 0
    return (hits[..., present] / support[present]).mean(axis=-1)


def shortcut_sweep(
    features: ArrayLike,
    biology: ArrayLike,
    confounder: ArrayLike,
    group: ArrayLike,
    *,
    pool_size: int,
    train_confounders: Sequence[object] | None = None,
    cramers_v_grid: Sequence[float] = CRAMERS_V_GRID,
    n_runs: int = 20,
    validation_fraction: float = 0.1,
    test_fraction: float = 0.3,
    c_grid: Sequence[float] = C_GRID,
    seed: int = 0,
    chunk_rows: int = DEFAULT_CANDIDATE_ROWS,
) -> ShortcutSweep:
    """Run the confounder-biased probe sweep on raw features (see the module docstring).

    ``train_confounders``: the confounder levels the probe trains on, in the order that aligns them
    with the sorted classes (default all, in order of first appearance, leaving no held-out
    evaluation); the classes are those present in them, and held-out rows of other classes are not
    scored. ``pool_size``: training + validation rows at every V (rounded down to a
    multiple of max(#train confounders, #classes)^2, see :func:`composition`). ``features`` may be a
    :class:`~cellpath.robustness.neighbours.RowSource` (a memory-mapped store): only the rows a fit
    needs are read, and the held-out rows ``chunk_rows`` at a time.
    """
    x = feature_rows(features, chunk_rows)
    check_at_least_one("n_runs", n_runs)
    if not 0.0 <= validation_fraction < 1.0 or not 0.0 < test_fraction < 1.0:
        raise ValueError("validation_fraction must lie in [0, 1) and test_fraction in (0, 1)")
    groups = encode("group", group, len(x))
    layout = _layout(biology, confounder, len(x), train_confounders)
    n_classes = len(layout.class_names)
    tables, realised = sweep_tables(len(layout.levels), n_classes, pool_size, cramers_v_grid)
    runs = [_run(x, groups, layout, tables, np.random.default_rng([seed, run]), validation_fraction, test_fraction,
                 c_grid) for run in range(n_runs)]
    held_out = (_held_out_accuracies(x, [r[1] for r in runs], layout, chunk_rows) if layout.held_out_rows.size
                else None)
    return ShortcutSweep(cramers_v=realised, tables=tables, in_domain=np.array([r[0] for r in runs]).T,
                         held_out=held_out, chance=1.0 / n_classes)
