"""The multi-chunk schedules torch ships, taken from torch itself and scored by umopt's cost model.

torch.distributed.pipelining computes each schedule's action order when the schedule is built
(``pipeline_order``: per rank, ``_Action(stage_index, computation_type, microbatch_index)``).
:func:`torch_order` builds the schedule class over stand-in stages (the attributes the order
depends on: stage index, stage count, rank, group size; no process group, no model) and reads
that order, so a peer is measured by the peer's own code, never a re-implementation of it.
:func:`torch_ops` turns it into umopt ops on equal microbatches (torch splits the minibatch as
``torch.tensor_split``: the larger chunks first), and :func:`best_peers` finds, for each class,
its best v and M under the cost model (memory limit respected).
"""

from __future__ import annotations

import functools
import time
import types
from dataclasses import dataclass
from typing import Optional, Sequence

from ...chunks import chunking, placement, user_cuts
from ...costmodel import Chunking, ChunkOp, CostTables, OpKind, Timeline, rank_peak_memory, simulate
from ...errors import UmoptError
from ...formats.profile import Profile
from ...schedules.multichunk import build_ops, equal_genes
from ...schedules.partition import chunks as sample_ranges
from ...schedules.partition import equal_sizes
from ..problem import LayoutProblem

__all__ = [
    "TORCH_MULTI",
    "PeerResult",
    "load_torch_schedules",
    "torch_order",
    "torch_ops",
    "score_peer",
    "best_peers",
]

# torch's multi-stage schedule classes: placement, the chunk counts per rank they allow here,
# whether they split the backward into input (I) and weight (W) gradients
TORCH_MULTI: dict[str, tuple[str, tuple[int, ...], bool]] = {
    "ScheduleLoopedBFS": ("looped", (2, 3, 4), False),
    "ScheduleInterleaved1F1B": ("looped", (2, 3, 4), False),
    "ScheduleInterleavedZeroBubble": ("looped", (2, 3, 4), True),
    "ScheduleZBVZeroBubble": ("vshape", (2,), True),
    "ScheduleDualPipeV": ("vshape", (2,), True),
}


# a process that imported torch's schedules takes about this long to exit (0.8 s measured on a
# 2-core machine): a command on the clock keeps it back from its time limit
TORCH_EXIT_S = 0.8


def load_torch_schedules():
    """torch's schedule classes (importing them takes seconds on a CPU: a solve on the clock
    does it first, so that what is left is counted after it)."""
    from torch.distributed.pipelining import schedules

    return schedules


@functools.lru_cache(maxsize=512)
def torch_order(name: str, num_ranks: int, chunks: int, microbatches: int) -> dict[int, list]:
    """torch's action order of schedule class ``name``: rank -> its compute actions, in order
    (torch's idle slots dropped). Raises :class:`UmoptError` where torch refuses the shape."""
    schedules = load_torch_schedules()
    if name not in TORCH_MULTI:
        raise UmoptError(f"unknown torch schedule {name!r} (one of {', '.join(TORCH_MULTI)})")
    place = TORCH_MULTI[name][0]
    S, v = num_ranks, chunks
    V = S * v
    ranks = placement(place, S, v)
    # every rank's order is computed when any rank builds the schedule: rank 0's build has them all
    stages = [
        types.SimpleNamespace(
            stage_index=j,
            num_stages=V,
            group_size=S,
            group_rank=0,
            is_first=j == 0,
            is_last=j == V - 1,
            submod=None,  # torch only asks whether it is compiled
        )
        for j in range(V)
        if ranks[j] == 0
    ]
    try:
        sched = getattr(schedules, name)(stages, microbatches, loss_fn=lambda out, target: out)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise UmoptError(
            f"torch's {name} refuses {S} ranks x {v} chunks, {microbatches} microbatches: {exc}"
        ) from None
    got = sched.stage_index_to_group_rank
    if any(got[j] != ranks[j] for j in range(V)):
        raise UmoptError(f"torch's {name} places stages otherwise than umopt's {place} placement")
    return {r: [a for a in sched.pipeline_order[r] if a is not None] for r in range(S)}


def torch_ops(
    name: str, num_ranks: int, chunks: int, minibatch: int, microbatches: int
) -> list[list[ChunkOp]]:
    """torch's order of ``name`` as umopt ops on ``microbatches`` equal chunks of ``minibatch``.

    I (input gradient) is umopt's B on a stage with W ops, W is W; a full backward on such a stage
    is its B and then its W; an overlapped F and B (DualPipeV) runs as its two parts in order."""
    ranges = sample_ranges(equal_sizes(minibatch, microbatches))
    order = torch_order(name, num_ranks, chunks, microbatches)
    has_w = {a.stage_index for acts in order.values() for a in _flat(acts) if _kind(a) == OpKind.W}
    out = []
    for r in range(num_ranks):
        ops: list[ChunkOp] = []
        for a in _flat(order[r]):
            lo, hi = ranges[a.microbatch_index]
            kind, j = _kind(a), a.stage_index
            if kind == "FULL_B" and j in has_w:
                ops += [ChunkOp(OpKind.B, lo, hi, j), ChunkOp(OpKind.W, lo, hi, j)]
            elif kind == "FULL_B":
                ops.append(ChunkOp(OpKind.B, lo, hi, j))
            elif isinstance(kind, OpKind):
                ops.append(ChunkOp(kind, lo, hi, j))
        out.append(ops)
    return out


