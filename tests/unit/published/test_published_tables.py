"""The paper's published tables (cellpath.published): the committed excerpt re-derives the committed CSV,
values typed by hand from the paper's text are where they should be, and each table is consistent
with its legend and with the other tables. Needs nothing outside the repository."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from cellpath.errors import InputError
from cellpath.published import load_published, seed_tables
from cellpath.published.seed_tables import (
    BLOCK_HEADER,
    COLUMNS,
    CSV_PATH,
    EXCERPT_PATH,
    MODEL_ALIASES,
    extract_table_text,
    main,
    parse_cells,
    parse_models,
    parse_tables,
    to_csv_text,
)
from cellpath.vocabulary import CLS_READOUTS, READOUTS

# The reference list's `model` column (foundation_models.csv), copied so the test needs nothing outside the repository.
REFERENCE_MODELS = {
    "H-Optimus-1", "H-Optimus-0", "Prov-GigaPath", "Virchow2", "Virchow", "UNI2", "GPFM", "Hibou-L", "UNI",
    "Phikon-v2", "Kaiko ViT-L/14", "Hibou-B", "Kaiko ViT-B/8", "Kaiko ViT-B/16", "H0-mini", "Phikon",
    "CTransPath (CHIEF)", "Kaiko ViT-S/8", "Kaiko ViT-S/16", "Lunit ViT-S/8", "MUSK", "CONCH v1.5", "mSTAR", "CONCH",
    "PLIP", "SEAL (UNI2)", "OmiCLIP", "SEAL (CONCH)", "DINOv3 ViT-L/16", "DINOv3 ViT-B/16",
}
IS_TABLES = range(9, 81)
PANEL_TABLES = {"S25": range(9, 27), "S20": range(27, 45), "S15": range(45, 63), "S10": range(63, 81)}
PROTOCOL_TABLES = {"is": IS_TABLES, "iocd": range(81, 99), "mocv": range(99, 117), "looo": range(117, 135)}


@pytest.fixture(scope="module")
def published() -> pd.DataFrame:
    return load_published()


def _cell(frame: pd.DataFrame, table: int, model: str, *, readout: str | None = "Nuc", metric: str | None = None,
          protocol: str | None = None, taxonomy: str | None = None) -> pd.Series:
    rows = frame[(frame.table == table) & (frame.model == model)]
    rows = rows[rows.readout.isna()] if readout is None else rows[rows.readout == readout]
    for column, value in (("metric", metric), ("protocol", protocol), ("taxonomy", taxonomy)):
        if value is not None:
            rows = rows[rows[column] == value]
    assert len(rows) == 1, f"Table {table} {model} {readout} {metric} {protocol} {taxonomy}: {len(rows)} rows"
    return rows.iloc[0]


# --------------------------------------------------------------- derivation


def test_the_committed_excerpt_reproduces_the_committed_csv_exactly():
    derived = parse_tables(EXCERPT_PATH.read_text(encoding="utf-8"))
    assert to_csv_text(derived) == CSV_PATH.read_text(encoding="utf-8")
    pd.testing.assert_frame_equal(derived, load_published())


def test_the_check_command_finds_the_committed_files_up_to_date(capsys):
    assert main(["--check"]) == 0


def test_the_check_command_reports_a_changed_value(tmp_path, monkeypatch, capsys):
    changed = tmp_path / "results.csv"
    text = CSV_PATH.read_text(encoding="utf-8")
    changed.write_text(text.replace(",H-Optimus-1,1,36.73,8.51,", ",H-Optimus-1,1,36.74,8.51,"), encoding="utf-8")
    monkeypatch.setattr(seed_tables, "CSV_PATH", changed)
    assert main(["--check"]) == 1
    assert "results.csv: 2 changed lines" in capsys.readouterr().err


def test_the_excerpt_records_the_seed_and_the_command():
    header = EXCERPT_PATH.read_text(encoding="utf-8").split("\n")[:6]
    assert any(re.fullmatch(r"# seed sha256: [0-9a-f]{64}", line) for line in header)
    made_by = [line for line in header if line.startswith("# made by: ")]
    assert made_by == ["# made by: python -m cellpath.published.seed_tables --seed <path to the paper's text>"]


def _seed_from_excerpt(excerpt: str) -> str:
    """A stand-in for the paper's text, rebuilt from the excerpt alone: each block's lines at the seed
    lines its separator records (caption on the first, last value line on the last, blank lines
    elsewhere). The paper's text itself is not in the repository; with it, ``--check --seed <path>``
    also compares the excerpt with the real text."""
    lines: list[str] = []
    for line_number, (table, body) in zip(_block_ranges(excerpt), _block_bodies(excerpt), strict=True):
        first, last = line_number
        assert len(body) <= last - first + 1, f"Table {table}: {len(body)} lines do not fit seed lines {first}-{last}"
        lines += [""] * (first - 1 - len(lines))
        lines += body[:-1] + [""] * (last - first + 1 - len(body)) + body[-1:]
    return "\n".join(lines) + "\n"


def _block_ranges(excerpt: str) -> list[tuple[int, int]]:
    return [(int(m.group(2)), int(m.group(3))) for m in map(BLOCK_HEADER.match, excerpt.split("\n")) if m]


def _block_bodies(excerpt: str) -> list[tuple[int, list[str]]]:
    return list(seed_tables._blocks(excerpt))


def test_the_excerpts_seed_lines_are_ascending_and_disjoint():
    ranges = _block_ranges(EXCERPT_PATH.read_text(encoding="utf-8"))
    assert len(ranges) == 128
    assert all(first <= last for first, last in ranges)
    assert all(previous[1] < following[0] for previous, following in zip(ranges, ranges[1:]))


def _made_by(excerpt: str) -> str:
    return next(line for line in excerpt.split("\n") if line.startswith("# made by: ")).removeprefix("# made by: ")


def _without_sha(excerpt: str) -> list[str]:
    return [line for line in excerpt.split("\n") if not line.startswith("# seed sha256: ")]


def test_the_excerpt_is_what_the_extraction_makes_of_its_own_lines():
    """Extracting the rebuilt text gives back the committed excerpt line for line (its header, blocks,
    seed line ranges and inventory), all but the sha256, which is the real text's."""
    committed = EXCERPT_PATH.read_text(encoding="utf-8")
    rebuilt = extract_table_text(_seed_from_excerpt(committed), _made_by(committed))
    assert _without_sha(rebuilt) == _without_sha(committed)
    assert rebuilt.count("# seed sha256: ") == committed.count("# seed sha256: ") == 1


