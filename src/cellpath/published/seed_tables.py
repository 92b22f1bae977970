"""The CellPath-Bench paper's results tables, read from the text extracted from its PDF.

The extraction flattens every table: the caption, then the model names in row order on one line,
then the column headings, then each *column* as one whitespace-separated line of 30 values (one per
model, in the order of the model line). Tables 4 and 5 (main text) have scrambled headings and, for
Table 5, prose lines between the columns; their layouts are checked line by line below. The
supplementary tables (9-134: "Complete IS/IOCD/MOCV/LOOO results ...") share one layout.

Two pure steps, I/O at the edges (the CLI):

- :func:`extract_table_text`: seed text → the excerpt (every results table's raw lines, caption
  through last value line, blank lines dropped), committed as ``cellpath/data/published/tables.txt``
  so the CSV can be re-derived without the seed;
- :func:`parse_tables`: excerpt → the tidy table (``cellpath/data/published/results.csv``).

``python -m cellpath.published.seed_tables --seed SEED`` rewrites both files; ``--check`` (with or
without ``--seed``) re-derives them and exits 1 with a diff summary when the committed files differ.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from cellpath.errors import InputError
from cellpath.vocabulary import CLS_READOUTS, CROSS_DOMAIN_PROTOCOLS, MAGNIFICATIONS, PROTOCOLS, READOUTS, TAXONOMIES

PUBLISHED_DIR = Path(__file__).resolve().parents[1] / "data" / "published"
EXCERPT_PATH = PUBLISHED_DIR / "tables.txt"
CSV_PATH = PUBLISHED_DIR / "results.csv"

N_MODELS = 30
#: Tables 4-5 report 11 organs and the cross-domain tables (81-134) 23 held-out sections and 11
#: held-out organs: the S25 panel (25 sections across 11 organs), which their captions do not name.
MAIN_TEXT_PANEL = "S25"
CROSS_DOMAIN_PANEL = "S25"
CRA_METRIC = "cra"

#: Every spelling of a model in the tables → the ``model`` column of the reference list
#: (``foundation_models.csv``). A name not here is an error.
MODEL_ALIASES: dict[str, str] = {
    "H-Optimus-1": "H-Optimus-1",
    "H-Optimus-0": "H-Optimus-0",
    "Prov-GigaPath": "Prov-GigaPath",
    "Virchow2": "Virchow2",
    "Virchow": "Virchow",
    "UNI2": "UNI2",
    "GPFM": "GPFM",
    "Hibou-L": "Hibou-L",
    "UNI": "UNI",
    "Phikon-v2": "Phikon-v2",
    "Kaiko ViT-L/14": "Kaiko ViT-L/14",
    "Hibou-B": "Hibou-B",
    "Kaiko ViT-B/8": "Kaiko ViT-B/8",
    "Kaiko ViT-B/16": "Kaiko ViT-B/16",
    "H0mini": "H0-mini",  # supplementary tables
    "H0-mini": "H0-mini",  # Tables 4-5
    "Phikon": "Phikon",
    "CTransPath": "CTransPath (CHIEF)",
    "Kaiko ViT-S/8": "Kaiko ViT-S/8",
    "Kaiko ViT-S/16": "Kaiko ViT-S/16",
    "Lunit ViT-S": "Lunit ViT-S/8",
    "MUSK": "MUSK",
    "CONCH v1.5": "CONCH v1.5",
    "mSTAR": "mSTAR",
    "CONCH": "CONCH",
    "PLIP": "PLIP",
    "SEAL(UNI2)": "SEAL (UNI2)",
    "OmiCLIP": "OmiCLIP",
    "SEAL(CONCH)": "SEAL (CONCH)",
    "DINOv3 ViT-L": "DINOv3 ViT-L/16",
    "DINOv3 ViT-B": "DINOv3 ViT-B/16",
}
#: The one model without a class token: its CLS-dependent cells are printed "–".
NO_CLS_MODEL = "CTransPath (CHIEF)"

COLUMNS = ["table", "panel", "magnification", "taxonomy", "protocol", "metric", "readout", "model",
           "row", "mean", "sd", "wins", "crt"]
DECIMALS = 2  # every value in the tables is printed with two decimals (checked while parsing)

DASH = "–"
CELL = re.compile(r"^(\d+\.\d+)(?:±(\d+\.\d+))?$")
WINS = re.compile(r"^\d+$")
VALUE_TOKEN = re.compile(r"^(\d+\.\d+±\d+\.\d+|\d+\.\d+|\d+|–)$")
MIN_VALUE_TOKENS = 10  # a value line (or a piece of one) has at least this many tokens
PROSE_MIN_WORDS = 15  # a non-value line with at least this many words is running text

CAPTION = re.compile(r"Table (\d+): ")
SUPPLEMENT_CAPTION = re.compile(
    r"^Table (?P<table>\d+): Complete (?P<protocol>IS|IOCD|MOCV|LOOO) results"
    r"(?:, (?P<panel>S\d+) panel,| at) (?P<mag>\d+)× magnification, T(?P<taxonomy>fine|coarse) taxonomy, "
    r"Macro-(?P<metric>F1|AUROC|AUPRC)\. See the shared legend above\. Model (?P<models>.+)$")
TABLE4_CAPTION = re.compile(r"^Table 4: Within-section Cell Representation Advantage at (?P<mag>\d+)×\..*Tfine \(9\)$")
TABLE5_CAPTION = re.compile(
    r"^Table 5: Cross-domain evaluation of Cell Representation Transferability at (?P<mag>\d+)×\..* IOCD Model$")
RESULTS_CAPTION = re.compile(r"^Table \d+: (Complete (IS|IOCD|MOCV|LOOO) results|Within-section Cell Representation "
                             r"Advantage|Cross-domain evaluation of Cell Representation Transferability)")

BLOCK_HEADER = re.compile(r"^===== Table (\d+) \| seed lines (\d+)-(\d+) =====$")

# Layouts of the two main-text tables, line by line after the caption: "<models>", "V" (a value
# line), "P" (a prose line the extraction put inside the table) or a heading line as printed.
TABLE4_LAYOUT = ["<models>", "Tcoarse (3)", "Nuc", "Mean", "Nuc", "Mean", "V", "V", "V", "V", "CRA↑",
                 "Sig. wins↑", "V", "V"]
# (taxonomy, readout or CRA, metric) of Table 4's value lines in order; the last is Sig. wins.
TABLE4_COLUMNS = [("fine", "Nuc", "macro_f1"), ("fine", "Mean", "macro_f1"), ("coarse", "Nuc", "macro_f1"),
                  ("coarse", "Mean", "macro_f1"), (None, None, CRA_METRIC)]
TABLE5_LAYOUT = ["<models>", "MOCV", "F1", "AUROC", "F1", "AUROC", "Sig. wins↑", "V", "V", "V", "V", "V",
                 "Tfine (9)", "Tcoarse (3)", "Tfine (9) F1", "AUROC", "F1", "V", "V", "V", "P", "P",
                 "LOOO AUROC", "Sig. wins↑", "F1", "AUROC", "F1", "AUROC", "Sig. wins↑", "V", "V", "V", "V", "V",
                 "V", "V"]
# Per protocol: four score columns (taxonomy, metric), then its Sig. wins (Tfine, Nuc).
TABLE5_PROTOCOL_COLUMNS = [("fine", "macro_f1"), ("fine", "macro_auroc"), ("coarse", "macro_f1"),
                           ("coarse", "macro_auroc")]
TABLE5_PROTOCOLS = CROSS_DOMAIN_PROTOCOLS  # Table 5's column groups, in this order (IOCD, MOCV, LOOO)

#: The readout headings as printed (CLS for Cls, ∥ for ||), in the vocabulary's order, which the tables follow.
SUPPLEMENT_HEADINGS = [readout.replace("Cls", "CLS").replace("||", "∥") for readout in READOUTS]


# ---------------------------------------------------------------- extraction


def _is_value_line(line: str) -> bool:
    tokens = line.split()
    return len(tokens) >= MIN_VALUE_TOKENS and all(VALUE_TOKEN.match(t) for t in tokens)


def _captions(lines: list[str]) -> list[tuple[int, int, int]]:
    """(table number, line index, character offset) of every "Table N:" caption, in order."""
    found = [(int(m.group(1)), i, m.start()) for i, line in enumerate(lines) for m in CAPTION.finditer(line)]
    numbers = [n for n, _, _ in found]
    if numbers != sorted(set(numbers)):
        raise InputError(f"table captions are not unique and ascending: {numbers}")
    return found


def seed_sha256(seed_text: str) -> str:
    """The sha256 of the seed file (its UTF-8 bytes, newlines as in the file)."""
    return hashlib.sha256(seed_text.encode("utf-8")).hexdigest()


def table_inventory(seed_text: str) -> dict[int, str]:
    """Every "Table N:" caption of the seed → its first 80 characters."""
    lines = seed_text.split("\n")
    return {n: lines[i][offset:offset + 80] for n, i, offset in _captions(lines)}


def extract_table_text(seed_text: str, command: str = "") -> str:
    """The excerpt: a header (seed sha256, ``command``), then every results table's raw lines from its
    caption through its last value line (blank lines dropped), each block under a separator line
    ``===== Table N | seed lines A-B =====`` (1-based lines of the seed).

    Raises :class:`InputError` when a caption that is not a results table is followed by a full
    value line (a results table this module does not know).
    """
    lines = seed_text.split("\n")
    captions = _captions(lines)
    blocks, numbers = [], []
    for k, (number, start, offset) in enumerate(captions):
        stop = captions[k + 1][1] if k + 1 < len(captions) else len(lines)  # the next caption's line
        values = [i for i in range(start + 1, stop) if _is_value_line(lines[i])]
        caption = lines[start][offset:]
        if not RESULTS_CAPTION.match(caption):
            if any(len(lines[i].split()) >= N_MODELS for i in values):
                raise InputError(f"Table {number} is not a known results table but has value lines: {caption[:80]}")
            continue
        if not values:
            raise InputError(f"Table {number}: no value lines after its caption")
        end = values[-1]
        numbers.append(number)
        body = [caption, *(line for line in lines[start + 1:end + 1] if line.strip())]
        blocks.append(f"===== Table {number} | seed lines {start + 1}-{end + 1} =====\n" + "\n".join(body))
    header = ["# CellPath-Bench results tables, excerpted verbatim from the text extracted from the paper's PDF",
              "# (caption through last value line of each table; blank lines dropped). Do not edit: re-derive it.",
              f"# seed sha256: {seed_sha256(seed_text)}",
              f"# made by: {command or 'python -m cellpath.published.seed_tables --seed SEED'}",
              f"# tables ({len(numbers)}): {', '.join(str(n) for n in numbers)}"]
    return "\n".join(header) + "\n\n" + "\n\n".join(blocks) + "\n"


# ------------------------------------------------------------------- parsing


def _blocks(excerpt: str) -> Iterator[tuple[int, list[str]]]:
    """(table number, its non-empty lines after the separator) of every block of the excerpt."""
    number, body = None, []
    for line in excerpt.split("\n"):
        header = BLOCK_HEADER.match(line)
        if header:
            if number is not None:
                yield number, body
            number, body = int(header.group(1)), []
        elif number is not None and line.strip():
            body.append(line)
    if number is not None:
        yield number, body


def parse_models(names: str, where: str) -> list[str]:
    """The canonical names of a table's model line (longest alias first); an unknown name is an error."""
    tokens, models, i = names.split(), [], 0
    longest = max(len(alias.split()) for alias in MODEL_ALIASES)
    while i < len(tokens):
        for width in range(min(longest, len(tokens) - i), 0, -1):
            alias = " ".join(tokens[i:i + width])
            if alias in MODEL_ALIASES:
                models.append(MODEL_ALIASES[alias])
                i += width
                break
        else:
            raise InputError(f"{where}: unknown model name at {' '.join(tokens[i:i + 3])!r} (add it to MODEL_ALIASES)")
    if len(models) != N_MODELS or len(set(models)) != N_MODELS:
        raise InputError(f"{where}: {len(models)} model names ({len(set(models))} distinct), expected {N_MODELS}")
    return models


