"""``umopt solve`` as a library call: profile in, schedule (and its report) out.

:func:`solve` builds the problem from a profile, computes the baselines and the lower bound, runs
the chosen solver, re-scores its answer with the reference simulator (the single source of
predicted times) and returns a :class:`SolveReport` holding the schedule file's content. Nothing is
written here; the CLI writes the files once everything has succeeded.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from ..costmodel import CostTables, Op, Timeline, simulate
from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from ..formats.schedule import Schedule, make_schedule, validate_ops
from ..limits import check_problem_size
from ..measure.decide import is_equal
from ..schedules.family import ScheduleFamily, parse_order
from .baselines import Baseline, gpipe_equal, onef1b_equal
from .bounds import BackgroundBounds, Scope, fast_bound_ms, fast_job, reported_bounds, spec_bound
from .choice import Choice, choose
from .peers.schedules import PeerResult
from .problem import Candidate, Problem, Progress, SolverResult
from .solvers import SOLVERS
from .solvers.auto import EXACT_MAX_TERMS
from .solvers.cpsat import solve_with_weight_ops
from .solvers.cpsat_chunks import ExactChunks
from .solvers.exact import model_terms
from .solvers.multichunk import ChunkSolution
from .zerobubble import best_with_weight_ops, require_split, search_with_weight_ops, zb_h1, zb_h2

__all__ = ["SolveReport", "LayoutsReport", "solve", "make_problem", "allreduce_for"]


@dataclass
class LayoutsReport:
    """What a solve with several chunks per rank (``umopt solve --chunks``) found beside one chunk
    per rank: the one-chunk solve's schedule, torch's multi-chunk schedules at their best v, M and
    cut, umopt's multi-chunk search (and exact model), and which of them the report's schedule is."""

    picked: str  # "umopt chunks", "umopt one chunk", "umopt, polished from ...", "umopt exact, from ..." or a torch class
    one_chunk_schedule: Schedule
    one_chunk_timeline: Timeline
    peers: dict[str, PeerResult]
    search: Optional[ChunkSolution]  # None: no schedule with several chunks fits the memory limit
    exact: Optional[ExactChunks] = None  # the exact model's, where the instance is small enough
    # torch's schedules on the pick's own cut and placement (the file's candidates, and the pick
    # itself where one of them is faster than what umopt found there)
    on_layout: dict[str, PeerResult] = field(default_factory=dict)
    # the phases the time limit stopped before they were done ([Note: one deadline for a chunked solve])
    cut_short: list[str] = field(default_factory=list)


@dataclass
class SolveReport:
    """What a solve found: the schedule written and its timeline, the solver's result, the choice,
    the equal baselines and the bounds (those of one chunk per rank); with several chunks per rank,
    ``layouts`` says what else was searched and which the schedule is."""

    schedule: Schedule
    timeline: Timeline
    result: SolverResult
    choice: Choice
    gpipe: Baseline
    onef1b: Baseline
    lower_bound_ms: float
    gpipe_timeline: Optional[Timeline]
    onef1b_timeline: Optional[Timeline]
    zbh1: Optional[Baseline] = None  # with --zero-bubble: the best equal ZB-H1
    zbh1_timeline: Optional[Timeline] = None
    zbh2: Optional[Baseline] = None  # with --zero-bubble: the best equal ZB-H2 within the memory limit
    zbh2_timeline: Optional[Timeline] = None
    layouts: Optional[LayoutsReport] = None

    def speedup_over(self, baseline: Baseline) -> Optional[float]:
        if baseline.iteration_ms is None:
            return None
        return baseline.iteration_ms / self.timeline.iteration_ms

    @property
    def gap(self) -> float:
        """(iteration - best bound) / best bound: how far from optimal at most."""
        lb = self.schedule.solver.lower_bound_ms or self.lower_bound_ms
        return (self.timeline.iteration_ms - lb) / lb if lb > 0 else 0.0


# what the solver gets at least where what ran before it took most of --time-limit
MIN_SOLVER_SHARE = 0.1
# with --zero-bubble, the share of --time-limit kept for W ops: ZB-H1 and H2, W ops placed in the schedules
# found, the GA with W caps (and on small instances the exact model)
ZERO_BUBBLE_SHARE = 0.4
# From this many cells (B x largest chunk) on, the fast bounds take seconds and run in a process
# of their own beside the solver, which keeps its whole time; below, they run before it
BOUNDS_BESIDE_CELLS = 4096
# how long a solve waits at least for the fast bounds beside it before it reports the spec's bound
# instead (it is kept free at the end of the time limit)
BESIDE_GRACE_S = 0.5


def _fast_bounds(problem: Problem, family: bool) -> dict[Scope, Optional[float]]:
    return {
        Scope.ANY: fast_bound_ms(problem),
        Scope.IN_ORDER: fast_bound_ms(problem, Scope.IN_ORDER) if family else None,
    }


def make_problem(
    profile: Profile, minibatch: int, recompute: bool, dp: Optional[AllReduceProfile] = None
) -> Problem:
    if minibatch < 1:
        raise UmoptError(f"--minibatch must be at least 1, got {minibatch}")
    check_problem_size(profile.num_stages, minibatch)
    return Problem(CostTables.from_profile(profile, recompute, dp, minibatch=minibatch), minibatch)


def allreduce_for(
    profile: Profile, replicas: int, gbps: Optional[float] = None
) -> Optional[AllReduceProfile]:
    """The all-reduce ``replicas`` data-parallel pipelines pay per stage (None for one): at ``gbps``
    (bus bandwidth, Gbit/s) where given, else at the speed the profile measured (``umopt profile --dp``)."""
    if replicas < 1:
        raise UmoptError(f"--dp must be at least 1, got {replicas}")
    if gbps is not None and not (0 < gbps < math.inf):
        raise UmoptError(f"--dp-gbps must be a positive number, got {gbps}")
    if replicas == 1:
        return None
    measured = profile.allreduce
    if gbps is not None:
        return AllReduceProfile(
            replicas=replicas,
            latency_ms=measured.latency_ms if measured else 0.0,
            bus_bytes_per_ms=gbps * 1e9 / 8 / 1e3,
        )
    if measured is None:
        raise UmoptError(
            f"--dp {replicas}: the profile has no all-reduce speed; profile with --dp {replicas} to measure it, or give --dp-gbps"
        )
    return measured.model_copy(update={"replicas": replicas})


def _candidates(problem: Problem, pick: list[list[Op]], rivals: list[tuple[str, Candidate]]) -> list[dict]:
    """The schedules ``umopt run`` measures beside the pick while training: the best equal GPipe
    and 1F1B, the search's best where the pick fell back from it, with W ops the pick without
    them and the best equal ZB-H1; each once, the pick itself left out, each within the memory
    limit (they were all checked against it)."""
    seen = [pick]
    out = []
    for name, cand in rivals:
        ops = cand.ops()
        if ops in seen:
            continue
        seen.append(ops)
        out.append(
            {
                "name": name,
                "equal": is_equal(ops),
                "stages": [{"ops": [list(op) for op in st]} for st in ops],
                "predicted_iteration_ms": simulate(
                    problem.tables, ops, problem.minibatch, record=False
                ).iteration_ms,
            }
        )
    return out


def _baseline_entry(b: Baseline) -> dict:
    return {"microbatches": b.microbatches, "iteration_ms": b.iteration_ms}


def solve(
    profile: Profile,
    minibatch: int,
    *,
    recompute: bool = False,
    solver: str = "auto",
    time_limit: float = 20.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    order: "str | ScheduleFamily | None" = "auto",
    dp: Optional[AllReduceProfile] = None,
    zero_bubble: bool = False,
) -> SolveReport:
    """Solve for ``profile`` at ``minibatch`` samples per pipeline; with ``dp``, for that many
    data-parallel replicas of the pipeline, each stage paying its gradient all-reduce; with
    ``zero_bubble``, W ops (the weight gradients split off the backward) placed where they pay,
    against the best equal ZB-H1 and ZB-H2 too.

    The steps, each returning what the next takes: the equal baselines, the search (with the
    fast bounds), the choice between what it found and simpler schedules, the zero-bubble pass,
    the schedule file's content."""
    _check_arguments(solver, time_limit)
    fam = parse_order(order)  # None: every family (auto)
    started = time.perf_counter()
    problem = make_problem(profile, minibatch, recompute, dp)
    if zero_bubble:
        require_split(problem)
    gp, of = _equal_baselines(problem)
    search = _search(problem, solver, fam, time_limit, seed, progress, started, zero_bubble)
    result = search.result
    found, choice = _choice(profile, problem, solver, result, (gp, of), seed)
    zb = _ZeroBubble(choice.candidate.ops(), choice.candidate.simulate(problem))
    seconds = search.seconds
    if zero_bubble:
        seconds = ZERO_BUBBLE_SHARE * time_limit
        zb = _zero_bubble_pass(problem, result, choice, found, seconds, started, time_limit, seed, fam)
    rivals = [("umopt", found[0][1]), *((n, c) for n, c in found[1:])]
    if zero_bubble:
        rivals.append(("umopt_without_w", choice.candidate))
        if zb.zbh1 is not None and zb.zbh1.candidate is not None:
            rivals.append(("zbh1_equal", zb.zbh1.candidate))
    bound, scope, lb_1f1b = reported_bounds(
        search.fast, result.lower_bound_ms, result.bound_scope, result.lower_bound_1f1b_ms, zb.ops, fam
    )
    schedule = make_schedule(
        profile,
        minibatch,
        recompute,
        zb.ops,
        zb.timeline,
        solver=_solver_block(result, choice, solver, (bound, scope, lb_1f1b), seconds, seed, fam, time_limit),
        baselines={
            "gpipe_equal": _baseline_entry(gp),
            "1f1b_equal": _baseline_entry(of),
            **(
                {"zbh1_equal": _baseline_entry(zb.zbh1), "zbh2_equal": _baseline_entry(zb.zbh2)}
                if zb.zbh1
                else {}
            ),
        },
        dp=dp,
        candidates=_candidates(problem, zb.ops, rivals),
    )
    return SolveReport(
        schedule,
        zb.timeline,
        result,
        choice,
        gp,
        of,
        search.fast[Scope.ANY],
        gp.candidate.simulate(problem) if gp.candidate is not None else None,
        of.candidate.simulate(problem) if of.candidate is not None else None,
        zb.zbh1,
        zb.zbh1_timeline,
        zb.zbh2,
        zb.zbh2_timeline,
    )


