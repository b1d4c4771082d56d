"""The ``umopt`` command line: parse, call the library, print. Installed as ``umopt.cli``.

Every user-facing problem arrives as :class:`umopt.errors.UmoptError`; :func:`main` prints it as
one line on stderr and exits with code 2, without a traceback and without writing any file.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from umopt.errors import UmoptError

if TYPE_CHECKING:
    from umopt.formats.report import RunReport

__all__ = ["main", "cli"]

# emoji off: a user's text (`--data mydata:ok`) is printed as written, not as 🆗
out = Console(emoji=False)
err = Console(stderr=True, emoji=False)


class _Bytes(click.ParamType):
    """A byte count: 17179869184, 16GiB, 16GB, 512MiB, 1.5e9."""

    name = "bytes"
    _UNITS = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        import re

        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
        if not m or m.group(2) not in self._UNITS:
            self.fail(f"{value!r} is not a byte count (e.g. 17179869184, 16GiB, 512MB)", param, ctx)
        try:
            return int(float(m.group(1)) * self._UNITS[m.group(2)])
        except ValueError:
            self.fail(f"{value!r} is not a byte count (e.g. 17179869184, 16GiB, 512MB)", param, ctx)


BYTES = _Bytes()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="umopt")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Say more: what each step does (and every rank's log under umopt run).",
)
@click.option("-q", "--quiet", is_flag=True, help="Say less: no progress, only results, warnings and errors.")
def cli(verbose: bool, quiet: bool) -> None:
    """umopt: unequal per-stage microbatch partitions for pipeline-parallel training.

    \b
    profile -> solve -> run:
      umopt solve gpt-sim --minibatch 64 -o schedule.json --plot schedule.png
      umopt show schedule.json
    """
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    _VERBOSITY["level"] = level
    _log_to(err, level)
    os.environ["UMOPT_LOG_LEVEL"] = logging.getLevelName(level)  # for the ranks umopt run starts


def _log_to(console: Console, level: int) -> None:
    """umopt's library logs (warnings of profile_stages and Pipeline, the solver's steps) as
    'umopt: ...' lines on stderr, plain text."""
    logger = logging.getLogger("umopt")
    logger.setLevel(level)
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(
            _ConsoleHandler(console)
        )  # (and on to the root's handlers, where a host program set some)


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        kind = "warning: " if record.levelno >= logging.WARNING else ""
        self.console.print(
            f"umopt: {kind}{record.getMessage()}", markup=False, highlight=False, soft_wrap=True
        )


_VERBOSITY = {"level": logging.INFO}


class _Lines:
    """Progress as plain lines on stderr, for logs (CI, nohup, torchrun): one when what is being
    done changes, and at most one every ``every`` seconds while it goes on. The same calls as
    rich's Progress, which draws a bar only on a terminal."""

    def __init__(self, label: str, every: float = 10.0):
        self.label, self.every = label, every
        self.last_what, self.last_t, self.start = "", 0.0, time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: Optional[float] = None) -> int:
        return 0

    def update(
        self,
        task: int,
        completed: Optional[float] = None,
        total: Optional[float] = None,
        description: Optional[str] = None,
    ) -> None:
        now = time.monotonic()
        what = description or self.last_what
        if now - self.last_t < (
            self.every if what == self.last_what else 1.0
        ):  # a new phase, unless the last line is under a second old
            return
        share = f" ({completed:g}/{total:g})" if completed is not None and total else ""
        err.print(
            f"umopt {self.label}: {what}{share} [{now - self.start:.0f} s]",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        self.last_what, self.last_t = what, now


class _Silent(_Lines):
    def update(self, *args, **kwargs) -> None:
        return None


def _progress_bar(label: str):
    """A bar on a terminal, plain lines elsewhere, nothing with -q."""
    if _VERBOSITY["level"] > logging.INFO:
        return _Silent(label)
    if not err.is_terminal:
        return _Lines(label)
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


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
    type=click.Choice(["auto", "gpipe", "1f1b"]),
    default="auto",
    show_default=True,
    help="Op order: GPipe, 1F1B, or auto (the GA tries both; cpsat/milp order each stage freely).",
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
    "-o", "--output", type=click.Path(dir_okay=False), required=True, help="Schedule file to write."
)
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
    output,
    plot,
    trace,
) -> None:
    """Search unequal per-stage partitions for PROFILE (a path or a bundled profile's name)."""
    from umopt.solve_chunks import parse_chunks

    chunk_counts = parse_chunks(chunks)
    from umopt.fileio import check_writable
    from umopt.formats.profile import load_profile
    from umopt.formats.schedule import save_schedule
    from umopt.solve import allreduce_for
    from umopt.solve import solve as run_solve

    for path in filter(None, (output, plot, trace)):
        check_writable(path)
    profile = load_profile(profile_path)
    if memory_limit is not None:
        if memory_limit <= 0:
            raise UmoptError(f"--memory-limit must be positive, got {memory_limit}")
        profile = profile.with_memory_limit(memory_limit)
    allreduce = allreduce_for(profile, dp, dp_gbps)
    if chunk_counts != (1,):
        if solver != "auto" or order != "auto":
            raise UmoptError("--chunks searches on its own: it takes no --solver or --order")
        _solve_chunked(
            profile,
            minibatch,
            chunk_counts,
            recompute,
            time_limit,
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
            time_limit=time_limit,
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
    panels.append((f"umopt ({solver})", report.timeline))
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


def _best_so_far(bar):
    """A solver's progress callback (share done, best ms so far) moving ``bar``."""
    task = bar.add_task("", total=1.0)

    def progress(frac: float, best: float) -> None:
        bar.update(
            task, completed=frac, description=f"best {best:.3f} ms" if math.isfinite(best) else "searching"
        )

    return progress


def _solve_chunked(
    profile, minibatch, chunk_counts, recompute, time_limit, seed, zero_bubble, output, plot, trace, dp=None
):
    from umopt.formats.schedule import save_schedule
    from umopt.solve_chunks import solve_chunked

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
    one = report.one_chunk
    panels = [("umopt, one chunk per rank", one.timeline), (f"picked: {report.picked}", report.timeline)]
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
    torch_ms = [p.iteration_ms for p in report.peers.values() if p.iteration_ms is not None]
    best_torch = min(torch_ms, default=None)

    def row(name, v, m, ms):
        ratio = "-" if best_torch is None or ms is None else f"{best_torch / ms:.3f}"
        table.add_row(name, str(v or "-"), str(m or "-"), _ms(ms), ratio)

    row("GPipe equal", 1, one.gpipe.microbatches, one.gpipe.iteration_ms)
    row("1F1B equal", 1, one.onef1b.microbatches, one.onef1b.iteration_ms)
    row("umopt, one chunk", 1, None, one.timeline.iteration_ms)
    for name, p in report.peers.items():
        row(f"torch {name.removeprefix('Schedule')}", p.chunks, p.microbatches, p.iteration_ms)
    sol = report.search
    if sol is None:
        row("umopt, several chunks", None, None, None)
    else:
        counts = sorted({len(p) for p in sol.genes.fwd})
        row(
            f"umopt, {sol.shape.placement} ({sol.shape.cut} cut)",
            sol.shape.chunks,
            str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}",
            sol.iteration_ms,
        )
    if report.exact is not None:
        row(
            "umopt, exact model" + (" (optimal)" if report.exact.optimal else ""),
            None,
            None,
            report.exact.iteration_ms,
        )
    out.print(table)
    proven = ", optimal for its cut and placement" if report.schedule.solver.status == "optimal" else ""
    out.print(
        f"picked: {report.picked}, {report.timeline.iteration_ms:.3f} ms{proven}",
        markup=False,
        highlight=False,
    )
    lb = report.schedule.solver.lower_bound_ms
    if lb:
        out.print(
            f"lower bound {lb:.3f} ms (gap {100 * (report.timeline.iteration_ms - lb) / lb:.1f}% at most), "
            f"for {report.schedule.solver.model_extra.get('bound_holds_for', 'one chunk per rank')}",
            markup=False,
            highlight=False,
        )
    out.print(f"wrote {', '.join([output] + [p for p in (plot, trace) if p])}")


