"""What to recommend when the profile cannot tell schedules apart.

A profile's entries are medians of noisy repeats, and its fit to the runtime leaves a residual;
a schedule predicted 0.5% faster than the best equal one may well measure slower, and it runs
more ops and messages, each a chance for the runtime to lose time the model does not see. So the
predicted gain of the best schedule found over the best equal one comes with its uncertainty,
and unless the gain is larger, the best equal schedule, the simple one a user would otherwise
run, is recommended instead.

The uncertainty has two parts. The spread of the profile's entries (their interquartile ranges,
where the profiler kept them) is propagated by simulating both schedules in profiles perturbed
by it; and the residual of the profile's fit to probe runs of the runtime (``meta.calibration``)
says how far the cost model itself is from what the runtime does. A profile with neither (a
synthetic one, or one written before either existed) has no stated uncertainty, and its best
schedule is taken as predicted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..costmodel import CostTables, simulate
from ..formats.profile import Profile
from .problem import Candidate, Problem

__all__ = ["Choice", "complexity", "gain_uncertainty", "order_ratios", "choose"]

# how many standard deviations of the gain a schedule must be ahead to count as ahead
Z = 2.0
# perturbed profiles the spread is propagated through
SAMPLES = 32
# repeats behind each profile entry at least (the profiler's default); the spread of the median
# of n repeats is about 1.25 / sqrt(n) times theirs
MIN_REPEATS = 5


@dataclass(frozen=True)
class Choice:
    """The recommended candidate, what it was picked over, and why."""

    name: str
    candidate: Candidate
    gain: Optional[float]  # predicted gain of the best schedule found over the best equal one
    uncertainty: float  # Z standard deviations of that gain (0: none stated)
    reason: str


def complexity(problem: Problem, cand: Candidate) -> int:
    """Ops plus messages of a candidate's schedule: what the runtime pays for beyond compute."""
    ops = cand.ops()
    tl = simulate(problem.tables, ops, problem.minibatch)
    return sum(len(st) for st in ops) + len(tl.messages)


def _perturbed_tables(
    profile: Profile, problem: Problem, rng: np.random.Generator
) -> Optional[list[CostTables]]:
    """Tables of profiles whose entries are moved by their spread (None: the profile has none);
    the all-reduces are the problem's."""
    if not any(st.forward_iqr_ms for st in profile.stages):
        return None
    scale = 1.2533 / np.sqrt(MIN_REPEATS) / 1.349  # interquartile range -> the median's standard deviation
    out = []
    for _ in range(SAMPLES):
        stages = []
        for st in profile.stages:
            update = {}
            for key, iqr in (("forward_ms", st.forward_iqr_ms), ("backward_ms", st.backward_iqr_ms)):
                if iqr:
                    v = np.asarray(getattr(st, key))
                    update[key] = list(
                        np.maximum(0.0, v + rng.standard_normal(v.size) * np.asarray(iqr) * scale)
                    )
            stages.append(st.model_copy(update=update))
        tables = CostTables.from_profile(
            profile.model_copy(update={"stages": stages}), problem.recompute, minibatch=problem.minibatch
        )
        out.append(dataclasses.replace(tables, allreduce_ms=problem.tables.allreduce_ms))
    return out


def gain_uncertainty(
    profile: Profile, problem: Problem, best: Candidate, reference: Candidate, seed: int = 0
) -> float:
    """One standard deviation of the relative gain of ``best`` over ``reference``: the profile's
    spread propagated, and the residual of its fit to probe runs."""
    var = 0.0
    tables = _perturbed_tables(profile, problem, np.random.default_rng(seed))
    if tables is not None:
        best_ops, reference_ops = best.ops(), reference.ops()
        gains = [
            simulate(t, reference_ops, problem.minibatch, record=False).iteration_ms
            / simulate(t, best_ops, problem.minibatch, record=False).iteration_ms
            for t in tables
        ]
        var += float(np.var(gains))
    calibration = profile.meta.calibration
    rms = float(calibration.residual_rms or 0.0) if calibration else 0.0
    # two predictions each off by about rms: their ratio by up to sqrt(2) times that
    return float(np.sqrt(var + 2 * rms**2))


def order_ratios(profile: Profile) -> dict[str, float]:
    """Per order (a family's name): the geometric mean of measured / predicted over the profile's
    probe runs of that order, after the fit (empty where no probes ran)."""
    return dict(profile.meta.probes.order_ratio) if profile.meta.probes else {}


def choose(
    profile: Profile,
    problem: Problem,
    candidates: Sequence[tuple[str, Candidate]],
    equal: Sequence[str],
    seed: int = 0,
) -> Choice:
    """Among ``candidates`` (name, candidate, each within the memory limit), the fastest predicted
    one if it is ahead of the best equal one (``equal`` names the equal schedules) by more than
    the profile's uncertainty; else that best equal schedule. The equal schedules are ranked by
    their predictions times what the probe runs of their order measured over the fitted model:
    where the model cannot tell GPipe from 1F1B, the runtime has."""
    timed = sorted(
        ((c.simulate(problem).iteration_ms, name, c) for name, c in candidates), key=lambda t: t[0]
    )
    best_ms, best_name, best = timed[0]
    ratio = order_ratios(profile)
    by_model = [t for t in timed if t[1] in equal]
    equals = sorted(by_model, key=lambda t: t[0] * ratio.get(t[2].order, 1.0))
    if not equals:
        return Choice(best_name, best, None, 0.0, "no equal schedule to compare with")
    ref_ms, ref_name, ref = equals[0]
    probes = ""
    if ref_name != by_model[0][1]:
        other, first = by_model[0][1], by_model[0][2].order
        probes = (
            f"; {ref_name} over {other} (predicted {100 * (ref_ms / by_model[0][0] - 1):.1f}% slower): in the probe runs "
            f"{ref.order} measured {ratio[ref.order]:.2f}x the fitted model's time and {first} {ratio[first]:.2f}x"
        )
    if best_name in equal:
        return Choice(ref_name, ref, 0.0, 0.0, "the fastest predicted schedule is an equal one" + probes)
    # the gain is over the best equal schedule predicted, as the model alone sees it
    eq_ms, eq_name, eq = by_model[0]
    gain = eq_ms / best_ms - 1
    margin = Z * gain_uncertainty(profile, problem, best, eq, seed)
    if margin == 0.0:
        return Choice(best_name, best, gain, 0.0, "the profile states no uncertainty: the fastest predicted")
    if gain > margin:
        return Choice(
            best_name,
            best,
            gain,
            margin,
            f"ahead of {eq_name} by more than the profile's uncertainty ({100 * margin:.1f}%)",
        )
    return Choice(
        ref_name,
        ref,
        gain,
        margin,
        f"the best schedule found is predicted {100 * gain:.1f}% faster than {eq_name}, within the profile's uncertainty "
        f"({100 * margin:.1f}%): {ref_name}, with {complexity(problem, ref)} ops and messages against {complexity(problem, best)}, is recommended"
        + probes,
    )
