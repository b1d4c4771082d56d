"""One partition shared by every stage, chosen by dynamic programming (the TeraPipe/DynaPipe estimate).

Chunk i of size b_i costs t(b_i) = the slowest stage's forward plus backward time of b_i samples;
a pipeline of S stages then takes about ``sum_i t(b_i) + (S - 1) * max_i t(b_i)``. For every
candidate value of the max, an unbounded knapsack finds the least sum with no chunk above it; the
best total wins. The partition is then ordered (small chunks first or last) and scored with the
cost model. It shows what per-stage partitions add over a good shared one.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...errors import UmoptError
from ...schedules.family import GPIPE, ScheduleFamily
from ..problem import Candidate, Problem, SolverResult, pack
from .entry import entry

__all__ = ["shared_partition", "solve_dp"]


def _fits(problem: Problem) -> np.ndarray:
    """Chunk sizes 1..max that keep every stage under the memory limit wherever they run in GPipe
    order (the whole minibatch is held at the last F and the first B)."""
    t, B = problem.tables, problem.minibatch
    b = np.arange(1, problem.max_size + 1)
    if problem.memory_limit is None:
        return np.ones(len(b), dtype=bool)
    held = t.input_bytes if problem.recompute else t.stash_bytes
    running = t.stash_bytes if problem.recompute else np.zeros_like(t.stash_bytes)
    peak = t.static_bytes[:, None] + B * held[:, None] + b[None, :] * running[:, None]
    return (peak <= problem.memory_limit).all(axis=0)


def shared_partition(problem: Problem) -> list[int]:
    """Chunk sizes minimising sum(t_i) + (S-1) max(t_i), largest first."""
    t = problem.tables
    B, S, mx = problem.minibatch, problem.num_stages, problem.max_size
    cost = (t.fwd + t.bwd)[:, 1 : mx + 1].max(axis=0)  # t(b) for b = 1..mx
    cost = np.where(_fits(problem), cost, np.inf)
    if not np.isfinite(cost).any():
        raise UmoptError(
            "dp: no GPipe schedule fits the memory limit (try --recompute or a smaller minibatch)"
        )
    caps = np.unique(cost[np.isfinite(cost)])
    # best[c, n]: least sum of t over partitions of n samples with every t(b) <= caps[c]
    best = np.full((len(caps), B + 1), np.inf)
    choice = np.zeros((len(caps), B + 1), dtype=np.int64)
    best[:, 0] = 0.0
    sizes = np.arange(1, mx + 1)
    allowed = cost[None, :] <= caps[:, None] + 1e-12  # (C, mx)
    for n in range(1, B + 1):
        k = min(n, mx)
        tot = best[:, n - sizes[:k]] + np.where(allowed[:, :k], cost[:k], np.inf)
        choice[:, n] = np.argmin(tot, axis=1) + 1
        best[:, n] = tot[np.arange(len(caps)), choice[:, n] - 1]
    total = best[:, B] + (S - 1) * caps
    c = int(np.argmin(total))
    parts, n = [], B
    while n > 0:
        parts.append(int(choice[c, n]))
        n -= parts[-1]
    return sorted(parts, reverse=True)


@entry
def solve_dp(
    problem: Problem,
    *,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    S = problem.num_stages
    sizes = shared_partition(problem)
    orders = [sizes, sizes[::-1]]
    it, _ = GPIPE.score(problem.tables, pack([[o] * S for o in orders]))
    k = int(np.argmin(it))
    # the partition is chosen for GPipe order; asked for another family, the same chunks run in its order
    cand = Candidate.uniform(orders[k], S, (order or GPIPE).name)
    cand.iteration_ms = cand.simulate(problem).iteration_ms
    return SolverResult("dp", cand, "feasible", evaluated=len(orders))
