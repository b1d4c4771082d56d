"""Fit a profile's costs by tokens to runs of sequences of different lengths:
``umopt calibrate PROFILE REPORT... -o OUT`` with reports of ``umopt run PLAN --lengths/--data``.

``umopt profile --lengths`` times each stage alone on a grid of chunks of sequences; inside a
running pipeline the same ops take longer or shorter (another rank's ops beside them on the same
cores, caches, the runtime's own work per op: shapes from the plan, masks, buffers). A run of
sequences writes every measured step's ops into its report, each with its plan's prediction and
its measured duration (``lengths.op_pairs``). For each stage, mode (packed or padded) and kind (F,
B, W) this module fits ``measured = r * predicted + delta`` over those ops (least squares; where
the ops' predictions barely differ, as padding's equal rows, the ratio alone): ``r`` scales
every term of the stage's fit (per token, per square, per sequence, per op) and ``delta`` is what
each op costs beyond it. The stage's layers (a profile for several chunks per rank) move with it,
each term scaled alike and ``delta`` shared out, so that they still sum to the stage. From runs
with several chunks per rank each virtual stage is fitted so and moves its own layers, and each
stage's fits become its layers' sums; the reports must then share one layout (the same layer
cut two ways would be fitted twice).

Then what a step costs beyond its ops: every measured step's plan (``lengths.plans``) is
predicted again on the fitted costs, and what the measured steps leave over them (their mean, in
relative least squares) is added to every stage's ``optimizer_ms``, as ``umopt calibrate`` fits
runs of one length. A mode (packed or padded) the runs held no op of is dropped from the
calibrated profile: left as profiled beside a fitted one, it would win the planner's choice by
its error alone. What it leaves: the per-message costs (the probe runs of ``umopt profile``
fit those) and runs with ``--recompute`` (their B ops hold a forward too: refused in one line).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..costmodel import simulate
from ..errors import UmoptError
from ..formats.profile import CalibrationMeta, Profile, TokenCosts, TokenFit
from ..formats.report import RunReport, as_report
from ..predict import schedule_tables

__all__ = ["TokenRefit", "calibrate_tokens"]

# a fit's field for each op kind; B where the stage's ops were split into B and W: its input part
_FIELD = {"F": "forward", "B": "backward", "W": "backward_weight"}
MIN_OPS = 4  # ops a (stage, mode, kind) needs before it is fitted
SPREAD = 0.15  # the predictions' coefficient of variation below which only the ratio is fitted


@dataclass(frozen=True)
class TokenRefit:
    """One (stage, mode, kind)'s fit: the ratio, each op's own cost beyond it, over how many ops,
    and the relative RMS error of the ops' predictions before and after."""

    stage: int
    mode: str
    kind: str  # the fit's field: forward, backward, backward_input, backward_weight
    ratio: float
    per_op_ms: float
    ops: int
    rms_before: float
    rms_after: float


def _check(rep: RunReport, name: str, profile: Profile) -> None:
    if rep.lengths is None:
        raise UmoptError(
            f"{name}: a run of one length; give runs of sequences of different lengths alone (their costs by "
            "tokens are fitted), or of one length alone (their costs by sample count)"
        )
    if not rep.lengths.op_pairs:
        raise UmoptError(
            f"{name}: no ops with their predictions (written by an older umopt run; run it again)"
        )
    if rep.chunks and profile.layers is None:
        raise UmoptError(
            f"{name}: a run with several chunks per rank, and the profile has no per-layer entries"
        )
    if rep.recompute:
        raise UmoptError(
            f"{name}: a run with --recompute (its B ops hold a forward too); calibrate from runs without"
        )
    if rep.stages != profile.num_stages:
        raise UmoptError(f"{name}: has {rep.stages} stages, the profile {profile.num_stages}")
    held = _held(rep, profile)
    for mode, s, *_ in rep.lengths.op_pairs:
        if not 0 <= s < len(held):
            raise UmoptError(f"{name}: an op of stage {s}, and the run had {len(held)}")
        costs = profile.stages[s].tokens if not rep.chunks else profile.layers[held[s][0]].tokens  # type: ignore[index]
        if costs is None or mode not in costs:
            raise UmoptError(
                f"{name}: ran {mode} sequences on stage {s}, which the profile has no costs by tokens for"
            )


