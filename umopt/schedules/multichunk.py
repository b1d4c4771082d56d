"""Several chunks per rank with unequal microbatches: genes -> every rank's op order.

A schedule of this family is given by its genes (:class:`ChunkGenes`): each virtual stage's
partition of the minibatch (forward and, with recompute, backward), and a rank's rule for which
ready op to run next. :func:`build_ops` plays the genes under the cost model by list scheduling
([Note: list scheduling]) and returns the ranks' op lists, which are ordinary schedule ops: the
reference simulator plays them to the same times.

[Note: list scheduling]
Interleaved 1F1B (Megatron, torch) fixes each rank's order by microbatch index, which presumes
every virtual stage splits the minibatch the same way. With a partition per virtual stage the
order has to follow the data instead: a rank, whenever it is free, runs one of its ops whose
inputs have arrived, chosen by a priority rule; when none has, it waits for the first that will.
The rule is 1F1B's: forwards while fewer than ``cap[r]`` samples are in flight on the rank
(forwarded, backward not yet run; with W ops, weight gradient not yet run, as the memory model
holds them), then a backward first whenever one is ready, waiting for it
rather than forwarding more; among ready forwards, the deeper virtual stage first (``deep``,
depth-first as in interleaved 1F1B) or the earlier samples first (breadth-first). With W ops, a
chunk's weight gradient waits and runs where the rank would otherwise idle (zero bubble), or at
once after its B (``defer_w`` off). Ops are committed in the order of their start times over all
ranks, so no op can later turn out to have been ready earlier: the order is the one a greedy
rank would run, and it never deadlocks (where every rank waits on its cap, the earliest-free rank
forwards anyway). Memory is the cost model's, checked on the result: the search lowers ``cap``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..costmodel import ChunkOp, CostTables, OpKind, weight_ms
from .partition import chunks as sample_ranges

__all__ = ["ChunkGenes", "build_ops", "equal_genes", "rank_loads"]

_INF = float("inf")


@dataclass
class ChunkGenes:
    fwd: list[list[int]]  # per virtual stage: its F chunks' sizes, in sample order
    cap: list[int]  # per rank: samples in flight before a ready backward goes first
    deep: bool = True  # among ready forwards, the deeper virtual stage first
    weights: bool = False  # split backward: B is the input gradient, W the weight gradient
    defer_w: bool = True  # W ops wait for idle time (else each runs right after its B)
    bwd: Optional[list[list[int]]] = None  # with recompute: B chunks per virtual stage (None: the F chunks)

    def copy(self) -> "ChunkGenes":
        return ChunkGenes(
            [list(p) for p in self.fwd],
            list(self.cap),
            self.deep,
            self.weights,
            self.defer_w,
            None if self.bwd is None else [list(p) for p in self.bwd],
        )

    def signature(self) -> tuple:
        return (
            tuple(map(tuple, self.fwd)),
            tuple(self.cap),
            self.deep,
            self.weights,
            self.defer_w,
            None if self.bwd is None else tuple(map(tuple, self.bwd)),
        )


def build_ops(tables: CostTables, minibatch: int, genes: ChunkGenes) -> tuple[list[list[ChunkOp]], float]:
    """Every rank's op list for ``genes`` and the iteration time the cost model gives it."""
    # one piece: the list scheduler's steps (pick, run, release) share its per-rank state, as
    # simulate's loop shares its own
    S, R, B = tables.num_stages, tables.num_ranks, minibatch
    local = [[j for j in range(S) if tables.rank_of(j) == r] for r in range(R)]
    fr = [sample_ranges(p) for p in genes.fwd]
    br = [sample_ranges(p) for p in (genes.bwd or genes.fwd)]
    bwd_table = "bwd_input" if genes.weights else "bwd"
    act = [[0.0] * B] + [[_INF] * B for _ in range(S - 1)]
    grad = [[_INF] * B for _ in range(S)]
    fi, bi = [0] * S, [0] * S
    f_upto = [0] * S  # samples [0, f_upto) forwarded on the stage
    free = [0.0] * R
    inflight = [0] * R
    pending_w: list[list[tuple[int, int, int]]] = [[] for _ in range(R)]
    link_free: dict[tuple[int, int], float] = {}
    ops: list[list[ChunkOp]] = [[] for _ in range(R)]
    left = [sum(len(fr[j]) + len(br[j]) for j in local[r]) for r in range(R)]
    stale = [True] * R
    best: list[tuple[float, str, int]] = [(_INF, "", -1)] * R

    def ready_f(j: int) -> float:
        lo, hi = fr[j][fi[j]]
        return max(act[j][lo:hi])

    def ready_b(j: int) -> float:
        lo, hi = br[j][bi[j]]
        return max(grad[j][lo:hi]) if f_upto[j] >= hi else _INF

    def choose(r: int, force: bool = False) -> tuple[float, str, int]:
        t0 = free[r]
        fs = [(ready_f(j), j) for j in local[r] if fi[j] < len(fr[j])]
        bs = [(ready_b(j), j) for j in local[r] if bi[j] < len(br[j])]
        b_now = [(t, -j) for t, j in bs if t <= t0]
        f_now = [(-j if genes.deep else fr[j][fi[j]][0], j) for t, j in fs if t <= t0]
        capped = inflight[r] >= genes.cap[r] and not force  # (with W ops: until their W, as memory is)
        if b_now and (capped or not f_now):
            return t0, OpKind.B, -min(b_now)[1]
        if f_now and not capped:
            return t0, OpKind.F, min(f_now)[1]
        if pending_w[r] and genes.defer_w:  # the rank would idle: a deferred W fills it
            return t0, OpKind.W, pending_w[r][0][0]
        # nothing to run now: the first op that will be ready (a forward only under the cap)
        nxt = [(t, 0, OpKind.B, j) for t, j in bs] + ([] if capped else [(t, 1, OpKind.F, j) for t, j in fs])
        t, _, kind, j = min(nxt, default=(_INF, 0, "", -1))
        return max(t, t0), kind, j

    def send(direction: str, j: int, lo: int, hi: int, sent: float, dest: list[float]) -> None:
        ch = tables.channel(j, direction)
        start = max(sent, link_free.get(ch, 0.0))
        end = start + float(tables.link_ms(j, lo, hi))
        link_free[ch] = end
        dest[lo:hi] = [end] * (hi - lo)

    def run(r: int, start: float, kind: str, j: int) -> None:
        if kind == OpKind.W:
            j, lo, hi = pending_w[r].pop(0)
            dur = weight_ms(tables, j, [(lo, hi)])
            inflight[r] -= hi - lo
        elif kind == OpKind.F:
            lo, hi = fr[j][fi[j]]
            fi[j] += 1
            f_upto[j] = hi
            dur = float(tables.op_ms("fwd", j, lo, hi))
            inflight[r] += hi - lo
            left[r] -= 1
        else:
            lo, hi = br[j][bi[j]]
            bi[j] += 1
            dur = float(tables.op_ms(bwd_table, j, lo, hi))
            inflight[r] -= 0 if genes.weights else hi - lo
            left[r] -= 1
        end = start + dur
        free[r] = end
        ops[r].append(ChunkOp(kind, lo, hi, j))
        stale[r] = True
        if kind == OpKind.F:
            if j + 1 < S:
                send("fwd", j, lo, hi, end, act[j + 1])
                stale[tables.rank_of(j + 1)] = True
            else:
                grad[j][lo:hi] = [end] * (hi - lo)
        elif kind == OpKind.B:
            if j > 0:
                send("bwd", j - 1, lo, hi, end, grad[j - 1])
                stale[tables.rank_of(j - 1)] = True
            if genes.weights:
                pending_w[r].append((j, lo, hi))

    while True:
        # a rank's ops after its last F or B: W ops still owed, run back to back
        for r in range(R):
            if left[r] == 0 and pending_w[r]:
                while pending_w[r]:
                    run(r, free[r], OpKind.W, -1)
                stale[r] = False
                best[r] = (_INF, "", -1)
            elif stale[r] and left[r] > 0:
                if pending_w[r] and not genes.defer_w:  # W right after its B
                    best[r] = (free[r], OpKind.W, -1)
                else:
                    best[r] = choose(r)
                stale[r] = False
        if all(n == 0 for n in left):
            break
        t, r = min((best[r][0], r) for r in range(R) if left[r] > 0)
        if t == _INF:  # every rank waits on its cap: the first that can forward does anyway
            forced = {r: choose(r, force=True) for r in range(R) if left[r] > 0}
            t, r = min((c[0], r) for r, c in forced.items())
            if t == _INF:
                raise AssertionError("list scheduling found nothing to run")  # the F chain always can
            best[r] = forced[r]
        run(r, *best[r])
    ar = tables.allreduce_ms
    return ops, max(free[r] + float(ar[r]) for r in range(R)) + tables.optimizer_ms


