"""Search over several chunks per rank with unequal microbatches (``umopt solve --chunks``).

Each *shape* (chunks per rank v, looped or V-shaped placement, the cut of the layers) gets its
cost tables; every shape is screened with equal chunks for every M and a few order rules
(:func:`umopt.schedules.multichunk.equal_genes`: interleaved 1F1B's caps, twice them, none),
skipping an M whose busiest rank alone is slower than the best found. The best few screened
schedules are then improved by an iterated local search over the genes: one sample moved between
neighbouring chunks of a virtual stage (or of all virtual stages at once), two chunks merged, one
split, a partition copied to the next virtual stage, a rank's cap moved by a chunk, the order
rule flipped, a layer moved between virtual stages ([Note: layer moves]). Each schedule is scored by list scheduling (the reference simulator agrees to
1e-9), within the memory limit.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ...chunks import balanced_cut, chunking, placement, stage_cut
from ...costmodel import Chunking, ChunkOp, CostTables, OpKind, rank_peak_memory
from ...errors import UmoptError
from ...formats.profile import Profile
from ...schedules.multichunk import ChunkGenes, build_ops, equal_genes, rank_loads
from ...schedules.partition import equal_sizes
from ..problem import LayoutProblem

__all__ = ["ChunkShape", "ChunkSolution", "shapes", "solve_chunks"]


@dataclass(frozen=True)
class ChunkShape:
    chunks: int  # v
    placement: str  # "looped" | "vshape"
    cut: (
        str  # "stage": each stage cut into v; "balanced": all layers cut evenly; "searched": moved from those
    )
    chunking: Chunking


@dataclass
class ChunkSolution:
    shape: ChunkShape
    tables: CostTables
    genes: ChunkGenes
    ops: list[list[ChunkOp]]
    iteration_ms: float
    evaluated: int = 0
    equal_ms: Optional[float] = None  # the best equal schedule of the search's own screening
    screened: int = 0  # of the evaluated, those the screening built (the local search the rest)
    screened_ms: Optional[float] = None  # the screening's best: what the local search started from
    screen_cut: bool = False  # the time limit ended the screening before every shape and M


def shapes(
    profile: Profile, chunk_counts: Sequence[int], placements: Sequence[str] = ("looped", "vshape")
) -> list[ChunkShape]:
    """Every shape for the chunk counts: each placement, the stage cut and the balanced one."""
    out, seen = [], set()
    for v in chunk_counts:
        for place in placements if v > 1 else ("looped",):
            cuts = {}
            try:
                cuts["stage"] = stage_cut(profile, v)
            except UmoptError:
                pass
            try:
                cuts["balanced"] = balanced_cut(profile, v * profile.num_stages)
            except UmoptError:
                pass
            for name, cut in cuts.items():
                ch = chunking(profile, v, place, cut)
                if ch in seen:
                    continue
                seen.add(ch)
                out.append(ChunkShape(v, place, name, ch))
    if not out:
        raise UmoptError(
            f"no cut of the profile's {profile.num_layers} layers gives {', '.join(map(str, chunk_counts))} chunks per rank"
        )
    return out


def given_shape(profile: Profile, chunking: Chunking) -> ChunkShape:
    """A given cut and placement as a shape (its placement named where it is one of umopt's)."""
    v = len(chunking.ranks) // profile.num_stages
    for place in ("looped", "vshape"):
        if tuple(chunking.ranks) == tuple(placement(place, profile.num_stages, v)):
            return ChunkShape(v, place, "given", chunking)
    return ChunkShape(v, "custom", "given", chunking)


def _fits(tables: CostTables, ops: list[list[ChunkOp]]) -> bool:
    limit = tables.memory_limit
    return limit is None or all(rank_peak_memory(tables, r, o) <= limit for r, o in enumerate(ops))


def _variants(tables: CostTables, minibatch: int, m: int, weights: bool) -> list[ChunkGenes]:
    out = []
    for deep in (True, False):
        g = equal_genes(tables, minibatch, m, weights=weights, deep=deep)
        # interleaved 1F1B's warm-up, less of it (a memory limit), more, and none (all forwards first)
        for factor in (1, 0.5, 0.25, 2, None):
            h = g.copy()
            h.cap = (
                [max(1, int(c * factor)) for c in g.cap]
                if factor
                else [minibatch * tables.num_stages] * len(g.cap)
            )
            out.append(h)
    return out


def _own_m_variants(tables: CostTables, minibatch: int, weights: bool, max_size: int) -> list[ChunkGenes]:
    """Each virtual stage its own chunk count: the m minimising (m + k) c_j(B / m), its compute
    over m chunks plus k chunks' worth of fill and drain, for a few k (UMPIPE's point: a stage
    with a large per-op cost wants fewer, larger chunks than one without)."""
    B, S, R = minibatch, tables.num_stages, tables.num_ranks
    v = S // R
    bwd = tables.bwd_input if weights else tables.bwd
    out = []
    for k in (R / v / 2, R / v, 2 * R / v):
        parts = []
        for j in range(S):
            best = min(
                range(max(1, -(-B // max_size)), B + 1),
                key=lambda m: (
                    (m + k) * sum(float(tables.fwd[j, b] + bwd[j, b]) for b in equal_sizes(B, m)) / m
                ),
            )
            parts.append(equal_sizes(B, best))
        m_ref = round(sum(len(p) for p in parts) / S)
        for g in _variants(tables, B, max(1, m_ref), weights):
            g.fwd = [list(p) for p in parts]
            out.append(g)
    return out


def _mutate(g: ChunkGenes, tables: CostTables, rng: random.Random, max_size: int) -> Optional[ChunkGenes]:
    h = g.copy()
    S = len(h.fwd)
    parts = h.bwd if (h.bwd is not None and rng.random() < 0.5) else h.fwd
    what = rng.random()
    j = rng.randrange(S)
    p = parts[j]
    if what < 0.35 and len(p) > 1:  # a sample between neighbours, on one stage or on all
        k = rng.randrange(len(p) - 1)
        d = rng.choice((-1, 1))
        targets = [j] if rng.random() < 0.6 else range(S)
        for t in targets:
            q = parts[t]
            if k < len(q) - 1 and 1 <= q[k] + d <= max_size and 1 <= q[k + 1] - d <= max_size:
                q[k] += d
                q[k + 1] -= d
    elif what < 0.45 and len(p) > 1:  # merge two neighbours
        k = rng.randrange(len(p) - 1)
        if p[k] + p[k + 1] > max_size:
            return None
        p[k : k + 2] = [p[k] + p[k + 1]]
    elif what < 0.55:  # split one
        k = rng.randrange(len(p))
        if p[k] < 2:
            return None
        a = p[k] // 2
        p[k : k + 1] = [a, p[k] - a]
    elif what < 0.62:  # one chunk more or fewer on the stage, equal sizes
        m = len(p) + rng.choice((-1, 1))
        B = sum(p)
        if not -(-B // max_size) <= m <= B:
            return None
        parts[j] = equal_sizes(B, m)
    elif what < 0.67:  # the neighbour's partition
        t = j + rng.choice((-1, 1))
        if not 0 <= t < S:
            return None
        parts[t] = list(p)
    elif what < 0.9:  # a rank's cap
        r = rng.randrange(len(h.cap))
        step = max(1, max(p))
        h.cap[r] = max(1, h.cap[r] + rng.choice((-step, step)))
    elif what < 0.95:
        h.deep = not h.deep
    else:
        if not h.weights:
            return None
        h.defer_w = not h.defer_w
    if h.signature() == g.signature():
        return None
    return h


# [Note: layer moves]
# The cuts screened (each stage in v pieces, or all layers evenly by time) are where a search
# starts, not where it must stay: a virtual stage's cost shapes the fill and drain of those after
# it, so the best cut under a schedule is not the most even one. The local search moves one layer
# across one boundary between virtual stages now and then (each virtual stage keeps a layer at
# least); the partitions stay as they are, the cost tables of the new cut are built (and kept).
LAYER_MOVES = 0.1  # of the local search's moves


def _move_layer(shape: ChunkShape, rng: random.Random) -> Optional[ChunkShape]:
    """The shape with one layer moved across one boundary between virtual stages."""
    layers = [list(r) for r in shape.chunking.layers]
    j = rng.randrange(len(layers) - 1)
    d = rng.choice((-1, 1))  # the boundary after virtual stage j moves by d layers
    if layers[j][1] + d <= layers[j][0] or layers[j][1] + d >= layers[j + 1][1]:
        return None
    layers[j][1] += d
    layers[j + 1][0] += d
    ch = Chunking(tuple(tuple(r) for r in layers), shape.chunking.ranks)
    return ChunkShape(shape.chunks, shape.placement, "searched", ch)


def _screen(
    problem: LayoutProblem,
    chunk_counts: Sequence[int],
    weights: bool,
    keep: int,
    progress: Optional[Callable[[float, float], None]],
    until: float,
    on: Optional[Chunking] = None,
) -> tuple[list[tuple[float, int, ChunkShape, CostTables, ChunkGenes, list]], int, bool]:
    """Equal schedules of every shape and M, the most promising first: (shape, M) pairs in order
    of their busiest rank's load (no schedule of them is faster), while within 2% of the best
    found, then each shape's own-M variants; within the memory limit, until ``until`` (once
    one schedule fits). Returns them, how many were built, and whether time cut it short."""
    profile, B = problem.profile, problem.minibatch
    screened: list[tuple[float, int, ChunkShape, CostTables, ChunkGenes, list]] = []
    evaluated = 0
    best_ms = float("inf")
    all_shapes = shapes(profile, chunk_counts) if on is None else [given_shape(profile, on)]
    tables = []
    pairs = []  # (the order of promise, the pair's lower bound, M, shape's index)
    for n, shape in enumerate(all_shapes):
        tables.append(problem.tables(shape.chunking))
        R = tables[n].num_ranks
        for m in range(max(1, -(-B // problem.max_size)), B + 1):
            g = equal_genes(tables[n], B, m, weights=weights)
            low = max(rank_loads(tables[n], B, g)) + tables[n].optimizer_ms
            # by sequences a plan has milliseconds, not seconds, to screen: the bound with the
            # fill and drain (R - 1 of a rank's V/R x M op slots) orders them, which the bound
            # alone, lowest for the fewest chunks, does not
            promise = low * (1 + (R - 1) / (shape.chunks * m)) if problem.tokens is not None else low
            pairs.append((promise, low, m, n))
        if time.perf_counter() > until and n >= 1:
            break  # the rest of the shapes are not screened at all
    pairs.sort()
    shapes_seen = len(tables)

    def add(genes: list[ChunkGenes], n: int) -> bool:
        """Build and keep those that fit; whether any did."""
        nonlocal evaluated, best_ms
        fit = False
        for g in genes:
            ops, ms = build_ops(tables[n], B, g)
            evaluated += 1
            if _fits(tables[n], ops):
                screened.append((ms, evaluated, all_shapes[n], tables[n], g, ops))
                best_ms = min(best_ms, ms)
                fit = True
        return fit

    def out_of_time() -> bool:
        return bool(screened) and time.perf_counter() > until

    cut = shapes_seen < len(all_shapes)
    # a shape whose M chunks fit in none of their variants: fewer, larger chunks hold more
    too_big: dict[int, int] = {}
    for i, (promise, low, m, n) in enumerate(pairs):
        if promise >= best_ms * 1.02 and len(screened) >= keep:
            break
        if m <= too_big.get(n, 0):
            continue
        if out_of_time():
            cut = True
            break
        if not add(_variants(tables[n], B, m, weights), n):
            too_big[n] = max(too_big.get(n, 0), m)
        if progress is not None and i % 8 == 0:
            progress(0.3 * min(1.0, i / len(pairs)), best_ms)
    # each shape's own-M variants, the most promising shapes first
    first_low = {}
    for promise, _, _, n in pairs:
        first_low.setdefault(n, promise)
    for n in sorted(first_low, key=first_low.get):
        if out_of_time():
            cut = True
            break
        add(_own_m_variants(tables[n], B, weights, problem.max_size), n)
    if not screened:
        raise UmoptError("no schedule with several chunks per rank fits the memory limit")
    return screened, evaluated, cut


SCREEN_SHARE = 0.5  # of solve_chunks' time at most, for the screening; the local search the rest


def solve_chunks(
    problem: LayoutProblem,
    *,
    chunk_counts: Sequence[int] = (1, 2, 3, 4),
    weights: bool = False,
    seconds: float = 30.0,
    seed: int = 0,
    keep: int = 3,
    progress: Optional[Callable[[float, float], None]] = None,
    on: Optional[Chunking] = None,
    evaluations: Optional[int] = None,
) -> ChunkSolution:
    """The fastest multi-chunk schedule found within ``seconds``: the screening (at most
    :data:`SCREEN_SHARE` of them, once one schedule fits), then the local search. ``on``: that
    cut and placement only (the layers a running pipeline's modules hold), no layer moves.
    ``evaluations``: the local search ends after this many schedules too (with ample ``seconds``,
    a search that is the same on every machine: tests, benches)."""
    start = time.perf_counter()
    rng = random.Random(seed)
    B = problem.minibatch
    if weights and not problem.split:
        raise UmoptError(
            "W ops need the profile's layers with backward_input_ms / backward_weight_ms (profile with --split-backward)"
        )
    screened, evaluated, cut = _screen(
        problem, chunk_counts, weights, keep, progress, start + SCREEN_SHARE * seconds, on
    )
    screened_count = evaluated
    screened.sort(key=lambda x: x[:2])
    equal_ms = screened[0][0]
    # the best few, each from a different shape, climbed in turns
    starts, used = [], set()
    for item in screened:
        if item[2] not in used:
            used.add(item[2])
            starts.append(item)
        if len(starts) == keep:
            break
    pool = [list(x) for x in starts]
    best = min(pool, key=lambda x: x[0])
    screened_ms = best[0]
    deadline = start + seconds
    tried: set = set()
    last = None if evaluations is None else evaluated + evaluations
    while time.perf_counter() < deadline and (last is None or evaluated < last):
        for item in pool:
            if last is not None and evaluated >= last:
                break
            ms, _, shape, tables, g, ops = item
            if rng.random() < LAYER_MOVES and on is None:  # [Note: layer moves]
                moved = _move_layer(shape, rng)
                if moved is None:
                    continue
                h, h_shape = g, moved
                h_tables = problem.tables(moved.chunking)
            else:
                h = _mutate(g, tables, rng, problem.max_size)
                h_shape, h_tables = shape, tables
            if h is None or (h_shape, h.signature()) in tried:
                continue
            tried.add((h_shape, h.signature()))
            h_ops, h_ms = build_ops(h_tables, B, h)
            evaluated += 1
            if h_ms <= ms + 1e-9 and _fits(h_tables, h_ops):
                item[0], item[2], item[3], item[4], item[5] = h_ms, h_shape, h_tables, h, h_ops
                if h_ms < best[0] - 1e-9:
                    best = item
        if progress is not None:
            progress(min(1.0, 0.3 + 0.7 * (time.perf_counter() - start) / max(seconds, 1e-9)), best[0])
    ms, _, shape, tables, g, ops = best
    return ChunkSolution(
        shape,
        tables,
        g,
        ops,
        ms,
        evaluated,
        equal_ms,
        screened=screened_count,
        screened_ms=screened_ms,
        screen_cut=cut,
    )


def improve_order(
    tables: CostTables,
    ops: Sequence[Sequence[ChunkOp]],
    minibatch: int,
    seconds: float,
    seed: int = 0,
) -> tuple[list[list[ChunkOp]], float, int]:
    """Hill climbing over the ranks' op orders themselves, partitions fixed: an op moved a few
    places earlier or later on its rank (kept where the schedule stays valid, deadlock-free and
    within the memory limit, and no slower). For a schedule list scheduling cannot express, such
    as torch's own orders, or to polish one it built. Returns the ops, their iteration time and
    the schedules scored."""
    from ...costmodel import simulate

    rng = random.Random(seed)
    best = [list(r) for r in ops]
    best_ms = simulate(tables, best, minibatch, record=False).iteration_ms
    deadline = time.perf_counter() + seconds
    evaluated = 0
    limit = tables.memory_limit
    while time.perf_counter() < deadline:
        r = rng.randrange(len(best))
        row = best[r]
        if len(row) < 2:
            continue
        i = rng.randrange(len(row))
        k = max(0, min(len(row) - 1, i + rng.choice((-3, -2, -1, 1, 2, 3))))
        lo, hi = min(i, k), max(i, k)
        if k == i or any(
            op.stage == row[i].stage and op.kind == OpKind.F == row[i].kind
            for op in row[lo : hi + 1]
            if op is not row[i]
        ):
            continue  # a stage's forwards keep their sample order (validity, rule 1)
        trial = list(row)
        trial.insert(k, trial.pop(i))
        cand = best[:r] + [trial] + best[r + 1 :]
        try:
            ms = simulate(tables, cand, minibatch, record=False).iteration_ms
        except UmoptError:  # a B before its F, a W before its B, or a deadlock
            continue
        evaluated += 1
        if ms <= best_ms + 1e-9 and (limit is None or rank_peak_memory(tables, r, trial) <= limit):
            best, best_ms = cand, ms
    return best, best_ms, evaluated
