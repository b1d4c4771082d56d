"""The exact models of :mod:`.cpsat` as mixed-integer programs (PuLP, on HiGHS where the
``highspy`` package installs, else on PuLP's CBC): the GPipe-order one, and a free-order one for
small instances.

The same decision variables (a binary per stage and chunk for the forward partition, another for
the backward one with recompute) and the same per-sample chains, with each "if this chunk is
used" written as a big-M term, plus the linear cuts of :mod:`umopt.search.bounds`. Times stay in float
milliseconds. Scope as for cpsat: with ``--order gpipe`` "optimal" and the bound hold among
GPipe-order schedules, with ``auto`` among all. PuLP reports no bound when the solver is stopped
by the time limit; then the bound the model started from is reported (:func:`umopt.search.bounds.start_bound_ms`).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Optional

import numpy as np
import pulp

from ...costmodel import Op, OpKind
from ...schedules.family import GPIPE, ScheduleFamily
from ..bounds import Scope, heads_and_tails, int_tables, linear_cuts, start_bound_ms
from ..problem import Candidate, Problem, Progress, SolverResult
from .entry import entry
from .exact import candidate_chunks, chunk_fits, chunk_set, chunks_ending_at, start_or_skip, with_clock

__all__ = ["MIP_TOLERANCE_MS", "engine", "solve_milp", "build_milp", "build_free_milp", "order_pairs"]


def build_milp(problem: Problem, horizon_ms: float, hint: Optional[Candidate] = None):
    """The MILP; returns (problem, x, y, makespan) with x[s][(lo, hi)] binaries."""
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    t = problem.tables
    S, B = problem.num_stages, problem.minibatch
    chunks = candidate_chunks(problem)
    M = horizon_ms  # no time in a useful schedule exceeds the horizon
    F, G, L = int_tables(problem)
    heads = heads_and_tails(F, G, L, B)

    lp = pulp.LpProblem("umopt_gpipe", pulp.LpMinimize)

    def time_var(name: str) -> pulp.LpVariable:
        return lp.add_variable(name, lowBound=0, upBound=M)

    # --- variables ---------------------------------------------------------------------------
    x = [{c: lp.add_variable(f"x_{s}_{c[0]}_{c[1]}", cat="Binary") for c in chunks} for s in range(S)]
    y = (
        x
        if not problem.recompute
        else [{c: lp.add_variable(f"y_{s}_{c[0]}_{c[1]}", cat="Binary") for c in chunks} for s in range(S)]
    )
    fstart = [{c: time_var(f"fs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    bstart = [{c: time_var(f"bs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    fend, bend, fmsg, bmsg, arrive, garrive = (
        [[time_var(f"{n}_{s}_{i}") for i in range(B)] for s in range(S)]
        for n in ("fe", "be", "fm", "bm", "ar", "ga")
    )
    makespan = time_var("makespan")

    # --- constraints ---------------------------------------------------------------------------
    for s in range(S):
        for name, part in (("x", x[s]), ("y", y[s])) if problem.recompute else (("x", x[s]),):
            for i in range(B):
                lp += pulp.lpSum(part[c] for c in chunks if c[0] <= i < c[1]) == 1, f"cover_{name}_{s}_{i}"
            for c in chunks:
                if not chunk_fits(problem, s, *c):
                    lp += part[c] == 0
        ends = [pulp.lpSum(x[s][c] for c in chunks if c[1] - 1 == i) for i in range(B)]
        starts = [pulp.lpSum(y[s][c] for c in chunks if c[0] == i) for i in range(B)]
        for c in chunks:
            lo, hi = c
            b = hi - lo
            off, boff = M * (1 - x[s][c]), M * (1 - y[s][c])
            if lo > 0:
                lp += fstart[s][c] >= fend[s][lo - 1] - off
            if s > 0:
                lp += fstart[s][c] >= arrive[s - 1][hi - 1] - off
            lp += fend[s][hi - 1] >= fstart[s][c] + float(t.fwd[s, b]) - off
            lp += bstart[s][c] >= fend[s][B - 1] - boff
            if hi < B:
                lp += bstart[s][c] >= bend[s][hi] - boff
            if s + 1 < S:
                lp += bstart[s][c] >= garrive[s + 1][lo] - boff
            lp += bend[s][lo] >= bstart[s][c] + float(t.bwd[s, b]) - boff
            if s + 1 < S:
                link = float(t.link[s, b])
                lp += fmsg[s][hi - 1] >= fend[s][hi - 1] + link - off
                if lo > 0:
                    lp += fmsg[s][hi - 1] >= fmsg[s][lo - 1] + link - off
            if s > 0:
                link = float(t.link[s - 1, b])
                lp += bmsg[s][lo] >= bend[s][lo] + link - boff
                if hi < B:
                    lp += bmsg[s][lo] >= bmsg[s][hi] + link - boff
        if s + 1 < S:
            for i in range(B):
                lp += arrive[s][i] >= fmsg[s][i] - M * (1 - ends[i])
                if i + 1 < B:
                    lp += arrive[s][i] >= arrive[s][i + 1] - M * ends[i]
        if s > 0:
            for i in range(B):
                lp += garrive[s][i] >= bmsg[s][i] - M * (1 - starts[i])
                if i > 0:
                    lp += garrive[s][i] >= garrive[s][i - 1] - M * starts[i]
        lp += makespan >= bend[s][0] + float(t.allreduce_ms[s])  # the stage's last op, then its all-reduce
        _add_cuts(lp, problem, heads, s, chunks, x[s], y[s], F, G, makespan, gpipe=True)

    # --- objective -----------------------------------------------------------------------------
    lp += makespan

    if hint is not None:
        _hint(problem, hint, chunks, x, y)
    return lp, x, y, makespan


MAX_ORDER_PAIRS = 20000


def order_pairs(problem: Problem, chunks) -> list[tuple[tuple, tuple]]:
    """Pairs of ops of one stage whose order the free-order MILP must choose: an F chunk that may
    come after a B (its samples are later than all the B's), and two disjoint B chunks. Every
    other pair is ordered by the F chain or by "B after the F of its samples"."""
    pairs = [((OpKind.F, c), (OpKind.B, d)) for c in chunks for d in chunks if c[0] >= d[1]]
    pairs += [
        ((OpKind.B, c), (OpKind.B, d))
        for c in chunks
        for d in chunks
        if c < d and (c[1] <= d[0] or d[1] <= c[0])
    ]
    return pairs


def count_order_pairs(chunks) -> int:
    """``len(order_pairs(...))`` without building them: both kinds count the pairs of disjoint
    chunks (one chunk wholly before the other), once each."""
    ends = np.array(sorted(hi for _, hi in chunks))
    before = sum(int(np.searchsorted(ends, lo, side="right")) for lo, _ in chunks)  # d.hi <= c.lo
    return 2 * before


def build_free_milp(problem: Problem, horizon_ms: float, hint: Optional[Candidate] = None):
    """The free-order MILP; returns (problem, x, y, fstart, bstart, makespan).

    As :func:`build_milp`, but each stage's op order is chosen: for every pair of ops from
    :func:`order_pairs` a binary ``z`` says which runs first (big-M, active only when both chunks
    are used). The same ``z`` orders the two B ops' gradient messages, so the link sends them in
    op order, exactly as the cost model does. No memory limit (that is the CP-SAT model's job).
    """
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    t = problem.tables
    S, B = problem.num_stages, problem.minibatch
    chunks = candidate_chunks(problem)
    M = horizon_ms
    F, G, L = int_tables(problem)
    heads = heads_and_tails(F, G, L, B)
    pairs = order_pairs(problem, chunks)

    lp = pulp.LpProblem("umopt_free", pulp.LpMinimize)

    def time_var(name: str) -> pulp.LpVariable:
        return lp.add_variable(name, lowBound=0, upBound=M)

    # --- variables ---------------------------------------------------------------------------
    x = [{c: lp.add_variable(f"x_{s}_{c[0]}_{c[1]}", cat="Binary") for c in chunks} for s in range(S)]
    y = (
        x
        if not problem.recompute
        else [{c: lp.add_variable(f"y_{s}_{c[0]}_{c[1]}", cat="Binary") for c in chunks} for s in range(S)]
    )
    fstart = [{c: time_var(f"fs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    bstart = [{c: time_var(f"bs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    gsend = [{c: time_var(f"gs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    z = [{p: lp.add_variable(f"z_{s}_{k}", cat="Binary") for k, p in enumerate(pairs)} for s in range(S)]
    fend, fdone, fmsg, arrive, garrive = (
        [[time_var(f"{n}_{s}_{i}") for i in range(B)] for s in range(S)]
        for n in ("fe", "fd", "fm", "ar", "ga")
    )
    makespan = time_var("makespan")

    # --- constraints ---------------------------------------------------------------------------
    for s in range(S):
        for name, part in (("x", x[s]), ("y", y[s])) if problem.recompute else (("x", x[s]),):
            for i in range(B):
                lp += pulp.lpSum(part[c] for c in chunks if c[0] <= i < c[1]) == 1, f"cover_{name}_{s}_{i}"
        ends = [pulp.lpSum(x[s][c] for c in chunks if c[1] - 1 == i) for i in range(B)]
        dur = {(OpKind.F, c): float(t.fwd[s, c[1] - c[0]]) for c in chunks} | {
            (OpKind.B, c): float(t.bwd[s, c[1] - c[0]]) for c in chunks
        }
        start = {(OpKind.F, c): fstart[s][c] for c in chunks} | {(OpKind.B, c): bstart[s][c] for c in chunks}
        used = {(OpKind.F, c): x[s][c] for c in chunks} | {(OpKind.B, c): y[s][c] for c in chunks}
        for c in chunks:
            lo, hi = c
            off, boff = M * (1 - x[s][c]), M * (1 - y[s][c])
            if lo > 0:
                lp += fstart[s][c] >= fend[s][lo - 1] - off
            if s > 0:
                lp += fstart[s][c] >= arrive[s - 1][hi - 1] - off
            lp += fend[s][hi - 1] >= fstart[s][c] + dur[OpKind.F, c] - off
            lp += bstart[s][c] >= fdone[s][hi - 1] - boff
            if s + 1 < S:
                for i in range(lo, hi):
                    lp += bstart[s][c] >= garrive[s + 1][i] - boff
            lp += makespan >= bstart[s][c] + dur[OpKind.B, c] + float(t.allreduce_ms[s]) - boff
            if s > 0:
                lp += gsend[s][c] >= bstart[s][c] + dur[OpKind.B, c] - boff
                for i in range(lo, hi):
                    lp += garrive[s][i] >= gsend[s][c] + float(t.link[s - 1, hi - lo]) - boff
            if s + 1 < S:
                link = float(t.link[s, hi - lo])
                lp += fmsg[s][hi - 1] >= fend[s][hi - 1] + link - off
                if lo > 0:
                    lp += fmsg[s][hi - 1] >= fmsg[s][lo - 1] + link - off
        for i in range(B):
            lp += fdone[s][i] >= fend[s][i] - M * (1 - ends[i])
            if i + 1 < B:
                lp += fdone[s][i] >= fdone[s][i + 1] - M * ends[i]
            if s + 1 < S:
                lp += arrive[s][i] >= fmsg[s][i] - M * (1 - ends[i])
                if i + 1 < B:
                    lp += arrive[s][i] >= arrive[s][i + 1] - M * ends[i]
        for (u, v), first in z[s].items():  # first = 1: u before v
            both = M * (2 - used[u] - used[v])
            lp += start[v] >= start[u] + dur[u] - M * (1 - first) - both
            lp += start[u] >= start[v] + dur[v] - M * first - both
            if s > 0 and u[0] == v[0] == OpKind.B:  # their gradient messages, in the same order
                cu, cv = u[1], v[1]
                lp += (
                    gsend[s][cv]
                    >= gsend[s][cu] + float(t.link[s - 1, cu[1] - cu[0]]) - M * (1 - first) - both
                )
                lp += gsend[s][cu] >= gsend[s][cv] + float(t.link[s - 1, cv[1] - cv[0]]) - M * first - both
        _add_cuts(lp, problem, heads, s, chunks, x[s], y[s], F, G, makespan, gpipe=False)

    # --- objective -----------------------------------------------------------------------------
    lp += makespan

    if hint is not None:
        _hint(problem, hint, chunks, x, y)
    return lp, x, y, fstart, bstart, makespan


def _add_cuts(
    lp, problem: Problem, heads, s: int, chunks, x: dict, y: dict, F, G, makespan, gpipe: bool
) -> None:
    """The linear cuts of :func:`umopt.search.bounds.linear_cuts` (microseconds, turned into ms)."""
    fd = {c: int(F[s, c[1] - c[0]]) for c in chunks}
    bd = {c: int(G[s, c[1] - c[0]]) for c in chunks}
    later_f, later_b = _later_work(lp, s, chunks, problem.minibatch, x, y, fd, bd)
    for terms, rest in linear_cuts(problem, heads, s, chunks, x, y, fd, bd, later_f, later_b, gpipe=gpipe):
        lp += makespan >= pulp.LpAffineExpression([(v, a / 1000) for a, v in terms]) + rest / 1000


def _hint(problem: Problem, hint: Candidate, chunks, x, y) -> None:
    """CBC's MIP start: the hint's partitions."""
    for s in range(problem.num_stages):
        for part, sizes in ((x[s], hint.fsizes[s]), (y[s], hint.bsizes[s])):
            used = chunk_set(sizes)
            for c in chunks:
                part[c].setInitialValue(1 if c in used else 0)


def _later_work(lp, s: int, chunks, B: int, x: dict, y: dict, fdur: dict, bdur: dict):
    """As ``cpsat._later_work``: F and B work (microseconds) of chunks holding a sample >= i."""
    ending = chunks_ending_at(chunks, B)
    later_f = [lp.add_variable(f"lf_{s}_{i}", lowBound=0) for i in range(B + 1)]
    later_b = [lp.add_variable(f"lb_{s}_{i}", lowBound=0) for i in range(B + 1)]
    lp += later_f[B] == 0
    lp += later_b[B] == 0
    for i in range(B - 1, -1, -1):
        lp += later_f[i] == later_f[i + 1] + pulp.LpAffineExpression([(x[c], fdur[c]) for c in ending[i]])
        lp += later_b[i] == later_b[i + 1] + pulp.LpAffineExpression([(y[c], bdur[c]) for c in ending[i]])
    return later_f, later_b


# how far above its bound a schedule may be and still count as optimal: the MIP solvers'
# feasibility and gap tolerances, in ms
MIP_TOLERANCE_MS = 1e-3


def engine() -> str:
    """The MIP engine: HiGHS (the ``highspy`` package) where it is installed, else PuLP's CBC."""
    return "HiGHS" if "HiGHS" in pulp.listSolvers(onlyAvailable=True) else "CBC"


def _solver(time_limit: float, warm: bool):
    threads = max(1, os.cpu_count() or 1)
    if engine() == "HiGHS":
        return pulp.HiGHS(msg=False, timeLimit=time_limit, threads=threads)
    return pulp.PULP_CBC_CMD(
        msg=False, timeLimit=max(1, int(round(time_limit))), threads=threads, warmStart=warm
    )


@entry
def solve_milp(
    problem: Problem,
    *,
    time_limit: float = 20.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    hint: Optional[Candidate] = None,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    """``order`` GPIPE: the GPipe-order model; None (auto): the free-order model where it is small
    enough and no memory limit is set, else the GPipe-order one (``extra["note"]`` says so)."""
    return with_clock(
        progress, time_limit, lambda found: _solve_milp(problem, time_limit, seed, hint, order, found)
    )


def _solve_milp(
    problem: Problem,
    time_limit: float,
    seed: int,
    hint: Optional[Candidate],
    order: Optional[ScheduleFamily],
    found: list,
) -> SolverResult:
    t0 = time.perf_counter()
    note = None
    if order is not GPIPE:
        pairs = count_order_pairs(candidate_chunks(problem)) * problem.num_stages
        if pairs > MAX_ORDER_PAIRS:
            note = f"the free-order model needs {pairs} ordering binaries (more than {MAX_ORDER_PAIRS}): solved in GPipe order"
        elif problem.memory_limit is not None:
            note = "the free-order model has no memory limit: solved in GPipe order (cpsat orders freely under one)"
        if note:
            order = GPIPE
    base, time_limit, warm_scored, skipped = start_or_skip(problem, "milp", time_limit, seed, hint, order, t0)
    if skipped:
        return skipped
    found[0] = base.iteration_ms
    t_model = time.perf_counter()  # building the model counts against the time limit
    opt = problem.tables.optimizer_ms
    horizon = base.iteration_ms - opt + 1.0
    if order is GPIPE:
        lp, x, y, makespan = build_milp(problem, horizon, base)
    else:
        lp, x, y, fstart, bstart, makespan = build_free_milp(problem, horizon, base)
    lb = start_bound_ms(problem, order, time_limit - (time.perf_counter() - t_model), base.iteration_ms, seed)
    lp += makespan >= max(0.0, lb - opt - 1e-6)
    status, solved = "not run", False
    for warm in (True, False):  # CBC's MIP start crashes it on some models: then go without
        left = max(1.0, time_limit - (time.perf_counter() - t_model))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # PULP_CBC_CMD: still the bundled CBC
                lp.solve(_solver(left, warm=warm))
            status = pulp.LpStatus[lp.status]
            solved = lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
            break
        except pulp.PulpSolverError as exc:  # the solver died or stopped before writing a solution
            status = f"solver error: {str(exc).splitlines()[0][:80]}"
    S = problem.num_stages

    def on(v) -> bool:
        return (v.value() or 0) > 0.5

    if solved and order is GPIPE:
        fs = [[hi - lo for lo, hi in sorted(c for c, v in x[s].items() if on(v))] for s in range(S)]
        bs = [[hi - lo for lo, hi in sorted(c for c, v in y[s].items() if on(v))] for s in range(S)]
        cand = Candidate(fs, bs, GPIPE.name)
    elif solved:
        ops = []
        for s in range(S):
            timed = [(fstart[s][c].value(), 0, Op(OpKind.F, *c)) for c, v in x[s].items() if on(v)]
            timed += [(bstart[s][c].value(), 1, Op(OpKind.B, *c)) for c, v in y[s].items() if on(v)]
            ops.append([op for _, _, op in sorted(timed)])
        cand = Candidate.from_ops(ops)
    else:  # nothing better in time: keep the warm start
        cand = base
    cand.iteration_ms = cand.simulate(problem).iteration_ms
    if base.iteration_ms < cand.iteration_ms:
        cand = base
    proven = solved and lp.sol_status == pulp.LpSolutionOptimal
    # the objective at a proven optimum is a bound (up to the solver's tolerances); otherwise the
    # starting one. A schedule that meets its bound within those tolerances is optimal too
    bound = max(lb, pulp.value(makespan) + opt - 1e-6) if proven else lb
    optimal = proven or cand.iteration_ms <= bound + MIP_TOLERANCE_MS
    return SolverResult(
        "milp",
        cand,
        "optimal" if optimal else "feasible",
        lower_bound_ms=min(bound, cand.iteration_ms),
        evaluated=warm_scored,
        bound_scope=(Scope.GPIPE if order is GPIPE else Scope.ANY).value,
        engine_status=status,
        engine=engine(),
        notes=[note] if note else [],
    )
