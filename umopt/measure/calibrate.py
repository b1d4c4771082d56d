"""Fit a profile to what runs measured: ``umopt calibrate PROFILE REPORT... -o OUT``, and the
probes at the end of ``umopt profile``.

A profile times each stage alone (or beside the others on a CPU), one chunk at a time; in a real
pipeline the same ops can run slower or faster (caches holding several chunks' activations,
communication threads beside compute, allocator state), and the runtime adds costs of its own.
``umopt run`` writes every op's median measured duration into its report beside the profile's
prediction. This module fits the profile to those reports in two steps:

* op times: the profile's ``forward_ms`` and ``backward_ms`` are scaled by the measured ratio, per
  stage, per kind (F or B) and per chunk size (the median of measured / predicted over its ops;
  between seen sizes interpolated in log size, beyond them the nearest one's), and fitted again
  not to fall as chunks grow;
* the runtime's own costs: what each op costs beyond its compute (``op_overhead_ms``, the same on
  every stage: the runtime's dispatch and bookkeeping), what each message costs beyond its
  transfer (``message_overhead_ms``), and what an iteration spends beyond its ops (the optimizer
  step inside a running pipeline, the last messages: added to ``optimizer_ms``), chosen so that
  the simulator's iteration times for the reports' own op lists fit the measured ones in least
  squares of the relative error. Reports whose schedules differ in how many ops and messages they
  run tell the per-op and per-message costs from the per-iteration one; one report alone only
  fits the latter.

The simulator then predicts with the calibrated profile as with any other (it stays the single
source of predicted times); the profile says what it was fitted to, and how far the fitted
predictions still are from the reports (``residual_rms``), in ``meta.calibration``.
Runs with ``--recompute`` time B as forward plus backward, so their B ops are not used for the
op times.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..costmodel import OpKind
from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, CalibrationMeta, Profile
from ..formats.report import RunReport, as_report
from .calibrate_tokens import calibrate_tokens
from .noise import monotone_fit

__all__ = [
    "calibrate",
    "calibrate_runs",
    "Calibrated",
    "size_ratios",
    "fit_overheads",
    "Overheads",
    "run_ratios",
]


@dataclass
class Calibrated:
    """``umopt calibrate``'s answer: the fitted profile, with what was fitted: the op times by size
    (``ratios``, measured over profiled per (stage, kind) and size), or the costs by tokens
    (``refits``, each stage's, mode's and kind's fit)."""

    profile: Profile
    ratios: dict[tuple[int, str], dict[int, float]]
    refits: list  # umopt.measure.calibrate_tokens.TokenRefit


def calibrate_runs(profile: Profile, reports: Sequence[RunReport], names: list[str]) -> Calibrated:
    """``profile`` fitted to runs, whichever kind they are: runs of sequences of different lengths
    refit its costs by tokens (:func:`umopt.measure.calibrate_tokens.calibrate_tokens`), runs of
    one length scale its op times by size (:func:`calibrate`)."""
    if any(r.lengths is not None for r in reports):
        fitted, refits = calibrate_tokens(profile, list(reports), names)
        return Calibrated(fitted, {}, refits)
    fitted = calibrate(profile, list(reports), names)
    return Calibrated(fitted, size_ratios(list(reports), profile.num_stages), [])


def _check_report(rep: RunReport, name: str, profile: Profile) -> None:
    from ..costmodel import CostTables

    if rep.measured_iteration_ms is None:
        raise UmoptError(f"{name}: measured_iteration_ms is null: not a report of a finished run")
    if rep.ops is None:
        raise UmoptError(f"{name}: no per-op times (written by an older umopt run; run it again)")
    if rep.lengths is not None:
        raise UmoptError(
            f"{name}: a run of sequences of different lengths (each op's cost by its tokens); calibrate fits "
            "costs by sample count from runs of one length (umopt profile --lengths fits the costs by tokens)"
        )
    if rep.chunks:
        raise UmoptError(
            f"{name}: a run with several chunks per rank; calibrate from runs of one chunk per rank (umopt profile fits those itself)"
        )
    if len(rep.ops) != profile.num_stages:
        raise UmoptError(f"{name}: has {len(rep.ops)} stages, the profile {profile.num_stages}")
    tables = CostTables.from_profile(profile, rep.recompute)
    for s, stage_ops in enumerate(rep.ops):
        split = any(op[0] == OpKind.W for op in stage_ops)
        if split and tables.bwd_input is None:
            raise UmoptError(
                f"{name}: ran W ops, but the profile has no backward_input_ms / backward_weight_ms"
            )
        for kind, lo, hi, _measured, predicted in stage_ops:
            b = hi - lo
            if not 1 <= b <= tables.max_size or lo < 0:
                raise UmoptError(
                    f"{name}: stage {s} has a malformed op entry {[kind, lo, hi]} (a chunk the profile has no time for)"
                )
            table = {
                OpKind.F: tables.fwd,
                OpKind.B: tables.bwd_input if split else tables.bwd,
                OpKind.W: tables.bwd_weight,
            }[kind]
            expected = float(table[s, b])
            if abs(predicted - expected) > 1e-6 * max(1.0, expected):
                raise UmoptError(
                    f"{name}: was not measured against this profile (stage {s} {kind}({lo},{hi}) predicted {predicted:.4f} ms, the profile says {expected:.4f})"
                )


def _allreduce(rep: RunReport, profile: Profile) -> Optional[AllReduceProfile]:
    """The all-reduce of a run of data-parallel replicas (None: one pipeline): the profile's, fitted,
    where it has one, else what the run was predicted with; for the run's replicas."""
    if not rep.allreduce:
        return None
    ran = rep.allreduce
    return (profile.allreduce or ran).model_copy(update={"replicas": ran.replicas})


def fit_allreduce(profile: Profile, reports: list[RunReport]) -> Optional[AllReduceProfile]:
    """The profile's all-reduce with its latency fitted to the runs of data-parallel replicas
    (the median over stages and runs of measured minus bandwidth term: what the replicas'
    skew and the machine add to every all-reduce); None where no report ran replicas."""
    from ..costmodel import allreduce_ms

    extra = []
    base = None
    for rep in reports:
        ar = _allreduce(rep, profile)
        if ar is None or not rep.allreduce_ms:
            continue
        base = base or ar
        bandwidth_only = ar.model_copy(update={"latency_ms": 0.0})
        extra += [
            m - allreduce_ms(bandwidth_only, st.param_bytes or 0)
            for m, st in zip(rep.allreduce_ms.measured, profile.stages)
        ]
    if base is None:
        return None
    return base.model_copy(update={"latency_ms": max(0.0, float(np.median(extra)))})


def size_ratios(reports: list[RunReport], num_stages: int) -> dict[tuple[int, str], dict[int, float]]:
    """``{(stage, "F"|"B"): {size: median measured / predicted}}`` over every op of every report."""
    samples: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for rep in reports:
        for s, ops in enumerate(rep.ops or []):
            split = any(op[0] == OpKind.W for op in ops)
            for kind, lo, hi, measured, predicted in ops:
                # a B with recompute, or split from its W, is not the profile's backward
                if kind == OpKind.W or (kind == OpKind.B and (rep.recompute or split)):
                    continue
                if predicted > 0:
                    samples[(s, kind, hi - lo)].append(measured / predicted)
    out: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)
    for (s, kind, b), rs in sorted(samples.items()):
        out[(s, kind)][b] = float(np.median(rs))
    return dict(out)


