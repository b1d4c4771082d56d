"""The default solver: the best equal, DP and ramp schedules first, then the GA, within the time limit.

The ramp (one shared partition, small chunks first and last) is where the GA starts on deep
pipelines: there it cannot line up such chunk ends on every stage by itself.

On instances small enough for the exact model to prove (about S=4, B=8), half the time goes to
CP-SAT, warm-started with the best schedule found: the free-order model under ``--order auto``
(its bound holds for every schedule), the GPipe-order one under ``--order gpipe``; its proof and
bound are then the report's. On larger ones the GA has all the time, and up to S=4, B=32 the pair
bounds run beside it on the other cores (:class:`umopt.search.bounds.BackgroundBounds`): first those of every
schedule (the report's bound; status "optimal" where the schedule meets it), then those of the
1F1B family (B ops in sample order, the GA's schedules), reported where the schedule found is of
that family (``lower_bound_1f1b_ms``; under ``--order 1f1b`` only they run, and they are the
bound). When the bound meets the GA's best schedule, both stop there: it is optimal. The result
is the best schedule any of them found, scored by the reference simulator, so it is never worse
than the best equal schedule.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ...errors import UmoptError
from ...schedules.family import ScheduleFamily
from ...schedules.partition import backwards_in_sample_order
from ..bounds import IN_ORDER_MAX_CELLS, BackgroundBounds, Scope, pair_bound_runs, pairs_job
from ..problem import Problem, Progress, SolverResult
from .cpsat import solve_cpsat
from .dp import solve_dp
from .entry import entry
from .equal import solve_equal
from .exact import model_terms, models_exactly
from .ga import solve_ga
from .ramp import solve_ramp

__all__ = ["solve_auto"]


@dataclass
class _PairBounds:
    """What the pair bounds beside the GA have proven so far, and the GA's best so far."""

    searched_ms: float = 0.0  # on the schedules the GA searches (its stop: within a hair, optimal)
    found_ms: float = float("inf")  # the GA's best, offered to the pair models as their horizon
    any_ms: Optional[float] = None  # proven on every schedule, when the pairs ended
    in_order_ms: Optional[float] = None  # proven on the 1F1B family, when the pairs ended