def _flat(actions: Sequence) -> list:
    flat = []
    for a in actions:
        flat += list(a.sub_actions) if getattr(a, "sub_actions", None) else [a]
    return flat


# torch's computation types as umopt's kinds: I (input gradient) is umopt's B, torch's B a full backward
_TORCH_KINDS = {"F": OpKind.F, "B": "FULL_B", "I": OpKind.B, "W": OpKind.W}


def _kind(action) -> OpKind | str:
    """umopt's kind of a torch action, "FULL_B" for a full backward, else torch's own name."""
    ct = str(
        action.computation_type.value
        if hasattr(action.computation_type, "value")
        else action.computation_type
    )
    return _TORCH_KINDS.get(ct, ct)


@dataclass
class PeerResult:
    name: str  # torch's class name
    chunks: Optional[int]  # v: chunks per rank (None: no shape fits)
    microbatches: Optional[int]
    iteration_ms: Optional[float]
    ops: Optional[list[list[ChunkOp]]] = None
    tables: Optional[CostTables] = None
    timeline: Optional[Timeline] = None
    chunking: Optional[Chunking] = None  # the layers each virtual stage holds, and where
    cut: Optional[str] = None  # how those layers were cut (umopt.chunks.user_cuts' names)
    complete: bool = True  # False: the time limit stopped the scoring before every (v, M, cut)


def score_peer(
    problem: LayoutProblem, name: str, chunks: int, microbatches: int
) -> tuple[CostTables, list[list[ChunkOp]], Timeline]:
    """torch's ``name`` at ``chunks`` per rank and ``microbatches`` equal chunks, each rank's stage
    cut into ``chunks`` pieces (:func:`umopt.chunks.stage_cut`), under the cost model."""
    tables = problem.tables(chunking(problem.profile, chunks, TORCH_MULTI[name][0]))
    ops = torch_ops(name, problem.num_ranks, chunks, problem.minibatch, microbatches)
    return tables, ops, simulate(tables, ops, problem.minibatch)


def _cuts(profile: Profile, name: str, v: int) -> list[tuple[str, Chunking]]:
    """The cuts a torch user could make for v chunks per rank (:func:`umopt.chunks.user_cuts`),
    named, under the placement of ``name``."""
    place = TORCH_MULTI[name][0]
    out: list[tuple[str, Chunking]] = []
    for cut_name, layers in user_cuts(profile, v).items():
        try:
            ch = chunking(profile, v, place, layers)
        except UmoptError:
            continue
        if all(ch != c for _, c in out):
            out.append((cut_name, ch))
    return out


def _same_layout(profile: Profile, name: str, v: int, on: Chunking) -> list[tuple[str, Chunking]]:
    """``on`` where torch's ``name`` at v chunks per rank places virtual stages as it does."""
    try:
        return [("umopt's", on)] if chunking(profile, v, TORCH_MULTI[name][0], on.layers) == on else []
    except UmoptError:  # another chunk count than on's
        return []


def _busiest_rank_ms(tables: CostTables, minibatch: int, m: int, split: bool) -> float:
    """No iteration is shorter than its busiest rank's compute (M equal chunks on every stage;
    by sequences, each chunk its own samples' costs)."""
    ranges = sample_ranges(equal_sizes(minibatch, m))
    busy = [0.0] * tables.num_ranks
    kinds = ("fwd", "bwd_input", "bwd_weight") if split else ("fwd", "bwd")
    for j in range(tables.num_stages):
        busy[tables.rank_of(j)] += sum(float(tables.op_ms(k, j, lo, hi)) for k in kinds for lo, hi in ranges)
    return max(busy) + tables.optimizer_ms


