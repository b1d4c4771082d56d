"""The exact CP-SAT model of a pipeline with several chunks per rank, on small instances.

For one cut and placement (a :class:`umopt.costmodel.Chunking`), the model chooses every
virtual stage's partitions and every rank's op order: each op is an optional interval on its
rank's no-overlap resource, so interleaved 1F1B, ZB-V, DualPipeV, the list-scheduled orders of
:mod:`umopt.search.solvers.multichunk` and every other order are in its search space. Its optimum is
therefore a lower bound on every schedule of that cut and placement, and where it proves
optimality it tells how far the search and torch's orders are from the best schedule there is.
The model is as :func:`umopt.search.solvers.cpsat.build_free_model`, with these changes:

* ops of all the virtual stages on a rank share the rank's no-overlap resource and memory
  reservoir (the rank holds every chunk's static bytes);
* a hand-off between virtual stages on one rank is free and immediate; other messages are
  intervals on the no-overlap resource of their ordered rank pair, which the boundaries sharing
  that pair share. Activation messages of one boundary keep sample order (as they do in the
  simulator); other messages need not keep send order, which can only make the model optimistic;
* with ``weights`` every virtual stage splits its backward: each B chunk has a W op of its own,
  anywhere after it, which frees what its samples hold. A W over several B chunks costs their
  weight gradients and one per-op cost, so the model's W lasts its weight gradient *less* the
  per-op cost: the bound holds for schedules grouping W ops in any way.

Durations are floored to microseconds, so the model's optimum is never above the true one; the
schedule it finds is re-scored by the reference simulator.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ...costmodel import ChunkOp, CostTables, OpKind, simulate
from ...errors import UmoptError
from .. import stoppable
from ..bounds.ranks import rank_ends
from .cpsat import _as_bool, memory_events

__all__ = ["ExactChunks", "build_chunk_model", "solve_chunks_exact", "chunk_model_size", "MAX_CHUNK_MODEL"]

# beyond this many (virtual stage, chunk, sample) terms the model finds nothing the search has not
# (8 ranks x 2 chunks at B=16 is 13,056)
MAX_CHUNK_MODEL = 20_000


@dataclass
class ExactChunks:
    ops: list[list[ChunkOp]]
    iteration_ms: float  # the simulator's time of ``ops``
    lower_bound_ms: float  # holds for every schedule of this cut and placement (and W use)
    optimal: bool
    weights: bool = False  # the model's W use: every virtual stage split (True) or none
    tables: Optional[CostTables] = None  # the cut and placement it holds for


def _us(ms: float) -> int:
    return int(math.floor(ms * 1000 + 1e-9))


def _chunks(minibatch: int, max_size: int) -> list[tuple[int, int]]:
    return [(lo, hi) for lo in range(minibatch) for hi in range(lo + 1, min(minibatch, lo + max_size) + 1)]


def chunk_model_size(num_virtual: int, minibatch: int, max_size: int) -> int:
    """The model's size: virtual stages x chunks x their samples (the arrival constraints)."""
    return num_virtual * sum(hi - lo for lo, hi in _chunks(minibatch, min(max_size, minibatch)))


