"""Fit a profile to what a run measured: ``umopt calibrate PROFILE REPORT... -o OUT``.

A profile times each stage alone (or beside the others on a CPU), one chunk at a time; in a real
pipeline the same ops can run slower or faster (caches holding several chunks' activations,
communication threads beside compute, allocator state). ``umopt run`` writes every op's median
measured duration into its report beside the profile's prediction; this module scales the
profile's ``forward_ms`` and ``backward_ms`` by the measured ratio, per stage, per kind (F or B)
and per chunk size:

* the ratio of a size seen in the runs is the median of measured / predicted over its ops;
* between seen sizes it is interpolated in log size; beyond them it is the nearest one's.

An iteration also holds work no op time covers (the optimizer step inside a running pipeline,
building the step's batch, waiting on the last messages): what each report measured beyond what
the op-calibrated profile predicts for its own op lists is that step overhead; its median over
the reports is added to every stage's ``optimizer_ms`` (the cost model's per-iteration term), so it
shifts every schedule's prediction alike and changes no comparison between them.

The simulator then predicts with the calibrated profile as with any other (it stays the single
source of predicted times); the profile says what it was fitted to in ``meta.calibration``.
Runs with ``--recompute`` time B as forward plus backward, so their B ops are not used.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .errors import UmoptError
from .formats.profile import Profile

__all__ = ["calibrate", "size_ratios", "step_overhead_ms"]


def _check_report(rep, name: str, profile: Profile, tables) -> None:
    if not isinstance(rep, dict) or "measured_iteration_ms" not in rep:
        raise UmoptError(f"{name}: not a report of umopt run")
    ops = rep.get("ops")
    if ops is None:
        raise UmoptError(f"{name}: no per-op times (written by an older umopt run; run it again)")
    if not isinstance(ops, list) or len(ops) != profile.num_stages:
        raise UmoptError(f"{name}: has {len(ops) if isinstance(ops, list) else 'no'} stages, the profile {profile.num_stages}")
    for s, stage_ops in enumerate(ops):
        for op in stage_ops:
            try:
                kind, lo, hi, measured, predicted = op
                b = int(hi) - int(lo)
                table = tables.fwd if kind == "F" else tables.bwd
                expected = float(table[s, b]) if 1 <= b <= tables.max_size else None
                ok = kind in ("F", "B") and float(measured) >= 0 and expected is not None
            except (TypeError, ValueError):
                ok, expected, predicted = False, None, None
            if not ok:
                raise UmoptError(f"{name}: stage {s} has a malformed op entry {op!r}")
            if abs(float(predicted) - expected) > 1e-6 * max(1.0, expected):
                raise UmoptError(f"{name}: was not measured against this profile (stage {s} {kind}({lo},{hi}) predicted {predicted:.4f} ms, the profile says {expected:.4f})")


def size_ratios(reports: list[dict], num_stages: int) -> dict[tuple[int, str], dict[int, float]]:
    """``{(stage, "F"|"B"): {size: median measured / predicted}}`` over every op of every report."""
    samples: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for rep in reports:
        for s, ops in enumerate(rep["ops"]):
            for kind, lo, hi, measured, predicted in ops:
                if kind == "B" and rep.get("recompute"):
                    continue
                if predicted > 0:
                    samples[(s, kind, hi - lo)].append(measured / predicted)
    out: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)
    for (s, kind, b), rs in sorted(samples.items()):
        out[(s, kind)][b] = float(np.median(rs))
    return dict(out)


def calibrate(profile: Profile, reports: list[dict], names: list[str]) -> Profile:
    """A copy of ``profile`` with its op times scaled to the reports' measurements.

    Every report must come from a run of a schedule for this very profile: each op's predicted
    duration in the report must be the profile's (else it was measured against another one).
    """
    from .costmodel import CostTables

    for rep, name in zip(reports, names):
        _check_report(rep, name, profile, CostTables.from_profile(profile, bool(rep.get("recompute"))))
    ratios = size_ratios(reports, profile.num_stages)
    log_sizes = np.log(np.asarray(profile.sizes, dtype=float))
    stages = []
    for s, st in enumerate(profile.stages):
        update = {}
        for kind, key in (("F", "forward_ms"), ("B", "backward_ms")):
            seen = ratios.get((s, kind))
            if not seen:
                continue
            xs = np.log(np.asarray(list(seen), dtype=float))
            scale = np.interp(log_sizes, xs, np.asarray(list(seen.values())))
            update[key] = [float(v * r) for v, r in zip(getattr(st, key), scale)]
        stages.append(st.model_copy(update=update))
    scaled = profile.model_copy(update={"stages": stages})
    overhead = step_overhead_ms(scaled, reports)
    stages = [st.model_copy(update={"optimizer_ms": max(0.0, st.optimizer_ms + overhead)}) for st in stages]
    meta = dict(getattr(profile, "meta", None) or {})
    meta["calibration"] = {
        "reports": names,
        "ratios": {f"stage{s}.{kind}": {str(b): round(r, 4) for b, r in seen.items()} for (s, kind), seen in ratios.items()},
        "step_overhead_ms": round(overhead, 4),
    }
    return profile.model_copy(update={"stages": stages, "meta": meta})


def step_overhead_ms(profile: Profile, reports: list[dict]) -> float:
    """Median over the reports of measured iteration - the iteration ``profile`` predicts for the
    report's own op lists (in the order they ran)."""
    from .costmodel import CostTables, simulate

    residuals = []
    for rep in reports:
        ops = [[(kind, int(lo), int(hi)) for kind, lo, hi, *_ in stage] for stage in rep["ops"]]
        minibatch = int(rep.get("minibatch") or max(hi for stage in ops for _, _, hi in stage))
        tl = simulate(CostTables.from_profile(profile, bool(rep.get("recompute"))), ops, minibatch, record=False)
        residuals.append(float(rep["measured_iteration_ms"]) - tl.iteration_ms)
    return float(np.median(residuals)) if residuals else 0.0