def _check_decimals(number: str, where: str) -> float:
    if len(number.split(".")[1]) != DECIMALS:
        raise InputError(f"{where}: {number} is not printed with {DECIMALS} decimals (the CSV writes {DECIMALS})")
    return float(number)


def parse_cells(line: str, where: str) -> list[tuple[float | None, float | None]]:
    """(mean, sd) of each of a column's 30 cells: ``None`` for "–", sd ``None`` when printed without ±."""
    tokens = line.split()
    if len(tokens) != N_MODELS:
        raise InputError(f"{where}: {len(tokens)} values, expected {N_MODELS}")
    cells = []
    for printed in tokens:
        if printed == DASH:
            cells.append((None, None))
            continue
        match = CELL.match(printed)
        if not match:
            raise InputError(f"{where}: {printed!r} is not a value")
        mean = _check_decimals(match.group(1), where)
        sd = _check_decimals(match.group(2), where) if match.group(2) else None
        cells.append((mean, sd))
    return cells


def parse_wins(line: str, where: str) -> list[int]:
    """A column of 30 significant-win counts (0-29)."""
    tokens = line.split()
    if len(tokens) != N_MODELS or not all(WINS.match(t) for t in tokens):
        raise InputError(f"{where}: expected {N_MODELS} win counts, got {line[:80]!r}")
    wins = [int(t) for t in tokens]
    if not all(0 <= w <= N_MODELS - 1 for w in wins):
        raise InputError(f"{where}: a win count outside 0-{N_MODELS - 1}")
    return wins


