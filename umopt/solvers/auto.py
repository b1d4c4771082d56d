"""The default solver: the fast ones first, then the GA seeded with their best, within the time limit.

The result is the best schedule any of them found, scored by the reference simulator, so it is
never worse than the best equal schedule.
"""

from __future__ import annotations

import time
from typing import Optional

from ..problem import Problem, Progress, SolverResult
from .dp import solve_dp
from .equal import solve_equal
from .ga import solve_ga
from .greedy import solve_greedy

__all__ = ["solve_auto"]


def solve_auto(
    problem: Problem, *, time_limit: float = 20.0, seed: int = 0, progress: Optional[Progress] = None, order: str = "auto", **_
) -> SolverResult:
    t0 = time.perf_counter()
    fast = [solve_equal(problem, order=order), solve_dp(problem, order=order), solve_greedy(problem, time_limit=0.05 * time_limit, order=order)]
    for r in fast:
        tl = r.candidate.simulate(problem)
        r.candidate.iteration_ms = tl.iteration_ms if r.candidate.fits(tl, problem) else float("inf")
    left = max(0.1, time_limit - (time.perf_counter() - t0))
    ga = solve_ga(problem, time_limit=left, seed=seed, progress=progress, seeds=[r.candidate for r in fast], order=order)
    ga.candidate.iteration_ms = ga.candidate.simulate(problem).iteration_ms
    results = fast + [ga]
    best = min(results, key=lambda r: r.candidate.iteration_ms)
    return SolverResult(
        "auto",
        best.candidate,
        best.status,
        seconds=time.perf_counter() - t0,
        evaluated=sum(r.evaluated for r in results),
        extra={"winner": best.name, "tried": {r.name: r.candidate.iteration_ms for r in results}},
    )
