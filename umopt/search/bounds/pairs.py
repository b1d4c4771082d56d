"""The pair bounds as a solve runs them: the pair program, then the CP-SAT pair models, in a time.

For every schedule (:attr:`Scope.ANY`) the pair program gets most of the time first, in a
process of its own (:mod:`.background`), then the untied and free-order pair models start from what
it proved; within the 1F1B family (:attr:`Scope.IN_ORDER`) the in-order
pair models alone. Every value is a lower bound in ms with the optimizer step, never below the
fast bound of the same scope.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from ...schedules.family import GPIPE, ScheduleFamily
from ..problem import Problem
from .background import BackgroundBounds
from .fast import FAST_PROGRAM_CELLS, fast_bound_ms, fast_bound_us, spec_bound
from .heads import int_tables
from .pair_models import PAIR_MAX_CELLS, pair_bound
from .pair_program import pair_program_bound
from .scope import Scope

__all__ = [
    "PAIR_SHARE",
    "PROGRAM_SHARE",
    "pair_bound_runs",
    "pair_bound_ms",
    "program_within",
    "start_bound_ms",
    "program_job",
    "pairs_job",
]

# of an exact solver's time limit, what its starting bound gets (cpsat and milp start from it)
PAIR_SHARE = 0.25
# of the any-order pair bound's time, the pair program's (CP-SAT's untied pair models get the
# rest, and what the program leaves where it settles early)
PROGRAM_SHARE = 0.9


def pair_bound_runs(problem: Problem, max_cells: Optional[int] = PAIR_MAX_CELLS) -> bool:
    """Does :func:`pair_bound_ms` search here (more than one stage, no recompute, small enough)?"""
    small = max_cells is None or problem.minibatch * problem.max_size <= max_cells
    return problem.num_stages > 1 and not problem.recompute and small


def pair_bound_ms(
    problem: Problem,
    time_limit: float,
    upper_ms: "float | Callable[[], Optional[float]] | None" = None,
    seed: int = 0,
    report: Optional[Callable[[float], None]] = None,
    max_cells: Optional[int] = PAIR_MAX_CELLS,
    scope: Scope = Scope.ANY,
    workers: Optional[int] = None,
) -> float:
    """:func:`.pair_models.pair_bound` in ms with the optimizer step, never below
    :func:`.fast.fast_bound_ms` of the same ``scope`` (in any order the programs first); that
    bound alone with recompute or past ``max_cells``. ``upper_ms``: a known schedule's iteration,
    or a function giving the best known so far; ``report(bound_ms)`` as bounds are proven."""
    t0 = time.perf_counter()
    scope = Scope(scope)
    if not pair_bound_runs(problem, max_cells):
        return fast_bound_ms(problem, scope)
    opt = problem.tables.optimizer_ms
    known = fast_bound_us(problem, scope)
    fast = max(spec_bound(problem), known / 1000 + opt)  # fast_bound_ms, without computing it again

    def in_units(ms: Optional[float]) -> Optional[int]:
        return None if ms is None else int(np.floor((ms - opt) * 1000 + 1e-9))

    upper = (lambda: in_units(upper_ms())) if callable(upper_ms) else in_units(upper_ms)  # noqa: E731
    tick = None if report is None else lambda us: report(max(fast, us / 1000 + opt))  # noqa: E731
    tables = int_tables(problem)
    if scope == Scope.ANY:
        known = max(known, program_within(problem, known, PROGRAM_SHARE * time_limit, tick))
        fast = max(fast, known / 1000 + opt)
        if report:
            report(fast)
    left = time_limit - (time.perf_counter() - t0)
    own = pair_bound(
        *tables,
        problem.minibatch,
        left,
        upper,
        seed,
        tick,
        max_cells,
        scope == Scope.IN_ORDER,
        known,
        workers,
    )
    return max(fast, own / 1000 + opt)


def program_within(
    problem: Problem, known: int, seconds: float, report: Optional[Callable[[int], None]] = None
) -> int:
    """The pair program from ``known``: the best it proves within ``seconds``, never below
    ``known`` (units of :func:`.heads.int_tables`); ``report(bound)`` as it proves them. Small
    instances have it in the fast bound already; larger ones run it beside, stopped at the time
    limit wherever it is."""
    if problem.minibatch * problem.max_size <= FAST_PROGRAM_CELLS:
        return known
    on_bound = None if report is None else lambda _scope, value: report(int(value))  # noqa: E731
    with BackgroundBounds(program_job, problem, on_bound, known=known, seconds=seconds) as job:
        proven = job.wait(timeout=seconds + BESIDE_GRACE_S)
    return max([known] + [int(v) for v in proven.values()])


# how long past its time a bound beside is waited for before it is stopped (it checks the clock
# between questions, not inside one)
BESIDE_GRACE_S = 0.5


def start_bound_ms(
    problem: Problem, order: Optional[ScheduleFamily], seconds: float, upper_ms: float, seed: int = 0
) -> float:
    """The bound an exact model starts from: for the free-order one (``order`` None) the pair
    bound in ``PAIR_SHARE`` of its ``seconds`` where that runs; otherwise the fast bound."""
    if order is GPIPE:
        return fast_bound_ms(problem)
    return pair_bound_ms(problem, PAIR_SHARE * max(0.0, seconds), upper_ms, seed)


def program_job(problem: Problem, emit, upper, *, known: int, seconds: float) -> None:
    """:class:`.background.BackgroundBounds`'s job for :func:`program_within`: the pair program from ``known``
    for ``seconds``, each bound as proven, in the units of :func:`.heads.int_tables`."""
    F, G, L = int_tables(problem)
    emit(
        Scope.ANY.value,
        pair_program_bound(F, G, L, problem.minibatch, known, seconds, lambda b: emit(Scope.ANY.value, b)),
    )


def pairs_job(
    problem: Problem,
    emit,
    upper,
    *,
    any_seconds: float,
    family_seconds: float,
    seed: int,
    max_cells: int,
    workers: int,
) -> None:
    """:class:`.background.BackgroundBounds`'s job for a search that runs the pair bounds beside it (``auto``):
    of every schedule for ``any_seconds``, then of the 1F1B family's for ``family_seconds``; in
    ms, as proven."""
    found = 0.0
    if any_seconds > 0:
        found = pair_bound_ms(
            problem,
            any_seconds,
            upper,
            seed,
            lambda ms: emit(Scope.ANY.value, ms),
            max_cells,
            Scope.ANY,
            workers,
        )
        emit(Scope.ANY.value, found)
    if family_seconds > 0:
        family = pair_bound_ms(
            problem,
            family_seconds,
            upper,
            seed,
            lambda ms: emit(Scope.IN_ORDER.value, ms),
            max_cells,
            Scope.IN_ORDER,
            workers,
        )
        emit(Scope.IN_ORDER.value, max(family, found))  # a bound on every schedule bounds the family's too
