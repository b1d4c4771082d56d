"""Best-improvement hill climbing over per-stage partitions, in GPipe or 1F1B order.

A move changes one stage's forward partition (and, with recompute, its backward partition on its
own): shift the boundary between two neighbouring chunks by one sample, merge two chunks, or split
one in half; in 1F1B order, with ``free_warmup``, it may also run one forward more or fewer before
a stage's first backward. All moves of a step are scored together (one vectorized call per order; the free
order: the reference simulator) and the best one is taken, until none helps or time runs out.

The iteration time is a max over stages, so many moves tie; ties are broken by the sum of the
stages' finish times, which lets the climb cross plateaus where the slowest stage does not move yet.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ..costmodel import simulate, stage_peak_memory
from ..problem import Candidate, Problem, pack
from ..vectorized import evaluate_1f1b, evaluate_gpipe

__all__ = ["moves", "score_batch", "hill_climb"]


def moves(part: list[int], max_size: int) -> Iterator[list[int]]:
    """Every partition one move away from ``part``."""
    for j in range(len(part) - 1):
        a, b = part[j], part[j + 1]
        if a > 1 and b < max_size:
            yield part[:j] + [a - 1, b + 1] + part[j + 2 :]
        if b > 1 and a < max_size:
            yield part[:j] + [a + 1, b - 1] + part[j + 2 :]
        if a + b <= max_size:
            yield part[:j] + [a + b] + part[j + 2 :]
    for j, a in enumerate(part):
        if a > 1:
            yield part[:j] + [a // 2, a - a // 2] + part[j + 1 :]


def _neighbours(problem: Problem, cand: Candidate, free_warmup: bool = False) -> list[Candidate]:
    out = []
    mx, S = problem.max_size, problem.num_stages
    wu = cand.warmup
    for s in range(S):
        for new in moves(cand.fsizes[s], mx):
            f = cand.fsizes[:s] + [new] + cand.fsizes[s + 1 :]
            b = cand.bsizes if problem.recompute else f
            out.append(Candidate(f, b, cand.order, warmup=wu))
        if problem.recompute:
            for new in moves(cand.bsizes[s], mx):
                out.append(Candidate(cand.fsizes, cand.bsizes[:s] + [new] + cand.bsizes[s + 1 :], cand.order, warmup=wu))
    if free_warmup and cand.order == "1f1b":
        now = cand.warmups
        for s in range(S):
            n = len(cand.fsizes[s])
            # a warm-up of n or more means "all forwards first", kept as the minibatch so that it
            # survives later splits of the partition
            for w in (min(now[s], n) - 1, min(now[s], n) + 1):
                if 0 <= w <= n and w != min(now[s], n):
                    w = problem.minibatch if w == n else w
                    out.append(Candidate(cand.fsizes, cand.bsizes, "1f1b", warmup=now[:s] + [w] + now[s + 1 :]))
    return out


def score_batch(problem: Problem, cands: list[Candidate]) -> tuple[np.ndarray, np.ndarray]:
    """(iteration ms, sum of stage finish times) per candidate; ``inf`` over the memory limit."""
    limit = problem.memory_limit
    if cands and all(c.order == "gpipe" for c in cands):
        sc = evaluate_gpipe(problem.tables, pack([c.fsizes for c in cands]), pack([c.bsizes for c in cands]))
        it = sc.iteration_ms
        if limit is not None:
            it = np.where(sc.peak_memory_bytes.max(axis=1) <= limit, it, np.inf)
        return it, sc.finish_ms.sum(axis=1)
    if cands and all(c.order == "1f1b" for c in cands):
        wu = np.array([c.warmups for c in cands])
        sc = evaluate_1f1b(problem.tables, pack([c.fsizes for c in cands]), wu, pack([c.bsizes for c in cands]))
        it = sc.iteration_ms
        if limit is not None:
            it = np.where(sc.peak_memory_bytes.max(axis=1) <= limit, it, np.inf)
        return it, sc.finish_ms.sum(axis=1)
    it = np.empty(len(cands))
    tie = np.empty(len(cands))
    for i, c in enumerate(cands):
        ops = c.ops()
        if limit is not None and any(stage_peak_memory(problem.tables, s, o) > limit for s, o in enumerate(ops)):
            it[i] = tie[i] = np.inf
            continue
        tl = simulate(problem.tables, ops, problem.minibatch, record=False)
        it[i], tie[i] = tl.iteration_ms, sum(tl.finish_ms)
    return it, tie


def hill_climb(
    problem: Problem, cand: Candidate, deadline: float, max_steps: int = 10_000, free_warmup: bool = False
) -> tuple[Candidate, int]:
    """Climb from ``cand``; returns the best candidate found and how many schedules were scored."""
    (it,), (tie,) = score_batch(problem, [cand])
    scored = 1
    for _ in range(max_steps):
        if time.perf_counter() > deadline:
            break
        nbrs = _neighbours(problem, cand, free_warmup)
        if not nbrs:
            break
        its, ties = score_batch(problem, nbrs)
        scored += len(nbrs)
        k = int(np.lexsort((ties, its))[0])
        if not (its[k] < it - 1e-9 or (its[k] <= it + 1e-12 and ties[k] < tie - 1e-9)):
            break
        cand, it, tie = nbrs[k], float(its[k]), float(ties[k])
    cand.iteration_ms = it
    return cand, scored
