"""A local greedy: each stage in turn picks its own partition to finish earliest, given the others.

Starting from the best equal GPipe schedule, stage 0, 1, ..., S-1 each choose, from the equal
partitions of every feasible M (larger chunks first or last), the one that minimises *that stage's*
finish time (ties: the iteration time), with the other stages held fixed; with recompute the
forward and the backward partition are chosen one after the other. Sweeps repeat until no stage
changes its mind. It is myopic on purpose: the paper's local baseline.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ...errors import UmoptError
from ...schedules.family import GPIPE, ScheduleFamily
from ...schedules.partition import equal_sizes
from ..baselines import feasible_m, gpipe_equal
from ..problem import Candidate, Problem, Progress, SolverResult, pack
from .entry import entry

__all__ = ["solve_greedy"]


def _family(problem: Problem) -> list[list[int]]:
    out = []
    for m in feasible_m(problem):
        sizes = equal_sizes(problem.minibatch, m)
        out.append(sizes)
        if sizes[0] != sizes[-1]:
            out.append(sizes[::-1])
    return out


@entry
def solve_greedy(
    problem: Problem,
    *,
    time_limit: float = 10.0,
    progress: Optional[Progress] = None,
    max_sweeps: int = 20,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    t0 = time.perf_counter()
    start = gpipe_equal(problem)
    if start.candidate is None:
        raise UmoptError("no equal GPipe partition fits the memory limit, so greedy has no start")
    S = problem.num_stages
    fam = _family(problem)
    fs = [list(p) for p in start.candidate.fsizes]
    bs = [list(p) for p in start.candidate.bsizes]
    best_it = start.iteration_ms
    evaluated = 0
    for sweep in range(max_sweeps):
        changed = False
        for s in range(S):
            for which in ("f", "b") if problem.recompute else ("f",):
                trial_f, trial_b = [], []
                for part in fam:
                    f = [p for p in fs]
                    b = [p for p in bs]
                    if which == "f":
                        f[s] = part
                        if not problem.recompute:
                            b[s] = part
                    else:
                        b[s] = part
                    trial_f.append(f)
                    trial_b.append(b)
                it, sc = GPIPE.score(problem.tables, pack(trial_f), pack(trial_b))
                evaluated += len(fam)
                own = np.where(np.isfinite(it), sc.finish_ms[:, s], np.inf)
                k = int(np.lexsort((it, own))[0])
                current = fs[s] if which == "f" else bs[s]
                if fam[k] != current and np.isfinite(it[k]):
                    fs, bs = trial_f[k], trial_b[k]
                    best_it = float(it[k])
                    changed = True
            if progress:
                progress(min(1.0, (sweep * S + s + 1) / (max_sweeps * S)), best_it)
        if not changed or time.perf_counter() - t0 > time_limit:
            break
    # chosen for GPipe order; asked for another family, the same partitions run in its order
    fam = order or GPIPE
    cand = Candidate(fs, bs, fam.name)
    cand.iteration_ms = best_it if fam is GPIPE else cand.simulate(problem).iteration_ms
    return SolverResult("greedy", cand, "feasible", evaluated=evaluated)