def _print_report(report) -> None:
    """The solve table, within 80 columns: names and the chunk counts abbreviated on purpose."""
    from umopt.bounds import Scope, bound_for, scope_of

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
    scope = scope_of(solver.model_extra.get("bound_scope"))
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
    row(
        "GPipe equal",
        str(report.gpipe.microbatches or "-"),
        report.gpipe.candidate,
        report.gpipe.iteration_ms,
        gt.bubble_fraction if gt else None,
    )
    row(
        "1F1B equal",
        str(report.onef1b.microbatches or "-"),
        report.onef1b.candidate,
        report.onef1b.iteration_ms,
        ot.bubble_fraction if ot else None,
    )
    for name, zb, zt in (
        ("ZB-H1 equal", report.zbh1, report.zbh1_timeline),
        ("ZB-H2 equal", report.zbh2, report.zbh2_timeline),
    ):
        if zb is not None:
            row(name, str(zb.microbatches or "-"), None, zb.iteration_ms, zt.bubble_fraction if zt else None)
    counts = sorted({len([o for o in st.ops if o[0] == "F"]) for st in report.schedule.stages})
    winner = report.result.winner
    umopt_name = f"umopt {solver.name}" if not winner or winner == solver.name else f"umopt ({winner})"
    if report.choice.name in ("gpipe_equal", "1f1b_equal"):
        umopt_name = f"umopt: {report.choice.name.split('_')[0]}"
    has_w = any(op[0] == "W" for st in report.schedule.stages for op in st.ops)
    if has_w:
        umopt_name += " + W"
    # (the bounds hold for schedules without W ops: no gap for one with them)
    row(
        umopt_name,
        str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}",
        None if has_w else report.choice.candidate,
        tl.iteration_ms,
        tl.bubble_fraction,
    )
    table.add_row("lower bound", "", _ms(solver.lower_bound_ms), "", "", "", "")
    out.print(table)
    covers = {
        Scope.ANY: "every schedule",
        Scope.IN_ORDER: "1F1B-order schedules",
        Scope.GPIPE: "GPipe-order schedules",
    }[scope]
    out.print(
        f"solver {solver.name}: {solver.status}, {solver.seconds:.1f} s, {report.result.evaluated} schedules scored; "
        f"the bound holds for {covers}"
        + (
            " without W ops"
            if has_w
            else ""
            if scope == Scope.ANY
            else " (the others' gap is to the one for every schedule)"
        )
    )
    lb_w = solver.model_extra.get("lower_bound_w_ms")
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
    lb_1f1b = solver.model_extra.get("lower_bound_1f1b_ms")
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


