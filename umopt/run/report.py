"""The run report of ``umopt run``: what a schedule measured on every rank, beside the simulator's
prediction for exactly its ops, logged and written (report, Chrome trace, Gantt picture).

With sequences of different lengths (each step its own minibatch and plan) the iteration figures
are means over the measured steps, beside the tokens per second, and the prediction is each
step's plan's; the trace and the picture are the last step's, beside its plan.

Each figure says which steps it covers: ``steps`` measured steps (after ``warmup`` warm-up steps
and ``selection_steps`` steps of selection's turns), whose median is the measured iteration and
whose per-rank median busy time is ``busy_ms`` (so busy time never exceeds the iteration it is
part of); ``losses`` are those of every step trained (``trained_steps``).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Optional

from ..costmodel import CostTables, OpKind, Span, Timeline, simulate
from ..formats.profile import AllReduceProfile
from ..formats.report import Decision as ReportDecision
from ..formats.report import LengthsRun, MeasuredPredicted, PeakMemory, RunReport, Selection, save_report
from ..formats.schedule import Schedule
from ..measure.decide import Decision
from ..measure.noise import run_warnings
from ..predict import schedule_tables
from .options import RunConfig

__all__ = ["Measured", "run_allreduce", "write_report"]

_log = logging.getLogger("umopt.runtime")


@dataclass
class Measured:
    """What one schedule measured, every rank's part gathered (replica 0's ranks, by rank)."""

    name: str
    path: str  # the schedule file it came from
    schedule: Schedule
    step_ms: list[float]  # each measured step, the slowest rank's time
    warmup: int
    selection_steps: int
    trained_steps: int  # warm-up, selection and measured steps together
    # per rank: spans (last step), busy_ms and allreduce_ms (medians over measured steps), op_ms,
    # losses, reference_ms, numerics_differ, peak_memory_bytes
    per_rank: list[dict]
    played: list[
        Schedule
    ]  # every schedule that played (selection's candidates too): the memory they may need
    lengths: Optional[LengthsRun] = None  # sequences of different lengths (schedule: the last step's plan)


def measured_timeline(per_rank: list[dict]) -> Timeline:
    """The last measured step as a timeline (its spans), for the trace and the picture."""
    spans = []
    busy = []
    for s, rec in enumerate(per_rank):
        mine = [
            Span(s, k, lo, hi, t0, t1, j)
            for k, lo, hi, j, t0, t1 in rec["spans"]
            if k in (OpKind.F, OpKind.B, OpKind.W)
        ]
        spans.append(mine)
        busy.append(sum(sp.end - sp.start for sp in mine))
    end = max((t1 for rec in per_rank for *_, t1 in rec["spans"]), default=0.0)
    finish = [sp[-1].end if sp else 0.0 for sp in spans]
    # the all-reduce span (data-parallel replicas) runs from the stage's last op to its end
    ar = [
        max([t1 for k, *_, t1 in rec["spans"] if k == "AR"], default=f) - f
        for rec, f in zip(per_rank, finish)
    ]
    return Timeline(
        iteration_ms=end, busy_ms=busy, peak_memory_bytes=[], spans=spans, finish_ms=finish, allreduce_ms=ar
    )


def run_allreduce(cfg: RunConfig, schedule: Schedule) -> Optional[AllReduceProfile]:
    """The all-reduce the prediction of ``schedule`` includes with ``--dp`` replicas: at the speed
    the schedule was solved with, else the one its profile measured (None: one pipeline, or no
    speed known, which the report says)."""
    speed = schedule.dp or cfg.profile.allreduce
    return (
        None
        if cfg.options.dp <= 1 or speed is None
        else speed.model_copy(update={"replicas": cfg.options.dp})
    )


def write_report(
    cfg: RunConfig,
    m: Measured,
    k: int,
    rounds: int,
    decision: Optional[Decision],
    selection: Optional[Selection],
) -> None:
    """Schedule ``k``'s report: logged, written, traced and plotted where asked."""
    opts = cfg.options
    tl = measured_timeline(m.per_rank)
    allreduce = run_allreduce(cfg, m.schedule)
    if m.lengths is not None:  # the last step's plan, as the planner costed it
        tables = schedule_tables(m.schedule, cfg.profile)
    else:
        tables = CostTables.from_profile(
            cfg.profile, m.schedule.recompute, allreduce, m.schedule.chunking(), m.schedule.minibatch
        )
    pred_tl = simulate(tables, m.schedule.op_lists(), m.schedule.minibatch)
    report = _run_report(cfg, m, pred_tl, rounds, decision, selection, allreduce)
    measured, predicted = report.measured_iteration_ms, report.predicted_iteration_ms
    report_path, trace_path, plot_path = (cfg.output(t, k) for t in (opts.report, opts.trace, opts.plot))
    tokens = (
        f" (mean), {m.lengths.tokens_per_s:,.0f} tokens/s vs predicted {m.lengths.predicted_tokens_per_s:,.0f}"
        if m.lengths is not None
        else ""
    )
    _log.info(
        "%s: measured %.2f ms, predicted %.2f ms%s (measured / predicted %.3f) over %d steps%s",
        m.name,
        measured,
        predicted,
        tokens,
        measured / predicted,
        len(m.step_ms),
        f"; report {report_path}" if opts.report else "",
    )
    if decision is not None and k == len(cfg.schedules) - 1:
        _log.info(
            "keep %s: %s%s",
            decision.winner,
            decision.reason,
            "" if decision.decided else " (not decided when the turns ended)",
        )
    for line in run_warnings(report):
        _log.warning(line)
    if report_path:
        save_report(report, report_path)
    panels = [("predicted", pred_tl), ("measured (last step)", tl)]
    if trace_path:
        from ..trace import write_trace

        write_trace(panels, trace_path)
    if plot_path:
        from ..plot import gantt

        gantt(
            panels,
            plot_path,
            title=f"{cfg.profile.model.name}: measured {measured:.1f} ms vs predicted {predicted:.1f} ms",
        )


