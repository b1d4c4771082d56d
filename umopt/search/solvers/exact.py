"""What the exact models (cpsat, milp) share: the chunks they choose from (every ``[lo, hi)`` of at
most the largest size), the GPipe-order memory check of a chunk, their size, their warm start,
and their progress bar."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from ...errors import UmoptError
from ...schedules.family import GPIPE, ScheduleFamily
from ..baselines import gpipe_equal
from ..problem import Candidate, Problem, Progress, SolverResult, ticking

__all__ = [
    "MAX_MODEL_TERMS",
    "candidate_chunks",
    "chunk_fits",
    "chunk_set",
    "chunks_ending_at",
    "model_terms",
    "model_too_large",
    "start_or_skip",
    "warm_start",
    "with_clock",
]


def with_clock(
    progress: Optional[Progress], time_limit: float, solve: Callable[[list], SolverResult]
) -> SolverResult:
    """``solve(found)``, with the bar moving by the clock meanwhile (the solver keeps ``found[0]``,
    the best iteration ms so far, up to date) and ending at the schedule it returns."""
    found = [float("inf")]
    with ticking(progress, time.perf_counter(), time_limit, lambda: found[0]):
        result = solve(found)
    if progress:
        progress(1.0, result.candidate.iteration_ms)
    return result


def candidate_chunks(problem: Problem) -> list[tuple[int, int]]:
    B, mx = problem.minibatch, problem.max_size
    return [(lo, hi) for lo in range(B) for hi in range(lo + 1, min(B, lo + mx) + 1)]


def chunk_fits(problem: Problem, s: int, lo: int, hi: int) -> bool:
    """GPipe peak while this chunk runs: samples [0, hi) are held (see vectorized._gpipe_peak)."""
    t, limit = problem.tables, problem.memory_limit
    if limit is None:
        return True
    if problem.recompute:
        return t.static_bytes[s] + hi * t.input_bytes[s] + (hi - lo) * t.stash_bytes[s] <= limit
    return t.static_bytes[s] + problem.minibatch * t.stash_bytes[s] <= limit


def chunks_ending_at(chunks, minibatch: int) -> list[list]:
    """``out[i]``: the chunks whose last sample is i, so that the work of chunks ending after i
    chains as ``later[i] = later[i + 1] + sum over out[i]`` (linear size, not quadratic)."""
    out = [[] for _ in range(minibatch)]
    for c in chunks:
        out[c[1] - 1].append(c)
    return out


def chunk_set(sizes: Sequence[int]) -> set[tuple[int, int]]:
    out, lo = set(), 0
    for b in sizes:
        out.add((lo, lo + int(b)))
        lo += int(b)
    return out


STALL_SHARE = 0.05  # a warm start ends after this share of the limit without a better schedule

# past this many terms, building an exact model in Python takes longer than a typical time limit
MAX_MODEL_TERMS = 600_000


def model_terms(problem: Problem) -> int:
    """The size of an exact model: stages x minibatch x chunks holding a sample (every sample's
    cut and every B chunk's readiness sum over the chunks holding it)."""
    S, B, mx = problem.num_stages, problem.minibatch, problem.max_size
    return S * B * mx * (mx + 1) // 2


def model_too_large(problem: Problem) -> Optional[str]:
    """Why the exact models would not even be built in reasonable time, or None."""
    terms = model_terms(problem)
    if terms > MAX_MODEL_TERMS:
        return f"the exact model would have ~{terms:,} terms (stages x minibatch x max size^2 / 2 > {MAX_MODEL_TERMS:,}); kept the GA's schedule"
    return None


def models_exactly(order: Optional[ScheduleFamily]) -> bool:
    """Do the exact models search the schedules of ``--order``: every order's (None, the free-order
    model) or GPipe order's (its own model)? Other families' rules they do not model."""
    return order is None or order is GPIPE


def warm_start(
    problem: Problem,
    name: str,
    time_limit: float,
    seed: int,
    hint: Optional[Candidate],
    order: Optional[ScheduleFamily],
    share: float = 0.3,
) -> tuple[Candidate, float, int]:
    """(start, time left, schedules scored): the caller's hint, else the GA's best schedule found in
    ``share`` of the time. With ``order`` GPIPE the start is a GPipe-order schedule; with None (the
    free-order model) any order will do."""
    from .ga import (
        solve_ga,  # the GA is itself a solver; imported here to keep this module light
    )

    if not models_exactly(order):
        raise UmoptError(
            f"{name} does not model the {order.name} rule; use --order auto (its free order includes every family) or gpipe"
        )
    scored = 0
    if hint is None:
        # the GA stops once it has found nothing better for a while: on an instance small enough
        # for the model to prove, it converges in a fraction of its share, and the proof is the
        # point (a 3-stage B=4 instance went unproven with the whole share spent scoring 1.16
        # million schedules)
        best = [float("inf"), time.perf_counter()]

        def stalled(ms: float) -> bool:
            now = time.perf_counter()
            if ms < best[0] - 1e-9:
                best[:] = [ms, now]
            return now - best[1] > STALL_SHARE * time_limit

        started = time.perf_counter()
        warm = solve_ga(problem, time_limit=share * time_limit, seed=seed, order=order, stop=stalled)
        hint, scored = warm.candidate, warm.evaluated
        time_limit -= time.perf_counter() - started
    base = hint if order is not GPIPE or hint.family is GPIPE else gpipe_equal(problem).candidate
    if base is None or not base.fits(base.simulate(problem), problem):
        raise UmoptError(f"{name}: no schedule to start from fits the memory limit (try --recompute)")
    return base, time_limit, scored


def start_or_skip(
    problem: Problem,
    name: str,
    time_limit: float,
    seed: int,
    hint: Optional[Candidate],
    order: Optional[ScheduleFamily],
    t0: float,
) -> tuple[Candidate, float, int, Optional[SolverResult]]:
    """The exact solvers' common start: (warm start, time left, schedules scored, result), where
    ``result`` is set when the model is too large to build: then the GA had the whole time and
    its schedule is the answer, with the fast any-order bound."""
    from ..bounds import Scope, fast_bound_ms

    too_large = model_too_large(problem)
    base, left, scored = warm_start(
        problem, name, time_limit, seed, hint, order, share=1.0 if too_large else 0.3
    )
    base.iteration_ms = base.simulate(problem).iteration_ms
    if not too_large:
        return base, left, scored, None
    result = SolverResult(
        name,
        base,
        "feasible",
        lower_bound_ms=min(fast_bound_ms(problem), base.iteration_ms),
        seconds=time.perf_counter() - t0,
        evaluated=scored,
        bound_scope=Scope.ANY.value,
        notes=[too_large],
    )
    return base, left, scored, result
