"""What people run on sequences of different lengths, from the tools' and papers' own descriptions,
each at the knobs that serve it best, scored by the same cost model as umopt's plans.

- ``pad``: pad every sequence of the minibatch to its longest, then equal microbatches on every
  stage (torch.distributed.pipelining and DeepSpeed with fixed shapes), the best microbatch
  count, GPipe or 1F1B order;
- ``pack``: pack the sequences into rows of a fixed length (first fit, longest first), attention
  masked per sequence, equal microbatches of rows (Megatron-LM, NeMo): the best row length (a power
  of two from the longest sequence's up, chosen per minibatch where users fix one per run) and
  microbatch count;
- ``pack-split``: the same with rows down to a quarter of the longest sequence, a longer sequence
  cut into pieces of a row each (Megatron-LM's pretraining data does this): faster, but not the
  same training (a cut sequence's tokens attend within their piece only), so it is reported beside
  the others and not counted among them;
- ``sort-split``: sort by length and cut into contiguous microbatches of about equal tokens,
  each padded to its own longest or packed, whichever is faster, the best count;
- ``dynapipe``: DynaPipe (Jiang et al., EuroSys'24): sort by length, then a dynamic program over
  the sorted sequences that minimises ``(S - 1) t_max + sum of t`` over microbatches (t a
  microbatch's time on the slowest stage, each under a cap ``t_max``, every cap tried), within
  the memory limit; microbatches padded to their own longest, as the paper's, or packed, and
  played in sorted order or its reverse, GPipe or 1F1B, whichever is fastest;
- ``wlb``: WLB-LLM (Wang et al., OSDI'25): each sequence, heaviest first, into the microbatch of
  least workload so far, a sequence's workload ``b L + c L^2`` from the profile's costs by tokens
  (summed over stages), microbatches packed with attention masked per sequence, the best count.

Every peer plays its equal microbatches in GPipe or 1F1B order, whichever is faster, 1F1B with
fewer microbatches than stages too, as Megatron-LM runs it (each stage warms up
min(S - s - 1, M); torch's Schedule1F1B refuses M < S), so a minibatch packed into a few rows is
not held to GPipe. Every peer gives the same partition to every stage (that is what these tools run); umopt's
planner (:mod:`.planner`) gives each stage its own. With several chunks per rank (``chunks``),
``pad`` and ``pack`` run torch's multi-chunk schedules (interleaved 1F1B, looped BFS, and with a
split backward the zero-bubble ones) at their best chunk count, microbatch count and cut, as a
torch user would pick them. docs/varlen.md says what was chosen where the
descriptions leave room.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ..costmodel import Chunking, sample_tokens
from ..formats.profile import AllReduceProfile, Profile
from ..schedules.family import GPIPE, ONEF1B
from ..search.baselines import gpipe_equal, onef1b_equal
from ..search.peers import PeerResult, best_peers, equal_list_scheduled, load_torch_schedules
from ..search.problem import Candidate, LayoutProblem, Problem, pack
from .plan import Layout, Plan, score

__all__ = ["PEERS", "pad", "packed_rows", "sort_split", "dynapipe", "wlb", "unavailable"]


def _best_equal(
    method: str,
    profile: Profile,
    lengths,
    layout: Layout,
    S: int,
    recompute,
    dp,
    chunks: int = 1,
    on: Optional[Chunking] = None,
    until: Optional[float] = None,
    **knobs,
) -> Optional[Plan]:
    """The best equal-microbatch schedule (GPipe or 1F1B, every count) of ``layout``; with
    ``chunks`` > 1, of torch's multi-chunk schedules instead (:func:`_best_torch_multi`, which
    stops trying counts at ``until``, a ``time.perf_counter()``, once one fits)."""
    if chunks > 1:
        return _best_torch_multi(method, profile, lengths, layout, chunks, recompute, dp, on, until, **knobs)
    tables = layout.tables(profile, lengths, recompute, dp)
    problem = Problem(tables, len(layout.units))
    found = [
        b
        for b in (gpipe_equal(problem), onef1b_equal(problem, fewer_than_stages=True))
        if b.candidate is not None
    ]
    if not found:
        return None
    best = min(found, key=lambda b: b.iteration_ms)
    return score(
        method,
        profile,
        lengths,
        layout,
        best.candidate.ops(),
        recompute,
        dp,
        microbatches=best.microbatches,
        order=best.candidate.order,
        **knobs,
    )


def _best_torch_multi(
    method: str,
    profile: Profile,
    lengths,
    layout: Layout,
    chunks: int,
    recompute,
    dp,
    on: Optional[Chunking] = None,
    until: Optional[float] = None,
    **knobs,
) -> Optional[Plan]:
    """torch's multi-chunk schedules (interleaved 1F1B, looped BFS; those with W ops need a split
    backward) on ``layout``'s samples, each at its best chunk count up to ``chunks``, microbatch
    count and cut (what a torch user would try, :func:`umopt.search.peers.best_peers`; ``on``: that
    cut and placement only): the fastest within the memory limit."""
    tokens, squares, docs, mode, rows = sample_tokens(
        lengths, layout.units, layout.mode, layout.row, layout.pad_to
    )
    problem = LayoutProblem(
        profile,
        len(layout.units),
        recompute,
        dp,
        tokens=tokens,
        mode=mode,
        squares=squares,
        docs=docs,
        rows=rows,
    )
    load_torch_schedules()
    found = [
        p
        for p in best_peers(problem, max_chunks=chunks, on=on, until=until).values()
        if p.iteration_ms is not None
    ]
    if not found and on is not None:  # torch has no class for this layout (V-shaped without W ops)
        equal = equal_list_scheduled(problem.tables(on), problem.minibatch, until=until)
        if equal is not None:
            ops, ms, m = equal
            v = len(on.ranks) // problem.num_ranks
            tables = problem.tables(on)
            found = [
                PeerResult("equal, list-scheduled", v, m, ms, ops, tables, chunking=on, cut="the plan's")
            ]
    if not found:
        return None
    best = min(found, key=lambda p: p.iteration_ms)
    return score(
        method,
        profile,
        lengths,
        layout,
        best.ops,
        recompute,
        dp,
        tables=best.tables,
        chunking=best.chunking,
        microbatches=best.microbatches,
        order=best.name,
        chunks=best.chunks,
        cut=best.cut,
        **knobs,
    )


def _best_shared(
    method: str,
    profile: Profile,
    lengths,
    layouts: Sequence[tuple[Layout, list[list[int]], dict]],
    S: int,
    recompute,
    dp,
) -> Optional[Plan]:
    """The fastest of shared partitions (the same on every stage), each ``(layout, [sizes, ...],
    knobs)``, in GPipe and 1F1B order, within the memory limit."""
    best = None
    for layout, partitions, knobs in layouts:
        if not partitions:
            continue
        tables = layout.tables(profile, lengths, recompute, dp)
        problem = Problem(tables, len(layout.units))
        sizes = pack([[list(p)] * S for p in partitions])
        # GPipe and 1F1B, 1F1B with fewer microbatches than stages too, as Megatron-LM runs it
        for fam in (GPIPE, ONEF1B):
            ok = list(range(len(partitions)))
            it, _ = fam.score(problem.tables, sizes[ok])
            k = int(np.argmin(it))
            if np.isfinite(it[k]) and (best is None or it[k] < best[0]):
                best = (float(it[k]), layout, partitions[ok[k]], fam.name, knobs)
    if best is None:
        return None
    _, layout, sizes, order, knobs = best
    ops = Candidate.uniform(sizes, S, order).ops()
    return score(
        method, profile, lengths, layout, ops, recompute, dp, microbatches=len(sizes), order=order, **knobs
    )


def pad(
    profile: Profile,
    lengths,
    S: int,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    chunks: int = 1,
    on: Optional[Chunking] = None,
) -> Optional[Plan]:
    if unavailable(profile, "pad"):
        return None
    L = np.asarray(lengths)
    layout = Layout(tuple((i,) for i in range(len(L))), "padded", pad_to=int(L.max()))
    return _best_equal("pad", profile, L, layout, S, recompute, dp, chunks, on, padded_to=int(L.max()))


def _rows(L: np.ndarray, row: int) -> tuple[tuple[int, ...], ...]:
    """First fit, longest first, into rows of ``row`` tokens (a longer sequence is cut into
    pieces of a row each, which the rows then hold as sequences of their own)."""
    pieces = []  # (length, sequence)
    for i, n in enumerate(L):
        while n > row:
            pieces.append((row, i))
            n -= row
        pieces.append((int(n), i))
    pieces.sort(key=lambda p: -p[0])
    rows: list[list] = []
    room: list[int] = []
    for n, i in pieces:
        k = next((k for k, r in enumerate(room) if r >= n), None)
        if k is None:
            rows.append([])
            room.append(row)
            k = len(rows) - 1
        rows[k].append(i)
        room[k] -= n
    return tuple(tuple(r) for r in rows)


def packed_rows(
    profile: Profile,
    lengths,
    S: int,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    rows: Optional[Sequence[int]] = None,
    split: bool = False,
    chunks: int = 1,
    on: Optional[Chunking] = None,
    until: Optional[float] = None,
) -> Optional[Plan]:
    """``rows``: the row lengths to try (default: three powers of two from the longest
    sequence's up, within the profile's longest; with ``split``, also a half and a quarter of
    it, the longer sequences then cut into pieces of a row each)."""
    if unavailable(profile, "pack"):
        return None
    L = np.asarray(lengths)
    if rows is None:
        first = 1 << int(math.ceil(math.log2(max(int(L.max()), 1))))
        shorter = (first // 4, first // 2) if split else ()
        rows = [
            r
            for r in (*shorter, first, 2 * first, 4 * first)
            if min(1024, first) <= r <= profile.lengths.max_length
        ] or [int(L.max())]
    best = None
    for r in rows:
        layout = Layout(_rows(L, r), "packed", row=int(r))
        plan = _best_equal(
            "pack-split" if split else "pack",
            profile,
            L,
            layout,
            S,
            recompute,
            dp,
            chunks,
            on,
            until,
            row=int(r),
            rows=len(layout.units),
        )
        if plan is not None and (best is None or plan.iteration_ms < best.iteration_ms):
            best = plan
    return best


def packed_split(
    profile: Profile, lengths, S: int, recompute: bool = False, dp: Optional[AllReduceProfile] = None
) -> Optional[Plan]:
    """Packing with rows shorter than the longest sequence too (see the module docstring)."""
    return packed_rows(profile, lengths, S, recompute, dp, split=True)


def _equal_token_cuts(tokens: np.ndarray, m: int) -> list[int]:
    """Sizes of ``m`` contiguous groups of about equal tokens (each at least one sample)."""
    B = len(tokens)
    ends = np.searchsorted(np.cumsum(tokens), np.sum(tokens) * np.arange(1, m) / m, side="left") + 1
    cuts = [0]
    for e in ends:
        cuts.append(int(min(max(e, cuts[-1] + 1), B - (m - len(cuts)))))
    cuts.append(B)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def sort_split(
    profile: Profile, lengths, S: int, recompute: bool = False, dp: Optional[AllReduceProfile] = None
) -> Optional[Plan]:
    L = np.asarray(lengths)
    order = np.argsort(L, kind="stable")
    parts = [_equal_token_cuts(L[order], m) for m in range(1, len(L) + 1)]
    parts = [p for p in parts if max(p) <= len(L)]
    choices = [(Layout.of_order(order, mode), parts, {"mode": mode}) for mode in profile.lengths.modes]
    return _best_shared("sort-split", profile, L, choices, S, recompute, dp)


def _microbatch_ms(tables, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A microbatch's forward and backward on the slowest stage (DynaPipe's microbatch time)."""
    R = tables.ranged
    return (R.fwd[:, lo, hi] + R.bwd[:, lo, hi]).max(axis=0)


