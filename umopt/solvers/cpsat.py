"""An exact CP-SAT model of GPipe-order schedules with per-stage partitions (OR-Tools).

Scope, plainly: the model covers GPipe order only, so "optimal" and the bound it reports hold
among GPipe-order schedules (the schedule file says so in ``solver.bound_scope``); 1F1B and free
op orders are not modelled yet. It proves small instances optimal in well under a second; on a
minibatch of 32 its relaxation is weak and the bound stays near the simple lower bound.

Decision variables are the partitions themselves: for every stage and every chunk ``[lo, hi)`` of
at most the profile's largest size, a boolean ``x[s][c]`` (the forward partition uses it) and
``y[s][c]`` (the backward one; the same variable without recompute). Times are integers in
microseconds, with durations rounded *down*, so the model's optimum is never above the true
one and the solver's bound is a valid lower bound on any schedule of this order. The schedule it
finds is written and reported as the float cost model scores it.

The cost model's semantics become "starts no earlier than" constraints: minimising the makespan
makes every op start as early as the model allows, which is exactly the simulator's rule.
Per-sample helper variables keep the model at O(stages x B x max size) constraints:

* ``fend[s][i]``: end of the F chunk that ends at sample i; a chunk starts after ``fend[s][lo-1]``.
* ``fmsg[s][i]``: when the activation message of that chunk has arrived at s+1 (messages on a
  link one at a time, in chunk order); ``arrive[s][i]`` is the arrival of the message holding
  sample i (the next chunk end at or after i), and an F chunk on s waits for its last sample.
* ``bend[s][lo]``, ``bmsg[s][lo]``, ``garrive[s][i]``: the same for B chunks, which run in
  reverse sample order, so they chain on chunk starts and wait for their *first* sample.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

from ortools.sat.python import cp_model

from ..baselines import lower_bound
from ..errors import UmoptError
from ..problem import Candidate, Problem, Progress, SolverResult
from .chunks import candidate_chunks, chunk_fits, chunk_set, warm_start

__all__ = ["solve_cpsat", "build_model"]


def _us(ms: float) -> int:
    return int(math.floor(ms * 1000 + 1e-9))


def build_model(problem: Problem, horizon_us: int, hint: Optional[Candidate] = None):
    """The CP-SAT model; returns (model, x, y, makespan) with x[s][(lo, hi)] booleans."""
    t = problem.tables
    S, B = problem.num_stages, problem.minibatch
    chunks = candidate_chunks(problem)

    m = cp_model.CpModel()
    H = horizon_us

    # --- variables ---------------------------------------------------------------------------
    x = [{c: m.new_bool_var(f"x{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    y = x if not problem.recompute else [{c: m.new_bool_var(f"y{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    fstart = [{c: m.new_int_var(0, H, "") for c in chunks} for s in range(S)]
    bstart = [{c: m.new_int_var(0, H, "") for c in chunks} for s in range(S)]
    fend = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]
    bend = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # indexed by chunk start
    fmsg = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]
    bmsg = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]
    arrive = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # at s+1
    garrive = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # at s-1
    makespan = m.new_int_var(0, H, "makespan")

    # --- constraints ---------------------------------------------------------------------------
    for s in range(S):
        for part in (x[s], y[s]) if problem.recompute else (x[s],):
            for i in range(B):  # every sample in exactly one chunk
                m.add_exactly_one(part[c] for c in chunks if c[0] <= i < c[1])
            for c in chunks:
                if not chunk_fits(problem, s, *c):
                    m.add(part[c] == 0)
        ends = [_as_bool(m, sum(x[s][c] for c in chunks if c[1] - 1 == i)) for i in range(B)]  # an F chunk ends at i
        starts = [_as_bool(m, sum(y[s][c] for c in chunks if c[0] == i)) for i in range(B)]  # a B chunk starts at i
        for c in chunks:
            lo, hi = c
            b = hi - lo
            f_dur, b_dur = _us(t.fwd[s, b]), _us(t.bwd[s, b])
            on, bon = x[s][c], y[s][c]
            # forward: after the previous chunk, after its inputs, in sample order
            if lo > 0:
                m.add(fstart[s][c] >= fend[s][lo - 1]).only_enforce_if(on)
            if s > 0:
                m.add(fstart[s][c] >= arrive[s - 1][hi - 1]).only_enforce_if(on)
            m.add(fend[s][hi - 1] >= fstart[s][c] + f_dur).only_enforce_if(on)
            # backward: after every forward of the stage, after the chunk above, after its gradients
            m.add(bstart[s][c] >= fend[s][B - 1]).only_enforce_if(bon)
            if hi < B:
                m.add(bstart[s][c] >= bend[s][hi]).only_enforce_if(bon)
            if s + 1 < S:
                m.add(bstart[s][c] >= garrive[s + 1][lo]).only_enforce_if(bon)
            m.add(bend[s][lo] >= bstart[s][c] + b_dur).only_enforce_if(bon)
            # messages: one at a time per link direction, in the order the ops send them
            if s + 1 < S:
                link = _us(t.link[s, b])
                prev = [fmsg[s][lo - 1]] if lo > 0 else []
                for after in [fend[s][hi - 1], *prev]:
                    m.add(fmsg[s][hi - 1] >= after + link).only_enforce_if(on)
            if s > 0:
                link = _us(t.link[s - 1, b])
                prev = [bmsg[s][hi]] if hi < B else []
                for after in [bend[s][lo], *prev]:
                    m.add(bmsg[s][lo] >= after + link).only_enforce_if(bon)
        # arrivals: a sample arrives with the message of the chunk holding it
        if s + 1 < S:
            for i in range(B):
                m.add(arrive[s][i] >= fmsg[s][i]).only_enforce_if(ends[i])
                if i + 1 < B:
                    m.add(arrive[s][i] >= arrive[s][i + 1]).only_enforce_if(ends[i].Not())
        if s > 0:
            for i in range(B):
                m.add(garrive[s][i] >= bmsg[s][i]).only_enforce_if(starts[i])
                if i > 0:
                    m.add(garrive[s][i] >= garrive[s][i - 1]).only_enforce_if(starts[i].Not())
        m.add(makespan >= bend[s][0])

    # --- objective -----------------------------------------------------------------------------
    m.minimize(makespan)

    if hint is not None:
        for s in range(S):
            fch = chunk_set(hint.fsizes[s])
            bch = chunk_set(hint.bsizes[s])
            for c in chunks:
                m.add_hint(x[s][c], c in fch)
                if problem.recompute:
                    m.add_hint(y[s][c], c in bch)
    return m, x, y, makespan


def _as_bool(m: cp_model.CpModel, expr):
    """A boolean equal to a 0/1 linear expression (a sum of exclusive booleans)."""
    v = m.new_bool_var("")
    m.add(v == expr)
    return v


def _partition(is_set, chunk_vars: dict) -> list[int]:
    """Chunk sizes, in sample order, of the chunks whose boolean ``is_set`` says are used."""
    return [hi - lo for lo, hi in sorted(c for c, v in chunk_vars.items() if is_set(v))]


def solve_cpsat(
    problem: Problem,
    *,
    time_limit: float = 20.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    hint: Optional[Candidate] = None,
    order: str = "gpipe",
    **_,
) -> SolverResult:
    t0 = time.perf_counter()
    base, time_limit, warm_scored = warm_start(problem, "cpsat", time_limit, seed, hint, order)
    base_ms = base.simulate(problem).iteration_ms - problem.tables.optimizer_ms
    n_ops = 2 * problem.num_stages * problem.minibatch
    model, x, y, makespan = build_model(problem, _us(base_ms) + n_ops + 1, base)
    lb_ms = lower_bound(problem) - problem.tables.optimizer_ms
    # the spec's bound, in the model's floored microseconds (one microsecond of slack per op)
    model.add(makespan >= max(0, _us(lb_ms) - n_ops))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit)
    solver.parameters.num_workers = max(1, os.cpu_count() or 1)
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        fs = [_partition(solver.boolean_value, x[s]) for s in range(problem.num_stages)]
        bs = [_partition(solver.boolean_value, y[s]) for s in range(problem.num_stages)]
        cand = Candidate(fs, bs, "gpipe")
    elif status == cp_model.UNKNOWN:  # no time to complete even the warm start: keep it
        cand = Candidate([list(p) for p in base.fsizes], [list(p) for p in base.bsizes], "gpipe")
    else:
        raise UmoptError(f"cpsat: the model is {solver.status_name(status)} (no GPipe schedule fits)")
    cand.iteration_ms = cand.simulate(problem).iteration_ms
    bound = solver.best_objective_bound / 1000 + problem.tables.optimizer_ms
    # floored durations can only make the model optimistic, so its bound stays valid; call the
    # float schedule optimal when it is within that rounding of the bound
    proven = status == cp_model.OPTIMAL and cand.iteration_ms <= bound + n_ops / 1000 + 1e-9
    if progress:
        progress(1.0, cand.iteration_ms)
    return SolverResult(
        "cpsat",
        cand,
        "optimal" if proven else "feasible",
        lower_bound_ms=min(bound, cand.iteration_ms),
        seconds=time.perf_counter() - t0,
        evaluated=warm_scored,
        extra={"bound_scope": "gpipe order", "cp_status": solver.status_name(status)},
    )