def _check_arguments(solver: str, time_limit: float) -> None:
    if solver not in SOLVERS:
        raise UmoptError(f"unknown solver {solver!r} (choose from {', '.join(SOLVERS)})")
    if not (0 < time_limit < math.inf):  # also NaN
        raise UmoptError(f"--time-limit must be a positive number of seconds, got {time_limit}")


def _choice(
    profile: Profile,
    problem: Problem,
    solver: str,
    result: SolverResult,
    equal: tuple[Baseline, Baseline],
    seed: int,
) -> tuple[list[tuple[str, Candidate]], Choice]:
    """What the search found (checked) beside the equal baselines, and the one chosen: a schedule
    the profile cannot tell apart from a simpler one is not worth its extra ops."""
    cand: Candidate = result.candidate
    validate_ops(cand.ops(), problem.minibatch, problem.max_size, problem.recompute)
    if not cand.fits(cand.simulate(problem), problem):
        raise UmoptError(f"solver {result.name} found no schedule within the memory limit")
    found = [(f"umopt {solver}", cand)] + [(b.name, b.candidate) for b in equal if b.candidate is not None]
    choice = choose(profile, problem, found, equal=("gpipe_equal", "1f1b_equal"), seed=seed)
    if choice.name != found[0][0]:
        result.notes.append(choice.reason)
    return found, choice


