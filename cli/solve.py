"""``umopt solve``: a profile and a minibatch in, a schedule file out, with its report."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional

import click
import numpy as np
from rich.table import Table

from .app import (
    BYTES,
    _ms,
    _progress_bar,
    cli,
    command_start,
    legend,
    load_solve_profile,
    out,
    own_model_hint,
    warn,
)

_LEGEND = {
    "ms": "predicted iteration",
    "ktok/s": "the minibatch's real tokens (no padding) per second",
    "umopt x": "umopt's plan's speedup over the row",
    "M": "microbatches per stage, or per virtual stage with chunks (a range where they differ)",
    "plan ms": "the time the method took to plan",
    "chunked": "several chunks per rank (pad and pack: on torch's multi-chunk schedules at their best count, "
    "microbatches and cut)",
}


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
    profile_path, minibatch, recompute, solver, order, time_limit, seed, memory_limit, dp, dp_gbps,
    zero_bubble, chunks, lengths, minibatches, budget_ms, output, plot, trace,
) -> None:  # fmt: skip
    """Search unequal per-stage partitions for PROFILE (a path or a bundled profile's name)."""
    from umopt.search.ask import SolveAsk, answer, check_time_limit
    from umopt.search.solve_chunks import parse_chunks

    started = command_start()  # the time limit covers the whole command
    check_time_limit(time_limit)  # first: what is left of it is computed from it
    chunk_counts = parse_chunks(chunks)
    profile = load_solve_profile(profile_path, memory_limit)  # a wrong path is the first thing said
    ask = SolveAsk(
        profile, minibatch, started, time_limit, recompute, solver, order, seed, dp, dp_gbps,
        zero_bubble, chunk_counts, lengths, minibatches, budget_ms, output, plot, trace,
    )  # fmt: skip
    ask.check()
    if ask.cut_note():
        warn(ask.cut_note())
    with _solving(ask) as progress:
        report = answer(ask, progress)
    PRINTERS[ask.kind](report, ask)


@contextmanager
def _solving(ask):
    """The progress bar of the solve ``ask`` asks for: its best so far, or what it is doing."""
    title, doing = {
        "sizes": (f"solve ({ask.solver})", None),
        "chunks": ("solve (chunks)", None),
        "minibatch": ("plan (lengths)", f"{ask.minibatch} sequences: fast plan, peers, then the long search"),
        "stream": ("plan (stream)", None),
        "replicas": ("plan (replicas)", f"{ask.minibatch} sequences among {ask.dp} replicas: every assignment, each replica planned"),
    }[ask.kind]  # fmt: skip
    with _progress_bar(title) as bar:
        if doing is not None:
            bar.add_task(doing, total=None)
            yield None
        else:
            yield _best_so_far(bar)


def _write(ask, panels, schedule, title: str) -> None:
    """The picture (--plot), the trace (--trace), then the schedule file: a schedule file means
    everything was written."""
    from umopt.formats.schedule import save_schedule

    if ask.plot:
        from umopt.plot import gantt

        gantt(panels, ask.plot, title=f"{ask.profile.model.name}, {title}")
    if ask.trace:
        from umopt.trace import write_trace

        write_trace([p[:2] for p in panels], ask.trace)
    save_schedule(schedule, ask.output)


def _print_sizes(report, ask) -> None:
    """One chunk per rank by sizes: the table, the bounds, the next step."""
    profile = ask.profile
    panels = (
        [(f"best equal GPipe (M={report.gpipe.microbatches})", report.gpipe_timeline)]
        if report.gpipe_timeline
        else []
    )
    panels.append((_pick_name(report), report.timeline))
    _write(ask, panels, report.schedule, f"{profile.num_stages} stages, minibatch {ask.minibatch}")
    _print_report(report)
    if ask.minibatch > profile.max_size:
        out.print(
            f"chunks are at most {profile.max_size} samples: the profile was measured up to {profile.max_size} (umopt profile --max-size, "
            f"or profile_stages' sample batch); profile to {min(ask.minibatch, 2 * profile.max_size)} or more if larger chunks may run faster per sample",
            markup=False,
            highlight=False,
        )
    out.print(f"wrote {', '.join(ask.files)}")
    _print_next(report.schedule, ask.output, profile)


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
    """A solver's progress callback (share done, best ms so far: None where a stream of plans has
    no one best) moving ``bar``."""
    task = bar.add_task("", total=1.0)
    lowest = [math.inf]  # over every phase: a later phase's own best may be worse than an earlier one's

    def progress(frac: float, best: Optional[float]) -> None:
        lowest[0] = min(lowest[0], math.inf if best is None else best)
        bar.update(
            task,
            completed=frac,
            description=f"best {lowest[0]:.3f} ms"
            if math.isfinite(lowest[0])
            else ("searching" if best is not None else f"{frac:.0%} planned"),
        )

    return progress


def _print_chunked(report, ask) -> None:
    """Several chunks per rank by sizes: every schedule tried against torch's, what was picked."""
    found = report.layouts
    panels = [
        ("umopt, one chunk per rank", found.one_chunk_timeline),
        (f"picked: {found.picked}", report.timeline),
    ]
    _write(ask, panels, report.schedule, f"{ask.profile.num_stages} ranks, minibatch {ask.minibatch}")
    table = Table(
        title=f"minibatch {ask.minibatch}, {ask.profile.num_stages} ranks"
        + (", recompute" if ask.recompute else "")
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
    picked_ms, marked = report.timeline.iteration_ms, False
    for name, v, m, ms in _chunked_rows(report):
        ratio = "-" if best_torch is None or ms is None else f"{best_torch / ms:.3f}"
        mark = " *" if ms is not None and abs(ms - picked_ms) < 1e-9 and not marked else ""
        marked = marked or bool(mark)
        table.add_row(name + mark, str(v or "-"), str(m or "-"), _ms(ms), ratio)
    out.print(table)
    out.print(
        "v: model chunks per rank; M: microbatches per chunk; x best torch: speedup over the fastest of "
        "torch's schedules, each at its best v, M and cut (each stage or all layers, in pieces by cost or by layer count); "
        "*: the schedule written",
        markup=False,
        highlight=False,
        style="dim",
    )
    _print_chunked_notes(report)
    out.print(f"wrote {', '.join(ask.files)}")
    _print_next(report.schedule, ask.output, ask.profile)


def _chunked_rows(report) -> list[tuple]:
    """The chunked solve's table rows, (name, v, M, ms): the equal schedules, torch's, umopt's."""
    found, sol, picked_ms = report.layouts, report.layouts.search, report.timeline.iteration_ms
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
        M = str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"
        rows.append(
            (f"umopt, {sol.shape.placement} ({sol.shape.cut} cut)", sol.shape.chunks, M, sol.iteration_ms)
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
            name = "picked: " + found.picked.replace("umopt chunks", "umopt's search")
            rows.append((name, v, _chunks(report.schedule), picked_ms))
    return rows


def _print_chunked_notes(report) -> None:
    """Below the chunked solve's table: the pick, umopt's search, what was cut short, the bound."""
    found, sol, picked_ms = report.layouts, report.layouts.search, report.timeline.iteration_ms
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


def _print_report(report) -> None:
    """The solve table, within 80 columns: names and the chunk counts abbreviated on purpose."""
    from umopt.search.bounds import Scope, bound_for, scope_of

    tl = report.timeline
    table = Table(title=_solve_title(report))
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


def _solve_title(report) -> str:
    """The solve table's title: the minibatch, the stages, recompute, data parallelism."""
    tl, dp = report.timeline, report.schedule.dp
    return (
        f"minibatch {report.schedule.minibatch}, {len(tl.spans)} stages"
        + (", recompute" if report.schedule.recompute else "")
        + (
            f", x{dp.replicas} data-parallel (all-reduce {min(tl.allreduce_ms):.2f}-{max(tl.allreduce_ms):.2f} ms per stage)"
            if dp
            else ""
        )
    )


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


def _print_replicas(report, ask) -> None:
    """A global minibatch across replicas: each assignment's step, beside the bound; the file."""
    from umopt.formats.replicas import save_replicas
    from umopt.search.replicas import replicas_file

    L = ask.batches[0]
    out.print(
        f"global minibatch: {len(L)} sequences from {ask.source}, {int(L.sum()):,} tokens (longest {int(L.max()):,}), "
        f"{ask.dp} replicas of {ask.profile.num_stages} stages",
        markup=False,
        highlight=False,
    )
    base = report.plans["contiguous"].step_ms
    table = Table()
    for col in ("assignment", "step ms", "ktok/s", "max/mean", "x contig.", "> bound", "assign ms"):
        table.add_column(col, justify="left" if col == "assignment" else "right", no_wrap=True)
    for name, g in report.plans.items():
        table.add_row(
            name + (" *" if name == report.pick else ""),
            _ms(g.step_ms),
            f"{g.tokens_per_s / 1e3:.1f}",
            f"{g.step_ms / g.mean_ms:.3f}",
            f"{base / g.step_ms:.3f}x",
            f"{100 * (g.step_ms / report.lower_bound_ms - 1):.1f}%",
            f"{1e3 * g.assignment.seconds:.1f}",
        )
    table.add_row("lower bound", _ms(report.lower_bound_ms), "", "", "", "", "")
    out.print(table)
    legend(
        {
            "assignment": "who gave each replica its sequences, each replica then planned by umopt's planner "
            "(so the assignments compare, not the planners)",
            "step ms": "the slowest replica's predicted step",
            "max/mean": "the slowest replica over the mean one",
            "x contig.": "the contiguous split's step over this one's (torch's DistributedSampler)",
            "> bound": "above the lower bound no assignment beats: the larger of the mean replica's work spread "
            "perfectly, with the least fill and drain, and the longest sequence's own path",
            "assign ms": "the assignment's time, on this machine",
        },
        ["assignment", "step ms", "max/mean", "x contig.", "> bound", "assign ms"],
    )
    if ask.output:
        save_replicas(replicas_file(report, ask.profile, ask.recompute, ask.allreduce), ask.output)
        out.print(f"wrote {ask.output}: each replica's sequences and its plan", markup=False, highlight=False)


def _microbatches(plan) -> str:
    """F ops per (virtual) stage: one count, or the range where they differ."""
    per: dict[tuple, int] = {}
    for r, st in enumerate(plan.ops):
        for op in st:
            if op[0] == "F":
                key = (r, op[3]) if len(op) > 3 else (r,)
                per[key] = per.get(key, 0) + 1
    counts = sorted(set(per.values()))
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"


def _how(plan) -> str:
    k = plan.knobs
    if plan.method.startswith("umopt"):
        if plan.chunking is not None:
            return f"x{k.get('chunks')} {k.get('placement', '')}, {k.get('cut', '')} cut, {k.get('order', '')} order"
        return f"{k.get('order', '')} order, {k.get('family', '')}" + (" + W" if k.get("weights") else "")
    if plan.chunking is not None:
        torch_name = str(k.get("order", "")).removeprefix("Schedule")
        how = f"padded to {plan.layout.pad_to}" if plan.layout.pad_to else f"rows of {plan.layout.row} tokens"
        return f"{how}, {torch_name} x{k.get('chunks')}"
    if plan.layout.pad_to:
        return f"padded to {plan.layout.pad_to}"
    if plan.layout.row:
        return f"rows of {plan.layout.row} tokens ({len(plan.layout.units)} rows)"
    return k.get("mode", plan.layout.mode) + (f", {k['microbatch_order']}" if "microbatch_order" in k else "")


def _print_minibatch(report, ask) -> None:
    """One minibatch by lengths: umopt's plans and every peer's, how each cut it; the files."""
    from umopt.search.solve_lengths import schedule_of

    L, profile = ask.batches[0], ask.profile
    out.print(
        f"minibatch: {len(L)} sequences from {ask.source}, {int(L.sum()):,} tokens "
        f"(longest {int(L.max()):,}, mean {L.mean():.0f}), {profile.num_stages} stages",
        markup=False,
        highlight=False,
    )
    _print_minibatch_table(report, ask)
    fitting = [(n, p) for n, p in report.peers.items() if p is not None]
    panels = []
    if fitting:
        name, peer = min(fitting, key=lambda x: x[1].iteration_ms)
        panels.append((f"best peer: {name}", peer.timeline, _tokens(peer, L)))
    panels.append(("umopt", report.best.timeline, _tokens(report.best, L)))
    schedule = schedule_of(report, profile, ask.recompute, ask.allreduce)
    _write(ask, panels, schedule, f"{profile.num_stages} stages, {len(L)} sequences")
    out.print(f"wrote {', '.join(ask.files)}", markup=False, highlight=False)
    from umopt.zoo import runnable

    if not runnable(profile.model.name):
        out.print(own_model_hint(profile, lengths=True), markup=False, highlight=False)
        return
    source = ask.source if not ask.source.startswith("file ") else ask.source[5:]
    out.print(
        f"next: umopt run {ask.output} --lengths {source} "
        "--methods umopt,pack (each step planned ahead; --data module:fn for your own sequences)",
        markup=False,
        highlight=False,
    )


def _print_minibatch_table(report, ask) -> None:
    """The table of one minibatch's plans, and below it how each method cut the minibatch."""
    from umopt.search.methods import METHODS
    from umopt.search.solve_lengths import CHUNKED

    rows = []
    if report.chunked is not None:
        rows.append((f"umopt, {CHUNKED}", report.chunked))
    if report.best is not report.fast and report.best is not report.chunked:
        rows.append((f"umopt, searched {report.search_s:.0f} s", report.best))
    rows.append((f"umopt, fast plan ({ask.budget_ms:g} ms)", report.fast))
    rows += [(name, p) for name, p in report.peers.items()]
    pick = report.best
    table = Table(title=None)
    for col in ("method", "ms", "ktok/s", "umopt x", "M", "plan ms"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    hows = []
    for name, p in rows:
        if p is None:
            table.add_row(name, "-", "-", "-", "-", "")
            why = METHODS[name.split(",")[0]].unavailable(ask.profile) or "does not fit the memory limit"
            hows.append(f"{name}: {why}")
            continue
        ratio = "" if p is pick else f"{p.iteration_ms / pick.iteration_ms:.2f}x"
        ktok = f"{p.tokens_per_s / 1e3:.1f}"
        table.add_row(name, _ms(p.iteration_ms), ktok, ratio, _microbatches(p), f"{p.planning_ms:.0f}")
        hows.append(f"{name}: {_how(p)}")
    out.print(table)
    legend(
        _LEGEND, [*(c.header for c in table.columns), *(["chunked"] if report.chunked is not None else [])]
    )
    out.print("how each method cut the minibatch:", markup=False, highlight=False)
    for line in hows:  # below the table, where a narrow terminal keeps them whole
        out.print(f"  {line}", markup=False, highlight=False)


def _tokens(plan, L) -> np.ndarray:
    """Each sample's real tokens (a row's: its sequences'), for the picture's labels."""
    return np.array([sum(int(L[i]) for i in u) for u in plan.layout.units])


def _print_stream(report, ask) -> None:
    """A stream of minibatches by lengths: each method's tokens per second and planning times."""
    batches, profile, source = ask.batches, ask.profile, ask.source
    n = report.planned
    cut = f" (planned the first {n}: the rest did not fit in --time-limit)" if n < report.asked else ""
    out.print(
        f"stream: {report.asked} minibatches of {len(batches[0])} sequences from {source}, "
        f"{profile.num_stages} stages{cut}",
        markup=False,
        highlight=False,
    )
    table = Table()
    for col in ("method", "fits", "ktok/s", "umopt vs it", "plan ms p50", "p95"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    # umopt's row: its faster layout over the stream (one chunk per rank, or several)
    ours = [m for m in report.ms if m == "umopt" or m.startswith("umopt,")]
    pick = max(ours, key=lambda m: report.tokens_per_s(m) or 0.0)
    mine = report.fits(pick)
    for method in report.ms:
        fits = report.fits(method)
        both = fits & mine
        rate = report.tokens_per_s(method)
        ratio = (
            ""
            if method == pick or not both
            else f"{report.tokens_per_s(pick, both) / report.tokens_per_s(method, both):.2f}x"
        )
        ms = report.planning_ms[method]
        table.add_row(
            method + (" *" if method == pick and len(ours) > 1 else ""),
            f"{len(fits)}/{n}",
            "-" if rate is None else f"{rate / 1e3:.1f}",
            ratio,
            f"{np.percentile(ms, 50):.1f}" if ms else "-",
            f"{np.percentile(ms, 95):.1f}" if ms else "-",
        )
    out.print(table)
    legend(
        {
            "fits": "minibatches the method fits in the memory limit",
            "ktok/s": "real tokens (no padding) per second over those",
            "umopt vs it": "over the minibatches both fit"
            + (" (with several chunks per rank, umopt's faster layout, *)" if len(ours) > 1 else ""),
            "plan ms": "per minibatch, umopt's warm-started from the last",
            "chunked": "several chunks per rank, each method keeping the layout its first plan chose",
        },
        [*(c.header for c in table.columns), *(["chunked"] if len(ours) > 1 else [])],
    )


# each kind of solve's printer (umopt.search.ask.SolveAsk.kind)
PRINTERS = {
    "sizes": _print_sizes,
    "chunks": _print_chunked,
    "minibatch": _print_minibatch,
    "stream": _print_stream,
    "replicas": _print_replicas,
}