@entry
def solve_auto(
    problem: Problem,
    *,
    time_limit: float = 20.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    t0 = time.perf_counter()
    fast = _fast_starts(problem, order, t0, time_limit)
    # the GA starts from the best equal schedules itself; another start only joins it when it
    # beats them, so that otherwise the GA runs exactly as `--solver ga` with the same seed would
    # (a start that adds nothing still changes the random path, by several percent at S=8)
    best_equal = fast[0].candidate.iteration_ms if fast and fast[0].name == "equal" else float("inf")
    seeds = [r.candidate for r in fast if r.candidate.iteration_ms < best_equal - 1e-9]
    exact = models_exactly(order) and model_terms(problem) <= EXACT_MAX_TERMS
    # where CP-SAT cannot prove the optimum (S=4, B=12 to 32), the pair bounds run beside the GA,
    # on the cores it does not use (it searches on one; CP-SAT releases the GIL), so the GA keeps
    # its whole time: under --order auto first the untied pairs (a bound on every schedule, for
    # the report), then those of the in-order schedules (B ops in sample order: a bound on the
    # 1F1B family's, where the schedule found is one); under --order 1f1b (a family of in-order
    # schedules) only the latter
    beside_runs = (
        not exact
        and (order is None or order.backwards_in_sample_order)
        and pair_bound_runs(problem, IN_ORDER_MAX_CELLS)
    )
    left = max(0.1, time_limit - (time.perf_counter() - t0))
    ga_time = left * (1 - (EXACT_SHARE if exact else 0))
    ga, pairs = _ga_with_pairs(
        problem, fast, seeds, ga_time, beside_runs, order, seed, progress, t0, time_limit
    )
    results = fast + [ga]
    status, bound, scope, bound_1f1b = "feasible", None, None, None
    close = 2 * problem.num_stages * problem.minibatch / 1000  # within one floored microsecond per op
    if exact:
        cp = _exact_pass(problem, results, order, left, t0, time_limit, seed, progress)
        results.append(cp)
        # the model searched every schedule auto may return (any order, or GPipe order under
        # --order gpipe), so its proof and bound are auto's
        status, bound = cp.status, cp.lower_bound_ms
        scope = cp.bound_scope
    best = min(results, key=lambda r: r.candidate.iteration_ms)
    found = best.candidate.iteration_ms
    in_order = order is not None and order.backwards_in_sample_order  # all auto searched is in order
    if pairs.in_order_ms is not None and (in_order or backwards_in_sample_order(best.candidate.ops())):
        in_order_bound = min(pairs.in_order_ms, found)
        bound_1f1b = in_order_bound
        if in_order:
            bound, scope = in_order_bound, Scope.IN_ORDER.value
            status = "optimal" if found <= in_order_bound + close else status
    if pairs.any_ms is not None:
        bound, scope = min(pairs.any_ms, found), Scope.ANY.value
        if found <= bound + close:
            status = "optimal"
    return SolverResult(
        "auto",
        best.candidate,
        status,
        lower_bound_ms=bound,
        evaluated=sum(r.evaluated for r in results),
        bound_scope=scope,
        lower_bound_1f1b_ms=bound_1f1b,
        winner=best.name,
        tried={r.name: r.candidate.iteration_ms for r in results},
        alternatives=[
            r.candidate for r in results if r is not best and r.candidate.iteration_ms < float("inf")
        ],
    )


def _fast_starts(
    problem: Problem, order: Optional[ScheduleFamily], t0: float, time_limit: float
) -> list[SolverResult]:
    """The fast solvers' schedules (equal, DP, ramp), each re-scored by the simulator (inf where
    over the memory limit), within a share of the time limit."""
    fast = []
    # the paper's greedy baseline is left out: it is never near the GA's schedules and costs
    # seconds on large instances (S=8, B=256)
    for solver in (solve_equal, solve_dp, solve_ramp):
        # on the largest instances these take seconds each: the GA's time is not theirs to take
        if solver is not solve_equal and time.perf_counter() - t0 > FAST_SHARE * time_limit:
            break
        try:
            fast.append(solver(problem, order=order))
        except UmoptError:  # e.g. no GPipe schedule fits the memory limit; the others may
            pass
    for r in fast:
        tl = r.candidate.simulate(problem)
        r.candidate.iteration_ms = tl.iteration_ms if r.candidate.fits(tl, problem) else float("inf")
    return fast


def _ga_with_pairs(
    problem: Problem,
    fast: list[SolverResult],
    seeds: list,
    ga_time: float,
    beside_runs: bool,
    order: Optional[ScheduleFamily],
    seed: int,
    progress: Optional[Progress],
    t0: float,
    time_limit: float,
) -> tuple[SolverResult, _PairBounds]:
    """The GA, with the pair bounds beside it where they run: what they proved, and the GA's
    schedule (stopped early once its best meets their bound)."""
    # the bound on the schedules the GA searches, as the pairs beside it prove it: once the GA's
    # best meets it, the schedule is optimal and both stop. The bounds are on floored
    # microseconds: within one per op of one is optimal.
    proven = threading.Event()
    close = 2 * problem.num_stages * problem.minibatch / 1000
    pairs = _PairBounds()
    beside: Optional[BackgroundBounds] = None

    def stop(best_ms: float) -> bool:
        if best_ms < pairs.found_ms:
            pairs.found_ms = best_ms
            if beside is not None:
                beside.offer(best_ms)  # a tighter horizon for the pair models
        if best_ms <= pairs.searched_ms + close:
            proven.set()
        return proven.is_set()

    def on_bound(scope: str, ms: float) -> None:
        # the GA searches every order under --order auto (bounded by the any-order pairs), only
        # an in-order family under --order 1f1b (bounded by the in-order pairs)
        if scope == Scope.ANY.value or order is not None:
            pairs.searched_ms = max(pairs.searched_ms, ms)

    if beside_runs:
        any_time = ANY_ORDER_SHARE * ga_time if order is None else 0.0
        beside = BackgroundBounds(
            pairs_job,
            problem,
            on_bound,
            any_seconds=any_time,
            family_seconds=ga_time - any_time,
            seed=seed,
            max_cells=IN_ORDER_MAX_CELLS,
            workers=max(1, (os.cpu_count() or 1) - 1),
        )
        # a horizon for its models: the best fast schedule within the memory limit, if any
        first = min(
            (r.candidate.iteration_ms for r in fast if r.candidate.iteration_ms < float("inf")), default=None
        )
        if first is not None:
            stop(first)
    try:
        ga = solve_ga(
            problem,
            time_limit=ga_time,
            seed=seed,
            progress=progress,
            seeds=seeds,
            order=order,
            stop=stop if beside_runs else None,
        )
        ga.candidate.iteration_ms = ga.candidate.simulate(problem).iteration_ms
        if beside is not None:
            stop(ga.candidate.iteration_ms)  # a bound proven after the GA's last look ends the pairs too
            proved = (
                beside.stop()
                if proven.is_set()
                else beside.wait(timeout=max(0.0, t0 + time_limit - time.perf_counter()))
            )
            if Scope.ANY.value in proved:
                pairs.any_ms = proved[Scope.ANY.value]
            if proved:  # a bound on every schedule bounds that family's too
                pairs.in_order_ms = max(proved.get(Scope.IN_ORDER.value, 0.0), pairs.any_ms or 0.0)
    finally:
        if beside is not None:
            beside.close()
    return ga, pairs


def _exact_pass(
    problem: Problem,
    results: list[SolverResult],
    order: Optional[ScheduleFamily],
    left: float,
    t0: float,
    time_limit: float,
    seed: int,
    progress: Optional[Progress],
) -> SolverResult:
    """The CP-SAT model, started from the best schedule found that it searches among, for its
    share of the time (at least; more if the GA's final polish ran over)."""
    scope = [r for r in results if order is None or r.candidate.family is order]
    start = min(scope, key=lambda r: r.candidate.iteration_ms)
    # its share even if the GA's final polish ran over
    cp_time = max(EXACT_SHARE * left, time_limit - (time.perf_counter() - t0))

    def share(_frac: float, best: float) -> None:  # the bar goes on from where the GA left it
        progress(min(1.0, (time.perf_counter() - t0) / time_limit), min(best, start.candidate.iteration_ms))

    cp = solve_cpsat(
        problem,
        time_limit=cp_time,
        seed=seed,
        hint=start.candidate,
        order=order,
        progress=share if progress else None,
    )
    return cp


# Where the free-order CP-SAT model gets half the time: up to the model size where it proves
# optimality within a minute on 2 cores; beyond, it proves nothing and the GA finds schedules as
# good, so there its half would be lost
EXACT_MAX_TERMS = 3_000
# the share of the time limit after which no more of the fast starts (DP, ramp) begins
FAST_SHARE = 0.25
EXACT_SHARE = 0.5
# Of the GA's time, what the pair bounds of every schedule get beside it under --order auto;
# the 1F1B family's pairs get the rest (they settle most of their lift early)
ANY_ORDER_SHARE = 2 / 3