def _int_list(value: Optional[str], what: str) -> Optional[list[int]]:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UmoptError(f"{what} must be comma-separated integers, got {value!r}") from None


@cli.command()
@click.option("--model", required=True, help="vgg16, gpt, mlp, or package.module:factory for your own.")
@click.option(
    "--model-arg",
    "model_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="Model argument, repeatable (e.g. layers=8).",
)
@click.option(
    "--stages", type=int, default=None, help="Number of stages, balanced by measured per-layer time."
)
@click.option("--split", default=None, help="Stage cut points instead, e.g. 0,7,17,27.")
@click.option(
    "--sizes", default=None, help="Chunk sizes to measure, ascending from 1 (default: powers of two)."
)
@click.option(
    "--max-size", type=int, default=64, show_default=True, help="Largest chunk size for the default sizes."
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="Autocast dtype.",
)
@click.option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="CPU intra-op threads (one rank per core in the runtime).",
)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option(
    "--repeats", type=int, default=5, show_default=True, help="Timed repeats per entry; the median is kept."
)
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default="sgd", show_default=True)
@click.option(
    "--link-latency-ms",
    type=float,
    default=None,
    help="Give the link instead of measuring it (needed with one GPU).",
)
@click.option(
    "--link-gbps", type=float, default=None, help="Link bandwidth in Gbit/s, with --link-latency-ms."
)
@click.option(
    "--memory-limit",
    type=BYTES,
    default=None,
    help="Bytes per stage (16GiB, 512MB or a number) to record as the profile's memory limit.",
)
@click.option(
    "--trace",
    "trace_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write a torch.profiler trace per stage here.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed the model is built with.")
