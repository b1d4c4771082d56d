"""The pair bound: two adjacent stages solved exactly by CP-SAT, every other stage as heads and tails.

The stage cuts of :mod:`.bounds` bound each stage alone, and so let every stage pick the
partition that suits itself. But one stage's partition serves its neighbour too: the last stage
of vgg16-cpu wants one large chunk (its forward costs as much for 8 samples as for 1), and then
the stage above gets no gradient until that chunk's forward and backward are done, and must run
its whole backward work after that. Here stages ``s`` and ``s + 1`` are one CP-SAT model, with
their partitions, op orders, the activations and gradients between them, and every other stage
only through the heads and tails of :mod:`.bounds` (when samples can first reach a stage, how long
an F's samples take to come back as gradients, how long the iteration runs after a B op).

Every constraint holds in every schedule of the cost model, in any op order, so the model's least
makespan is a lower bound on the iteration, and so is CP-SAT's proven bound on it wherever the time
limit stops the search. The links are relaxed (activation messages arrive in chunk order, each
at least its own transfer after the previous; gradient messages only take their transfer time).
Without recompute only: with it, a stage's B chunks are free and the stage cuts already charge them
by least work.

Only chunks that some partition meeting the stage cuts within the model's horizon holds are
variables (:func:`.bounds.usable_chunks`): near the stage cuts that is a fifth of the bottleneck's.

vgg16-cpu, S=4, B=8: the stage cuts give 139.0 ms, this bound 154.6, the optimum is 158.0.
It is exact search, so it only runs where CP-SAT gets somewhere in seconds (``PAIR_MAX_CELLS``).

The same model within the 1F1B family (both stages run their B ops in sample order; a last
stage then runs each chunk's B right after its F, a chain) bounds the schedules of that family,
the GA's. CP-SAT settles it far sooner: vgg16-cpu, B=16 in 2 s (210.0 ms against a schedule of
211.5), and at B=32 15 s lift gpt-sim's bound within that family from 100.8 to 102.1 ms
(``IN_ORDER_MAX_CELLS``).

And for every schedule the untied model (:func:`build_untied_pair_model`; :mod:`.bounds`, "Any
order, in sample order"): every schedule turns into one with its B ops in sample order and B
ranges untied from F ranges, no later, so a bound on those bounds all. It runs beside the
free-order model up to ``PAIR_MAX_CELLS`` (vgg16-cpu, B=8: 157.4 ms against 154.6; B=12: 183.56,
the optimum is 183.59) and alone up to ``IN_ORDER_MAX_CELLS``. Before the pairs, in most of the
time (``PROGRAMS_SHARE``), :mod:`.pair_program` (the untied pair model as a program in time order,
with one more relaxation, then tied; vgg16-cpu, B=32: 301.2 -> 305.3 ms in seconds, gpt-sim
100.5 -> 102.8 in 40 s) and :func:`.bounds.matched_bound` (the untied program with each B op
matched to an earlier F op of its size; gpt-cpu, B=32: 139.8 -> 141.6 ms), from which they start.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import numpy as np
from ortools.sat.python import cp_model

from .bounds import (
    MATCHED_FAST_CELLS,
    Heads,
    InOrderHeads,
    UntiedHeads,
    best_bound_ms,
    heads_and_tails,
    in_order_heads,
    in_order_usable_chunks,
    int_tables,
    own_bound,
    sample_order_bound,
    stage_bound,
    untied_heads,
    untied_usable_chunks,
    usable_chunks,
)

__all__ = ["IN_ORDER_MAX_CELLS", "PAIR_MAX_CELLS", "PAIR_SHARE", "PROGRAMS_SHARE", "PROGRAM_SHARE", "build_pair_model", "build_untied_pair_model", "pair_bound", "pair_bound_ms", "pair_bound_runs", "start_bound_ms"]

# B x max size. S=4, B=8 (64): under a second per pair; B=12 (144): 20-30 s for the binding
# pair on vgg16-cpu; B=16 (256): not settled in a minute, but 15 s lift vgg16-cpu's bound 3%
# (185.9 -> 191.7 ms), gpt-sim's and gpt-cpu's 1.4-1.7%; B=32 (1024): 15 s lift nothing, a
# minute 2% (vgg16-cpu 281.3 -> 286.8), which is worth less than the GA's time it would take.
PAIR_MAX_CELLS = 256
# of a solver's time limit, where it runs (cpsat and milp start from it; auto reports it): enough
# to settle S=4, B=8 many times over and most of what B=12 gives in a minute
PAIR_SHARE = 0.25
# of the any-order pair bound's time, the matched and pair programs' (:func:`_programs_within`;
# CP-SAT's untied pair models get the rest, and what the programs leave where they settle early),
# and of that the pair program's (the matched bound gets what is left). The pair program first,
# with most of it: in 20 s it ends above the matched bound on every bundled profile at B=12-32
# (S=4 and 8), and at S=4, B=32 it needs 20-25 s (gpt-cpu: 142.4 ms, where the matched bound
# alone takes 21 s for 141.6)
PROGRAMS_SHARE = 0.9
PROGRAM_SHARE = 0.85
# The same for the pairs of the 1F1B family (:func:`build_pair_model` with ``io``), whose B ops in
# sample order CP-SAT settles far sooner: B=16 in 2 s, and at B=32 15 s on 2 cores lift gpt-sim's
# bound from 100.8 to 102.1 ms, vgg16-cpu's from 301.2 to 304.5 (45 s on one: 102.9, 305.2).
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

    Integer tables as in :func:`.bounds.int_tables` (floored microseconds); ``lower`` and
    ``horizon`` bound the makespan (a known bound, a known schedule's makespan). With ``io``
    (:func:`.bounds.in_order_heads`), the model of the 1F1B family instead: both stages run
    their B ops in sample order, and a last stage runs each chunk's B right after its F."""
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
    fs = [{c: m.new_int_var(int(h.release[r, c[1]]), H, f"fs{r}_{c[0]}_{c[1]}") for c in chunks[k]} for k, r in enumerate((s, s + 1))]
    fe = [{c: m.new_int_var(0, H, "") for c in chunks[k]} for k in (0, 1)]
    bs = [{c: m.new_int_var(0, H, "") for c in chunks[k]} for k in (0, 1)]
    be = [{c: m.new_int_var(0, H, "") for c in chunks[k]} for k in (0, 1)]
    fdone = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in (s, s + 1)]  # end of the F holding sample i
    bdone = [[m.new_int_var(0, H, "") for _ in range(B)] for _ in (s, s + 1)] if io is not None else []  # of the B (in order)
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
            # twice as fast as with interval variables that hold the ends (vgg16-cpu, B=12-32)
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
    """The pair model of *untied* schedules (:mod:`.bounds`, "Any order, in sample order"): each
    stage has an F partition and a B partition, both run in sample order, with the same chunk
    sizes; a B chunk waits for the F of its samples and their gradients. Every schedule, in any
    order, turns into one of these no later, so the model's least makespan bounds them all.
    Returns (model, makespan)."""
    B, S = minibatch, F.shape[0]
    mx = F.shape[1] - 1
    m = cp_model.CpModel()
    H = horizon
    # the F partition is the schedule's own, so the stage cuts hold for it; both partitions are
    # a run of the one-stage program of .bounds.untied_bound within the horizon
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
    fs = [{c: m.new_int_var(int(h.release[r, c[1]]), H, f"fs{r}_{c[0]}_{c[1]}") for c in fchunks[k]} for k, r in enumerate((s, s + 1))]
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
            m.add(sum(v for c, v in xf[k].items() if c[1] - c[0] == b) == sum(v for c, v in xb[k].items() if c[1] - c[0] == b))
        intervals = []
        for (lo, hi), on in xf[k].items():
            b = hi - lo
            intervals.append(m.new_optional_fixed_size_interval_var(fs[k][lo, hi], int(F[r, b]), on, ""))
            m.add(fdone[k][lo] >= fs[k][lo, hi] + int(F[r, b])).only_enforce_if(on)
            if lo > 0:
                m.add(fs[k][lo, hi] >= fdone[k][lo - 1]).only_enforce_if(on)
            if k == 1 and r < S - 1:  # its samples go down and come back, the last one last
                m.add(back[hi - 1] >= fs[k][lo, hi] + int(F[r, b]) + int(ut.turn_last[r, b])).only_enforce_if(on)
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
    stop: Optional[threading.Event] = None,
) -> int:
    """The best of the stage cuts and every pair's bound, in the tables' units; with
    ``in_order``, of :func:`.bounds.sample_order_bound` and every pair's in the 1F1B family
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
    caller has them (they take a second or two at S=4, B=32). ``workers``: CP-SAT's (None: one
    per core). ``stop``: once set, the search ends within a tenth of a second with what it has
    proven (``auto``: the schedule found already meets the bound)."""
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
    safe = int(h.release.max() + 2 * B * ((F[:, 1] + G[:, 1]).max() + L[:, 1].max()) + 2 * h.turn.max() + h.tail.max())
    upper_now = upper if callable(upper) else (lambda: upper)  # noqa: E731

    def tightened(horizon: int) -> int:
        u = upper_now()
        return min(horizon, u + 2 * S * B) if u is not None else horizon  # floored op durations

    horizon = tightened(safe)
    deadline = time.perf_counter() + time_limit
    # the pair most likely to bind first: the one whose tighter stage has the fewest usable
    # chunks 1% above the bound (then the other stage's); it gets 3/4 of every round's time.
    # In any order each pair has two models, the untied one (bounds.py) and the one in any op
    # order; neither bound contains the other (20 s each: vgg16-cpu, B=8 157.4 against 154.6 ms;
    # gpt-sim, B=12 54.8 against 56.4), so both run and the better one counts.
    near = best + best // 100
    # (past PAIR_MAX_CELLS the free-order model proves nothing in a minute: the untied one alone)
    models = [io] if in_order else [untied_heads(F, G, L, h, B)] + ([None] if B * (F.shape[1] - 1) <= PAIR_MAX_CELLS else [])
    if in_order:
        usable = [int(in_order_usable_chunks(near, h, io, F, G, r, B).sum()) for r in range(S)]
    else:  # the untied model's (its F and B chunks)
        usable = [sum(int(u.sum()) for u in untied_usable_chunks(near, h, models[0], F, G, r, B)) for r in range(S)]
    order = sorted(range(S - 1), key=lambda s: sorted(usable[s : s + 2]))
    # per (pair, model): no schedule of it below lo; one within hi; the next probe's step (None:
    # not searched yet)
    state = {(s, k): (best, None, None) for s in order for k in range(len(models))}
    while time.perf_counter() < deadline and not (stop and stop.is_set()):
        # a better schedule found meanwhile is a schedule of every pair's model
        horizon = tightened(horizon)
        state = {key: (lo, hi if hi is None else min(hi, horizon), step) for key, (lo, hi, step) in state.items()}
        open_ = [key for key, (lo, hi, _) in state.items() if hi is None or max(lo, best) < hi]
        if not open_:
            break
        lead = [key for key in open_ if key[0] == open_[0][0]]
        rest = len(open_) - len(lead)
        weight = {key: (3 / (4 * len(lead)) if key in lead else 1 / (4 * rest)) if rest else 1.0 for key in open_}
        for i, (s, k) in enumerate(open_):
            left = deadline - time.perf_counter()
            share = left * weight[s, k] / sum(weight[key] for key in open_[i:])
            tick = (lambda lo: report(max(best, lo))) if report else None  # noqa: E731
            lo, hi, step = _narrow(F, G, L, h, models[k], B, s, max(best, state[s, k][0]), *state[s, k][1:], horizon, share, seed, tick, workers, stop)
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
    stop: Optional[threading.Event] = None,
):
    """Narrow ``[lo, hi]``, where the least makespan of pair ``s``'s model lies, within ``budget``
    seconds; ``hi`` and ``step`` None on the first call. Returns the new (lo, hi, step).

    Minimising proves small instances (S=4, B=8) in under a second. Where it does not, its bound
    stays where it started, so then it asks "is there a schedule within T?" for T in growing steps
    above what is proven: far below the optimum CP-SAT answers "none" in a fraction of a second
    (vgg16-cpu, B=12: 157.7 -> 168.2 ms in 2 s). A step that has a schedule halves the interval;
    one that it cannot settle in a third of the time left is retried a quarter as far; what time is
    left after that minimises again, between what is proven and what was found."""
    deadline = time.perf_counter() + budget

    def solve(T: int, seconds: float, objective: bool):
        if seconds <= 0 or (stop and stop.is_set()):
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
        status = _solve_unless(solver, model, stop)
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
    while lo < hi and step >= max(1, lo // 5000) and time.perf_counter() < deadline and not (stop and stop.is_set()):
        T = min(hi - 1, lo + step)
        _, status = solve(T, (deadline - time.perf_counter()) / 3, False)
        if status == cp_model.INFEASIBLE:
            lo, step = T + 1, 2 * step
        elif status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            hi = T
            if small:  # within so tight a horizon minimising often proves the optimum at once
                # (vgg16-cpu, B=12, the binding pair: in 0.8 s, where bisecting with the same time
                # had it 0.3 ms short); at B=32 it proves nothing and bisecting gets further
                minimise(T, (deadline - time.perf_counter()) / 2)
            step = (hi - lo) // 2
        else:  # near the optimum either answer is slow to prove: step back towards lo
            step //= 4
    if lo < hi:
        minimise(hi, deadline - time.perf_counter())
    return lo, hi, step


def _solve_unless(solver: cp_model.CpSolver, model: cp_model.CpModel, stop: Optional[threading.Event]):
    """``solver.solve(model)``, stopped early (status UNKNOWN, or what it has) once ``stop`` is set."""
    if stop is None:
        return solver.solve(model)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            if stop.is_set():
                solver.stop_search()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return solver.solve(model)
    finally:
        done.set()
        watcher.join()


def pair_bound_runs(problem, max_cells: Optional[int] = PAIR_MAX_CELLS) -> bool:
    """Does :func:`pair_bound_ms` search here (more than one stage, no recompute, small enough)?"""
    small = max_cells is None or problem.minibatch * problem.max_size <= max_cells
    return problem.num_stages > 1 and not problem.recompute and small


def pair_bound_ms(
    problem,
    time_limit: float,
    upper_ms: "float | Callable[[], Optional[float]] | None" = None,
    seed: int = 0,
    report: Optional[Callable[[float], None]] = None,
    max_cells: Optional[int] = PAIR_MAX_CELLS,
    scope: str = "any order",
    workers: Optional[int] = None,
    stop: Optional[threading.Event] = None,
) -> float:
    """:func:`pair_bound` in ms with the optimizer step, never below :func:`.bounds.best_bound_ms`
    of the same ``scope`` ("any order", or "1f1b order": the in-order pairs); that bound alone
    with recompute or past ``max_cells``. ``report(bound_ms)`` and ``stop`` as there (``report``
    also once the matched program is done)."""
    t0 = time.perf_counter()
    if not pair_bound_runs(problem, max_cells):
        return best_bound_ms(problem, scope)
    from ..baselines import lower_bound  # the spec's bound (imported here as in bounds.py)

    opt = problem.tables.optimizer_ms
    known = own_bound(problem, scope)
    fast = max(lower_bound(problem), known / 1000 + opt)  # best_bound_ms, without computing it again
    def in_units(ms: Optional[float]) -> Optional[int]:
        return None if ms is None else int(np.floor((ms - opt) * 1000 + 1e-9))

    upper = (lambda: in_units(upper_ms())) if callable(upper_ms) else in_units(upper_ms)  # noqa: E731
    tick = None if report is None else lambda us: report(max(fast, us / 1000 + opt))  # noqa: E731
    tables = int_tables(problem)
    if scope == "any order":  # the pair and matched programs first, in most of the time
        known = max(known, _programs_within(*tables, problem.minibatch, known, PROGRAMS_SHARE * time_limit, stop))
        fast = max(fast, known / 1000 + opt)
        if report:
            report(fast)
    left = time_limit - (time.perf_counter() - t0)
    own = pair_bound(*tables, problem.minibatch, left, upper, seed, tick, max_cells, scope == "1f1b order", known, workers, stop)
    return max(fast, own / 1000 + opt)


def _programs_within(
    F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int, known: int, seconds: float, stop: Optional[threading.Event] = None
) -> int:
    """:func:`.pair_program.pair_program_bound` from ``known`` in ``PROGRAM_SHARE`` of ``seconds``,
    then :func:`.bounds.matched_bound`, the best they prove within ``seconds`` (or until ``stop``
    is set), never below ``known``. Small
    instances have both in the fast bound already; larger ones run them in a Python process of
    their own, which prints each bound it proves and is killed at the time limit, so it does not
    hold this one's GIL (the matched program is pure Python, and in ``auto`` they run beside the GA).
    A plain subprocess, not multiprocessing: spawning would import the caller's main module again."""
    if minibatch * (F.shape[1] - 1) <= MATCHED_FAST_CELLS:
        return known
    buf = io.BytesIO()
    np.savez(buf, F=F, G=G, L=L, B=minibatch, known=known, seconds=seconds)
    proc = subprocess.Popen([sys.executable, "-c", _PROGRAMS_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.perf_counter() + seconds
    data: Optional[bytes] = buf.getvalue()
    while True:  # in short waits, to see ``stop``; a retried communicate loses no output
        try:
            out, _ = proc.communicate(data, timeout=max(0.0, min(0.1, deadline - time.perf_counter())))
            break
        except subprocess.TimeoutExpired:
            data = None
            if time.perf_counter() >= deadline or (stop and stop.is_set()):
                proc.kill()
                out, _ = proc.communicate()  # what it printed before: each line a bound proven
                break
    return max([known] + [int(line) for line in out.split()])


_PROGRAMS_CHILD = (
    "import io, sys, numpy as np; from umopt.solvers.bounds import matched_bound; "
    "from umopt.solvers.pair_program import pair_program_bound; from umopt.solvers.pairs import PROGRAM_SHARE; "
    "d = np.load(io.BytesIO(sys.stdin.buffer.read())); "
    "F, G, L, B = d['F'], d['G'], d['L'], int(d['B']); "
    "pair_program_bound(F, G, L, B, int(d['known']), PROGRAM_SHARE * float(d['seconds']), lambda b: print(b, flush=True)); "
    "print(matched_bound(F, G, L, B, int(d['known'])), flush=True)"
)


def start_bound_ms(problem, order: str, seconds: float, upper_ms: float, seed: int = 0) -> float:
    """The bound an exact model starts from: for the free-order one (``order`` "auto") the pair
    bound in ``PAIR_SHARE`` of its ``seconds`` where that runs; otherwise the fast bound."""
    if order == "gpipe":
        return best_bound_ms(problem)
    return pair_bound_ms(problem, PAIR_SHARE * max(0.0, seconds), upper_ms, seed)
