"""``umopt solve``: a profile and a minibatch in, a schedule file out, with its report."""

from __future__ import annotations

import math
import time
from typing import Optional

import click
from rich.table import Table

from umopt.errors import UmoptError

from .app import BYTES, _ms, _progress_bar, cli, command_start, load_solve_profile, out, own_model_hint

# the least --time-limit a solve with --chunks keeps (see the check below)
CHUNKS_MIN_TIME_LIMIT = 5.0


@cli.command()
@click.argument("profile_path", metavar="PROFILE")
@click.option("-B", "--minibatch", type=int, required=True, help="Samples per iteration (per pipeline).")
@click.option("--recompute", is_flag=True, help="Recompute activations in backward; B chunks become free.")
@click.option(
    "--solver",
    type=click.Choice(["auto", "ga", "greedy", "dp", "ramp", "equal", "cpsat", "milp"]),
    default="auto",
    show_default=True,
)
@click.option(
    "--order",
    default="auto",
    show_default=True,
    help="Op order: a schedule family's name (gpipe, 1f1b), or auto (the GA tries every family; cpsat/milp order each stage freely).",
)
@click.option("--time-limit", type=float, default=20.0, show_default=True, help="Seconds of search.")
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Random seed (the search is timed: the same seed gives the same result for the same amount of work, not always on a busier machine).",
)
@click.option(
    "--memory-limit",
    type=BYTES,
    default=None,
    help="Bytes per stage (16GiB, 512MB or a number); overrides the profile's limit.",
)
@click.option(
    "--dp",
    type=int,
    default=1,
    show_default=True,
    help="Data-parallel replicas of the pipeline: each stage all-reduces its gradients among them after its last op.",
)
@click.option(
    "--dp-gbps",
    type=float,
    default=None,
    help="Bus bandwidth of that all-reduce, Gbit/s (default: what `umopt profile --dp N` measured).",
)
@click.option(
    "--zero-bubble",
    is_flag=True,
    help="Split each backward: W ops (weight gradients) placed to fill bubbles; compares with the best equal ZB-H1 and ZB-H2.",
)
@click.option(
    "--chunks",
    default="1",
    show_default=True,
    help="Model chunks per rank (1-4, or auto: each): with more than one, interleaved and V-shaped schedules with unequal microbatches, against torch's multi-chunk schedules.",
)
@click.option(
    "--lengths",
    default=None,
    metavar="SAMPLER|FILE",
    help="Sequences of different lengths: -B sequences per minibatch drawn from a sampler (chat, instruction, lmsys, long-context) or read from a file of lengths; planned per stage by tokens, beside padding, packing, DynaPipe and WLB-LLM (docs/varlen.md).",
)
@click.option(
    "--minibatches",
    type=int,
    default=1,
    show_default=True,
    help="With --lengths: plan a stream of this many minibatches, each warm-started from the last, and print tokens per second (no schedule file).",
)
@click.option(
    "--budget-ms",
    type=float,
    default=15.0,
    show_default=True,
    help="With --lengths: the planner's time per minibatch (what a training step spends on it).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Schedule file to write.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Gantt chart PNG: best equal GPipe above, this schedule below.",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="Chrome-trace JSON of the predicted timelines (Perfetto).",
)
def solve(
    profile_path,
    minibatch,
    recompute,
    solver,
    order,
    time_limit,
    seed,
    memory_limit,
    dp,
    dp_gbps,
    zero_bubble,
    chunks,
    lengths,
    minibatches,
    budget_ms,
    output,
    plot,
    trace,
) -> None:
    """Search unequal per-stage partitions for PROFILE (a path or a bundled profile's name)."""
    started = command_start()  # the time limit covers the whole command
    if not (0 < time_limit < math.inf):  # also NaN; checked before what is left of it is computed
        raise UmoptError(f"--time-limit must be a positive number of seconds, got {time_limit}")
    from umopt.search.solve_chunks import parse_chunks

    chunk_counts = parse_chunks(chunks)
    profile = load_solve_profile(profile_path, memory_limit)  # a wrong path is the first thing said
    if lengths is not None:
        from .solve_lengths import solve_lengths

        given = [
            name
            for name, on in (
                ("--solver", solver != "auto"),
                ("--order", order != "auto"),
                ("--zero-bubble", zero_bubble),
            )
            if on
        ]
        if given:
            raise UmoptError(f"--lengths plans on its own: it takes no {', '.join(given)}")
        solve_lengths(
            profile, lengths, minibatch, minibatches, budget_ms, recompute, time_limit, seed,
            memory_limit, dp, dp_gbps, output, plot, trace, chunk_counts,
        )  # fmt: skip
        return
    if output is None:
        raise UmoptError("give -o/--output, the schedule file to write")
    if minibatches != 1:
        raise UmoptError("--minibatches plans a stream of sequences of different lengths: give --lengths")
    from umopt.fileio import check_writable
    from umopt.formats.schedule import save_schedule
    from umopt.search.solve import allreduce_for
    from umopt.search.solve import solve as run_solve

    for path in filter(None, (output, plot, trace)):
        check_writable(path)
    allreduce = allreduce_for(profile, dp, dp_gbps)
    if chunk_counts != (1,):
        from umopt.search.peers.schedules import TORCH_EXIT_S

        if solver != "auto" or order != "auto":
            raise UmoptError("--chunks searches on its own: it takes no --solver or --order")
        if time_limit < CHUNKS_MIN_TIME_LIMIT:
            raise UmoptError(
                f"--chunks needs --time-limit {CHUNKS_MIN_TIME_LIMIT:g} or more (it imports torch's schedules, "
                f"seconds on a CPU, and scores them before its own search), got {time_limit:g}"
            )
        _solve_chunked(
            profile,
            minibatch,
            chunk_counts,
            recompute,
            # what is left of it, less the process's exit once torch's schedules are imported
            max(0.5, time_limit - (time.perf_counter() - started) - TORCH_EXIT_S),
            seed,
            zero_bubble,
            output,
            plot,
            trace,
            allreduce,
        )
        return
    with _progress_bar(f"solve ({solver})") as bar:
        progress = _best_so_far(bar)
        report = run_solve(
            profile,
            minibatch,
            recompute=recompute,
            solver=solver,
            time_limit=max(0.5, time_limit - (time.perf_counter() - started)),  # what is left of it
            seed=seed,
            progress=progress,
            order=order,
            dp=allreduce,
            zero_bubble=zero_bubble,
        )
    panels = (
        [(f"best equal GPipe (M={report.gpipe.microbatches})", report.gpipe_timeline)]
        if report.gpipe_timeline
        else []
    )
    panels.append((_pick_name(report), report.timeline))
    if plot:
        from umopt.plot import gantt

        gantt(panels, plot, title=f"{profile.model.name}, {profile.num_stages} stages, minibatch {minibatch}")
    if trace:
        from umopt.trace import write_trace

        write_trace(panels, trace)
    save_schedule(report.schedule, output)  # last: a schedule file means everything was written
    _print_report(report)
    if minibatch > profile.max_size:
        out.print(
            f"chunks are at most {profile.max_size} samples: the profile was measured up to {profile.max_size} (umopt profile --max-size, "
            f"or profile_stages' sample batch); profile to {min(minibatch, 2 * profile.max_size)} or more if larger chunks may run faster per sample",
            markup=False,
            highlight=False,
        )
    written = [output] + [p for p in (plot, trace) if p]
    out.print(f"wrote {', '.join(written)}")
    _print_next(report.schedule, output, profile)