def dynapipe(
    profile: Profile,
    lengths,
    S: int,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    caps: int = 48,
) -> Optional[Plan]:
    """``caps``: how many caps on a microbatch's time the DP tries (quantiles of every range's
    time; the paper's search over the cap, sampled)."""
    L = np.asarray(lengths)
    B = len(L)
    order = np.argsort(L, kind="stable")
    choices = []
    for mode in profile.lengths.modes:
        layout = Layout.of_order(order, mode)
        tables = layout.tables(profile, L, recompute, dp)
        lo, hi = np.triu_indices(B + 1, 1)
        t = np.full((B + 1, B + 1), np.inf)
        t[lo, hi] = _microbatch_ms(tables, lo, hi)
        if tables.memory_limit is not None:  # a microbatch alone must fit (DynaPipe's constraint)
            need = tables.static_bytes.max() + tables.ranged.stash[:, lo, hi].max(axis=0)
            t[lo[need > tables.memory_limit], hi[need > tables.memory_limit]] = np.inf
        finite = np.sort(t[np.isfinite(t)])
        partitions = []
        for cap in np.unique(finite[np.linspace(0, len(finite) - 1, min(caps, len(finite))).astype(int)]):
            capped = np.where(t <= cap, t, np.inf)
            best, arg = np.full(B + 1, np.inf), np.zeros(B + 1, dtype=int)
            best[0] = 0.0
            for j in range(1, B + 1):  # best[j]: least sum of times cutting [0, j)
                c = best[:j] + capped[:j, j]
                arg[j] = int(np.argmin(c))
                best[j] = c[arg[j]]
            if not np.isfinite(best[B]):
                continue
            sizes, j = [], B
            while j > 0:
                sizes.append(j - arg[j])
                j = arg[j]
            partitions.append(((S - 1) * float(cap) + float(best[B]), sizes[::-1]))
        partitions.sort(key=lambda x: x[0])
        keep = [p for _, p in partitions[:8]]  # the DP's best by its objective (and a few more)
        choices.append((layout, keep, {"mode": mode, "microbatch_order": "ascending"}))
        rev = Layout.of_order(order[::-1], mode)
        choices.append((rev, [p[::-1] for p in keep], {"mode": mode, "microbatch_order": "descending"}))
    return _best_shared("dynapipe", profile, L, choices, S, recompute, dp)


