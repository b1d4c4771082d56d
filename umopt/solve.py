"""``umopt solve`` as a library call: profile in, schedule (and its report) out.

:func:`solve` builds the problem from a profile, computes the baselines and the lower bound, runs
the chosen solver, re-scores its answer with the reference simulator (the single source of
predicted times) and returns a :class:`SolveReport` holding the schedule file's content. Nothing is
written here; the CLI writes the files once everything has succeeded.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from .baselines import Baseline, gpipe_equal, onef1b_equal
from .costmodel import CostTables, Timeline
from .errors import UmoptError
from .problem import Candidate, Problem, Progress, SolverResult
from .profile import Profile
from .schedule import Schedule, make_schedule, validate_ops
from .solvers import SOLVERS
from .solvers.bounds import backwards_in_sample_order, best_bound_ms

__all__ = ["SolveReport", "solve", "make_problem"]


@dataclass
class SolveReport:
    schedule: Schedule
    timeline: Timeline
    result: SolverResult
    gpipe: Baseline
    onef1b: Baseline
    lower_bound_ms: float
    gpipe_timeline: Optional[Timeline]
    onef1b_timeline: Optional[Timeline]

    def speedup_over(self, baseline: Baseline) -> Optional[float]:
        if baseline.iteration_ms is None:
            return None
        return baseline.iteration_ms / self.timeline.iteration_ms

    @property
    def gap(self) -> float:
        """(iteration - best bound) / best bound: how far from optimal at most."""
        lb = self.schedule.solver.lower_bound_ms or self.lower_bound_ms
        return (self.timeline.iteration_ms - lb) / lb if lb > 0 else 0.0


# what the solver gets at least where the bounds before it took most of --time-limit
MIN_SOLVER_SHARE = 0.25
# From this many cells (B x largest chunk) on, the fast bounds run in a process of their own
# beside the solver: there they take seconds (transformer8-sim, both scopes: B=128 2.9 s, B=256
# 5.6 s; S=4, B=32 0.9 s) and no pair bounds run on the other cores, so the solver keeps its time
BOUNDS_BESIDE_CELLS = 4096


class _BoundsBeside:
    """:func:`best_bound_ms` for every schedule and (``family``) for the 1F1B family, computed in
    a child process while the solver runs. A plain subprocess, as in :mod:`.solvers.pairs`:
    spawning would import the caller's main module again."""

    def __init__(self, problem: Problem, family: bool):
        self.problem, self.family = problem, family
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOUNDS_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(base64.b64encode(pickle.dumps((problem, family))).decode())
        self.proc.stdin.close()

    def result(self) -> tuple[float, Optional[float]]:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().split()
        self.proc.wait()
        if self.proc.returncode != 0 or len(out) != 2:  # then here, as where it is small
            return _fast_bounds(self.problem, self.family)
        return float(out[0]), (float(out[1]) if self.family else None)


_BOUNDS_CHILD = (
    "import base64, pickle, sys; from umopt.solvers.bounds import best_bound_ms; "
    "p, family = pickle.loads(base64.b64decode(sys.stdin.read())); "
    "print(best_bound_ms(p)); print(best_bound_ms(p, '1f1b order') if family else 0.0)"
)


def _fast_bounds(problem: Problem, family: bool) -> tuple[float, Optional[float]]:
    return best_bound_ms(problem), (best_bound_ms(problem, "1f1b order") if family else None)


def make_problem(profile: Profile, minibatch: int, recompute: bool) -> Problem:
    if minibatch < 1:
        raise UmoptError(f"--minibatch must be at least 1, got {minibatch}")
    return Problem(CostTables.from_profile(profile, recompute), minibatch)


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
    order: str = "auto",
) -> SolveReport:
    if solver not in SOLVERS:
        raise UmoptError(f"unknown solver {solver!r} (choose from {', '.join(SOLVERS)})")
    if order not in ("auto", "gpipe", "1f1b"):
        raise UmoptError(f"--order must be auto, gpipe or 1f1b, got {order!r}")
    if time_limit <= 0:
        raise UmoptError(f"--time-limit must be positive, got {time_limit}")
    started = time.perf_counter()
    problem = make_problem(profile, minibatch, recompute)
    gp, of = gpipe_equal(problem), onef1b_equal(problem)
    if gp.candidate is None and of.candidate is None:
        limit = problem.memory_limit
        raise UmoptError(
            f"minibatch {minibatch} does not fit the memory limit of {limit} bytes with any equal partition"
            + ("" if recompute else "; try --recompute")
        )
    # the fast bound (the spec's, or the stage cuts' and untied bound's when higher), and the 1F1B
    # family's, which most schedules are of: beside the solver where they take seconds, else
    # before it; either way within the time limit (they used to come on top of it)
    beside = None
    if problem.minibatch * problem.max_size >= BOUNDS_BESIDE_CELLS and (os.cpu_count() or 1) >= 2:
        beside = _BoundsBeside(problem, not recompute)
    else:
        lb, lb_family = _fast_bounds(problem, not recompute)
    t0 = time.perf_counter()
    left = max(MIN_SOLVER_SHARE * time_limit, time_limit - (t0 - started))
    try:
        result = SOLVERS[solver](problem, time_limit=left, seed=seed, progress=progress, order=order)
    except BaseException:  # (a solver's error, an interrupt) no bound is wanted any more
        if beside is not None:
            beside.proc.kill()
        raise
    seconds = time.perf_counter() - t0
    if beside is not None:
        lb, lb_family = beside.result()
    cand: Candidate = result.candidate
    ops = cand.ops()
    validate_ops(ops, minibatch, problem.max_size, recompute)
    timeline = cand.simulate(problem)
    if not cand.fits(timeline, problem):
        raise UmoptError(f"solver {result.name} found no schedule within the memory limit")
    # a schedule of the 1F1B family (B ops in sample order) is also measured against the best of
    # that family, whose bound is tighter; under --order 1f1b that family is the whole question
    bound = max(lb, result.lower_bound_ms or lb)
    lb_1f1b = None
    if lb_family is not None and (order == "1f1b" or backwards_in_sample_order(ops)):
        lb_1f1b = max(bound, lb_family, result.extra.get("lower_bound_1f1b_ms", 0.0))
    scope = {"bound_scope": result.extra["bound_scope"]} if "bound_scope" in result.extra else {}
    if order == "1f1b" and lb_1f1b is not None:
        bound, scope = lb_1f1b, {"bound_scope": "1f1b order"}
    schedule = make_schedule(
        profile,
        minibatch,
        recompute,
        ops,
        timeline,
        solver={
            "name": solver,
            "status": result.status,
            "lower_bound_ms": bound,
            **({"lower_bound_1f1b_ms": lb_1f1b} if lb_1f1b is not None else {}),
            "seconds": seconds,
            "seed": seed,
            "order": order,
            "time_limit": time_limit,
            "evaluated": result.evaluated,
            **({"winner": result.extra["winner"]} if "winner" in result.extra else {}),
            **scope,
            "schedule_order": cand.order,
            **({"warmup": cand.warmup} if cand.order == "1f1b" and cand.warmup is not None else {}),
        },
        baselines={"gpipe_equal": _baseline_entry(gp), "1f1b_equal": _baseline_entry(of)},
    )
    gpipe_timeline = gp.candidate.simulate(problem) if gp.candidate is not None else None
    onef1b_timeline = of.candidate.simulate(problem) if of.candidate is not None else None
    return SolveReport(schedule, timeline, result, gp, of, lb, gpipe_timeline, onef1b_timeline)