def equal_list_scheduled(
    tables: CostTables, minibatch: int, weights: bool = False, until: Optional[float] = None
) -> Optional[tuple[list[list[ChunkOp]], float, int]]:
    """The best equal schedule on ``tables``' layout: every virtual stage M equal chunks (in
    samples, by sequences too), each rank ordered by list scheduling under interleaved 1F1B's
    warm-up, W ops with ``weights``; (ops, iteration ms, M) of the fastest M within the memory
    limit, None where none fits. What stands for the equal peer where torch has no class for a
    layout (V-shaped without W ops). ``until``: a ``time.perf_counter()`` after which no more M is
    tried once one fits."""
    limit, best = tables.memory_limit, None
    # no chunk larger than the profile costs: at least minibatch / largest size of them
    for m in range(max(1, -(-minibatch // tables.max_size)), minibatch + 1):
        if best is not None and until is not None and time.perf_counter() > until:
            break
        genes = equal_genes(tables, minibatch, m, weights=weights)
        genes.fwd = [list(equal_sizes(minibatch, m)) for _ in genes.fwd]  # equal in samples
        ops, ms = build_ops(tables, minibatch, genes)
        fits = limit is None or all(rank_peak_memory(tables, r, o) <= limit for r, o in enumerate(ops))
        if fits and (best is None or ms < best[1] - 1e-9):
            best = (ops, ms, m)
    return best


def best_peers(
    problem: LayoutProblem,
    *,
    names: Sequence[str] | None = None,
    max_chunks: int = 4,
    on: Optional[Chunking] = None,
    until: Optional[float] = None,
) -> dict[str, PeerResult]:
    """For each of torch's multi-chunk schedules, its best chunk count (<= ``max_chunks``),
    microbatch count and cut (each a user would try: :func:`umopt.chunks.user_cuts`) under the cost model,
    within the profile's memory limit; with the problem's ``dp``, each rank paying its gradient
    all-reduce.
    ``on``: that layout only (a schedule whose placement differs from it has no result), as torch
    would run on the layers where umopt's pick puts them.

    Every (v, M, cut) is accounted for, the most promising first; those whose busiest rank alone
    is slower than the best found are not simulated (their order: :func:`_busiest_rank_ms` with
    interleaved 1F1B's fill and drain). ``until`` (a ``time.perf_counter()``): each
    class gets an equal share of the time left, and one stopped by it says so (``complete``)."""
    profile, minibatch = problem.profile, problem.minibatch
    limit = profile.memory_limit_bytes
    out = {}
    todo = list(names or TORCH_MULTI)
    S = profile.num_stages
    for i, name in enumerate(todo):
        share = (
            None if until is None else time.perf_counter() + (until - time.perf_counter()) / (len(todo) - i)
        )
        _, vs, needs_w = TORCH_MULTI[name]
        best = PeerResult(name, None, None, None)
        if needs_w and not problem.split:
            out[name] = best
            continue
        shapes = []
        for v in (v for v in vs if v <= max_chunks):
            for k, (cut, ch) in enumerate(
                _cuts(profile, name, v) if on is None else _same_layout(profile, name, v, on)
            ):
                tables = problem.tables(ch)  # classes of one placement share their cuts
                for m in range(max(1, -(-minibatch // problem.max_size)), minibatch + 1):
                    bound = _busiest_rank_ms(tables, minibatch, m, needs_w)
                    # the order of promise: the bound with interleaved 1F1B's fill and drain,
                    # (S - 1) / v of a microbatch's work on a rank, and with fewer microbatches
                    # than ranks, the rounds of S slots they leave part empty
                    estimate = bound * max(1.0, S / m) * (1 + (S - 1) / (v * max(m, S)))
                    shapes.append((estimate, bound, v, m, k, tables, ch, cut))
        # in turns over the chunk counts (the estimate misses what the messages cost, which
        # grows with v), each count's shapes in order of promise
        turn: dict[int, int] = {}
        seen: dict[int, int] = {}
        for x in sorted(shapes, key=lambda x: x[:5]):
            turn[id(x)] = seen.get(x[2], 0)
            seen[x[2]] = turn[id(x)] + 1
        tried = 0
        # a shape over the memory limit: fewer (larger) microbatches of its v and cut hold more
        too_big: dict[tuple[int, int], int] = {}
        for _, bound, v, m, k, tables, ch, cut in sorted(shapes, key=lambda x: (turn[id(x)], *x[:5])):
            if best.iteration_ms is not None and bound >= best.iteration_ms:
                continue
            if m <= too_big.get((v, k), 0):
                continue
            # past its share once it has a result (or many tries found none within the memory limit)
            if (
                share is not None
                and time.perf_counter() > share
                and (best.iteration_ms is not None or tried >= 24)
            ):
                best.complete = False
                break
            try:
                ops = torch_ops(name, profile.num_stages, v, minibatch, m)
            except UmoptError:  # a shape torch's class refuses is no try
                continue
            tried += 1
            tl = simulate(tables, ops, minibatch, record=False)
            if best.iteration_ms is not None and tl.iteration_ms >= best.iteration_ms - 1e-9:
                continue
            if limit is not None and any(rank_peak_memory(tables, r, o) > limit for r, o in enumerate(ops)):
                too_big[(v, k)] = max(too_big.get((v, k), 0), m)
                continue
            best = PeerResult(name, v, m, tl.iteration_ms, ops, tables, chunking=ch, cut=cut)
        if best.ops is not None:
            best.timeline = simulate(best.tables, best.ops, minibatch)
        out[name] = best
    return out
