"""The chunks the exact models choose from: every ``[lo, hi)`` of at most the largest size that
keeps its stage under the memory limit wherever it runs in GPipe order."""

from __future__ import annotations

from typing import Sequence

from ..problem import Problem

__all__ = ["candidate_chunks", "chunk_fits", "chunk_set"]


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
