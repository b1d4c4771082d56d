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
    from umopt.measure.calibrate import calibrate as fit
    from umopt.measure.calibrate import size_ratios

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
