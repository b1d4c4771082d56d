"""The pair program: two adjacent stages' untied schedules by a dynamic program in time order.

The pair models of :mod:`.pairs` hand two adjacent stages to CP-SAT, which settles them at
S=4, B=12 but at B=32 proves little in a minute (vgg16-cpu: 301.2 -> 302.6 ms). This is the
same relaxation (untied schedules, :mod:`.bounds`, "Any order, in sample order": each stage's F
and B ops in sample order, every other stage as heads and tails) by a program instead, with
one more relaxation that keeps its states few.

Take the ops of both stages in the order they start. A state is how far each of the four chains
has got: ``a`` samples forwarded and ``b`` backwarded on the upper stage ``U = s``, ``f`` and ``g``
on the lower one ``W = s + 1``. A label on it is when each stage is free again (never before the
last op's start: later ops start no earlier) and what the last op of each stage still owes the
other: if U's last op is an F of ``n`` samples, those samples reach W only at its end plus their
message; if W's last op is a B of ``n`` samples, their gradients reach U only then. An op that
needs samples of an older op waits for nothing: that op ended before the other stage's last op
started, so before this one starts, up to a message's time, which is dropped (the relaxation).
Every schedule, its ops taken in start order, passes through labels no later than its own times
(by induction over the ops), so the least ``T`` whose program reaches the end bounds it; labels
no later in every field than another on the same state stand for it (the program is monotone).
States past the one-stage programs' latest ends (:func:`.bounds.untied_latest`) are dropped.

vgg16-cpu, S=4, B=32, stages 2 and 3: 301.18 -> 305.14 ms in about 10 s (1-2 s a target), against
CP-SAT's 302.6 in a minute; B=16: 207.3 in 1-2 s (CP-SAT's untied pair model: 206.2 in a minute,
and its exact value lies in 209.0 .. 210.5, the GA's best is 211.5). What it leaves out is that a B
op runs an F op's samples (untied, B ranges are any): the stage forwards small chunks to start
early and backwards large ones to work little, which no schedule does (the matched program of
:mod:`.bounds` puts that back for one stage).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from .bounds import Heads, UntiedHeads, _least, _untied_limits, heads_and_tails, untied_heads, untied_latest, untied_usable_chunks, usable_chunks

__all__ = ["pair_program_feasible", "pair_program_bound"]


# states the dive visits before the program takes over (a tenth of a second or so)
DIVE_STATES = 5_000


class _OutOfTime(Exception):
    pass


def pair_program_feasible(
    T: int, F: np.ndarray, G: np.ndarray, L: np.ndarray, h: Heads, ut: UntiedHeads, minibatch: int, s: int, deadline: Optional[float] = None
) -> bool:
    """Does the program of stages ``s`` and ``s + 1`` reach the end with every op meeting ``T``
    (integer tables of :func:`.bounds.int_tables`)? Raises ``_OutOfTime`` past ``deadline``."""
    B, mx = minibatch, min(F.shape[1] - 1, minibatch)
    U, W = s, s + 1
    # --- the chunks each stage may use, and each stage's own limits ---------------------------
    sizes = []  # [stage][kind][lo]: the usable chunk sizes starting at sample lo
    for r in (U, W):
        f_use, b_use = untied_usable_chunks(T, h, ut, F, G, r, B)
        f_use &= usable_chunks(T, h, F, G, r, B)
        if not f_use.any():
            return False
        sizes.append([[[c for c in range(1, mx + 1) if lo + c <= B and use[lo, c]] for lo in range(B)] for use in (f_use, b_use)])
    limits = [_untied_limits(h, ut, F, G, r, B) for r in (U, W)]
    rel = [lim[0].tolist() for lim in limits]  # F ops ending at sample n start no earlier
    ready = [lim[1].tolist() for lim in limits]  # B ops ending at sample n start no earlier
    after_f = [lim[2].tolist() for lim in limits]  # what runs after an F op of c samples
    after_b = [lim[3].tolist() for lim in limits]  # ... after a B op of c samples ending at n
    latest = [untied_latest(T, h, ut, F, G, r, B).tolist() for r in (U, W)]  # per (i, j)
    dur_f = [F[r].tolist() for r in (U, W)]
    dur_b = [G[r].tolist() for r in (U, W)]
    link = L[U].tolist()

    def moves(key: tuple[int, int, int, int], label: tuple[int, int, int, int]):
        """The labels one op on from ``label`` on state ``key``, as (key, label)."""
        a, b, f, g = key
        tU, tW, na, ng = label
        if tU > latest[0][a][b] or tW > latest[1][f][g]:
            return
        for c in sizes[0][0][a] if a < B else ():  # F on U
            start = max(tU, rel[0][a + c])
            end = start + dur_f[0][c]
            if end + after_f[0][c] <= T:
                yield (a + c, b, f, g), (end, max(tW, start), c, ng)
        for c in sizes[0][1][b] if b < g else ():  # B on U, after W's B of its samples
            if b + c > g:
                break
            start = max(tU, ready[0][b + c], tW + link[ng] if b + c > g - ng else 0)
            end = start + dur_b[0][c]
            if end + after_b[0][c][b + c] <= T:
                yield (a, b + c, f, g), (end, max(tW, start), 0, ng)
        for c in sizes[1][0][f] if f < a else ():  # F on W, after U's F of its samples
            if f + c > a:
                break
            start = max(tW, rel[1][f + c], tU + link[na] if f + c > a - na else 0)
            end = start + dur_f[1][c]
            if end + after_f[1][c] <= T:
                yield (a, b, f + c, g), (max(tU, start), end, na, 0)
        for c in sizes[1][1][g] if g < f else ():  # B on W
            if g + c > f:
                break
            start = max(tW, ready[1][g + c])
            end = start + dur_b[1][c]
            if end + after_b[1][c][g + c] <= T:
                yield (a, b, f, g + c), (max(tU, start), end, na, c)

    # --- a dive first: where T is loose, a path to the end is quickly found ------------------
    seen: set = set()
    stack = [((0, 0, 0, 0), (0, 0, 0, 0))]
    while stack and len(seen) < DIVE_STATES:
        key, label = stack.pop()
        if key == (B, B, B, B):
            return True
        if (key, label) in seen:
            continue
        seen.add((key, label))
        # the op that leaves both stages free earliest is tried first (it is pushed last)
        stack.extend(sorted(moves(key, label), key=lambda m: -max(m[1][0], m[1][1])))

    # --- the program, states by total progress a + b + f + g ---------------------------------
    # a label: (U free, W free, samples of U's last op in flight to W, of W's last op to U)
    fronts: dict[tuple[int, int, int, int], list[tuple[int, int, int, int]]] = {(0, 0, 0, 0): [(0, 0, 0, 0)]}
    by_progress: list[list[tuple[int, int, int, int]]] = [[] for _ in range(4 * B + 1)]
    by_progress[0].append((0, 0, 0, 0))

    def add(key: tuple[int, int, int, int], label: tuple[int, int, int, int]) -> None:
        front = fronts.get(key)
        if front is None:
            fronts[key] = [label]
            by_progress[sum(key)].append(key)
            return
        t1, t2, n1, n2 = label
        for m in front:
            if m[0] <= t1 and m[1] <= t2 and m[2] <= n1 and m[3] <= n2:
                return
        front[:] = [m for m in front if not (t1 <= m[0] and t2 <= m[1] and n1 <= m[2] and n2 <= m[3])]
        front.append(label)

    for progress in range(4 * B):
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime
        for key in by_progress[progress]:
            for label in fronts.pop(key):
                for nxt in moves(key, label):
                    add(*nxt)
    return (B, B, B, B) in fronts


def pair_program_bound(
    F: np.ndarray,
    G: np.ndarray,
    L: np.ndarray,
    minibatch: int,
    known: int,
    seconds: Optional[float] = None,
    report: Optional[Callable[[int], None]] = None,
) -> int:
    """The best of ``known`` (a bound already proven, in the tables' units) and every pair's
    program, to a two-thousandth. Each pair first asks whether its program meets the bound so
    far (then it cannot lift it); one that does not steps up in doubling steps, then bisects.
    ``report(bound)`` after every lift; past ``seconds`` the bound proven so far."""
    B, S = minibatch, F.shape[0]
    deadline = None if seconds is None else time.perf_counter() + seconds
    h = heads_and_tails(F, G, L, B)
    ut = untied_heads(F, G, L, h, B)
    best = known

    def ok(s: int, T: int) -> bool:
        if pair_program_feasible(T, F, G, L, h, ut, B, s, deadline):
            return True
        if report:  # every T below fails too; the searches below only ever ask higher
            report(T + 1)
        return False

    try:
        for s in range(S - 2, -1, -1):  # the last stages bind most often
            if ok(s, best):
                continue
            best += 1
            step = max(1, best // 500)
            while not ok(s, best + step):
                best, step = best + step + 1, 2 * step
            # reached: the pair's least T is in [best, best + step]
            best = _least(lambda T: ok(s, T), best, best + step, max(1, best // 2000))
    except _OutOfTime:
        pass
    return best
