"""The commands that read files and print them: ``umopt show``, ``umopt export``, ``umopt profiles``."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from umopt.errors import UmoptError

from .app import cli, out


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
    from umopt.formats.schedule import load_schedule
    from umopt.predict import check_against_profile

    for path in filter(None, (plot, trace)):
        check_writable(path)
    schedule = load_schedule(schedule_path)
    profile = load_profile(profile_path or schedule.profile.path)
    try:
        tl = check_against_profile(schedule, profile)
    except UmoptError as exc:
        raise UmoptError(f"{schedule_path}: {exc}") from None
    out.print(_stages_table(schedule, tl, schedule_path))
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
    panels = [(schedule.solver.recommended or schedule.solver.name, tl)]
    if plot:
        from umopt.plot import gantt

        gantt(panels, plot)
    if trace:
        from umopt.trace import write_trace

        write_trace(panels, trace)
    written = [p for p in (plot, trace) if p]
    if written:
        out.print(f"wrote {', '.join(written)}")


def _stages_table(schedule, tl, title: str) -> Table:
    """Each stage's chunks (per virtual stage where ranks hold several), busy time and peak memory."""
    table = Table(title=f"{title}: {len(tl.spans)} stages, minibatch {schedule.minibatch}")
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
    return table


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
    for col in ("name", "model", "device", "stages", "sizes", "layers", "B/W", "lengths"):
        table.add_column(col, no_wrap=col != "model")
    for name in bundled_profiles():
        p = load_profile(name)
        split = all(st.backward_input_ms is not None for st in p.stages)
        table.add_row(
            name,
            p.model.name,
            p.device.type,
            str(p.num_stages),
            f"1..{p.max_size}",
            str(len(p.layers)) if p.layers is not None else "-",
            "split" if split else "-",
            f"<={p.lengths.max_length}" if p.lengths else "-",
        )
    out.print(table)
    out.print(
        "layers: timed layer by layer, so solve --chunks can cut the stages into several chunks per rank; "
        "B/W split: solve --zero-bubble can place W ops; lengths: costed by tokens up to that length, "
        "so solve --lengths can plan sequences of different lengths",
        markup=False,
        highlight=False,
    )