def test_a_line_added_to_the_excerpt_is_not_what_the_extraction_makes():
    committed = EXCERPT_PATH.read_text(encoding="utf-8")
    edited = committed.replace("\n\n===== Table 10 |", "\nTable 9 continued by hand\n\n===== Table 10 |", 1)
    assert edited != committed
    rebuilt = extract_table_text(_seed_from_excerpt(edited), _made_by(edited))
    assert _without_sha(rebuilt) != _without_sha(edited)


def test_the_columns_and_dtypes_are_fixed(published):
    assert list(published.columns) == COLUMNS
    assert str(published["mean"].dtype) == "float64" and str(published["wins"].dtype) == "Int64"
    assert published.table.dtype == "int64" and published.row.dtype == "int64"
    assert len(published) == 5 * 30 + 12 * 30 + 72 * 8 * 30 + 54 * 7 * 30  # Tables 4, 5, IS, cross-domain


def test_every_printed_number_keeps_its_two_decimals():
    text = CSV_PATH.read_text(encoding="utf-8")
    body = [line.split(",") for line in text.splitlines()[1:]]
    mean, sd, crt = COLUMNS.index("mean"), COLUMNS.index("sd"), COLUMNS.index("crt")
    for fields in body[::97]:
        for value in (fields[mean], fields[sd], fields[crt]):
            assert value == "" or re.fullmatch(r"\d+\.\d\d", value), fields


# ----------------------------------------------------------------- by hand


