"""``umopt solve --chunks``: several chunks per rank, against every multi-chunk schedule torch ships.

:func:`solve_chunked` runs the one-chunk solve (:func:`umopt.search.solve.solve`), scores torch's
multi-chunk schedules at their best v, M and cut (:func:`umopt.search.peers.schedules.best_peers`), and searches
unequal per-virtual-stage partitions (:func:`umopt.search.solvers.multichunk.solve_chunks`: a screening,
then a local search), then polishes the fastest multi-chunk order found, umopt's or torch's, op
by op (:func:`umopt.search.solvers.multichunk.improve_order`). On small instances the exact model
(:mod:`umopt.search.solvers.cpsat_chunks`) takes half of the polish's time, starts from the polished
order and may prove it optimal for its cut and placement. Every phase ends on one clock ([Note:
one deadline for a chunked solve]). The fastest within the memory limit is the schedule; every
figure comes from the reference simulator.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..costmodel import Chunking, CostTables, OpKind, Timeline, simulate
from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from ..formats.schedule import Schedule, make_schedule, validate_ops
from .bounds.ranks import busiest_rank_bound
from .peers.schedules import TORCH_MULTI, PeerResult, best_peers, equal_list_scheduled, load_torch_schedules
from .problem import LayoutProblem, Progress
from .solve import LayoutsReport, SolveReport, solve
from .solvers.cpsat_chunks import MAX_CHUNK_MODEL, ExactChunks, chunk_model_size, solve_chunks_exact
from .solvers.multichunk import ChunkSolution, improve_order, solve_chunks

__all__ = ["solve_chunked", "parse_chunks"]

# [Note: one deadline for a chunked solve]
# `--time-limit T` holds for the whole command, so every phase ends at a point of one clock
# (fractions of T from the start) rather than after a time of its own: a phase that runs late
# shortens the next ones, never the promise. The one-chunk solve to ONE_CHUNK_END; torch's
# schedules to PEERS_END (each class an equal share, its (v, M, cut) in order of promise); the
# screening and the local search to SEARCH_END (the screening at most half of that, the most
# promising shapes first); the polish (and on small instances the exact model) until TAIL before
# the end (at most TAIL_S), kept for scoring torch on the pick's own cut and writing the file. A phase the clock stopped
# before it was done is named in the report (SolveReport.layouts.cut_short).
ONE_CHUNK_END = 0.25
PEERS_END = 0.40
SEARCH_END = 0.72
EXACT_SHARE = 0.5  # of the refinement, on instances small enough, for the exact model
TAIL, TAIL_S = 0.08, 2.0


def _w_everywhere(ops, num_virtual: int) -> Optional[bool]:
    """True if every virtual stage has W ops, False if none has, None if some have."""
    with_w = {op.stage for row in ops for op in row if op.kind == OpKind.W}
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


def _part(progress: Optional[Progress], lo: float, hi: float) -> Optional[Progress]:
    """``progress`` for a step that spans ``[lo, hi]`` of the whole solve."""
    if progress is None:
        return None
    return lambda frac, best: progress(lo + (hi - lo) * frac, best)


def _baselines(one: SolveReport, peers: dict[str, PeerResult]) -> dict:
    """The schedule file's baselines: the one-chunk solve's, its own schedule, torch's schedules."""
    return {
        **one.schedule.baselines,
        "umopt_one_chunk": {"microbatches": None, "iteration_ms": one.timeline.iteration_ms},
        **{
            name: {"microbatches": p.microbatches, "iteration_ms": p.iteration_ms, "chunks": p.chunks}
            for name, p in peers.items()
        },
    }


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
    dp: Optional[AllReduceProfile] = None,
) -> SolveReport:
    """The fastest schedule with up to ``max(chunk_counts)`` chunks per rank that umopt finds,
    or one of torch's, or the one-chunk solve's, whichever the cost model says is fastest; with
    ``dp``, for that many data-parallel replicas (each rank's all-reduce of all its chunks).

    The steps: the one-chunk solve; torch's schedules at their best v and M; umopt's search;
    the fastest of those with several chunks polished op by op (and on small instances handed to
    the exact model); the pick and its schedule file."""
    if profile.layers is None:
        raise UmoptError(
            "the profile has no per-layer entries, so a rank's layers cannot be cut into chunks "
            "(umopt profile --chunks, or umopt.profile_stages(..., layers=True) for your own stages; or solve without --chunks)"
        )
    started = time.perf_counter()

    def at(share: float) -> float:
        return started + share * time_limit

    def left(share: float) -> float:
        return max(0.0, at(share) - time.perf_counter())

    cut_short = []
    load_torch_schedules()
    problem = LayoutProblem(profile, minibatch, recompute, dp)
    one = solve(
        profile,
        minibatch,
        recompute=recompute,
        time_limit=max(0.5, left(ONE_CHUNK_END)),
        seed=seed,
        zero_bubble=zero_bubble,
        progress=_part(progress, 0.0, ONE_CHUNK_END),
        dp=dp,
    )
    names = [n for n, (_, _, w) in TORCH_MULTI.items() if zero_bubble or not w]
    peers = best_peers(problem, names=names, max_chunks=max(chunk_counts), until=at(PEERS_END))
    stopped = [n.removeprefix("Schedule") for n, p in peers.items() if not p.complete]
    if stopped:
        cut_short.append(f"torch's schedules ({', '.join(stopped)} not at every v, M and cut)")
    V = max(chunk_counts) * profile.num_stages
    small = chunk_model_size(V, minibatch, profile.max_size) <= MAX_CHUNK_MODEL
    try:
        search: Optional[ChunkSolution] = solve_chunks(
            problem,
            chunk_counts=chunk_counts,
            weights=zero_bubble,
            seconds=left(SEARCH_END),
            seed=seed,
            progress=_part(progress, PEERS_END, SEARCH_END),
        )
    except UmoptError:  # no multi-chunk schedule within the memory limit: the others still compete
        search = None
    if search is not None and search.screen_cut:
        cut_short.append("the screening (not every shape and M)")
    running = [_Contender.of_search(search)] if search is not None else []
    running += [_Contender.of_peer(name, p) for name, p in peers.items() if p.iteration_ms is not None]
    exact = None
    if running:
        refine_until = started + time_limit - min(TAIL * time_limit, TAIL_S)
        refine_s = max(0.0, refine_until - time.perf_counter())
        polish_s = refine_s * (1 - EXACT_SHARE) if small else refine_s
        found, exact = _refine(
            min(running, key=lambda c: c.iteration_ms), minibatch, polish_s, small, refine_until, seed
        )
        running += found
    if progress is not None:
        progress(1.0, min([c.iteration_ms for c in running], default=float("inf")))
    baselines = _baselines(one, peers)
    best = min(running, key=lambda c: c.iteration_ms, default=None)
    if best is None or one.timeline.iteration_ms <= best.iteration_ms + 1e-9:
        schedule = Schedule.model_validate({**one.schedule.model_dump(), "baselines": baselines})
        found = LayoutsReport(
            "umopt one chunk", one.schedule, one.timeline, peers, search, exact, cut_short=cut_short
        )
        return dataclasses.replace(one, schedule=schedule, layouts=found)
    solver = {
        "seconds": time.perf_counter() - started,
        "seed": seed,
        "time_limit": time_limit,
        "evaluated": search.evaluated if search is not None else 0,
        "chunks_per_rank": best.chunking.num_virtual // profile.num_stages,
        "cut": best.cut,
    }
    names = [n for n, (_, _, w) in TORCH_MULTI.items() if zero_bubble or not w]
    v = best.chunking.num_virtual // profile.num_stages
    on_layout = best_peers(problem, names=names, max_chunks=v, on=best.chunking, until=started + time_limit)
    scored = [(p.iteration_ms, n) for n, p in on_layout.items() if p.iteration_ms is not None]
    if scored and min(scored)[0] < best.iteration_ms - 1e-9:  # torch's order wins on umopt's own cut
        best = _Contender.of_peer(min(scored)[1], on_layout[min(scored)[1]])
        exact = None
    candidates = _candidates(on_layout, best, minibatch, started + time_limit)
    schedule, timeline = _schedule_of(problem, best, exact, solver, baselines, candidates)
    found = LayoutsReport(best.name, one.schedule, one.timeline, peers, search, exact, on_layout, cut_short)
    return dataclasses.replace(one, schedule=schedule, timeline=timeline, layouts=found)


