"""Heads and tails: how early an op can start and how long the pipeline must run after it ends.

The exact models add these as redundant constraints. They hold for every schedule of the cost
model, in any op order, so they cut nothing feasible; they tell the solver early what the
pipeline's shape costs (a large chunk cannot start before the stages below have forwarded all its
samples; a large last backward leaves a long drain), which its relaxation does not see by itself.

All values are integer microseconds computed from the same floored durations the models use, so
every bound is satisfied by the model's own times. The one argument behind all of them: if ``j``
samples of a set are done on a stage and ``m`` of the set were available there at time ``c(m)``,
the chunks holding the last ``j - m + 1`` to become available all started after ``c(m)`` and cover
at least that many samples, so they took at least the least work for that many samples.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

# what this module calls the compiled one-stage programs with (their VERSION)
_COMPILED_VERSION = 1
try:  # _two_chains and _suffix_work compiled (setup.py); where they did not build, in numpy
    from . import _stage_programs as _compiled
except ImportError:  # pragma: no cover - depends on the install
    _compiled = None
if _compiled is not None and getattr(_compiled, "VERSION", None) != _COMPILED_VERSION:  # pragma: no cover
    _compiled = None  # an editable install whose rebuild failed keeps the module it built before

# whether the one-stage programs run compiled (the fast bound at S=8, B=256: 9 s -> 2 s)
COMPILED = _compiled is not None

__all__ = [
    "COMPILED",
    "Heads",
    "heads_and_tails",
    "stage_bound",
    "sample_order_bound",
    "sample_order_bound_ms",
    "backwards_in_sample_order",
    "drains",
    "gradient_releases",
    "least_work",
    "int_tables",
    "best_bound_ms",
    "own_bound",
    "linear_cuts",
    "chunks_ending_at",
    "usable_chunks",
    "InOrderHeads",
    "in_order_heads",
    "in_order_usable_chunks",
    "UntiedHeads",
    "untied_heads",
    "untied_bound",
    "untied_usable_chunks",
    "untied_latest",
    "matched_bound",
    "MATCHED_FAST_CELLS",
]


@dataclass(frozen=True)
class Heads:
    """``release[s][n]``: no F chunk ending at sample ``n - 1`` starts on ``s`` earlier.
    ``tail[s][b]``: after a ``b``-sample B op ends on ``s``, the iteration runs at least this long.
    ``turn[s][b]``: after a ``b``-sample F op ends on ``s``, its B cannot start earlier (same chunk)."""

    release: np.ndarray  # (S, B + 1)
    tail: np.ndarray  # (S, max_size + 1)
    turn: np.ndarray  # (S, max_size + 1)


def int_tables(problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Durations in whole microseconds, rounded down (so every bound on them is a bound in ms)."""
    t, mx = problem.tables, problem.max_size
    us = [np.floor(a[:, : mx + 1] * 1000 + 1e-9).astype(np.int64) for a in (t.fwd, t.bwd, t.link)]
    return us[0], us[1], us[2]


def best_bound_ms(problem, scope: str = "any order") -> float:
    """The best bound in ms (with the optimizer step) on every schedule of ``scope``.

    "any order": the best of the spec's lower bound, :func:`stage_bound` and (without recompute)
    :func:`untied_bound`, on small instances (B x max size up to ``MATCHED_FAST_CELLS``)
    :func:`matched_bound` and :func:`.pair_program.pair_program_bound` on top. "1f1b order"
    (every stage runs its B ops in sample order, however they interleave with its F ops: 1F1B
    with any warm-ups, PipeDream-flush): also :func:`sample_order_bound`, which only holds there.
    """
    from ..baselines import lower_bound  # the spec's bound

    return max(lower_bound(problem), own_bound(problem, scope) / 1000 + problem.tables.optimizer_ms)


def own_bound(problem, scope: str = "any order") -> int:
    """:func:`best_bound_ms`'s own part, in the units of :func:`int_tables` (no optimizer step).
    Remembered per tables (S=8, B=256 takes about 10 s, and a solve asks more than once)."""
    if scope not in ("any order", "1f1b order"):
        raise ValueError(f"unknown bound scope {scope!r}")
    F, G, L = int_tables(problem)
    return _own_bound(F.tobytes(), G.tobytes(), L.tobytes(), F.shape, problem.minibatch, problem.recompute, scope)


