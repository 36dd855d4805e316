"""The text tables the benchmark reports print: a :class:`Column` per column, one formatter.

Use: list the columns, then :func:`table_lines` gives the header line and one line per row
(cells joined by one space)::

    cols = [Column("codec", 20, "codec", left=True), Column("x ref", 8, "x_reference", ".2f"),
            span_column("x_reference_range", ".2f", 11)]
    print("\\n".join(table_lines(cols, report["rows"])))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """One column: ``header``, its ``width``, the ``value`` of a row (a key of the row, or a
    function of it), the value's format ``spec`` (``format(value, spec)``), the text of a
    ``None`` value (``missing``), and right alignment unless ``left``."""

    header: str
    width: int
    value: str | Callable[[Any], Any]
    spec: str = ""
    left: bool = False
    missing: str = "-"

    def _align(self, text: str) -> str:
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"

    def head(self) -> str:
        """The header, aligned to the column."""
        return self._align(self.header)

    def cell(self, row) -> str:
        """The cell of ``row``, formatted and aligned."""
        v = row[self.value] if isinstance(self.value, str) else self.value(row)
        return self._align(self.missing if v is None else format(v, self.spec))


def span_column(key: str, spec: str, width: int, header: str = "range") -> Column:
    """A column of a row's ``[lo, hi]`` pair at ``key``, written ``lo-hi`` (each ``format(x, spec)``)."""
    return Column(header, width, lambda r: "-".join(format(x, spec) for x in r[key]))


def header_line(columns: Sequence[Column]) -> str:
    """The line of the columns' headers."""
    return " ".join(c.head() for c in columns)


def row_line(columns: Sequence[Column], row) -> str:
    """The line of one row."""
    return " ".join(c.cell(row) for c in columns)


def table_lines(columns: Sequence[Column], rows) -> list[str]:
    """The header line, then one line per row of ``rows``."""
    return [header_line(columns)] + [row_line(columns, r) for r in rows]
