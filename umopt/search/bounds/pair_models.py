"""The pair models: two adjacent stages solved exactly by CP-SAT, every other stage as heads and tails.

The stage cuts bound each stage alone, and so let every stage pick the partition that suits
itself. But one stage's partition serves its neighbour too: a last stage that wants one large
chunk (its forward costs as much for 8 samples as for 1) leaves the stage above without a
gradient until that chunk's forward and backward are done. Here stages ``s`` and ``s + 1`` are
one CP-SAT model, with their partitions, op orders, the activations and gradients between them,
and every other stage only through the heads and tails of :mod:`.heads` (when samples can first
reach a stage, how long an F's samples take to come back as gradients, how long the iteration
runs after a B op).

Every constraint holds in every schedule of the cost model, so the model's least makespan is a
lower bound on the iteration, and so is CP-SAT's proven bound on it wherever the time limit stops
the search. The links are relaxed (activation messages arrive in chunk order, each at least its
own transfer after the previous; gradient messages only take their transfer time). Without
recompute only: with it, a stage's B chunks are free and the stage cuts already charge them by
least work. Only chunks that some partition meeting the stage cuts within the model's horizon
holds are variables (:func:`.stage_cuts.usable_chunks`).

Three models: in any op order (:func:`build_pair_model`); within the 1F1B family (both stages run
their B ops in sample order, a last stage each chunk's B right after its F: a chain, which CP-SAT
settles far sooner); and of untied schedules (:func:`build_untied_pair_model`, :mod:`.untied`),
which bound every schedule too. Neither any-order model contains the other, so both run.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from .. import stoppable
from .heads import Heads, heads_and_tails
from .in_order import InOrderHeads, in_order_heads, in_order_usable_chunks, sample_order_bound
from .stage_cuts import stage_bound, usable_chunks
from .untied import UntiedHeads, untied_heads, untied_usable_chunks

__all__ = [
    "PAIR_MAX_CELLS",
    "IN_ORDER_MAX_CELLS",
    "build_pair_model",
    "build_untied_pair_model",
    "pair_bound",
]

# B x max size up to which the any-order pair models search: beyond, CP-SAT proves too little
# of them within a solve's time to be worth the cores
PAIR_MAX_CELLS = 256
# the same for the pairs of the 1F1B family, whose B ops in sample order CP-SAT settles far sooner
IN_ORDER_MAX_CELLS = 1024


def build_pair_model(
    F: np.ndarray,
    G: np.ndarray,
    L: np.ndarray,
    h: Heads,
    minibatch: int,
    s: int,
    lower: int,
    horizon: int,
    io: Optional[InOrderHeads] = None,
):
    """The CP-SAT model of stages ``s`` and ``s + 1``; returns (model, makespan).

    Integer tables as in :func:`.heads.int_tables` (floored microseconds); ``lower`` and
    ``horizon`` bound the makespan (a known bound, a known schedule's makespan). With ``io``
    (:func:`.in_order.in_order_heads`), the model of the 1F1B family instead: both stages run
    their B ops in sample order, and a last stage runs each chunk's B right after its F."""
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    from ortools.sat.python import cp_model  # imported where used: it pulls in pandas

    B, S = minibatch, F.shape[0]
    m = cp_model.CpModel()
    H = horizon
    # each stage's partition meets the stage cuts within the horizon, so only the chunks of such
    # partitions can be used (near the stage cuts that leaves a fifth of the bottleneck's chunks)
    if io is None:
        usable = [usable_chunks(H, h, F, G, r, B) for r in (s, s + 1)]
    else:
        usable = [in_order_usable_chunks(H, h, io, F, G, r, B) for r in (s, s + 1)]
    chunks = [[(int(lo), int(lo + b)) for lo, b in zip(*np.nonzero(u))] for u in usable]

    # --- variables ---------------------------------------------------------------------------
    makespan = m.new_int_var(lower, H, "makespan")
    # per stage: x (chunk used), F and B start/end of each chunk
    x = [{c: m.new_bool_var(f"x{r}_{c[0]}_{c[1]}") for c in chunks[k]} for k, r in enumerate((s, s + 1))]
    fs = [
        {c: m.new_int_var(int(h.release[r, c[1]]), H, f"fs{r}_{c[0]}_{c[1]}") for c in chunks[k]}
        for k, r in enumerate((s, s + 1))
    ]
    fe = [{c: m.new_int_var(0, H, "") for c in chunks[k]} for k in (0, 1)]
    bs = [{c: m.new_int_var(0, H, "") for c in chunks[k]} for k in (0, 1)]
    be = [{c: m.new_int_var(0, H, "") for c in chunks[k]} for k in (0, 1)]
    fdone = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in (s, s + 1)]  # end of the F holding sample i
    bdone = (
        [[m.new_int_var(0, H, "") for _ in range(B)] for _ in (s, s + 1)] if io is not None else []
    )  # of the B (in order)
    arrive = [m.new_int_var(0, H, "") for _ in range(B)]  # activations of sample i on s + 1
    grad = [m.new_int_var(0, H, "") for _ in range(B)]  # gradients of sample i back on s

    # --- constraints: each stage -------------------------------------------------------------
    for k, r in enumerate((s, s + 1)):
        for i in range(B):  # a partition: every sample in one chunk (none usable: no schedule)
            m.add_exactly_one(x[k][c] for c in chunks[k] if c[0] <= i < c[1])
        # on the last stage, with B ops in sample order, F(k) B(k) F(k+1) B(k+1)... ends every B
        # no later than any other order (its F ops only feed its own B ops), so only that one
        chain = io is not None and r == S - 1
        intervals = []
        for c in chunks[k]:
            lo, hi = c
            b, on = hi - lo, x[k][c]
            # fixed-size intervals and the ends apart: CP-SAT proves "no schedule within T" up to
            # faster than with interval variables that hold the ends
            m.add(fe[k][c] == fs[k][c] + int(F[r, b])).only_enforce_if(on)
            m.add(be[k][c] == bs[k][c] + int(G[r, b])).only_enforce_if(on)
            if not chain:
                intervals.append(m.new_optional_fixed_size_interval_var(fs[k][c], int(F[r, b]), on, ""))
                intervals.append(m.new_optional_fixed_size_interval_var(bs[k][c], int(G[r, b]), on, ""))
            m.add(fdone[k][hi - 1] == fe[k][c]).only_enforce_if(on)
            if lo > 0:  # forwards in sample order
                m.add(fs[k][c] >= fdone[k][lo - 1]).only_enforce_if(on)
            # the chunk's samples go down the stages below (or back from those below s + 1)
            m.add(bs[k][c] >= fe[k][c] + int(h.turn[r, b])).only_enforce_if(on)
            after = int(h.tail[r, b]) if io is None else max(int(h.tail[r, b]), int(io.drain[r, b, B - hi]))
            m.add(makespan >= be[k][c] + after).only_enforce_if(on)
            if io is not None:
                m.add(bdone[k][hi - 1] == be[k][c]).only_enforce_if(on)
                if lo > 0:  # backwards in sample order (and, on a chain, the next F after them)
                    m.add(bs[k][c] >= bdone[k][lo - 1]).only_enforce_if(on)
                    if chain:
                        m.add(fs[k][c] >= bdone[k][lo - 1]).only_enforce_if(on)
                if chain:
                    m.add(bs[k][c] == fe[k][c]).only_enforce_if(on)
                m.add(bs[k][c] >= int(io.grad_release[r, hi])).only_enforce_if(on)
        if intervals:
            m.add_no_overlap(intervals)

    # --- constraints: the link between them ----------------------------------------------------
    for i in range(1, B):  # activation messages arrive in chunk order
        m.add(arrive[i] >= arrive[i - 1])
        if io is not None:  # and gradient messages, B ops being in sample order
            m.add(grad[i] >= grad[i - 1])
    for lo, hi in chunks[0]:  # sent by s
        up, link = x[0][lo, hi], int(L[s, hi - lo])
        m.add(arrive[lo] >= fe[0][lo, hi] + link).only_enforce_if(up)
        if lo > 0:  # one message at a time
            m.add(arrive[lo] >= arrive[lo - 1] + link).only_enforce_if(up)
        for i in range(hi - 1 if io is not None else lo, hi):  # in sample order grad[i] rises with i
            m.add(bs[0][lo, hi] >= grad[i]).only_enforce_if(up)
    for lo, hi in chunks[1]:  # received by s + 1
        down, link = x[1][lo, hi], int(L[s, hi - lo])
        m.add(fs[1][lo, hi] >= arrive[hi - 1]).only_enforce_if(down)
        for i in range(lo, lo + 1 if io is not None else hi):
            m.add(grad[i] >= be[1][lo, hi] + link).only_enforce_if(down)

    # --- objective -----------------------------------------------------------------------------
    m.minimize(makespan)
    return m, makespan


