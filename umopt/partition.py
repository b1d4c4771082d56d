"""Partitions of a minibatch into chunks, and the op lists built from them.

A partition is the list of chunk sizes in sample order: ``[2, 3, 3]`` splits 8 samples into
``[0,2) [2,5) [5,8)``. Solvers work on batches of partitions as an "ends" mask, ``ends[..., i]``
true when a chunk ends at sample ``i``, which is what crossover and mutation flip; the vectorized
evaluator reads zero-padded size arrays. This module converts between the three and turns
per-stage forward and backward partitions into op lists in GPipe or 1F1B order.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import numpy as np

from .costmodel import Op

__all__ = [
    "equal_sizes",
    "chunks",
    "sizes_to_ends",
    "ends_to_sizes",
    "repair_ends",
    "gpipe_ops",
    "onef1b_schedule",
    "pipedream_warmup",
    "partitions_from_ops",
    "backwards_in_sample_order",
    "with_weight_ops",
]


def equal_sizes(minibatch: int, m: int) -> list[int]:
    """``m`` chunks whose sizes differ by at most one, the larger ones first (as numpy.array_split)."""
    q, r = divmod(minibatch, m)
    return [q + 1] * r + [q] * (m - r)


def chunks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Sample ranges ``(lo, hi)`` of a partition, in sample order."""
    out, lo = [], 0
    for b in sizes:
        out.append((lo, lo + int(b)))
        lo += int(b)
    return out


def sizes_to_ends(sizes: Sequence[int], minibatch: int) -> np.ndarray:
    ends = np.zeros(minibatch, dtype=bool)
    ends[np.cumsum(sizes) - 1] = True
    return ends


def ends_to_sizes(ends: np.ndarray) -> np.ndarray:
    """Zero-padded chunk sizes, shape ``ends.shape[:-1] + (K,)``, K the most chunks of any row.

    Every row must end a chunk at its last sample.
    """
    lead, B = ends.shape[:-1], ends.shape[-1]
    flat = ends.reshape(-1, B)
    at = np.flatnonzero(flat)  # row-major: positions come sorted within each row
    rows = at // B
    counts = np.bincount(rows, minlength=flat.shape[0])
    K = int(counts.max())
    k = np.arange(at.size) - np.repeat(np.cumsum(counts) - counts, counts)
    prev = np.empty_like(at)
    prev[1:] = at[:-1]
    starts = k == 0
    prev[starts] = rows[starts] * B - 1
    out = np.zeros(flat.shape[0] * K, dtype=np.int64)
    out[rows * K + k] = at - prev
    return out.reshape(*lead, K)


def repair_ends(ends: np.ndarray, max_size: int) -> np.ndarray:
    """Add chunk ends so that no chunk is longer than ``max_size`` (in place; also returned).

    Every ``max_size``-th sample after a kept end becomes an end, which splits an over-long chunk
    into full chunks and one remainder, in one vectorized pass.
    """
    B = ends.shape[-1]
    ends[..., -1] = True
    if max_size >= B:
        return ends
    idx = np.arange(B)
    last = np.where(ends, idx, -1)
    # index of the end strictly before each sample (-1 at the start)
    before = np.maximum.accumulate(
        np.concatenate([np.full(ends.shape[:-1] + (1,), -1), last[..., :-1]], axis=-1), axis=-1
    )
    gap = idx - before
    ends |= gap % max_size == 0
    return ends


def gpipe_ops(fsizes: Sequence[int], bsizes: Sequence[int]) -> list[Op]:
    """One stage's GPipe order: every F in sample order, then every B in reverse sample order."""
    ops: list[Op] = [Op("F", lo, hi) for lo, hi in chunks(fsizes)]
    ops += [Op("B", lo, hi) for lo, hi in reversed(chunks(bsizes))]
    return ops


def pipedream_warmup(num_stages: int) -> list[int]:
    """PipeDream-flush's warm-up forwards per stage: ``S - s - 1``."""
    return list(range(num_stages - 1, -1, -1))