# (table, model, readout, metric, protocol, taxonomy) → (mean, sd, wins), typed from the paper's text.
HAND_TYPED = [
    # Table 4 (S25, 20×): row 1 Tfine Nuc, its CRA, and the last row's Tcoarse Mean
    ((4, "H-Optimus-1", "Nuc", "macro_f1", "is", "fine"), (36.73, 8.51, 29)),
    ((4, "H-Optimus-1", None, "cra", "is", None), (10.14, 6.05, 29)),
    ((4, "OmiCLIP", "Mean", "macro_f1", "is", "coarse"), (45.65, 4.81, 0)),
    # Table 5 (20×, Nuc): the values the text quotes, and IOCD's GPFM (row 12) with its IOCD wins
    ((5, "UNI2", "Nuc", "macro_f1", "iocd", "fine"), (28.85, 8.28, 27)),
    ((5, "H-Optimus-1", "Nuc", "macro_f1", "mocv", "coarse"), (60.68, 7.67, 27)),
    ((5, "H-Optimus-0", "Nuc", "macro_f1", "looo", "fine"), (23.96, 6.90, 24)),
    ((5, "GPFM", "Nuc", "macro_auroc", "iocd", "fine"), (67.70, 10.14, 21)),
    # IS, S25 40× Tfine F1 (Table 9): row 1, MUSK's Cls, the last row
    ((9, "UNI2", "Nuc", "macro_f1", "is", "fine"), (36.94, 12.68, 27)),
    ((9, "MUSK", "Cls", "macro_f1", "is", "fine"), (27.63, 7.51, 3)),
    ((9, "OmiCLIP", "Nuc", "macro_f1", "is", "fine"), (30.00, 8.86, 0)),
    # IS, S20 40× Tfine F1 (Table 27): Nuc and CRA of row 1
    ((27, "UNI2", "Nuc", "macro_f1", "is", "fine"), (39.84, 11.15, 27)),
    ((27, "UNI2", None, "cra", "is", "fine"), (9.20, 5.48, 27)),
    # IS, S15 20× Tfine AUROC (Table 53): H-Optimus-1's Nuc and chance-level Cls
    ((53, "H-Optimus-1", "Nuc", "macro_auroc", "is", "fine"), (79.78, 11.67, 29)),
    ((53, "H-Optimus-1", "Cls", "macro_auroc", "is", "fine"), (49.97, 0.24, 29)),
    # IS, S10 10× Tcoarse AUPRC (Table 80): row 1 and its CRA
    ((80, "CONCH v1.5", "Nuc", "macro_auprc", "is", "coarse"), (74.72, 13.06, 29)),
    ((80, "CONCH v1.5", None, "cra", "is", "coarse"), (16.23, 7.61, 29)),
    # IOCD 40× Tfine F1 (Table 81): row 1 Nuc, the last row's Mean
    ((81, "UNI2", "Nuc", "macro_f1", "iocd", "fine"), (28.72, 8.83, 28)),
    ((81, "OmiCLIP", "Mean", "macro_f1", "iocd", "fine"), (14.90, 3.45, 0)),
    # MOCV 40× Tcoarse F1 (Table 100): SEAL(UNI2) Nuc, UNI2 Mean, H0mini's wins
    ((100, "SEAL (UNI2)", "Nuc", "macro_f1", "mocv", "coarse"), (60.81, 8.17, 27)),
    ((100, "UNI2", "Mean", "macro_f1", "mocv", "coarse"), (49.94, 5.84, 27)),
    ((100, "H0-mini", "Nuc", "macro_f1", "mocv", "coarse"), (59.51, 8.28, 23)),
    # LOOO 40× Tfine F1 (Table 117) and 10× Tcoarse AUPRC (Table 134)
    ((117, "SEAL (UNI2)", "Nuc", "macro_f1", "looo", "fine"), (24.67, 7.75, 28)),
    ((117, "H0-mini", "Cls", "macro_f1", "looo", "fine"), (9.64, 2.38, 24)),
    ((134, "CONCH", "Nuc", "macro_auprc", "looo", "coarse"), (54.87, 23.39, 26)),
    ((134, "CONCH v1.5", "N||C", "macro_auprc", "looo", "coarse"), (55.08, 23.63, 21)),
]


@pytest.mark.parametrize(("key", "expected"), HAND_TYPED, ids=[f"T{k[0]}-{k[1]}-{k[2]}-{k[3]}" for k, _ in HAND_TYPED])
def test_values_typed_by_hand_from_the_paper(published, key, expected):
    table, model, readout, metric, protocol, taxonomy = key
    row = _cell(published, table, model, readout=readout, metric=metric, protocol=protocol, taxonomy=taxonomy)
    assert (row["mean"], row["sd"], row["wins"]) == expected
    if taxonomy is None:
        assert pd.isna(row["taxonomy"])  # Table 4's CRA pools both taxonomies


