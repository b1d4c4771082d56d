"""What every peer ends in: equal microbatches of the peer's samples, the same partition on every
stage (that is what these tools run; umopt's planner gives each stage its own), scored by the
cost model.

Every peer plays its equal microbatches in GPipe or 1F1B order, whichever is faster, 1F1B with
fewer microbatches than stages too, as Megatron-LM runs it (each stage warms up
min(S - s - 1, M); torch's Schedule1F1B refuses M < S), so a minibatch packed into a few rows is
not held to GPipe. With several chunks per rank, a peer that has them runs torch's multi-chunk
schedules (interleaved 1F1B, looped BFS, and with a split backward the zero-bubble ones) at
their best chunk count, microbatch count and cut, as a torch user would pick them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ...costmodel import Chunking, sample_tokens
from ...formats.profile import Profile
from ...schedules.family import GPIPE, ONEF1B
from ..baselines import gpipe_equal, onef1b_equal
from ..plan import Layout, Plan, score
from ..problem import Candidate, LayoutProblem, Problem, pack
from .schedules import PeerResult, best_peers, equal_list_scheduled, load_torch_schedules

__all__ = ["best_equal", "best_torch_multi", "best_shared"]


def best_equal(
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
    ``chunks`` > 1, of torch's multi-chunk schedules instead (:func:`best_torch_multi`, which
    stops trying counts at ``until``, a ``time.perf_counter()``, once one fits)."""
    if chunks > 1:
        return best_torch_multi(method, profile, lengths, layout, chunks, recompute, dp, on, until, **knobs)
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


def best_torch_multi(
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
    count and cut (what a torch user would try, :func:`umopt.search.peers.schedules.best_peers`; ``on``: that
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


def best_shared(
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
