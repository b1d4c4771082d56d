"""The stage cuts: a bound on every schedule from each stage alone, with its own best partition.

Target ``T`` is reachable only if every stage, alone, has a partition whose chunks each meet
release, F, turnaround, B and drain within ``T`` (the chunk cut), and whose suffixes meet the
work still to run after each chunk's release and a drain (the suffix cut). A dynamic program over
the partition from its last chunk checks both; bisection finds the least reachable ``T``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .heads import Heads, heads_and_tails, keep_undominated, least_true, least_work, stage_programs

__all__ = ["stage_bound", "usable_chunks", "LARGE_CHUNKS_MAX_CELLS"]


def stage_bound(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int, recompute: bool) -> int:
    """A lower bound on the makespan of any schedule (any order), in the tables' units.

    Target ``T`` is reachable only if every stage, alone, has a partition meeting the two cuts of
    ``cpsat._add_cuts`` (chunk: release, F, turnaround, B and drain in a row; suffix: from a
    chunk's release, all later F chunks and the B ops that need them, then a drain), checked by a
    dynamic program over the partition from its last chunk. The least reachable ``T`` is found by
    bisection (reachability only grows with ``T``). It sees what large chunks cost (they start
    late and drain long), which the spec's bound does not. Then, up to
    ``LARGE_CHUNKS_MAX_CELLS``, the large-chunk cut of :func:`_large_chunks_ok` lifts it further.
    """
    B = minibatch
    h = heads_and_tails(F, G, L, B)
    S = F.shape[0]
    cuts = [_chunk_cut(h, F, G, s, B, recompute) for s in range(S)]
    KG = [least_work(G[s], B) for s in range(S)]
    top = int(max(h.release[s, B] + (F[s, 1] + G[s, 1]) * B + h.turn.max() + h.tail.max() for s in range(S)))
    lo_T = least_true(
        lambda T: all(_reachable(T, h, F, G, s, cuts[s], KG[s], B, recompute) for s in range(S)), 0, top
    )
    if recompute or B * (F.shape[1] - 1) > LARGE_CHUNKS_MAX_CELLS:
        return lo_T
    for s in range(S - 1, -1, -1):  # the last stages bind most often
        for c in range(2, F.shape[1]):
            ok = lambda T: _large_chunks_ok(T, h, F, G, s, cuts[s], B, c)  # noqa: E731
            if ok(lo_T):
                continue
            # it lifts the bound by a few percent: search upwards in growing steps, then bisect
            step = max(1, lo_T // 256)
            while not ok(lo_T + step):
                lo_T, step = lo_T + step + 1, 2 * step
            lo_T = least_true(ok, lo_T, lo_T + step)
    return lo_T


# The large-chunk cut's program keeps two sums per state; past this many (sample, size) cells
# it costs tens of seconds, so larger instances keep the bound without it.
LARGE_CHUNKS_MAX_CELLS = 1024


def _large_chunks_ok(
    T: int, h: Heads, F: np.ndarray, G: np.ndarray, s: int, cut: np.ndarray, B: int, c: int
) -> bool:
    """Has stage s a partition meeting :func:`_reachable`'s cuts and the large-chunk cut for ``c``?

    The large-chunk cut: from the release of a chunk of at least ``c`` samples, the stage runs
    the F and B ops of it and of every later chunk of at least ``c`` samples, one at a time; the
    last of them to end is a B op (each F precedes its B), so the least tail of a chunk of ``c``
    or more follows. The suffix cut charges the least tail of *any* later chunk, so a partition
    with one small chunk at the end escapes it however many large chunks drain before; here
    their drains count.

    The program (from the last chunk down) keeps, per least tail of the suffix (the state of
    :func:`_reachable`), every undominated pair (work of the suffix, work of its chunks of ``c``
    or more samples).
    """
    mx = F.shape[1] - 1
    rel = h.release[s]
    tails = h.tail[s, 1:]
    levels, level_of = _tail_levels(tails)
    large_tail = int(h.tail[s, c:].min())
    fronts: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(B + 1)]
    fronts[B][len(levels) - 1] = [(0, 0)]
    for lo in range(B - 1, -1, -1):
        here = fronts[lo]
        for b in range(1, min(mx, B - lo) + 1):
            hi = lo + b
            if cut[lo, b] > T or not fronts[hi]:
                continue
            own, r, large = int(F[s, b] + G[s, b]), int(rel[hi]), b >= c
            for state, front in fronts[hi].items():
                state = min(int(level_of[b]), state)
                for work, large_work in front:
                    work, large_work = work + own, large_work + own * large
                    if r + work + levels[state] > T or (large and r + large_work + large_tail > T):
                        continue
                    keep_undominated(here.setdefault(state, []), work, large_work)
    return bool(fronts[0])


def _tail_levels(tails: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct drains of a stage's chunk sizes, ascending, then 0 for "no chunk yet" (never
    read by a cut); and each size's index among them (``level_of[b]``, b = 1..max size)."""
    levels = np.unique(tails)
    return np.append(levels, 0), np.concatenate([[0], np.searchsorted(levels, tails)])


def _chunk_cut(h: Heads, F: np.ndarray, G: np.ndarray, s: int, B: int, recompute: bool) -> np.ndarray:
    """``cut[lo, b]``: release, F, turnaround, B and drain of chunk [lo, lo + b) on stage s."""
    mx = F.shape[1] - 1
    big = np.iinfo(np.int64).max // 4
    cut = np.full((B, mx + 1), big, dtype=np.int64)
    b = np.arange(1, mx + 1)
    for lo in range(B):
        bb = b[lo + b <= B]
        if recompute:
            after = G[s, 1:].min() + h.tail[s, 1:].min()
        else:
            after = h.turn[s, bb] + G[s, bb] + h.tail[s, bb]
        cut[lo, bb] = h.release[s, lo + bb] + F[s, bb] + after
    return cut


def _reachable(
    T: int,
    h: Heads,
    F: np.ndarray,
    G: np.ndarray,
    s: int,
    cut: np.ndarray,
    KG: np.ndarray,
    B: int,
    recompute: bool,
) -> bool:
    """Has stage s a partition whose chunk and suffix cuts all stay within ``T``?"""
    W, _, _ = _suffix_work(T, h, F, G, s, cut, KG, B, recompute)
    return bool((W[0] < np.iinfo(np.int64).max // 4).any())


def _suffix_work(
    T: int,
    h: Heads,
    F: np.ndarray,
    G: np.ndarray,
    s: int,
    cut: np.ndarray,
    KG: Optional[np.ndarray],
    B: int,
    recompute: bool,
    compiled: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``W[lo, l]``: the least work of a partition of ``[lo, B)`` on stage s whose chunk and suffix
    cuts all stay within ``T`` and whose chunks' least tail is ``levels[l]``; with ``levels`` and
    ``level_of`` (as :func:`_tail_levels`). Unreachable: the int64 maximum // 4.

    The suffix cut from a chunk ends with the drain after the last B op among the chunks from
    there on, at least the least ``tail`` of their sizes, so the dynamic program (from the last
    chunk down) carries that least tail as its state. With recompute the B chunks are free, so
    the suffix ends with the least tail of all sizes and the least B work ``KG`` of the samples.
    """
    big = np.iinfo(np.int64).max // 4
    mx = F.shape[1] - 1
    rel = h.release[s]
    tails = h.tail[s, 1:]
    if recompute:
        level_of = np.zeros(mx + 1, dtype=np.int64)
        levels = np.array([tails.min(), tails.min()])
    else:
        levels, level_of = _tail_levels(tails)
    Lv = len(levels) - 1  # index of "no chunk yet"
    cut_ok = cut <= T
    if stage_programs is not None and compiled:
        own = F[s] if recompute else F[s] + G[s]
        kg = np.array([KG[B - lo] if recompute else 0 for lo in range(B)], dtype=np.int64)
        W = stage_programs.suffix_work(int(T), cut_ok, rel, own, level_of, levels, kg, B)
        return W, levels, level_of
    W = np.full((B + 1, Lv + 1), big, dtype=np.int64)
    W[B, Lv] = 0
    for lo in range(B - 1, -1, -1):
        b = np.arange(1, min(mx, B - lo) + 1)
        hi = lo + b
        own = F[s, b] if recompute else F[s, b] + G[s, b]
        rest = own[:, None] + W[hi]  # (sizes, state of the rest)
        state = np.minimum(level_of[b][:, None], np.arange(Lv + 1)[None, :])
        suffix = rel[hi][:, None] + rest + levels[state] + (KG[B - lo] if recompute else 0)
        ok = cut_ok[lo, b][:, None] & (suffix <= T) & (W[hi] < big)
        np.minimum.at(W[lo], state[ok], rest[ok])
    return W, levels, level_of


def usable_chunks(T: int, h: Heads, F: np.ndarray, G: np.ndarray, s: int, B: int) -> np.ndarray:
    """``use[lo, b]``: does chunk ``[lo, lo + b)`` belong to some partition of stage s that meets
    :func:`_reachable`'s cuts within ``T``? (Without recompute.) In a schedule within ``T`` every
    stage's partition does, so no other chunk can be in one; the pair model leaves them out.

    :func:`_suffix_work` (the program from the last chunk down) gives, per sample and least tail
    of the suffix from there, the least work of a suffix meeting its cuts; the same program from
    the first chunk up gives, per sample and least tail of the suffix, the most suffix work the
    best prefix allows (each earlier chunk's suffix cut runs over the whole suffix). A chunk is usable when a
    suffix starting with it meets both. Near the stage cuts that leaves few of a bottleneck
    stage's chunks.
    """
    big = np.iinfo(np.int64).max // 4
    mx = F.shape[1] - 1
    rel = h.release[s]
    cut = _chunk_cut(h, F, G, s, B, False)
    cut_ok = cut <= T
    W, levels, level_of = _suffix_work(T, h, F, G, s, cut, None, B, False)
    own = F[s] + G[s]
    every = np.arange(len(levels))
    # from the first chunk up: A[lo, l], the most work a suffix [lo, B) whose least tail is
    # levels[l] may have, under the cuts of the best prefix [0, lo)
    A = np.full((B + 1, len(levels)), -big, dtype=np.int64)
    A[0] = big
    for hi in range(1, B + 1):
        for b in range(1, min(mx, hi) + 1):
            lo = hi - b
            if cut_ok[lo, b]:
                state = np.minimum(level_of[b], every)
                allow = np.minimum(T - rel[hi] - own[b] - levels[state], A[lo, state] - own[b])
                A[hi] = np.maximum(A[hi], allow)
    use = np.zeros((B, mx + 1), dtype=bool)
    for lo in range(B):
        for b in range(1, min(mx, B - lo) + 1):
            hi = lo + b
            if cut_ok[lo, b]:
                state = np.minimum(level_of[b], every)
                work = own[b] + W[hi]
                use[lo, b] = bool(
                    ((W[hi] < big) & (rel[hi] + work + levels[state] <= T) & (work <= A[lo, state])).any()
                )
    return use
