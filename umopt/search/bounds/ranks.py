"""Lower bounds for pipelines with several chunks per rank, from each rank's own work.

A rank cannot start before one sample's forward has reached its lowest virtual stage, cannot
finish before it has run the compute of all its chunks, and (without W ops) its last op is a B
of its lowest stage, whose gradient still has to go down to stage 0. :func:`busiest_rank_bound`
takes every stage at its cheapest cost per sample, so it holds whatever the partitions and the
order; the exact model of :mod:`umopt.search.solvers.cpsat_chunks` adds the same reasoning as a
redundant constraint over its chosen partitions (:func:`rank_ends`).
"""

from __future__ import annotations

import numpy as np

from ...costmodel import CostTables

__all__ = ["rank_ends", "busiest_rank_bound"]


def rank_ends(tables: CostTables, minibatch: int) -> tuple[np.ndarray, np.ndarray]:
    """``up[j]``: the least time before any op of virtual stage j can start (one sample's
    forwards and messages through the stages below it); ``down[j]``: the least time from the end
    of a B of stage j to the end of the B of its samples on stage 0."""
    top = min(tables.max_size, minibatch)
    fwd, bwd = tables.fwd[:, 1 : top + 1], tables.bwd[:, 1 : top + 1]
    if tables.bwd_input is not None:
        bwd = np.minimum(bwd, tables.bwd_input[:, 1 : top + 1])
    link = tables.link[:, 1 : top + 1].min(axis=1) if tables.num_stages > 1 else np.zeros(0)
    up = np.concatenate([[0.0], np.cumsum(fwd.min(axis=1)[:-1] + link)])
    down = np.concatenate([[0.0], np.cumsum(bwd.min(axis=1)[:-1] + link)])
    return up, down


def busiest_rank_bound(tables: CostTables, minibatch: int) -> float:
    """A lower bound on every schedule of these virtual stages, whatever the partitions and
    order: some rank r has, before its first op, at least the forwards of one sample through the
    stages below its lowest one (and their messages); then its compute, every virtual stage at
    its cheapest cost per sample (with W ops, a B and its share of a W at least the input and
    weight gradients less one per-op cost); and, without W ops, after its last B at least the
    backwards of one sample through the stages below (its last op is a B, whose gradient goes on
    down). Plus the optimizer step."""
    top = min(tables.max_size, minibatch)
    b = np.arange(1, top + 1)
    fwd, bwd = tables.fwd[:, 1 : top + 1], tables.bwd[:, 1 : top + 1]
    split = tables.bwd_input is not None
    if split:  # a W over several B chunks saves their per-op costs but one
        parts = (
            tables.bwd_input[:, 1 : top + 1] + tables.bwd_weight[:, 1 : top + 1] - tables.op_overhead[:, None]
        )
        bwd = np.minimum(bwd, parts)
    per_sample = ((fwd + bwd) / b).min(axis=1)
    up, down = rank_ends(tables, minibatch)
    bound = 0.0
    for r in range(tables.num_ranks):
        mine = [j for j in range(tables.num_stages) if tables.rank_of(j) == r]
        load = minibatch * sum(per_sample[j] for j in mine)
        tail = 0.0 if split else float(down[min(mine)])
        bound = max(bound, float(up[min(mine)]) + load + tail)
    return bound + tables.optimizer_ms