@dataclass
class _Contender:
    """A schedule with several chunks per rank in the running, and where it came from."""

    name: str  # as the report's "picked" says it
    solver: str  # as the schedule file's solver.name says it
    iteration_ms: float
    tables: CostTables
    ops: list
    chunking: Chunking
    placement: str
    cut: Optional[str] = None  # umopt's search: which cut it started from ("searched": moved)

    @classmethod
    def of_search(cls, sol: ChunkSolution) -> "_Contender":
        shape = sol.shape
        return cls(
            "umopt chunks",
            "multichunk",
            sol.iteration_ms,
            sol.tables,
            sol.ops,
            shape.chunking,
            shape.placement,
            shape.cut,
        )

    @classmethod
    def of_peer(cls, name: str, p: PeerResult) -> "_Contender":
        return cls(name, name, p.iteration_ms, p.tables, p.ops, p.chunking, TORCH_MULTI[name][0])


def _refine(
    start: _Contender,
    minibatch: int,
    seconds: float,
    small: bool,
    until: float,
    seed: int,
) -> tuple[list[_Contender], Optional[ExactChunks]]:
    """``start``'s order polished op by op for ``seconds``; on a small instance, then the exact
    model on its cut and placement, started from the polished order, until ``until``."""
    out = []
    ops, ms, _ = improve_order(start.tables, start.ops, minibatch, seconds, seed)
    if ms < start.iteration_ms - 1e-9:
        out.append(
            dataclasses.replace(
                start,
                name=f"umopt, polished from {start.name}",
                solver=f"multichunk (order polished from {start.name})",
                iteration_ms=ms,
                ops=ops,
            )
        )
    else:
        ops = start.ops
    weights = _w_everywhere(ops, start.tables.num_stages)
    if not small or weights is None:
        return out, None
    left = until - time.perf_counter()
    if left < 0.2:  # too little for the model to be built, let alone searched
        return out, None
    exact = solve_chunks_exact(start.tables, minibatch, time_limit=left, weights=weights, hint=ops, seed=seed)
    if exact is not None:
        out.append(
            dataclasses.replace(
                start,
                name=f"umopt exact, from {start.name}",
                solver=f"multichunk cpsat (from {start.name})",
                iteration_ms=exact.iteration_ms,
                ops=exact.ops,
            )
        )
    return out, exact


