"""The best equal schedule: the best of every family's best equal one (or the one ``--order`` names)."""

from __future__ import annotations

import time
from typing import Optional

from ...errors import UmoptError
from ...schedules.family import ScheduleFamily, ruled
from ..baselines import best_equal
from ..problem import Problem, Progress, SolverResult

__all__ = ["solve_equal"]


def solve_equal(
    problem: Problem,
    *,
    time_limit: float = 0.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    order: Optional[ScheduleFamily] = None,
    **_,
) -> SolverResult:
    t0 = time.perf_counter()
    families = ruled() if order is None else [order]
    options = [b for b in (best_equal(problem, f) for f in families) if b.candidate is not None]
    if not options:
        raise UmoptError("no equal partition fits the memory limit")
    best = min(options, key=lambda b: b.iteration_ms)
    return SolverResult(
        "equal", best.candidate, "feasible", seconds=time.perf_counter() - t0, evaluated=len(options)
    )
