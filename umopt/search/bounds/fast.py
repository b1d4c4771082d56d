"""The fast bound: the best of the bounds that take seconds at most, for every schedule of a scope.

The spec's bound (each stage's least work with the cheapest fill and drain: docs/formats.md) is
the floor; the stage cuts and, without recompute, the untied bound lift it; on small instances the
pair program joins, being quick there. Within the 1F1B family the sample-order bound counts too.
"""

from __future__ import annotations

import functools

import numpy as np

from ..problem import Problem
from .heads import int_tables
from .in_order import sample_order_bound
from .pair_program import pair_program_bound
from .scope import Scope
from .stage_cuts import stage_bound
from .untied import untied_bound

__all__ = ["FAST_PROGRAM_CELLS", "spec_bound", "min_work", "fast_bound_ms", "fast_bound_us", "fast_job"]

# up to this B x max size the pair program takes under a second and joins the fast bound
FAST_PROGRAM_CELLS = 64


def min_work(cost: np.ndarray, total: int) -> float:
    """Least sum of ``cost[b_i]`` over chunk sizes ``b_i >= 1`` summing to ``total`` (unbounded knapsack).

    ``cost[b]`` is given for ``b = 0..max``; ``cost[0]`` is ignored.
    """
    mx = min(len(cost) - 1, total)
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    if mx < total:
        # a pass per chunk size b, all totals at once: along each residue class mod b, using b
        # once more adds cost[b], a running minimum of best[n] - k cost[b] (k = n // b)
        for b in range(1, mx + 1):
            rows = total // b + 1
            grid = np.full(rows * b, np.inf)
            grid[: total + 1] = best
            steps = np.arange(rows)[:, None] * cost[b]
            via = (np.minimum.accumulate(grid.reshape(rows, b) - steps, axis=0) + steps).reshape(-1)[
                : total + 1
            ]
            best = np.minimum(best, via)
        return float(best[total])
    sizes = np.arange(1, mx + 1)
    for n in range(1, total + 1):
        b = sizes[sizes <= n]
        best[n] = np.min(best[n - b] + cost[b])
    return float(best[total])


def spec_bound(problem: Problem) -> float:
    """For each stage: fastest fill + least F work + least B work + fastest drain; the max, plus optimizer.

    Fill and drain take, per stage and link on the way, the cheapest op or message of any size
    (at least one sample must pass each), which keeps the bound valid for any partitions. With
    data-parallel replicas, a stage's all-reduce follows its own last op: the drain to each stage
    ``j`` below, then ``j``'s all-reduce, and the stage's own all-reduce, whichever is longest.
    """
    t = problem.tables
    B, S, mx = problem.minibatch, problem.num_stages, problem.max_size
    cheapest_f = t.fwd[:, 1 : mx + 1].min(axis=1)
    cheapest_b = t.bwd[:, 1 : mx + 1].min(axis=1)
    cheapest_link = t.link[:, 1 : mx + 1].min(axis=1) if S > 1 else np.zeros(0)
    ar = t.allreduce_ms
    best = 0.0
    for s in range(S):
        fill = float(cheapest_f[:s].sum() + cheapest_link[:s].sum())
        # after this stage's last op: the drain down to stage j, then j's all-reduce (j = s: its own)
        tail = max(float(cheapest_b[j:s].sum() + cheapest_link[j:s].sum() + ar[j]) for j in range(s + 1))
        work = min_work(t.fwd[s, : mx + 1], B) + min_work(t.bwd[s, : mx + 1], B)
        best = max(best, fill + work + tail)
    return best + t.optimizer_ms


def fast_bound_ms(problem: Problem, scope: Scope = Scope.ANY) -> float:
    """The best fast bound in ms (with the optimizer step) on every schedule of ``scope``
    (:attr:`Scope.ANY` or :attr:`Scope.IN_ORDER`)."""
    return max(spec_bound(problem), fast_bound_us(problem, scope) / 1000 + problem.tables.optimizer_ms)


def fast_bound_us(problem: Problem, scope: Scope = Scope.ANY) -> int:
    """:func:`fast_bound_ms` without the spec's bound, in the units of :func:`.heads.int_tables`
    (no optimizer step). Remembered per tables: a solve asks more than once, and at S=8, B=256 it
    takes seconds."""
    scope = Scope(scope)
    if scope not in (Scope.ANY, Scope.IN_ORDER):
        raise ValueError(f"no fast bound for {scope.value!r} schedules")
    F, G, L = int_tables(problem)
    return _fast_bound_us_cached(
        F.tobytes(), G.tobytes(), L.tobytes(), F.shape, problem.minibatch, problem.recompute, scope
    )


@functools.lru_cache(maxsize=16)
def _fast_bound_us_cached(
    Fb: bytes, Gb: bytes, Lb: bytes, shape: tuple, minibatch: int, recompute: bool, scope: Scope
) -> int:
    F, G = (np.frombuffer(x, dtype=np.int64).reshape(shape) for x in (Fb, Gb))
    L = (
        np.frombuffer(Lb, dtype=np.int64).reshape(shape[0] - 1, shape[1])
        if shape[0] > 1
        else np.zeros((0, shape[1]), dtype=np.int64)
    )
    if scope == Scope.IN_ORDER:  # every schedule's bound holds for that family too: computed once
        own = _fast_bound_us_cached(Fb, Gb, Lb, shape, minibatch, recompute, Scope.ANY)
        return own if recompute else max(own, sample_order_bound(F, G, L, minibatch))
    own = stage_bound(F, G, L, minibatch, recompute)
    if not recompute:
        own = untied_bound(F, G, L, minibatch, own)
        if minibatch * (shape[1] - 1) <= FAST_PROGRAM_CELLS:
            own = pair_program_bound(F, G, L, minibatch, own)
    return own


def fast_job(problem: Problem, emit, upper, *, family: bool) -> None:
    """:class:`.background.BackgroundBounds`'s job: the fast bound of every schedule, and (``family``) of the
    1F1B family's."""
    emit(Scope.ANY.value, fast_bound_ms(problem, Scope.ANY))
    if family:
        emit(Scope.IN_ORDER.value, fast_bound_ms(problem, Scope.IN_ORDER))
