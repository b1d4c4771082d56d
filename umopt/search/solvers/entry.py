"""The frame every solver's entry shares, written once: :func:`entry` makes a solver's function
take the keywords every solver is called with (``time_limit``, ``seed``, ``progress``, ``order``,
and those only some take: ``hint``, ``seeds`` ...), passing on those it names, and sets its
result's ``seconds`` to the whole call's. A solver's own clock (its deadlines) stays its own."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Callable

from ..problem import Problem, SolverResult

__all__ = ["entry"]


def entry(solve: Callable[..., SolverResult]) -> Callable[..., SolverResult]:
    """``solve(problem, **named)`` as a solver's entry (see the module docstring)."""
    named = set(inspect.signature(solve).parameters)

    @functools.wraps(solve)
    def call(problem: Problem, **options) -> SolverResult:
        t0 = time.perf_counter()
        result = solve(problem, **{k: v for k, v in options.items() if k in named})
        result.seconds = time.perf_counter() - t0
        return result

    return call
