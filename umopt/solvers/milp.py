"""The exact GPipe-order model of :mod:`.cpsat` as a mixed-integer program (PuLP; CBC, or HiGHS
when installed).

The same decision variables (a binary per stage and chunk for the forward partition, another for
the backward one with recompute) and the same per-sample chains, with each "if this chunk is
used" written as a big-M term. Times stay in float milliseconds, so the written schedule is the
one the model scored. Scope as for cpsat: "optimal" and the bound hold among GPipe-order
schedules. CBC through PuLP reports no bound when stopped by the time limit; then the spec's
lower bound is reported.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Optional

import pulp

from ..baselines import lower_bound
from ..problem import Candidate, Problem, Progress, SolverResult
from .chunks import candidate_chunks, chunk_fits, chunk_set, warm_start

__all__ = ["solve_milp", "build_milp"]


def build_milp(problem: Problem, horizon_ms: float, hint: Optional[Candidate] = None):
    """The MILP; returns (problem, x, y, makespan) with x[s][(lo, hi)] binaries."""
    t = problem.tables
    S, B = problem.num_stages, problem.minibatch
    chunks = candidate_chunks(problem)
    M = horizon_ms  # no time in a useful schedule exceeds the horizon

    lp = pulp.LpProblem("umopt_gpipe", pulp.LpMinimize)

    def time_var(name: str) -> pulp.LpVariable:
        return lp.add_variable(name, lowBound=0, upBound=M)

    # --- variables ---------------------------------------------------------------------------
    x = [{c: lp.add_variable(f"x_{s}_{c[0]}_{c[1]}", cat="Binary") for c in chunks} for s in range(S)]
    y = x if not problem.recompute else [{c: lp.add_variable(f"y_{s}_{c[0]}_{c[1]}", cat="Binary") for c in chunks} for s in range(S)]
    fstart = [{c: time_var(f"fs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    bstart = [{c: time_var(f"bs_{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    fend, bend, fmsg, bmsg, arrive, garrive = (
        [[time_var(f"{n}_{s}_{i}") for i in range(B)] for s in range(S)] for n in ("fe", "be", "fm", "bm", "ar", "ga")
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
        lp += makespan >= bend[s][0]

    # --- objective -----------------------------------------------------------------------------
    lp += makespan

    if hint is not None:
        for s in range(S):
            for part, sizes in ((x[s], hint.fsizes[s]), (y[s], hint.bsizes[s])):
                used = chunk_set(sizes)
                for c in chunks:
                    part[c].setInitialValue(1 if c in used else 0)
    return lp, x, y, makespan


def _solver(time_limit: float, warm: bool):
    threads = max(1, os.cpu_count() or 1)
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False, timeLimit=time_limit, threads=threads)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(round(time_limit))), threads=threads, warmStart=warm)


def solve_milp(
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
    base, time_limit, warm_scored = warm_start(problem, "milp", time_limit, seed, hint, order)
    opt = problem.tables.optimizer_ms
    horizon = base.simulate(problem).iteration_ms - opt + 1.0
    lp, x, y, makespan = build_milp(problem, horizon, base)
    lb = lower_bound(problem)
    lp += makespan >= max(0.0, lb - opt - 1e-6)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # PULP_CBC_CMD: still the bundled CBC
            lp.solve(_solver(time_limit, warm=True))
        status = pulp.LpStatus[lp.status]
        solved = lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    except pulp.PulpSolverError as exc:  # CBC stopped before writing a solution
        status, solved = f"solver error: {str(exc).splitlines()[0][:80]}", False
    if solved:
        S = problem.num_stages
        fs = [[hi - lo for lo, hi in sorted(c for c, v in x[s].items() if (v.value() or 0) > 0.5)] for s in range(S)]
        bs = [[hi - lo for lo, hi in sorted(c for c, v in y[s].items() if (v.value() or 0) > 0.5)] for s in range(S)]
        cand = Candidate(fs, bs, "gpipe")
    else:  # nothing better in time: keep the warm start
        cand = Candidate([list(p) for p in base.fsizes], [list(p) for p in base.bsizes], "gpipe")
    cand.iteration_ms = cand.simulate(problem).iteration_ms
    proven = solved and lp.sol_status == pulp.LpSolutionOptimal
    # CBC's objective at a proven optimum is a bound (up to its tolerances); otherwise the spec's
    bound = (pulp.value(makespan) + opt - 1e-6) if proven else lb
    if progress:
        progress(1.0, cand.iteration_ms)
    return SolverResult(
        "milp",
        cand,
        "optimal" if proven else "feasible",
        lower_bound_ms=min(bound, cand.iteration_ms),
        seconds=time.perf_counter() - t0,
        evaluated=warm_scored,
        extra={"bound_scope": "gpipe order", "mip_status": status},
    )
