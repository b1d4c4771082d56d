"""Heads and tails: how early an op can start and how long the pipeline must run after it ends.

The exact models add these as redundant constraints, and every bound of this package is built on
them. They hold for every schedule of the cost model, in any op order, so they cut nothing
feasible; they tell a solver early what the pipeline's shape costs (a large chunk cannot start
before the stages below have forwarded all its samples; a large last backward leaves a long
drain), which its relaxation does not see by itself.

All values are integer microseconds computed from the same floored durations the models use, so
every bound is satisfied by the model's own times. The one argument behind all of them: if ``j``
samples of a set are done on a stage and ``m`` of the set were available there at time ``c(m)``,
the chunks holding the last ``j - m + 1`` to become available all started after ``c(m)`` and cover
at least that many samples, so they took at least the least work for that many samples.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import numpy as np

# what this package calls the compiled one-stage programs with (their VERSION)
_STAGE_PROGRAMS_VERSION = 1
try:  # two_chains and the stage cuts' suffix program compiled (setup.py); where they did not build, numpy
    from . import _stage_programs as stage_programs
except ImportError:  # pragma: no cover - depends on the install
    stage_programs = None
if (
    stage_programs is not None and getattr(stage_programs, "VERSION", None) != _STAGE_PROGRAMS_VERSION
):  # pragma: no cover
    stage_programs = None  # an editable install whose rebuild failed keeps the module it built before

# whether the one-stage programs run compiled
COMPILED = stage_programs is not None

__all__ = [
    "COMPILED",
    "BIG",
    "Heads",
    "int_tables",
    "least_work",
    "heads_and_tails",
    "round_trip",
    "chain",
    "in_order_done",
    "drains",
    "least_true",
    "keep_undominated",
    "linear_cuts",
]

BIG = np.iinfo(np.int64).max


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
            turn[s, b] = round_trip(L, KF, KG, lmin, s, b)[b]
    # The same walks with each stage's chunks in arrival order (see chain): a stage's one
    # partition both delays its first samples (large chunks) and costs work (small ones), and
    # messages carry their chunk's size. Neither walk contains the other, so both count.
    for s in range(1, S):
        tail[s, 1:] = np.maximum(
            tail[s, 1:], chain(L[s - 1], [(G[r], L[r - 1] if r else None) for r in range(s - 1, -1, -1)])
        )
    for s in range(S - 1):
        up = [(F[r], L[r]) for r in range(s + 1, S - 1)]
        down = [(G[r], L[r - 1]) for r in range(S - 2, s, -1)]
        # the last stage holds each chunk for its F and its B, so it counts as one op of both
        turn[s, 1:] = np.maximum(turn[s, 1:], chain(L[s], [*up, (F[S - 1] + G[S - 1], L[S - 2]), *down]))
    return Heads(release, tail, turn)


def round_trip(L: np.ndarray, KF: list, KG: list, lmin: list, s: int, b: int) -> np.ndarray:
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


def chain(first: np.ndarray, steps: list) -> np.ndarray:
    """``out[b - 1]``: the earliest time all ``b`` samples of one message (``first[b]`` long) are
    done by a chain of otherwise idle stages, ``steps`` = [(dur, link to the next or None)].

    Each stage takes the samples in the order they arrive, in chunks of consecutive arrivals, a
    chunk waiting for all of its samples: as good as any grouping and order (give the j-th chunk
    the earliest samples not yet taken; no chunk then starts later). A chunk may also hold
    samples from outside the message, so it costs at least the cheapest chunk of its size or
    more. :func:`in_order_done` gives, per prefix, the earliest end and arrival downstream.
    """
    mx = len(first) - 1
    mono = lambda a: np.minimum.accumulate(a[::-1])[::-1]  # noqa: E731
    # row b - 1: the message of b samples (columns past b are never read for that row)
    avail = np.repeat(first[1:, None], mx + 1, axis=1).astype(np.int64)
    for dur, link in steps:
        avail[:, 0] = 0
        avail = in_order_done(avail, mono(dur), None if link is None else mono(link))
    return avail[np.arange(mx), np.arange(1, mx + 1)]


def least_true(ok, lo: int, hi: int, tol: int = 0) -> int:
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


def linear_cuts(
    problem,
    heads: Heads,
    s: int,
    chunks,
    x: dict,
    y: dict,
    fdur: dict,
    bdur: dict,
    later_f: list,
    later_b: list,
    gpipe: bool,
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
            yield (
                [(int(rel[c[1]] + fdur[c] + turn[size[c]] + bdur[c] + tail[size[c]]), x[c]) for c in holding],
                0,
            )
        else:
            yield [(int(rel[c[1]] + fdur[c] + bdur[c] + tail[size[c]]), y[c]) for c in holding], 0
        terms = [(int(rel[c[1]]), x[c]) for c in holding]
        if gpipe:
            yield terms + [(int(tail[size[c]]), y[c]) for c in chunks if c[0] == 0], later_f[i] + later_b[0]
        else:
            yield terms, later_f[i] + later_b[i] + tail_min


def drains(F: np.ndarray, G: np.ndarray, L: np.ndarray, minibatch: int) -> np.ndarray:
    """``D[s, b, m]``: after a ``b``-sample B op ends on stage s, with ``m`` later samples still to
    backward there, the iteration runs at least this long (B ops in sample order everywhere).

    The chunk's gradients reach s - 1 in one message; the later samples' follow at the pace of the
    least B work on s. Each lower stage then backwards the samples in order, in chunks that wait
    for all their samples (the exact earliest ends for one stage, :func:`in_order_done`); the
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
            avail = in_order_done(avail, mono[r], np.minimum.accumulate(L[r - 1][::-1])[::-1])
            avail[:, 0] = 0
        done = in_order_done(avail, mono[0])
        # D[s, b, m] = all b + m samples done on stage 0
        idx = np.clip(b[:, None] + np.arange(B + 1)[None, :], 0, B)
        D[s, 1:, :] = np.where(
            b[:, None] + np.arange(B + 1)[None, :] <= B, np.take_along_axis(done, idx, axis=1), 0
        )
    return D


def in_order_done(avail: np.ndarray, dur: np.ndarray, link: Optional[np.ndarray] = None) -> np.ndarray:
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


def keep_undominated(front: list[tuple[int, int]], a: int, e: int) -> None:
    """Add (a, e) to ``front`` unless a pair there is no larger in both; drop the pairs it beats.
    ``front`` stays sorted by ``a`` (so ``e`` falls along it), which makes both checks a bisection."""
    i = bisect.bisect_right(front, (a, BIG))
    if i and front[i - 1][1] <= e:
        return
    j = k = bisect.bisect_left(front, (a, -BIG))
    while k < len(front) and front[k][1] >= e:
        k += 1
    front[j:k] = [(a, e)]
