"""Bounds within the 1F1B family: schedules whose stages run their B ops in sample order.

When every stage runs its B ops in sample order (1F1B, whatever its warm-ups), the samples after
a chunk are backwarded after it, everywhere, so the drain after a chunk's B is known to include
them, and each lower stage's B ops form one in-order chain that a single-stage recursion solves
exactly. Both cuts of the stage bound lose these: in a free order any chunk may be the last
backwarded one. Without recompute only (B chunks are then the F chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .heads import BIG, Heads, drains, heads_and_tails, keep_undominated, least_true
from .stage_cuts import usable_chunks

__all__ = [
    "sample_order_bound",
    "InOrderHeads",
    "in_order_heads",
    "in_order_usable_chunks",
    "gradient_releases",
]


def sample_order_bound(
    F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int, pareto_max: int = 64
) -> int:
    """A lower bound on the makespan of every schedule whose stages run B ops in sample order.

    For each stage and target ``T``, a dynamic program over its partition (chunks in sample
    order) checks three bounds on ``e_k``, the end of chunk k's B op, each followed by
    ``drains[s, b_k, B - hi_k]``: the chunk cut of :func:`stage_bound` (release, F, turnaround,
    B); ``A_k = max(A_{k-1}, release[hi_k]) + F + B`` (from the start of any earlier chunk's F,
    the F and B ops of it and every chunk up to k ran before ``e_k``); and ``E_k = E_{k-1} +
    B(b_k)`` (B ops in order). ``A`` and ``E`` pull apart, so up to ``pareto_max`` samples the
    program keeps every undominated pair; beyond, one program per chain (weaker, much faster).
    """
    B = minibatch
    h = heads_and_tails(F, G, L, B)
    io = in_order_heads(F, G, L, h, B)
    D, grel, cut = io.drain, io.grad_release, io.cut
    best = 0
    programs = (False, True) if B <= pareto_max else (False,)
    for s in range(F.shape[0] - 1, -1, -1):  # the last stages bind most often: then the rest are quick
        if best and all(_in_order_ok(best, h, F, G, D, cut[s], s, B, pareto) for pareto in programs):
            continue  # this stage's bound is no higher
        # every partition meets every bound at this T (each A_k, E_k is at most it minus a drain)
        top = (
            int(h.release[s, B] + grel[s, B] + (F[s, 1:] + G[s, 1:]).max() * B + h.turn[s].max() + D[s].max())
            + 1
        )
        lo_T = best
        for pareto in programs:  # the pairs' program starts from the single chains' bound, which is lower
            lo_T = least_true(lambda T: _in_order_ok(T, h, F, G, D, cut[s], s, B, pareto), lo_T, top)
        best = max(best, lo_T)
    return best


@dataclass(frozen=True)
class InOrderHeads:
    """What B ops in sample order on every stage (the 1F1B family) add to :class:`Heads`.
    ``drain[s, b, m]``: :func:`drains`; ``grad_release[s, n]``: :func:`gradient_releases`;
    ``cut[s, lo, b]``: the least end of chunk ``[lo, lo + b)``'s B op on s (release, F,
    turnaround, and the gradients of every sample up to its last)."""

    drain: np.ndarray  # (S, max_size + 1, B + 1)
    grad_release: np.ndarray  # (S, B + 1)
    cut: np.ndarray  # (S, B + 1, max_size + 1); out of range: a huge value


def in_order_heads(F: np.ndarray, G: np.ndarray, L: np.ndarray, h: Heads, minibatch: int) -> InOrderHeads:
    B = minibatch
    grel = gradient_releases(F, G, L, h, B)
    mx = F.shape[1] - 1
    b = np.arange(1, mx + 1)
    cut = np.full((F.shape[0], B + 1, mx + 1), np.iinfo(np.int64).max // 4, dtype=np.int64)
    for lo in range(B):
        bb = b[lo + b <= B]
        hi = lo + bb
        cut[:, lo, bb] = np.maximum(h.release[:, hi] + F[:, bb] + h.turn[:, bb], grel[:, hi]) + G[:, bb]
    return InOrderHeads(drains(F, G, L, B), grel, cut)


def in_order_usable_chunks(
    T: int, h: Heads, io: InOrderHeads, F: np.ndarray, G: np.ndarray, s: int, B: int
) -> np.ndarray:
    """:func:`usable_chunks` among schedules whose stages run B ops in sample order: also a
    partition meeting :func:`sample_order_bound`'s program (every undominated ``(A, E)``) within
    ``T``. From the first chunk up, the undominated pairs reachable at each sample; from the last
    chunk down, the most ``(A, E)`` pairs from which the rest still meets ``T`` (the program only
    grows with ``A`` and ``E``, so those are a set's maximal points); a chunk is usable when a pair
    before it leads into one after it. Near :func:`sample_order_bound` it keeps few of the
    bottleneck stage's chunks, further from it about what :func:`usable_chunks` keeps."""
    mx = F.shape[1] - 1
    rel, W, D, cut = h.release[s], F[s] + G[s], io.drain[s], io.cut[s]

    def step(lo: int, b: int, a: int, e: int) -> tuple[int, int]:
        a2 = max(a, int(rel[lo + b])) + int(W[b])
        return a2, max(e + int(G[s, b]), a2, int(cut[lo, b]))

    def fits(lo: int, b: int) -> bool:
        return int(cut[lo, b]) + int(D[b, B - lo - b]) <= T

    ahead = _in_order_fronts(T, h, F, G, io.drain, cut, s, B)
    # maximal points, kept negated so that keep_undominated keeps them
    behind: list[list[tuple[int, int]]] = [[] for _ in range(B + 1)]
    behind[B] = [(-BIG // 4, -BIG // 4)]
    for hi in range(B, 0, -1):
        for b in range(1, min(mx, hi) + 1):
            lo = hi - b
            if fits(lo, b):
                for na, ne in behind[hi]:
                    X = min(-na, T - int(D[b, B - hi]))  # the most A and E at hi
                    Y = min(-ne, T - int(D[b, B - hi]))
                    XA = min(X, Y)  # E >= A
                    if int(rel[hi]) + int(W[b]) <= XA and int(cut[lo, b]) <= Y:
                        keep_undominated(behind[lo], -(XA - int(W[b])), -(Y - int(G[s, b])))
    use = np.zeros((B, mx + 1), dtype=bool)
    for lo in range(B):
        for b in range(1, min(mx, B - lo) + 1):
            if fits(lo, b):
                ends = [
                    (a2, e2)
                    for a2, e2 in (step(lo, b, a, e) for a, e in ahead[lo])
                    if e2 + int(D[b, B - lo - b]) <= T
                ]
                use[lo, b] = any(a2 <= -na and e2 <= -ne for a2, e2 in ends for na, ne in behind[lo + b])
    return use & usable_chunks(T, h, F, G, s, B)


def gradient_releases(F: np.ndarray, G: np.ndarray, L: np.ndarray, h: Heads, minibatch: int) -> np.ndarray:
    """``grel[s, n]``: with B ops in sample order everywhere, the gradients of samples 0..n-1
    reach stage s no earlier than this (0 on the last stage).

    Stage s + 1 sends them after backwarding every sample up to n - 1, which it does only after
    forwarding them and backwarding all earlier ones: the least end of that prefix is the least
    over its partitions of the chains of :func:`sample_order_bound` (``A`` and ``E``, each
    minimised on its own, with the chunk cut), from the top stage down.
    """
    S, mx1 = F.shape
    mx, B = mx1 - 1, minibatch
    big = np.iinfo(np.int64).max // 4
    grel = np.zeros((S, B + 1), dtype=np.int64)
    for r in range(S - 1, 0, -1):
        rel, W = h.release[r], F[r] + G[r]
        A = np.full(B + 1, big, dtype=np.int64)
        E = np.full(B + 1, big, dtype=np.int64)
        A[0] = E[0] = 0
        for hi in range(1, B + 1):
            b = np.arange(1, min(mx, hi) + 1)
            lo = hi - b
            A[hi] = (np.maximum(A[lo], rel[hi]) + W[b]).min()
            own = np.maximum(rel[hi] + F[r, b] + h.turn[r, b], grel[r, hi])
            E[hi] = (np.maximum(E[lo], own) + G[r, b]).min()
        done = np.minimum.accumulate(np.maximum(A, E)[::-1])[::-1]  # the chunk holding n - 1 may end later
        grel[r - 1, 1:] = done[1:] + int(L[r - 1, 1:].min())
    return grel


def _in_order_ok(
    T: int,
    h: Heads,
    F: np.ndarray,
    G: np.ndarray,
    D: np.ndarray,
    cut: np.ndarray,
    s: int,
    B: int,
    pareto: bool,
) -> bool:
    """Has stage s a partition meeting the three bounds of :func:`sample_order_bound` within T?
    ``cut[lo, b]``: the chunk cut's end of the B op of chunk [lo, lo + b)."""
    big = np.iinfo(np.int64).max // 4
    mx = F.shape[1] - 1
    rel = h.release[s]
    W = F[s] + G[s]
    if not pareto:  # A and E each minimised on its own: two necessary conditions
        A = np.full(B + 1, big, dtype=np.int64)
        E = np.full(B + 1, big, dtype=np.int64)
        A[0] = E[0] = -big
        for lo in range(B):
            b = np.arange(1, min(mx, B - lo) + 1)
            hi = lo + b
            d = D[s, b, B - hi]
            c = cut[lo, b]
            ok = c + d <= T
            a2 = np.maximum(A[lo], rel[hi]) + W[b]
            e2 = np.maximum(E[lo] + G[s, b], c)
            oka = ok & (a2 + d <= T) & (A[lo] < big)
            oke = ok & (e2 + d <= T) & (E[lo] < big)
            np.minimum.at(A, hi[oka], a2[oka])
            np.minimum.at(E, hi[oke], e2[oke])
        return bool(A[B] < big and E[B] < big)
    return bool(_in_order_fronts(T, h, F, G, D, cut, s, B)[B])


def _in_order_fronts(
    T: int, h: Heads, F: np.ndarray, G: np.ndarray, D: np.ndarray, cut: np.ndarray, s: int, B: int
) -> list:
    """``fronts[n]``: every undominated ``(A, E)`` of :func:`_in_order_ok`'s program over the
    partitions of samples ``0..n-1`` meeting its bounds within T (empty: none)."""
    big = np.iinfo(np.int64).max // 4
    mx = F.shape[1] - 1
    rel, W = h.release[s], F[s] + G[s]
    fronts: list[list[tuple[int, int]]] = [[] for _ in range(B + 1)]
    fronts[0] = [(-big, -big)]
    for lo in range(B):
        for b in range(1, min(mx, B - lo) + 1):
            hi = lo + b
            d = int(D[s, b, B - hi])
            c = int(cut[lo, b])
            if c + d > T:
                continue
            for a, e in fronts[lo]:
                a2 = max(a, int(rel[hi])) + int(W[b])
                e2 = max(e + int(G[s, b]), a2, c)
                if e2 + d <= T:
                    keep_undominated(fronts[hi], a2, e2)
    return fronts