@click.option(
    "--concurrent/--sequential",
    default=None,
    help="Time all stages at once, one process each, as they run (default on CPU when the cores suffice).",
)
@click.option(
    "--probes/--no-probes",
    default=True,
    show_default=True,
    help="End with probe runs of the real runtime and fit the profile to them (where there is a core or GPU per stage).",
)
@click.option(
    "--probe-minibatch", type=int, default=32, show_default=True, help="Minibatch of the probe runs."
)
@click.option(
    "--split-backward",
    is_flag=True,
    help="Also time each backward's input and weight gradients apart (what solve --zero-bubble needs; about a quarter more time).",
)
@click.option(
    "--dp",
    type=int,
    default=1,
    show_default=True,
    help="Also measure the gradient all-reduce among this many data-parallel replicas (processes; GPUs 0..N-1 on CUDA).",
)
@click.option(
    "--chunks",
    type=int,
    default=1,
    show_default=True,
    help="Time every layer on its own (one after another) so that each stage can be cut into up to this many chunks (solve --chunks); the probe runs fit the runtime's own costs on the whole stages.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Profile file to write.")
def profile(
    model,
    model_args,
    stages,
    split,
    sizes,
    max_size,
    device,
    dtype,
    threads,
    warmup,
    repeats,
    optimizer,
    link_latency_ms,
    link_gbps,
    memory_limit,
    trace_dir,
    seed,
    concurrent,
    probes,
    probe_minibatch,
    split_backward,
    dp,
    chunks,
    output,
) -> None:
    """Measure each stage's forward/backward time per chunk size, its memory and the links."""
    _require_torch()
    from umopt.fileio import check_writable
    from umopt.formats.profile import save_profile
    from umopt.measure import ProfileOptions
    from umopt.probes import profile_in_pipeline
    from umopt.zoo import parse_model_args

    if max_size < 1:
        raise UmoptError(f"--max-size must be at least 1, got {max_size}")
    if dp < 1:
        raise UmoptError(f"--dp must be at least 1, got {dp}")
    if not 1 <= chunks <= 4:
        raise UmoptError(f"--chunks must be 1-4, got {chunks}")
    if chunks > 1 and dp > 1:
        raise UmoptError("--chunks with --dp is not supported yet")
    if probe_minibatch < 2:
        raise UmoptError(f"--probe-minibatch must be at least 2, got {probe_minibatch}")
    check_writable(output)
    opts = ProfileOptions(
        model=model,
        model_args=parse_model_args(list(model_args)),
        stages=stages,
        split=_int_list(split, "--split"),
        sizes=_int_list(sizes, "--sizes"),
        max_size=max_size,
        device=device,
        dtype=dtype,
        threads=threads,
        warmup=warmup,
        repeats=repeats,
        optimizer=optimizer,
        link_latency_ms=link_latency_ms,
        link_gbps=link_gbps,
        memory_limit_bytes=memory_limit,
        trace_dir=trace_dir,
        seed=seed,
        concurrent=concurrent,
        dp=dp,
        split_backward=split_backward,
    )
    with _progress_bar("profile") as bar:
        task = bar.add_task("", total=None)

        def progress(done: float, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total or None, description=what)

        ctx_obj = click.get_current_context().obj or {}
        argv = ctx_obj.get("argv", ["umopt", *sys.argv[1:]])
        if chunks > 1:
            from umopt.measure import profile_for_chunks

            prof = profile_for_chunks(
                opts, chunks, progress, argv, probes=probes, probe_minibatch=probe_minibatch
            )
        else:
            prof = profile_in_pipeline(
                opts,
                probes=probes,
                probe_minibatch=probe_minibatch,
                progress=progress,
                argv=argv,
                say=lambda m: bar.update(task, description=m),
            )
    save_profile(prof, output)
    table = Table(title=f"{model} on {prof.device.type} ({prof.device.name}), {prof.num_stages} stages")
    for col in (
        "stage",
        "layers",
        f"F ms @1..{prof.max_size}",
        f"B ms @1..{prof.max_size}",
        "stash/sample",
        "sends/sample",
    ):
        table.add_column(col, justify="right")
    for s, st in enumerate(prof.stages):
        table.add_row(
            str(s),
            f"{st.layers[0]}-{st.layers[1]}",
            f"{st.forward_ms[0]:.2f}..{st.forward_ms[-1]:.2f}",
            f"{st.backward_ms[0]:.2f}..{st.backward_ms[-1]:.2f}",
            f"{st.stash_bytes_per_sample / 1024:.1f} KiB",
            f"{st.output_bytes_per_sample / 1024:.1f} KiB",
        )
    out.print(table)
    if prof.links:
        ln = prof.links[0]
        out.print(
            f"links: {ln.latency_ms:.3f} ms + {8 * ln.bytes_per_ms / 1e6:.2f} Gbit/s ({ln.model_extra.get('source', '')})"
        )
    if prof.allreduce:
        ar = prof.allreduce
        out.print(
            f"all-reduce among {ar.replicas}: {ar.latency_ms:.3f} ms + {8 * ar.bus_bytes_per_ms / 1e6:.2f} Gbit/s bus bandwidth (measured)"
        )
    probed, cal = prof.meta.probes, prof.meta.calibration
    if probed and probed.ran and cal:
        out.print(
            f"fitted to {probed.schedules} probe runs of the runtime: {cal.op_overhead_ms:.3f} ms per op, "
            f"{cal.message_overhead_ms:.3f} ms per message, {cal.step_overhead_ms:+.2f} ms per iteration; "
            f"predictions within {100 * (cal.residual_rms or 0.0):.1f}% (rms) of those runs"
        )
    elif probed:
        out.print(f"note: no probe runs ({probed.why}): predictions do not include the runtime's own costs")
    for line in prof.meta.warnings:
        err.print(f"umopt: warning: {line}", markup=False, highlight=False, soft_wrap=True)
    out.print(f"wrote {output}")


