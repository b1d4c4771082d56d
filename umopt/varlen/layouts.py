"""Which layout each planning method's pipeline holds: one chunk per rank, or several.

A pipeline's modules are built once, so a run of sequences of different lengths keeps one
layout (chunks per rank, their placement and layer cut) while its steps' plans change. Each
method chooses its own as its users would: its plan of a first minibatch at each count of chunks
per rank asked, the fastest predicted. umopt's plans with several chunks are
:func:`umopt.varlen.chunks.plan_chunks`'s; padding's and packing's run torch's multi-chunk
schedules at their best count, placement and cut (:mod:`umopt.varlen.peers`); the other peers
have one chunk per rank only. ``umopt tune --lengths --chunks`` then measures every method on
the layout it chose (each layout its own copy of the model).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from .chunks import plan_chunks
from .peers import PEERS, unavailable
from .plan import Plan
from .planner import plan

__all__ = ["METHODS", "CHUNKED_METHODS", "choose_layouts"]

METHODS = ("umopt", *PEERS)  # who may plan the minibatches
CHUNKED_METHODS = ("umopt", "pad", "pack")  # ...and where ranks hold several chunks


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
    L = np.asarray(lengths, dtype=np.int64)
    S = profile.num_stages
    many = tuple(c for c in chunks if c > 1)
    out = {}
    for m in methods:
        if unavailable(profile, m):
            raise UmoptError(unavailable(profile, m))
        found: list[Optional[Plan]] = []
        if 1 in chunks:
            one = (
                plan(profile, L, budget_ms=budget_ms, recompute=recompute, dp=dp, seed=seed)
                if m == "umopt"
                else PEERS[m](profile, L, S, recompute, dp)
            )
            found.append(one)
        if many and m in CHUNKED_METHODS:
            if m == "umopt":
                try:
                    found.append(
                        plan_chunks(
                            profile, L, many, recompute=recompute, dp=dp, budget_ms=budget_ms, seed=seed
                        )
                    )
                except UmoptError:  # none within the memory limit
                    pass
            else:
                found.append(PEERS[m](profile, L, S, recompute, dp, chunks=max(many)))
        fits = [p for p in found if p is not None]
        if not fits:
            raise UmoptError(f"{m}: no plan of the first minibatch fits the memory limit")
        out[m] = min(fits, key=lambda p: p.iteration_ms)
    return out
