"""How close each solver gets to optimal: iteration ms, gap to the best proven bound, seconds.

    python bench/exact_solvers.py [--time-limit 60] [--quick | --s4 | --s8]
    python bench/exact_solvers.py --small      # S=4, B=6 / 8 (CP-SAT proves the optimum) and 12
    python bench/exact_solvers.py --pairs      # S=4, B=16 / 32: the pair bounds given 15 s and 60 s
    python bench/exact_solvers.py --bounds --time-limit 30  # the fast bounds alone: stage cuts, untied, pair program untied and tied (each within --time-limit), 1F1B (about 12 minutes)

Issue 3's table: for the bundled profiles at S=4, B=32 (gpt-sim, gpt-cpu, vgg16-cpu) and S=8,
B=128 / 256 (transformer8-sim), every solver gets the same time limit. "bound" is the best lower
bound anyone proved for *every* schedule (any op order): the fast stage-cut bound
(``umopt.search.bounds``) or the free-order CP-SAT/MILP model's, whichever is higher; the spec's
simple bound is shown beside it. "gap" = iteration / bound - 1, so it is how far from optimal a
schedule is *at most*. ``cpsat[gpipe]`` and ``milp`` solve the GPipe-order models; their own
bounds hold only in GPipe order, so they are listed but never used as the table's bound.
"1F1B bound" holds among schedules whose stages run their B ops in sample order (1F1B with any
warm-ups, PipeDream-flush): the fast one, or the pair bound of that family where ``auto`` ran it
(S=4); for a schedule of that family the gap to it is shown in brackets.

Targets: S=4, B=32 proven optimal or gap <= 2% within 60 s; at S=8, B=256 ``auto`` is never
worse than ``ga`` alone. Every iteration time is the reference simulator's.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from umopt.formats.profile import load_profile
from umopt.schedules.family import GPIPE
from umopt.schedules.partition import backwards_in_sample_order
from umopt.search.baselines import gpipe_equal, onef1b_equal
from umopt.search.bounds import Scope, fast_bound_ms, pair_bound_ms, spec_bound
from umopt.search.solve import make_problem
from umopt.search.solvers import SOLVERS

CASES = [
    ("gpt-sim", 32),
    ("gpt-cpu", 32),
    ("vgg16-cpu", 32),
    ("transformer8-sim", 128),
    ("transformer8-sim", 256),
]
# (label, solver, the family searched alone: None for every order)
RUNS = [
    ("dp", "dp", None),
    ("ramp", "ramp", None),
    ("greedy", "greedy", None),
    ("ga", "ga", None),
    ("cpsat", "cpsat", None),
    ("cpsat (gpipe)", "cpsat", GPIPE),
    ("milp", "milp", None),
    ("auto", "auto", None),
]


def run(time_limit: float, cases=CASES, say=print) -> list[dict]:
    out = []
    for name, B in cases:
        problem = make_problem(load_profile(name), B, recompute=False)
        t0 = time.perf_counter()
        fast = fast_bound_ms(problem)
        fast_s = time.perf_counter() - t0
        in_order = fast_bound_ms(problem, Scope.IN_ORDER)
        gp = gpipe_equal(problem).iteration_ms
        results = []
        for label, solver, order in RUNS:
            t0 = time.perf_counter()
            res = SOLVERS[solver](problem, time_limit=time_limit, seed=0, order=order)
            seconds = time.perf_counter() - t0
            it = res.candidate.simulate(problem).iteration_ms
            scope = res.bound_scope
            results.append(
                {
                    "label": label,
                    "it": it,
                    "seconds": seconds,
                    "status": res.status,
                    "scope": scope,
                    "bound": res.lower_bound_ms,
                    "note": "; ".join(res.notes),
                    "in_order": backwards_in_sample_order(res.candidate.ops()),
                    "bound_1f1b": res.lower_bound_1f1b_ms,
                }
            )
            say(f"{name} B={B} {label}: {it:.2f} ms, {res.status}, {seconds:.1f} s")
        any_order = [r["bound"] for r in results if r["scope"] == "any order" and r["bound"] is not None]
        bound = max([fast, *any_order])
        out.append(
            {
                "profile": name,
                "B": B,
                "S": problem.num_stages,
                "gpipe_equal": gp,
                "spec_bound": spec_bound(problem),
                "fast_bound": fast,
                "fast_seconds": fast_s,
                "bound": bound,
                # the fast one, or auto's pairs of the 1F1B family where it ran them
                "bound_1f1b": max(
                    [bound, in_order, *(r["bound_1f1b"] for r in results if r["bound_1f1b"] is not None)]
                ),
                "results": results,
            }
        )
    return out


def table(rows: list[dict], time_limit: float) -> Table:
    tab = Table(
        title=f"iteration ms / gap to the best any-order bound (to the 1F1B-order bound, for 1F1B-order schedules) / seconds; "
        f"every solver gets {time_limit:g} s"
    )
    for col in (
        "profile",
        "S",
        "B",
        "spec bound",
        "best bound",
        "1F1B bound",
        *[label for label, _, _ in RUNS],
    ):
        tab.add_column(col, justify="right")
    for row in rows:
        cells = []
        for r in row["results"]:
            gap = 100 * (r["it"] / row["bound"] - 1)
            mark = " opt" if r["status"] == "optimal" and r["scope"] == "any order" else ""
            in_order = f" ({100 * (r['it'] / row['bound_1f1b'] - 1):.1f}%)" if r["in_order"] else ""
            cells.append(f"{r['it']:.1f} / {gap:.1f}%{in_order}{mark} / {r['seconds']:.0f}s")
        tab.add_row(
            row["profile"],
            str(row["S"]),
            str(row["B"]),
            f"{row['spec_bound']:.1f}",
            f"{row['bound']:.1f}",
            f"{row['bound_1f1b']:.1f}",
            *cells,
        )
    return tab


# Where CP-SAT proves the optimum over every order within a minute or two (B=6, 8): the truth to
# measure the fast solvers and the bounds against; at B=12 it does not, and the rows compare the
# bounds with the best schedule found (S=4, B=32 has no such reference)
SMALL_CASES = [(name, B) for name in ("gpt-sim", "gpt-cpu", "vgg16-cpu") for B in (6, 8, 12)]


def run_small(
    ga_time: float, exact_time: float, pair_time: float = 20.0, cases=SMALL_CASES, say=print
) -> Table:
    tab = Table(
        title=f"S=4, small B: the proven optimum (cpsat, free order, up to {exact_time:g} s) against the fast bound, "
        f"the pair bound ({pair_time:g} s) and the GA ({ga_time:g} s, seed 0); gaps are to the optimum, or to the best "
        "schedule found where it is not proven"
    )
    for col in (
        "profile",
        "B",
        "optimum",
        "cpsat s",
        "fast bound",
        "gap",
        "pair bound",
        "gap",
        "1F1B bound",
        "ga",
        "ga gap",
        "best equal",
    ):
        tab.add_column(col, justify="right")
    for name, B in cases:
        problem = make_problem(load_profile(name), B, recompute=False)
        t0 = time.perf_counter()
        cp = SOLVERS["cpsat"](problem, time_limit=exact_time, seed=0, order=None)
        cp_s = time.perf_counter() - t0
        ga = (
            SOLVERS["ga"](problem, time_limit=ga_time, seed=0, order=None)
            .candidate.simulate(problem)
            .iteration_ms
        )
        best = min(cp.candidate.simulate(problem).iteration_ms, ga)
        fast, in_order = fast_bound_ms(problem), fast_bound_ms(problem, Scope.IN_ORDER)
        pair = pair_bound_ms(problem, pair_time, best)
        equal = min(
            r.iteration_ms for r in (gpipe_equal(problem), onef1b_equal(problem)) if r.candidate is not None
        )
        proven = cp.status == "optimal"
        say(
            f"{name} B={B}: cpsat {best:.2f} ({cp.status}, {cp_s:.0f} s), ga {ga:.2f}, bounds {fast:.2f} / {pair:.2f}"
        )
        gap = lambda v, ref: f"{100 * (v / ref - 1):.1f}%"  # noqa: E731
        tab.add_row(
            name,
            str(B),
            f"{best:.2f}" + ("" if proven else " (not proven)"),
            f"{cp_s:.0f}",
            f"{fast:.2f}",
            gap(best, fast),
            f"{pair:.2f}",
            gap(best, pair),
            f"{in_order:.2f}",
            f"{ga:.2f}",
            f"{100 * (ga / best - 1):.2f}%",
            f"{equal:.2f}",
        )
    return tab


PAIR_CASES = [(name, B) for name in ("gpt-sim", "gpt-cpu", "vgg16-cpu") for B in (16, 32)]


def run_pairs(ga_time: float, pair_times=(15.0, 60.0), cases=PAIR_CASES, say=print) -> Table:
    """Where the pair bound stops being exact search: what it proves in a solver's share of a
    minute (15 s, as `cpsat` and `auto` give it) and in a whole minute, against the GA's schedule;
    for every schedule and within the 1F1B family (the GA's schedules here are of it)."""
    tab = Table(
        title=f"S=4, B=16 and 32: the pair bounds (seconds given) against the fast bounds and the GA's schedule ({ga_time:g} s, seed 0); "
        "gaps are the schedule's to each bound; '1F1B': bounds within the 1F1B family"
    )
    cols = ["profile", "B", "ga", "fast", "gap", *(c for t in pair_times for c in (f"pair ({t:g} s)", "gap"))]
    cols += ["1F1B fast", "gap", *(c for t in pair_times for c in (f"1F1B pair ({t:g} s)", "gap"))]
    for col in cols:
        tab.add_column(col, justify="right")
    for name, B in cases:
        problem = make_problem(load_profile(name), B, recompute=False)
        res = SOLVERS["ga"](problem, time_limit=ga_time, seed=0, order=None)
        ga = res.candidate.simulate(problem).iteration_ms
        fast, fast_io = fast_bound_ms(problem), fast_bound_ms(problem, Scope.IN_ORDER)
        pairs = [pair_bound_ms(problem, t, ga, max_cells=None) for t in pair_times]
        pairs_io = [pair_bound_ms(problem, t, ga, max_cells=None, scope="1f1b order") for t in pair_times]
        say(
            f"{name} B={B}: ga {ga:.2f}, bounds {fast:.2f} / "
            + " / ".join(f"{v:.2f}" for v in pairs + [fast_io] + pairs_io)
        )
        gap = lambda v: f"{100 * (ga / v - 1):.1f}%"  # noqa: E731
        # a GPipe-order schedule is not of the 1F1B family: no gap to its bounds
        gap_io = gap if backwards_in_sample_order(res.candidate.ops()) else (lambda v: "n/a")  # noqa: E731
        row = [
            name,
            str(B),
            f"{ga:.2f}",
            f"{fast:.2f}",
            gap(fast),
            *(c for v in pairs for c in (f"{v:.2f}", gap(v))),
        ]
        row += [f"{fast_io:.2f}", gap_io(fast_io), *(c for v in pairs_io for c in (f"{v:.2f}", gap_io(v)))]
        tab.add_row(*row)
    return tab


BOUND_CASES = [
    ("gpt-sim", 8),
    ("vgg16-cpu", 8),
    ("gpt-sim", 12),
    ("gpt-cpu", 12),
    ("vgg16-cpu", 12),
    ("gpt-sim", 16),
    ("gpt-cpu", 16),
    ("vgg16-cpu", 16),
    *CASES,
]


def run_bounds(cases=BOUND_CASES, seconds: float = 60.0, say=print) -> Table:
    """The fast bounds side by side, each with its seconds: the stage cuts (any order), the
    untied bound (any order: every schedule turns into an untied one in sample order, docs/formats.md),
    the pair program on top of it, untied, then tied from there (any
    order, where B <= 32: seconds, not fast; auto runs them beside the GA; each program within
    ``seconds``, what it proved by then) and the 1F1B-family bound."""
    from umopt.search.bounds.heads import int_tables
    from umopt.search.bounds.in_order import sample_order_bound
    from umopt.search.bounds.pair_program import PASSES, UNTIED, pair_program_bound
    from umopt.search.bounds.stage_cuts import stage_bound
    from umopt.search.bounds.untied import untied_bound

    tab = Table(
        title="lower bounds, ms (seconds): all but the last hold for every schedule, the last within the 1F1B family"
    )
    for col in (
        "profile",
        "S",
        "B",
        "stage cuts",
        "untied",
        "pair program",
        "tied pair program",
        "1F1B family",
    ):
        tab.add_column(col, justify="right")
    for name, B in cases:
        problem = make_problem(load_profile(name), B, recompute=False)
        F, G, L = int_tables(problem)
        opt = problem.tables.optimizer_ms
        t0 = time.perf_counter()
        cuts = stage_bound(F, G, L, B, False)
        t1 = time.perf_counter()
        untied = untied_bound(F, G, L, B, cuts)
        t2 = time.perf_counter()
        in_order = sample_order_bound(F, G, L, B)
        t3 = t4 = time.perf_counter()
        # its seconds: until its last lift (it goes on asking above that until done or out of time)
        lifted = [t4]
        program = (
            pair_program_bound(
                F, G, L, B, untied, seconds, lambda _: lifted.append(time.perf_counter()), passes=[UNTIED]
            )
            if B <= 32
            else None
        )
        t5 = time.perf_counter()
        tied_lifts = [t5]
        tied = (
            pair_program_bound(
                F,
                G,
                L,
                B,
                program,
                seconds,
                lambda _: tied_lifts.append(time.perf_counter()),
                passes=PASSES[1:],
            )
            if B <= 32
            else None
        )
        pairs = (
            (cuts, t1 - t0),
            (untied, t2 - t1),
            (program, lifted[-1] - t4),
            (tied, tied_lifts[-1] - t5),
            (in_order, t3 - t2),
        )
        cells = [f"{v / 1000 + opt:.2f} ({dt:.1f} s)" if v is not None else "-" for v, dt in pairs]
        say(f"{name} B={B}: " + ", ".join(cells))
        tab.add_row(name, str(problem.num_stages), str(B), *cells)
    return tab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="the first case only")
    ap.add_argument("--s4", action="store_true", help="the S=4 cases only (about 21 minutes)")
    ap.add_argument("--s8", action="store_true", help="the S=8 cases only")
    ap.add_argument(
        "--small",
        action="store_true",
        help="only S=4, B=6, 8 and 12: the proven optimum (or best found) against the bounds",
    )
    ap.add_argument(
        "--pairs", action="store_true", help="only S=4, B=16 and 32: the pair bound given 15 s and 60 s"
    )
    ap.add_argument(
        "--bounds",
        action="store_true",
        help="the fast bounds alone (stage cuts, untied, pair program untied and tied, each within --time-limit, 1F1B family), 10-15 minutes at 30 s",
    )
    args = ap.parse_args()
    console = Console(width=260)
    if args.bounds:
        console.print(run_bounds(seconds=args.time_limit))
        return
    if args.pairs:
        console.print(run_pairs(ga_time=args.time_limit))
        return
    if args.small:
        console.print(run_small(ga_time=20.0, exact_time=2 * args.time_limit))
        return
    cases = (
        CASES[:1]
        if args.quick
        else [c for c in CASES if (c[0] == "transformer8-sim") == args.s8]
        if args.s4 or args.s8
        else CASES
    )
    rows = run(args.time_limit, cases)
    console.print(table(rows, args.time_limit))
    for row in rows:
        for r in row["results"]:
            if r["note"]:
                console.print(f"{row['profile']} B={row['B']} {r['label']}: {r['note']}")
        ga = next(r for r in row["results"] if r["label"] == "ga")
        auto = next(r for r in row["results"] if r["label"] == "auto")
        console.print(
            f"{row['profile']} B={row['B']}: auto {auto['it']:.2f} vs ga {ga['it']:.2f} ms "
            f"({'not worse' if auto['it'] <= ga['it'] + 1e-9 else 'WORSE'}); fast bound in {row['fast_seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
