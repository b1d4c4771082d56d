"""Does ``umopt solve --time-limit T`` end within T, whatever the size? The whole command, start-up
included, timed from outside, with its peak memory, up to umopt's largest minibatch.

    python bench/time_limits.py [--time-limit 2]     # about a minute
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from umopt.limits import MAX_MINIBATCH

CASES = [("gpt-sim", B) for B in (64, 512, 2048, MAX_MINIBATCH)] + [
    ("transformer8-sim", B) for B in (256, 2048, MAX_MINIBATCH)
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time-limit", type=float, default=2.0)
    args = p.parse_args()
    table = Table(
        title=f"umopt solve --time-limit {args.time_limit:g}: the whole command, timed from outside"
    )
    for col in ("profile", "B", "wall s", "over the limit s", "peak MiB (the solve process)", "exit"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for name, B in CASES:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "umopt.cli",
                    "solve",
                    name,
                    "-B",
                    str(B),
                    "--time-limit",
                    str(args.time_limit),
                    "-o",
                    str(Path(tmp) / "s.json"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory (KiB)
            wall = time.perf_counter() - t0
            table.add_row(
                name,
                str(B),
                f"{wall:.2f}",
                f"{wall - args.time_limit:+.2f}",
                f"{usage.ru_maxrss / 1024:.0f}",
                str(os.waitstatus_to_exitcode(status)),
            )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
