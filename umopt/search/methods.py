"""Every method of planning a minibatch of sequences of different lengths, by name: umopt's own
(:class:`Umopt`: the one-chunk planner, or the multi-chunk one where several chunks per rank are
asked) first, then the peers of :mod:`.peers`. Names are what users type (``--methods``); past
this module a method is its object.
"""

from __future__ import annotations

from typing import Optional

from ..errors import UmoptError
from .method import Method, Request
from .peers import PEERS
from .plan import Plan
from .solvers.per_step import plan
from .solvers.per_step_chunks import plan_chunks

__all__ = ["METHODS", "UMOPT", "Umopt", "named", "chunked_names"]


class Umopt(Method):
    """umopt's planner: each stage its own partition (:func:`.planner.plan`), or with several chunks
    per rank each virtual stage its own (:func:`.chunks.plan_chunks`)."""

    name = "umopt"
    position = 0
    chunked = True

    def _plan(self, r: Request) -> Optional[Plan]:
        if r.several:
            return plan_chunks(
                r.profile, r.lengths, r.chunks, recompute=r.recompute, dp=r.dp, budget_ms=r.budget_ms,
                seed=r.seed, on=r.on, previous=r.previous,
            )  # fmt: skip
        return plan(
            r.profile, r.lengths, recompute=r.recompute, dp=r.dp, budget_ms=r.budget_ms,
            previous=r.previous, seed=r.seed,
        )  # fmt: skip


UMOPT = Umopt()
METHODS: dict[str, Method] = {"umopt": UMOPT, **PEERS}


def named(name: str) -> Method:
    """The method called ``name``; an unknown name is refused in one line that lists them."""
    if name not in METHODS:
        raise UmoptError(f"unknown planning method {name!r}: one of {', '.join(METHODS)}")
    return METHODS[name]


def chunked_names() -> list[str]:
    """The methods that plan several chunks per rank, by name."""
    return [m.name for m in METHODS.values() if m.chunked]
