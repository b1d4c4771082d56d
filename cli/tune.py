"""``umopt tune``: profile, solve, run the candidates in turns and recommend what measured fastest."""

from __future__ import annotations

import click
from rich.table import Table

from .app import _require_torch, cli, err, model_options, out, warn


@cli.command()
@click.option(
    "--model", default=None, help="vgg16, gpt, mlp or package.module:factory (default: a small GPT)."
)
@model_options
@click.option("--stages", type=int, default=None, help="Pipeline stages (default 2).")
@click.option("--minibatch", "-B", type=int, default=None, help="Samples per iteration (default 32).")
@click.option(
    "--steps",
    type=int,
    default=2,
    show_default=True,
    help="Measured iterations of each schedule in each round, as in umopt run.",
)
@click.option(
    "--rounds",
    type=int,
    default=4,
    show_default=True,
    help="Turns the schedules take on the same processes, at least.",
)
@click.option(
    "--confidence",
    type=click.FloatRange(0.5, 1, min_open=True, max_open=True),
    default=0.95,
    show_default=True,
    help="Take turns until the paired test over rounds decides at this confidence.",
)
@click.option(
    "--budget",
    type=click.FloatRange(0, min_open=True),
    default=120.0,
    show_default=True,
    help="Seconds of turns after which no round starts; the pick is then made at the confidence reached.",
)
@click.option("--time-limit", type=float, default=10.0, show_default=True, help="Seconds of search.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="umopt-tune", show_default=True)
@click.option(
    "--probes/--no-probes",
    default=True,
    show_default=True,
    help="Fit the profile to probe runs of the runtime before solving (where there is a core or GPU per stage).",
)
@click.option(
    "--zero-bubble",
    is_flag=True,
    help="Profile the backward split too, and measure umopt's W schedule and the best equal ZB-H1 beside the others.",
)
@click.option(
    "--chunks",
    default="1",
    show_default=True,
    help="Model chunks per rank, 1-4 or auto (1..4): above 1, profile layer by layer and measure umopt's and torch's multi-chunk schedules too. With --lengths each method trains on the layout (one chunk per rank, or several) its plan of the first minibatch predicts fastest.",
)
@click.option(
    "--lengths",
    default=None,
    metavar="SAMPLER|FILE",
    help="Sequences of different lengths: minibatches of -B sequences drawn from a sampler (chat, "
    "instruction, lmsys, long-context; scaled to --max-length) or a file of lengths, each step planned by umopt and by the "
    "peers (--methods) in turns on the same minibatches; tokens per second decide.",
)
@click.option(
    "--max-length",
    type=click.IntRange(2),
    default=256,
    show_default=True,
    help="With --lengths: the longest sequence in tokens (longer ones are cut to it; the profile "
    "costs sequences up to it).",
)
@click.option(
    "--methods",
    default=None,
    help="With --lengths: who plans the steps, umopt and peers (pad, pack, pack-split, sort-split, dynapipe, wlb; "
    "with --chunks pad and pack). Default: umopt,pad,pack,dynapipe; with --chunks umopt,pad,pack.",
)
@click.option(
    "--dp",
    type=int,
    default=1,
    show_default=True,
    help="With --lengths: data-parallel replicas of the pipeline (stages x dp processes); -B is then the "
    "global minibatch, umopt's steps train on umopt's assignment of it, the peers' on --peer-assign's.",
)
@click.option(
    "--peer-assign",
    default="contiguous",
    show_default=True,
    help="With --dp: how the peers' replicas get their shares (contiguous, as torch's DistributedSampler, "
    "Megatron-LM and DeepSpeed split; round-robin, tokens, wlb, hydraulis).",
)
def tune(
    model, model_args, stages, minibatch, device, steps, rounds, confidence, budget, time_limit, out_dir,
    probes, dtype, link_latency_ms, link_gbps, zero_bubble, chunks, lengths, max_length, methods, dp,
    peer_assign,
) -> None:  # fmt: skip
    """Profile, solve, run the candidates in turns and recommend what measured fastest."""
    given = dict(locals())  # the options, as the command line gave them
    _require_torch()
    from umopt.tune import LengthsResult, tune_asked

    result, title = tune_asked(**given, say=lambda m: err.print(f"umopt tune: {m}", markup=False))
    if isinstance(result, LengthsResult):
        _print_lengths(result, title)
    else:
        _print_schedules(result, title)
    for line in result.warnings:
        warn(line)
    if not isinstance(result, LengthsResult):
        out.print(f"wrote {len(result.files)} files to {result.out_dir}/")
        return
    methods = "" if result.recommended == "umopt" else f" --methods {result.recommended}"
    won = next(r for r in result.rows if r.method == result.recommended)
    if result.dp > 1:
        methods += f" --dp {result.dp}" + ("" if won.assign == "umopt" else f" --assign {won.assign}")
    out.print(
        f"wrote {len(result.files)} files to {result.out_dir}/; train with ({result.recommended}'s plans): "
        f"umopt run {result.out_dir}/plan.json{methods} --profile {result.out_dir}/profile.json "
        "--data package.module:fn (your sequences)",
        markup=False,
        highlight=False,
    )


def _state(result) -> str:
    """What the turns left open when the budget ended, if anything."""
    if result.decided:
        return ""
    if result.pick_sure:
        return "; the pick is decided, not every other pair when the budget ended"
    return "; not decided when the budget ended (more --budget or --steps decides)"


def _print_schedules(result, title: str) -> None:
    """The schedules measured in turns, their speedups, the recommendation and the bound."""
    table = Table(title=title)
    table.add_column("schedule", no_wrap=True)
    for col in ("M", "pred ms", "meas ms", "meas x", "pred x"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in result.rows:
        mark = " *" if row.name == result.recommended or row.same_as == result.recommended else ""
        name = f"{row.name} (= {row.same_as})" if row.same_as else row.name
        table.add_row(
            name + mark,
            row.chunks,
            f"{row.predicted_ms:.2f}",
            f"{row.measured_ms:.2f}",
            f"{result.speedup(row):.3f}x",
            f"{result.speedup(row, False):.3f}x",
        )
    out.print(table)
    out.print(
        "(= x): the same ops as row x, measured once; meas x, pred x: speedup over the first row, measured "
        "(medians of every round) and predicted",
        markup=False,
        highlight=False,
        style="dim",
    )
    state = _state(result)
    out.print(
        f"recommended (*): {result.recommended}, {result.reason}{state}; written as {result.out_dir}/recommended.json",
        markup=False,
        highlight=False,
    )
    for note in result.notes:
        out.print(f"note: {note}", markup=False, highlight=False)
    _print_bound(result)


def _print_bound(result) -> None:
    """How far the fastest schedule predicted is from the lower bound."""
    fastest = min(result.rows, key=lambda r: r.predicted_ms)
    if not result.lower_bound_ms:
        return
    lb = result.lower_bound_ms
    gap = (fastest.predicted_ms - lb) / lb
    where = (
        "is below it: a schedule with W ops, which the bound does not cover"
        if gap < -1e-6
        else "meets it: no schedule can be faster there"
        if gap <= 1e-6
        else f"is within {100 * gap:.1f}% of it (the bound is not always reachable)"
    )
    out.print(
        f"lower bound {lb:.2f} ms for {result.bound_holds_for}: the fastest schedule predicted, "
        f"{fastest.name} ({fastest.predicted_ms:.2f} ms), {where}",
        markup=False,
        highlight=False,
    )


def _print_lengths(result, title: str) -> None:
    """``tune --lengths``: each method's tokens per second, measured and predicted; the pick."""
    umopt = next(r for r in result.rows if r.method == "umopt")
    table = Table(title=title)
    table.add_column("method", no_wrap=True)
    if result.dp > 1:
        table.add_column("assigned by", no_wrap=True)
    for col in ("chunks", "ktok/s", "pred", "ms", "pred ms", "umopt x"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in result.rows:
        mark = " *" if row.method == result.recommended else ""
        table.add_row(
            row.method + mark,
            *([row.assign or ""] if result.dp > 1 else []),
            str(row.chunks),
            f"{row.tokens_per_s / 1e3:.2f}",
            f"{row.predicted_tokens_per_s / 1e3:.2f}",
            f"{row.measured_ms:.1f}",
            f"{row.predicted_ms:.1f}",
            f"{umopt.tokens_per_s / row.tokens_per_s:.2f}x",
        )
    out.print(table)
    out.print(
        "method: who planned each step (the same minibatches for all)"
        + ("; assigned by: who gave each replica its share of each global minibatch" if result.dp > 1 else "")
        + "; chunks: per rank, the layout the method "
        "chose on the first minibatch; ktok/s: real tokens (no padding) "
        "per second, measured over the measured steps, and pred as the cost model costs each step's plan; "
        "ms: the mean step; umopt x: umopt's tokens per second over the row's",
        markup=False,
        highlight=False,
        style="dim",
    )
    state = _state(result)
    out.print(f"recommended (*): {result.recommended}, {result.reason}{state}", markup=False, highlight=False)
    most = max(result.rows, key=lambda r: r.tokens_per_s)
    if most.method != result.recommended:
        out.print(
            f"note: {most.method} shows the most tokens/s above (a mean over every step, slow ones included); the "
            f"recommendation goes by each round's median step, paired round by round, where {result.recommended} "
            "came out ahead (the confidences above say how sure that is)",
            markup=False,
            highlight=False,
        )
