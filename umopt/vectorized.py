"""Scoring a whole population of GPipe-order schedules in one call (the TiDGAP idea).

The paper's GA spends its time evaluating schedules; TiDGAP evaluates the whole population with
matrix operations instead of one simulation per individual. Here the trick is that, in GPipe
order, every recurrence of the cost model is a max-plus scan:

    end_k = max(end_{k-1}, ready_k) + d_k   ==>   end = C + cummax(ready - C_prev),  C = cumsum(d)

and a link that carries one message at a time is the same scan over message durations. So each
stage costs a handful of ``cumsum`` / ``maximum.accumulate`` passes over a (population x chunks)
array, and which upstream message holds a chunk's last sample is one ``searchsorted``.

An individual is, per stage, a forward partition and a backward partition (zero-padded chunk
sizes in sample order, see :mod:`umopt.partition`). F ops run in sample order, B ops in reverse.
The result must equal :func:`umopt.costmodel.simulate` on the same ops to 1e-9 (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costmodel import CostTables

__all__ = ["PopulationScore", "evaluate_gpipe"]


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
        return self._chunk_of[np.minimum(samples, B - 1) * P + cols]


def evaluate_gpipe(tables: CostTables, fsizes: np.ndarray, bsizes: np.ndarray | None = None) -> PopulationScore:
    """Score P GPipe-order schedules.

    ``fsizes``: int array (P, S, K) of forward chunk sizes per stage, zero-padded at the end.
    ``bsizes``: the same for backward chunks (sample order); ``None`` means the forward partition.
    """
    fsizes = np.asarray(fsizes)
    P, S, _ = fsizes.shape
    B = int(fsizes[0, 0].sum())
    idx = np.int32 if B * P < 2**31 else np.int64
    cols = np.arange(P, dtype=idx)
    # Chunk-major layout (S, K, P): every scan step is then one contiguous row of the population.
    fparts = [_Partition(np.ascontiguousarray(fsizes[:, s].T, dtype=idx), B, cols) for s in range(S)]
    if bsizes is None:
        bparts = fparts
    else:
        bsizes = np.asarray(bsizes)
        bparts = [_Partition(np.ascontiguousarray(bsizes[:, s].T, dtype=idx), B, cols) for s in range(S)]
    fwd, bwd, link = tables.fwd, tables.bwd, tables.link
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
        d = fwd[s][part.sizes]
        end = _scan(ready, d, 0.0)
        fwd_end[s] = end[-1]
        busy[s] = d.sum(axis=0)
        if s + 1 < S:
            arrive = _scan(end + part.pad, link[s][part.sizes], 0.0)

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
        d = bwd[s][part.sizes]
        end = _scan(ready, d, fwd_end[s], reverse=True)
        finish[s] = end[0]
        busy[s] += d.sum(axis=0)
        if s > 0:
            arrive = _scan(end + part.pad, link[s - 1][part.sizes], 0.0, reverse=True)
        peak[s] = _gpipe_peak(tables, s, fparts[s].sizes, part.sizes)

    return PopulationScore(
        iteration_ms=finish.max(axis=0) + tables.optimizer_ms, finish_ms=finish.T, busy_ms=busy.T, peak_memory_bytes=peak.T
    )


def _gather(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``values[rows[k, p], p]`` for (K, P) arrays (take_along_axis, but faster here)."""
    P = values.shape[1]
    return values.ravel()[rows * P + np.arange(P, dtype=rows.dtype)]


def _gpipe_peak(tables: CostTables, s: int, f: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Peak memory of stage ``s`` in GPipe order (see costmodel.stage_peak_memory); (K, P) arrays."""
    B = f.sum(axis=0)
    static = float(tables.static_bytes[s])
    if not tables.recompute:
        return static + B * float(tables.stash_bytes[s])
    inb, stash = float(tables.input_bytes[s]), float(tables.stash_bytes[s])
    during_f = _running_sum(f) * inb + f * stash
    # B ops run in reverse sample order: while chunk k runs, samples [0, its end) are still held.
    during_b = np.where(b > 0, (_running_sum(b)) * inb + b * stash, 0.0)
    return static + np.maximum(during_f.max(axis=0), during_b.max(axis=0))