def build_chunk_model(
    tables: CostTables,
    minibatch: int,
    horizon_us: int,
    weights: bool = False,
    hint: Optional[Sequence[Sequence[ChunkOp]]] = None,
):
    """The model; returns (model, x, y, start, makespan) with ``x[j][c]`` (F partition of virtual
    stage j uses chunk c), ``y[j][c]`` (its B partition; ``x`` without recompute) and
    ``start[kind][j][c]`` for kind in F, B, W."""
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    from ortools.sat.python import cp_model  # imported where used: it pulls in pandas

    t = tables
    V, R, B = t.num_stages, t.num_ranks, minibatch
    chunks = _chunks(B, min(t.max_size, B))
    H = horizon_us
    m = cp_model.CpModel()
    local = [t.rank_of(j) == t.rank_of(j + 1) for j in range(V - 1)]
    up, down = rank_ends(t, B)

    # --- variables ---------------------------------------------------------------------------
    x = [{c: m.new_bool_var(f"x{j}_{c[0]}_{c[1]}") for c in chunks} for j in range(V)]
    y = (
        x
        if not t.recompute
        else [{c: m.new_bool_var(f"y{j}_{c[0]}_{c[1]}") for c in chunks} for j in range(V)]
    )
    bwd = t.bwd_input if weights else t.bwd
    dur = {
        OpKind.F: [{c: _us(t.fwd[j, c[1] - c[0]]) for c in chunks} for j in range(V)],
        OpKind.B: [{c: _us(bwd[j, c[1] - c[0]]) for c in chunks} for j in range(V)],
    }
    if weights:
        dur[OpKind.W] = [
            {c: max(0, _us(t.bwd_weight[j, c[1] - c[0]] - t.op_overhead[j])) for c in chunks}
            for j in range(V)
        ]
    start = {k: [{c: m.new_int_var(0, H, "") for c in chunks} for _ in range(V)] for k in dur}
    used = {OpKind.F: x, OpKind.B: y, OpKind.W: y}
    interval = {
        k: [
            {
                c: m.new_optional_fixed_size_interval_var(start[k][j][c], dur[k][j][c], used[k][j][c], "")
                for c in chunks
            }
            for j in range(V)
        ]
        for k in dur
    }
    # messages: activations of F chunks over boundary j (to j+1), gradients of B chunks (to j-1)
    msg = {"act": [], "grad": []}
    for j in range(V):
        act = {} if j + 1 == V or local[j] else {c: m.new_int_var(0, H, "") for c in chunks}
        grad = {} if j == 0 or local[j - 1] else {c: m.new_int_var(0, H, "") for c in chunks}
        msg["act"].append(act)
        msg["grad"].append(grad)
    fend = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in range(V)]  # F chunk ending at i
    fdone = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in range(V)]  # F of sample i
    amsg = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in range(V)]  # message of chunk ending at i
    arrive = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in range(V)]  # activation of i at j+1
    garrive = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in range(V)]  # gradient of i at j-1
    makespan = m.new_int_var(0, H, "makespan")

    # --- constraints ---------------------------------------------------------------------------
    on_rank = [[] for _ in range(R)]
    channels: dict[tuple[int, int], list] = {}
    for j in range(V):
        r = t.rank_of(j)
        on_rank[r] += [iv for k in interval for iv in interval[k][j].values()]
        for part in (x[j], y[j]) if t.recompute else (x[j],):
            for i in range(B):  # every sample in exactly one chunk
                m.add_exactly_one(part[c] for c in chunks if c[0] <= i < c[1])
        ends = [_as_bool(m, sum(x[j][c] for c in chunks if c[1] - 1 == i)) for i in range(B)]
        for c in chunks:
            lo, hi = c
            b = hi - lo
            on, bon = x[j][c], y[j][c]
            f0, b0 = start[OpKind.F][j][c], start[OpKind.B][j][c]
            # forward: in sample order, after its inputs (and, redundant, one sample's way up)
            if j > 0:
                m.add(f0 >= max(0, _us(float(up[j])) - 2 * V)).only_enforce_if(on)
            if lo > 0:
                m.add(f0 >= fend[j][lo - 1]).only_enforce_if(on)
            if j > 0:
                m.add(f0 >= arrive[j - 1][hi - 1]).only_enforce_if(on)
            m.add(fend[j][hi - 1] >= f0 + dur[OpKind.F][j][c]).only_enforce_if(on)
            # backward: after the F of its samples here, after their gradients from above
            m.add(b0 >= fdone[j][hi - 1]).only_enforce_if(bon)
            if j + 1 < V:
                for i in range(lo, hi):
                    m.add(b0 >= garrive[j + 1][i]).only_enforce_if(bon)
            b_end = b0 + dur[OpKind.B][j][c]
            if j > 0:
                if local[j - 1]:
                    for i in range(lo, hi):
                        m.add(garrive[j][i] >= b_end).only_enforce_if(bon)
                else:
                    g = msg["grad"][j][c]
                    link = _us(t.link[j - 1, b])
                    m.add(g >= b_end).only_enforce_if(bon)
                    ch = t.channel(j - 1, "bwd")
                    channels.setdefault(ch, []).append(
                        m.new_optional_fixed_size_interval_var(g, link, bon, "")
                    )
                    for i in range(lo, hi):
                        m.add(garrive[j][i] >= g + link).only_enforce_if(bon)
            ar = _us(t.allreduce_ms[r])
            if weights:  # the chunk's W after its B; the rank's all-reduce after its last op
                w0 = start[OpKind.W][j][c]
                m.add(w0 >= b_end).only_enforce_if(bon)
                m.add(makespan >= w0 + dur[OpKind.W][j][c] + ar).only_enforce_if(bon)
            m.add(makespan >= b_end + max(ar, _us(float(down[j])) - 2 * V)).only_enforce_if(bon)
            # activation messages of the boundary: one at a time, in F order (= sample order)
            if j + 1 < V and not local[j]:
                a = msg["act"][j][c]
                link = _us(t.link[j, b])
                m.add(a >= fend[j][hi - 1]).only_enforce_if(on)
                if lo > 0:
                    m.add(a >= amsg[j][lo - 1]).only_enforce_if(on)
                m.add(amsg[j][hi - 1] >= a + link).only_enforce_if(on)
                ch = t.channel(j, "fwd")
                channels.setdefault(ch, []).append(m.new_optional_fixed_size_interval_var(a, link, on, ""))
        for i in range(B):  # F of sample i ends with the chunk holding it (the next chunk end)
            m.add(fdone[j][i] >= fend[j][i]).only_enforce_if(ends[i])
            if i + 1 < B:
                m.add(fdone[j][i] >= fdone[j][i + 1]).only_enforce_if(ends[i].Not())
            if j + 1 < V:
                m.add(arrive[j][i] >= (fdone[j][i] if local[j] else amsg[j][i])).only_enforce_if(ends[i])
                if i + 1 < B:
                    m.add(arrive[j][i] >= arrive[j][i + 1]).only_enforce_if(ends[i].Not())
    for r in range(R):
        m.add_no_overlap(on_rank[r])
    # redundant: a rank's first op after one sample's way up to it, then all its work, then (no
    # W ops) the way down from its last B (umopt.search.bounds.ranks); one microsecond per term floored
    for r in range(R):
        mine = [j for j in range(V) if t.rank_of(j) == r]
        j0 = min(mine)
        work = sum(dur[k][j][c] * used[k][j][c] for k in dur for j in mine for c in chunks)
        tail = 0.0 if weights else float(down[j0])
        m.add(makespan >= work + max(0, _us(float(up[j0]) + tail) - 2 * V))
    for ivs in channels.values():
        m.add_no_overlap(ivs)
    if t.memory_limit is not None:
        for r in range(R):
            mine = [j for j in range(V) if t.rank_of(j) == r]
            room = int(t.memory_limit - sum(int(t.static_bytes[j]) for j in mine))
            if room < 0:
                raise UmoptError(f"rank {r}'s chunks alone need more than the memory limit")
            times, changes, actives = [], [], []
            for j in mine:
                wend = {c: start[OpKind.W][j][c] + dur[OpKind.W][j][c] for c in chunks} if weights else None
                ev = memory_events(
                    t,
                    j,
                    chunks,
                    x[j],
                    y[j],
                    start[OpKind.F][j],
                    start[OpKind.B][j],
                    dur[OpKind.F][j],
                    dur[OpKind.B][j],
                    wend,
                )
                for acc, part in zip((times, changes, actives), ev):
                    acc += part
            m.add_reservoir_constraint_with_active(times, changes, actives, 0, room)

    # --- objective -----------------------------------------------------------------------------
    m.minimize(makespan)

    if hint is not None:
        _add_hint(m, tables, minibatch, hint, chunks, x, y, start)
    return m, x, y, start, makespan