def wlb(
    profile: Profile, lengths, S: int, recompute: bool = False, dp: Optional[AllReduceProfile] = None
) -> Optional[Plan]:
    if unavailable(profile, "wlb"):
        return None
    L = np.asarray(lengths)
    costs = [st.tokens["packed"] for st in profile.stages]
    b = sum(c.forward.b_ms + c.backward.b_ms for c in costs)
    c2 = sum(c.forward.c_ms + c.backward.c_ms for c in costs)
    work = b * L + c2 * L.astype(float) ** 2
    heaviest = np.argsort(-work, kind="stable")
    choices = []
    for m in range(1, len(L) + 1):
        load = np.zeros(m)
        groups: list[list[int]] = [[] for _ in range(m)]
        for i in heaviest:
            k = int(np.argmin(load))
            groups[k].append(int(i))
            load[k] += work[i]
        groups = [g for g in groups if g]
        order = [i for g in groups for i in g]
        choices.append((Layout.of_order(order, "packed"), [[len(g) for g in groups]], {"mode": "packed"}))
    return _best_shared("wlb", profile, L, choices, S, recompute, dp)


# the chunk layout each peer needs the profile to cost (the others choose among the profile's)
NEEDS = {"pad": "padded", "pack": "packed", "pack-split": "packed", "wlb": "packed"}


def unavailable(profile: Profile, method: str) -> Optional[str]:
    """Why ``method`` cannot plan for ``profile``'s model (None: it can): a peer that pads needs
    padded costs, one that packs packed ones, and the profile has those its model can take."""
    need = NEEDS.get(method)
    if need is None or profile.lengths is None or need in profile.lengths.modes:
        return None
    return (
        f"{method} needs {need} chunks, and the profile's model takes only "
        f"{' and '.join(profile.lengths.modes)} ones (see [Note: packed sequences] in umopt/zoo.py)"
    )


PEERS: dict[str, Callable[..., Optional[Plan]]] = {
    "pad": pad,
    "pack": packed_rows,
    "pack-split": packed_split,
    "sort-split": sort_split,
    "dynapipe": dynapipe,
    "wlb": wlb,
}


def timed(fn: Callable[..., Optional[Plan]], *args, **kwargs) -> Optional[Plan]:
    """``fn``'s plan with the time it took to make."""
    t0 = time.perf_counter()
    plan = fn(*args, **kwargs)
    if plan is not None:
        plan.planning_ms = (time.perf_counter() - t0) * 1e3
    return plan