def _readout(heading: str) -> str:
    readout = heading.replace("∥", "||").replace("CLS", "Cls")
    if readout not in READOUTS:
        raise InputError(f"unknown readout heading {heading!r}")
    return readout


def _magnification(text: str) -> str:
    magnification = f"{text}x"
    if magnification not in MAGNIFICATIONS:
        raise InputError(f"unknown magnification {text}×")
    return magnification


def _records(table: int, panel: str, magnification: str, taxonomy: str | None, protocol: str, metric: str,
             readout: str | None, models: list[str], cells: list[tuple[float | None, float | None]],
             wins: list[int] | None = None, crt: list[float] | None = None) -> list[dict]:
    return [{"table": table, "panel": panel, "magnification": magnification, "taxonomy": taxonomy,
             "protocol": protocol, "metric": metric, "readout": readout, "model": model, "row": i + 1,
             "mean": mean, "sd": sd, "wins": None if wins is None else wins[i],
             "crt": None if crt is None else crt[i]}
            for i, (model, (mean, sd)) in enumerate(zip(models, cells, strict=True))]


def _check_dashes(records: list[dict], where: str) -> None:
    """A "–" only where a CLS-dependent readout of the model without a class token is."""
    for r in records:
        dash = r["mean"] is None
        expected = r["model"] == NO_CLS_MODEL and r["readout"] in CLS_READOUTS
        if dash != expected:
            raise InputError(f"{where}: {r['model']} {r['readout']}: {'a dash' if dash else 'a value'} "
                             f"where {'a value' if dash else 'a dash'} was expected")