@pytest.mark.parametrize(("table", "model", "readout", "row"), [
    (9, "CTransPath (CHIEF)", "Cls", 26), (81, "CTransPath (CHIEF)", "Cls", 29), (80, "CTransPath (CHIEF)", "N+C", 27),
])
def test_a_dash_is_an_empty_cell(published, table, model, readout, row):
    cell = _cell(published, table, model, readout=readout)
    assert cell["row"] == row and pd.isna(cell["mean"]) and pd.isna(cell["sd"])


@pytest.mark.parametrize(("model", "crt"), [("SEAL (UNI2)", 26.33), ("UNI2", 26.33), ("H-Optimus-1", 25.33),
                                            ("H-Optimus-0", 24.33), ("Virchow2", 16.33)])
def test_crt_matches_the_values_quoted_in_the_text(published, model, crt):
    rows = published[(published.table == 5) & (published.model == model)]
    assert set(rows.crt) == {crt}


def test_the_main_text_tables_are_on_the_s25_panel_at_20x(published):
    main_text = published[published.table.isin([4, 5])]
    assert set(main_text.panel) == {"S25"} and set(main_text.magnification) == {"20x"}
    assert set(published[published.table == 5].readout) == {"Nuc"}


# ------------------------------------------------------------- consistency


def test_the_inventory_is_in_the_csv(published):
    header = next(line for line in EXCERPT_PATH.read_text(encoding="utf-8").split("\n") if line.startswith("# tables"))
    listed = [int(n) for n in header.split(":", 1)[1].split(",")]
    assert listed == [4, 5, *range(9, 135)]
    assert sorted(set(published.table)) == listed
    for protocol, tables in PROTOCOL_TABLES.items():
        assert set(published[published.table.isin(tables)].protocol) == {protocol}
    for panel, tables in PANEL_TABLES.items():
        assert set(published[published.table.isin(tables)].panel) == {panel}
    assert set(published[published.table >= 81].panel) == {"S25"}


def test_each_supplementary_table_is_one_configuration_of_the_grid(published):
    supplement = published[published.table >= 9]
    configurations = supplement.groupby("table")[["panel", "magnification", "taxonomy", "protocol"]].nunique()
    assert (configurations == 1).all().all()
    metrics = supplement[supplement.metric != "cra"].groupby("table").metric.nunique()
    assert (metrics == 1).all()
    keys = supplement[supplement.metric != "cra"].drop_duplicates("table")
    assert not keys.duplicated(["panel", "magnification", "taxonomy", "protocol", "metric"]).any()


def test_30_distinct_reference_models_per_table_column(published):
    column = published.readout.fillna("") + "|" + published.metric + "|" + published.protocol + "|" \
        + published.taxonomy.fillna("")
    for (table, _), group in published.groupby([published.table, column]):
        assert len(group) == 30 and set(group.model) == REFERENCE_MODELS, table
        assert sorted(group.row) == list(range(1, 31)), table
    assert set(MODEL_ALIASES.values()) == REFERENCE_MODELS


def test_a_model_keeps_its_row_across_a_tables_columns(published):
    assert (published.groupby(["table", "model"]).row.nunique() == 1).all()


def test_the_readouts_use_the_vocabulary(published):
    supplement = published[(published.table >= 9) & (published.metric != "cra")]
    assert set(supplement.readout) == set(READOUTS)
    assert published[published.metric == "cra"].readout.isna().all()


def test_dashes_are_only_the_cls_readouts_of_the_model_without_a_class_token(published):
    dashes = published[published["mean"].isna()]
    assert set(dashes.model) == {"CTransPath (CHIEF)"} and set(dashes.readout) == CLS_READOUTS
    assert len(dashes) == 3 * (72 + 54)
    assert published[published["mean"].notna()].sd.notna().all()  # every printed value has its ±SD


def test_values_are_plausible_percentages(published):
    values = published.dropna(subset=["mean"])
    assert values["mean"].between(0, 100).all() and (values.sd >= 0).all()
    scores = values[values.metric != "cra"]
    best = scores.groupby(["table", "readout", "metric", "protocol", scores.taxonomy.fillna("")])["mean"].max()
    assert best.between(10, 100).all()
    auroc = scores[scores.metric == "macro_auroc"]
    assert (auroc.groupby("table")["mean"].max() > 50).all()  # the best model beats chance
    assert published.wins.between(0, 29).all()


