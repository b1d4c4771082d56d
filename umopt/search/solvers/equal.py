"""The best equal schedule: the best of every family's best equal one (or the one ``--order`` names)."""

from __future__ import annotations

from typing import Optional

from ...errors import UmoptError
from ...schedules.family import ScheduleFamily, ruled
from ..baselines import best_equal
from ..problem import Problem, SolverResult
from .entry import entry

__all__ = ["solve_equal"]


@entry
def solve_equal(
    problem: Problem,
    *,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    families = ruled() if order is None else [order]
    options = [b for b in (best_equal(problem, f) for f in families) if b.candidate is not None]
    if not options:
        raise UmoptError("no equal partition fits the memory limit")
    best = min(options, key=lambda b: b.iteration_ms)
    return SolverResult("equal", best.candidate, "feasible", evaluated=len(options))
