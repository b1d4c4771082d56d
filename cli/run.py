"""``umopt run``: execute schedule files, one process per stage, and print measured against predicted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import click
from rich.table import Table

from umopt.words import count

from .app import _progress_bar, _require_torch, cli, err, out, warn

if TYPE_CHECKING:
    from umopt.formats.report import RunReport

_EACH = "; with several schedules a path with {name} in it, the schedule file's name without .json."


@cli.command()
@click.argument("schedules", metavar="SCHEDULE...", nargs=-1, required=True)
@click.option("--profile", default=None, help="Profile to use (default: the one the schedule names).")
@click.option(
    "--steps",
    type=int,
    default=40,
    show_default=True,
    help="Iterations after the warm-up (of each schedule, each round); where the schedule file has "
    "candidates, selection's turns are the first of them.",
)
@click.option(
    "--warmup",
    type=int,
    default=2,
    show_default=True,
    help="Iterations run first and not measured (of each schedule, in the first round).",
)
@click.option(
    "--rounds",
    type=int,
    default=1,
    show_default=True,
    help="Turns each schedule takes; its median is over all of them (with --decide: at least).",
)
@click.option(
    "--decide",
    type=float,
    default=None,
    metavar="CONFIDENCE",
    help="With several schedules: keep taking turns until the paired test over rounds decides between them "
    "at this confidence (e.g. 0.95), --budget ends, or --max-rounds; the decision goes in each report.",
)
@click.option(
    "--budget",
    type=float,
    default=120.0,
    show_default=True,
    help="With --decide: seconds of turns after which no round starts.",
)
@click.option("--max-rounds", type=int, default=30, show_default=True, help="With --decide: rounds at most.")
@click.option(
    "--select/--no-select",
    default=True,
    help="Run the schedule file's candidates in turns over the first steps and keep the fastest "
    "(--no-select: its pick alone).",
)
@click.option(
    "--select-steps",
    type=int,
    default=None,
    help="Steps at most that a schedule with candidates spends measuring them in turns (they train too; "
    "default a quarter of the run, at most 60, or what 3 rounds of turns need where that is at most half of it).",
)
@click.option(
    "--backend",
    type=click.Choice(["gloo", "nccl"]),
    default=None,
    help="Default: nccl on CUDA profiles, else gloo.",
)
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default="sgd", show_default=True)
@click.option("--lr", type=float, default=None, help="Learning rate (default 0.01 for sgd, 1e-3 for adamw).")
@click.option(
    "--dp",
    type=int,
    default=None,
    help="Data-parallel replicas of the pipeline, each on its own minibatch of the schedule's size "
    "(default: the schedule's, else 1).",
)
@click.option("--threads", type=int, default=None, help="Intra-op threads per rank (default: the profile's).")
@click.option(
    "--data",
    default=None,
    help="package.module:fn, fn(step, minibatch) -> (inputs, targets); with a plan for sequences of "
    "different lengths, two lists of 1-d tensors, a sequence each (any number of sequences).",
)
@click.option(
    "--lengths",
    default=None,
    metavar="SAMPLER",
    help="With a plan for sequences of different lengths and no --data: each step's lengths drawn from "
    "this sampler (chat, instruction, lmsys, long-context) or a file of lengths, the model's own tokens "
    "(default: the plan's lengths every step).",
)
@click.option(
    "--methods",
    default=None,
    metavar="M,M",
    help="With a plan for sequences of different lengths: who plans each step, umopt (default) or a "
    "peer (pad, pack, pack-split, sort-split, dynapipe, wlb); several take turns on the same minibatches.",
)
@click.option(
    "--assign",
    default=None,
    metavar="A[,A]",
    help="With --dp and a plan for sequences of different lengths: who gives each replica its share of "
    "each step's global minibatch, umopt (default: the sequences that make the replicas finish together) "
    "or a peer (contiguous, as torch's DistributedSampler; round-robin, tokens, wlb, hydraulis); one for "
    "every method, or one per method of --methods, comma-separated.",
)
@click.option("--report", default=None, help="Write report.json here" + _EACH)
@click.option("--trace", default=None, help="Write a Chrome trace of measured and predicted ops here" + _EACH)
@click.option("--plot", default=None, help="Write a Gantt PNG of measured beside predicted here" + _EACH)
@click.option(
    "--checkpoint",
    default=None,
    help="Directory: a checkpoint set (a file per stage, then checkpoint.json) after the last step.",
)
@click.option(
    "--checkpoint-every",
    type=int,
    default=0,
    show_default=True,
    help="Also every N steps (0: only after the last).",
)
@click.option("--resume", is_flag=True, help="Continue from --checkpoint's last complete set.")
@click.option(
    "--save-grads", default=None, help="Directory: each stage writes its gradients of the last step."
)
def run(schedules, **options) -> None:
    """Execute SCHEDULE files, one torch.distributed process per stage. Several schedules (of one
    profile) take turns on the same processes, --rounds times, so that what drifts on the machine
    meets them all alike. Under torchrun (several machines) each process is one rank."""
    _require_torch()
    from umopt.devices import replica_cores
    from umopt.measure.noise import run_warnings
    from umopt.run.launch import launch
    from umopt.run.options import RunOptions

    methods = options.pop("methods")
    opts = RunOptions(
        schedules=list(schedules),
        methods=[m.strip() for m in methods.split(",") if m.strip()] if methods is not None else None,
        **options,
    )
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started this process as one rank
        from umopt.run.rank import main as run_one_rank

        run_one_rank(opts)
        return
    with _progress_bar("run") as bar:
        task = bar.add_task("starting the ranks", total=None)

        def progress(done: int, total: Optional[int], what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        result = launch(opts, progress=progress)
    for line in dict.fromkeys(line for r in result.reports for line in run_warnings(r)):  # each once
        warn(line)
    first = result.reports[0]
    if first.backend == "gloo" and replica_cores(0, first.dp, first.stages * first.dp) is not None:
        err.print(
            f"umopt run: {first.stages * first.dp} processes on fewer cores: each replica was kept to cores of its "
            "own, a machine of its own as on a cluster (docs/run.md)",
            markup=False,
            highlight=False,
        )
    if result.reports[0].lengths is not None:
        _print_lengths(result.reports)
        return
    if len(result.reports) > 1:
        _print_turns(result.reports)
        return
    r = result.report
    if r.selection is not None:
        _print_selection(r.selection)
    _print_run(r)


def _print_run(r: RunReport) -> None:
    """One schedule's run: every figure with the steps it covers."""
    kept = f" ({r.selection.winner}, kept by selection)" if r.selection is not None else ""
    table = Table(title=f"{r.schedule}{kept}: {r.stages} stages, minibatch {r.minibatch}, {r.backend}")
    for col in ("", "iteration ms", "stage busy ms"):
        table.add_column(col, justify="right")
    table.add_row(
        "predicted", f"{r.predicted_iteration_ms:.2f}", " ".join(f"{x:.1f}" for x in r.busy_ms.predicted)
    )
    table.add_row(
        f"measured (median of {r.steps} steps)",
        f"{r.measured_iteration_ms:.2f}",
        " ".join(f"{x:.1f}" for x in r.busy_ms.measured),
    )
    if r.allreduce_ms is not None:
        ar = r.allreduce_ms
        table.add_row(
            "all-reduce pred / meas",
            "",
            " ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(ar.predicted, ar.measured)),
        )
    out.print(table)
    parts = [f"{r.warmup} warm-up"] + (
        [f"{r.selection_steps} of selection's turns"] if r.selection_steps else []
    )
    trained = r.trained_steps or r.warmup + r.selection_steps + r.steps
    out.print(
        f"{trained} steps: {', '.join(parts)}, then the {r.steps} measured above; measured / predicted = "
        f"{r.measured_over_predicted:.3f}",
        markup=False,
        highlight=False,
    )
    out.print(
        f"losses of all {len(r.losses)} steps: " + " ".join(f"{x:.4f}" for x in r.losses),
        markup=False,
        highlight=False,
    )
    _print_memory(r)


