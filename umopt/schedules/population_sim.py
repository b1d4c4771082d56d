"""Scoring a whole population of schedules in one call (the TiDGAP idea), in GPipe or 1F1B order.

The paper's GA spends its time evaluating schedules; TiDGAP evaluates the whole population with
matrix operations instead of one simulation per individual. Here the trick is that, in GPipe
order, every recurrence of the cost model is a max-plus scan:

    end_k = max(end_{k-1}, ready_k) + d_k   ==>   end = C + cummax(ready - C_prev),  C = cumsum(d)

and a link that carries one message at a time is the same scan over message durations. So each
stage costs a handful of ``cumsum`` / ``maximum.accumulate`` passes over a (population x chunks)
array, and which upstream message holds a chunk's last sample is one ``searchsorted``. Where the
install built ``umopt/schedules/_population_sim.cpp``, both evaluators run compiled instead, an individual at a
time with the same floating-point steps (``COMPILED``); the numpy code stays as the fallback
and as what the compiled scores are tested against.

An individual is, per stage, a forward partition and a backward partition (zero-padded chunk
sizes in sample order, see :mod:`umopt.schedules.partition`). F ops run in sample order, B ops in reverse.
The result must equal :func:`umopt.costmodel.simulate` on the same ops to 1e-9 (tested).
:func:`evaluate_1f1b` does the same for 1F1B order, where dependencies run both ways between
stages and a different scheme is needed (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..costmodel import CostTables, simulate
from ..errors import UmoptError
from .gpipe import gpipe_ops
from .onef1b import onef1b_schedule
from .weights import with_weight_ops

# what this module calls the compiled evaluators with (their VERSION)
_COMPILED_VERSION = 3
try:  # both evaluators compiled (setup.py); where they did not build, numpy (and a Python loop for 1F1B)
    from . import _population_sim as _compiled
except ImportError:  # pragma: no cover - depends on the install
    _compiled = None
if _compiled is not None and getattr(_compiled, "VERSION", None) != _COMPILED_VERSION:  # pragma: no cover
    _compiled = None  # an editable install whose rebuild failed keeps the module it built before

__all__ = ["COMPILED", "PopulationScore", "evaluate_gpipe", "evaluate_1f1b", "evaluate_split"]

# whether the evaluators run compiled (the GA's scoring, several times sooner)
COMPILED = _compiled is not None


@dataclass
class PopulationScore:
    iteration_ms: np.ndarray  # (P,)
    finish_ms: np.ndarray  # (P, S) end of each stage's last op
    busy_ms: np.ndarray  # (P, S)
    peak_memory_bytes: np.ndarray  # (P, S)


def _scan(ready: np.ndarray, dur: np.ndarray, start: np.ndarray | float, reverse: bool = False) -> np.ndarray:
    """End times of jobs run one at a time in chunk order (axis 0, or reversed): job k starts at
    max(previous end, ready_k, start). Padding chunks (ready -inf, duration 0) change nothing.

    A loop over the K chunk rows, each step a vector operation over the whole population: numpy's
    ``accumulate`` along an axis is several times slower than K row operations for the K and P
    that occur here, and the loop does the very same float operations as the reference simulator.
    """
    end = np.empty_like(dur)
    prev = np.broadcast_to(np.asarray(start, dtype=float), dur.shape[1:])
    for k in range(dur.shape[0] - 1, -1, -1) if reverse else range(dur.shape[0]):
        np.maximum(prev, ready[k], out=end[k])
        end[k] += dur[k]
        prev = end[k]
    return end


def _running_sum(x: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum along axis 0 (row loop; see :func:`_scan`)."""
    out = np.empty_like(x)
    out[0] = x[0]
    for k in range(1, x.shape[0]):
        np.add(out[k - 1], x[k], out=out[k])
    return out


