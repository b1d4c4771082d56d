"""Iterations with W ops (zero bubble): predicted on the bundled profiles that have the B/W
split, and measured on 2 CPU stages.

    python bench/zero_bubble.py [--minibatch 32] [--time-limit 8] [--markdown]
    python bench/zero_bubble.py --measure [--rounds 3] [--steps 6] [--markdown]
    python bench/zero_bubble.py --small [--markdown]

For each profile, at two memory limits (1F1B's peak, which ZB-H1 keeps, and ZB-H2's): `umopt solve`
without W ops, `umopt solve --zero-bubble` (umopt's schedule with W ops: the GA searching
partitions and W placement together, W ops placed in the schedules found, then filled and
climbed; and the best equal ZB-H1 and ZB-H2), and the best equal 1F1B, all within that limit.
Targets (issue 34): with W ops umopt beats umopt without them where backward >= forward, and the
best equal ZB-H1 by at least 5% on the heterogeneous profiles. The synthetic profiles split each
backward 50/50 between input and weight gradients (a transformer layer's B and W each cost about
one forward); vgg16-split-cpu is VGG16 measured here with `--split-backward` (vgg16-cpu and
gpt-cpu predate the split and are left out).

With --measure: a GPT of 4 layers on 2 CPU stages x 1 thread, `umopt profile --split-backward`
(which times the split as the runtime runs it, and fits to probe runs), then umopt's best schedule
without W ops, `umopt solve --zero-bubble`'s (where it has W ops), and the best equal ZB-H1 and 1F1B, run in turns on the
same processes (--rounds times): predicted and measured ms, their ratio, and each against the others.

With --small: on small synthetic instances, how far umopt's W search (placement in the schedules
found, and the GA with W caps) is from the optimum among schedules with a W op per B chunk (the
free-order CP-SAT model, proven).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from umopt.costmodel import CostTables, simulate
from umopt.formats.profile import bundled_profiles, load_profile, save_profile
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.measure import ProfileOptions
from umopt.probes import profile_in_pipeline
from umopt.run.launch import launch
from umopt.run.options import RunOptions
from umopt.search.problem import Problem
from umopt.search.solve import make_problem, solve
from umopt.search.solvers.cpsat import solve_with_weight_ops
from umopt.search.zerobubble import best_with_weight_ops, search_with_weight_ops, zb_h1, zb_h2
from umopt.synthetic import synthetic_profile

COLUMNS = (
    "profile",
    "memory limit MiB",
    "1F1B equal ms",
    "ZB-H1 equal ms",
    "ZB-H2 equal ms",
    "umopt ms",
    "umopt + W ms",
    "x 1F1B",
    "x ZB-H1",
    "x ZB-H2",
    "x umopt",
    "peak MiB +W",
)


MEASURE_COLUMNS = ("schedule", "W ops", "pred ms", "meas ms", "meas / pred", "meas x 1F1B", "meas x ZB-H1")


def measure(B: int, rounds: int, steps: int, time_limit: float) -> list[tuple]:
    with tempfile.TemporaryDirectory(prefix="umopt-zb-") as tmp:
        out = Path(tmp)
        args = {"layers": 4, "d_model": 192, "heads": 4, "vocab": 512, "seq_len": 64}
        save_profile(
            profile_in_pipeline(
                ProfileOptions(model="gpt", model_args=args, stages=2, max_size=B, split_backward=True),
                probe_minibatch=B,
            ),
            out / "p.json",
        )
        prof = load_profile(out / "p.json")
        problem = make_problem(prof, B, False)
        plain = solve(prof, B, time_limit=time_limit, seed=0)
        plans = {"umopt": plain.schedule.op_lists(), "1f1b_equal": plain.onef1b.candidate.ops()}
        with_w = solve(prof, B, time_limit=time_limit, seed=0, zero_bubble=True)
        if any(op[0] == "W" for st in with_w.schedule.stages for op in st.ops):
            plans["umopt_w"] = with_w.schedule.op_lists()
        else:  # W ops did not pay in prediction: measure the best W schedule all the same ("forced")
            found = search_with_weight_ops(problem, [plain.choice.candidate], time_limit / 2)
            if found is not None:
                plans["umopt_w_forced"] = found[0]
        zb = zb_h1(problem, seconds=time_limit / 2)
        if zb is not None:
            plans["zbh1_equal"] = zb[1]
        paths = []
        for name, ops in plans.items():
            tl = simulate(problem.tables, ops, B)
            save_schedule(
                make_schedule(
                    prof, B, False, ops, tl, {"name": name, "status": "feasible", "seconds": 0.0}, {}
                ),
                str(out / f"{name}.json"),
            )
            paths.append(str(out / f"{name}.json"))
        reports = launch(
            RunOptions(
                schedules=paths, steps=steps, warmup=2, rounds=rounds, report=str(out / "{name}_report.json")
            ),
            quiet=True,
        ).reports
        meas = {n: r.measured_iteration_ms for n, r in zip(plans, reports)}
        rows = []
        for (name, ops), r in zip(plans.items(), reports):
            rows.append(
                (
                    name,
                    "yes" if any(op.kind == "W" for st in ops for op in st) else "no",
                    f"{r.predicted_iteration_ms:.1f}",
                    f"{r.measured_iteration_ms:.1f}",
                    f"{r.measured_over_predicted:.3f}",
                    f"{meas['1f1b_equal'] / meas[name]:.3f}",
                    f"{meas['zbh1_equal'] / meas[name]:.3f}" if "zbh1_equal" in meas else "-",
                )
            )
        return rows


SMALL_COLUMNS = ("S", "B", "seed", "umopt + W ms", "optimum ms", "gap", "proven", "cp-sat s")


def small(time_limit: float) -> list[tuple]:

    rows = []
    for S, B, seed in [(2, 4, 1), (2, 6, 3), (3, 4, 2), (3, 6, 5), (4, 6, 4), (4, 8, 6)]:
        prof = synthetic_profile(S, max_size=4, seed=seed)
        problem = Problem(CostTables.from_profile(prof), B)
        plain = solve(prof, B, time_limit=time_limit, seed=0)
        # what solve --zero-bubble does before its exact model: W ops placed in the schedules
        # found, and the GA with W caps started from them
        seeds = [plain.choice.candidate] + [
            c
            for c in (plain.gpipe.candidate, plain.onef1b.candidate, *plain.result.alternatives)
            if c is not None
        ]
        heur = min(best_with_weight_ops(problem, c.ops())[1].iteration_ms for c in seeds)
        heur = min(heur, search_with_weight_ops(problem, seeds, time_limit)[1].iteration_ms)
        t0 = time.perf_counter()
        ops, _bound, proven = solve_with_weight_ops(problem, 60)
        sec = time.perf_counter() - t0
        best = simulate(problem.tables, ops, B, record=False).iteration_ms
        rows.append(
            (
                str(S),
                str(B),
                str(seed),
                f"{heur:.2f}",
                f"{best:.2f}",
                f"{100 * (heur - best) / best:.1f}%",
                "yes" if proven else "no",
                f"{sec:.1f}",
            )
        )
    return rows


def _print(columns, rows, markdown: bool, title: str) -> None:
    if markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("profile", "schedule") else "right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minibatch", "-B", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=8.0)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--measure", action="store_true", help="measure on 2 CPU stages instead")
    ap.add_argument(
        "--small", action="store_true", help="the W placement against the exact model on small instances"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    if a.small:
        _print(
            SMALL_COLUMNS,
            small(min(a.time_limit, 4.0)),
            a.markdown,
            "W placement against the exact optimum with W ops",
        )
        return
    if a.measure:
        _print(
            MEASURE_COLUMNS,
            measure(a.minibatch, a.rounds, a.steps, a.time_limit),
            a.markdown,
            f"measured on 2 CPU stages, minibatch {a.minibatch}",
        )
        return
    rows = []
    for name in bundled_profiles():
        prof = load_profile(name)
        if any(st.backward_input_ms is None for st in prof.stages):
            continue
        problem = make_problem(prof, a.minibatch, False)
        for memory, found in (("1F1B's", zb_h1(problem)), ("ZB-H2's", zb_h2(problem))):
            limit = max(found[2].peak_memory_bytes)
            at = prof.with_memory_limit(limit)
            plain = solve(at, a.minibatch, time_limit=a.time_limit, seed=0)
            zb = solve(at, a.minibatch, time_limit=a.time_limit, seed=0, zero_bubble=True)
            it = zb.timeline.iteration_ms
            x = lambda base: "-" if base is None else f"{base / it:.3f}"  # noqa: E731
            ms = lambda base: "-" if base is None else f"{base:.2f}"  # noqa: E731
            rows.append(
                (
                    name,
                    f"{memory} {limit / 2**20:.0f}",
                    ms(zb.onef1b.iteration_ms),
                    ms(zb.zbh1.iteration_ms),
                    ms(zb.zbh2.iteration_ms),
                    f"{plain.timeline.iteration_ms:.2f}",
                    f"{it:.2f}",
                    x(zb.onef1b.iteration_ms),
                    x(zb.zbh1.iteration_ms),
                    x(zb.zbh2.iteration_ms),
                    x(plain.timeline.iteration_ms),
                    f"{max(zb.timeline.peak_memory_bytes) / 2**20:.0f}",
                )
            )
    _print(
        COLUMNS,
        rows,
        a.markdown,
        f"predicted ms per iteration, minibatch {a.minibatch}, within the memory limit (MiB)",
    )


if __name__ == "__main__":
    main()