def _print_memory(r: RunReport, who: str = "") -> None:
    mem = r.peak_memory_bytes
    if mem is None or not mem.measured or len(mem.measured) != len(mem.predicted):
        return
    how = "over the run" if r.backend == "nccl" else "in the last warm-up step, by torch's profiler"
    out.print(
        f"{who}peak memory per rank, predicted / measured ({how}): "
        + ", ".join(f"{p / 2**20:.1f}/{m / 2**20:.1f}" for p, m in zip(mem.predicted, mem.measured))
        + " MiB",
        markup=False,
        highlight=False,
    )


def _print_lengths(reports: list[RunReport]) -> None:
    """Steps of sequences of different lengths, each planned by its method: tokens per second."""
    first = reports[0]
    umopt = next((r for r in reports if r.lengths.method == "umopt"), None)
    assigns = {r.lengths.assign for r in reports}
    each = len(assigns) > 1  # methods on shares of their own: a column says whose

    table = Table(
        title=f"{first.stages} ranks x {first.dp}, {first.backend}: sequences of different lengths "
        f"({first.lengths.data}), {count(first.rounds, 'round')}, {count(first.steps, 'measured step')} each"
        + (
            f", each replica's share assigned by {first.lengths.assign}"
            if first.lengths.assign and not each
            else ""
        )
    )
    table.add_column("method", no_wrap=True)
    if each:
        table.add_column("assigned by", no_wrap=True)
    for col in ("chunks", "ktok/s", "pred", "ms", "pred ms", "meas/pred"):
        table.add_column(col, justify="right", no_wrap=True)
    if umopt is not None and len(reports) > 1:
        table.add_column("umopt x", justify="right", no_wrap=True)
    for r in reports:
        ln = r.lengths
        row = [
            ln.method,
            *([ln.assign or ""] if each else []),
            str(r.chunks_per_rank()),  # on the layout the method's steps ran on
            f"{ln.tokens_per_s / 1e3:.2f}",
            f"{ln.predicted_tokens_per_s / 1e3:.2f}",
            f"{r.measured_iteration_ms:.1f}",
            f"{r.predicted_iteration_ms:.1f}",
            f"{r.measured_over_predicted:.3f}",
        ]
        if umopt is not None and len(reports) > 1:
            row.append(f"{umopt.lengths.tokens_per_s / ln.tokens_per_s:.2f}x")
        table.add_row(*row)
    out.print(table)
    out.print(
        "method: who planned each step"
        + ("; assigned by: who gave each replica its share of the global minibatch" if each else "")
        + "; chunks: per rank, in the method's layout; ktok/s: real tokens (no padding) per second over the measured "
        "steps; ms: the mean step; pred: each step's plan as the cost model costs it; umopt x: umopt's "
        "tokens per second over the row's; every method of a round trained on the same minibatches",
        markup=False,
        highlight=False,
    )
    d = first.decision
    if d:
        state = (
            "decided" if d.decided else f"not decided at {100 * d.confidence_asked:.0f}% when the turns ended"
        )
        out.print(f"keep {d.winner}: {d.reason} ({state})", markup=False, highlight=False)
    for r in reports:
        _print_memory(r, f"{r.lengths.method}: ")