def _run_report(
    cfg: RunConfig,
    m: Measured,
    pred_tl: Timeline,
    rounds: int,
    decision: Optional[Decision],
    selection: Optional[Selection],
    allreduce: Optional[AllReduceProfile],
) -> RunReport:
    """The report of one schedule: its measured steps beside the simulator's prediction."""
    opts, schedule, per_rank = cfg.options, m.schedule, m.per_rank
    measured = statistics.median(m.step_ms)
    predicted = pred_tl.iteration_ms  # the simulator's, not what the file says
    ar_measured = [rec["allreduce_ms"] for rec in per_rank]
    if m.lengths is not None:  # every step its own plan: the means, and the most any plan needs
        measured = statistics.fmean(m.step_ms)
        predicted = statistics.fmean(m.lengths.predicted_step_ms)
        peaks = [m.lengths.predicted_peak_memory_bytes or pred_tl.peak_memory_bytes]
    else:
        peaks = [
            simulate(
                CostTables.from_profile(cfg.profile, sc.recompute, allreduce, sc.chunking(), sc.minibatch),
                sc.op_lists(),
                sc.minibatch,
            ).peak_memory_bytes
            for sc in m.played
        ]
    measured_peak = [rec["peak_memory_bytes"] for rec in per_rank]
    own = [rec.get("peak_predicted_bytes") for rec in per_rank]
    if None not in own:  # each rank's own, its pools counted ([Note: one pool of token rows])
        peaks = [own]
    return RunReport(
        schedule=str(m.path),
        profile=cfg.profile.path,
        backend=opts.backend,
        stages=cfg.num_stages,
        dp=opts.dp,
        allreduce=allreduce,  # what the prediction took the replicas' all-reduce to cost (None: one pipeline, or left out)
        minibatch=schedule.minibatch,
        recompute=schedule.recompute,
        steps=len(m.step_ms),
        warmup=m.warmup,
        selection_steps=m.selection_steps,
        trained_steps=m.trained_steps,
        rounds=rounds,
        round_ms=[
            statistics.median(m.step_ms[i : i + opts.steps]) for i in range(0, len(m.step_ms), opts.steps)
        ],
        schedules_in_turn=len(cfg.schedules),  # the schedules that took turns with it on the same processes
        measured_iteration_ms=measured,
        predicted_iteration_ms=predicted,
        measured_over_predicted=measured / predicted,
        step_ms=m.step_ms,
        busy_ms=MeasuredPredicted(
            measured=[rec["busy_ms"] for rec in per_rank],
            # sequences: the measured steps' plans' median, as the measured figure is theirs
            predicted=[rec["busy_predicted_ms"] for rec in per_rank]
            if m.lengths is not None
            else pred_tl.busy_ms,
        ),
        allreduce_ms=MeasuredPredicted(measured=ar_measured, predicted=pred_tl.allreduce_ms)
        if opts.dp > 1
        else None,
        peak_memory_bytes=PeakMemory(
            measured=[] if None in measured_peak else measured_peak,
            predicted=[max(p[r] for p in peaks) for r in range(len(per_rank))],
        ),
        # per rank, every op with its median measured duration and the profile's: what
        # `umopt calibrate` fits a profile to
        ops=[
            [(kind, lo, hi, ms, sp.end - sp.start) for (kind, lo, hi, ms), sp in zip(rec["op_ms"], pred)]
            for rec, pred in zip(per_rank, pred_tl.spans)
        ],
        losses=per_rank[schedule.chunks.ranks[-1] if schedule.chunks is not None else -1]["losses"],
        reference_ms=[rec["reference_ms"] for rec in per_rank],
        numerics_differ=sorted({d for rec in per_rank for d in rec.get("numerics_differ", [])}),
        decision=None
        if decision is None
        else ReportDecision(
            winner=decision.winner,
            reference=decision.reference,
            confidence=decision.confidence,
            decided=decision.decided,
            confidence_asked=opts.decide,
            reason=decision.reason,
        ),
        selection=selection,
        **({"chunks": schedule.chunks.model_dump()} if schedule.chunks is not None else {}),
        lengths=m.lengths,
    )
