"""The pair program: two adjacent stages' untied schedules by a dynamic program in time order.

The pair models (:mod:`.pair_models`) hand two adjacent stages to CP-SAT, which settles small
pairs but proves little on large ones within a solve. This is the same relaxation (untied
schedules, :mod:`.untied`: each stage's F and B ops in sample order, every other stage as heads
and tails) by a program instead, with one more relaxation that keeps its states few.

Take the ops of both stages in the order they start. A state is how far each of the four chains
has got: ``a`` samples forwarded and ``b`` backwarded on the upper stage ``U = s``, ``f`` and ``g``
on the lower one ``W = s + 1``. A label on it is when each stage is free again (never before the
last op's start: later ops start no earlier) and two queues of messages still on their way: when
each of U's F ops not yet run on by W has its activations on W, and when each of W's B ops has its
gradients on U. A link sends its messages one at a time in the order their ops end (the cost
model's rule; for gradients it holds after the untied exchange too: the messages keep their
sizes and times), so an arrival is the later of the op's end and the previous arrival, plus its
own transfer. An arrival no later than the receiving stage is free waits for nothing and leaves
the queue (the one relaxation: the next message's transfer may then start earlier than the link
is free). Every schedule, its ops taken in start order, passes through labels no later than its
own times (by induction over the ops), so the least ``T`` whose program reaches the end bounds
it; a label no later in every field than another on the same state (each queued sample in no
later) stands for it, the program being monotone. States past the one-stage programs' latest
ends (:func:`.untied.untied_latest`) are dropped.

Untied, it leaves out that a B op runs an F op's samples: the stage forwards small chunks to
start early and backwards large ones to work little, which no schedule does. Tied, it puts that
back: the exchange keeps each B op's size and time, so a stage's B ops take the sizes of its F
ops, each after an F op of its size has ended. A state then also holds, per stage, the sizes
forwarded and not yet matched by a B op ("sizes"; or only how many are owed, "count", weaker and
cheaper); a B op must take one of them, and a state that cannot run what it still owes before
``T`` is dropped. A tied question costs many times an untied one, so the untied pass runs first.

The search over states is compiled where the install built it (:mod:`._pair_program`, the same
moves in C++); this module computes what it needs and runs it in Python otherwise.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Optional, Sequence

import numpy as np

# what this module calls the compiled search with (its VERSION)
_COMPILED_VERSION = 2
try:  # the label search compiled (setup.py); where it did not build, the same search in Python
    from . import _pair_program as _compiled
except ImportError:  # pragma: no cover - depends on the install
    _compiled = None
if _compiled is not None and getattr(_compiled, "VERSION", None) != _COMPILED_VERSION:  # pragma: no cover
    # an editable install whose rebuild failed keeps the module it built before
    warnings.warn(
        "umopt: the compiled pair program is out of date (pip install -e . rebuilds it); running it in Python",
        stacklevel=1,
    )
    _compiled = None

from .heads import Heads, heads_and_tails, least_true, least_work  # noqa: E402  (after the compiled module's check)
from .stage_cuts import usable_chunks  # noqa: E402
from .untied import UntiedHeads, untied_heads, untied_latest, untied_limits, untied_usable_chunks  # noqa: E402

__all__ = ["pair_program_feasible", "pair_program_bound", "Tie", "UNTIED", "PASSES", "COMPILED"]


# what a stage's B ops are tied to, per stage of a pair (upper, lower): see pair_program_feasible
Tie = tuple[str, str]
_NONE, _SIZES, _COUNT = 0, 1, 2
_MODES = {"none": _NONE, "sizes": _SIZES, "count": _COUNT}
UNTIED: Tie = ("none", "none")
# pair_program_bound's passes, each from where the one before got: untied (cheap); the lower
# stage's B ops of its F ops' sizes (within reach on large pairs, where sizes on both stages take
# minutes a question); both stages' B ops of their F ops' sizes (what lifts small pairs most)
PASSES: tuple[Tie, ...] = (UNTIED, ("none", "sizes"), ("sizes", "sizes"))

# whether the label search runs compiled
COMPILED = _compiled is not None

# labels the dive runs on from before the program takes over (a second or so)
DIVE_STATES = 20_000


# the compiled search gives a question up past this many labels held (about 200 bytes each):
# with sizes on both stages at B=32 a level alone has millions
MAX_LABELS = 5_000_000


class _OutOfTime(Exception):
    pass


class _TooLarge(Exception):
    """The compiled search held more than ``MAX_LABELS`` labels: no answer."""


def pair_program_feasible(
    T: int,
    F: np.ndarray,
    G: np.ndarray,
    L: np.ndarray,
    h: Heads,
    ut: UntiedHeads,
    minibatch: int,
    s: int,
    deadline: Optional[float] = None,
    tie: Tie = UNTIED,
    compiled: bool = True,
    witness: bool = False,
) -> bool | list[tuple] | None:
    """Does the program of stages ``s`` and ``s + 1`` reach the end with every op meeting ``T``
    (integer tables of :func:`.heads.int_tables`)? ``tie``, per stage (upper, lower): "none",
    "sizes" (its B ops take the sizes of its F ops: a state also holds the sizes forwarded and
    not yet backwarded) or "count" (as many B ops as F ops, none before its F: a state holds how
    many are owed). ``compiled``: the search in :mod:`._pair_program` where it was built (the
    same answers, sooner; it raises ``_TooLarge`` past ``MAX_LABELS`` labels).
    Raises ``_OutOfTime`` past ``deadline``.

    ``witness`` (compiled only): instead of yes or no, the ops of one path to the end, in the
    order they start, each ``(kind, 0 for s or 1 for s + 1, lo, size, start)``, or None. Each
    stage's F and B ops come in sample order (B ops as the exchange of :mod:`.untied` puts
    them): it shows what the relaxation lets a schedule do that no schedule can."""
    # one piece: the search's closures (fits, moves) read the dozen tables built first; apart,
    # each would take them all as arguments. The compiled search takes the same tables
    modes = tuple(_MODES[t] for t in tie)
    B, mx = minibatch, min(F.shape[1] - 1, minibatch)
    U, W = s, s + 1
    # --- the chunks each stage may use, and each stage's own limits ---------------------------
    sizes = []  # [stage][kind][lo]: the usable chunk sizes starting at sample lo
    for r in (U, W):
        f_use, b_use = untied_usable_chunks(T, h, ut, F, G, r, B)
        f_use &= usable_chunks(T, h, F, G, r, B)
        if not f_use.any():
            return False
        sizes.append(
            [
                [[c for c in range(1, mx + 1) if lo + c <= B and use[lo, c]] for lo in range(B)]
                for use in (f_use, b_use)
            ]
        )
    limits = [untied_limits(h, ut, F, G, r, B) for r in (U, W)]
    rel = [lim[0].tolist() for lim in limits]  # F ops ending at sample n start no earlier
    ready = [lim[1].tolist() for lim in limits]  # B ops ending at sample n start no earlier
    after_f = [lim[2].tolist() for lim in limits]  # what runs after an F op of c samples
    after_b = [lim[3].tolist() for lim in limits]  # ... after a B op of c samples ending at n
    latest = [untied_latest(T, h, ut, F, G, r, B).tolist() for r in (U, W)]  # per (i, j)
    dur_f = [F[r].tolist() for r in (U, W)]
    dur_b = [G[r].tolist() for r in (U, W)]
    link = L[U].tolist()
    # tied, a stage still has to run the B ops it owes (sizes: theirs; count: the least work of
    # that many ops over the samples forwarded and not backwarded) and the F and B ops of the
    # samples it has not forwarded (their least work in one partition), then comes the least
    # tail after a last B op: a state that cannot fit that before T is dropped
    todo = [least_work(F[r] + G[r], B).tolist() for r in (U, W)]
    owed = [_least_ops_work(G[r], B, mx).tolist() for r in (U, W)]  # [samples][ops]
    last_tail = [min(after_b[k][c][B] for c in range(1, mx + 1)) for k in (0, 1)]

    if compiled and _compiled is not None and B <= 255:
        use = np.zeros((2, 2, B, mx + 1), dtype=np.int64)
        for k in (0, 1):
            for kind in (0, 1):
                for lo in range(B):
                    use[k, kind, lo, sizes[k][kind][lo]] = 1
        left = -1.0 if deadline is None else max(0.0, deadline - time.perf_counter())
        arrays = (rel, ready, after_f, after_b, latest, dur_f, dur_b, link, todo, owed, last_tail)
        met = _compiled.feasible(
            T,
            B,
            mx,
            modes[0],
            modes[1],
            use,
            *(np.array(x, dtype=np.int64) for x in arrays),
            DIVE_STATES,
            left,
            MAX_LABELS,
            witness,
        )
        if witness:
            met, path = met
        if met == -1:
            raise _OutOfTime
        if met == -2:
            raise _TooLarge
        if witness:
            return path if met else None
        return bool(met)
    if witness:
        raise NotImplementedError("a witness needs the compiled search")

    def fits(k: int, free: int, pending: tuple[int, ...], forwarded: int, open_: int) -> bool:
        if modes[k] == _NONE:
            return True
        owes = (
            owed[k][open_][pending[0] if pending else 0]
            if modes[k] == _COUNT
            else sum(dur_b[k][c] for c in pending)
        )
        return free + owes + todo[k][B - forwarded] + last_tail[k] <= T

    def moves(key: Key, label: Label):
        """The labels one op on from ``label`` on state ``key``, as (key, label)."""
        a, b, f, g, pU, pW = key
        tU, tW, qa, qg = label
        if tU > latest[0][a][b] or tW > latest[1][f][g]:
            return
        for c in sizes[0][0][a] if a < B else ():  # F on U: its activations join W's queue
            start = max(tU, rel[0][a + c])
            end = start + dur_f[0][c]
            if end + after_f[0][c] <= T:
                arrive = max(end, qa[-1][1] if qa else 0) + link[c]  # the link sends in order
                nW = max(tW, start)
                nU = _push(pU, c, modes[0])
                if fits(0, end, nU, a + c, a + c - b):
                    yield (
                        (a + c, b, f, g, nU, pW),
                        (end, nW, _trim(qa + ((a, arrive),), nW, f), _trim(qg, end, b)),
                    )
        for c in sizes[0][1][b] if b < g else ():  # B on U, after W's B of its samples
            if b + c > g:
                break
            if not _has(pU, c, modes[0]):
                continue
            start = max(tU, ready[0][b + c], _arrival(qg, b + c - 1))
            end = start + dur_b[0][c]
            if end + after_b[0][c][b + c] <= T:
                nW = max(tW, start)
                nU = _pop(pU, c, modes[0])
                if fits(0, end, nU, a, a - b - c):
                    yield (a, b + c, f, g, nU, pW), (end, nW, _trim(qa, nW, f), _trim(qg, end, b + c))
        for c in sizes[1][0][f] if f < a else ():  # F on W, after U's F of its samples
            if f + c > a:
                break
            start = max(tW, rel[1][f + c], _arrival(qa, f + c - 1))
            end = start + dur_f[1][c]
            if end + after_f[1][c] <= T:
                nU = max(tU, start)
                nW = _push(pW, c, modes[1])
                if fits(1, end, nW, f + c, f + c - g):
                    yield (a, b, f + c, g, pU, nW), (nU, end, _trim(qa, end, f + c), _trim(qg, nU, b))
        for c in sizes[1][1][g] if g < f else ():  # B on W: its gradients join U's queue
            if g + c > f:
                break
            if not _has(pW, c, modes[1]):
                continue
            start = max(tW, ready[1][g + c])
            end = start + dur_b[1][c]
            if end + after_b[1][c][g + c] <= T:
                arrive = max(end, qg[-1][1] if qg else 0) + link[c]
                nU = max(tU, start)
                nW = _pop(pW, c, modes[1])
                if fits(1, end, nW, f, f - g - c):
                    yield (
                        (a, b, f, g + c, pU, nW),
                        (nU, end, _trim(qa, end, f), _trim(qg + ((g, arrive),), nU, b)),
                    )

    # --- a dive first: depth first, the op that leaves both stages free earliest first ---------
    # Where T is loose a path to the end is found at once; a label no better than one already
    # dived from (same state) is passed over, so an exhausted dive has its answer too
    start_key: Key = (0, 0, 0, 0, (), ())
    start_label: Label = (0, 0, (), ())
    end_key: Key = (B, B, B, B, (), ())  # tied, every F op's B op has run
    dived: dict[Key, list[Label]] = {}
    stack = [(start_key, start_label)]
    count = 0
    while stack and count < DIVE_STATES:
        key, label = stack.pop()
        if key == end_key:
            return True
        if any(_no_later(m, label) for m in dived.get(key, ())):
            continue
        dived.setdefault(key, []).append(label)
        count += 1
        stack.extend(sorted(moves(key, label), key=lambda m: -max(m[1][0], m[1][1])))
    if not stack:
        return False

    # --- the program, states by total progress a + b + f + g ---------------------------------
    fronts: dict[Key, list[Label]] = {start_key: [start_label]}
    by_progress: list[list[Key]] = [[] for _ in range(4 * B + 1)]
    by_progress[0].append(start_key)

    def add(key: Key, label: Label) -> None:
        front = fronts.get(key)
        if front is None:
            fronts[key] = [label]
            by_progress[key[0] + key[1] + key[2] + key[3]].append(key)
            return
        if any(_no_later(m, label) for m in front):
            return
        front[:] = [m for m in front if not _no_later(label, m)]
        front.append(label)

    for progress in range(4 * B):
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime
        for key in by_progress[progress]:
            for label in fronts.pop(key):
                for nxt in moves(key, label):
                    add(*nxt)
    return end_key in fronts


# A queue: ((first sample, arrival), ...), first samples and arrivals both increasing: from its
# first sample on, a message's samples (and every later one's) are in no earlier than its arrival.
Queue = tuple[tuple[int, int], ...]
# A label: (U free, W free, activations on their way to W, gradients on their way to U)
Label = tuple[int, int, Queue, Queue]
# A state: (a, b, f, g, what U owes, what W owes): the B ops owed for F ops run, as their sorted
# sizes or their count (empty unless the program is tied on that stage: _push)
Key = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...]]


# what a state holds of a stage's owed B ops: sizes, the sorted sizes (()) for none; count, (n,)
def _push(owed: tuple[int, ...], c: int, mode: int) -> tuple[int, ...]:
    if mode == _NONE:
        return owed
    return tuple(sorted(owed + (c,))) if mode == _SIZES else (owed[0] + 1 if owed else 1,)


def _has(owed: tuple[int, ...], c: int, mode: int) -> bool:
    return mode == _NONE or (c in owed if mode == _SIZES else bool(owed))


def _pop(owed: tuple[int, ...], c: int, mode: int) -> tuple[int, ...]:
    if mode == _NONE:
        return owed
    if mode == _COUNT:
        return (owed[0] - 1,) if owed[0] > 1 else ()
    k = owed.index(c)
    return owed[:k] + owed[k + 1 :]


def _least_ops_work(Gs: np.ndarray, B: int, mx: int) -> np.ndarray:
    """``w[n, m]``: the least B work of ``m`` ops of at most ``mx`` samples holding ``n`` samples
    in all (a large number where none do)."""
    big = np.iinfo(np.int64).max // 4
    w = np.full((B + 1, B + 1), big, dtype=np.int64)
    w[0, 0] = 0
    for m in range(1, B + 1):
        for n in range(m, min(B, m * mx) + 1):
            c = np.arange(1, min(mx, n - m + 1) + 1)
            w[n, m] = (w[n - c, m - 1] + Gs[c]).min()
    return w


def _arrival(q: Queue, sample: int) -> int:
    """When ``sample`` (and every queued one before it) is in: 0 where nothing queued holds it."""
    when = 0
    for first, arrive in q:
        if first > sample:
            break
        when = arrive
    return when


def _trim(q: Queue, free: int, used: int) -> Queue:
    """``q`` without what no later op waits for: arrivals no later than ``free`` (the receiving
    stage is busy until then anyway) and samples before ``used`` (the receiver has run them)."""
    k = 0
    while k < len(q) and q[k][1] <= free:
        k += 1
    while k + 1 < len(q) and q[k + 1][0] <= used:
        k += 1
    q = q[k:]
    return ((used, q[0][1]),) + q[1:] if q and q[0][0] < used else q


def _no_later(x: Label, y: Label) -> bool:
    """Is ``x`` no later than ``y`` in every field (each queued sample arriving no later)?"""
    return (
        x[0] <= y[0]
        and x[1] <= y[1]
        and all(arrive <= _arrival(y[2], first) for first, arrive in x[2])
        and all(arrive <= _arrival(y[3], first) for first, arrive in x[3])
    )


def pair_program_bound(
    F: np.ndarray,
    G: np.ndarray,
    L: np.ndarray,
    minibatch: int,
    known: int,
    seconds: Optional[float] = None,
    report: Optional[Callable[[int], None]] = None,
    passes: Sequence[Tie] = PASSES,
) -> int:
    """The best of ``known`` (a bound already proven, in the tables' units) and every pair's
    program, to a two-thousandth: pair by pair (the last first: it binds most often), each of
    ``passes`` from where the one before got (cheap relaxations first: a tied question can
    cost many times an untied one). A pass first asks whether the program meets the bound so
    far (then it cannot lift it); one that does not steps up in doubling steps, then bisects.
    ``report(bound)`` after every lift; past ``seconds`` the bound proven so far. Without
    recompute only (a tie is a stage's one partition)."""
    B, S = minibatch, F.shape[0]
    deadline = None if seconds is None else time.perf_counter() + seconds
    h = heads_and_tails(F, G, L, B)
    ut = untied_heads(F, G, L, h, B)
    best = proven = known

    def ok(s: int, T: int, tie: Tie) -> bool:
        nonlocal proven
        met = pair_program_feasible(T, F, G, L, h, ut, B, s, deadline, tie)
        if not met:  # every T below fails too; the searches below only ever ask higher
            proven = max(proven, T + 1)
            if report:
                report(T + 1)
        return met

    try:
        for s in range(S - 2, -1, -1):
            for tie in passes:
                try:
                    if ok(s, best, tie):
                        continue
                    best += 1
                    step = max(1, best // 500)
                    while not ok(s, best + step, tie):
                        best, step = best + step + 1, 2 * step
                    # reached: the pair's least T is in [best, best + step]
                    best = least_true(lambda T: ok(s, T, tie), best, best + step, max(1, best // 2000))
                except _TooLarge:  # this pass has no answer here; what it proved stands
                    best = max(best, proven)
    except _OutOfTime:
        pass
    return max(best, proven)
