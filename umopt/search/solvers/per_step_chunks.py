"""umopt's plan for a minibatch of sequences of different lengths with several chunks per rank.

Each rank's layers are cut into chunks (virtual stages, looped or V-shaped), and every virtual
stage gets its own partition of the minibatch's samples, costed by sample range on the layers'
costs by tokens. The planner orders the sequences as the one-chunk planner does
(:func:`umopt.search.solvers.per_step.order_of`: each order way of :data:`umopt.search.solvers.per_step.ORDERS`, in
each mode), then runs the multi-chunk search of ``umopt solve --chunks``
(:func:`umopt.search.solvers.multichunk.solve_chunks`: equal partitions of every shape and count
screened, then per-virtual-stage moves and layer moves, the ranks' orders built by list
scheduling) on those costs, each way an equal share of the budget; the fastest within the memory
limit is the plan. Warm (the last step's plan given), only the last step's way and one other in
turn are tried: planning each step of a run then costs a third as much (the screening's floor is
about 10 ms a way at 16 sequences on a CPU, taken from the ranks where they hold every core).

Packing's plan on torch's multi-chunk schedules (:func:`umopt.search.peers.packed_rows`) is one
of umopt's too: its rows' sequences in row order, each microbatch the sequences of its rows,
without the rows' padding (:func:`_unpacked`); so is padding's (:func:`umopt.search.peers.pad`),
each microbatch padded to its own longest instead of the minibatch's (:func:`_unpadded`). umopt's
plan is never predicted slower than the peer of its mode, whatever the budget left the search,
and is in the mode asked: padded means padded (a model that cannot pack gets no packed plan).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

import numpy as np

from ...costmodel import Chunking, ChunkOp
from ...errors import NoFit, UmoptError
from ...formats.profile import AllReduceProfile, Profile
from ..peers import packed_rows, pad
from ..plan import Layout, Plan, score
from ..problem import LayoutProblem
from .multichunk import solve_chunks
from .per_step import ORDERS, modes_of, order_of, stage_weights

__all__ = ["plan_chunks"]


def plan_chunks(
    profile: Profile,
    lengths,
    chunks: Union[int, Sequence[int]],
    mode: Optional[str] = None,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    budget_ms: float = 200.0,
    orders: Sequence[str] = ORDERS,
    seed: int = 0,
    on: Optional[Chunking] = None,
    weights: Optional[bool] = None,
    previous: Optional[Plan] = None,
    evaluations: Optional[int] = None,
) -> Plan:
    """umopt's plan of ``lengths`` with ``chunks`` chunks per rank (a count, or the counts to
    search: ``--chunks auto``'s 2-4), within about ``budget_ms`` (see the module docstring); ``mode``: "packed" or "padded" (default: each of the profile's);
    ``on``: that cut and placement only (a running pipeline's, whose modules hold its layers);
    ``weights``: W ops (the backward split, zero bubble), by default where the layers' costs by
    tokens have the split; ``previous``: the last step's plan, to start from (see the module
    docstring); ``evaluations``: each way's local search ends after so many schedules too (with
    an ample budget, the same plan on every machine)."""
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    S, B = profile.num_stages, len(L)
    if profile.layers is None:
        raise UmoptError(
            "the profile has no per-layer entries, so a rank's layers cannot be cut into chunks "
            "(umopt profile --lengths --chunks)"
        )
    counts = (
        (len(on.ranks) // S,)
        if on is not None
        else tuple(sorted({chunks} if isinstance(chunks, int) else set(chunks)))
    )
    if not counts or min(counts) < 2:
        raise UmoptError(f"plan_chunks plans 2 or more chunks per rank, got {counts}")
    ways = [(m, how) for how in orders for m in ([mode] if mode else modes_of(profile))]
    kn = previous.knobs if previous is not None and previous.chunking is not None else {}
    turn = int(kn.get("turn", -1)) + 1
    if (kn.get("mode"), kn.get("order")) in ways:  # warm: the last step's way, and one other in turn
        last = (kn["mode"], kn["order"])
        others = [w for w in ways if w != last]
        ways = [last] + ([others[turn % len(others)]] if others else [])
    if weights is None:
        weights = all(
            ly.backward_input_ms is not None
            and ly.tokens is not None
            and all(c.backward_input is not None for c in ly.tokens.values())
            for ly in profile.layers
        )
    # the peers' plans as umopt's first (a few ms), in the modes asked: the search has what is left,
    # if any (its screening alone takes tens of ms at 32 sequences: a step's small budget may not
    # hold it)
    modes = [mode] if mode else modes_of(profile)
    until = t0 + budget_ms / 1e3
    seeds = [
        p
        for p in (
            _unpacked(profile, L, max(counts), recompute, dp, on, until) if "packed" in modes else None,
            _unpadded(profile, L, max(counts), recompute, dp, on, until) if "padded" in modes else None,
        )
        if p is not None
    ]
    rows = min(seeds, key=lambda p: p.iteration_ms) if seeds else None
    if rows is not None and time.perf_counter() - t0 > budget_ms / 1e3:
        ways = []
    best = None
    for n, (m, how) in enumerate(ways):
        left = budget_ms / 1e3 - (time.perf_counter() - t0)
        order = order_of(L, how, stage_weights(profile, m, L).sum(axis=0), groups=2 * S)
        problem = LayoutProblem(profile, B, recompute, dp, tokens=L[order], mode=m)
        try:
            sol = solve_chunks(
                problem,
                chunk_counts=counts,
                seconds=max(0.0, left / (len(ways) - n)),
                seed=seed,
                on=on,
                weights=weights,
                evaluations=evaluations,
            )
        except UmoptError:  # no schedule of this way within the memory limit: the others may
            continue
        if best is None or sol.iteration_ms < best[0].iteration_ms:
            best = (sol, Layout.of_order(order, m), how)
    if best is None and rows is None:
        raise NoFit()
    if rows is not None and (best is None or rows.iteration_ms < best[0].iteration_ms):
        rows.knobs.update(turn=turn, order=kn.get("order", "rows"), mode=rows.layout.mode)
        rows.planning_ms = (time.perf_counter() - t0) * 1e3
        return rows
    sol, layout, how = best
    out = score(
        "umopt",
        profile,
        L,
        layout,
        sol.ops,
        recompute,
        dp,
        tables=sol.tables,
        predicted_ms=sol.iteration_ms,
        chunking=sol.shape.chunking,
        mode=layout.mode,
        order=how,
        chunks=sol.shape.chunks,
        turn=turn,
        placement=sol.shape.placement,
        cut=sol.shape.cut,
        counts=sorted({len(p) for p in sol.genes.fwd}),
    )
    out.planning_ms = (time.perf_counter() - t0) * 1e3
    return out


def _unpacked(profile: Profile, L: np.ndarray, chunks: int, recompute, dp, on, until=None) -> Optional[Plan]:
    """Packing's plan on torch's multi-chunk schedules as a plan of umopt's: the rows' sequences
    in row order, every op on the sequences of its rows (the rows' padding dropped: never slower);
    None where packing has no plan within the memory limit."""
    peer = packed_rows(profile, L, profile.num_stages, recompute, dp, chunks=chunks, on=on, until=until)
    if peer is None or peer.chunking is None:
        return None
    units = peer.layout.units
    if len({i for u in units for i in u}) != sum(len(u) for u in units):
        return None  # a sequence cut across rows: not one of umopt's plans
    start = np.concatenate([[0], np.cumsum([len(u) for u in units])]).astype(int)
    ops = [[ChunkOp(op[0], int(start[op[1]]), int(start[op[2]]), op[3]) for op in rank] for rank in peer.ops]
    layout = Layout.of_order([i for u in units for i in u], "packed")
    return _as_umopts(peer, profile, L, layout, ops, recompute, dp, "rows")


def _unpadded(profile: Profile, L: np.ndarray, chunks: int, recompute, dp, on, until=None) -> Optional[Plan]:
    """Padding's plan on torch's multi-chunk schedules as a plan of umopt's: the same ops on the
    same samples, each microbatch padded to its own longest instead of the minibatch's (never
    slower); None where padding has no plan within the memory limit."""
    peer = pad(profile, L, profile.num_stages, recompute, dp, chunks=chunks, on=on)
    if peer is None or peer.chunking is None:
        return None
    layout = Layout.of_order(range(len(L)), "padded")
    return _as_umopts(peer, profile, L, layout, [list(rank) for rank in peer.ops], recompute, dp, "padding's")


def _as_umopts(
    peer: Plan, profile: Profile, L: np.ndarray, layout: Layout, ops, recompute, dp, placement: str
) -> Plan:
    """A peer's multi-chunk ops on ``layout``'s samples, scored as a plan of umopt's (its knobs kept)."""
    return score(
        "umopt",
        profile,
        L,
        layout,
        ops,
        recompute,
        dp,
        chunking=peer.chunking,
        chunks=len(peer.chunking.ranks) // profile.num_stages,
        placement=placement,
        cut=peer.knobs.get("cut"),
        rows_of=peer.knobs.get("order"),
        counts=[int(peer.knobs.get("microbatches") or 0)],
    )
