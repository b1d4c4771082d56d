"""``umopt profile``: measure a model's stages into a profile file."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from .app import BYTES, _int_list, _progress_bar, _require_torch, cli, model_options, out, warn


@cli.command()
@click.option("--model", required=True, help="vgg16, gpt, mlp, or package.module:factory for your own.")
@model_options
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
    help="Time every layer on its own (one after another) so that each stage can be cut into up to this many chunks (solve --chunks); each stage is also timed whole and fitted to probe runs, and its layers scaled to it.",
)
@click.option(
    "--lengths",
    type=int,
    default=None,
    help="Also time chunks of sequences of different lengths up to this many tokens and fit each stage's costs by tokens (what solve --lengths plans with; models that take sequences, e.g. gpt).",
)
@click.option(
    "--length-modes",
    default=None,
    help="With --lengths: packed, padded or both, comma-separated (default: packed where the model packs, and padded).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Profile file to write.")
def profile(
    model, model_args, stages, split, sizes, max_size, device, dtype, threads, warmup, repeats, optimizer,
    link_latency_ms, link_gbps, memory_limit, trace_dir, seed, concurrent, probes, probe_minibatch,
    split_backward, dp, chunks, lengths, length_modes, output,
) -> None:  # fmt: skip
    """Measure each stage's forward/backward time per chunk size, its memory and the links."""
    _require_torch()
    from umopt.fileio import check_writable
    from umopt.formats.profile import save_profile
    from umopt.measure import ProfileOptions
    from umopt.probes import check_profile_ask, profile_asked
    from umopt.zoo import model_name, parse_model_args

    opts = ProfileOptions(
        model=model_name(model), model_args=parse_model_args(list(model_args)), stages=stages,
        split=_int_list(split, "--split"), sizes=_int_list(sizes, "--sizes"), max_size=max_size,
        device=device, dtype=dtype, threads=threads, warmup=warmup, repeats=repeats, optimizer=optimizer,
        link_latency_ms=link_latency_ms, link_gbps=link_gbps, memory_limit_bytes=memory_limit,
        trace_dir=trace_dir, seed=seed, concurrent=concurrent, dp=dp, split_backward=split_backward,
        lengths=lengths,
        length_modes=tuple(m.strip() for m in length_modes.split(",")) if length_modes else None,
    )  # fmt: skip
    check_profile_ask(opts, chunks, probe_minibatch)
    check_writable(output)
    argv = (click.get_current_context().obj or {}).get("argv", ["umopt", *sys.argv[1:]])
    with _progress_bar("profile") as bar:
        task = bar.add_task("", total=None)

        def progress(done: float, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total or None, description=what)

        prof = profile_asked(
            opts, chunks, probes=probes, probe_minibatch=probe_minibatch, progress=progress, argv=argv,
            say=lambda m: bar.update(task, description=m),
        )  # fmt: skip
    save_profile(prof, output)
    _print_profile(prof, model)
    out.print(f"wrote {output}")


def _print_profile(prof, model: str) -> None:
    """A profile as a table of its stages, its links, all-reduce, fit to the probe runs, warnings."""
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
    if prof.lengths:
        _print_token_fits(prof)
    if prof.links:
        ln = prof.links[0]
        out.print(
            f"links: {ln.latency_ms:.3f} ms + {8 * ln.bytes_per_ms / 1e6:.2f} Gbit/s ({ln.source or ''})"
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
        warn(line)


def _print_token_fits(prof) -> None:
    """Each stage's costs by tokens: the fits and how well they fit what was timed."""
    table = Table(
        title=f"costs by tokens (sequences up to {prof.lengths.max_length}): ms = a + b tok + c len² + d seq"
    )
    for col in ("stage", "mode", "op", "a ms", "b us/tok", "c ns/len²", "d us/seq", "fit error"):
        table.add_column(col, justify="right")
    for s, st in enumerate(prof.stages):
        for mode, c in (st.tokens or {}).items():
            for op, f in (("F", c.forward), ("B", c.backward)):
                table.add_row(
                    str(s),
                    mode,
                    op,
                    f"{f.a_ms:.3f}",
                    f"{1e3 * f.b_ms:.3f}",
                    f"{1e6 * f.c_ms:.3f}",
                    f"{1e3 * f.d_ms:.1f}",
                    "" if f.residual is None else f"{100 * f.residual:.1f}%",
                )
    out.print(table)