def build_untied_pair_model(
    F: np.ndarray,
    G: np.ndarray,
    L: np.ndarray,
    h: Heads,
    minibatch: int,
    s: int,
    lower: int,
    horizon: int,
    ut: UntiedHeads,
):
    """The pair model of *untied* schedules (:mod:`.untied`): each
    stage has an F partition and a B partition, both run in sample order, with the same chunk
    sizes; a B chunk waits for the F of its samples and their gradients. Every schedule, in any
    order, turns into one of these no later, so the model's least makespan bounds them all.
    Returns (model, makespan)."""
    # one piece: [Note: one function per model] (umopt/search/solvers/cpsat.py)
    from ortools.sat.python import cp_model

    B, S = minibatch, F.shape[0]
    mx = F.shape[1] - 1
    m = cp_model.CpModel()
    H = horizon
    # the F partition is the schedule's own, so the stage cuts hold for it; both partitions are
    # a run of the one-stage program of .untied.untied_bound within the horizon
    fchunks, bchunks = [], []
    for r in (s, s + 1):
        f_use, b_use = untied_usable_chunks(H, h, ut, F, G, r, B)
        f_use = f_use & usable_chunks(H, h, F, G, r, B)
        b_use &= f_use.any(axis=0)[None, :]  # the sizes are the F chunks'
        fchunks.append([(int(lo), int(lo + b)) for lo, b in zip(*np.nonzero(f_use))])
        bchunks.append([(int(lo), int(lo + b)) for lo, b in zip(*np.nonzero(b_use))])

    # --- variables ---------------------------------------------------------------------------
    makespan = m.new_int_var(lower, H, "makespan")
    xf = [{c: m.new_bool_var(f"xf{r}_{c[0]}_{c[1]}") for c in fchunks[k]} for k, r in enumerate((s, s + 1))]
    xb = [{c: m.new_bool_var(f"xb{r}_{c[0]}_{c[1]}") for c in bchunks[k]} for k, r in enumerate((s, s + 1))]
    fs = [
        {c: m.new_int_var(int(h.release[r, c[1]]), H, f"fs{r}_{c[0]}_{c[1]}") for c in fchunks[k]}
        for k, r in enumerate((s, s + 1))
    ]
    bs = [{c: m.new_int_var(0, H, "") for c in bchunks[k]} for k in (0, 1)]
    fdone = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in (0, 1)]  # F of sample i ended
    bdone = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in (0, 1)]  # B of sample i ended
    back = [m.new_int_var(0, H, "") for _ in range(B)]  # gradient of sample i back on s + 1 (from below)
    arrive = [m.new_int_var(0, H, "") for _ in range(B)]  # activations of sample i on s + 1
    grad = [m.new_int_var(0, H, "") for _ in range(B)]  # gradients of sample i back on s

    # --- constraints: each stage -------------------------------------------------------------
    for k, r in enumerate((s, s + 1)):
        for i in range(B):
            m.add_exactly_one(xf[k][c] for c in fchunks[k] if c[0] <= i < c[1])
            m.add_exactly_one(xb[k][c] for c in bchunks[k] if c[0] <= i < c[1])
            if i:  # both kinds in sample order
                m.add(fdone[k][i] >= fdone[k][i - 1])
                m.add(bdone[k][i] >= bdone[k][i - 1])
                if k == 1:
                    m.add(back[i] >= back[i - 1])
        for b in range(1, mx + 1):  # the B sizes are a permutation of the F sizes
            m.add(
                sum(v for c, v in xf[k].items() if c[1] - c[0] == b)
                == sum(v for c, v in xb[k].items() if c[1] - c[0] == b)
            )
        intervals = []
        for (lo, hi), on in xf[k].items():
            b = hi - lo
            intervals.append(m.new_optional_fixed_size_interval_var(fs[k][lo, hi], int(F[r, b]), on, ""))
            m.add(fdone[k][lo] >= fs[k][lo, hi] + int(F[r, b])).only_enforce_if(on)
            if lo > 0:
                m.add(fs[k][lo, hi] >= fdone[k][lo - 1]).only_enforce_if(on)
            if k == 1 and r < S - 1:  # its samples go down and come back, the last one last
                m.add(back[hi - 1] >= fs[k][lo, hi] + int(F[r, b]) + int(ut.turn_last[r, b])).only_enforce_if(
                    on
                )
        for (lo, hi), on in xb[k].items():
            b = hi - lo
            start, end = bs[k][lo, hi], bs[k][lo, hi] + int(G[r, b])
            intervals.append(m.new_optional_fixed_size_interval_var(start, int(G[r, b]), on, ""))
            m.add(bdone[k][hi - 1] >= end).only_enforce_if(on)
            if lo > 0:
                m.add(start >= bdone[k][lo - 1]).only_enforce_if(on)
            m.add(start >= fdone[k][hi - 1]).only_enforce_if(on)
            m.add(start >= int(ut.grad_release[r, hi])).only_enforce_if(on)
            if k == 1 and r < S - 1:
                m.add(start >= back[hi - 1]).only_enforce_if(on)
            m.add(makespan >= end + max(int(h.tail[r, b]), int(ut.drain[r, b, B - hi]))).only_enforce_if(on)
        m.add_no_overlap(intervals)

    # --- constraints: the link between them ----------------------------------------------------
    for i in range(1, B):  # messages arrive in sample order both ways
        m.add(arrive[i] >= arrive[i - 1])
        m.add(grad[i] >= grad[i - 1])
    for (lo, hi), on in xf[0].items():
        link = int(L[s, hi - lo])
        m.add(arrive[lo] >= fs[0][lo, hi] + int(F[s, hi - lo]) + link).only_enforce_if(on)
        if lo > 0:  # one message at a time
            m.add(arrive[lo] >= arrive[lo - 1] + link).only_enforce_if(on)
    for (lo, hi), on in xf[1].items():
        m.add(fs[1][lo, hi] >= arrive[hi - 1]).only_enforce_if(on)
    for (lo, hi), on in xb[1].items():
        m.add(grad[lo] >= bs[1][lo, hi] + int(G[s + 1, hi - lo]) + int(L[s, hi - lo])).only_enforce_if(on)
    for (lo, hi), on in xb[0].items():
        m.add(bs[0][lo, hi] >= grad[hi - 1]).only_enforce_if(on)

    # --- objective -----------------------------------------------------------------------------
    m.minimize(makespan)
    return m, makespan