@functools.lru_cache(maxsize=16)
def _own_bound(Fb: bytes, Gb: bytes, Lb: bytes, shape: tuple, minibatch: int, recompute: bool, scope: str) -> int:
    F, G = (np.frombuffer(x, dtype=np.int64).reshape(shape) for x in (Fb, Gb))
    L = np.frombuffer(Lb, dtype=np.int64).reshape(shape[0] - 1, shape[1]) if shape[0] > 1 else np.zeros((0, shape[1]), dtype=np.int64)
    if scope == "1f1b order":  # every schedule's bound holds for that family too: computed once
        own = _own_bound(Fb, Gb, Lb, shape, minibatch, recompute, "any order")
        return own if recompute else max(own, sample_order_bound(F, G, L, minibatch))
    own = stage_bound(F, G, L, minibatch, recompute)
    if not recompute:
        own = untied_bound(F, G, L, minibatch, own)
        if minibatch * (shape[1] - 1) <= MATCHED_FAST_CELLS:
            from .pair_program import pair_program_bound  # (it builds on this module)

            own = matched_bound(F, G, L, minibatch, own)
            own = pair_program_bound(F, G, L, minibatch, own)
    return own


def least_work(dur: np.ndarray, n: int) -> np.ndarray:
    """``out[k]``: least total duration of chunks covering at least ``k`` samples, k = 0..n."""
    mx = len(dur) - 1
    exact = np.full(n + mx + 1, np.iinfo(np.int64).max // 4, dtype=np.int64)
    exact[0] = 0
    for k in range(1, n + mx + 1):
        b = np.arange(1, min(k, mx) + 1)
        exact[k] = np.min(exact[k - b] + dur[b])
    return np.minimum.accumulate(exact[::-1])[::-1][: n + 1]  # "at least k": best over k' >= k


def _pass(avail: np.ndarray, work: np.ndarray) -> np.ndarray:
    """``done[j] = max over m <= j of avail[m] + work[j - m + 1]`` (index 0 unused)."""
    n = len(avail) - 1
    j = np.arange(n + 1)[:, None]
    m = np.arange(n + 1)[None, :]
    valid = (m >= 1) & (m <= j)
    table = np.where(valid, avail[None, :] + work[np.clip(j - m + 1, 0, n)], np.iinfo(np.int64).min // 4)
    done = table.max(axis=1)
    done[0] = 0
    return done


def _forward_arrivals(avail: np.ndarray, F: np.ndarray, L: np.ndarray) -> np.ndarray:
    """``arr[n]``: earliest arrival at the next stage of samples 0..n-1 forwarded by one stage
    whose samples become available at ``avail[n]`` (the whole prefix): F chunks in sample order,
    one at a time, each sent in one message of its size, messages one at a time in that order.
    Then "at least n": the chunk holding sample n-1 may end later.

    ``done`` (the F chain) and ``arr`` (the link) are minimised each on its own, so both are
    lower bounds for every partition, and the last chunk's message is charged at its own size."""
    B = len(avail) - 1
    mx = len(F) - 1
    big = np.iinfo(np.int64).max // 4
    done = np.full(B + 1, big, dtype=np.int64)
    arr = np.full(B + 1, big, dtype=np.int64)
    done[0] = arr[0] = 0
    for hi in range(1, B + 1):
        b = np.arange(1, min(mx, hi) + 1)
        lo = hi - b
        end = np.maximum(done[lo], avail[hi]) + F[b]
        done[hi] = end.min()
        arr[hi] = (np.maximum(end, arr[lo]) + L[b]).min()
    return np.minimum.accumulate(arr[::-1])[::-1]


def heads_and_tails(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int) -> Heads:
    """From integer duration tables ``F[s, b]``, ``G[s, b]`` (B ops), ``L[s, b]`` (link s)."""
    S, mx1 = F.shape
    mx = mx1 - 1
    B = minibatch
    big = np.iinfo(np.int64).max // 4
    KF = [least_work(F[s], B) for s in range(S)]
    KG = [least_work(G[s], B) for s in range(S)]
    lmin = [int(L[s, 1:].min()) for s in range(S - 1)]

    # release: samples 0..n-1 have arrived on s
    release = np.zeros((S, B + 1), dtype=np.int64)
    for s in range(1, S):
        release[s, 1:] = np.minimum(_forward_arrivals(release[s - 1], F[s - 1], L[s - 1])[1:], big)
    tail = np.zeros((S, mx + 1), dtype=np.int64)
    turn = np.zeros((S, mx + 1), dtype=np.int64)
    for b in range(1, mx + 1):
        for s in range(1, S):  # gradients of b samples leave s in one message, then go down to 0
            avail = np.full(b + 1, int(L[s - 1, b]), dtype=np.int64)
            for r in range(s - 1, -1, -1):
                done = _pass(avail, KG[r][: b + 1])
                avail = done + (lmin[r - 1] if r > 0 else 0)
            tail[s, b] = done[b]
        for s in range(S - 1):
            turn[s, b] = _round_trip(L, KF, KG, lmin, s, b)[b]
    # The same walks with each stage's chunks in arrival order (see _chain): a stage's one
    # partition both delays its first samples (large chunks) and costs work (small ones), and
    # messages carry their chunk's size. Neither walk contains the other, so both count.
    # gpt-sim, B=8: tail of an 8-sample chunk off stage 3 18.7 -> 25.0 ms.
    for s in range(1, S):
        tail[s, 1:] = np.maximum(tail[s, 1:], _chain(L[s - 1], [(G[r], L[r - 1] if r else None) for r in range(s - 1, -1, -1)]))
    for s in range(S - 1):
        up = [(F[r], L[r]) for r in range(s + 1, S - 1)]
        down = [(G[r], L[r - 1]) for r in range(S - 2, s, -1)]
        # the last stage holds each chunk for its F and its B, so it counts as one op of both
        turn[s, 1:] = np.maximum(turn[s, 1:], _chain(L[s], [*up, (F[S - 1] + G[S - 1], L[S - 2]), *down]))
    return Heads(release, tail, turn)


def _round_trip(L: np.ndarray, KF: list, KG: list, lmin: list, s: int, b: int) -> np.ndarray:
    """``back[n]``: the first n of ``b`` activations that leave s in one message are back on s as
    gradients no earlier (they go up, every stage above forwards and then backwards them, each
    at the least work for that many samples, messages at one sample's size)."""
    S = len(KF)
    avail = np.full(b + 1, int(L[s, b]), dtype=np.int64)
    for r in range(s + 1, S):
        avail = _pass(avail, KF[r][: b + 1]) + (lmin[r] if r + 1 < S else 0)
    # on the last stage a B follows the F of its samples; then down to s + 1
    avail = _pass(avail, KG[S - 1][: b + 1])
    for r in range(S - 2, s, -1):
        avail = _pass(avail + lmin[r], KG[r][: b + 1])
    return avail + lmin[s]


def _chain(first: np.ndarray, steps: list) -> np.ndarray:
    """``out[b - 1]``: the earliest time all ``b`` samples of one message (``first[b]`` long) are
    done by a chain of otherwise idle stages, ``steps`` = [(dur, link to the next or None)].

    Each stage takes the samples in the order they arrive, in chunks of consecutive arrivals, a
    chunk waiting for all of its samples: as good as any grouping and order (give the j-th chunk
    the earliest samples not yet taken; no chunk then starts later). A chunk may also hold
    samples from outside the message, so it costs at least the cheapest chunk of its size or
    more. :func:`_in_order_done` gives, per prefix, the earliest end and arrival downstream.
    """
    mx = len(first) - 1
    mono = lambda a: np.minimum.accumulate(a[::-1])[::-1]  # noqa: E731
    # row b - 1: the message of b samples (columns past b are never read for that row)
    avail = np.repeat(first[1:, None], mx + 1, axis=1).astype(np.int64)
    for dur, link in steps:
        avail[:, 0] = 0
        avail = _in_order_done(avail, mono(dur), None if link is None else mono(link))
    return avail[np.arange(mx), np.arange(1, mx + 1)]


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
    lo_T = _least(lambda T: all(_reachable(T, h, F, G, s, cuts[s], KG[s], B, recompute) for s in range(S)), 0, top)
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
            lo_T = _least(ok, lo_T, lo_T + step)
    return lo_T


# The large-chunk cut's program keeps two sums per state; past this many (sample, size) cells
# it costs seconds (S=4, B=64: 30 s), so larger instances keep the bound without it.
LARGE_CHUNKS_MAX_CELLS = 1024


def _large_chunks_ok(T: int, h: Heads, F: np.ndarray, G: np.ndarray, s: int, cut: np.ndarray, B: int, c: int) -> bool:
    """Has stage s a partition meeting :func:`_reachable`'s cuts and the large-chunk cut for ``c``?

    The large-chunk cut: from the release of a chunk of at least ``c`` samples, the stage runs
    the F and B ops of it and of every later chunk of at least ``c`` samples, one at a time; the
    last of them to end is a B op (each F precedes its B), so the least tail of a chunk of ``c``
    or more follows. The suffix cut charges the least tail of *any* later chunk, so a partition
    with one small chunk at the end escapes it however many large chunks drain before; here
    their drains count. gpt-sim, S=4, B=32: the bound's best partition on the last stage had
    two chunks of 12 and 15, which this cut charges 108 ms against a bound of 92.

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
                    _keep_undominated(here.setdefault(state, []), work, large_work)
    return bool(fronts[0])


def _tail_levels(tails: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct drains of a stage's chunk sizes, ascending, then 0 for "no chunk yet" (never
    read by a cut); and each size's index among them (``level_of[b]``, b = 1..max size)."""
    levels = np.unique(tails)
    return np.append(levels, 0), np.concatenate([[0], np.searchsorted(levels, tails)])


def _least(ok, lo: int, hi: int, tol: int = 0) -> int:
    """The least ``T`` in ``[lo, hi]`` with ``ok(T)``, for an ``ok`` that only grows with ``T``
    and holds at ``hi``; with ``tol``, a ``T`` at most that far below it (every smaller one fails,
    so it is still a bound)."""
    while hi - lo > tol:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


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
    T: int, h: Heads, F: np.ndarray, G: np.ndarray, s: int, cut: np.ndarray, KG: np.ndarray, B: int, recompute: bool
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
    if _compiled is not None and compiled:
        own = F[s] if recompute else F[s] + G[s]
        kg = np.array([KG[B - lo] if recompute else 0 for lo in range(B)], dtype=np.int64)
        W = _compiled.suffix_work(int(T), cut_ok, rel, own, level_of, levels, kg, B)
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
    suffix starting with it meets both. vgg16-cpu, B=32, stage 2: 108 of 528 chunks at 2% above
    the stage cuts, 377 at 10%.
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
                use[lo, b] = bool(((W[hi] < big) & (rel[hi] + work + levels[state] <= T) & (work <= A[lo, state])).any())
    return use


def linear_cuts(
    problem, heads: Heads, s: int, chunks, x: dict, y: dict, fdur: dict, bdur: dict, later_f: list, later_b: list, gpipe: bool
):
    """Linear cuts ``makespan >= sum(coef * var) + rest`` on stage s, in the tables' units.

    Exactly one chunk holds sample i, so a sum over the chunks holding i, each weighted by what
    that chunk forces, is a valid bound in every schedule; unlike "if this chunk is used, then"
    implications (big-M terms), it keeps its strength in the LP relaxation, which then sees what
    each chunk size costs. ``later_f[i]`` and ``later_b[i]`` are the model's expressions for the F
    and B work of chunks ending after sample i (see :func:`chunks_ending_at`).

    * chunk cut: the chunk holding i starts after its release, then its F, its gradients'
      turnaround, its B and the drain after it follow one another;
    * suffix cut: from the start of the chunk holding i, the stage still runs every F chunk from
      there on and the B ops that need them (in GPipe order all B ops), then a drain.
    """
    rel, tail, turn = heads.release[s], heads.tail[s], heads.turn[s]
    size = {c: c[1] - c[0] for c in chunks}
    tail_min = int(tail[1:].min())
    for i in range(problem.minibatch):
        holding = [c for c in chunks if c[0] <= i < c[1]]
        if not problem.recompute:
            yield [(int(rel[c[1]] + fdur[c] + turn[size[c]] + bdur[c] + tail[size[c]]), x[c]) for c in holding], 0
        else:
            yield [(int(rel[c[1]] + fdur[c] + bdur[c] + tail[size[c]]), y[c]) for c in holding], 0
        terms = [(int(rel[c[1]]), x[c]) for c in holding]
        if gpipe:
            yield terms + [(int(tail[size[c]]), y[c]) for c in chunks if c[0] == 0], later_f[i] + later_b[0]
        else:
            yield terms, later_f[i] + later_b[i] + tail_min


def chunks_ending_at(chunks, minibatch: int) -> list[list]:
    """``out[i]``: the chunks whose last sample is i, so that the work of chunks ending after i
    chains as ``later[i] = later[i + 1] + sum over out[i]`` (linear size, not quadratic)."""
    out = [[] for _ in range(minibatch)]
    for c in chunks:
        out[c[1] - 1].append(c)
    return out


# --- schedules whose stages run their B ops in sample order ------------------------------------
#
# When every stage runs its B ops in sample order (1F1B, whatever its warm-ups), the samples after
# a chunk are backwarded after it, everywhere, so the drain after a chunk's B is known to include
# them, and each lower stage's B ops form one in-order chain that a single-stage recursion solves
# exactly. Both cuts of :func:`stage_bound` lose these: in a free order any chunk may be the last
# backwarded one. Without recompute only (B chunks are then the F chunks).


def sample_order_bound_ms(problem) -> float:
    """:func:`sample_order_bound` in ms with the optimizer step (needs recompute off)."""
    F, G, L = int_tables(problem)
    return sample_order_bound(F, G, L, problem.minibatch) / 1000 + problem.tables.optimizer_ms


def backwards_in_sample_order(ops) -> bool:
    """Does every stage's op list run its B ops in sample order (the 1F1B family)?"""
    return all([lo for kind, lo, _ in st if kind == "B"] == sorted(lo for kind, lo, _ in st if kind == "B") for st in ops)


def drains(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int) -> np.ndarray:
    """``D[s, b, m]``: after a ``b``-sample B op ends on stage s, with ``m`` later samples still to
    backward there, the iteration runs at least this long (B ops in sample order everywhere).

    The chunk's gradients reach s - 1 in one message; the later samples' follow at the pace of the
    least B work on s. Each lower stage then backwards the samples in order, in chunks that wait
    for all their samples (the exact earliest ends for one stage, :func:`_in_order_done`); the
    last stage's end is the drain. Every stage is assumed free of other work, so this is a bound.
    """
    S, mx1 = F.shape
    mx, B = mx1 - 1, minibatch
    KG = [least_work(G[s], B) for s in range(S)]
    mono = [np.minimum.accumulate(G[s][::-1])[::-1] for s in range(S)]  # a chunk of >= c samples
    lmin = [int(L[s, 1:].min()) for s in range(S - 1)]
    D = np.zeros((S, mx + 1, B + 1), dtype=np.int64)
    b = np.arange(1, mx + 1)
    for s in range(S):
        if s == 0:  # nothing below: the later samples' own B work
            D[0, 1:, :] = KG[0][None, :]
            continue
        first = L[s - 1, b][:, None]  # (sizes, 1): the chunk's message
        n = np.arange(B + 1)[None, :]
        later = KG[s][np.clip(n - b[:, None], 0, B)] + lmin[s - 1]
        avail = np.where(n <= b[:, None], first, np.maximum(first, later))  # first n of the samples
        avail[:, 0] = 0
        for r in range(s - 1, 0, -1):
            avail = _in_order_done(avail, mono[r], np.minimum.accumulate(L[r - 1][::-1])[::-1])
            avail[:, 0] = 0
        done = _in_order_done(avail, mono[0])
        # D[s, b, m] = all b + m samples done on stage 0
        idx = np.clip(b[:, None] + np.arange(B + 1)[None, :], 0, B)
        D[s, 1:, :] = np.where(b[:, None] + np.arange(B + 1)[None, :] <= B, np.take_along_axis(done, idx, axis=1), 0)
    return D


def _in_order_done(avail: np.ndarray, dur: np.ndarray, link: Optional[np.ndarray] = None) -> np.ndarray:
    """``done[., n]``: earliest end of one stage's in-order chunks over the first n samples of a
    set whose first n have arrived at ``avail[., n]`` (rows: independent sets); a chunk waits
    for all its samples, ``dur[c]`` is a chunk of c samples. With ``link`` (``link[c]``: a
    message of c samples), the earliest arrival of the first n at the next stage instead, each
    chunk sent in one message, messages one at a time in order (each of ``done`` and the
    arrivals minimised on its own, so both stay bounds for every partition)."""
    R, N1 = avail.shape
    mx = len(dur) - 1
    done = np.zeros((R, N1), dtype=np.int64)
    arr = np.zeros((R, N1), dtype=np.int64)
    for n in range(1, N1):
        c = np.arange(1, min(mx, n) + 1)
        end = np.maximum(done[:, n - c], avail[:, n : n + 1]) + dur[c][None, :]
        done[:, n] = end.min(axis=1)
        if link is not None:
            arr[:, n] = (np.maximum(end, arr[:, n - c]) + link[c][None, :]).min(axis=1)
    if link is None:
        return done
    return np.minimum.accumulate(arr[:, ::-1], axis=1)[:, ::-1]  # the chunk holding sample n-1 may end later


def sample_order_bound(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int, pareto_max: int = 64) -> int:
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
        top = int(h.release[s, B] + grel[s, B] + (F[s, 1:] + G[s, 1:]).max() * B + h.turn[s].max() + D[s].max()) + 1
        lo_T = best
        for pareto in programs:  # the pairs' program starts from the single chains' bound, which is lower
            lo_T = _least(lambda T: _in_order_ok(T, h, F, G, D, cut[s], s, B, pareto), lo_T, top)
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


def in_order_usable_chunks(T: int, h: Heads, io: InOrderHeads, F: np.ndarray, G: np.ndarray, s: int, B: int) -> np.ndarray:
    """:func:`usable_chunks` among schedules whose stages run B ops in sample order: also a
    partition meeting :func:`sample_order_bound`'s program (every undominated ``(A, E)``) within
    ``T``. From the first chunk up, the undominated pairs reachable at each sample; from the last
    chunk down, the most ``(A, E)`` pairs from which the rest still meets ``T`` (the program only
    grows with ``A`` and ``E``, so those are a set's maximal points); a chunk is usable when a pair
    before it leads into one after it. Cheap (0.1 s at S=4, B=32); near :func:`sample_order_bound`
    it keeps few of the bottleneck stage's chunks (vgg16-cpu, B=32, stage 2: 8 of 528 at that bound,
    156 at 1% above it), further from it about what :func:`usable_chunks` keeps."""
    mx = F.shape[1] - 1
    rel, W, D, cut = h.release[s], F[s] + G[s], io.drain[s], io.cut[s]

    def step(lo: int, b: int, a: int, e: int) -> tuple[int, int]:
        a2 = max(a, int(rel[lo + b])) + int(W[b])
        return a2, max(e + int(G[s, b]), a2, int(cut[lo, b]))

    def fits(lo: int, b: int) -> bool:
        return int(cut[lo, b]) + int(D[b, B - lo - b]) <= T

    ahead = _in_order_fronts(T, h, F, G, io.drain, cut, s, B)
    # maximal points, kept negated so that _keep_undominated keeps them
    behind: list[list[tuple[int, int]]] = [[] for _ in range(B + 1)]
    behind[B] = [(-_BIG // 4, -_BIG // 4)]
    for hi in range(B, 0, -1):
        for b in range(1, min(mx, hi) + 1):
            lo = hi - b
            if fits(lo, b):
                for na, ne in behind[hi]:
                    X = min(-na, T - int(D[b, B - hi]))  # the most A and E at hi
                    Y = min(-ne, T - int(D[b, B - hi]))
                    XA = min(X, Y)  # E >= A
                    if int(rel[hi]) + int(W[b]) <= XA and int(cut[lo, b]) <= Y:
                        _keep_undominated(behind[lo], -(XA - int(W[b])), -(Y - int(G[s, b])))
    use = np.zeros((B, mx + 1), dtype=bool)
    for lo in range(B):
        for b in range(1, min(mx, B - lo) + 1):
            if fits(lo, b):
                ends = [(a2, e2) for a2, e2 in (step(lo, b, a, e) for a, e in ahead[lo]) if e2 + int(D[b, B - lo - b]) <= T]
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
    T: int, h: Heads, F: np.ndarray, G: np.ndarray, D: np.ndarray, cut: np.ndarray, s: int, B: int, pareto: bool
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


def _in_order_fronts(T: int, h: Heads, F: np.ndarray, G: np.ndarray, D: np.ndarray, cut: np.ndarray, s: int, B: int) -> list:
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
                    _keep_undominated(fronts[hi], a2, e2)
    return fronts


def _keep_undominated(front: list[tuple[int, int]], a: int, e: int) -> None:
    """Add (a, e) to ``front`` unless a pair there is no larger in both; drop the pairs it beats.
    ``front`` stays sorted by ``a`` (so ``e`` falls along it), which makes both checks a bisection."""
    i = bisect.bisect_right(front, (a, _BIG))
    if i and front[i - 1][1] <= e:
        return
    j = k = bisect.bisect_left(front, (a, -_BIG))
    while k < len(front) and front[k][1] >= e:
        k += 1
    front[j:k] = [(a, e)]


_BIG = np.iinfo(np.int64).max


# Any order, in sample order. Take any schedule without recompute and, on every stage, give its
# B ops new sample ranges in the order they run: the first one run takes samples [0, b1), the next
# [b1, b1 + b2), and so on, each keeping its size and time slot. Nothing else changes (F ops,
# messages: same sizes at the same times), and every op is still ready when it starts: j B ops
# in, the old ones held some j-sized set of samples, all forwarded and with their gradients in,
# so the first j samples are too (F ops and links are in sample order). Memory counts samples, so
# it is the same. The new schedule runs every stage's B ops in sample order, but its B ranges are
# no longer the F ranges (their sizes are a permutation of them), which the spec only allows with
# recompute. So every schedule's makespan is at least the least makespan of *untied* schedules:
# B ops in sample order, their sizes a permutation of the stage's F sizes, no-recompute costs.
# That problem has the structure of the 1F1B family that CP-SAT handles well (chains in sample
# order), and bounds on it hold for every schedule (tests check the exchange and the bounds
# against brute force). What changes for the heads: a B chunk need not wait for a whole F chunk's
# samples, and the last stage's B chunks are not its F chunks.


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
            back = _round_trip(L, KF, KG, lmin, s, b)
            last[s, b], first[s, b] = back[b], back[1]
    for s in range(S - 1):
        up = [(F[r], L[r]) for r in range(s + 1, S - 1)]
        down = [(G[r], L[r - 1]) for r in range(S - 2, s, -1)]
        last[s, 1:] = np.maximum(last[s, 1:], _chain(L[s], [*up, (F[S - 1], None), (G[S - 1], L[S - 2] if S > 1 else None), *down]))
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
        # and the stage's two chains exactly (:func:`_two_chains` with no deadline): the least
        # end of a state with n samples backwarded
        t = _two_chains(big, F[r], G[r], rel, ready, np.zeros(mx + 1, dtype=np.int64), np.zeros((mx + 1, B + 1), dtype=np.int64), B)
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
    may be backwarded last, here the later samples follow the earlier ones (gpt-sim, S=4, B=32:
    94.4 -> 100.5 ms; vgg16-cpu: 281.3 -> 301.2; S=8, B=256: 313.7 -> 358.9, in 7 s). ``known``: a bound already
    proven (the stage cuts), where the search starts; the result is never below it."""
    B = minibatch
    best = known
    for s, h, ut, ends in _untied_stages(F, G, L, B):
        if best and _two_chains(best, F[s], G[s], *ends, B) is not None:
            continue  # this stage's bound is no higher
        top = int(h.release[s, B] + ut.grad_ready[s, B] + (F[s, 1:] + G[s, 1:]).max() * B + ends[2].max(initial=0) + ends[3][ends[3] < _BIG // 4].max(initial=0)) + 1
        # to a ten-thousandth: each step is a program over (B + 1)^2 / 2 states
        best = max(best, _least(lambda T: _two_chains(T, F[s], G[s], *ends, B) is not None, best, top, best // 10_000))
    return best


def _untied_stages(F: np.ndarray, G: np.ndarray, L: np.ndarray, B: int):
    """``(s, heads, untied heads, stage s's inputs to the programs)``, last stage first."""
    h = heads_and_tails(F, G, L, B)
    ut = untied_heads(F, G, L, h, B)
    for s in range(F.shape[0] - 1, -1, -1):
        yield s, h, ut, _untied_limits(h, ut, F, G, s, B)


def _untied_limits(h: Heads, ut: UntiedHeads, F: np.ndarray, G: np.ndarray, s: int, B: int):
    """Stage s's inputs to :func:`_two_chains`: F releases, B readiness, and what runs after an F
    op of b samples (its last sample's gradient back, then some B op and its drain) and after a
    B op of b samples ending at sample j (tail, drain)."""
    S, mx = F.shape[0], F.shape[1] - 1
    b = np.arange(1, mx + 1)
    after_b = np.full((mx + 1, B + 1), _BIG // 4, dtype=np.int64)
    for j in range(1, B + 1):
        bb = b[b <= j]
        after_b[bb, j] = np.maximum(h.tail[s, bb], ut.drain[s, bb, B - j])
    # whichever B op holds that sample, with however many samples after it
    m = np.arange(B + 1)[None, :]
    drain = np.where(b[:, None] + m <= B, ut.drain[s, 1:, :], _BIG // 4).min(axis=1)
    least_b = int((G[s, 1:] + np.maximum(h.tail[s, 1:], drain)).min())
    after_f = np.zeros(mx + 1, dtype=np.int64)
    after_f[1:] = (ut.turn_last[s, 1:] if s < S - 1 else 0) + least_b
    return h.release[s], ut.grad_ready[s], after_f, after_b


def _two_chains(
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
    if _compiled is not None and compiled:
        t, reached = _compiled.two_chains(int(T), Fs, Gs, rel, ready, after_f, after_b, B)
        return t if reached else None
    mx = len(Fs) - 1
    big = _BIG // 4
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


def untied_latest(T: int, h: Heads, ut: UntiedHeads, F: np.ndarray, G: np.ndarray, s: int, B: int) -> np.ndarray:
    """``late[i, j]``: the latest end of stage s's state (i forwarded, j backwarded) in
    :func:`_two_chains`'s program from which (B, B) is still reached meeting ``T``; a large
    negative number where none is."""
    mx = F.shape[1] - 1
    big = _BIG // 4
    rel, ready, after_f, after_b = _untied_limits(h, ut, F, G, s, B)
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
        nxt = np.minimum(late[i, np.clip(j + b, 0, B)], T - after_b[np.broadcast_to(b, (len(i), mx)), np.clip(j + b, 0, B)])
        ok = k & (ready[np.clip(j + b, 0, B)] + G[s, b] <= nxt)
        cand = np.maximum(cand, np.where(ok, nxt - G[s, b], -big).max(axis=1))
        late[i[:, 0], j[:, 0]] = cand
    return late


def untied_usable_chunks(T: int, h: Heads, ut: UntiedHeads, F: np.ndarray, G: np.ndarray, s: int, B: int) -> tuple[np.ndarray, np.ndarray]:
    """``(f_use, b_use)``, each ``[lo, b]``: the F and the B chunks of stage s that some run of
    :func:`_two_chains`'s program meeting ``T`` holds (a state reached in time from the start
    from which the end is still reached in time, through that chunk). All False where none meets it."""
    mx = F.shape[1] - 1
    big = _BIG // 4
    rel, ready, after_f, after_b = _untied_limits(h, ut, F, G, s, B)
    f_use = np.zeros((B + 1, mx + 1), dtype=bool)
    b_use = np.zeros((B + 1, mx + 1), dtype=bool)
    t = _two_chains(T, F[s], G[s], rel, ready, after_f, after_b, B)
    if t is None:
        return f_use[:B], b_use[:B]
    late = untied_latest(T, h, ut, F, G, s, B)
    for i in range(B):
        for bb in range(1, min(mx, B - i) + 1):  # F [i, i + bb) from some (i, j), j <= i
            js = np.arange(i + 1)
            end = np.maximum(t[i, js], rel[i + bb]) + F[s, bb]
            f_use[i, bb] = bool(((t[i, js] < big) & (end <= np.minimum(late[i + bb, js], T - after_f[bb]))).any())
    for j in range(B):
        for bb in range(1, min(mx, B - j) + 1):  # B [j, j + bb) from some (i, j), i >= j + bb
            i = np.arange(j + bb, B + 1)
            end = np.maximum(t[i, j], ready[j + bb]) + G[s, bb]
            b_use[j, bb] = bool(((t[i, j] < big) & (end <= np.minimum(late[i, j + bb], T - after_b[bb, j + bb]))).any())
    return f_use[:B], b_use[:B]


# Matched: what the untied schedules forget. The exchange above keeps every B op's size and time
# slot, and before the exchange each B op had its own chunk's F op, of the same size, ended before
# it. So in every schedule, turned untied, each B op of b samples can be matched to a different
# earlier F op of b samples. A program over (i forwarded, j backwarded, the sizes of the F ops not
# matched yet) keeps that; and it knows the B work still owed for those open F ops exactly (each
# gets one B op of its size), which with the least F and B work of the samples not yet forwarded
# is a floor on what the stage must still run. The untied program lets a stage forward in small
# chunks (short heads) and backward in large ones (cheap work); here the small F chunks owe small,
# dear B ops. gpt-cpu, S=4, B=32, its last stage: 139.15 -> 141.62 ms. The open sizes make the
# states many (up to ~200,000 per diagonal at B=32, seconds per target in Python), so there it
# runs beside the search (auto), under a cap on states; small instances have it in the fast bound.

MATCHED_MAX_STATES = 4_000_000
# up to this B x max size the matched program takes hundredths of a second (S=4, B=8: 0.02 s) and
# joins the fast bound (gpt-cpu, B=8: 49.08 -> 50.08 ms, the optimum is 50.55); beyond, seconds.
# So does the pair program (:mod:`.pair_program`; S=4, B=8: 0.2-0.5 s; vgg16-cpu 147.10 -> 153.50)
MATCHED_FAST_CELLS = 64
# only stages whose untied bound is within 1/MATCHED_REACH of the best are searched (the lift on
# gpt-cpu's last stage is 1.8%)
MATCHED_REACH = 25


def matched_bound(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int, known: int = 0, max_states: int = MATCHED_MAX_STATES) -> int:
    """A lower bound on every schedule (any order, no recompute), never below ``known`` (see
    above): for each stage, the least ``T`` whose matched program reaches the end, to a
    two-thousandth. A program past ``max_states`` states counts as reaching it (no lift)."""
    B = minibatch
    best = known
    for s, _, _, ends in _untied_stages(F, G, L, B):
        if _two_chains(best - best // MATCHED_REACH, F[s], G[s], *ends, B) is not None:
            continue  # its untied bound is too far below to be lifted above ``best`` (seconds saved)
        owed = least_work(F[s] + G[s], B)

        def ok(T: int) -> bool:
            return _matched(T, F[s], G[s], *ends, owed, B, max_states) is not False

        if ok(best):
            continue  # this stage's bound is no higher
        # up in growing steps from what is proven (the lifts are a few percent, and a program far
        # above its optimum has many more states), then halve the last step
        lo, step = best + 1, max(1, best // 200)
        while not ok(lo + step):
            lo, step = lo + step + 1, 2 * step
        best = max(best, _least(ok, lo, lo + step, best // 2000))
    return best


def _matched(T: int, Fs, Gs, rel, ready, after_f, after_b, owed, B: int, max_states: int) -> Optional[bool]:
    """Does one stage's matched program reach (B, B) with every op meeting ``T``? None: gave up.
    States by anti-diagonal; per (i, j) the least end of each multiset of open sizes (a sorted
    tuple), with the B work it owes."""
    mx = len(Fs) - 1
    rel, ready, after_f, owed = (np.asarray(a).tolist() for a in (rel, ready, after_f, owed))
    Fs, Gs, after_b = Fs.tolist(), Gs.tolist(), after_b.tolist()
    layers: dict = {(0, 0): {(): (0, 0)}}
    seen = 0
    for d in range(2 * B):
        for i in range((d + 1) // 2, min(d, B) + 1):
            cur = layers.pop((i, d - i), None)
            if not cur:
                continue
            j = d - i
            seen += len(cur)
            if seen > max_states:
                return None
            for opened, (e, w) in cur.items():
                for b in range(1, min(mx, B - i) + 1):  # an F op [i, i + b)
                    end = max(e, rel[i + b]) + Fs[b]
                    if end + after_f[b] > T or end + w + Gs[b] + owed[B - i - b] > T:
                        continue
                    k = bisect.bisect(opened, b)
                    key = (*opened[:k], b, *opened[k:])
                    nxt = layers.setdefault((i + b, j), {})
                    if key not in nxt or nxt[key][0] > end:
                        nxt[key] = (end, w + Gs[b])
                last = 0
                for k, b in enumerate(opened):  # a B op of an open size b: [j, j + b)
                    if b == last:
                        continue
                    last = b
                    end = max(e, ready[j + b]) + Gs[b]
                    if end + after_b[b][j + b] > T or end + w - Gs[b] + owed[B - i] > T:
                        continue
                    key = opened[:k] + opened[k + 1 :]
                    nxt = layers.setdefault((i, j + b), {})
                    if key not in nxt or nxt[key][0] > end:
                        nxt[key] = (end, w - Gs[b])
    return (B, B) in layers