def _layout(body: list[str]) -> list[str]:
    """Each line as "V" (value line), "P" (prose) or itself (a heading)."""
    return ["V" if _is_value_line(line) else "P" if len(line.split()) >= PROSE_MIN_WORDS else line.strip()
            for line in body]


def _check_layout(table: int, body: list[str], expected: list[str]) -> None:
    found = _layout(body)
    found[0] = "<models>" if found[0] in ("P", "V") or len(found[0].split()) > 3 else found[0]
    if found != expected:
        raise InputError(f"Table {table}: the extracted layout changed; expected {expected}, found {found}")


def _parse_supplement(table: int, body: list[str]) -> list[dict]:
    caption = SUPPLEMENT_CAPTION.match(body[0])
    where = f"Table {table}"
    if not caption:
        raise InputError(f"{where}: caption not understood: {body[0][:100]!r}")
    protocol = caption["protocol"].lower()
    assert protocol in PROTOCOLS
    if (caption["panel"] is None) != (protocol != "is"):
        raise InputError(f"{where}: only the IS tables name a panel")
    panel = caption["panel"] or CROSS_DOMAIN_PANEL
    magnification, taxonomy = _magnification(caption["mag"]), caption["taxonomy"]
    assert taxonomy in TAXONOMIES
    metric = f"macro_{caption['metric'].lower()}"
    models = parse_models(caption["models"], where)
    headings = [line.strip() for line in body[1:] if not _is_value_line(line)]
    expected = [*SUPPLEMENT_HEADINGS, *([f"CRA{caption['metric']}"] if protocol == "is" else []), "Wins"]
    if headings != expected:
        raise InputError(f"{where}: column headings {headings}, expected {expected}")
    values = [line for line in body[1:] if _is_value_line(line)]
    kinds = [_is_value_line(line) for line in body[1:]]  # the headings, then the value lines
    if len(values) != len(expected) or kinds != [False] * len(expected) + [True] * len(expected):
        raise InputError(f"{where}: {len(values)} value lines after the headings, expected {len(expected)}")
    wins = parse_wins(values[-1], f"{where} Wins")
    records = []
    for heading, line in zip(expected[:-1], values[:-1], strict=True):
        cells = parse_cells(line, f"{where} {heading}")
        if heading.startswith("CRA"):
            records += _records(table, panel, magnification, taxonomy, protocol, CRA_METRIC, None, models, cells, wins)
        else:
            records += _records(table, panel, magnification, taxonomy, protocol, metric, _readout(heading), models,
                                cells, wins)
    _check_dashes(records, where)
    return records