def _print_next(schedule, output: str, profile) -> None:
    """The next step: where the file has candidates, what selection measures and the steps it needs
    ([Note: selection while training])."""
    from umopt.run.steps import RUN_STEPS, RUN_WARMUP, SELECT_MOST, selection_steps_needed
    from umopt.zoo import runnable

    if not runnable(profile.model.name):
        out.print(own_model_hint(profile, lengths=False), markup=False, highlight=False)
        return
    n = 1 + len(schedule.candidates)
    if n == 1:
        out.print(f"next: umopt run {output}", markup=False, highlight=False)
        return
    need = selection_steps_needed(n)
    steps = max(RUN_STEPS, math.ceil(need / SELECT_MOST) - RUN_WARMUP)
    rivals = " and ".join(f"{c.name} ({c.predicted_iteration_ms:.2f} ms)" for c in schedule.candidates)
    out.print(
        f"next: umopt run {output} --steps {steps}: its first {need} steps measure the pick beside {rivals} "
        f"in turns and keep the fastest (with fewer steps it plays the pick alone)",
        markup=False,
        highlight=False,
    )


def _pick_name(report) -> str:
    """The pick's name in the table and the picture: the solver that found it, or the equal
    schedule it is (umopt: gpipe), with W ops marked."""
    solver = report.schedule.solver
    winner = report.result.winner
    name = f"umopt {solver.name}" if not winner or winner == solver.name else f"umopt ({winner})"
    ops = report.choice.candidate.ops()
    for base in (report.gpipe, report.onef1b):
        if base.candidate is not None and (report.choice.name == base.name or base.candidate.ops() == ops):
            name = f"umopt: {base.candidate.order}"
    if any(op[0] == "W" for st in report.schedule.stages for op in st.ops):
        name += " + W"
    return name


