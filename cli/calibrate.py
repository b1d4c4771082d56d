"""``umopt calibrate``: a profile scaled to what runs measured."""

from __future__ import annotations

import click
from rich.table import Table

from .app import cli, out


@cli.command()
@click.argument("profile_path", metavar="PROFILE")
@click.argument("reports", nargs=-1, required=True, metavar="REPORT...")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), required=True, help="Calibrated profile to write."
)
def calibrate(profile_path, reports, output) -> None:
    """Scale PROFILE's op times to what runs measured (their --report files)."""
    from umopt.fileio import check_writable
    from umopt.formats.profile import load_profile, save_profile
    from umopt.formats.report import load_report
    from umopt.measure.calibrate import calibrate_runs

    check_writable(output)
    profile = load_profile(profile_path)
    fitted = calibrate_runs(profile, [load_report(r) for r in reports], list(reports))
    if fitted.refits:
        _print_tokens(profile, fitted)
    else:
        _print_sizes(fitted)
    save_profile(fitted.profile, output)
    out.print(f"wrote {output}")


def _print_sizes(fitted) -> None:
    """Runs of one length: measured over profiled by chunk size, and the runtime's own costs."""
    table = Table(title="measured / profiled, by chunk size (median over ops)")
    for col in ("stage", "kind", "ratios"):
        table.add_column(col)
    for (s, kind), seen in sorted(fitted.ratios.items()):
        table.add_row(str(s), kind, "  ".join(f"{b}: {r:.2f}" for b, r in seen.items()))
    out.print(table)
    cal = fitted.profile.meta.calibration
    out.print(
        f"the runtime's own costs: {cal.op_overhead_ms:.3f} ms per op, {cal.message_overhead_ms:.3f} ms per message, "
        f"{cal.step_overhead_ms:+.2f} ms per iteration; predictions within {100 * (cal.residual_rms or 0.0):.1f}% (rms) of these runs"
    )


def _print_tokens(profile, fitted) -> None:
    """Runs of sequences: each refit of the costs by tokens, what was dropped, a step's own cost."""
    calibrated, refits = fitted.profile, fitted.refits
    table = Table(title="costs by tokens: measured = ratio x predicted + per op, over the runs' ops")
    for col in ("stage", "mode", "fit", "ops", "ratio", "per op ms", "error before", "after"):
        table.add_column(col, justify="left" if col in ("mode", "fit") else "right", no_wrap=True)
    for f in refits:
        table.add_row(
            str(f.stage),
            f.mode,
            f.kind,
            str(f.ops),
            f"{f.ratio:.3f}",
            f"{f.per_op_ms:+.3f}",
            f"{100 * f.rms_before:.1f}%",
            f"{100 * f.rms_after:.1f}%",
        )
    out.print(table)
    dropped = sorted(set(profile.lengths.modes if profile.lengths else ()) - {f.mode for f in refits})
    if dropped:
        out.print(
            f"dropped the {', '.join(dropped)} costs: the runs held no such op (a mode left as profiled beside "
            "a fitted one would win the planner's choice by its error alone)",
            markup=False,
            highlight=False,
        )
    it = calibrated.meta.calibration.tokens.get("iteration")
    if it is not None:
        out.print(
            f"a step beyond its ops: {it['step_ms']:+.2f} ms (over {it['steps']:.0f} steps, their predictions "
            f"{100 * it['rms_before']:.1f}% off with the ops fitted, {100 * it['rms_after']:.1f}% after)",
            markup=False,
            highlight=False,
        )
    out.print(
        "error: the ops' predictions off their measured durations (relative, rms); the per-message costs are "
        "left as they were",
        style="dim",
        markup=False,
        highlight=False,
    )
