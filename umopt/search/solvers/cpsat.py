"""Exact CP-SAT models of schedules with per-stage partitions (OR-Tools).

Two models, one function each. ``build_free_model`` (``--order auto``) lets every stage run its
ops in any order: each op is an optional interval on the stage's no-overlap resource, so GPipe,
1F1B and every other order are in the search space, and its bound holds for *every* schedule
(``solver.bound_scope: "any order"`` in the schedule file). ``build_gpipe_model``
(``--order gpipe``) fixes GPipe order; its proof and bound hold among GPipe-order schedules.
Both prove small instances optimal in seconds (tests compare them with brute force over every
partition and order). On realistic sizes they do not close the gap: their bound rises to the
bound they start from and stays there. The free-order model starts from the pair bounds (two
stages at a time, :func:`umopt.search.bounds.start_bound_ms`) where they run, else from the fast bound.

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
from typing import TYPE_CHECKING, Optional

from ...costmodel import Op, OpKind, simulate
from ...errors import UmoptError
from ...schedules.family import GPIPE, ScheduleFamily
from .. import stoppable
from ..bounds import (
    Heads,
    Scope,
    heads_and_tails,
    int_tables,
    linear_cuts,
    start_bound_ms,
)
from ..problem import Candidate, Problem, Progress, SolverResult
from .entry import entry
from .exact import (
    candidate_chunks,
    chunk_fits,
    chunk_set,
    chunks_ending_at,
    start_or_skip,
    with_clock,
)

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["solve_cpsat", "build_gpipe_model", "build_free_model", "solve_with_weight_ops"]

# [Note: one function per model]
# An exact model is built in one function, as in the OR-Tools samples: its variables, then its
# constraints, then its objective, named like the math, so that it reads top to bottom against
# docs/formats.md; split into helpers, one constraint's pieces would be scattered across them.


def _us(ms: float) -> int:
    return int(math.floor(ms * 1000 + 1e-9))


def build_gpipe_model(problem: Problem, horizon_us: int, hint: Optional[Candidate] = None):
    """The CP-SAT model; returns (model, x, y, makespan) with x[s][(lo, hi)] booleans."""
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    from ortools.sat.python import cp_model  # imported where used: it pulls in pandas

    t = problem.tables
    S, B = problem.num_stages, problem.minibatch
    chunks = candidate_chunks(problem)
    heads = heads_and_tails(*int_tables(problem), B)

    m = cp_model.CpModel()
    H = horizon_us

    # --- variables ---------------------------------------------------------------------------
    x = [{c: m.new_bool_var(f"x{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    y = (
        x
        if not problem.recompute
        else [{c: m.new_bool_var(f"y{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    )
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
        ends = [
            _as_bool(m, sum(x[s][c] for c in chunks if c[1] - 1 == i)) for i in range(B)
        ]  # an F chunk ends at i
        starts = [
            _as_bool(m, sum(y[s][c] for c in chunks if c[0] == i)) for i in range(B)
        ]  # a B chunk starts at i
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
            _add_heads(m, problem, heads, s, c, on, bon, fstart[s][c], bstart[s][c], f_dur, b_dur, makespan)
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
        m.add(makespan >= bend[s][0] + _us(t.allreduce_ms[s]))  # the stage's last op, then its all-reduce
        fd = {c: _us(t.fwd[s, c[1] - c[0]]) for c in chunks}
        bd = {c: _us(t.bwd[s, c[1] - c[0]]) for c in chunks}
        later_f, later_b = _later_work(m, chunks, B, x[s], y[s], fd, bd, H)
        for terms, rest in linear_cuts(
            problem, heads, s, chunks, x[s], y[s], fd, bd, later_f, later_b, gpipe=True
        ):
            m.add(makespan >= sum(a * v for a, v in terms) + rest)

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


def build_free_model(
    problem: Problem, horizon_us: int, hint: Optional[Candidate] = None, weights: bool = False
):
    """The free-order CP-SAT model; returns (model, x, y, fstart, bstart, makespan, wstart).

    With ``weights`` every stage's backward is split (zero bubble): a B op is the input gradient
    and each B chunk has a W op of its own, any time after it on the stage (``wstart``; empty
    otherwise), which releases what its samples kept; the redundant cuts, which assume whole
    backwards, are then left out.

    Every op is an optional interval on its stage's no-overlap resource, so each stage's op order
    is the solver's choice (GPipe, 1F1B and every other order are in the search space); memory is a
    reservoir per stage. F ops keep ascending sample order, as the spec requires, so activation
    messages chain per sample exactly as in the GPipe model. Gradient messages are intervals on
    their link's no-overlap resource: the link sends one at a time, but the model does not force
    them into send order, which can only make it optimistic, so its bound stays valid; the schedule
    is re-scored by the simulator, which does keep send order.
    """
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    from ortools.sat.python import cp_model

    t = problem.tables
    S, B = problem.num_stages, problem.minibatch
    chunks = candidate_chunks(problem)
    heads = heads_and_tails(*int_tables(problem), B)
    limit = problem.memory_limit

    m = cp_model.CpModel()
    H = horizon_us

    # --- variables ---------------------------------------------------------------------------
    x = [{c: m.new_bool_var(f"x{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    y = (
        x
        if not problem.recompute
        else [{c: m.new_bool_var(f"y{s}_{c[0]}_{c[1]}") for c in chunks} for s in range(S)]
    )
    fstart = [{c: m.new_int_var(0, H, "") for c in chunks} for s in range(S)]
    bstart = [{c: m.new_int_var(0, H, "") for c in chunks} for s in range(S)]
    fdur = [{c: _us(t.fwd[s, c[1] - c[0]]) for c in chunks} for s in range(S)]
    bdur = [{c: _us((t.bwd_input if weights else t.bwd)[s, c[1] - c[0]]) for c in chunks} for s in range(S)]
    fint = [
        {c: m.new_optional_fixed_size_interval_var(fstart[s][c], fdur[s][c], x[s][c], "") for c in chunks}
        for s in range(S)
    ]
    bint = [
        {c: m.new_optional_fixed_size_interval_var(bstart[s][c], bdur[s][c], y[s][c], "") for c in chunks}
        for s in range(S)
    ]
    wstart = [{c: m.new_int_var(0, H, "") for c in chunks} if weights else {} for s in range(S)]
    wdur = [{c: _us(t.bwd_weight[s, c[1] - c[0]]) for c in chunks} if weights else {} for s in range(S)]
    wint = [
        {c: m.new_optional_fixed_size_interval_var(wstart[s][c], wdur[s][c], y[s][c], "") for c in wstart[s]}
        for s in range(S)
    ]
    # gradient message of B chunk c on stage s (s > 0), over link s-1
    gsend = [{c: m.new_int_var(0, H, "") for c in chunks} if s > 0 else {} for s in range(S)]
    gint = [
        {
            c: m.new_optional_fixed_size_interval_var(
                gsend[s][c], _us(t.link[s - 1, c[1] - c[0]]), y[s][c], ""
            )
            for c in chunks
        }
        if s > 0
        else {}
        for s in range(S)
    ]
    fend = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # F chunk ending at i has ended
    fdone = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # F of sample i has ended
    fmsg = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]
    arrive = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # activation of i at s+1
    garrive = [[m.new_int_var(0, H, "") for _ in range(B)] for s in range(S)]  # gradient of i at s-1
    makespan = m.new_int_var(0, H, "makespan")

    # --- constraints ---------------------------------------------------------------------------
    for s in range(S):
        for part in (x[s], y[s]) if problem.recompute else (x[s],):
            for i in range(B):  # every sample in exactly one chunk
                m.add_exactly_one(part[c] for c in chunks if c[0] <= i < c[1])
        m.add_no_overlap([*fint[s].values(), *bint[s].values(), *wint[s].values()])
        ends = [_as_bool(m, sum(x[s][c] for c in chunks if c[1] - 1 == i)) for i in range(B)]
        for c in chunks:
            lo, hi = c
            on, bon = x[s][c], y[s][c]
            # forward: in sample order, after its inputs
            if lo > 0:
                m.add(fstart[s][c] >= fend[s][lo - 1]).only_enforce_if(on)
            if s > 0:
                m.add(fstart[s][c] >= arrive[s - 1][hi - 1]).only_enforce_if(on)
            m.add(fend[s][hi - 1] >= fstart[s][c] + fdur[s][c]).only_enforce_if(on)
            # backward: after the F of its samples here, after their gradients from above
            m.add(bstart[s][c] >= fdone[s][hi - 1]).only_enforce_if(bon)
            if s + 1 < S:
                for i in range(lo, hi):
                    m.add(bstart[s][c] >= garrive[s + 1][i]).only_enforce_if(bon)
            if s > 0:
                m.add(gsend[s][c] >= bstart[s][c] + bdur[s][c]).only_enforce_if(bon)
                for i in range(lo, hi):
                    m.add(garrive[s][i] >= gsend[s][c] + _us(t.link[s - 1, hi - lo])).only_enforce_if(bon)
            if weights:  # the chunk's W after its B, then the stage's all-reduce
                m.add(wstart[s][c] >= bstart[s][c] + bdur[s][c]).only_enforce_if(bon)
                m.add(makespan >= wstart[s][c] + wdur[s][c] + _us(t.allreduce_ms[s])).only_enforce_if(bon)
            else:
                _add_heads(
                    m,
                    problem,
                    heads,
                    s,
                    c,
                    on,
                    bon,
                    fstart[s][c],
                    bstart[s][c],
                    fdur[s][c],
                    bdur[s][c],
                    makespan,
                )
            # activation messages: one at a time, in F order (= sample order)
            if s + 1 < S:
                link = _us(t.link[s, hi - lo])
                prev = [fmsg[s][lo - 1]] if lo > 0 else []
                for after in [fend[s][hi - 1], *prev]:
                    m.add(fmsg[s][hi - 1] >= after + link).only_enforce_if(on)
        for i in range(B):  # F of sample i ends with the chunk holding it (the next chunk end)
            m.add(fdone[s][i] >= fend[s][i]).only_enforce_if(ends[i])
            if i + 1 < B:
                m.add(fdone[s][i] >= fdone[s][i + 1]).only_enforce_if(ends[i].Not())
            if s + 1 < S:
                m.add(arrive[s][i] >= fmsg[s][i]).only_enforce_if(ends[i])
                if i + 1 < B:
                    m.add(arrive[s][i] >= arrive[s][i + 1]).only_enforce_if(ends[i].Not())
        if s > 0:
            m.add_no_overlap(list(gint[s].values()))
        if limit is not None:
            wend = {c: wstart[s][c] + wdur[s][c] for c in wstart[s]} if weights else None
            _add_memory(m, problem, s, chunks, x[s], y[s], fstart[s], bstart[s], fdur[s], bdur[s], wend)
        if weights:
            continue
        # redundant cuts: they give the LP relaxation what each chunk size costs (see .bounds)
        later_f, later_b = _later_work(m, chunks, B, x[s], y[s], fdur[s], bdur[s], H)
        for terms, rest in linear_cuts(
            problem, heads, s, chunks, x[s], y[s], fdur[s], bdur[s], later_f, later_b, gpipe=False
        ):
            m.add(makespan >= sum(a * v for a, v in terms) + rest)

    # --- objective -----------------------------------------------------------------------------
    m.minimize(makespan)

    if hint is not None:
        _hint_free(m, problem, hint, chunks, x, y, fstart, bstart)
    return m, x, y, fstart, bstart, makespan, wstart


def _add_memory(
    m, problem: Problem, s: int, chunks, x, y, fstart, bstart, fdur, bdur, wend: Optional[dict] = None
) -> None:
    """The spec's memory model as a reservoir: stash grows when an F starts and shrinks when its
    B ends (with recompute: inputs are kept, the running chunk's stash only while it runs). With
    W ops (``wend``: each B chunk's W end) a sample's memory goes when its W ends, and with
    recompute what its B recomputed stays until then too."""
    room = int(problem.memory_limit - problem.tables.static_bytes[s])
    times, changes, actives = memory_events(problem.tables, s, chunks, x, y, fstart, bstart, fdur, bdur, wend)
    m.add_reservoir_constraint_with_active(times, changes, actives, 0, room)


def memory_events(tables, s: int, chunks, x, y, fstart, bstart, fdur, bdur, wend: Optional[dict] = None):
    """Stage ``s``'s memory changes for a reservoir (see :func:`_add_memory`): when (an
    expression), by how many bytes, and whether (the chunk's boolean)."""
    t = tables
    times, changes, actives = [], [], []

    def event(when, delta, active):
        if delta:
            times.append(when)
            changes.append(int(delta))
            actives.append(active)

    for c in chunks:
        b = c[1] - c[0]
        if wend is not None:
            event(
                fstart[c],
                b * (t.input_bytes[s] + t.stash_bytes[s] if t.recompute else t.stash_bytes[s]),
                x[c],
            )
            if t.recompute:
                event(fstart[c] + fdur[c], -b * t.stash_bytes[s], x[c])
                event(bstart[c], b * t.stash_bytes[s], y[c])
            event(
                wend[c],
                -b * (t.input_bytes[s] + t.stash_bytes[s] if t.recompute else t.stash_bytes[s]),
                y[c],
            )
        elif not t.recompute:
            event(fstart[c], b * t.stash_bytes[s], x[c])
            event(bstart[c] + bdur[c], -b * t.stash_bytes[s], y[c])
        else:
            event(fstart[c], b * (t.input_bytes[s] + t.stash_bytes[s]), x[c])
            event(fstart[c] + fdur[c], -b * t.stash_bytes[s], x[c])
            event(bstart[c], b * t.stash_bytes[s], y[c])
            event(bstart[c] + bdur[c], -b * (t.input_bytes[s] + t.stash_bytes[s]), y[c])
    return times, changes, actives


def _hint_free(m, problem: Problem, hint: Candidate, chunks, x, y, fstart, bstart) -> None:
    """The hint's partitions and its op start times as the simulator plays them."""
    tl = hint.simulate(problem)
    for s in range(problem.num_stages):
        fch, bch = chunk_set(hint.fsizes[s]), chunk_set(hint.bsizes[s])
        starts = {(sp.kind, sp.lo, sp.hi): _us(sp.start) for sp in tl.spans[s]}
        for c in chunks:
            m.add_hint(x[s][c], c in fch)
            if problem.recompute:
                m.add_hint(y[s][c], c in bch)
            if c in fch:
                m.add_hint(fstart[s][c], starts[(OpKind.F, *c)])
            if c in bch:
                m.add_hint(bstart[s][c], starts[(OpKind.B, *c)])


def _later_work(m, chunks, B: int, x: dict, y: dict, fdur: dict, bdur: dict, H: int):
    """``later_f[i]``, ``later_b[i]``: F and B work of one stage's chunks that end at sample i or
    later (that is, hold a sample >= i)."""
    ending = chunks_ending_at(chunks, B)
    later_f = [m.new_int_var(0, H, "") for _ in range(B + 1)]
    later_b = [m.new_int_var(0, H, "") for _ in range(B + 1)]
    m.add(later_f[B] == 0)
    m.add(later_b[B] == 0)
    for i in range(B - 1, -1, -1):
        # work of the chunks ending at sample i or later
        m.add(later_f[i] == later_f[i + 1] + sum(fdur[c] * x[c] for c in ending[i]))
        m.add(later_b[i] == later_b[i + 1] + sum(bdur[c] * y[c] for c in ending[i]))
    return later_f, later_b


def _add_heads(
    m, problem: Problem, heads: Heads, s: int, c, on, bon, fstart, bstart, fdur: int, bdur: int, makespan
) -> None:
    """Redundant release, turnaround and tail constraints of one chunk (see :mod:`umopt.search.bounds.heads`)."""
    lo, hi = c
    b = hi - lo
    if heads.release[s, hi] > 0:
        m.add(fstart >= int(heads.release[s, hi])).only_enforce_if(on)
    if not problem.recompute and heads.turn[s, b] > 0:
        m.add(bstart >= fstart + fdur + int(heads.turn[s, b])).only_enforce_if(on)
    m.add(makespan >= bstart + bdur + int(heads.tail[s, b])).only_enforce_if(bon)
    if problem.tables.allreduce_ms[s] > 0:  # data-parallel replicas: the stage's all-reduce after its ops
        m.add(makespan >= bstart + bdur + _us(problem.tables.allreduce_ms[s])).only_enforce_if(bon)


def _as_bool(m: cp_model.CpModel, expr):
    """A boolean equal to a 0/1 linear expression (a sum of exclusive booleans)."""
    v = m.new_bool_var("")
    m.add(v == expr)
    return v


def _partition(is_set, chunk_vars: dict) -> list[int]:
    """Chunk sizes, in sample order, of the chunks whose boolean ``is_set`` says are used."""
    return [hi - lo for lo, hi in sorted(c for c, v in chunk_vars.items() if is_set(v))]


@entry
def solve_cpsat(
    problem: Problem,
    *,
    time_limit: float = 20.0,
    seed: int = 0,
    progress: Optional[Progress] = None,
    hint: Optional[Candidate] = None,
    order: Optional[ScheduleFamily] = None,
) -> SolverResult:
    """``order`` GPIPE: the GPipe-order model; None (auto): the free-order model (any op order)."""
    return with_clock(
        progress, time_limit, lambda found: _solve_cpsat(problem, time_limit, seed, hint, order, found)
    )


def _solve_cpsat(
    problem: Problem,
    time_limit: float,
    seed: int,
    hint: Optional[Candidate],
    order: Optional[ScheduleFamily],
    found: list,
) -> SolverResult:
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    base, time_limit, warm_scored, skipped = start_or_skip(
        problem, "cpsat", time_limit, seed, hint, order, t0
    )
    if skipped:
        return skipped
    found[0] = base.iteration_ms
    t_model = time.perf_counter()  # building the model counts against the time limit
    opt = problem.tables.optimizer_ms
    base_ms = base.iteration_ms - opt
    n_ops = 2 * problem.num_stages * problem.minibatch
    horizon = _us(base_ms) + n_ops + 1
    if order is GPIPE:
        model, x, y, makespan = build_gpipe_model(problem, horizon, base)
    else:
        model, x, y, fstart, bstart, makespan, _ = build_free_model(problem, horizon, base)
    # on small instances two adjacent stages at a time, solved exactly, lift the bound (pairs.py)
    lb_ms = (
        start_bound_ms(problem, order, time_limit - (time.perf_counter() - t_model), base.iteration_ms, seed)
        - opt
    )
    # the bound, in the model's floored microseconds (one microsecond of slack per op)
    model.add(makespan >= max(0, _us(lb_ms) - n_ops))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit - (time.perf_counter() - t_model))
    solver.parameters.num_workers = max(1, os.cpu_count() or 1)
    solver.parameters.random_seed = seed
    status = stoppable.solve(solver, model)
    S = problem.num_stages
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if order is GPIPE:
            fs = [_partition(solver.boolean_value, x[s]) for s in range(S)]
            bs = [_partition(solver.boolean_value, y[s]) for s in range(S)]
            cand = Candidate(fs, bs, GPIPE.name)
        else:
            cand = Candidate.from_ops(
                [_ops_by_start(solver, x[s], y[s], fstart[s], bstart[s]) for s in range(S)]
            )
    elif status == cp_model.UNKNOWN:  # no time to complete even the warm start: keep it
        cand = base
    else:
        raise UmoptError(
            f"cpsat: the model is {solver.status_name(status)} (no schedule fits the memory limit)"
        )
    cand.iteration_ms = cand.simulate(problem).iteration_ms
    if base.iteration_ms < cand.iteration_ms:  # the relaxed link order can re-score worse than the start
        cand = base
    bound = solver.best_objective_bound / 1000 + opt
    # floored durations can only make the model optimistic, so its bound stays valid; call the
    # float schedule optimal when it is within that rounding of the bound
    proven = status == cp_model.OPTIMAL and cand.iteration_ms <= bound + n_ops / 1000 + 1e-9
    return SolverResult(
        "cpsat",
        cand,
        "optimal" if proven else "feasible",
        lower_bound_ms=min(bound, cand.iteration_ms),
        evaluated=warm_scored,
        bound_scope=(Scope.GPIPE if order is GPIPE else Scope.ANY).value,
        engine_status=solver.status_name(status),
    )


def _ops_by_start(
    solver: cp_model.CpSolver, x: dict, y: dict, fstart: dict, bstart: dict, wstart: Optional[dict] = None
) -> list:
    """One stage's op list in the order the solver timed it (F, B, W on a tie: each needs the one before)."""
    timed = [(solver.value(fstart[c]), 0, Op(OpKind.F, *c)) for c in x if solver.boolean_value(x[c])]
    timed += [(solver.value(bstart[c]), 1, Op(OpKind.B, *c)) for c in y if solver.boolean_value(y[c])]
    timed += [
        (solver.value(wstart[c]), 2, Op(OpKind.W, *c)) for c in (wstart or {}) if solver.boolean_value(y[c])
    ]
    return [op for _, _, op in sorted(timed)]


def gpipe_ops_all(sizes: list[int], num_stages: int) -> list[list[Op]]:
    from ...schedules import gpipe_ops

    return [gpipe_ops(sizes, sizes) for _ in range(num_stages)]


def solve_with_weight_ops(
    problem: Problem, time_limit: float, seed: int = 0
) -> Optional[tuple[list[list[Op]], float, bool]]:
    """The free-order model with a W op per B chunk (zero bubble), on a small instance, within the
    memory limit: (op lists, bound in ms, proven optimal among such schedules), or None if it
    found nothing in ``time_limit``. The op lists are re-scored by the simulator."""
    from ortools.sat.python import cp_model

    from ...schedules import onef1b_schedule, with_weight_ops

    t = problem.tables
    if t.bwd_input is None:
        raise UmoptError("the exact zero-bubble model takes a profile with the B/W split")
    # a schedule the model holds bounds the horizon (the model, whose links need not keep send
    # order, times it no later): GPipe order, 1-sample chunks, each W right after its B; under a
    # memory limit one sample at a time through the whole pipeline, which holds the least
    ones = [1] * problem.minibatch
    S = problem.num_stages
    if problem.memory_limit is None:
        plain = [
            [op for b in st for op in ([b, Op(OpKind.W, b.lo, b.hi)] if b.kind == OpKind.B else [b])]
            for st in gpipe_ops_all(ones, S)
        ]
    else:
        plain = [with_weight_ops(st, 0) for st in onef1b_schedule([ones] * S, [ones] * S, [0] * S)]
    horizon = (
        _us(simulate(t, plain, problem.minibatch, record=False).iteration_ms)
        + 4 * problem.num_stages * problem.minibatch
        + 1
    )
    model, x, y, fstart, bstart, makespan, wstart = build_free_model(problem, horizon, weights=True)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit)
    solver.parameters.num_workers = max(1, os.cpu_count() or 1)
    solver.parameters.random_seed = seed
    status = stoppable.solve(solver, model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    ops = [
        _ops_by_start(solver, x[s], y[s], fstart[s], bstart[s], wstart[s]) for s in range(problem.num_stages)
    ]
    bound = solver.best_objective_bound / 1000 + t.optimizer_ms
    return ops, bound, status == cp_model.OPTIMAL