def _models_and_order(
    F: np.ndarray, G: np.ndarray, L: np.ndarray, h: Heads, io: Optional[InOrderHeads], B: int, best: int
) -> tuple[list, list[int]]:
    """Each pair's models (the in-order one with ``io``, else the untied one and, below
    PAIR_MAX_CELLS, the one in any op order), and the pairs likeliest to bind first."""
    S = F.shape[0]
    # the pair most likely to bind first: the one whose tighter stage has the fewest usable
    # chunks 1% above the bound (then the other stage's); it gets 3/4 of every round's time.
    # In any order each pair has two models, the untied one (untied.py) and the one in any op
    # order; neither bound contains the other (each is higher on some instances), so both run and
    # the better one counts.
    near = best + best // 100
    # (past PAIR_MAX_CELLS the free-order model proves nothing in a minute: the untied one alone)
    models = (
        [io]
        if io is not None
        else [untied_heads(F, G, L, h, B)] + ([None] if B * (F.shape[1] - 1) <= PAIR_MAX_CELLS else [])
    )
    if io is not None:
        usable = [int(in_order_usable_chunks(near, h, io, F, G, r, B).sum()) for r in range(S)]
    else:  # the untied model's (its F and B chunks)
        usable = [
            sum(int(u.sum()) for u in untied_usable_chunks(near, h, models[0], F, G, r, B)) for r in range(S)
        ]
    return models, sorted(range(S - 1), key=lambda s: sorted(usable[s : s + 2]))


