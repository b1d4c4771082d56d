"""The best equal schedule: the better of the best equal GPipe and the best equal 1F1B (or one of them)."""

from __future__ import annotations

import time
from typing import Optional

from ...errors import UmoptError
from ..baselines import gpipe_equal, onef1b_equal
from ..problem import Problem, Progress, SolverResult

__all__ = ["solve_equal"]


def solve_equal(
    problem: Problem,
    *,
    time_limit: float = 0.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    order: str = "auto",
    **_,
) -> SolverResult:
    t0 = time.perf_counter()
    makers = {"gpipe": [gpipe_equal], "1f1b": [onef1b_equal]}.get(order, [gpipe_equal, onef1b_equal])
    options = [b for b in (make(problem) for make in makers) if b.candidate is not None]
    if not options:
        raise UmoptError("no equal partition fits the memory limit")
    best = min(options, key=lambda b: b.iteration_ms)
    return SolverResult(
        "equal", best.candidate, "feasible", seconds=time.perf_counter() - t0, evaluated=len(options)
    )
