"""Every solver against the baselines and the lower bound, on the bundled profiles.

    python bench/solver_quality.py [--time-limit 20] [--quick]

Targets (issue 2): on the measured 4-stage VGG16 CPU profile the default solver (``auto``) is at
least 8% faster than the best equal GPipe schedule within 20 s, and clearly better than a plain
hill climb over per-stage partitions (started from the best equal GPipe and from the best equal
1F1B schedule; the better one is shown). Every number is the reference simulator's.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from umopt.formats.profile import load_profile
from umopt.schedules.partition import backwards_in_sample_order
from umopt.search.baselines import gpipe_equal, onef1b_equal
from umopt.search.bounds import Scope, fast_bound_ms
from umopt.search.solve import make_problem
from umopt.search.solvers import SOLVERS
from umopt.search.solvers.local import hill_climb

CASES = [
    ("vgg16-cpu", 32),
    ("vgg16-cpu", 64),
    ("vgg16-cpu", 128),
    ("gpt-cpu", 64),
    ("gpt-sim", 64),
    ("transformer8-sim", 128),
    ("transformer8-sim", 256),
]


COLUMNS = (
    "profile",
    "B",
    "gpipe_equal",
    "1f1b_equal",
    "hill climb",
    "dp",
    "ramp",
    "greedy",
    "ga",
    "auto",
    "auto order",
    "auto s",
    "bound",
    "auto gap",
    "1F1B bound",
    "gap in 1F1B",
)


def run(time_limit: float, cases=CASES, say=print) -> list[list[str]]:
    """One row of cells per case: iteration ms (speedup over the best equal GPipe)."""
    rows = []
    for name, B in cases:
        problem = make_problem(load_profile(name), B, recompute=False)
        gp, of, lb = gpipe_equal(problem), onef1b_equal(problem), fast_bound_ms(problem)

        def cell(it: float) -> str:
            return f"{it:.1f} ({gp.iteration_ms / it:.3f}x)"

        climbs = [
            hill_climb(problem, c, time.perf_counter() + time_limit)[0] for c in (gp.candidate, of.candidate)
        ]
        climb = min(c.iteration_ms for c in climbs)
        row = [name, str(B), cell(gp.iteration_ms), cell(of.iteration_ms), cell(climb)]
        for solver in ("dp", "ramp", "greedy", "ga", "auto"):
            t0 = time.perf_counter()
            res = SOLVERS[solver](problem, time_limit=time_limit, seed=0)
            seconds = time.perf_counter() - t0
            it = res.candidate.simulate(problem).iteration_ms
            row.append(cell(it))
        row += [res.candidate.order, f"{seconds:.1f}", f"{lb:.1f}", f"{100 * (it - lb) / lb:.1f}%"]
        # the bound within the 1F1B family holds for auto's schedule when it is of that family
        lb1 = fast_bound_ms(problem, Scope.IN_ORDER)
        in_order = backwards_in_sample_order(res.candidate.ops())
        row += [f"{lb1:.1f}", f"{100 * (it - lb1) / lb1:.1f}%" if in_order else "-"]
        rows.append(row)
        say(f"done {name} B={B}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--quick", action="store_true", help="first two cases only")
    args = ap.parse_args()
    rows = run(args.time_limit, CASES[:2] if args.quick else CASES)
    table = Table(title=f"iteration ms (speedup over best equal GPipe); solvers get {args.time_limit:g} s")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