def equal_genes(
    tables: CostTables, minibatch: int, microbatches: int, *, weights: bool = False, deep: bool = True
) -> ChunkGenes:
    """Equal chunks on every virtual stage and interleaved 1F1B's warm-up as each rank's cap. By
    sequences of different lengths (``tables.ranged``), equal in work instead: each virtual stage
    cut where its own forward and backward time adds up to equal shares (UMPIPE's per-stage
    partition), the cap counting samples of the mean size."""
    from .partition import equal_sizes

    S, R = tables.num_stages, tables.num_ranks
    sizes = equal_sizes(minibatch, microbatches)
    parts = [list(sizes) for _ in range(S)]
    if tables.ranged is not None:
        parts = [_work_cut(tables, j, minibatch, microbatches) for j in range(S)]
    v = S // R
    per = max(sizes)
    # torch's _get_warmup_ops (multiply_factor 2): (v - 1) rounds of R microbatches + 2 (R - 1 - r)
    caps = [
        min(v * microbatches, (v - 1) * min(R, microbatches) + 2 * (R - 1 - r) + 1) * per for r in range(R)
    ]
    return ChunkGenes(parts, caps, deep=deep, weights=weights)


def _work_cut(tables: CostTables, stage: int, minibatch: int, m: int) -> list[int]:
    """``m`` chunks of the samples in order, cut where the stage's time on the samples before
    the cut (its F and B ops on that prefix) reaches each k/m of the whole; every chunk one
    sample at least."""
    import numpy as np

    B = minibatch
    r = tables.ranged
    prefix = r.fwd[stage][0, : B + 1] + r.bwd[stage][0, : B + 1]
    ends = np.searchsorted(prefix, prefix[B] * np.arange(1, m) / m)
    cuts = [0]
    for k, e in enumerate(ends, start=1):  # at least a sample per chunk, room for the rest
        cuts.append(int(min(max(e, cuts[-1] + 1), B - (m - k))))
    cuts.append(B)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def rank_loads(tables: CostTables, minibatch: int, genes: ChunkGenes) -> list[float]:
    """Each rank's compute time under ``genes``: no iteration is shorter than the largest."""
    busy = [0.0] * tables.num_ranks
    bwd = "bwd_input" if genes.weights else "bwd"

    def total(table: str, j: int, part) -> float:
        return sum(float(tables.op_ms(table, j, lo, hi)) for lo, hi in sample_ranges(part))

    for j, part in enumerate(genes.fwd):
        r = tables.rank_of(j)
        back = genes.bwd[j] if genes.bwd else part
        busy[r] += total("fwd", j, part) + total(bwd, j, back)
        if genes.weights:
            busy[r] += total("bwd_weight", j, back)
    return busy
