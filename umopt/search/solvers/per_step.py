"""umopt's plan for one minibatch of sequences of different lengths, fast enough for every step.

[Note: planning a minibatch of sequences]
With a token-normalized loss the gradients depend neither on the order of the sequences nor on
how they are grouped, so the planner chooses both, each stage's own partition (UMPIPE's idea)
and the op order. What pays, found by the long search (the GA) and built in here as rules:

- the order: the shortest sequences at both ends ("ends": the pipeline fills and drains on small
  chunks, the long ones run while every stage is busy), or ascending, or groups of equal work;
- each stage's partition, cut where that stage's own cost (b L + c L^2 per sequence) adds up to
  its shares: equal ("flat"), the first and last half ("ends"), or rising to the middle and
  falling again ("tent"); a stage lighter than the busiest cut into more chunks (by a power of
  the ratio of their work), so it feeds the busiest early and drains fast;
- the chunk count, and the op order: GPipe, or 1F1B with each stage's warm-up (PipeDream's,
  twice that, or falling from every forward on the first stage to none on the last: the long
  search's schedules look like that).

Each stage's cuts are computed once per order (every count, every ramp), schedules are index
arrays into them, and a few hundred are scored at once by the compiled population evaluators on
the minibatch's costs by sample range. A cold start screens every order, count, ramp and slope;
a warm start (the previous step's plan) screens only its own order and knobs, the counts around
its own. The best within the memory limit is then polished, the best single move (a chunk end
moved, two chunks merged, one split, a warm-up changed) at a time, while it pays and the time
budget lasts. :func:`search` (the GA from the plan) says how far the fast plan is from the best
found.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from ...errors import NoFit, UmoptError
from ...formats.profile import AllReduceProfile, Profile
from ...schedules.family import ONEF1B, family, ruled
from ..plan import Layout, Plan, score
from ..problem import Candidate, Problem

__all__ = ["ORDERS", "RAMPS", "plan", "search", "order_of"]

ORDERS = ("ends", "ascending", "balanced")
RAMPS = ("flat", "ends", "tent")
SLOPES = (0.0, 1.0, 2.0, 3.0)
WARMUPS = ("pipedream", "double", "falling")
ROTATION = 12  # a warm start screens one in ROTATION of every knob (see _screen_orders)


def order_of(
    lengths: np.ndarray, how: str, weights: Optional[np.ndarray] = None, groups: int = 8
) -> np.ndarray:
    """The sequences in the order ``how``: "ascending", "descending", "ends" (the shortest at
    both ends, the longest in the middle), or "balanced" (``groups`` groups of about equal work,
    each sequence, heaviest first, to the lightest group so far, as WLB-LLM packs its
    microbatches; the groups one after another, the lightest at the ends, each in ascending
    order)."""
    asc = np.argsort(lengths, kind="stable")
    if how == "ascending":
        return asc
    if how == "descending":
        return asc[::-1]
    if how == "balanced":
        w = np.asarray(lengths, dtype=float) if weights is None else weights
        load = np.zeros(groups)
        members: list[list[int]] = [[] for _ in range(groups)]
        for i in np.argsort(-w, kind="stable"):
            k = int(np.argmin(load))
            members[k].append(int(i))
            load[k] += w[i]
        ranked = np.argsort(load, kind="stable")
        arranged = list(ranked[0::2]) + list(ranked[1::2][::-1])  # light groups at both ends
        return np.array([i for k in arranged for i in sorted(members[k], key=lambda i: lengths[i])])
    if how == "ends":
        return np.concatenate([asc[0::2], asc[1::2][::-1]])
    raise UmoptError(f"unknown order {how!r} (one of {', '.join(ORDERS)}, descending)")


def _shares(m: int, ramp: str) -> np.ndarray:
    if ramp == "ends" and m >= 3:
        out = np.ones(m)
        out[0] = out[-1] = 0.5
        return out
    if ramp == "tent":
        return np.minimum(np.arange(1, m + 1), np.arange(m, 0, -1)).astype(float)
    return np.ones(m)


@lru_cache(maxsize=4096)
def _fractions(m: int, ramp: str, K: int) -> np.ndarray:
    """Where ``m`` chunks following ``ramp`` end, as fractions of the total weight: (K - 1,),
    past the ``m - 1`` cuts infinite."""
    out = np.full(max(K - 1, 0), np.inf)
    shares = _shares(m, ramp)
    out[: m - 1] = np.cumsum(shares)[:-1] / shares.sum()
    return out


def _cut_table(weights: np.ndarray, keys: Sequence[tuple[int, str]]) -> np.ndarray:
    """(R, len(keys), K) chunk sizes: for each row of ``weights`` (R, B) and each (count m, ramp)
    in ``keys``, m chunks of contiguous samples whose weights follow the ramp, each at least one
    sample, zero-padded to the largest count K. All keys and rows at once: a warm start cuts a
    few hundred of them per step."""
    R, B = weights.shape
    K = max(m for m, _ in keys)
    frac = np.array([_fractions(m, r, K) for m, r in keys]).reshape(len(keys), K - 1)
    m = np.array([m for m, _ in keys])[:, None]
    k = np.arange(K - 1)[None, :]
    cut = k < m - 1  # the key's own cuts; the rest is padding
    cum = np.cumsum(weights, axis=1)
    ends = np.empty((R, len(keys), K - 1), dtype=np.int64)
    for s in range(R):
        ends[s] = np.searchsorted(cum[s], np.where(cut, frac * cum[s, -1], 0.0), side="left") + 1
    ends = np.maximum.accumulate(ends - k, axis=-1) + k  # every chunk at least one sample...
    ends = np.minimum(ends, B - (m - 1 - k))  # ...and room left for the ones after
    ends = np.where(cut, ends - k, np.iinfo(np.int64).max // 2)
    ends = np.minimum.accumulate(ends[..., ::-1], axis=-1)[..., ::-1] + k
    ends = np.concatenate([np.where(cut, ends, B), np.full((R, len(keys), 1), B)], axis=-1)
    return np.diff(ends, axis=-1, prepend=0)


class _Cuts:
    """One order's per-stage cuts: for every stage (and the stages' sum, "shared"), every chunk
    count and ramp, the chunk sizes; a schedule's partitions are one row per stage of these."""

    def __init__(self, weights: np.ndarray, counts: Sequence[int], ramps: Sequence[str] = RAMPS):
        self.S, self.B = weights.shape
        self.counts = sorted(set(int(m) for m in counts if 1 <= m <= self.B))
        self.keys = [(m, r) for m in self.counts for r in ramps]
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.K = max(self.counts)
        self.work = weights.sum(axis=1)
        # the stages' cuts, then the shared cut's (the stages' sum)
        self.table = _cut_table(np.vstack([weights, weights.sum(axis=0)]), self.keys)

    def key(self, m: int, ramp: str) -> int:
        m = min(self.counts, key=lambda c: abs(c - m))  # the nearest count cut
        return self.index[(m, ramp)]

    def rows(self, m: int, ramp: str, slope: Optional[float]) -> np.ndarray:
        """Each stage's row for the busiest stage's count ``m``: the shared cut (``slope`` None),
        or each stage's own, a stage of less work in ``m x (busiest / its work) ** slope`` chunks."""
        if slope is None:
            return np.full(self.S, self.key(m, ramp)) + 0
        ratio = self.work.max() / np.maximum(self.work, 1e-12)
        ms = np.clip(np.round(m * ratio**slope), 1, self.B).astype(int)
        return np.array([self.key(int(k), ramp) for k in ms])

    def sizes(self, rows: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """(P, S, K) partitions of P schedules: ``rows`` (P, S) key indices, ``shared`` (P,) True
        where the rows are the shared cut's."""
        P = rows.shape[0]
        out = np.empty((P, self.S, self.K), dtype=np.int64)
        for s in range(self.S):
            out[:, s] = np.where(shared[:, None], self.table[self.S][rows[:, s]], self.table[s][rows[:, s]])
        return out


def _warm(style: str, counts: np.ndarray, S: int) -> np.ndarray:
    """(P, S) warm-ups of a style, for schedules with ``counts`` (P, S) forward chunks."""
    s = np.arange(S)
    if style == "pipedream":
        return np.broadcast_to(S - 1 - s, counts.shape).copy()
    if style == "double":
        return np.broadcast_to(2 * (S - 1 - s), counts.shape).copy()
    return np.round(counts * (S - 1 - s) / max(S - 1, 1)).astype(np.int64)  # falling


@dataclass
class _Genes:
    """A schedule by rule: per-stage partitions (forward and backward alike), GPipe or 1F1B order
    and, in 1F1B, each stage's warm-up; and the knobs that made it."""

    parts: np.ndarray  # (S, K) zero-padded chunk sizes
    order: str
    warm: Optional[np.ndarray] = None
    knobs: Optional[dict] = None

    def lists(self) -> list[list[int]]:
        return [[int(x) for x in row if x] for row in self.parts]

    def candidate(self) -> Candidate:
        parts = self.lists()
        warm = [int(w) for w in self.warm] if family(self.order).warmups else None
        return Candidate(parts, parts, self.order, warmup=warm)


def _score(problem: Problem, sizes: np.ndarray, order: str, warm: Optional[np.ndarray]) -> np.ndarray:
    it, _ = family(order).score(problem.tables, sizes, warmup=warm)
    return it


def _screen(problem: Problem, cuts: _Cuts, knobs: list[tuple]) -> tuple[float, Optional[_Genes]]:
    """The best of every (count, ramp, slope) in ``knobs``, in every family built by rule (GPipe,
    and 1F1B with each warm-up style): all of them scored in one call per family and style."""
    S = cuts.S
    rows = np.array([cuts.rows(m, r, sl) for m, r, sl in knobs])
    shared = np.array([sl is None for _, _, sl in knobs])
    sizes = cuts.sizes(rows, shared)
    counts = (sizes > 0).sum(axis=2)
    best: tuple[float, Optional[_Genes]] = (np.inf, None)
    for order, style in [(f.name, w) for f in ruled() for w in (WARMUPS if f.warmups else [None])]:
        warm = _warm(style, counts, S) if style else None
        it = _score(problem, sizes, order, warm)
        k = int(np.argmin(it))
        if it[k] < best[0]:
            m, r, sl = knobs[k]
            g = _Genes(
                sizes[k],
                order,
                None if warm is None else warm[k],
                dict(count=m, ramp=r, slope=sl, warmup=style),
            )
            best = (float(it[k]), g)
    return best


# a move on one stage: a chunk end moved by d, two neighbouring chunks merged, a chunk split in
# two, a warm-up moved by d
END, MERGE, SPLIT, WARM = range(4)


def _moves(g: _Genes) -> np.ndarray:
    """Every schedule one move away, on one stage (a chunk end moved a sample or two or a quarter
    of the smaller chunk, two chunks merged, one split in two; in 1F1B a warm-up a forward or two
    up or down), as (N, 4) rows (kind, stage, chunk, d): the polish materializes only the moves
    it scores (:func:`_apply`)."""
    parts = np.asarray(g.parts)
    S, K = parts.shape
    n = (parts > 0).sum(axis=1)
    blocks = []
    # a chunk end moved by d: 1, 2 or a quarter of the smaller chunk (where that is more), both ways
    ss, ks = np.nonzero(np.arange(K)[None, :] < (n - 1)[:, None])
    if len(ss):
        quarter = np.maximum(np.minimum(parts[ss, ks], parts[ss, ks + 1]) // 4, 1)
        steps = np.stack([np.ones_like(quarter), np.full_like(quarter, 2), quarter], axis=1)
        keep = np.ones(steps.shape, dtype=bool)
        keep[:, 2] = quarter > 2  # a quarter of 1 or 2 is already there
        ds = np.concatenate([steps[keep], -steps[keep]])
        ss = np.tile(np.repeat(ss, keep.sum(axis=1)), 2)
        ks = np.tile(np.repeat(ks, keep.sum(axis=1)), 2)
        ok = (parts[ss, ks] + ds >= 1) & (parts[ss, ks + 1] - ds >= 1)
        blocks.append(np.stack([np.full(ok.sum(), END), ss[ok], ks[ok], ds[ok]], axis=1))
    for s in range(S):
        if n[s] >= 2:
            k = np.arange(n[s] - 1)
            blocks.append(np.stack([np.full(len(k), MERGE), np.full(len(k), s), k, 0 * k], axis=1))
        big = np.flatnonzero(parts[s, : n[s]] >= 2)
        if len(big):
            blocks.append(np.stack([np.full(len(big), SPLIT), np.full(len(big), s), big, 0 * big], axis=1))
    if g.warm is not None:
        w = np.asarray(g.warm)
        for s in range(S):
            ds = np.array([d for d in (-2, -1, 1, 2) if max(0, w[s] + d) != w[s]], dtype=np.int64)
            blocks.append(np.stack([np.full(len(ds), WARM), np.full(len(ds), s), 0 * ds, ds], axis=1))
    return np.concatenate(blocks) if blocks else np.zeros((0, 4), dtype=np.int64)


def _apply(g: _Genes, moves: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``moves`` (P, 4) of :func:`_moves` made on ``g``: (P, S, K + 1) partitions and, in 1F1B,
    (P, S) warm-ups."""
    parts = np.asarray(g.parts)
    S, K = parts.shape
    base = np.zeros((S, K + 1), dtype=np.int64)
    base[:, :K] = parts
    kind, ss, ks, ds = moves.T
    out = np.repeat(base[None], len(moves), axis=0)
    j = np.arange(K + 1)[None, :]
    i = np.flatnonzero(kind == END)
    out[i, ss[i], ks[i]] += ds[i]
    out[i, ss[i], ks[i] + 1] -= ds[i]
    i = np.flatnonzero(kind == MERGE)
    if len(i):
        rows, k = base[ss[i]], ks[i][:, None]
        src = j + (j > k)
        merged = np.where(src <= K, np.take_along_axis(rows, np.minimum(src, K), axis=1), 0)
        merged[np.arange(len(i)), ks[i]] += rows[np.arange(len(i)), ks[i] + 1]
        out[i, ss[i]] = merged
    i = np.flatnonzero(kind == SPLIT)
    if len(i):
        rows, k = base[ss[i]], ks[i][:, None]
        split = np.take_along_axis(rows, np.maximum(j - (j > k), 0), axis=1)
        half = rows[np.arange(len(i)), ks[i]]
        split[np.arange(len(i)), ks[i]] = half // 2
        split[np.arange(len(i)), ks[i] + 1] = half - half // 2
        out[i, ss[i]] = split
    if g.warm is None:
        return out, None
    warms = np.repeat(np.asarray(g.warm)[None], len(moves), axis=0)
    i = np.flatnonzero(kind == WARM)
    warms[i, ss[i]] = np.maximum(0, warms[i, ss[i]] + ds[i])
    return out, warms


def _counts(B: int, S: int, coarse: bool) -> list[int]:
    """Chunk counts for the busiest stage to try: every count up to 4S, then every other up to
    8S, then a geometric ladder to one sequence a chunk (coarse: a ladder of about a dozen)."""
    if coarse:
        out, m = set(), max(1, S // 2)
        while m < B:
            out.add(m)
            m = int(m * 1.3) + 1
        return sorted(out | {B})
    out = set(range(max(1, S // 2), min(B, 4 * S) + 1)) | set(range(4 * S, min(B, 8 * S) + 1, 2))
    m = 8 * S
    while m < B:
        out.add(m)
        m = int(m * 1.25) + 1
    return sorted(out | {B})


def stage_weights(profile: Profile, mode: str, lengths: np.ndarray) -> np.ndarray:
    """(S, B): each sequence's forward and backward work on each stage (b L + c L^2 + d)."""
    L = lengths.astype(float)
    rows = []
    for st in profile.stages:
        c = st.tokens[mode]
        f, b = c.forward, c.backward
        rows.append((f.b_ms + b.b_ms) * L + (f.c_ms + b.c_ms) * L * L + (f.d_ms + b.d_ms))
    return np.array(rows)


def plan(
    profile: Profile,
    lengths,
    mode: Optional[str] = None,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    budget_ms: float = 15.0,
    previous: Optional[Plan] = None,
    orders: Sequence[str] = ORDERS,
    seed: int = 0,
) -> Plan:
    """umopt's plan for one minibatch (see [Note: planning a minibatch of sequences]), within
    about ``budget_ms`` of planning; ``previous``: the last step's plan, to start from;
    ``mode``: "packed" or "padded" (default: the better of the profile's modes, a knob too)."""
    t0 = time.perf_counter()
    L = np.asarray(lengths)
    kn = previous.knobs if previous is not None else {}
    ways = [(m, how) for how in orders for m in ([mode] if mode else modes_of(profile))]
    warm_start = kn.get("count") is not None and (kn.get("mode"), kn.get("order")) in ways
    best = _screen_orders(profile, L, recompute, dp, ways, kn if warm_start else None, budget_ms, t0)
    if best[1] is None and warm_start:  # the last step's knobs fit none of this minibatch's plans
        best = _screen_orders(profile, L, recompute, dp, ways, None, budget_ms, t0)
    ms, g, layout, problem, how = best
    if g is None:
        raise NoFit()
    # the polish stops short of the budget by what the plan's ops took last step to build
    tail_ms = float(kn.get("ops_ms", 0.2 * budget_ms))
    ms, g = _polish(problem, g, ms, t0 + (budget_ms - tail_ms) / 1e3, np.random.default_rng(seed))
    t_ops = time.perf_counter()
    ops = g.candidate().ops()
    out = score(
        "umopt",
        profile,
        L,
        layout,
        ops,
        recompute,
        dp,
        tables=problem.tables,
        predicted_ms=ms,
        mode=layout.mode,
        order=how,
        turn=int(kn.get("turn", -1)) + 1,
        family=g.order,
        **g.knobs,
        counts=sorted({len(p) for p in g.lists()}),
        warmups=None if g.warm is None else [int(w) for w in g.warm],
        ops_ms=round((time.perf_counter() - t_ops) * 1e3, 3),
    )
    out.planning_ms = (time.perf_counter() - t0) * 1e3
    return out


def modes_of(profile: Profile) -> list[str]:
    if profile.lengths is None:
        raise UmoptError(
            "the profile has no costs by tokens (profile with --lengths, or a variable-length sim profile)"
        )
    modes = list(profile.lengths.modes)
    if (
        "padded" in modes
        and "packed" in modes
        and all(_no_cheaper(st.tokens["padded"], st.tokens["packed"]) for st in profile.stages)
    ):
        modes.remove("padded")  # padding counts at least packing's tokens and squares: never better
    return modes


def _no_cheaper(padded, packed) -> bool:
    """Whether every coefficient of ``padded``'s costs is at least ``packed``'s."""
    fits = ("forward", "backward", "backward_input", "backward_weight")
    for f in fits:
        a, b = getattr(padded, f), getattr(packed, f)
        if (a is None) != (b is None):
            return False
        if a is not None and (a.a_ms < b.a_ms or a.b_ms < b.b_ms or a.c_ms < b.c_ms or a.d_ms < b.d_ms):
            return False
    keys = (
        "input_bytes_per_token",
        "output_bytes_per_token",
        "stash_bytes_per_token",
        "work_bytes_per_token",
    )
    return all(getattr(padded, k) >= getattr(packed, k) for k in keys)


def _screen_orders(profile, L, recompute, dp, ways, kn: Optional[dict], budget_ms: float, t0: float):
    """The best screened plan (ms, genes, layout, problem, order): cold (``kn`` None), every knob
    of each (mode, order) of ``ways`` while the budget's first half lasts; warm, the last step's
    with its knobs (the counts around its own) and one in ROTATION of every knob, a different
    share each step, and the same for one other way in turn: what suits the stream better than
    the last step's knobs is found within a few dozen steps."""
    B, S = len(L), profile.num_stages
    every = [
        (m, r, sl) for m in _counts(B, S, coarse=budget_ms < 200) for r in RAMPS for sl in (None, *SLOPES)
    ]
    if kn:
        turn = int(kn.get("turn", 0))
        near = [(m, kn["ramp"], kn["slope"]) for m in range(kn["count"] - 3, kn["count"] + 4) if 1 <= m <= B]
        knobs = near + every[turn % ROTATION :: ROTATION]
        last, other = (kn["mode"], kn["order"]), ways[turn % len(ways)]
        tried = [(last, knobs)] + ([(other, knobs)] if other != last else [])
    else:
        tried = [(way, every) for way in ways]
    best: tuple = (np.inf, None, None, None, "")
    for n, ((mode, how), knobs) in enumerate(tried):
        order = order_of(L, how, stage_weights(profile, mode, L).sum(axis=0), groups=2 * S)
        layout = Layout.of_order(order, mode)
        problem = Problem(layout.tables(profile, L, recompute, dp), B)
        weights = stage_weights(profile, mode, L[order])
        ratio = weights.sum(axis=1).max() / np.maximum(weights.sum(axis=1), 1e-12)
        counts = {m for m, _, _ in knobs} | {
            int(np.clip(round(m * r**sl), 1, B)) for m, _, sl in knobs if sl is not None for r in ratio
        }
        ramps = sorted({r for _, r, _ in knobs})
        ms, g = _screen(problem, _Cuts(weights, sorted(counts), ramps), knobs)
        if g is not None and ms < best[0]:
            best = (ms, g, layout, problem, how)
        if not kn and g is not None and n and (time.perf_counter() - t0) * 1e3 > budget_ms / 2:
            break
    return best


def _polish(
    problem: Problem, g: _Genes, ms: float, deadline: float, rng: np.random.Generator
) -> tuple[float, _Genes]:
    """The best single move while it pays, until ``deadline``: every move where time allows, a
    random share of them where it does not (a round that finds nothing then draws again). The
    first round scores a few moves only, to learn what one costs on this machine."""
    per_move = None  # seconds to score one schedule, as measured
    while time.perf_counter() < deadline:
        moves = _moves(g)
        if not len(moves):
            break
        left = deadline - time.perf_counter()
        take = min(len(moves), 16) if per_move is None else max(8, min(len(moves), int(left / per_move)))
        pick = (
            np.sort(rng.choice(len(moves), take, replace=False))
            if take < len(moves)
            else np.arange(len(moves))
        )
        t = time.perf_counter()
        sizes, warm = _apply(g, moves[pick])
        it = _score(problem, sizes, g.order, warm)
        per_move = (time.perf_counter() - t) / len(pick)
        k = int(np.argmin(it))
        if it[k] < ms - 1e-9:
            ms = float(it[k])
            g = _Genes(sizes[k], g.order, None if warm is None else warm[k], g.knobs)
        elif take == len(moves):
            break  # a local optimum: no move pays
    return ms, g


def search(
    profile: Profile,
    lengths,
    start: Plan,
    seconds: float = 10.0,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    seed: int = 0,
) -> Plan:
    """The long search: the GA (umopt's dual-chromosome search: per-stage forward and backward
    partitions, GPipe or 1F1B order with per-stage warm-ups) on the plan's order, started from it,
    for ``seconds``: how far the fast plan is from the best found."""
    from .ga import solve_ga

    L = np.asarray(lengths)
    layout = start.layout
    problem = Problem(layout.tables(profile, L, recompute, dp), len(layout.units))
    parts = Candidate.from_ops(start.ops)
    seed_cand = Candidate(
        parts.fsizes, parts.bsizes, start.knobs.get("family", ONEF1B.name), warmup=start.knobs.get("warmups")
    )
    res = solve_ga(problem, time_limit=seconds, seed=seed, seeds=[seed_cand])
    best = min((res.candidate, seed_cand), key=lambda c: c.simulate(problem).iteration_ms)
    if best.simulate(problem).iteration_ms >= start.iteration_ms:
        return start
    return score("umopt-search", profile, L, layout, best.ops(), recompute, dp, **start.knobs)