def pair_bound(
    F: np.ndarray,
    G: np.ndarray,
    L: np.ndarray,
    minibatch: int,
    time_limit: float,
    upper: "int | Callable[[], Optional[int]] | None" = None,
    seed: int = 0,
    report: Optional[Callable[[int], None]] = None,
    max_cells: Optional[int] = PAIR_MAX_CELLS,
    in_order: bool = False,
    known: Optional[int] = None,
    workers: Optional[int] = None,
) -> int:
    """The best of the stage cuts and every pair's bound, in the tables' units; with
    ``in_order``, of :func:`.in_order.sample_order_bound` and every pair's in the 1F1B family
    (a bound on the schedules whose stages all run their B ops in sample order).

    Rounds over the pairs not yet settled, until the time is up or every pair is settled: the
    pair likeliest to bind (its stages have the fewest usable chunks near the bound) gets 3/4 of
    each round, the others equal shares of the rest.
    ``upper``: a known schedule's makespan in the same units, which narrows the models; or a
    function giving the best one known so far (None: none yet), asked every round (``auto``:
    the GA's, as it improves);
    ``report(bound)`` is called after each CP-SAT call and each pair's turn (for a progress bar,
    and for ``auto`` to stop once its schedule meets the bound); past ``max_cells``
    (B x max size; None: no limit) the stage cuts alone. ``known``: those bounds, where the
    caller has them (they take seconds on large instances). ``workers``: CP-SAT's (None: one
    per core)."""
    B, S = minibatch, F.shape[0]
    h = heads_and_tails(F, G, L, B)
    if known is None:
        known = stage_bound(F, G, L, B, recompute=False)
        if in_order:
            known = max(known, sample_order_bound(F, G, L, B))
    best = known
    io = in_order_heads(F, G, L, h, B) if in_order else None
    if S < 2 or (max_cells is not None and B * (F.shape[1] - 1) > max_cells):
        return best
    # a schedule of every pair: one sample per chunk, all F ops of both stages, then all B ops,
    # one op and one message at a time (a horizon too low would only make the bound higher: the
    # model's "no schedule within it" is proven, so it holds)
    safe = int(
        h.release.max()
        + 2 * B * ((F[:, 1] + G[:, 1]).max() + L[:, 1].max())
        + 2 * h.turn.max()
        + h.tail.max()
    )
    upper_now = upper if callable(upper) else (lambda: upper)  # noqa: E731

    def tightened(horizon: int) -> int:
        u = upper_now()
        return min(horizon, u + 2 * S * B) if u is not None else horizon  # floored op durations

    horizon = tightened(safe)
    deadline = time.perf_counter() + time_limit
    models, order = _models_and_order(F, G, L, h, io, B, best)
    # per (pair, model): no schedule of it below lo; one within hi; the next probe's step (None:
    # not searched yet)
    state = {(s, k): (best, None, None) for s in order for k in range(len(models))}
    while time.perf_counter() < deadline:
        # a better schedule found meanwhile is a schedule of every pair's model
        horizon = tightened(horizon)
        state = {
            key: (lo, hi if hi is None else min(hi, horizon), step) for key, (lo, hi, step) in state.items()
        }
        open_ = [key for key, (lo, hi, _) in state.items() if hi is None or max(lo, best) < hi]
        if not open_:
            break
        lead = [key for key in open_ if key[0] == open_[0][0]]
        rest = len(open_) - len(lead)
        weight = {
            key: (3 / (4 * len(lead)) if key in lead else 1 / (4 * rest)) if rest else 1.0 for key in open_
        }
        for i, (s, k) in enumerate(open_):
            left = deadline - time.perf_counter()
            share = left * weight[s, k] / sum(weight[key] for key in open_[i:])
            tick = (lambda lo: report(max(best, lo))) if report else None  # noqa: E731
            lo, hi, step = _narrow(
                F,
                G,
                L,
                h,
                models[k],
                B,
                s,
                max(best, state[s, k][0]),
                *state[s, k][1:],
                horizon,
                share,
                seed,
                tick,
                workers,
            )
            state[s, k], best = (lo, hi, step), max(best, lo)
            if report:  # (the ticks inside report the bound before each probe, this the one after)
                report(best)
    return best