def _parse_table4(body: list[str]) -> list[dict]:
    caption = TABLE4_CAPTION.match(body[0])
    if not caption:
        raise InputError(f"Table 4: caption not understood: {body[0][:100]!r}")
    _check_layout(4, body[1:], TABLE4_LAYOUT)
    if not body[1].startswith("Model "):
        raise InputError("Table 4: the model line does not start with 'Model'")
    models = parse_models(body[1].removeprefix("Model "), "Table 4")
    values = [line for line in body[1:] if _is_value_line(line)]
    wins = parse_wins(values[-1], "Table 4 Sig. wins")
    magnification = _magnification(caption["mag"])
    records = []
    for (taxonomy, readout, metric), line in zip(TABLE4_COLUMNS, values[:-1], strict=True):
        cells = parse_cells(line, f"Table 4 {taxonomy} {readout or metric}")
        records += _records(4, MAIN_TEXT_PANEL, magnification, taxonomy, "is", metric, readout, models, cells, wins)
    return records


def crt_of(wins: list[list[int]]) -> list[float]:
    """CRT (Eq. 5): the mean of the three cross-domain protocols' win counts, to the printed 2 decimals."""
    return [round(sum(per_model) / len(per_model), DECIMALS) for per_model in zip(*wins, strict=True)]


def _parse_table5(body: list[str]) -> list[dict]:
    caption = TABLE5_CAPTION.match(body[0])
    if not caption:
        raise InputError(f"Table 5: caption not understood: {body[0][:100]!r}")
    _check_layout(5, body[1:], TABLE5_LAYOUT)
    models = parse_models(body[1], "Table 5")
    values = [line for line in body[1:] if _is_value_line(line)]
    magnification = _magnification(caption["mag"])
    per_protocol = len(TABLE5_PROTOCOL_COLUMNS) + 1
    groups = [values[k * per_protocol:(k + 1) * per_protocol] for k in range(len(TABLE5_PROTOCOLS))]
    wins = [parse_wins(group[-1], f"Table 5 {protocol} Sig. wins") for protocol, group in zip(TABLE5_PROTOCOLS, groups)]
    crt = crt_of(wins)
    records = []
    for protocol, group, protocol_wins in zip(TABLE5_PROTOCOLS, groups, wins, strict=True):
        assert protocol in PROTOCOLS
        for (taxonomy, metric), line in zip(TABLE5_PROTOCOL_COLUMNS, group[:-1], strict=True):
            cells = parse_cells(line, f"Table 5 {protocol} {taxonomy} {metric}")
            records += _records(5, MAIN_TEXT_PANEL, magnification, taxonomy, protocol, metric, "Nuc", models, cells,
                                protocol_wins, crt)
    return records


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    """The published table's dtypes: text as ``string`` (missing = <NA>), row int, mean/sd/crt float, wins Int64."""
    frame = frame[COLUMNS].copy()
    for column in ("panel", "magnification", "taxonomy", "protocol", "metric", "readout", "model"):
        frame[column] = frame[column].astype("string")
    frame["table"] = frame["table"].astype("int64")
    frame["row"] = frame["row"].astype("int64")
    for column in ("mean", "sd", "crt"):
        frame[column] = pd.to_numeric(frame[column]).astype("float64")
    frame["wins"] = pd.to_numeric(frame["wins"]).astype("Int64")
    return frame.reset_index(drop=True)


