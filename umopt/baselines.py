"""What every report compares against: the best equal schedules.

``gpipe_equal``: M chunks of equal size (differing by at most one) on every stage, all F then all
B, the best M. ``onef1b_equal``: the same chunks in 1F1B (PipeDream-flush) order, M >= S.
M values whose peak memory breaks the limit are skipped. (The lower bounds are :mod:`umopt.bounds`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .partition import equal_sizes
from .problem import Candidate, Problem, pack, score_1f1b, score_gpipe

__all__ = ["Baseline", "feasible_m", "gpipe_equal", "onef1b_equal"]


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
