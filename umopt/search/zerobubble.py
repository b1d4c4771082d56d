"""Zero-bubble schedules: each stage's backward split into B (the input gradient, on the critical
path: its result goes to the stage before) and W (the weight gradient, local, free to fill a bubble).

Any F/B schedule, unequal and per-stage partitions included, becomes one with W ops in two
steps. :func:`with_weight_ops` defers each chunk's W while the stage holds at most ``cap``
samples in flight (forwarded, weight gradient not yet computed): ZB-H1 (Qi et al., ICLR 2024)
keeps 1F1B's peak (S microbatches), so its memory is 1F1B's; no cap defers every W to the end. Then
:func:`fill_bubbles` moves W ops, one at a time, into idle time of their stage that is long enough
to hold them, which by the cost model delays nothing, and merges neighbouring W ops where the
runtime's cost per op makes one W cheaper than two; :func:`climb` then moves single W ops
wherever the iteration gets shorter. :func:`zb_h1` and :func:`zb_h2` are the paper's ZB-H1 and ZB-H2 on equal
microbatches, the best M; :func:`best_with_weight_ops` the best W placement of one schedule
within the memory limit.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from ..costmodel import Op, OpKind, Timeline, simulate
from ..errors import UmoptError
from ..schedules import onef1b_schedule, with_weight_ops
from ..schedules.family import ScheduleFamily
from ..schedules.partition import equal_sizes
from .baselines import feasible_m
from .problem import Candidate, Problem
from .solvers.ga import solve_ga

__all__ = [
    "with_weight_ops",
    "fill_bubbles",
    "climb",
    "best_with_weight_ops",
    "search_with_weight_ops",
    "zb_h1",
    "zb_h2",
    "require_split",
]


def require_split(problem: Problem) -> None:
    if problem.tables.bwd_input is None:
        raise UmoptError(
            "W ops need the profile's backward_input_ms and backward_weight_ms: profile with --split-backward"
        )


def in_flight_peak(stage_ops: Sequence[Op]) -> int:
    """Most samples a stage holds for backward at once (forwarded, backward not yet run)."""
    held = peak = 0
    for kind, lo, hi in stage_ops:
        held += (hi - lo) * ((kind == OpKind.F) - (kind == OpKind.B))
        peak = max(peak, held)
    return peak


def _moves(tl: Timeline, stage_ops: list[Op], s: int, max_size: int, tables) -> list[tuple[int, list[Op]]]:
    """Candidate changes of one stage's list, best first: a W moved into an earlier gap that
    holds it, after its B; two neighbouring W ops of adjacent samples merged where cheaper."""
    spans = tl.spans[s]
    out = []
    b_at = {(op.lo, op.hi): i for i, op in enumerate(stage_ops) if op.kind == OpKind.B}
    for i, op in enumerate(stage_ops):
        if op.kind != OpKind.W:
            continue
        after = max(b_at[c] for c in b_at if op.lo <= c[0] and c[1] <= op.hi)
        dur = spans[i].end - spans[i].start
        for j in range(after + 1, i):  # insert before op j: the gap between j-1 and j
            if spans[j].start - spans[j - 1].end >= dur - 1e-12:
                out.append((0, stage_ops[:j] + [op] + stage_ops[j:i] + stage_ops[i + 1 :]))
                break
    for i in range(len(stage_ops) - 1):
        a, b = stage_ops[i], stage_ops[i + 1]
        if a.kind == b.kind == OpKind.W and (a.hi == b.lo or b.hi == a.lo) and a.size + b.size <= max_size:
            # one op's overhead less (each B chunk's weight gradient costs what it did)
            lo, hi = min(a.lo, b.lo), max(a.hi, b.hi)
            if tables.op_overhead[s] > 0:
                out.append((1, stage_ops[:i] + [Op(OpKind.W, lo, hi)] + stage_ops[i + 2 :]))
    return out


def fill_bubbles(
    problem: Problem, ops: Sequence[Sequence[Op]], deadline: float = float("inf")
) -> tuple[list[list[Op]], Timeline]:
    """Move W ops into idle time and merge them while the iteration does not grow (or the
    ``time.perf_counter()`` deadline passes); the new op lists and their timeline."""
    ops = [list(st) for st in ops]
    tl = simulate(problem.tables, ops, problem.minibatch)
    moved = True
    while moved and time.perf_counter() < deadline:
        moved = False
        for s in range(problem.num_stages):
            for _, trial in sorted(
                _moves(tl, ops[s], s, problem.max_size, problem.tables), key=lambda m: m[0]
            ):
                cand = ops[:s] + [trial] + ops[s + 1 :]
                ctl = simulate(problem.tables, cand, problem.minibatch)
                if (
                    ctl.iteration_ms <= tl.iteration_ms + 1e-9
                    and sum(ctl.finish_ms) < sum(tl.finish_ms) - 1e-9
                ):
                    ops, tl, moved = cand, ctl, True
                    break
    return ops, tl


def climb(
    problem: Problem, ops: Sequence[Sequence[Op]], tl: Timeline, deadline: float = float("inf")
) -> tuple[list[list[Op]], Timeline]:
    """Move single W ops to any other place after their B while that shortens the iteration
    within the memory limit (first improvement, stage by stage, until none does or the deadline
    passes): what filling gaps cannot find, as a W that delays one op to let another stage start
    sooner."""
    ops = [list(st) for st in ops]
    better = True
    while better and time.perf_counter() < deadline:
        better = False
        for s in range(problem.num_stages):
            st = ops[s]
            for i, op in enumerate(st):
                if op.kind != OpKind.W or time.perf_counter() > deadline:
                    continue
                rest = st[:i] + st[i + 1 :]
                after = max(
                    k for k, o in enumerate(rest) if o.kind == OpKind.B and op.lo <= o.lo and o.hi <= op.hi
                )
                for j in range(after + 1, len(rest) + 1):
                    if j == i:
                        continue
                    trial = ops[:s] + [rest[:j] + [op] + rest[j:]] + ops[s + 1 :]
                    ttl = simulate(problem.tables, trial, problem.minibatch)
                    if ttl.iteration_ms < tl.iteration_ms - 1e-9 and _fits(problem, ttl):
                        ops, tl, better = trial, ttl, True
                        break
                if better:
                    break
    return ops, tl


def _fits(problem: Problem, tl: Timeline) -> bool:
    limit = problem.tables.memory_limit
    return limit is None or max(tl.peak_memory_bytes) <= limit


def best_with_weight_ops(
    problem: Problem, ops: Sequence[Sequence[Op]], seconds: float = 2.0
) -> Optional[tuple[list[list[Op]], Timeline]]:
    """The best of ``ops`` with W ops deferred under the schedule's own in-flight peak (its
    memory) and with every W deferred (more memory), bubbles filled, then climbed; None if
    neither fits."""
    require_split(problem)
    deadline = time.perf_counter() + seconds
    best = None
    for caps in ([in_flight_peak(st) for st in ops], [None] * len(ops)):
        split = [with_weight_ops(st, cap) for st, cap in zip(ops, caps)]
        got = fill_bubbles(problem, split, deadline)
        if _fits(problem, got[1]) and (best is None or got[1].iteration_ms < best[1].iteration_ms - 1e-9):
            best = got
    # the rest of the time to climb from the better of the two
    return None if best is None else climb(problem, *best, deadline)


def zb_h1(
    problem: Problem, seconds: float = 2.0, tries: int = 4
) -> Optional[tuple[int, list[list[Op]], Timeline]]:
    """ZB-H1 on M equal microbatches: PipeDream-flush's F/B order, every stage deferring each W
    while it holds at most S microbatches (1F1B's peak, that of its first stage, as the paper
    keeps it: later stages start their W ops later), bubbles filled; the best M among the
    ``tries`` best of 1F1B without W ops. (M, op lists, timeline), or None if none fits."""
    S = problem.num_stages
    return _equal_zero_bubble(problem, seconds, tries, None, lambda s, mb: S * mb)


def zb_h2(
    problem: Problem, seconds: float = 2.0, tries: int = 4
) -> Optional[tuple[int, list[list[Op]], Timeline]]:
    """ZB-H2 on M equal microbatches: stage s runs 2 (S - s) - 1 forwards before its first
    backward (the paper's warm-up, which fills the bubble before it), then F and B in turn, every
    W deferred and moved into the idle time that is left (the tail's B W B W), so that the
    bubbles close at about twice 1F1B's memory (here: samples are held until their W).
    (M, op lists, timeline), or None if none fits the memory limit."""
    S = problem.num_stages
    return _equal_zero_bubble(
        problem, seconds, tries, [2 * (S - s) - 2 for s in range(S)], lambda s, mb: None
    )


def _equal_zero_bubble(
    problem: Problem, seconds: float, tries: int, warmup, cap
) -> Optional[tuple[int, list[list[Op]], Timeline]]:
    """The best M of a zero-bubble schedule on equal microbatches: 1F1B order with ``warmup``
    (None: PipeDream-flush's), W ops deferred under ``cap(stage, microbatch size)``, bubbles
    filled; M among the ``tries`` best of 1F1B without W ops."""
    require_split(problem)
    S, B = problem.num_stages, problem.minibatch
    plans = []
    for M in feasible_m(problem, lowest=S):
        sizes = equal_sizes(B, M)
        fb = onef1b_schedule([sizes] * S, [sizes] * S)
        plans.append((simulate(problem.tables, fb, B, record=False).iteration_ms, M, sizes))
    plans.sort(key=lambda p: p[0])
    deadline = time.perf_counter() + seconds
    best = None
    for _, M, sizes in plans[:tries]:
        fb = onef1b_schedule([sizes] * S, [sizes] * S, warmup)
        split = [with_weight_ops(st, cap(s, max(sizes))) for s, st in enumerate(fb)]
        ops, tl = fill_bubbles(problem, split, deadline)
        if _fits(problem, tl) and (best is None or tl.iteration_ms < best[2].iteration_ms - 1e-9):
            best = (M, ops, tl)
    return best


def search_with_weight_ops(
    problem: Problem,
    seeds: Sequence[Candidate],
    seconds: float,
    seed: int = 0,
    order: Optional[ScheduleFamily] = None,
) -> Optional[tuple[list[list[Op]], Timeline]]:
    """The GA with W caps in every individual (partitions, order, warm-ups and where the W ops
    go searched together), started from ``seeds``, then its best with gaps filled and single W
    ops climbed (moves the caps cannot express); None if nothing fits the memory limit."""
    require_split(problem)
    deadline = time.perf_counter() + seconds
    ruled = [c for c in seeds if c.family.by_rule]
    found = solve_ga(
        problem, time_limit=0.8 * seconds, seed=seed, seeds=ruled, weights=True, order=order
    ).candidate
    ops = found.ops()
    tl = simulate(problem.tables, ops, problem.minibatch)
    if not _fits(problem, tl):
        return None
    ops, tl = fill_bubbles(problem, ops, deadline)
    return climb(problem, ops, tl, deadline)