def _print_selection(sel) -> None:
    """The schedule file's pick and candidates as they took turns over the first steps."""
    table = Table(
        title=f"the first {count(sel.steps, 'step')}: the schedule file's pick and candidates in turns (ms: median of their measured steps)"
        if sel.steps
        else "the schedule file's pick and candidates (not measured in turns)"
    )
    table.add_column("schedule", no_wrap=True)
    for col in ("equal", "pred ms", "meas ms", "steps"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in sel.candidates:
        mark = " *" if c.name == sel.winner else ""
        meas = "-" if c.measured_ms is None else f"{c.measured_ms:.2f}"
        table.add_row(c.name + mark, "yes" if c.equal else "no", f"{c.predicted_ms:.2f}", meas, str(c.steps))
    out.print(table)
    cost = (
        f"; the turns cost {sel.cost_ms:.0f} ms (noise alone gives up to {sel.cost_spread_ms:.0f}) beyond the winner's pace"
        if sel.steps and sel.cost_ms > sel.cost_spread_ms
        else "; the turns cost nothing measurable beyond the winner's pace"
        if sel.steps
        else ""
    )
    out.print(f"kept (*) {sel.winner}: {sel.reason}{cost}", markup=False, highlight=False)
    if sel.note:
        err.print(f"umopt: note: {sel.note}", markup=False, highlight=False, soft_wrap=True)


def _print_turns(reports: list[RunReport]) -> None:
    """Schedules that took turns on the same processes, side by side; speedups over the first."""
    first = reports[0]
    table = Table(
        title=f"{first.stages} stages, {first.backend}, {count(first.rounds, 'round')} of turns, {count(first.steps, 'measured step')} each: speedups over {Path(first.schedule).name}"
    )
    table.add_column("schedule", no_wrap=True)
    for col in ("pred ms", "meas ms", "meas / pred", "meas x", "pred x"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in reports:
        table.add_row(
            Path(r.schedule).name,
            f"{r.predicted_iteration_ms:.2f}",
            f"{r.measured_iteration_ms:.2f}",
            f"{r.measured_over_predicted:.3f}",
            f"{first.measured_iteration_ms / r.measured_iteration_ms:.3f}x",
            f"{first.predicted_iteration_ms / r.predicted_iteration_ms:.3f}x",
        )
    out.print(table)
    d = first.decision
    if d:
        state = (
            "decided" if d.decided else f"not decided at {100 * d.confidence_asked:.0f}% when the turns ended"
        )
        out.print(f"keep {d.winner}: {d.reason} ({state})", markup=False, highlight=False)