def _solver_block(
    result: SolverResult,
    choice: Choice,
    solver: str,
    bounds: tuple,
    seconds: float,
    seed: int,
    order: Optional[ScheduleFamily],
    time_limit: float,
) -> dict:
    """The schedule file's ``solver`` block: who found it, how, its bounds and what was recommended."""
    bound, scope, lb_1f1b = bounds
    cand = choice.candidate
    return {
        "name": solver,
        "status": result.status,
        "lower_bound_ms": bound,
        **({"lower_bound_1f1b_ms": lb_1f1b} if lb_1f1b is not None else {}),
        "seconds": seconds,
        "seed": seed,
        "order": "auto" if order is None else order.name,
        "time_limit": time_limit,
        "evaluated": result.evaluated,
        **({"winner": result.winner} if result.winner else {}),
        **({"bound_scope": scope.value} if scope is not None else {}),
        "schedule_order": cand.order,
        "recommended": choice.name,
        **(
            {"gain_over_equal": choice.gain, "gain_uncertainty": choice.uncertainty}
            if choice.gain is not None
            else {}
        ),
        **({"warmup": cand.warmup} if cand.family.warmups and cand.warmup is not None else {}),
        # with --zero-bubble on a small instance: no schedule with a W op per B chunk is faster
        **({"lower_bound_w_ms": result.lower_bound_w_ms} if result.lower_bound_w_ms is not None else {}),
    }