def _add_hint(m, tables: CostTables, minibatch: int, ops, chunks, x, y, start) -> None:
    """The hint's partitions and its F and B start times as the simulator plays them."""
    tl = simulate(tables, ops, minibatch)
    for j in range(tables.num_stages):
        spans = [sp for row in tl.spans for sp in row if sp.chunk == j]
        when = {(sp.kind, sp.lo, sp.hi): _us(sp.start) for sp in spans}
        for c in chunks:
            m.add_hint(x[j][c], (OpKind.F, *c) in when)
            if tables.recompute:
                m.add_hint(y[j][c], (OpKind.B, *c) in when)
            for k in (OpKind.F, OpKind.B):
                if (k, *c) in when:
                    m.add_hint(start[k][j][c], when[(k, *c)])


def solve_chunks_exact(
    tables: CostTables,
    minibatch: int,
    *,
    time_limit: float,
    weights: bool = False,
    hint: Optional[Sequence[Sequence[ChunkOp]]] = None,
    seed: int = 0,
) -> Optional[ExactChunks]:
    """The best schedule of this cut and placement CP-SAT finds within ``time_limit`` and its
    lower bound; None if it found none. With ``hint`` (a valid schedule of these tables) the
    result is never slower than the hint."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    V, B = tables.num_stages, minibatch
    if weights and tables.bwd_input is None:
        raise UmoptError("the exact model with W ops takes a profile with the B/W split")
    n_ops = (3 if weights else 2) * V * B
    if hint is not None:
        hint_ms = simulate(tables, hint, B, record=False).iteration_ms
    else:  # one sample at a time through the whole pipeline bounds the horizon
        hint_ms = B * float(tables.fwd[:, 1].sum() + tables.bwd[:, 1].sum() + 2 * tables.link[:, 1].sum())
        hint_ms += tables.optimizer_ms + float(max(tables.allreduce_ms))
    horizon = _us(hint_ms - tables.optimizer_ms) + n_ops + 1
    model, x, y, start, makespan = build_chunk_model(tables, B, horizon, weights, hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit - (time.perf_counter() - t0))
    # a portfolio of 8 even on 2 cores: the workers that lift the bound (LP) are not among the first 2
    solver.parameters.num_workers = max(8, os.cpu_count() or 1)
    solver.parameters.random_seed = seed
    status = stoppable.solve(solver, model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise UmoptError("no schedule of this cut and placement fits the memory limit")
        return None
    ops = _ops_by_start(solver, tables, x, y, start)
    ms = simulate(tables, ops, B, record=False).iteration_ms
    if hint is not None and hint_ms < ms:  # the relaxed message order can re-score worse
        ops, ms = [list(r) for r in hint], hint_ms
    bound = solver.best_objective_bound / 1000 + tables.optimizer_ms
    # floored durations make the model optimistic, so the bound stays valid; call the float
    # schedule optimal when it is within that rounding of the bound
    optimal = status == cp_model.OPTIMAL and ms <= bound + n_ops / 1000 + 1e-9
    return ExactChunks(ops, ms, min(bound, ms), optimal, weights, tables)


def _ops_by_start(solver, tables: CostTables, x, y, start) -> list[list[ChunkOp]]:
    """Each rank's ops in the order the solver timed them (F, B, W on a tie)."""
    timed: list[list] = [[] for _ in range(tables.num_ranks)]
    rank = {OpKind.F: 0, OpKind.B: 1, OpKind.W: 2}
    for kind, per_stage in start.items():
        use = x if kind == OpKind.F else y
        for j, starts in enumerate(per_stage):
            for c, v in starts.items():
                if solver.boolean_value(use[j][c]):
                    timed[tables.rank_of(j)].append(
                        (solver.value(v), rank[kind], j, ChunkOp(kind, c[0], c[1], j))
                    )
    return [[op for *_, op in sorted(row)] for row in timed]