class _Partition:
    """One stage's partition for the whole population, in chunk-major (K, P) layout."""

    def __init__(self, sizes: np.ndarray, minibatch: int, cols: np.ndarray):
        self.sizes = sizes
        self.last = _running_sum(sizes) - 1  # last sample of each chunk (padding: minibatch - 1)
        self.first = self.last - sizes + 1  # first sample (padding: minibatch)
        self.pad = np.where(sizes > 0, 0.0, -np.inf)  # added to ready times: padding never waits
        self._minibatch, self._cols = minibatch, cols
        self._chunk_of = None

    def costs(self, tables: CostTables, table: str, s: int) -> np.ndarray:
        """(K, P) costs of every chunk from ``table`` of stage (or link) ``s``: by size, or by
        sample range (see [Note: costs by sample range]; padding is an empty range, costs 0)."""
        if tables.ranged is None:
            return getattr(tables, table)[s][self.sizes]
        hi = self.last + 1
        return getattr(tables.ranged, table)[s][hi - self.sizes, hi]

    def chunk_of(self, samples: np.ndarray) -> np.ndarray:
        """Index of this partition's chunk that holds ``samples[k, p]`` (entries >= B are clipped).

        The chunk holding sample i is the number of chunk ends before i: mark the ends, then an
        exclusive running count down the samples, computed once and looked up.
        """
        B, cols = self._minibatch, self._cols
        P = cols.size
        if self._chunk_of is None:
            mark = np.zeros((B, P), dtype=np.int16 if B < 32000 else np.int32)
            mark.ravel()[self.last * P + cols] = 1  # padding repeats the last end: harmless
            count = np.empty_like(mark)
            count[0] = 0
            for i in range(1, B):
                np.add(count[i - 1], mark[i - 1], out=count[i])
            self._chunk_of = count.ravel()
        return self._chunk_of[np.minimum(samples, B - 1) * P + cols].astype(cols.dtype)


def evaluate_gpipe(
    tables: CostTables, fsizes: np.ndarray, bsizes: np.ndarray | None = None, wcap: np.ndarray | None = None
) -> PopulationScore:
    """Score P GPipe-order schedules.

    ``fsizes``: int array (P, S, K) of forward chunk sizes per stage, zero-padded at the end.
    ``bsizes``: the same for backward chunks (sample order); ``None`` means the forward partition.
    ``wcap``: (P, S) W-op caps (see :func:`evaluate_split`); None: no W ops.
    Compiled where the install built it (:mod:`umopt.schedules._population_sim`: the same scans an individual at
    a time, the same scores to the bit; faster than numpy at the GA's population, where numpy's
    work per call is large against its work per row).
    """
    fsizes = np.asarray(fsizes)
    if wcap is not None:
        return evaluate_split(tables, fsizes, bsizes, wcap)
    P, S, _ = fsizes.shape
    B = int(fsizes[0, 0].sum())
    if _compiled is not None:
        it, finish, busy, peak = _compiled.evaluate_gpipe(
            *_one_width(fsizes, bsizes), _compiled_costs(tables, B)
        )
        return _scored(
            fsizes,
            bsizes,
            tables,
            PopulationScore(iteration_ms=it, finish_ms=finish, busy_ms=busy, peak_memory_bytes=peak),
        )
    idx = np.int32 if B * P < 2**31 else np.int64
    cols = np.arange(P, dtype=idx)
    # Chunk-major layout (S, K, P): every scan step is then one contiguous row of the population.
    fparts = [_Partition(np.ascontiguousarray(fsizes[:, s].T, dtype=idx), B, cols) for s in range(S)]
    if bsizes is None:
        bparts = fparts
    else:
        bsizes = np.asarray(bsizes)
        bparts = [_Partition(np.ascontiguousarray(bsizes[:, s].T, dtype=idx), B, cols) for s in range(S)]
    busy = np.zeros((S, P))
    peak = np.zeros((S, P))
    fwd_end = np.zeros((S, P))

    # Forward sweep: activations flow from stage 0 to S-1, chunks in sample order. A chunk is
    # ready when the upstream message holding its last sample has arrived (arrivals only grow).
    arrive = None
    for s in range(S):
        part = fparts[s]
        if s == 0:
            ready = part.pad
        else:
            holder = fparts[s - 1].chunk_of(part.last)
            ready = _gather(arrive, holder) + part.pad
        d = part.costs(tables, "fwd", s)
        end = _scan(ready, d, 0.0)
        fwd_end[s] = end[-1]
        busy[s] = d.sum(axis=0)
        if s + 1 < S:
            arrive = _scan(end + part.pad, part.costs(tables, "link", s), 0.0)

    # Backward sweep: gradients flow from S-1 to 0 and B chunks run in reverse sample order, so
    # the scans run backwards over the chunks and a chunk waits for the gradient message that
    # holds its *first* sample.
    finish = np.zeros((S, P))
    for s in range(S - 1, -1, -1):
        part = bparts[s]
        if s == S - 1:
            ready = part.pad  # the last stage's own F ops have all ended before its first B
        else:
            holder = bparts[s + 1].chunk_of(part.first)
            ready = _gather(arrive, holder) + part.pad
        d = part.costs(tables, "bwd", s)
        end = _scan(ready, d, fwd_end[s], reverse=True)
        finish[s] = end[0]
        busy[s] += d.sum(axis=0)
        if s > 0:
            arrive = _scan(end + part.pad, part.costs(tables, "link", s - 1), 0.0, reverse=True)
        peak[s] = _gpipe_peak(tables, s, fparts[s], part)

    return _scored(
        fsizes,
        bsizes,
        tables,
        PopulationScore(
            iteration_ms=finish.max(axis=0) + tables.optimizer_ms,
            finish_ms=finish.T,
            busy_ms=busy.T,
            peak_memory_bytes=peak.T,
        ),
    )