def _equal_baselines(problem: Problem) -> tuple[Baseline, Baseline]:
    """The best equal GPipe and 1F1B schedules; where neither fits, why, in one line."""
    gp, of = gpipe_equal(problem), onef1b_equal(problem)
    if gp.candidate is not None or of.candidate is not None:
        return gp, of
    limit = problem.memory_limit
    static = problem.tables.static_bytes
    if limit is not None and static.max() > limit:
        s = int(static.argmax())
        raise UmoptError(
            f"stage {s}'s memory before any activation ({int(static[s])} bytes: weights, gradients, optimizer state, the minibatch's receive buffers) is over the memory limit of {limit} bytes"
        )
    if limit is None:  # every equal schedule took infinitely long: cannot be, with finite tables
        raise UmoptError(f"no equal partition of minibatch {problem.minibatch} could be scored")
    raise UmoptError(
        f"minibatch {problem.minibatch} does not fit the memory limit of {limit} bytes with any equal partition"
        + ("" if problem.recompute else "; try --recompute")
    )


@dataclass
class _Search:
    result: SolverResult
    fast: dict[Scope, Optional[float]]  # the fast bounds, of every schedule and of the 1F1B family
    seconds: float


def _search(
    problem: Problem,
    solver: str,
    order: Optional[ScheduleFamily],
    time_limit: float,
    seed: int,
    progress: Optional[Progress],
    started: float,
    zero_bubble: bool,
) -> _Search:
    """The solver's run, and the fast bounds of every schedule and of the 1F1B family (which
    most schedules are of): beside the solver where they take seconds, else before it; within
    the time limit either way."""
    family = not problem.recompute
    beside = None
    if problem.minibatch * problem.max_size >= BOUNDS_BESIDE_CELLS and (os.cpu_count() or 1) >= 2:
        beside = BackgroundBounds(fast_job, problem, family=family)
    else:
        fast = _fast_bounds(problem, family)
    t0 = time.perf_counter()
    # the whole solve ends within --time-limit: the wait for the bounds beside comes out of it too
    left = max(
        MIN_SOLVER_SHARE * time_limit,
        time_limit - (t0 - started) - (BESIDE_GRACE_S if beside is not None else 0.0),
    )
    left *= 1 - ZERO_BUBBLE_SHARE if zero_bubble else 1.0
    try:
        result = SOLVERS[solver](problem, time_limit=left, seed=seed, progress=progress, order=order)
        if beside is not None:  # what it proved by the time limit (the spec's bound, if nothing)
            got = beside.wait(timeout=max(BESIDE_GRACE_S, started + time_limit - time.perf_counter()))
            fast = {
                Scope.ANY: got.get(Scope.ANY.value, spec_bound(problem)),
                Scope.IN_ORDER: got.get(Scope.IN_ORDER.value) if family else None,
            }
            if Scope.ANY.value not in got:
                result.notes.append(
                    "the fast bounds did not finish within --time-limit, so the bound is the spec's simple one (more time gives a tighter one)"
                )
    finally:
        if beside is not None:
            beside.close()
    return _Search(result, fast, time.perf_counter() - t0)


