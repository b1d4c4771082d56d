"""How the benchmarks print: a table and its summary lines, as rich on a terminal (whole in a
log too) or as markdown for docs/results.md."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table


def print_table(
    title: str,
    columns: Sequence[str],
    cells: Sequence[Sequence[str]],
    summary: Sequence[str],
    markdown: bool,
    left: Sequence[str] = (),
) -> None:
    if markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join("---" if c in left else "---:" for c in columns) + "|")
        for c in cells:
            print("| " + " | ".join(c) + " |")
        print()
        for line in summary:
            print(f"- {line}")
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", no_wrap=True)
    for c in cells:
        table.add_row(*c)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for line in summary:
        console.print(line, markup=False)
