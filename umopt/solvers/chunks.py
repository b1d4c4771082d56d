"""What the exact models (cpsat, milp) share: the chunks they choose from (every ``[lo, hi)`` of at
most the largest size that keeps its stage under the memory limit wherever it runs in GPipe
order) and their warm start."""

from __future__ import annotations

from typing import Sequence
from typing import Optional

from ..baselines import gpipe_equal
from ..errors import UmoptError
from ..problem import Candidate, Problem

__all__ = ["candidate_chunks", "chunk_fits", "chunk_set", "warm_start"]


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


def chunk_set(sizes: Sequence[int]) -> set[tuple[int, int]]:
    out, lo = set(), 0
    for b in sizes:
        out.add((lo, lo + int(b)))
        lo += int(b)
    return out


def warm_start(
    problem: Problem, name: str, time_limit: float, seed: int, hint: Optional[Candidate], order: str
) -> tuple[Candidate, float, int]:
    """(GPipe-order start, time left, schedules scored): the caller's hint, else the GA's best
    GPipe-order schedule found in 30% of the time."""
    from .ga import solve_ga  # the GA is itself a solver; imported here to keep this module light

    if order == "1f1b":
        raise UmoptError(f"{name} models GPipe order only (use --order gpipe or auto, or another solver for 1F1B)")
    scored = 0
    if hint is None:
        share = 0.3 * time_limit
        warm = solve_ga(problem, time_limit=share, seed=seed, orders=("gpipe",), max_restarts=1)
        hint, scored = warm.candidate, warm.evaluated
        time_limit -= share
    base = hint if hint.order == "gpipe" else gpipe_equal(problem).candidate
    if base is None:
        raise UmoptError(f"{name}: no GPipe schedule fits the memory limit (try --recompute)")
    return base, time_limit, scored