def _chunks(schedule_or_ops) -> str:
    """Chunk counts per stage and, where they differ, the sizes: "8", "7..14", "6 (10-11)"."""
    ops = schedule_or_ops.op_lists() if hasattr(schedule_or_ops, "op_lists") else schedule_or_ops
    forwards = [[op[2] - op[1] for op in st if op[0] == "F"] for st in ops]
    counts = sorted({len(f) for f in forwards})
    sizes = sorted({b for f in forwards for b in f})
    text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"
    if len(counts) == 1 and len(sizes) > 1:
        text += f" ({sizes[0]}-{sizes[-1]})"
    return text


_STATUS = {"feasible": "feasible (valid, not proven optimal)", "optimal": "optimal (proven)"}

_FOOTER = (
    "ms: predicted iteration; x gpipe/1f1b: speedup over the best equal schedule; gap: at most this far from "
    "optimal (above the lower bound); bubble: idle share of stage time; chunks: microbatches per stage (sizes "
    "where they differ)"
)


def _best_so_far(bar):
    """A solver's progress callback (share done, best ms so far) moving ``bar``."""
    task = bar.add_task("", total=1.0)
    lowest = [math.inf]  # over every phase: a later phase's own best may be worse than an earlier one's

    def progress(frac: float, best: float) -> None:
        lowest[0] = min(lowest[0], best)
        bar.update(
            task,
            completed=frac,
            description=f"best {lowest[0]:.3f} ms" if math.isfinite(lowest[0]) else "searching",
        )

    return progress


