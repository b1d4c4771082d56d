"""``umopt solve --lengths``: sequences of different lengths planned, one minibatch (a schedule
file) or a stream of them (tokens per second), each beside what people run."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
from rich.table import Table

from umopt.errors import UmoptError

from .app import _ms, _progress_bar, legend, out, own_model_hint, warn

_LEGEND = {
    "ms": "predicted iteration",
    "ktok/s": "the minibatch's real tokens (no padding) per second",
    "umopt x": "umopt's plan's speedup over the row",
    "M": "microbatches per stage, or per virtual stage with chunks (a range where they differ)",
    "plan ms": "the time the method took to plan",
    "chunked": "several chunks per rank (pad and pack: on torch's multi-chunk schedules at their best count, "
    "microbatches and cut)",
}


def solve_lengths(
    profile,
    lengths: str,
    size: int,
    count: int,
    budget_ms: float,
    recompute: bool,
    time_limit: float,
    seed: int,
    memory_limit: Optional[int],  # applied to the profile already
    dp: int,
    dp_gbps: Optional[float],
    output: Optional[str],
    plot: Optional[str],
    trace: Optional[str],
    chunks: tuple[int, ...] = (1,),
) -> None:
    import time

    started = time.perf_counter()  # the time limit covers the whole command
    from umopt.fileio import check_writable
    from umopt.samplers import cut_note, minibatches
    from umopt.search.solve import allreduce_for

    if count < 1:
        raise UmoptError(f"--minibatches must be at least 1, got {count}")
    if budget_ms <= 0:
        raise UmoptError(f"--budget-ms must be positive, got {budget_ms}")
    if count > 1 and (output or plot or trace):
        raise UmoptError(
            "a stream (--minibatches > 1) writes no files: plan one minibatch for a schedule file"
        )
    if count == 1 and output is None:
        raise UmoptError("give -o/--output, the schedule file to write")
    for path in filter(None, (output, plot, trace)):
        check_writable(path)
    allreduce = allreduce_for(profile, dp, dp_gbps)
    spec = f"file:{lengths}" if os.path.isfile(lengths) else lengths
    cap = profile.lengths.max_length if profile.lengths is not None else None
    batches = minibatches(spec, count, size, seed=seed, cap=cap)
    cut = cut_note(spec, cap, minibatches(spec, count, size, seed=seed)) if cap is not None else None
    if cut:
        warn(cut)
    source = lengths if not spec.startswith("file:") else f"file {lengths}"
    time_limit -= time.perf_counter() - started  # what is left of it
    if dp > 1:  # -B is the global minibatch, split among the replicas
        if count > 1 or chunks != (1,) or plot or trace:
            raise UmoptError(
                "--dp with --lengths plans one global minibatch across the replicas, one chunk per rank: "
                "no --minibatches, --chunks, --plot or --trace (bench/replicas.py plays streams)"
            )
        _replicas(profile, batches[0], source, dp, budget_ms, recompute, allreduce, output)
        return
    if count == 1:
        _one(
            profile,
            batches[0],
            source,
            budget_ms,
            recompute,
            time_limit,
            seed,
            allreduce,
            output,
            plot,
            trace,
            chunks,
        )
    else:
        _stream(profile, batches, source, budget_ms, recompute, time_limit, allreduce, chunks)


def _replicas(profile, L, source, replicas, budget_ms, recompute, allreduce, output) -> None:
    from umopt.formats.replicas import save_replicas
    from umopt.search.replicas import replicas_file, solve_global

    with _progress_bar("plan (replicas)") as bar:
        bar.add_task(
            f"{len(L)} sequences among {replicas} replicas: every assignment, each replica planned",
            total=None,
        )
        report = solve_global(profile, L, replicas, budget_ms, recompute, allreduce)
    out.print(
        f"global minibatch: {len(L)} sequences from {source}, {int(L.sum()):,} tokens (longest {int(L.max()):,}), "
        f"{replicas} replicas of {profile.num_stages} stages",
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
    if output:
        save_replicas(replicas_file(report, profile, recompute, allreduce), output)
        out.print(f"wrote {output}: each replica's sequences and its plan", markup=False, highlight=False)


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


def _one(profile, L, source, budget_ms, recompute, time_limit, seed, dp, output, plot, trace, chunks) -> None:
    from umopt.formats.schedule import save_schedule
    from umopt.search.methods import METHODS
    from umopt.search.solve_lengths import CHUNKED, schedule_of, solve_minibatch

    with _progress_bar("plan (lengths)") as bar:
        bar.add_task(f"{len(L)} sequences: fast plan, peers, then the long search", total=None)
        report = solve_minibatch(profile, L, time_limit, budget_ms, recompute, dp, seed, chunks)
    out.print(
        f"minibatch: {len(L)} sequences from {source}, {int(L.sum()):,} tokens "
        f"(longest {int(L.max()):,}, mean {L.mean():.0f}), {profile.num_stages} stages",
        markup=False,
        highlight=False,
    )
    rows = []
    if report.chunked is not None:
        rows.append((f"umopt, {CHUNKED}", report.chunked))
    if report.best is not report.fast and report.best is not report.chunked:
        rows.append((f"umopt, searched {report.search_s:.0f} s", report.best))
    rows.append((f"umopt, fast plan ({budget_ms:g} ms)", report.fast))
    rows += [(name, p) for name, p in report.peers.items()]
    pick = report.best
    table = Table(title=None)
    for col in ("method", "ms", "ktok/s", "umopt x", "M", "plan ms"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    hows = []
    for name, p in rows:
        if p is None:
            table.add_row(name, "-", "-", "-", "-", "")
            hows.append(
                f"{name}: {METHODS[name.split(',')[0]].unavailable(profile) or 'does not fit the memory limit'}"
            )
            continue
        ratio = "" if p is pick else f"{p.iteration_ms / pick.iteration_ms:.2f}x"
        table.add_row(
            name,
            _ms(p.iteration_ms),
            f"{p.tokens_per_s / 1e3:.1f}",
            ratio,
            _microbatches(p),
            f"{p.planning_ms:.0f}",
        )
        hows.append(f"{name}: {_how(p)}")
    out.print(table)
    legend(
        _LEGEND, [*(c.header for c in table.columns), *(["chunked"] if report.chunked is not None else [])]
    )
    out.print("how each method cut the minibatch:", markup=False, highlight=False)
    for line in hows:  # below the table, where a narrow terminal keeps them whole
        out.print(f"  {line}", markup=False, highlight=False)
    schedule = schedule_of(report, profile, recompute, dp)
    fitting = [(n, p) for n, p in report.peers.items() if p is not None]
    panels = []
    if fitting:
        name, peer = min(fitting, key=lambda x: x[1].iteration_ms)
        panels.append((f"best peer: {name}", peer.timeline, _tokens(peer, L)))
    panels.append(("umopt", pick.timeline, _tokens(pick, L)))
    if plot:
        from umopt.plot import gantt

        gantt(panels, plot, title=f"{profile.model.name}, {profile.num_stages} stages, {len(L)} sequences")
    if trace:
        from umopt.trace import write_trace

        write_trace([(label, tl) for label, tl, _ in panels], trace)
    save_schedule(schedule, output)
    out.print(f"wrote {', '.join([output] + [p for p in (plot, trace) if p])}", markup=False, highlight=False)
    from umopt.zoo import runnable

    if not runnable(profile.model.name):
        out.print(own_model_hint(profile, lengths=True), markup=False, highlight=False)
        return
    out.print(
        f"next: umopt run {output} --lengths {source if not source.startswith('file ') else source[5:]} "
        "--methods umopt,pack (each step planned ahead; --data module:fn for your own sequences)",
        markup=False,
        highlight=False,
    )


def _tokens(plan, L) -> np.ndarray:
    """Each sample's real tokens (a row's: its sequences'), for the picture's labels."""
    return np.array([sum(int(L[i]) for i in u) for u in plan.layout.units])


def _stream(profile, batches, source, budget_ms, recompute, time_limit, dp, chunks) -> None:
    from umopt.search.solve_lengths import solve_stream

    with _progress_bar("plan (stream)") as bar:
        task = bar.add_task("minibatches", total=len(batches))
        report = solve_stream(
            profile,
            batches,
            time_limit,
            budget_ms,
            recompute,
            dp,
            progress=lambda done, total: bar.update(task, completed=done),
            chunks=chunks,
        )
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