_EACH = "; with several schedules a path with {name} in it, the schedule file's name without .json."


@cli.command()
@click.argument("schedules", metavar="SCHEDULE...", nargs=-1, required=True)
@click.option("--profile", default=None, help="Profile to use (default: the one the schedule names).")
@click.option(
    "--steps",
    type=int,
    default=10,
    show_default=True,
    help="Measured iterations (of each schedule, each round).",
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
    "default a quarter of --steps, at most 60).",
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
@click.option("--data", default=None, help="package.module:fn, fn(step, minibatch) -> (inputs, targets).")
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
    from umopt.launch import launch
    from umopt.noise import run_warnings
    from umopt.run_options import RunOptions

    opts = RunOptions(schedules=list(schedules), **options)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started this process as one rank
        from umopt.runtime import main as run_one_rank

        run_one_rank(opts)
        return
    with _progress_bar("run") as bar:
        task = bar.add_task("starting the ranks", total=None)

        def progress(done: int, total: Optional[int], what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        result = launch(opts, progress=progress)
    for r in result.reports:
        for line in run_warnings(r):
            err.print(f"umopt: warning: {line}", markup=False, highlight=False, soft_wrap=True)
    if len(result.reports) > 1:
        _print_turns(result.reports)
        return
    r = result.report
    if r.selection is not None:
        _print_selection(r.selection)
    kept = f" ({r.selection.winner})" if r.selection is not None else ""
    table = Table(
        title=f"{r.schedule}{kept}: {r.stages} stages, minibatch {r.minibatch}, {r.backend}, {r.steps} steps"
    )
    for col in ("", "iteration ms", "stage busy ms"):
        table.add_column(col, justify="right")
    table.add_row(
        "predicted", f"{r.predicted_iteration_ms:.2f}", " ".join(f"{x:.1f}" for x in r.busy_ms.predicted)
    )
    table.add_row(
        "measured (median)",
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
    out.print(
        f"measured / predicted = {r.measured_over_predicted:.3f}; losses per step: "
        + " ".join(f"{x:.4f}" for x in r.losses)
    )


def _print_selection(sel) -> None:
    """The schedule file's pick and candidates as they took turns over the first steps."""
    table = Table(title=f"the first {sel.steps} steps: the schedule file's pick and candidates in turns")
    table.add_column("schedule", no_wrap=True)
    for col in ("equal", "pred ms", "meas ms", "steps"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in sel.candidates:
        mark = " *" if c.name == sel.winner else ""
        meas = "-" if c.measured_ms is None else f"{c.measured_ms:.2f}"
        table.add_row(c.name + mark, "yes" if c.equal else "no", f"{c.predicted_ms:.2f}", meas, str(c.steps))
    out.print(table)
    cost = f"; measuring cost {sel.cost_ms:.0f} ms beyond the winner's pace" if sel.steps else ""
    out.print(f"kept (*) {sel.winner}: {sel.reason}{cost}", markup=False, highlight=False)
    if sel.note:
        err.print(f"umopt: note: {sel.note}", markup=False, highlight=False, soft_wrap=True)


def _print_turns(reports: list[RunReport]) -> None:
    """Schedules that took turns on the same processes, side by side; speedups over the first."""
    first = reports[0]
    table = Table(
        title=f"{first.stages} stages, {first.backend}, {first.rounds} rounds of turns, {first.steps} measured steps each: speedups over {Path(first.schedule).name}"
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


@cli.command()
@click.option(
    "--model", default=None, help="vgg16, gpt, mlp or package.module:factory (default: a small GPT)."
)
@click.option(
    "--model-arg", "model_args", multiple=True, metavar="KEY=VALUE", help="Model argument, repeatable."
)
@click.option("--stages", type=int, default=None, help="Pipeline stages (default 2).")
@click.option("--minibatch", "-B", type=int, default=None, help="Samples per iteration (default 32).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
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
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="Autocast dtype, as in umopt profile.",
)
@click.option(
    "--link-latency-ms",
    type=float,
    default=None,
    help="Give the links instead of measuring them, as in umopt profile.",
)
@click.option(
    "--link-gbps", type=float, default=None, help="Link bandwidth in Gbit/s, with --link-latency-ms."
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
    help="Model chunks per rank, 1-4 or auto (1..4): above 1, profile layer by layer and measure umopt's and torch's multi-chunk schedules too.",
)
def tune(
    model,
    model_args,
    stages,
    minibatch,
    device,
    steps,
    rounds,
    confidence,
    budget,
    time_limit,
    out_dir,
    probes,
    dtype,
    link_latency_ms,
    link_gbps,
    zero_bubble,
    chunks,
) -> None:
    """Profile, solve, run the candidates in turns and recommend what measured fastest."""
    _require_torch()
    from umopt.solve_chunks import parse_chunks
    from umopt.tune import DEFAULT
    from umopt.tune import tune as run_tune
    from umopt.zoo import parse_model_args

    args = (
        parse_model_args(list(model_args))
        if model
        else (parse_model_args(list(model_args)) or DEFAULT["model_args"])
    )
    result = run_tune(
        model or DEFAULT["model"],
        args,
        stages or DEFAULT["stages"],
        minibatch or DEFAULT["minibatch"],
        device=device,
        steps=steps,
        rounds=rounds,
        confidence=confidence,
        budget=budget,
        out_dir=out_dir,
        time_limit=time_limit,
        probes=probes,
        dtype=dtype,
        link_latency_ms=link_latency_ms,
        link_gbps=link_gbps,
        zero_bubble=zero_bubble,
        chunks=parse_chunks(chunks),
        say=lambda m: err.print(f"umopt tune: {m}", markup=False),
    )
    table = Table(
        title=f"{model or DEFAULT['model']}, {stages or DEFAULT['stages']} stages, minibatch {minibatch or DEFAULT['minibatch']}: speedups over equal GPipe"
    )
    table.add_column("schedule", no_wrap=True)
    for col in ("M", "pred ms", "meas ms", "meas x", "pred x"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in result.rows:
        mark = " *" if row.name == result.recommended else ""
        table.add_row(
            row.name + mark,
            row.chunks,
            f"{row.predicted_ms:.2f}",
            f"{row.measured_ms:.2f}",
            f"{result.speedup(row):.3f}x",
            f"{result.speedup(row, False):.3f}x",
        )
    out.print(table)
    state = "" if result.decided else "; not decided when the budget ended (more --budget or --steps decides)"
    out.print(
        f"recommended (*): {result.recommended}, {result.reason}{state}; written as {result.out_dir}/recommended.json",
        markup=False,
        highlight=False,
    )
    umopt_row = result.row("umopt")
    if result.lower_bound_ms:
        out.print(
            f"umopt's schedule is within {100 * (umopt_row.predicted_ms - result.lower_bound_ms) / result.lower_bound_ms:.1f}% "
            f"of the lower bound ({result.lower_bound_ms:.2f} ms, for {result.bound_holds_for}; not proven tight)",
            markup=False,
            highlight=False,
        )
    for line in result.warnings:
        err.print(f"umopt: warning: {line}", markup=False, highlight=False, soft_wrap=True)
    out.print(f"wrote {len(result.files)} files to {result.out_dir}/")


def _require_torch() -> None:
    """torch is needed to profile and run; say how to get it rather than fail on an import."""
    try:
        import torch
    except ImportError:
        raise UmoptError(
            "torch is not installed: pip install torch==2.13.0 (CPU) or the CUDA build for your driver"
        ) from None
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 2):
        raise UmoptError(
            f"torch {torch.__version__} is too old (umopt needs 2.2 or newer): pip install -U 'torch>=2.2'"
        )


@cli.command()
@click.argument("schedule_path", metavar="SCHEDULE")
@click.option(
    "--profile",
    "profile_path",
    default=None,
    help="Profile to check against (default: the one the schedule names).",
)
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="Gantt chart PNG of the schedule."
)
@click.option(
    "--trace", type=click.Path(dir_okay=False), default=None, help="Chrome-trace JSON of the schedule."
)
def show(schedule_path, profile_path, plot, trace) -> None:
    """Validate SCHEDULE against its profile, re-simulate it and print its numbers."""
    from umopt.fileio import check_writable
    from umopt.formats.profile import load_profile
    from umopt.formats.schedule import check_against_profile, load_schedule

    for path in filter(None, (plot, trace)):
        check_writable(path)
    schedule = load_schedule(schedule_path)
    profile = load_profile(profile_path or schedule.profile.path)
    try:
        tl = check_against_profile(schedule, profile)
    except UmoptError as exc:
        raise UmoptError(f"{schedule_path}: {exc}") from None
    table = Table(title=f"{schedule_path}: {len(tl.spans)} stages, minibatch {schedule.minibatch}")
    has_w = any(op[0] == "W" for st in schedule.stages for op in st.ops)
    kinds = ("F", "B", "W") if has_w else ("F", "B")
    for col in ("stage", *(f"{k} chunks" for k in kinds), "busy ms", "peak memory"):
        table.add_column(col, justify="right")
    for s, st in enumerate(schedule.stages):
        if schedule.chunks is None:  # in the order they run
            sizes = [_sizes([op[2] - op[1] for op in st.ops if op[0] == kind]) for kind in kinds]
        else:  # per virtual stage on the rank
            mine = [j for j, r in enumerate(schedule.chunks.ranks) if r == s]
            sizes = [
                "  ".join(
                    f"{j}: {_sizes([op[2] - op[1] for op in st.ops if op[0] == kind and op[3] == j])}"
                    for j in mine
                )
                for kind in kinds
            ]
        table.add_row(
            str(s),
            *sizes,
            f"{tl.busy_ms[s]:.3f}",
            f"{tl.peak_memory_bytes[s] / 2**20:.1f} MiB",
        )
    out.print(table)
    if schedule.chunks is not None:
        ch = schedule.chunks
        out.print(
            f"{len(ch.ranks) // len(schedule.stages)} chunks per rank ({ch.placement}): "
            + ", ".join(
                f"{j}: layers {lo}-{hi - 1} on rank {r}"
                for j, ((lo, hi), r) in enumerate(zip(ch.layers, ch.ranks))
            ),
            markup=False,
            highlight=False,
        )
    out.print(
        f"iteration {tl.iteration_ms:.3f} ms (file says {schedule.predicted.iteration_ms:.3f}), bubble {100 * tl.bubble_fraction:.1f}%"
    )
    if schedule.candidates:
        rivals = ", ".join(
            f"{c.name} ({'equal, ' if c.equal else ''}{c.predicted_iteration_ms:.3f} ms)"
            for c in schedule.candidates
        )
        out.print(
            f"measured beside it over the first steps of umopt run: {rivals}", markup=False, highlight=False
        )
    panels = [(schedule_path, tl)]
    if plot:
        from umopt.plot import gantt

        gantt(panels, plot)
    if trace:
        from umopt.trace import write_trace

        write_trace(panels, trace)


@cli.command()
@click.argument("profile_path", metavar="PROFILE")
@click.argument("reports", nargs=-1, required=True, metavar="REPORT...")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), required=True, help="Calibrated profile to write."
)
def calibrate(profile_path, reports, output) -> None:
    """Scale PROFILE's op times to what runs measured (their --report files)."""
    from umopt.calibrate import calibrate as fit
    from umopt.calibrate import size_ratios
    from umopt.fileio import check_writable
    from umopt.formats.profile import load_profile, save_profile
    from umopt.formats.report import load_report

    check_writable(output)
    profile = load_profile(profile_path)
    loaded = [load_report(r) for r in reports]
    calibrated = fit(profile, loaded, list(reports))
    table = Table(title="measured / profiled, by chunk size (median over ops)")
    for col in ("stage", "kind", "ratios"):
        table.add_column(col)
    for (s, kind), seen in sorted(size_ratios(loaded, profile.num_stages).items()):
        table.add_row(str(s), kind, "  ".join(f"{b}: {r:.2f}" for b, r in seen.items()))
    out.print(table)
    cal = calibrated.meta.calibration
    out.print(
        f"the runtime's own costs: {cal.op_overhead_ms:.3f} ms per op, {cal.message_overhead_ms:.3f} ms per message, "
        f"{cal.step_overhead_ms:+.2f} ms per iteration; predictions within {100 * (cal.residual_rms or 0.0):.1f}% (rms) of these runs"
    )
    save_profile(calibrated, output)
    out.print(f"wrote {output}")


def _sizes(sizes: list[int]) -> str:
    text = " ".join(map(str, sizes))
    return text if len(text) <= 40 else text[:37] + "..."


@cli.command()
@click.argument("schedule_path", metavar="SCHEDULE")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["torch-csv"]),
    default="torch-csv",
    show_default=True,
    help="torch-csv: torch.distributed.pipelining's action CSV (_PipelineScheduleRuntime._load_csv).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="File to write.")
def export(schedule_path, fmt, output) -> None:
    """Write SCHEDULE in another runtime's format (equal partitions only; the op order is kept)."""
    from umopt.export import torch_csv
    from umopt.fileio import check_writable, write_atomic
    from umopt.formats.schedule import load_schedule

    check_writable(output)
    text = torch_csv(load_schedule(schedule_path))
    write_atomic(output, lambda tmp: Path(tmp).write_text(text))
    out.print(f"wrote {output}: {text.count(chr(10))} ranks, load it with _PipelineScheduleRuntime._load_csv")


@cli.command("profiles")
def list_profiles() -> None:
    """List the bundled profiles (usable by name wherever a PROFILE is asked for)."""
    from umopt.formats.profile import bundled_profiles, load_profile

    table = Table()
    for col in ("name", "model", "device", "stages", "sizes"):
        table.add_column(col)
    for name in bundled_profiles():
        p = load_profile(name)
        table.add_row(
            name, p.model.name, f"{p.device.type} {p.device.name}", str(p.num_stages), f"1..{p.max_size}"
        )
    out.print(table)


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that it unwinds (children closed, temp files gone)."""


def _on_sigterm(_signum, _frame) -> None:
    raise _Terminated()


def main(argv: Optional[list[str]] = None) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        cli.main(args=args, prog_name="umopt", standalone_mode=False, obj={"argv": ["umopt", *args]})
    except UmoptError as exc:
        err.print(f"umopt: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:  # click's name for a KeyboardInterrupt
        err.print("umopt: interrupted", markup=False)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("umopt: interrupted", markup=False)
        sys.exit(130)
    except _Terminated:
        err.print("umopt: terminated", markup=False)
        sys.exit(143)


if __name__ == "__main__":
    main()
