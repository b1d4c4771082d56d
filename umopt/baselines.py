"""What every report compares against: the best equal schedules and a lower bound.

``gpipe_equal``: M chunks of equal size (differing by at most one) on every stage, all F then all
B, the best M. ``onef1b_equal``: the same chunks in 1F1B (PipeDream-flush) order, M >= S.
``lower_bound``: no schedule of the cost model can be faster (docs/formats.md, "Baselines").
M values whose peak memory breaks the limit are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .partition import equal_sizes
from .problem import Candidate, Problem, pack, score_1f1b, score_gpipe

__all__ = ["Baseline", "feasible_m", "gpipe_equal", "onef1b_equal", "lower_bound", "min_work"]


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


def gpipe_equal(problem: Problem) -> Baseline:
    ms = list(feasible_m(problem))
    S = problem.num_stages
    parts = [[equal_sizes(problem.minibatch, m)] * S for m in ms]
    it, _ = score_gpipe(problem, pack(parts))
    k = int(np.argmin(it))  # ties go to the smaller M
    if not np.isfinite(it[k]):
        return Baseline("gpipe_equal", None, None, None)
    cand = Candidate.uniform(equal_sizes(problem.minibatch, ms[k]), S)
    cand.iteration_ms = float(it[k])
    return Baseline("gpipe_equal", ms[k], float(it[k]), cand)


def onef1b_equal(problem: Problem) -> Baseline:
    S, B = problem.num_stages, problem.minibatch
    ms = list(feasible_m(problem, lowest=S))
    if not ms:
        return Baseline("1f1b_equal", None, None, None)
    it, _ = score_1f1b(problem, pack([[equal_sizes(B, m)] * S for m in ms]))
    k = int(np.argmin(it))  # ties go to the smaller M
    if not np.isfinite(it[k]):
        return Baseline("1f1b_equal", None, None, None)
    cand = Candidate.uniform(equal_sizes(B, ms[k]), S, order="1f1b")
    cand.iteration_ms = float(it[k])
    return Baseline("1f1b_equal", ms[k], float(it[k]), cand)


def min_work(cost: np.ndarray, total: int) -> float:
    """Least sum of ``cost[b_i]`` over chunk sizes ``b_i >= 1`` summing to ``total`` (unbounded knapsack).

    ``cost[b]`` is given for ``b = 0..max``; ``cost[0]`` is ignored.
    """
    mx = len(cost) - 1
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    sizes = np.arange(1, mx + 1)
    for n in range(1, total + 1):
        b = sizes[sizes <= n]
        best[n] = np.min(best[n - b] + cost[b])
    return float(best[total])


def lower_bound(problem: Problem) -> float:
    """For each stage: fastest fill + least F work + least B work + fastest drain; the max, plus optimizer.

    Fill and drain take, per stage and link on the way, the cheapest op or message of any size
    (at least one sample must pass each), which keeps the bound valid for any partitions.
    """
    t = problem.tables
    B, S, mx = problem.minibatch, problem.num_stages, problem.max_size
    cheapest_f = t.fwd[:, 1 : mx + 1].min(axis=1)
    cheapest_b = t.bwd[:, 1 : mx + 1].min(axis=1)
    cheapest_link = t.link[:, 1 : mx + 1].min(axis=1) if S > 1 else np.zeros(0)
    best = 0.0
    for s in range(S):
        fill = float(cheapest_f[:s].sum() + cheapest_link[:s].sum())
        drain = float(cheapest_b[:s].sum() + cheapest_link[:s].sum())
        work = min_work(t.fwd[s, : mx + 1], B) + min_work(t.bwd[s, : mx + 1], B)
        best = max(best, fill + work + drain)
    return best + t.optimizer_ms