def parse_tables(excerpt: str) -> pd.DataFrame:
    """The tidy table of every block of the excerpt: one row per (table, column, model); columns
    :data:`COLUMNS` (README.md next to the CSV says what each holds)."""
    records = []
    for table, body in _blocks(excerpt):
        if table == 4:
            records += _parse_table4(body)
        elif table == 5:
            records += _parse_table5(body)
        else:
            records += _parse_supplement(table, body)
    if not records:
        raise InputError("the excerpt holds no tables")
    return _typed(pd.DataFrame.from_records(records, columns=COLUMNS))


def to_csv_text(frame: pd.DataFrame) -> str:
    """The CSV as committed: values with the printed two decimals, missing values empty."""
    buffer = io.StringIO()
    frame.to_csv(buffer, index=False, float_format=f"%.{DECIMALS}f", lineterminator="\n")
    return buffer.getvalue()


def read_csv_text(text: str) -> pd.DataFrame:
    """The committed CSV's text → the typed table (the inverse of :func:`to_csv_text`)."""
    frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    if list(frame.columns) != COLUMNS:
        raise InputError(f"unexpected columns {list(frame.columns)}, expected {COLUMNS}")
    frame = frame.replace("", None)
    return _typed(frame)


# ----------------------------------------------------------------------- CLI


def _diff_summary(name: str, committed: str, derived: str, limit: int = 20) -> str:
    diff = list(difflib.unified_diff(committed.splitlines(), derived.splitlines(), f"committed {name}",
                                     f"re-derived {name}", n=0, lineterm=""))
    changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    shown = "\n".join(diff[:limit]) + ("\n..." if len(diff) > limit else "")
    return f"{name}: {changed} changed lines\n{shown}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or, with --check, verify) the committed excerpt and CSV."""
    parser = argparse.ArgumentParser(prog="python -m cellpath.published.seed_tables",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=Path, help="the paper's extracted text (000_a86b2b9496567a9c.txt)")
    parser.add_argument("--check", action="store_true", help="re-derive and compare with the committed files")
    args = parser.parse_args(argv)
    if args.seed is None and not args.check:
        parser.error("--seed is needed to rewrite the files (or pass --check)")
    if args.seed is not None:
        command = f"python -m cellpath.published.seed_tables --seed {args.seed}"
        if args.check and EXCERPT_PATH.exists():  # keep the command line the excerpt was made with
            made_by = next((line for line in EXCERPT_PATH.read_text(encoding="utf-8").split("\n")
                            if line.startswith("# made by: ")), None)
            command = made_by.removeprefix("# made by: ") if made_by else command
        excerpt = extract_table_text(args.seed.read_bytes().decode("utf-8"), command)
    else:
        excerpt = EXCERPT_PATH.read_text(encoding="utf-8")
    csv_text = to_csv_text(parse_tables(excerpt))
    if args.check:
        problems = []
        for path, derived in ((EXCERPT_PATH, excerpt), (CSV_PATH, csv_text)):
            committed = path.read_text(encoding="utf-8") if path.exists() else ""
            if committed != derived:
                problems.append(_diff_summary(path.name, committed, derived))
        if problems:
            print("\n\n".join(problems), file=sys.stderr)
            return 1
        print(f"{EXCERPT_PATH.name} and {CSV_PATH.name} are up to date ({csv_text.count(chr(10)) - 1} rows)")
        return 0
    PUBLISHED_DIR.mkdir(parents=True, exist_ok=True)
    EXCERPT_PATH.write_text(excerpt, encoding="utf-8")
    CSV_PATH.write_text(csv_text, encoding="utf-8")
    print(f"wrote {EXCERPT_PATH} and {CSV_PATH} ({csv_text.count(chr(10)) - 1} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