@dataclass
class _ZeroBubble:
    """The schedule after the zero-bubble pass (W ops placed where they paid), and ZB-H1/H2."""

    ops: list[list[Op]]
    timeline: Timeline
    zbh1: Optional[Baseline] = None
    zbh1_timeline: Optional[Timeline] = None
    zbh2: Optional[Baseline] = None
    zbh2_timeline: Optional[Timeline] = None


def _zero_bubble_pass(
    problem: Problem,
    result: SolverResult,
    choice: Choice,
    found: list[tuple[str, Candidate]],
    seconds: float,
    started: float,
    time_limit: float,
    seed: int,
    order: Optional[ScheduleFamily],
) -> _ZeroBubble:
    """The best equal ZB-H1 and ZB-H2, then W ops placed in the recommended schedule and in the
    other schedules the solve found (the best without W ops need not be the best with them), and
    the GA searching partitions and W placement together from them; the chosen schedule with its
    W ops where that is faster."""
    cand = choice.candidate
    out = _ZeroBubble(cand.ops(), cand.simulate(problem))
    found_zb = zb_h1(problem, seconds / 16)
    out.zbh1 = Baseline(
        "zbh1_equal",
        found_zb[0] if found_zb else None,
        found_zb[2].iteration_ms if found_zb else None,
        Candidate.from_ops(found_zb[1]) if found_zb else None,
    )
    out.zbh1_timeline = found_zb[2] if found_zb else None
    found_zb = zb_h2(problem, seconds / 16)
    out.zbh2 = Baseline(
        "zbh2_equal",
        found_zb[0] if found_zb else None,
        found_zb[2].iteration_ms if found_zb else None,
        None,
    )
    out.zbh2_timeline = found_zb[2] if found_zb else None
    seeds = [cand] + [c for c in [*(c for _, c in found), *result.alternatives] if c is not cand]
    placed = [
        w
        for w in (best_with_weight_ops(problem, c.ops(), seconds / 8 / len(seeds)) for c in seeds)
        if w is not None
    ]
    # on small instances the exact model places W ops too, and proves how far from optimal;
    # the GA gets what is left of --time-limit (the steps before can run a little over)
    exact_too = model_terms(problem) <= EXACT_MAX_TERMS
    left = max(
        0.1 * seconds, started + time_limit - time.perf_counter() - (seconds / 4 if exact_too else 0.0)
    )
    searched = search_with_weight_ops(problem, seeds, left, seed, order)
    if searched is not None:
        placed.append(searched)
    if exact_too:
        exact = solve_with_weight_ops(problem, seconds / 4, seed)
        if exact is not None:
            placed.append((exact[0], simulate(problem.tables, exact[0], problem.minibatch)))
            result.lower_bound_w_ms = exact[1]
    with_w = min(placed, key=lambda w: w[1].iteration_ms, default=None)
    if with_w is not None and with_w[1].iteration_ms < out.timeline.iteration_ms - 1e-9:
        out.ops, out.timeline = with_w
        result.notes.append("with W ops placed; the lower bounds hold for schedules without W ops")
    return out
