"""``umopt solve --chunks``: several chunks per rank, against every multi-chunk schedule torch ships.

:func:`solve_chunked` runs the one-chunk solve (:func:`umopt.solve.solve`, a third of the time),
scores torch's multi-chunk schedules at their best v and M (:func:`umopt.peers.best_peers`), and
searches unequal per-virtual-stage partitions (:func:`umopt.solvers.multichunk.solve_chunks`, the
rest of the time but a quarter), then polishes the fastest multi-chunk order found, umopt's or
torch's, op by op (:func:`umopt.solvers.multichunk.improve_order`, the last quarter). On small
instances the exact model (:mod:`umopt.solvers.cpsat_chunks`) takes a quarter of the time from
the search, starts from the polished order and may prove it optimal for its cut and placement.
The fastest within the memory limit is the schedule; every figure comes from the reference
simulator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from .bounds.ranks import busiest_rank_bound
from .costmodel import Timeline, simulate
from .errors import UmoptError
from .formats.profile import Profile
from .formats.schedule import Schedule, make_schedule, validate_ops
from .peers import TORCH_MULTI, PeerResult, best_peers
from .problem import Progress
from .solve import SolveReport, solve
from .solvers.cpsat_chunks import MAX_CHUNK_MODEL, ExactChunks, chunk_model_size, solve_chunks_exact
from .solvers.multichunk import ChunkSolution, improve_order, solve_chunks

__all__ = ["ChunkSolveReport", "solve_chunked", "parse_chunks"]

ONE_CHUNK_SHARE = 1 / 3  # of --time-limit, for the one-chunk solve
POLISH_SHARE = 1 / 4  # and for polishing the best order found
EXACT_SHARE = 1 / 4  # and, on instances small enough, for the exact model


@dataclass
class ChunkSolveReport:
    schedule: Schedule
    timeline: Timeline
    picked: str  # "umopt chunks", "umopt one chunk", "umopt, polished from ...", "umopt exact, from ..." or a torch class
    one_chunk: SolveReport
    peers: dict[str, PeerResult]
    search: Optional[ChunkSolution]  # None: no schedule with several chunks fits the memory limit
    exact: Optional[ExactChunks] = None  # the exact model's, where the instance is small enough


def _w_everywhere(ops, num_virtual: int) -> Optional[bool]:
    """True if every virtual stage has W ops, False if none has, None if some have."""
    with_w = {op.stage for row in ops for op in row if op.kind == "W"}
    return True if len(with_w) == num_virtual else False if not with_w else None


def parse_chunks(value: str) -> tuple[int, ...]:
    """``--chunks``: a count 1..4, or ``auto`` (each of 1..4)."""
    if value == "auto":
        return (1, 2, 3, 4)
    try:
        v = int(value)
    except ValueError:
        raise UmoptError(
            f"--chunks must be a number of chunks per rank (1-4) or auto, got {value!r}"
        ) from None
    if not 1 <= v <= 4:
        raise UmoptError(f"--chunks must be 1-4 or auto, got {v}")
    return (v,)


def solve_chunked(
    profile: Profile,
    minibatch: int,
    chunk_counts: Sequence[int],
    *,
    recompute: bool = False,
    time_limit: float = 20.0,
    seed: int = 0,
    zero_bubble: bool = False,
    progress: Optional[Progress] = None,
) -> ChunkSolveReport:
    """The fastest schedule with up to ``max(chunk_counts)`` chunks per rank that umopt finds,
    or one of torch's, or the one-chunk solve's, whichever the cost model says is fastest."""
    if profile.layers is None:
        raise UmoptError(
            "the profile has no per-layer entries, so a rank's layers cannot be cut into chunks "
            "(profile with --chunks, or solve without --chunks)"
        )
    started = time.perf_counter()

    def part(lo: float, hi: float) -> Optional[Progress]:
        if progress is None:
            return None
        return lambda frac, best: progress(lo + (hi - lo) * frac, best)

    one = solve(
        profile,
        minibatch,
        recompute=recompute,
        time_limit=ONE_CHUNK_SHARE * time_limit,
        seed=seed,
        zero_bubble=zero_bubble,
        progress=part(0.0, ONE_CHUNK_SHARE),
    )
    names = [n for n, (_, _, w) in TORCH_MULTI.items() if zero_bubble or not w]
    peers = best_peers(profile, minibatch, recompute=recompute, names=names, max_chunks=max(chunk_counts))
    V = max(chunk_counts) * profile.num_stages
    small = chunk_model_size(V, minibatch, profile.max_size) <= MAX_CHUNK_MODEL
    exact_share = EXACT_SHARE if small else 0.0
    left = max(1.0, (1 - POLISH_SHARE - exact_share) * time_limit - (time.perf_counter() - started))
    try:
        search: Optional[ChunkSolution] = solve_chunks(
            profile,
            minibatch,
            chunk_counts=chunk_counts,
            weights=zero_bubble,
            recompute=recompute,
            seconds=left,
            seed=seed,
            progress=part(ONE_CHUNK_SHARE, 1 - POLISH_SHARE),
        )
    except UmoptError:  # no multi-chunk schedule within the memory limit: the others still compete
        search = None
    # the fastest schedule with several chunks, umopt's or torch's, its order polished op by op
    found = (
        [(search.iteration_ms, "umopt chunks", search.tables, search.ops, search.shape.chunking)]
        if search
        else []
    )
    found += [
        (p.iteration_ms, name, p.tables, p.ops, p.chunking) for name, p in peers.items() if p.iteration_ms
    ]
    polished = exact = None
    if found:
        ms0, origin, tables0, ops0, ch0 = min(found, key=lambda x: x[0])
        seconds = max(0.5, (1 - exact_share) * time_limit - (time.perf_counter() - started))
        ops1, ms1, _ = improve_order(tables0, ops0, minibatch, seconds, seed)
        if ms1 < ms0 - 1e-9:
            polished = (ms1, origin, tables0, ops1, ch0)
            ops0 = ops1
        weights = _w_everywhere(ops0, tables0.num_stages)
        if small and weights is not None:  # the exact model, started from the best order found
            seconds = max(0.5, time_limit - (time.perf_counter() - started))
            exact = solve_chunks_exact(
                tables0, minibatch, time_limit=seconds, weights=weights, hint=ops0, seed=seed
            )
            if exact is not None:
                exact = (exact, origin, tables0, ch0, weights)
    if progress is not None:
        done = [x[0] for x in found] + ([polished[0]] if polished else [])
        progress(1.0, min(done + ([exact[0].iteration_ms] if exact else []), default=float("inf")))
    picks = [("umopt chunks", search.iteration_ms)] if search is not None else []
    picks += [(name, p.iteration_ms) for name, p in peers.items() if p.iteration_ms is not None]
    if polished is not None:
        picks.append(("umopt polished", polished[0]))
    if exact is not None:
        picks.append(("umopt exact", exact[0].iteration_ms))
    picks.append(("umopt one chunk", one.timeline.iteration_ms))
    picked = min(picks, key=lambda x: x[1] - (1e-9 if x[0] == "umopt one chunk" else 0.0))[0]
    baselines = {
        **one.schedule.baselines,
        "umopt_one_chunk": {"microbatches": None, "iteration_ms": one.timeline.iteration_ms},
        **{
            name: {"microbatches": p.microbatches, "iteration_ms": p.iteration_ms, "chunks": p.chunks}
            for name, p in peers.items()
        },
    }
    if picked == "umopt one chunk":
        schedule = Schedule.model_validate({**one.schedule.model_dump(), "baselines": baselines})
        return ChunkSolveReport(schedule, one.timeline, picked, one, peers, search, exact and exact[0])
    bound = {
        "lower_bound_ms": None,
        "bound_holds_for": "schedules with this cut and placement, any partitions and order",
    }
    if picked == "umopt exact":
        result, origin, tables, ch, weights = exact
        ops = result.ops
        place = search.shape.placement if origin == "umopt chunks" else TORCH_MULTI[origin][0]
        solver_name = f"multichunk cpsat (from {origin})"
        picked = f"umopt exact, from {origin}"
    elif picked == "umopt polished":
        _, origin, tables, ops, ch = polished
        place = search.shape.placement if origin == "umopt chunks" else TORCH_MULTI[origin][0]
        solver_name = f"multichunk (order polished from {origin})"
        picked = f"umopt, polished from {origin}"
    elif picked == "umopt chunks":
        tables, ops, place, ch = search.tables, search.ops, search.shape.placement, search.shape.chunking
        solver_name = "multichunk"
    else:
        p = peers[picked]
        tables, ops, place = p.tables, p.ops, TORCH_MULTI[picked][0]
        ch = p.chunking
        solver_name = picked
    bound["lower_bound_ms"] = busiest_rank_bound(tables, minibatch)
    status = "feasible"
    if exact is not None and exact[2] is tables:  # the exact model ran on this cut and placement
        result, weights = exact[0], exact[4]
        bound["lower_bound_ms"] = max(bound["lower_bound_ms"], result.lower_bound_ms)
        bound["bound_holds_for"] += " with W ops on every virtual stage" if weights else " without W ops"
        rounding = (3 if weights else 2) * tables.num_stages * minibatch / 1000  # a microsecond an op
        in_scope = _w_everywhere(ops, tables.num_stages) == weights
        if (
            in_scope
            and simulate(tables, ops, minibatch, record=False).iteration_ms
            <= bound["lower_bound_ms"] + rounding
        ):
            status = "optimal"
    validate_ops(ops, minibatch, profile.max_size, recompute, ch)
    timeline = simulate(tables, ops, minibatch)
    limit = profile.memory_limit_bytes
    if limit is not None and max(timeline.peak_memory_bytes) > limit:
        raise UmoptError(
            "the multi-chunk schedule found breaks the memory limit"
        )  # the search checks: cannot be
    schedule = make_schedule(
        profile,
        minibatch,
        recompute,
        ops,
        timeline,
        solver={
            "name": solver_name,
            "status": status,
            **bound,
            "seconds": time.perf_counter() - started,
            "seed": seed,
            "time_limit": time_limit,
            "evaluated": search.evaluated if search is not None else 0,
            "chunks_per_rank": ch.num_virtual // profile.num_stages,
            "cut": search.shape.cut if search is not None and picked == "umopt chunks" else None,
        },
        baselines=baselines,
        chunks=ch,
        placement=place,
    )
    return ChunkSolveReport(schedule, timeline, picked, one, peers, search, exact and exact[0])
