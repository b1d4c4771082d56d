"""The untied bound: every schedule, turned into one that runs its B ops in sample order.

Take any schedule without recompute and, on every stage, give its B ops new sample ranges in the
order they run: the first one run takes samples ``[0, b1)``, the next ``[b1, b1 + b2)``, and so on,
each keeping its size and time slot. Nothing else changes (F ops, messages: same sizes at the
same times), and every op is still ready when it starts: ``j`` B ops in, the old ones held some
``j``-sized set of samples, all forwarded and with their gradients in, so the first ``j`` samples
are too (F ops and links are in sample order). Memory counts samples, so it is the same. The new
schedule runs every stage's B ops in sample order, but its B ranges are no longer the F ranges
(their sizes are a permutation of them), which the spec only allows with recompute. So every
schedule's makespan is at least the least makespan of *untied* schedules: B ops in sample order,
their sizes a permutation of the stage's F sizes, no-recompute costs. Bounds on those hold for
every schedule. What changes for the heads: a B chunk need not wait for a whole F chunk's
samples, and the last stage's B chunks are not its F chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .heads import (
    BIG,
    Heads,
    chain,
    drains,
    heads_and_tails,
    least_true,
    least_work,
    round_trip,
    stage_programs,
)

__all__ = [
    "UntiedHeads",
    "untied_heads",
    "untied_bound",
    "untied_stages",
    "untied_limits",
    "two_chains",
    "untied_latest",
    "untied_usable_chunks",
]


@dataclass(frozen=True)
class UntiedHeads:
    """Heads of untied schedules (see above). ``turn_last[s, b]``: after a ``b``-sample F op
    ends on ``s``, the gradient of its last sample is back no earlier (gradients return in sample
    order there, so that is all of them); ``grad_release[s, n]``: the gradients of samples
    0..n-1 reach s no earlier; ``drain``: :func:`drains` (which only assumes B ops in sample
    order, each chunk free); ``grad_ready[s, n]``: the gradients of samples 0..n-1 are on s no
    earlier (their own forward and turnaround included; 0 on the last stage)."""

    turn_last: np.ndarray  # (S, max_size + 1)
    grad_release: np.ndarray  # (S, B + 1)
    drain: np.ndarray  # (S, max_size + 1, B + 1)
    grad_ready: np.ndarray  # (S, B + 1): samples 0..n-1 have their gradients on s (0 on the last stage)


def untied_heads(F: np.ndarray, G: np.ndarray, L: np.ndarray, h: Heads, minibatch: int) -> UntiedHeads:
    """The walks of :func:`heads_and_tails` for a turnaround, with the last stage's F and B ops
    apart (its B chunks are free), and :func:`gradient_releases` without the F and B of one chunk
    chained: a prefix's B ops on stage r all start after their samples' F and after the first
    sample's gradients come back, and F and B work of samples ``j..n-1`` both follow ``release[j+1]``."""
    S, mx1 = F.shape
    mx, B = mx1 - 1, minibatch
    big = np.iinfo(np.int64).max // 4
    KF = [least_work(F[s], B) for s in range(S)]
    KG = [least_work(G[s], B) for s in range(S)]
    lmin = [int(L[s, 1:].min()) for s in range(S - 1)]
    last = np.zeros((S, mx + 1), dtype=np.int64)
    first = np.zeros((S, mx + 1), dtype=np.int64)  # the first sample of the message back
    for b in range(1, mx + 1):
        for s in range(S - 1):
            back = round_trip(L, KF, KG, lmin, s, b)
            last[s, b], first[s, b] = back[b], back[1]
    for s in range(S - 1):
        up = [(F[r], L[r]) for r in range(s + 1, S - 1)]
        down = [(G[r], L[r - 1]) for r in range(S - 2, s, -1)]
        last[s, 1:] = np.maximum(
            last[s, 1:], chain(L[s], [*up, (F[S - 1], None), (G[S - 1], L[S - 2] if S > 1 else None), *down])
        )
    grel = np.zeros((S, B + 1), dtype=np.int64)
    gready = np.zeros((S, B + 1), dtype=np.int64)
    for r in range(S - 1, -1, -1):
        rel = h.release[r]
        # sample n - 1's gradient on r: after its F chunk, at least the first of its samples back
        own = rel + (int(F[r, 1:].min()) if r == S - 1 else int((F[r, 1:] + first[r, 1:]).min()))
        ready = np.maximum.accumulate(np.maximum(own, grel[r]))
        if r < S - 1:
            gready[r] = ready
        if r == 0:
            break
        E = np.full(B + 1, big, dtype=np.int64)
        A = np.zeros(B + 1, dtype=np.int64)
        E[0] = 0
        for n in range(1, B + 1):
            b = np.arange(1, min(mx, n) + 1)
            E[n] = (np.maximum(E[n - b], ready[n]) + G[r, b]).min()
            j = np.arange(n)
            A[n] = (rel[j + 1] + KF[r][n - j] + KG[r][n - j]).max()
        # and the stage's two chains exactly (:func:`two_chains` with no deadline): the least
        # end of a state with n samples backwarded
        t = two_chains(
            big,
            F[r],
            G[r],
            rel,
            ready,
            np.zeros(mx + 1, dtype=np.int64),
            np.zeros((mx + 1, B + 1), dtype=np.int64),
            B,
        )
        E = np.maximum(E, t.min(axis=0))
        done = np.minimum.accumulate(np.maximum(A, E)[::-1])[::-1]  # the chunk holding n - 1 may end later
        grel[r - 1, 1:] = done[1:] + lmin[r - 1]
    return UntiedHeads(last, grel, drains(F, G, L, B), gready)