def _one_width(fsizes: np.ndarray, bsizes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward partitions (the forward ones where ``bsizes`` is None) padded to one
    number of chunks."""
    bsizes = fsizes if bsizes is None else np.asarray(bsizes)
    K = max(fsizes.shape[2], bsizes.shape[2])
    return tuple(
        a if a.shape[2] == K else np.pad(a, ((0, 0), (0, 0), (0, K - a.shape[2]))) for a in (fsizes, bsizes)
    )


def _compiled_costs(tables: CostTables, minibatch: int):
    """The tables as the compiled evaluators take them (a few microseconds: views of the
    arrays and three short copies)."""
    t = tables
    costs = _compiled.Costs(
        t.fwd,
        t.bwd,
        t.link,
        t.static_bytes,
        t.stash_bytes,
        t.input_bytes,
        t.optimizer_ms,
        t.recompute,
        minibatch,
    )
    if t.ranged is not None:  # by sample range (see [Note: costs by sample range])
        R = t.ranged
        none = np.zeros(0)
        costs.set_ranged(
            R.fwd,
            R.bwd,
            R.link if R.link.size else np.zeros((1,) + R.fwd.shape[1:]),
            none if R.bwd_input is None else R.bwd_input,
            none if R.bwd_weight is None else R.bwd_weight,
            R.stash,
            R.inputs,
        )
    return costs


def _gather(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``values[rows[k, p], p]`` for (K, P) arrays (take_along_axis, but faster here)."""
    P = values.shape[1]
    return values.ravel()[rows * P + np.arange(P, dtype=rows.dtype)]


def _gpipe_peak(tables: CostTables, s: int, fpart: _Partition, bpart: _Partition) -> np.ndarray:
    """Peak memory of stage ``s`` in GPipe order (see costmodel.rank_peak_memory), per individual."""
    static = float(tables.static_bytes[s])
    if tables.ranged is None:
        f, b = fpart.sizes, bpart.sizes
        B = f.sum(axis=0)
        if not tables.recompute:
            return static + B * float(tables.stash_bytes[s])
        inb, stash = float(tables.input_bytes[s]), float(tables.stash_bytes[s])
        during_f = _running_sum(f) * inb + f * stash
        # B ops run in reverse sample order: while chunk k runs, samples [0, its end) are still held.
        during_b = np.where(b > 0, (_running_sum(b)) * inb + b * stash, 0.0)
        return static + np.maximum(during_f.max(axis=0), during_b.max(axis=0))
    # by sample range: the same, each chunk's own bytes
    R = tables.ranged
    fhi, bhi = fpart.last + 1, bpart.last + 1
    flo, blo = fhi - fpart.sizes, bhi - bpart.sizes
    if not tables.recompute:
        return static + R.stash[s][flo, fhi].sum(axis=0).astype(float)
    during_f = _running_sum(R.inputs[s][flo, fhi]) + R.stash[s][flo, fhi]
    during_b = np.where(bpart.sizes > 0, _running_sum(R.inputs[s][blo, bhi]) + R.stash[s][blo, bhi], 0)
    return static + np.maximum(during_f.max(axis=0), during_b.max(axis=0)).astype(float)


def evaluate_1f1b(
    tables: CostTables,
    fsizes: np.ndarray,
    warmup: np.ndarray | None = None,
    bsizes: np.ndarray | None = None,
    wcap: np.ndarray | None = None,
) -> PopulationScore:
    """Score P schedules in 1F1B order. ``warmup[p, s]``: forwards stage s runs before its first
    backward (default ``S - s - 1``, PipeDream-flush). ``bsizes``: the backward partitions (same
    layout as ``fsizes``), which may differ only with recompute; ``None``: the forward ones.
    ``wcap``: (P, S) W-op caps (see :func:`evaluate_split`); None: no W ops.

    The op order of every stage is :func:`umopt.schedules.onef1b.onef1b_schedule`'s, built here for the
    whole population at once: from the last stage up, the samples each backward needs forwarded
    first, then the slot of every F and B op.

    In 1F1B a stage's backward waits for gradients while its forward feeds the next stage, so the
    dependencies run both ways and no sweep over the stages in one direction settles them. The
    slots are played instead the way the reference simulator plays ops: every stage keeps a
    pointer and runs its next slot once the message it waits for has arrived, rounds over the
    stages alternating in direction, each step one vector operation over the population. An
    individual whose pointers stop short of the end deadlocked and gets an infinite time.

    Where the install built it, all of this runs compiled (:mod:`umopt.schedules._population_sim`, the same
    rules an individual at a time, the same scores to the bit), construction of the slots included:
    that, not the play loop, is most of the numpy version's call (``python
    bench/evaluator_throughput.py`` compares them).
    """
    # one piece: its steps (the slots, then the play) share the population's arrays, as the one
    # function of the compiled evaluator does that it is tested against, score for score
    if wcap is not None:
        return evaluate_split(tables, fsizes, bsizes, wcap, warmup)
    fsizes, bsizes = _one_width(np.asarray(fsizes), bsizes)
    K = fsizes.shape[2]
    P, S, _ = fsizes.shape
    B = int(fsizes[0, 0].sum())
    if _compiled is not None:
        warmups = np.broadcast_to(S - 1 - np.arange(S), (P, S)) if warmup is None else np.asarray(warmup)
        it, finish, busy, peak = _compiled.evaluate_1f1b(fsizes, bsizes, warmups, _compiled_costs(tables, B))
        return _scored(
            fsizes,
            bsizes,
            tables,
            PopulationScore(iteration_ms=it, finish_ms=finish, busy_ms=busy, peak_memory_bytes=peak),
        )
    idx = np.int32 if (2 * S + 4) * K * P < 2**31 else np.int64
    cols = np.arange(P, dtype=idx)
    parts = [_Partition(np.ascontiguousarray(fsizes[:, s].T, dtype=idx), B, cols) for s in range(S)]
    same = bsizes is fsizes or np.array_equal(bsizes, fsizes)
    bparts = (
        parts
        if same
        else [_Partition(np.ascontiguousarray(bsizes[:, s].T, dtype=idx), B, cols) for s in range(S)]
    )
    Q = 2 * K
    KP = K * P
    k_col = np.arange(K)[:, None]
    q_col = np.arange(Q)[:, None]

    # --- the op order of every stage, from the last stage up -----------------------------------
    f_slot, b_slot, slot_kind, slot_chunk = [None] * S, [None] * S, [None] * S, [None] * S
    peak = np.zeros((S, P))
    forwarded_at_b = None  # samples the stage below had forwarded when it ran each B chunk
    for s in range(S - 1, -1, -1):
        p, bp = parts[s], bparts[s]
        n = np.count_nonzero(p.sizes, axis=0)  # F chunks
        nb = np.count_nonzero(bp.sizes, axis=0)  # B chunks
        real, breal = k_col < n, k_col < nb
        hi, bhi = p.last + 1, bp.last + 1
        need = (
            bhi if s == S - 1 else np.maximum(bhi, _gather(forwarded_at_b, bparts[s + 1].chunk_of(bp.last)))
        )
        own = p.chunk_of(need - 1)  # the first F after which the need is met
        warm = np.minimum(S - s - 1 if warmup is None else np.asarray(warmup)[:, s], n)
        after = (
            np.maximum.accumulate(np.maximum(warm, own) - k_col, axis=0) + k_col
        )  # B_j runs after F number after_j
        after = np.minimum(after, n - 1)
        forwarded_at_b = np.where(breal, _gather(hi, after), B)
        b_pos = np.where(breal, after + 1 + k_col, Q - 1)
        taken = np.zeros((Q, P), dtype=bool)
        taken.ravel()[(b_pos * P + cols)[breal]] = True
        free = ~taken & (q_col < n + nb)
        f_index = np.cumsum(free, axis=0) - 1  # which F each free slot holds
        f_pos = np.full((K, P), Q - 1, dtype=idx)
        fq, fp = np.nonzero(free)
        f_pos[f_index[fq, fp], fp] = fq
        f_slot[s], b_slot[s] = f_pos, b_pos
        kind = np.full((Q, P), 2, dtype=np.int8)
        chunk = np.zeros((Q, P), dtype=idx)
        kind.ravel()[(f_pos * P + cols)[real]] = 0
        kind.ravel()[(b_pos * P + cols)[breal]] = 1
        chunk.ravel()[(f_pos * P + cols)[real]] = np.broadcast_to(k_col, (K, P))[real]
        chunk.ravel()[(b_pos * P + cols)[breal]] = np.broadcast_to(k_col, (K, P))[breal]
        slot_kind[s], slot_chunk[s] = kind, chunk
        # peak memory: samples forwarded and not yet backwarded, after each op
        delta = np.zeros((Q, P), dtype=np.int64)
        if tables.ranged is not None:  # by sample range: each chunk's own bytes
            _ranged_peak(tables, s, p, bp, f_pos, b_pos, real, breal, cols, peak)
            continue
        delta.ravel()[(f_pos * P + cols)[real]] = p.sizes[real]
        delta.ravel()[(b_pos * P + cols)[breal]] = -bp.sizes[breal]
        held = np.cumsum(delta, axis=0) - np.minimum(delta, 0)  # a B's samples are held while it runs
        if tables.recompute:  # inputs are held; activations only for the chunk that runs
            running = np.abs(delta)
            mem = held * float(tables.input_bytes[s]) + running * float(tables.stash_bytes[s])
            peak[s] = tables.static_bytes[s] + mem.max(axis=0)
        else:
            peak[s] = tables.static_bytes[s] + held.max(axis=0) * float(tables.stash_bytes[s])

    # --- playing the slots ----------------------------------------------------------------------
    # Every stage keeps a pointer to its next slot and runs it as soon as its input is known, as
    # the reference simulator does, for all individuals at once. ``known`` holds, flat, each
    # message's arrival time (+inf until sent): stage s's activations at s+1, its gradients at
    # s-1, and the last stage's own forward ends; a ready time of +inf means "not yet".
    inf = np.inf
    zero, f_base, b_base, l_base = 0, P, P + S * KP, P + 2 * S * KP
    known = np.full(P + 2 * S * KP + KP + P, inf)
    known[:P] = 0.0
    scratch = P + 2 * S * KP + KP  # where stage 0's gradients "go"
    plans = []
    for s in range(S):
        p, bp = parts[s], bparts[s]
        kind, chunk = slot_kind[s], slot_chunk[s]
        fsz = p.sizes.ravel()[chunk * P + cols]
        bsz = bp.sizes.ravel()[chunk * P + cols]
        fhi, bhi = p.last.ravel()[chunk * P + cols] + 1, bp.last.ravel()[chunk * P + cols] + 1
        cost = _slot_costs(tables, fsz, bsz, fhi, bhi)
        is_f = kind == 0
        if s == 0:
            f_src = zero + cols + 0 * chunk
        else:
            f_src = f_base + (s - 1) * KP + _gather(parts[s - 1].chunk_of(p.last), chunk) * P + cols
        if s == S - 1:  # a B waits for the F that forwarded its last sample here
            b_src = l_base + _gather(p.chunk_of(bp.last), chunk) * P + cols
        else:  # ... or for the gradient message holding its last sample (B ops run in sample order)
            b_src = b_base + (s + 1) * KP + _gather(bparts[s + 1].chunk_of(bp.last), chunk) * P + cols
        f_dst = (l_base if s == S - 1 else f_base + s * KP) + chunk * P + cols
        b_dst = np.full_like(chunk, scratch) + cols if s == 0 else b_base + s * KP + chunk * P + cols
        f_msg = cost("link", s, True) if s + 1 < S else np.zeros((Q, P))
        b_msg = cost("link", s - 1, False) if s > 0 else np.zeros((Q, P))
        plans.append(
            (
                np.where(is_f, f_src, b_src).ravel(),
                np.where(is_f, cost("fwd", s, True), cost("bwd", s, False)).ravel(),
                is_f.ravel(),
                np.where(is_f, f_dst, b_dst).ravel(),
                np.where(is_f, f_msg, b_msg).ravel(),
                np.count_nonzero(p.sizes, axis=0) + np.count_nonzero(bp.sizes, axis=0),
                s == S - 1,
            )
        )
    nslots = np.array([pl[5] for pl in plans])
    clock, ptr = _play(plans, known, P, Q, S)
    settled = (ptr == nslots).all(axis=0)
    finish = clock
    busy = np.array(
        [
            parts[s].costs(tables, "fwd", s).sum(axis=0) + bparts[s].costs(tables, "bwd", s).sum(axis=0)
            for s in range(S)
        ]
    )
    it = np.where(settled, finish.max(axis=0) + tables.optimizer_ms, np.inf)
    return _scored(
        fsizes,
        bsizes,
        tables,
        PopulationScore(iteration_ms=it, finish_ms=finish.T, busy_ms=busy.T, peak_memory_bytes=peak.T),
    )


def _slot_costs(tables: CostTables, fsz: np.ndarray, bsz: np.ndarray, fhi: np.ndarray, bhi: np.ndarray):
    """``cost(table, s, forward)``: the (Q, P) costs of every slot's F chunk (or B chunk), by size
    or by sample range."""

    def cost(table: str, s: int, forward: bool) -> np.ndarray:
        size, hi = (fsz, fhi) if forward else (bsz, bhi)
        if tables.ranged is None:
            return getattr(tables, table)[s][size]
        return getattr(tables.ranged, table)[s][hi - size, hi]

    return cost


def _ranged_peak(tables, s, p, bp, f_pos, b_pos, real, breal, cols, peak) -> None:
    """Stage ``s``'s peak memory in 1F1B order by sample range (the 1F1B slots' held bytes)."""
    R = tables.ranged
    Q, P = f_pos.shape[0] * 2, cols.size
    fhi, bhi = p.last + 1, bp.last + 1
    flo, blo = fhi - p.sizes, bhi - bp.sizes
    kept = R.inputs[s] if tables.recompute else R.stash[s]
    delta = np.zeros((Q, P), dtype=np.int64)
    delta.ravel()[(f_pos * P + cols)[real]] = kept[flo, fhi][real]
    delta.ravel()[(b_pos * P + cols)[breal]] = -kept[blo, bhi][breal]
    held = np.cumsum(delta, axis=0) - np.minimum(delta, 0)  # a B's samples are held while it runs
    if tables.recompute:  # and the chunk that runs, its activations
        running = np.zeros((Q, P), dtype=np.int64)
        running.ravel()[(f_pos * P + cols)[real]] = R.stash[s][flo, fhi][real]
        running.ravel()[(b_pos * P + cols)[breal]] = R.stash[s][blo, bhi][breal]
        held = held + running
    peak[s] = tables.static_bytes[s] + held.max(axis=0)


def evaluate_split(
    tables: CostTables,
    fsizes: np.ndarray,
    bsizes: np.ndarray | None,
    wcap: np.ndarray,
    warmup: np.ndarray | None = "gpipe",
) -> PopulationScore:
    """Score P schedules whose backward is split into B and W ops (zero bubble): the F/B order of
    GPipe (``warmup`` "gpipe") or of 1F1B with those warm-ups (None: PipeDream-flush's), then on
    each stage s a W op per B chunk placed by :func:`umopt.schedules.weights.with_weight_ops` with cap
    ``wcap[p, s]`` (samples awaiting their W; the minibatch defers every W to the end; negative:
    the stage's backward stays whole).

    Compiled where the install built it, equal to the reference simulator to 1e-9 (tested);
    without it, the reference simulator itself runs schedule by schedule (no vectorized numpy
    version: where W ops go depends on each individual's op order, slot by slot).
    """
    if tables.bwd_input is None:
        raise ValueError("W ops need tables with bwd_input and bwd_weight")
    onef1b = not isinstance(warmup, str)
    fsizes, bsizes = _one_width(np.asarray(fsizes), bsizes)
    P, S, _ = fsizes.shape
    B = int(fsizes[0, 0].sum())
    warmups = (
        np.broadcast_to(S - 1 - np.arange(S), (P, S)) if not onef1b or warmup is None else np.asarray(warmup)
    )
    wcap = np.asarray(wcap)
    if _compiled is not None:
        it, finish, busy, peak = _compiled.evaluate_split(
            fsizes,
            bsizes,
            warmups,
            wcap,
            onef1b,
            _compiled_costs(tables, B),
            tables.bwd_input,
            tables.bwd_weight,
            tables.op_overhead,
        )
        return _scored(
            fsizes,
            bsizes,
            tables,
            PopulationScore(iteration_ms=it, finish_ms=finish, busy_ms=busy, peak_memory_bytes=peak),
        )

    it, finish, busy, peak = np.full(P, np.inf), np.zeros((P, S)), np.zeros((P, S)), np.zeros((P, S))
    for p in range(P):
        fs = [[int(x) for x in fsizes[p, s] if x] for s in range(S)]
        bs = [[int(x) for x in bsizes[p, s] if x] for s in range(S)]
        fb = (
            onef1b_schedule(fs, bs, list(warmups[p])) if onef1b else [gpipe_ops(f, b) for f, b in zip(fs, bs)]
        )
        ops = [with_weight_ops(st, int(c)) if c >= 0 else st for st, c in zip(fb, wcap[p])]
        try:
            tl = simulate(tables, ops, B)
        except UmoptError:  # deadlocked
            continue
        it[p] = max(tl.finish_ms) + tables.optimizer_ms
        finish[p], busy[p], peak[p] = tl.finish_ms, tl.busy_ms, tl.peak_memory_bytes
    return _with_allreduce(
        tables, PopulationScore(iteration_ms=it, finish_ms=finish, busy_ms=busy, peak_memory_bytes=peak)
    )


def _scored(fsizes, bsizes, tables: CostTables, score: PopulationScore) -> PopulationScore:
    """``score`` of the partitions ``fsizes``, ``bsizes`` finished: each stage's peak with what
    its ops and its optimizer step allocate while they run (see costmodel's [Note: what an op
    allocates while it runs]: the largest of its chunks' on top), then the all-reduce."""
    if tables.work_bytes is not None:
        peak = np.asarray(score.peak_memory_bytes, dtype=float)
        work = np.zeros_like(peak)
        for part in _one_width(np.asarray(fsizes), bsizes):
            if tables.ranged is None:
                n = part.max(axis=2)
                w = np.where(n > 0, tables.work_bytes + n * tables.work_per_unit, 0)
            else:
                hi = np.cumsum(part, axis=2)
                T = tables.ranged.range_tokens[hi - part, hi]
                w = np.where(T > 0, tables.work_bytes[:, None] + T * tables.work_per_unit[:, None], 0).max(
                    axis=2
                )
            work = np.maximum(work, w)
        step = (tables.static_bytes + tables.optimizer_work_bytes).astype(float)
        score.peak_memory_bytes = np.maximum(peak + work, step)
    return _with_allreduce(tables, score)


def _with_allreduce(tables: CostTables, score: PopulationScore) -> PopulationScore:
    """``score`` with each stage's gradient all-reduce after its last op (data-parallel replicas):
    the iteration ends at the latest stage's end plus its all-reduce, then the optimizer step."""
    if not tables.allreduce_ms.any():
        return score
    ends = (score.finish_ms + tables.allreduce_ms).max(axis=1) + tables.optimizer_ms
    score.iteration_ms = np.where(np.isfinite(score.iteration_ms), ends, np.inf)
    return score


def _play(plans: list, known: np.ndarray, P: int, Q: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots played in Python, a round over the stages at a time (each step one vector
    operation over the population): each stage's end times and how many slots it ran."""
    cols = np.arange(P)
    inf = np.inf
    ptr = np.zeros((S, P), dtype=np.int64)
    clock = np.zeros((S, P))
    f_free = np.zeros((S, P))
    b_free = np.zeros((S, P))
    for rnd in range(2 * Q * S + 4):
        moved = False
        for s in range(S) if rnd % 2 == 0 else range(S - 1, -1, -1):
            src, cost, is_f, dst, msg, nslots, last = plans[s]
            at = np.minimum(ptr[s], Q - 1) * P + cols
            ready = known[src[at]]
            go = (ptr[s] < nslots) & (ready < inf)
            if not go.any():
                continue
            moved = True
            end = np.maximum(clock[s], ready) + cost[at]
            clock[s] = np.where(go, end, clock[s])
            f = is_f[at]
            sent_f = np.maximum(f_free[s], end) + msg[at]
            sent_b = np.maximum(b_free[s], end) + msg[at]
            f_free[s] = np.where(go & f, sent_f, f_free[s])
            b_free[s] = np.where(go & ~f, sent_b, b_free[s])
            value = np.where(f, end if last else sent_f, sent_b)
            known[dst[at][go]] = value[go]
            ptr[s] += go
        if not moved:
            break
    return clock, ptr