def onef1b_schedule(
    fsizes: Sequence[Sequence[int]], bsizes: Sequence[Sequence[int]], warmup: Optional[Sequence[int]] = None
) -> list[list[Op]]:
    """Every stage's 1F1B (PipeDream-flush) order, for any per-stage partitions.

    Stage ``s`` runs ``warmup[s]`` warm-up forwards (PipeDream-flush: ``S - s - 1``, the default),
    then one forward and at most one backward in turn (both in sample order), then the remaining
    backwards. Other warm-ups give the orders between 1F1B (few forwards in flight) and GPipe (all
    forwards first); a stage that holds the most work often wants fewer in flight than the
    textbook, and one that feeds it more. With unequal partitions a stage may
    only start a backward once it has forwarded every sample the stages below need before they
    can send that backward's gradients back; otherwise it would wait on a stage that waits on it.
    That requirement is worked out from the last stage up, and a backward whose requirement is
    not met yet waits for more forwards. With equal partitions this is the textbook 1F1B.
    """
    S = len(fsizes)
    warm = pipedream_warmup(S) if warmup is None else warmup
    out: list[list[Op]] = [[] for _ in range(S)]
    needed_below: list[int] = []  # per B chunk of stage s+1: samples it had forwarded when running it
    below_b: list[tuple[int, int]] = []
    for s in range(S - 1, -1, -1):
        fch, bch = chunks(fsizes[s]), chunks(bsizes[s])
        need = []
        for lo, hi in bch:
            n = hi
            if s + 1 < S:  # the B chunk of stage s+1 that holds this chunk's last sample
                k = next(i for i, (l2, h2) in enumerate(below_b) if l2 <= hi - 1 < h2)
                n = max(n, max(needed_below[: k + 1]))
            need.append(n)
        ops: list[Op] = []
        forwarded_when: list[int] = []
        i = j = forwarded = 0
        for _ in range(min(warm[s], len(fch))):
            ops.append(Op("F", *fch[i]))
            forwarded = fch[i][1]
            i += 1
        while i < len(fch) or j < len(bch):
            if i < len(fch):
                ops.append(Op("F", *fch[i]))
                forwarded = fch[i][1]
                i += 1
            while j < len(bch) and (need[j] <= forwarded or i == len(fch)):
                ops.append(Op("B", *bch[j]))
                forwarded_when.append(forwarded)
                j += 1
                if i < len(fch):
                    break
        out[s] = ops
        needed_below, below_b = forwarded_when, bch
    return out


def with_weight_ops(stage_ops: Sequence[Op], cap: Optional[int]) -> list[Op]:
    """One stage's F/B ops with a W op per B chunk, each as late as the stage can hold: before an F,
    the oldest W ops run until its samples fit under ``cap`` samples awaiting their W (forwarded,
    weight gradient not yet computed); after a B, while more than ``cap`` await. The rest run after
    the last op; ``None`` defers every W there.

    With ``cap`` at the stage's in-flight peak of the F/B order (ZB-H1: 1F1B's), memory stays what
    it was; in GPipe order, where all samples are in flight after the forwards, ``cap`` is how many
    samples' W ops wait for the end while the others run right after their B.
    """
    out: list[Op] = []
    pending: deque[Op] = deque()
    held = 0
    for op in stage_ops:
        if op.kind == "F":
            while pending and cap is not None and held + op.size > cap:
                w = pending.popleft()
                out.append(w)
                held -= w.size
            held += op.size
        out.append(op)
        if op.kind == "B":
            pending.append(Op("W", op.lo, op.hi))
            while pending and cap is not None and held > cap:
                w = pending.popleft()
                out.append(w)
                held -= w.size
    return out + list(pending)


def partitions_from_ops(ops: Sequence[Op]) -> tuple[list[int], list[int]]:
    """Forward and backward chunk sizes of one stage's op list, in sample order."""
    f = sorted((lo, hi) for k, lo, hi in ops if k == "F")
    b = sorted((lo, hi) for k, lo, hi in ops if k == "B")
    return [hi - lo for lo, hi in f], [hi - lo for lo, hi in b]


def backwards_in_sample_order(ops: Sequence[Sequence[Op]]) -> bool:
    """Does every stage's op list run its B ops in sample order (the 1F1B family, any warm-ups)?"""
    return all(
        [lo for kind, lo, _ in st if kind == "B"] == sorted(lo for kind, lo, _ in st if kind == "B")
        for st in ops
    )
