"""Plain-text tables for command output: GitHub markdown, text columns left-aligned, numeric
columns right-aligned (`llmserve estimate` and the benchmarks print them)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def format_cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table; text columns left-aligned, numeric columns right-aligned."""
    cells = [[format_cell(value) for value in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, the table has {len(headers)} columns")
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(isinstance(row[i], (int, float)) for row in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        ("-" * (w - 1) + ":") if right else "-" * w
        for w, right in zip(widths, numeric, strict=True)
    ]
    return "\n".join([line(headers), line(rule), *(line(row) for row in cells)])