def _solve_chunked(
    profile, minibatch, chunk_counts, recompute, time_limit, seed, zero_bubble, output, plot, trace, dp=None
):
    from umopt.formats.schedule import save_schedule
    from umopt.search.solve_chunks import solve_chunked

    with _progress_bar("solve (chunks)") as bar:
        progress = _best_so_far(bar)
        report = solve_chunked(
            profile,
            minibatch,
            chunk_counts,
            recompute=recompute,
            time_limit=time_limit,
            seed=seed,
            zero_bubble=zero_bubble,
            progress=progress,
            dp=dp,
        )
    found = report.layouts
    panels = [
        ("umopt, one chunk per rank", found.one_chunk_timeline),
        (f"picked: {found.picked}", report.timeline),
    ]
    if plot:
        from umopt.plot import gantt

        gantt(panels, plot, title=f"{profile.model.name}, {profile.num_stages} ranks, minibatch {minibatch}")
    if trace:
        from umopt.trace import write_trace

        write_trace(panels, trace)
    save_schedule(report.schedule, output)
    table = Table(
        title=f"minibatch {minibatch}, {profile.num_stages} ranks" + (", recompute" if recompute else "")
    )
    for col, justify in (
        ("schedule", "left"),
        ("v", "right"),
        ("M", "right"),
        ("ms", "right"),
        ("x best torch", "right"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)
    torch_ms = [p.iteration_ms for p in found.peers.values() if p.iteration_ms is not None]
    best_torch = min(torch_ms, default=None)
    picked_ms = report.timeline.iteration_ms

    def row(name, v, m, ms):
        ratio = "-" if best_torch is None or ms is None else f"{best_torch / ms:.3f}"
        mark = " *" if ms is not None and abs(ms - picked_ms) < 1e-9 and not row.marked else ""
        row.marked = row.marked or bool(mark)
        table.add_row(name + mark, str(v or "-"), str(m or "-"), _ms(ms), ratio)

    row.marked = False
    sol = found.search
    pick_row = (found.picked, report.schedule)
    rows = [
        ("GPipe equal", 1, report.gpipe.microbatches, report.gpipe.iteration_ms),
        ("1F1B equal", 1, report.onef1b.microbatches, report.onef1b.iteration_ms),
        ("umopt, one chunk", 1, None, found.one_chunk_timeline.iteration_ms),
    ]
    rows += [
        (
            f"torch {name.removeprefix('Schedule')}"
            + (f" ({p.cut})" if p.cut else "")
            + ("" if p.complete else ", cut short"),
            p.chunks,
            p.microbatches,
            p.iteration_ms,
        )
        for name, p in found.peers.items()
    ]
    if sol is not None:
        counts = sorted({len(p) for p in sol.genes.fwd})
        rows.append(
            (
                f"umopt, {sol.shape.placement} ({sol.shape.cut} cut)",
                sol.shape.chunks,
                str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}",
                sol.iteration_ms,
            )
        )
    if found.exact is not None:
        optimal = " (optimal)" if found.exact.optimal else ""
        rows.append((f"umopt, exact model{optimal}", None, None, found.exact.iteration_ms))
    if report.schedule.chunks is not None:
        v = len(report.schedule.chunks.ranks) // len(report.schedule.stages)
        rows += [
            (
                f"torch {name.removeprefix('Schedule')}, the pick's cut",
                p.chunks,
                p.microbatches,
                p.iteration_ms,
            )
            for name, p in found.on_layout.items()
            if p.iteration_ms is not None
        ]
        if all(abs(ms - picked_ms) > 1e-9 for *_, ms in rows if ms is not None):
            rows.append(
                (
                    "picked: " + pick_row[0].replace("umopt chunks", "umopt's search"),
                    v,
                    _chunks(pick_row[1]),
                    picked_ms,
                )
            )
    for r in rows:
        row(*r)
    out.print(table)
    out.print(
        "v: model chunks per rank; M: microbatches per chunk; x best torch: speedup over the fastest of "
        "torch's schedules, each at its best v, M and cut (each stage or all layers, in pieces by cost or by layer count); "
        "*: the schedule written",
        markup=False,
        highlight=False,
        style="dim",
    )
    proven = ", optimal for its cut and placement" if report.schedule.solver.status == "optimal" else ""
    picked = found.picked.replace("umopt chunks", "umopt's search").replace(
        "polished from", "order polished from"
    )
    out.print(f"picked (*): {picked}, {picked_ms:.3f} ms{proven}", markup=False, highlight=False)
    if sol is not None:
        gained = (sol.screened_ms or sol.iteration_ms) - sol.iteration_ms
        out.print(
            f"umopt's search: {sol.screened} schedules screened, {sol.evaluated - sol.screened} more by the local "
            f"search, {gained:.3f} ms gained over the screening's best",
            markup=False,
            highlight=False,
        )
    if found.cut_short:
        out.print(
            f"cut short by the time limit: {'; '.join(found.cut_short)} (a longer --time-limit does them in full)",
            markup=False,
            highlight=False,
            style="yellow",
        )
    lb = report.schedule.solver.lower_bound_ms
    if lb:
        scope = report.schedule.solver.bound_holds_for or "one chunk per rank"
        holds = lb <= picked_ms + 1e-9
        out.print(
            f"lower bound {lb:.3f} ms for {scope}"
            + (
                f": the pick is at most {100 * (picked_ms - lb) / lb:.1f}% from the best possible there"
                if holds
                else " (not for the pick, which is outside that scope)"
            ),
            markup=False,
            highlight=False,
        )
    out.print(f"wrote {', '.join([output] + [p for p in (plot, trace) if p])}")
    _print_next(report.schedule, output, profile)


