"""Partitions of a minibatch into chunks, and the op lists built from them.

A partition is the list of chunk sizes in sample order: ``[2, 3, 3]`` splits 8 samples into
``[0,2) [2,5) [5,8)``. Solvers work on batches of partitions as an "ends" mask, ``ends[..., i]``
true when a chunk ends at sample ``i``, which is what crossover and mutation flip; the vectorized
evaluator reads zero-padded size arrays. This module converts between the three; the schedule
families (:mod:`umopt.schedules`) turn partitions into op lists.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..costmodel import Op, OpKind

__all__ = [
    "equal_sizes",
    "chunks",
    "sizes_to_ends",
    "ends_to_sizes",
    "repair_ends",
    "partitions_from_ops",
    "backwards_in_sample_order",
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


def partitions_from_ops(ops: Sequence[Op]) -> tuple[list[int], list[int]]:
    """Forward and backward chunk sizes of one stage's op list, in sample order."""
    f = sorted((lo, hi) for k, lo, hi in ops if k == OpKind.F)
    b = sorted((lo, hi) for k, lo, hi in ops if k == OpKind.B)
    return [hi - lo for lo, hi in f], [hi - lo for lo, hi in b]


def backwards_in_sample_order(ops: Sequence[Sequence[Op]]) -> bool:
    """Does every stage's op list run its B ops in sample order (the 1F1B family, any warm-ups)?"""
    return all(
        [lo for kind, lo, _ in st if kind == OpKind.B] == sorted(lo for kind, lo, _ in st if kind == OpKind.B)
        for st in ops
    )
