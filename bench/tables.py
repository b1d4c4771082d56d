"""How the benchmarks print: a table and its summary lines, as rich on a terminal (whole in a
log too) or as markdown for docs/results.md; and how a long one shows it is working (a bar on a
terminal, a line per piece of work in a log)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
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


@contextmanager
def working(total: int, what: str) -> Iterator:
    """``step(label)`` after each of ``total`` pieces of work: a bar on stderr where it is a
    terminal, else one line per piece with the time so far (a CI log shows the bench is alive)."""
    console = Console(stderr=True)
    t0 = time.perf_counter()
    if not console.is_terminal:
        done = [0]

        def line(label: str) -> None:
            done[0] += 1
            console.print(
                f"{what}: {done[0]}/{total} {label} [{time.perf_counter() - t0:.0f} s]", markup=False
            )

        yield line
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{what}: {label}")

        yield advance