def test_rows_are_sorted_as_the_legends_say(published):
    """IS (and Table 4): by wins, then the unrounded CRA; cross-domain: by wins, then the unrounded Nuc
    mean. With rounded values, ties may print equal."""
    for table, group in published[published.table != 5].groupby("table"):
        key = group[group.metric == "cra"] if group.protocol.iloc[0] == "is" else group[group.readout == "Nuc"]
        key = key.sort_values("row")
        wins, mean = key.wins.tolist(), key["mean"].tolist()
        for i in range(len(wins) - 1):
            assert wins[i] >= wins[i + 1], (table, i + 1)
            if wins[i] == wins[i + 1]:
                assert mean[i] >= mean[i + 1], (table, i + 1)


def test_wins_are_the_same_on_every_row_of_a_model(published):
    per_model = published.groupby(["table", "protocol", "model"]).wins.nunique()
    assert (per_model == 1).all()
    assert published.wins.notna().all() and published[published.table != 5].crt.isna().all()


def test_table5_crt_is_the_mean_of_the_three_protocols_wins(published):
    table5 = published[published.table == 5]
    wins = table5.drop_duplicates(["protocol", "model"]).pivot(index="model", columns="protocol", values="wins")
    crt = table5.drop_duplicates("model").set_index("model").crt
    for model, row in wins.iterrows():
        assert math.isclose(crt[model], round((row.iocd + row.mocv + row.looo) / 3, 2), abs_tol=1e-9), model
    assert crt.between(0, 29).all()


def test_table4_nuc_equals_the_supplementary_is_table(published):
    """Table 4's Nuc means are the S25 20× Macro-F1 IS tables' (its SDs are across organs, theirs across sections)."""
    for taxonomy in ("fine", "coarse"):
        main_text = published[(published.table == 4) & (published.readout == "Nuc") & (published.taxonomy == taxonomy)]
        supplement = published[(published.table >= 9) & (published.protocol == "is") & (published.panel == "S25")
                               & (published.magnification == "20x") & (published.metric == "macro_f1")
                               & (published.taxonomy == taxonomy) & (published.readout == "Nuc")]
        assert supplement.table.nunique() == 1
        pd.testing.assert_series_equal(main_text.set_index("model")["mean"].sort_index(),
                                       supplement.set_index("model")["mean"].sort_index())


def test_table5_equals_the_supplementary_cross_domain_tables(published):
    table5 = published[published.table == 5]
    for (protocol, taxonomy, metric), group in table5.groupby(["protocol", "taxonomy", "metric"]):
        supplement = published[(published.table >= 81) & (published.protocol == protocol)
                               & (published.magnification == "20x") & (published.taxonomy == taxonomy)
                               & (published.metric == metric) & (published.readout == "Nuc")]
        assert supplement.table.nunique() == 1
        for column in ("mean", "sd"):
            pd.testing.assert_series_equal(group.set_index("model")[column].sort_index(),
                                           supplement.set_index("model")[column].sort_index())
        if (taxonomy, metric) == ("fine", "macro_f1"):  # Table 5's wins: Tfine, Nuc (Macro-F1)
            pd.testing.assert_series_equal(group.set_index("model").wins.sort_index(),
                                           supplement.set_index("model").wins.sort_index())


# ------------------------------------------------------------- fail loudly


def test_an_unknown_model_name_is_an_error():
    with pytest.raises(InputError, match="unknown model name"):
        parse_models("UNI2 UNI3", "Table X")
    with pytest.raises(InputError, match="31 model names"):  # H0mini and H0-mini are one model
        parse_models(" ".join(MODEL_ALIASES), "Table X")
    assert len(parse_models(" ".join(a for a in MODEL_ALIASES if a != "H0-mini"), "Table X")) == 30


def test_a_column_of_29_values_is_an_error():
    with pytest.raises(InputError, match="29 values"):
        parse_cells(" ".join(["1.00±0.10"] * 29), "Table X")
    with pytest.raises(InputError, match="decimals"):
        parse_cells(" ".join(["1.0±0.10"] * 30), "Table X")