def _print_report(report) -> None:
    """The solve table, within 80 columns: names and the chunk counts abbreviated on purpose."""
    from umopt.search.bounds import Scope, bound_for, scope_of

    tl = report.timeline
    dp = report.schedule.dp
    table = Table(
        title=f"minibatch {report.schedule.minibatch}, {len(tl.spans)} stages"
        + (", recompute" if report.schedule.recompute else "")
        + (
            f", x{dp.replicas} data-parallel (all-reduce {min(tl.allreduce_ms):.2f}-{max(tl.allreduce_ms):.2f} ms per stage)"
            if dp
            else ""
        )
    )
    table.add_column("schedule", no_wrap=True)
    for col in ("chunks", "ms", "x gpipe", "x 1f1b", "gap", "bubble"):
        table.add_column(col, justify="right", no_wrap=True)
    solver = report.schedule.solver
    scope = scope_of(solver.bound_scope)
    # the bound that holds for each row: the report's own where its scope covers the row, else
    # the fast one of every schedule
    bounds = {Scope.ANY: report.lower_bound_ms, scope: solver.lower_bound_ms}

    def row(name: str, chunks: str, cand, it: Optional[float], bubble: Optional[float]) -> None:
        sg = None if it is None or report.gpipe.iteration_ms is None else report.gpipe.iteration_ms / it
        so = None if it is None or report.onef1b.iteration_ms is None else report.onef1b.iteration_ms / it
        bound = None if cand is None else bound_for(cand.ops(), cand.order, bounds)
        gap = None if it is None or not bound else (it - bound) / bound
        table.add_row(
            name,
            chunks,
            _ms(it),
            "-" if sg is None else f"{sg:.3f}",
            "-" if so is None else f"{so:.3f}",
            "-" if gap is None else f"{100 * gap:.1f}%",
            "-" if bubble is None else f"{100 * bubble:.1f}%",
        )

    gt, ot = report.gpipe_timeline, report.onef1b_timeline
    for label, base, btl in (("GPipe equal", report.gpipe, gt), ("1F1B equal", report.onef1b, ot)):
        row(
            label,
            _chunks(base.candidate.ops()) if base.candidate is not None else "-",
            base.candidate,
            base.iteration_ms,
            btl.bubble_fraction if btl else None,
        )
    for name, zb, zt in (
        ("ZB-H1 equal", report.zbh1, report.zbh1_timeline),
        ("ZB-H2 equal", report.zbh2, report.zbh2_timeline),
    ):
        if zb is not None:
            row(name, str(zb.microbatches or "-"), None, zb.iteration_ms, zt.bubble_fraction if zt else None)
    has_w = any(op[0] == "W" for st in report.schedule.stages for op in st.ops)
    # (the bounds hold for schedules without W ops: no gap for one with them)
    row(
        _pick_name(report),
        _chunks(report.schedule),
        None if has_w else report.choice.candidate,
        tl.iteration_ms,
        tl.bubble_fraction,
    )
    if not has_w:  # (it holds for schedules without W ops: the line below says so for one with them)
        table.add_row("lower bound", "", _ms(solver.lower_bound_ms), "", "", "", "")
    out.print(table)
    out.print(_FOOTER, markup=False, highlight=False, style="dim")
    _print_bounds_and_notes(report, scope, has_w)


def _print_bounds_and_notes(report, scope, has_w: bool) -> None:
    """Below the solve table: what its bound holds for, the other bounds and rivals, the notes."""
    from umopt.search.bounds import Scope

    tl, solver = report.timeline, report.schedule.solver
    covers = {
        Scope.ANY: "every schedule",
        Scope.IN_ORDER: "1F1B-order schedules",
        Scope.GPIPE: "GPipe-order schedules",
    }[scope]
    out.print(
        f"solver {solver.name}: {_STATUS.get(solver.status, solver.status)}, {solver.seconds:.1f} s, "
        f"{report.result.evaluated} schedules scored; "
        f"the bound holds for {covers}"
        + (
            f" without W ops ({_ms(solver.lower_bound_ms)} ms; not for this schedule, which has them)"
            if has_w
            else ""
            if scope == Scope.ANY
            else " (the others' gap is to the one for every schedule)"
        )
    )
    lb_w = solver.lower_bound_w_ms
    if lb_w is not None:
        out.print(
            f"among schedules with a W op per B chunk the best possible is at least {lb_w:.2f} ms (CP-SAT): this one is within {100 * (tl.iteration_ms - lb_w) / lb_w:.1f}% of it"
        )
    for name, zb, zt in (
        ("ZB-H1", report.zbh1, report.zbh1_timeline),
        ("ZB-H2", report.zbh2, report.zbh2_timeline),
    ):
        if zb is not None and zb.iteration_ms:
            peak = f", its peak memory {max(zt.peak_memory_bytes) / 2**20:.0f} MiB against {max(tl.peak_memory_bytes) / 2**20:.0f}"
            out.print(
                f"against the best equal {name} (M={zb.microbatches}{peak}): {zb.iteration_ms / tl.iteration_ms:.3f}x"
            )
    lb_1f1b = solver.lower_bound_1f1b_ms
    if lb_1f1b is not None and scope != Scope.IN_ORDER and not has_w:
        out.print(
            f"among 1F1B-order schedules (B ops in sample order, any warm-ups) the best possible is at least "
            f"{lb_1f1b:.2f} ms: this one is within {100 * (tl.iteration_ms - lb_1f1b) / lb_1f1b:.1f}% of it"
        )
    if report.choice.gain is not None and report.choice.uncertainty > 0:
        out.print(
            f"the best schedule found is predicted {100 * report.choice.gain:.1f}% +- {100 * report.choice.uncertainty:.1f}% "
            "faster than the best equal one (the profile's spread and its fit to the runtime)"
        )
    if report.result.notes:
        out.print(f"note: {'; '.join(report.result.notes)}")
