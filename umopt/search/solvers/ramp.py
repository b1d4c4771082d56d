"""One shared partition with a ramp: small chunks first and last, equal chunks between.

A pipeline of S stages fills with its first chunks and drains with its last ones: in 1F1B order
the last stage starts after the first chunk has passed S - 1 stages, and the first stage ends
after the last chunk's gradient has come back through them. Small chunks there shorten both;
large ones in the middle run at the profile's best per-sample cost. Equal chunks cannot have
both, and on deep pipelines the GA rarely finds the shape by itself, because it must line up
chunk ends on every stage at once; started from the best ramp it does (``auto``).

The family, for every middle size m up to the profile's largest: an up-ramp a, 2a, 4a, ... below
m (a = 1 to 4, or none), chunks of m, the remainder as one smaller chunk after them, and a
down-ramp (the up-ramp mirrored, or none); and the best equal partitions, so that the result is never
worse than the best equal schedule. Every stage gets the same partition, in each family's
order (1F1B with PipeDream-flush warm-ups), and the whole family is scored in one call of the
population simulator (hundreds of partitions in about a second). ``auto`` hands the best to
the GA as a start.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ...errors import UmoptError
from ...schedules.family import ScheduleFamily, ruled
from ...schedules.partition import equal_sizes
from ..baselines import best_equal
from ..problem import Candidate, Problem, SolverResult, pack
from .entry import entry

__all__ = ["ramped_partitions", "solve_ramp"]

# the ramps start at 1 to 4 samples and double: about 4 ramps per middle size, two down-ramps
RAMP_STARTS = range(1, 5)


def _doubling(first: int, below: int) -> list[int]:
    out = []
    while first < below:
        out.append(first)
        first *= 2
    return out


def ramped_partitions(minibatch: int, max_size: int, equal_counts: Sequence[int] = ()) -> list[list[int]]:
    """Every partition of the family above (distinct, sorted), each summing to ``minibatch``,
    with the equal partitions into ``equal_counts`` chunks."""
    B = minibatch
    found = {tuple(equal_sizes(B, n)) for n in equal_counts}
    for m in range(1, min(max_size, B) + 1):
        ups = {()} | {tuple(_doubling(a, m)) for a in RAMP_STARTS}
        for up in ups:
            for down in (up, ()):
                rest = B - sum(up) - sum(down)
                if rest < 0:
                    continue
                middle = [m] * (rest // m) + ([rest % m] if rest % m else [])
                found.add((*up, *middle, *down[::-1]))
    return [list(p) for p in sorted(found)]


@entry
def solve_ramp(
    problem: Problem,
    *,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    S = problem.num_stages
    # every family's best equal partition stands in for all of them (the baselines scored them all)
    equal = sorted({best_equal(problem, f).microbatches for f in ruled()} - {None})
    parts = ramped_partitions(problem.minibatch, problem.max_size, equal)
    packed = pack([[p] * S for p in parts])
    scored: list[tuple[float, Candidate]] = []
    for fam in ruled() if order is None else [order]:
        it, _ = fam.score(problem.tables, packed)
        k = int(np.argmin(it))
        scored.append((float(it[k]), Candidate.uniform(parts[k], S, fam.name)))
    ms, cand = min(scored, key=lambda x: x[0])
    if not np.isfinite(ms):
        raise UmoptError(
            "ramp: no ramped schedule fits the memory limit (try --recompute or a smaller minibatch)"
        )
    cand.iteration_ms = cand.simulate(problem).iteration_ms
    evaluated = len(parts) * len(scored)
    return SolverResult("ramp", cand, "feasible", evaluated=evaluated)