def calibrate(profile: Profile, reports: Sequence[RunReport | dict], names: list[str]) -> Profile:
    """A copy of ``profile`` fitted to the reports' measurements.

    Every report must come from a run of a schedule for this very profile: each op's predicted
    duration in the report must be the profile's (else it was measured against another one).
    """
    reports = [
        as_report(rep, name) for rep, name in zip(reports, names)
    ]  # files read as JSON, or typed already
    for rep, name in zip(reports, names):
        _check_report(rep, name, profile)
    ratios = size_ratios(reports, profile.num_stages)
    log_sizes = np.log(np.asarray(profile.sizes, dtype=float))
    stages = []
    for s, st in enumerate(profile.stages):
        update = {}
        for kind, key in ((OpKind.F, "forward_ms"), (OpKind.B, "backward_ms")):
            seen = ratios.get((s, kind))
            if not seen:
                continue
            xs = np.log(np.asarray(list(seen), dtype=float))
            scale = np.interp(log_sizes, xs, np.asarray(list(seen.values())))
            # an op span measures what the old profile predicted as compute plus overhead; the
            # scaled curve, like the measured one, may not fall as chunks grow
            scaled = [float(r * (v + st.op_overhead_ms)) for v, r in zip(getattr(st, key), scale)]
            iqr = getattr(st, key.replace("_ms", "_iqr_ms"))
            weights = (
                None
                if iqr is None
                else [1.0 / (q / max(v, 1e-12) + 0.01) ** 2 for q, v in zip(iqr, getattr(st, key))]
            )
            update[key] = monotone_fit(scaled, weights)
            if kind == OpKind.B and st.backward_input_ms is not None:  # its two parts move with it
                for part in ("backward_input_ms", "backward_weight_ms"):
                    update[part] = monotone_fit(
                        [float(r * (v + st.op_overhead_ms)) for v, r in zip(getattr(st, part), scale)]
                    )
        stages.append(st.model_copy(update=update))
    scaled = profile.model_copy(update={"stages": stages})
    allreduce = fit_allreduce(scaled, reports)
    if allreduce is not None:
        scaled = scaled.model_copy(update={"allreduce": allreduce})
    fit = fit_overheads(scaled, reports)
    fitted = fit.apply(scaled)
    probes = profile.meta.probes
    if probes is not None:  # what the probe runs measured over the old fit does not hold for this one
        probes = probes.model_copy(update={"order_ratio": {}, "measured_over_fitted": {}})
    calibration = CalibrationMeta(
        reports=names,
        ratios={
            f"stage{s}.{kind}": {str(b): round(r, 4) for b, r in seen.items()}
            for (s, kind), seen in ratios.items()
        },
        op_overhead_ms=round(fit.op_ms, 5),
        message_overhead_ms=round(fit.message_ms, 5),
        step_overhead_ms=round(fit.step_ms, 4),
        residual_rms=round(fit.residual_rms, 5),
        **({"allreduce_latency_ms": round(allreduce.latency_ms, 4)} if allreduce is not None else {}),
    )
    return fitted.model_copy(
        update={"meta": profile.meta.model_copy(update={"probes": probes, "calibration": calibration})}
    )