def _held(rep: RunReport, profile: Profile) -> list[tuple[int, int, int]]:
    """Each (virtual) stage of the run: its layers (lo, hi) and its rank."""
    if rep.chunks:
        return [(lo, hi, r) for (lo, hi), r in zip(rep.chunks["layers"], rep.chunks["ranks"])]
    return [(st.layers[0], st.layers[1], s) for s, st in enumerate(profile.stages)]


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``y ~ r * x + delta`` in least squares of the relative error (so the fit is never further
    off than the predictions were) where the predictions spread, else the ratio alone."""
    q = x / y  # the relative error of r * x is r * q - 1
    ratio_only = (float(q.sum() / (q * q).sum()), 0.0)
    if x.std() < SPREAD * x.mean():
        return ratio_only
    r, delta = np.linalg.lstsq(np.stack([q, 1.0 / y], axis=1), np.ones_like(y), rcond=None)[0]
    # a per-op cost that would take back most of the smallest op, or a ratio far from one: the
    # ops do not tell the two apart; the ratio alone is the safer fit
    if not 0.2 <= r <= 5.0 or delta < -0.5 * x.min():
        return ratio_only
    return float(r), float(delta)


def _scaled(fit: TokenFit, r: float, extra: float) -> TokenFit:
    return fit.model_copy(
        update={
            "a_ms": max(0.0, r * fit.a_ms + extra),
            "b_ms": r * fit.b_ms,
            "c_ms": r * fit.c_ms,
            "d_ms": r * fit.d_ms,
        }
    )


def _only(entry, modes: set[str]):
    """A stage or layer entry with its costs by tokens in ``modes`` only."""
    if entry.tokens is None:
        return entry
    return entry.model_copy(update={"tokens": {m: c for m, c in entry.tokens.items() if m in modes}})


def _summed(st, layers):
    """A stage whose costs by tokens are its layers' sums (each fit term by term)."""
    if st.tokens is None:
        return st
    mine = layers[st.layers[0] : st.layers[1]]
    tokens = {}
    for mode, costs in st.tokens.items():
        update = {}
        for field in ("forward", "backward", "backward_input", "backward_weight"):
            fits = [getattr(ly.tokens[mode], field) for ly in mine if ly.tokens and mode in ly.tokens]
            if getattr(costs, field) is None or len(fits) != len(mine) or None in fits:
                continue
            update[field] = getattr(costs, field).model_copy(
                update={k: sum(getattr(f, k) for f in fits) for k in ("a_ms", "b_ms", "c_ms", "d_ms")}
            )
        tokens[mode] = costs.model_copy(update=update)
    return st.model_copy(update={"tokens": tokens})