def _narrow(
    F,
    G,
    L,
    h: Heads,
    extra: "InOrderHeads | UntiedHeads | None",
    B: int,
    s: int,
    lo: int,
    hi: Optional[int],
    step: Optional[int],
    horizon: int,
    budget: float,
    seed: int,
    tick: Optional[Callable[[int], None]],
    workers: Optional[int] = None,
):
    """Narrow ``[lo, hi]``, where the least makespan of pair ``s``'s model lies, within ``budget``
    seconds; ``hi`` and ``step`` None on the first call. Returns the new (lo, hi, step).

    Minimising proves small instances (S=4, B=8) in under a second. Where it does not, its bound
    stays where it started, so then it asks "is there a schedule within T?" for T in growing steps
    above what is proven: far below the optimum CP-SAT answers "none" in a fraction of a second
    A step that has a schedule halves the interval;
    one that it cannot settle in a third of the time left is retried a quarter as far; what time is
    left after that minimises again, between what is proven and what was found."""
    from ortools.sat.python import cp_model

    deadline = time.perf_counter() + budget

    def solve(T: int, seconds: float, objective: bool):
        if seconds <= 0:
            return None, cp_model.UNKNOWN
        if isinstance(extra, UntiedHeads):
            model, _ = build_untied_pair_model(F, G, L, h, B, s, lo, T, extra)
        else:
            model, _ = build_pair_model(F, G, L, h, B, s, lo, T, extra)
        if not objective:
            model.clear_objective()
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = seconds
        solver.parameters.num_workers = workers or max(1, os.cpu_count() or 1)
        solver.parameters.random_seed = seed
        status = stoppable.solve(solver, model)
        if tick:
            tick(lo)
        return solver, status

    def minimise(T: int, seconds: float):
        nonlocal lo, hi
        solver, status = solve(T, seconds, True)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            hi = min(hi, int(solver.objective_value))
        if status == cp_model.INFEASIBLE:
            lo = max(lo, T + 1)
        elif solver is not None:
            lo = max(lo, int(solver.best_objective_bound))

    small = B * (F.shape[1] - 1) <= PAIR_MAX_CELLS  # beyond, minimising proves nothing in its time
    if hi is None:
        hi = horizon
        if small:
            minimise(horizon, budget / 4)
    # a new round with more time probes again, from where the last one stopped (but not in
    # steps so small that the final minimisation would be the better use of the time)
    step = max(1, lo // 100) if step is None else max(step, lo // 1000)
    while lo < hi and step >= max(1, lo // 5000) and time.perf_counter() < deadline:
        T = min(hi - 1, lo + step)
        _, status = solve(T, (deadline - time.perf_counter()) / 3, False)
        if status == cp_model.INFEASIBLE:
            lo, step = T + 1, 2 * step
        elif status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            hi = T
            if small:  # within so tight a horizon minimising often proves the optimum at once
                # on small pairs; on large ones it proves nothing and bisecting gets further
                minimise(T, (deadline - time.perf_counter()) / 2)
            step = (hi - lo) // 2
        else:  # near the optimum either answer is slow to prove: step back towards lo
            step //= 4
    if lo < hi:
        minimise(hi, deadline - time.perf_counter())
    return lo, hi, step