def untied_bound(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int, known: int = 0) -> int:
    """A lower bound on the makespan of every schedule (any order), from the untied schedules that
    every schedule turns into (see above): for each stage and target ``T``, the least end of every
    state of its two chains (``i`` samples forwarded and ``j <= i`` backwarded, ops in sample order
    on one machine, F chunks after their release, B chunks after their samples' gradients, each
    op followed by what must still run after it) by a dynamic program over the states, which is
    exact for that one stage (a state's least end is all its future depends on).

    The last stage's backward is where the free-order stage cuts are weakest: there any chunk
    may be backwarded last, here the later samples follow the earlier ones. ``known``: a bound already
    proven (the stage cuts), where the search starts; the result is never below it."""
    B = minibatch
    best = known
    for s, h, ut, ends in untied_stages(F, G, L, B):
        if best and two_chains(best, F[s], G[s], *ends, B) is not None:
            continue  # this stage's bound is no higher
        top = (
            int(
                h.release[s, B]
                + ut.grad_ready[s, B]
                + (F[s, 1:] + G[s, 1:]).max() * B
                + ends[2].max(initial=0)
                + ends[3][ends[3] < BIG // 4].max(initial=0)
            )
            + 1
        )
        # to a ten-thousandth: each step is a program over (B + 1)^2 / 2 states
        best = max(
            best,
            least_true(lambda T: two_chains(T, F[s], G[s], *ends, B) is not None, best, top, best // 10_000),
        )
    return best


def untied_stages(F: np.ndarray, G: np.ndarray, L: np.ndarray, B: int):
    """``(s, heads, untied heads, stage s's inputs to the programs)``, last stage first."""
    h = heads_and_tails(F, G, L, B)
    ut = untied_heads(F, G, L, h, B)
    for s in range(F.shape[0] - 1, -1, -1):
        yield s, h, ut, untied_limits(h, ut, F, G, s, B)


def untied_limits(h: Heads, ut: UntiedHeads, F: np.ndarray, G: np.ndarray, s: int, B: int):
    """Stage s's inputs to :func:`two_chains`: F releases, B readiness, and what runs after an F
    op of b samples (its last sample's gradient back, then some B op and its drain) and after a
    B op of b samples ending at sample j (tail, drain)."""
    S, mx = F.shape[0], F.shape[1] - 1
    b = np.arange(1, mx + 1)
    after_b = np.full((mx + 1, B + 1), BIG // 4, dtype=np.int64)
    for j in range(1, B + 1):
        bb = b[b <= j]
        after_b[bb, j] = np.maximum(h.tail[s, bb], ut.drain[s, bb, B - j])
    # whichever B op holds that sample, with however many samples after it
    m = np.arange(B + 1)[None, :]
    drain = np.where(b[:, None] + m <= B, ut.drain[s, 1:, :], BIG // 4).min(axis=1)
    least_b = int((G[s, 1:] + np.maximum(h.tail[s, 1:], drain)).min())
    after_f = np.zeros(mx + 1, dtype=np.int64)
    after_f[1:] = (ut.turn_last[s, 1:] if s < S - 1 else 0) + least_b
    return h.release[s], ut.grad_ready[s], after_f, after_b


def two_chains(
    T: int,
    Fs: np.ndarray,
    Gs: np.ndarray,
    rel: np.ndarray,
    ready: np.ndarray,
    after_f: np.ndarray,
    after_b: np.ndarray,
    B: int,
    compiled: bool = True,
):
    """``t[i, j]``: the least end of one stage's state (i forwarded, j backwarded) whose ops all
    meet ``T``; None when (B, B) is out of reach. States by anti-diagonal ``i + j``, each one's
    cells at once (both moves into a cell come from earlier diagonals)."""
    if stage_programs is not None and compiled:
        t, reached = stage_programs.two_chains(int(T), Fs, Gs, rel, ready, after_f, after_b, B)
        return t if reached else None
    mx = len(Fs) - 1
    big = BIG // 4
    t = np.full((B + 1, B + 1), big, dtype=np.int64)
    t[0, 0] = 0
    b = np.arange(1, mx + 1)[None, :]
    for d in range(1, 2 * B + 1):
        i = np.arange((d + 1) // 2, min(d, B) + 1)[:, None]  # j = d - i <= i
        j = d - i
        # an F chunk of b samples ending at i, from (i - b, j), j <= i - b
        k = i - b >= j
        prev = np.where(k, t[np.clip(i - b, 0, B), j], big)
        end = np.maximum(prev, rel[i]) + Fs[b]
        best = np.where(k & (prev < big) & (end + after_f[b] <= T), end, big).min(axis=1)
        # a B chunk of b samples ending at j, from (i, j - b)
        k = j >= b
        prev = np.where(k, t[i, np.clip(j - b, 0, B)], big)
        end = np.maximum(prev, ready[j]) + Gs[b]
        best = np.minimum(best, np.where(k & (prev < big) & (end + after_b[b, j] <= T), end, big).min(axis=1))
        t[i[:, 0], j[:, 0]] = best
    return t if t[B, B] < big else None


def untied_latest(
    T: int, h: Heads, ut: UntiedHeads, F: np.ndarray, G: np.ndarray, s: int, B: int
) -> np.ndarray:
    """``late[i, j]``: the latest end of stage s's state (i forwarded, j backwarded) in
    :func:`two_chains`'s program from which (B, B) is still reached meeting ``T``; a large
    negative number where none is."""
    mx = F.shape[1] - 1
    big = BIG // 4
    rel, ready, after_f, after_b = untied_limits(h, ut, F, G, s, B)
    late = np.full((B + 1, B + 1), -big, dtype=np.int64)
    late[B, B] = big
    b = np.arange(1, mx + 1)[None, :]
    for d in range(2 * B - 1, -1, -1):
        i = np.arange((d + 1) // 2, min(d, B) + 1)[:, None]
        j = d - i
        k = i + b <= B  # an F chunk [i, i + b) next
        nxt = np.minimum(late[np.clip(i + b, 0, B), j], T - after_f[b])
        ok = k & (rel[np.clip(i + b, 0, B)] + F[s, b] <= nxt)
        cand = np.where(ok, nxt - F[s, b], -big).max(axis=1)
        k = j + b <= i  # a B chunk [j, j + b) next
        nxt = np.minimum(
            late[i, np.clip(j + b, 0, B)], T - after_b[np.broadcast_to(b, (len(i), mx)), np.clip(j + b, 0, B)]
        )
        ok = k & (ready[np.clip(j + b, 0, B)] + G[s, b] <= nxt)
        cand = np.maximum(cand, np.where(ok, nxt - G[s, b], -big).max(axis=1))
        late[i[:, 0], j[:, 0]] = cand
    return late


def untied_usable_chunks(
    T: int, h: Heads, ut: UntiedHeads, F: np.ndarray, G: np.ndarray, s: int, B: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(f_use, b_use)``, each ``[lo, b]``: the F and the B chunks of stage s that some run of
    :func:`two_chains`'s program meeting ``T`` holds (a state reached in time from the start
    from which the end is still reached in time, through that chunk). All False where none meets it."""
    mx = F.shape[1] - 1
    big = BIG // 4
    rel, ready, after_f, after_b = untied_limits(h, ut, F, G, s, B)
    f_use = np.zeros((B + 1, mx + 1), dtype=bool)
    b_use = np.zeros((B + 1, mx + 1), dtype=bool)
    t = two_chains(T, F[s], G[s], rel, ready, after_f, after_b, B)
    if t is None:
        return f_use[:B], b_use[:B]
    late = untied_latest(T, h, ut, F, G, s, B)
    for i in range(B):
        for bb in range(1, min(mx, B - i) + 1):  # F [i, i + bb) from some (i, j), j <= i
            js = np.arange(i + 1)
            end = np.maximum(t[i, js], rel[i + bb]) + F[s, bb]
            f_use[i, bb] = bool(
                ((t[i, js] < big) & (end <= np.minimum(late[i + bb, js], T - after_f[bb]))).any()
            )
    for j in range(B):
        for bb in range(1, min(mx, B - j) + 1):  # B [j, j + bb) from some (i, j), i >= j + bb
            i = np.arange(j + bb, B + 1)
            end = np.maximum(t[i, j], ready[j + bb]) + G[s, bb]
            b_use[j, bb] = bool(
                ((t[i, j] < big) & (end <= np.minimum(late[i, j + bb], T - after_b[bb, j + bb]))).any()
            )
    return f_use[:B], b_use[:B]