def calibrate_tokens(
    profile: Profile, reports: Sequence[RunReport | dict], names: list[str]
) -> tuple[Profile, list[TokenRefit]]:
    """A copy of ``profile`` with its costs by tokens fitted to the reports' ops (see the module
    docstring), and each fit. With several chunks per rank, each virtual stage's fit moves its
    layers, and each stage's own fits become its layers' sums."""
    reports = [as_report(rep, name) for rep, name in zip(reports, names)]
    for rep, name in zip(reports, names):
        _check(rep, name, profile)
    if len({json.dumps(rep.chunks, sort_keys=True) for rep in reports}) > 1:
        raise UmoptError(
            "the reports ran on different layouts (chunks per rank, placement or cut): calibrate from the runs "
            "of one layout at a time"
        )
    held = _held(reports[0], profile)
    pairs: dict[tuple[int, str, str], list[tuple[float, float]]] = defaultdict(list)
    for rep in reports:
        ops = rep.lengths.op_pairs  # type: ignore[union-attr]
        split = {s for _, s, kind, *_ in ops if kind == "W"}  # stages whose B ops left W ops behind
        for mode, s, kind, predicted, measured in ops:
            field = "backward_input" if kind == "B" and s in split else _FIELD[kind]
            if predicted > 0 and measured > 0:
                pairs[(s, mode, field)].append((predicted, measured))
    stages = list(profile.stages)
    layers = list(profile.layers) if profile.layers is not None else None
    chunked = reports[0].chunks is not None
    refits = []
    for (s, mode, field), seen in sorted(pairs.items()):
        if len(seen) < MIN_OPS:
            continue
        x, y = (np.array(v) for v in zip(*seen))
        r, delta = _fit(x, y)
        lo, hi, rank = held[s]
        # an op predicted fit + o (its rank's per-op cost) measures r (fit + o) + delta
        extra = (r - 1.0) * profile.stages[rank].op_overhead_ms + delta
        if not chunked:
            costs: TokenCosts = stages[s].tokens[mode]  # type: ignore[index]
            if getattr(costs, field) is None:
                continue
            new = costs.model_copy(update={field: _scaled(getattr(costs, field), r, extra)})
            stages[s] = stages[s].model_copy(update={"tokens": {**stages[s].tokens, mode: new}})  # type: ignore[dict-item]
        if layers is not None:
            for i in range(lo, hi):
                ly = layers[i]
                if ly.tokens is None or mode not in ly.tokens or getattr(ly.tokens[mode], field) is None:
                    continue
                mine = ly.tokens[mode].model_copy(
                    update={field: _scaled(getattr(ly.tokens[mode], field), r, extra / (hi - lo))}
                )
                layers[i] = ly.model_copy(update={"tokens": {**ly.tokens, mode: mine}})
        rms = lambda p: float(np.sqrt(np.mean(((y - p) / y) ** 2)))  # noqa: E731
        refits.append(TokenRefit(s, mode, field, r, delta, len(seen), rms(x), rms(r * x + delta)))
    if chunked and layers is not None:  # each stage's own fits: its layers' sums, term by term
        stages = [_summed(st, layers) for st in stages]
    if not refits:
        raise UmoptError(
            f"the reports hold fewer than {MIN_OPS} ops of any stage, mode and kind: nothing to fit"
        )
    # a mode the runs did not measure is dropped: a planner choosing between a fitted mode
    # and one left as profiled chose the unfitted one (padded, on this CPU 1.4-2.3x over its costs
    # where packed was fitted to 1.0x): the calibrated profile keeps the modes it fitted only
    kept = {f.mode for f in refits}
    stages = [_only(st, kept) for st in stages]
    layers = [_only(ly, kept) for ly in layers] if layers is not None else None
    lengths = profile.lengths.model_copy(  # type: ignore[union-attr]
        update={"modes": [m for m in profile.lengths.modes if m in kept]}  # type: ignore[union-attr]
    )
    fitted = profile.model_copy(
        update={"stages": stages, "lengths": lengths, **({"layers": layers} if layers is not None else {})}
    )
    fitted, iteration = _fit_iteration(fitted, reports)
    old = profile.meta.calibration or CalibrationMeta()
    fits = {
        f"stage{f.stage}.{f.mode}.{f.kind}": {
            "ratio": round(f.ratio, 4),
            "per_op_ms": round(f.per_op_ms, 5),
            "ops": f.ops,
            "rms_before": round(f.rms_before, 4),
            "rms_after": round(f.rms_after, 4),
        }
        for f in refits
    }
    if iteration is not None:
        fits["iteration"] = iteration
    calibration = old.model_copy(
        update={
            "reports": [*old.reports, *names],
            "step_overhead_ms": old.step_overhead_ms + (iteration or {}).get("step_ms", 0.0),
            "tokens": fits,
        }
    )
    return fitted.model_copy(
        update={"meta": profile.meta.model_copy(update={"calibration": calibration})}
    ), refits


def _fit_iteration(profile: Profile, reports: list[RunReport]) -> tuple[Profile, Optional[dict[str, float]]]:
    """What a step costs beyond its ops, fitted as ``umopt calibrate`` fits runs of one length:
    each measured step's plan predicted again on the fitted op costs, and the mean of what its
    measured time leaves (relative least squares) added to every stage's ``optimizer_ms`` (an
    iteration's own cost never below zero). None where the reports hold no plans."""
    # a report keeps the last measured steps' plans: they pair with the last step times
    steps = [
        (plan, ms)
        for rep in reports
        for plan, ms in zip(rep.lengths.plans, rep.step_ms[len(rep.step_ms) - len(rep.lengths.plans) :])  # type: ignore[union-attr]
    ]
    if not steps:
        return profile, None
    measured = np.array([ms for _, ms in steps])

    def predicted(p: Profile) -> np.ndarray:
        return np.array(
            [
                simulate(schedule_tables(plan, p), plan.op_lists(), plan.minibatch, record=False).iteration_ms
                for plan, _ in steps
            ]
        )

    weight = 1.0 / measured**2
    before = predicted(profile)
    step = float((weight * (measured - before)).sum() / weight.sum())
    step = max(step, -min(st.optimizer_ms for st in profile.stages))
    fitted = profile.model_copy(
        update={
            "stages": [
                st.model_copy(update={"optimizer_ms": st.optimizer_ms + step}) for st in profile.stages
            ]
        }
    )
    after = predicted(fitted)
    rms = lambda p: float(np.sqrt(np.mean(((measured - p) / measured) ** 2)))  # noqa: E731
    return fitted, {
        "step_ms": round(step, 4),
        "steps": len(steps),
        "rms_before": round(rms(before), 4),
        "rms_after": round(rms(after), 4),
    }
