"""What every report compares against: the best equal schedules.

``gpipe_equal``: M chunks of equal size (differing by at most one) on every stage, all F then all
B, the best M. ``onef1b_equal``: the same chunks in 1F1B (PipeDream-flush) order, M >= S.
M values whose peak memory breaks the limit are skipped. (The lower bounds are :mod:`umopt.search.bounds`.)

Every M is accounted for, but not every M is simulated: no iteration is shorter than its busiest
stage's compute, so once that alone exceeds the best M simulated, the M is out. With per-op
costs growing faster than linearly in the chunk count, that leaves a few dozen of the B values
at large minibatches, and the search stays linear in B instead of quadratic. Each problem
computes its baselines once (several solvers ask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..schedules.family import GPIPE, ONEF1B, ScheduleFamily
from ..schedules.partition import equal_sizes
from .problem import Candidate, Problem, pack

__all__ = ["Baseline", "feasible_m", "best_equal", "gpipe_equal", "onef1b_equal"]

# chunk counts simulated together, in a (batch, S, M) array of at most so many cells
_BATCH = 32
_BATCH_CELLS = 1 << 21


@dataclass
class Baseline:
    name: str
    microbatches: Optional[int]  # None when no M fits
    iteration_ms: Optional[float]
    candidate: Optional[Candidate]


def feasible_m(problem: Problem, lowest: int = 1) -> range:
    """Chunk counts whose equal chunks are within the profile's measured sizes."""
    B = problem.minibatch
    return range(max(lowest, -(-B // problem.max_size)), B + 1)


def _busiest_stage_ms(problem: Problem, ms: np.ndarray) -> np.ndarray:
    """For each chunk count M, the compute of the busiest stage: a lower bound on its iteration."""
    t = problem.tables
    if t.ranged is not None:  # each chunk's own samples (see [Note: costs by sample range])
        out = []
        for m in ms:
            ends = np.cumsum(equal_sizes(problem.minibatch, int(m)))
            lo, hi = ends - np.asarray(equal_sizes(problem.minibatch, int(m))), ends
            out.append(float((t.ranged.fwd[:, lo, hi] + t.ranged.bwd[:, lo, hi]).sum(axis=1).max()))
        return np.array(out)
    q, r = np.divmod(problem.minibatch, ms)
    per = t.fwd + t.bwd  # (S, sizes)
    busy = r * per[:, np.minimum(q + 1, t.max_size)] + (ms - r) * per[:, q]
    return busy.max(axis=0)


def best_equal(problem: Problem, fam: ScheduleFamily, lowest: Optional[int] = None) -> Baseline:
    """The best equal schedule of a family built by rule, over every feasible chunk count from
    ``lowest`` (default: the fewest the family's equal schedule is run with)."""
    name = fam.equal_name
    key = name if lowest is None else f"{name}/{lowest}"
    if key in problem.cache:
        return problem.cache[key]
    S, B = problem.num_stages, problem.minibatch
    ms = np.array(feasible_m(problem, lowest=fam.fewest_equal_chunks(S) if lowest is None else lowest))
    best_ms, best_m = np.inf, None
    if len(ms):
        lb = _busiest_stage_ms(problem, ms)
        todo = ms[np.argsort(lb, kind="stable")]
        lb = np.sort(lb, kind="stable")
        score = fam.score
        i = 0
        while i < len(todo) and lb[i] <= best_ms:
            # the next few counts still in the running (few: each batch tightens the best), in one
            # array of bounded size
            batch = []
            for m, low in zip(todo[i : i + _BATCH], lb[i : i + _BATCH]):
                if low > best_ms or (len(batch) + 1) * S * max(int(m), *batch, 1) > _BATCH_CELLS:
                    break
                batch.append(int(m))
            batch = batch or [int(todo[i])]
            n = len(batch)
            it, _ = score(problem.tables, pack([[equal_sizes(B, m)] * S for m in batch]))
            for m, t in zip(batch, it):
                if t < best_ms or (
                    t == best_ms and best_m is not None and m < best_m
                ):  # ties go to the smaller M
                    best_ms, best_m = float(t), m
            i += n
    if best_m is None or not np.isfinite(best_ms):
        base = Baseline(name, None, None, None)
    else:
        cand = Candidate.uniform(equal_sizes(B, best_m), S, order=fam.name)
        cand.iteration_ms = best_ms
        base = Baseline(name, best_m, best_ms, cand)
    problem.cache[key] = base
    return base


def gpipe_equal(problem: Problem) -> Baseline:
    return best_equal(problem, GPIPE)


def onef1b_equal(problem: Problem, fewer_than_stages: bool = False) -> Baseline:
    """1F1B's best equal schedule: with at least one microbatch per stage, as torch's Schedule1F1B
    runs it (the spec's baseline); ``fewer_than_stages``, from one up, as Megatron-LM runs it
    (each stage's warm-up min(S - s - 1, M))."""
    return best_equal(problem, ONEF1B, 1 if fewer_than_stages else None)