@dataclass(frozen=True)
class Overheads:
    """The runtime's own costs, fitted: per op, per message, per iteration (ms), and the relative
    RMS error of the fitted predictions over the reports."""

    op_ms: float
    message_ms: float
    step_ms: float
    residual_rms: float

    def apply(self, profile: Profile) -> Profile:
        stages = [
            st.model_copy(
                update={
                    "op_overhead_ms": self.op_ms,
                    "optimizer_ms": max(0.0, st.optimizer_ms + self.step_ms),
                }
            )
            for st in profile.stages
        ]
        links = [ln.model_copy(update={"message_overhead_ms": self.message_ms}) for ln in profile.links]
        return profile.model_copy(update={"stages": stages, "links": links})


def _report_ops(rep: RunReport) -> tuple[list, int]:
    ops = [[(kind, int(lo), int(hi)) for kind, lo, hi, *_ in stage] for stage in rep.ops or []]
    return ops, int(rep.minibatch or max(hi for stage in ops for _, _, hi in stage))


def fit_overheads(profile: Profile, reports: list[RunReport]) -> Overheads:
    """The per-op, per-message and per-iteration costs that make the simulator's iteration times
    of the reports' op lists fit their measured ones (least squares of the relative error).

    The per-iteration cost enters linearly, so for given per-op and per-message costs it is the
    weighted mean residual; those two are found by coordinate search (golden sections on
    ``[0, what one op or message could at most hold]``, a few sweeps): the simulator is the model,
    so whatever a schedule's critical path makes of an op's cost is what the fit sees.
    """
    from ..costmodel import CostTables, simulate

    if not reports:
        return Overheads(0.0, 0.0, 0.0, 0.0)
    runs = [
        (_report_ops(rep), float(rep.measured_iteration_ms), (rep.recompute, _allreduce(rep, profile)))
        for rep in reports
    ]
    measured = np.array([m for _, m, _ in runs])
    weight = 1.0 / measured**2

    def predict(op_ms: float, message_ms: float) -> np.ndarray:
        p = Overheads(op_ms, message_ms, 0.0, 0.0).apply(profile)
        return np.array(
            [
                simulate(CostTables.from_profile(p, *rc), ops, B, record=False).iteration_ms
                for (ops, B), _, rc in runs
            ]
        )

    def step_and_error(op_ms: float, message_ms: float) -> tuple[float, float]:
        res = measured - predict(op_ms, message_ms)
        # an iteration's own cost beyond its ops cannot be negative: where the runs were faster
        # than the ops alone predict, the per-op and per-message costs give way instead
        step = max(0.0, float((weight * res).sum() / weight.sum()))
        return step, float((weight * (res - step) ** 2).sum())

    most_ops = max(sum(len(st) for st in ops) for (ops, _), _, _ in runs)
    op_hi = float(measured.max()) / max(1, most_ops)
    msg_hi = op_hi if profile.num_stages > 1 else 0.0
    x = [0.0, 0.0]
    if (
        len({sum(len(st) for st in ops) for (ops, _), _, _ in runs}) > 1
    ):  # op counts differ: they can be told apart
        for _ in range(3):
            for k, hi in ((0, op_hi), (1, msg_hi)):
                if hi > 0:
                    x[k] = _golden(lambda v: step_and_error(*(x[:k] + [v] + x[k + 1 :]))[1], 0.0, hi)
        # Where the runs cannot tell a cost apart from the others (a message's cost on a pipeline
        # that waits on compute moves only its fill and drain, as an iteration's does), keep the
        # least of it that fits as well: what is not seen is not charged
        best = step_and_error(*x)[1]
        for k in (1, 0):
            ok = lambda v: step_and_error(*(x[:k] + [v] + x[k + 1 :]))[1] <= best * 1.01 + 1e-12  # noqa: E731
            lo, hi = 0.0, x[k]
            if ok(lo):
                x[k] = 0.0
                continue
            for _ in range(20):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if ok(mid) else (mid, hi)
            x[k] = hi
    step, err = step_and_error(*x)
    return Overheads(x[0], x[1], step, float(np.sqrt(err / len(runs))))


def run_ratios(profile: Profile, reports: list[RunReport]) -> list[float]:
    """Each report's measured iteration over what ``profile`` predicts for its op list: what a
    fit leaves, run by run."""
    from ..costmodel import CostTables, simulate

    out = []
    for rep in reports:
        (ops, B), rc = _report_ops(rep), (rep.recompute, _allreduce(rep, profile))
        out.append(
            float(rep.measured_iteration_ms)
            / simulate(CostTables.from_profile(profile, *rc), ops, B, record=False).iteration_ms
        )
    return out


def _golden(f, lo: float, hi: float, iters: int = 24) -> float:
    """The minimiser of ``f`` on ``[lo, hi]`` by golden sections (``f`` taken as unimodal there)."""
    g = (np.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    best = min((f(lo), lo), (fc, c), (fd, d), key=lambda t: t[0])
    return float(best[1])
