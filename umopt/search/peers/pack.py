"""``pack``: pack the sequences into rows of a fixed length (first fit, longest first), attention
masked per sequence, equal microbatches of rows (Megatron-LM, NeMo): the best row length (a power
of two from the longest sequence's up, chosen per minibatch where users fix one per run) and
microbatch count; with several chunks per rank, torch's multi-chunk schedules.

``pack-split``: the same with rows down to a quarter of the longest sequence, a longer sequence
cut into pieces of a row each (Megatron-LM's pretraining data does this): faster, but not the
same training (a cut sequence's tokens attend within their piece only), so it is reported beside
the others and not counted among them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ...costmodel import Chunking
from ...formats.profile import AllReduceProfile, Profile
from ..method import Method, Request
from ..plan import Layout, Plan
from .equal import best_equal


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
        plan = best_equal(
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


class Pack(Method):
    name = "pack"
    position = 2
    needs = "packed"
    chunked = True

    def _plan(self, r: Request) -> Optional[Plan]:
        return packed_rows(
            r.profile, r.lengths, r.stages, r.recompute, r.dp, chunks=max(r.chunks), on=r.on, until=r.until
        )


class PackSplit(Method):
    name = "pack-split"
    position = 3
    needs = "packed"
    counted = False

    def _plan(self, r: Request) -> Optional[Plan]:
        return packed_rows(r.profile, r.lengths, r.stages, r.recompute, r.dp, split=True)
