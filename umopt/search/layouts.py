"""Which layout each planning method's pipeline holds: one chunk per rank, or several.

A pipeline's modules are built once, so a run of sequences of different lengths keeps one
layout (chunks per rank, their placement and layer cut) while its steps' plans change. Each
method chooses its own as its users would: its plan of a first minibatch at each count of chunks
per rank asked, the fastest predicted. umopt's plans with several chunks are
:func:`umopt.search.solvers.per_step_chunks.plan_chunks`'s; padding's and packing's run torch's multi-chunk
schedules at their best count, placement and cut (:mod:`umopt.search.peers`); the other peers
have one chunk per rank only. ``umopt tune --lengths --chunks`` then measures every method on
the layout it chose (each layout its own copy of the model).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from .method import Request
from .methods import named
from .plan import Plan

__all__ = ["choose_layouts"]


def choose_layouts(
    profile: Profile,
    lengths,
    methods: Sequence[str],
    chunks: Sequence[int] = (1,),
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    budget_ms: float = 500.0,
    seed: int = 0,
) -> dict[str, Plan]:
    """Each method's plan of the minibatch ``lengths`` on the layout it chooses among ``chunks``
    (counts of chunks per rank; see the module docstring), within the memory limit."""
    one = Request(profile, lengths, recompute, dp, budget_ms=budget_ms, seed=seed)
    many = tuple(c for c in chunks if c > 1)
    out = {}
    for name in methods:
        m = named(name)
        if m.unavailable(profile):
            raise UmoptError(m.unavailable(profile))
        found = [m.plan(one)] if 1 in chunks else []
        if many and m.chunked:
            found.append(m.plan(one.but(chunks=many)))
        fits = [p for p in found if p is not None]
        if not fits:
            raise UmoptError(f"{name}: no plan of the first minibatch fits the memory limit")
        out[name] = min(fits, key=lambda p: p.iteration_ms)
    return out
