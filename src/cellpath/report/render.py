"""HTML and Markdown rendering of the report (Jinja2 template, images inlined as base64 PNG)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

from cellpath.report import tables


@dataclass
class Table:
    """A display table: strings, the index shown as the first column, best/second-best marks per column."""

    name: str
    title: str
    caption: str
    frame: pd.DataFrame
    marks: dict[str, tuple[object, object]] = field(default_factory=dict)
    #: why the table can be empty in this run (shown instead of an empty table)
    empty_reason: str = "see the parameters: protocol, readouts, magnifications"

    @property
    def empty(self) -> bool:
        """No rows, or no cell with a value (every cell "–" or blank)."""
        return self.frame.empty or bool(self.frame.astype(str).isin(["–", "", "nan"]).all().all())

    def html(self) -> Markup:
        if self.empty:
            return Markup(f'<p class="note" id="{escape(self.name)}-empty">{escape(self.title)}: no data in this run '
                          f'({escape(self.empty_reason)}).</p>')
        header = "".join(f"<th>{escape(c)}</th>" for c in [self.frame.index.name or "", *self.frame.columns])
        rows = []
        for index, row in self.frame.iterrows():
            cells = [f"<th>{escape(index)}</th>"]
            for column, value in row.items():
                best, second = self.marks.get(column, (None, None))
                css = ' class="best"' if index == best else ' class="second"' if index == second else ""
                cells.append(f"<td{css}>{escape(value)}</td>")
            rows.append(f"<tr>{''.join(cells)}</tr>")
        return Markup(f'<div class="scroll"><table id="{escape(self.name)}"><thead><tr>{header}</tr></thead>'
                      f'<tbody>{"".join(rows)}</tbody></table></div>')

    def markdown(self) -> str:
        return f"### {self.title}\n\n{self.caption}\n\n{self.frame.to_markdown()}\n"


def data_uri(png: bytes) -> str:
    """``data:image/png;base64,…`` for an <img> src."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def render_html(context: dict) -> str:
    """The report page from ``templates/report.html.j2``."""
    env = Environment(loader=PackageLoader("cellpath.report", "templates"), autoescape=select_autoescape(["j2"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["data_uri"] = data_uri
    return env.get_template("report.html.j2").render(**context)


def display_table(name: str, title: str, caption: str, numeric: pd.DataFrame, percent_pairs: bool = True,
                  percent_columns: tuple[str, ...] = ("CRA",), shown: list[str] | None = None,
                  max_rows: int | None = None) -> tuple[Table, pd.DataFrame]:
    """A display table (``shown`` columns, first ``max_rows`` rows, best two marked) and the full numeric frame."""
    visible = numeric if shown is None else numeric[shown]
    visible = visible if max_rows is None else visible.head(max_rows)
    frame = tables.display(visible, percent_pairs=percent_pairs, percent_columns=percent_columns)
    return Table(name, title, caption, frame, tables.best_two(visible)), numeric