def _schedule_of(
    problem: LayoutProblem,
    pick: _Contender,
    exact: Optional[ExactChunks],
    solver: dict,
    baselines: dict,
    candidates: Sequence[dict] = (),
) -> tuple[Schedule, Timeline]:
    """The picked schedule's file content, with its lower bound: the busiest rank's, or the
    exact model's where that ran on the pick's cut and placement (and then, where the pick is
    within its rounding, proven optimal there)."""
    profile, minibatch, recompute, dp = problem.profile, problem.minibatch, problem.recompute, problem.dp
    tables, ops = pick.tables, pick.ops
    bound = busiest_rank_bound(tables, minibatch)
    holds_for = "schedules with this cut and placement, any partitions and order"
    status = "feasible"
    if exact is not None and exact.tables is tables:
        bound = max(bound, exact.lower_bound_ms)
        holds_for += " with W ops on every virtual stage" if exact.weights else " without W ops"
        rounding = (3 if exact.weights else 2) * tables.num_stages * minibatch / 1000  # a microsecond an op
        in_scope = _w_everywhere(ops, tables.num_stages) == exact.weights
        if in_scope and pick.iteration_ms <= bound + rounding:
            status = "optimal"
    validate_ops(ops, minibatch, profile.max_size, recompute, pick.chunking)
    timeline = simulate(tables, ops, minibatch)
    limit = profile.memory_limit_bytes
    if limit is not None and max(timeline.peak_memory_bytes) > limit:  # the search checks: cannot be
        raise UmoptError("the multi-chunk schedule found breaks the memory limit")
    schedule = make_schedule(
        profile,
        minibatch,
        recompute,
        ops,
        timeline,
        solver={
            "name": pick.solver,
            "status": status,
            "lower_bound_ms": bound,
            "bound_holds_for": holds_for,
            **solver,
            "cut": pick.cut if pick.name == "umopt chunks" else None,
            # the pick's name where umopt run measures it beside its candidates
            "recommended": pick.name if pick.name in TORCH_MULTI else "umopt",
        },
        baselines=baselines,
        chunks=pick.chunking,
        placement=pick.placement,
        dp=dp,
        candidates=candidates,
    )
    return schedule, timeline


def _equal_on_layout(pick: _Contender, minibatch: int, until: float) -> Optional[tuple[list, float]]:
    """The best equal schedule on the pick's own cut and placement (W ops where the pick has
    them), within the memory limit: the equal candidate where torch has no class for the layout
    (V-shaped without W ops) or none fits."""
    weights = _w_everywhere(pick.ops, pick.tables.num_stages) is True
    best = equal_list_scheduled(pick.tables, minibatch, weights, until)
    return None if best is None else best[:2]


def _candidates(
    on_layout: dict[str, PeerResult], pick: _Contender, minibatch: int, until: float
) -> list[dict]:
    """What ``umopt run`` measures beside the pick while training: torch's schedules on the pick's
    own layout (equal chunks, each at its best M within the memory limit) and umopt's best equal
    one there, each once, the pick itself left out. The pick's layout only: the candidates take
    turns on one model, which another layout would not hold ([Note: selection while training]
    in umopt/run/selection.py)."""
    seen, out = [pick.ops], []
    named = [(name, peer.ops, peer.iteration_ms) for name, peer in on_layout.items() if peer.ops is not None]
    equal = _equal_on_layout(pick, minibatch, until)
    if equal is not None:
        named.append((f"{pick.placement}_equal", *equal))
    for name, ops, ms in named:
        if ops in seen:
            continue
        seen.append(ops)
        out.append(
            {
                "name": name,
                "equal": True,
                "stages": [{"ops": [list(op) for op in st]} for st in ops],
                "predicted_iteration_ms": ms,
                "chunks": {
                    "layers": [list(c) for c in pick.chunking.layers],
                    "ranks": list(pick.chunking.ranks),
                    "placement": pick.placement,
                },
            }
        )
    return out
