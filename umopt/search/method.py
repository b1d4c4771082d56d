"""What a method of planning a minibatch of sequences of different lengths is: umopt's planner and
every peer (padding, packing, DynaPipe, WLB-LLM ...) answer one :class:`Request` with a
:class:`~umopt.search.plan.Plan` scored by the same cost model.

A method is a :class:`Method` subclass with a ``name``: what it needs of the profile (``needs``:
padded or packed chunks), whether it plans several chunks per rank (``chunked``), whether it is
the same training as the others (``counted``), where tables list it (``position``), and its
``plan``. Defining the class registers it: a new peer is one class in one file of
:mod:`umopt.search.peers`, and :data:`umopt.search.methods.METHODS` lists it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import numpy as np

from ..costmodel import Chunking
from ..errors import NoFit
from ..formats.profile import AllReduceProfile, Profile
from .plan import Plan

__all__ = ["Request", "Method", "registered"]


@dataclass(frozen=True)
class Request:
    """One minibatch to plan: ``lengths`` on ``profile``'s pipeline.

    ``chunks``: the counts of chunks per rank to plan, all 1 (one chunk per rank) or all above 1
    (umopt searches them; a peer runs torch's multi-chunk schedules at its best count up to the
    largest); ``on``: that cut and placement only (a running pipeline's); ``until``: a
    ``time.perf_counter()`` after which a peer trying counts stops once one fits; ``budget_ms``,
    ``previous`` (the last step's plan by the same method) and ``seed``: what umopt's planner
    takes, the peers being deterministic and quick."""

    profile: Profile
    lengths: np.ndarray
    recompute: bool = False
    dp: Optional[AllReduceProfile] = None
    chunks: tuple[int, ...] = (1,)
    on: Optional[Chunking] = None
    until: Optional[float] = None
    budget_ms: float = 15.0
    previous: Optional[Plan] = None
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "lengths", np.asarray(self.lengths, dtype=np.int64))
        object.__setattr__(self, "chunks", tuple(int(c) for c in self.chunks))
        if self.on is not None:
            object.__setattr__(self, "chunks", (len(self.on.ranks) // self.profile.num_stages,))
        if len({c > 1 for c in self.chunks}) != 1:
            raise ValueError(f"a request is for one chunk per rank or several, not both: {self.chunks}")

    @property
    def stages(self) -> int:
        return self.profile.num_stages

    @property
    def several(self) -> bool:
        """Several chunks per rank asked."""
        return self.chunks[0] > 1

    def but(self, **changes) -> "Request":
        return replace(self, **changes)


_REGISTERED: list[type["Method"]] = []


def registered() -> list["Method"]:
    """One of each method class defined so far, in table order."""
    return sorted((cls() for cls in _REGISTERED), key=lambda m: m.position)


class Method:
    """A way to plan a minibatch (see the module docstring)."""

    name: ClassVar[str]
    position: ClassVar[int] = 100  # where tables list it (umopt first)
    needs: ClassVar[Optional[str]] = None  # the chunk mode it needs the profile to cost
    chunked: ClassVar[bool] = False  # it plans several chunks per rank too
    counted: ClassVar[bool] = True  # False: not the same training (reported, not compared)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _REGISTERED.append(cls)

    def unavailable(self, profile: Profile) -> Optional[str]:
        """Why this method cannot plan for ``profile``'s model (None: it can): one that pads needs
        padded costs, one that packs packed ones, and the profile has those its model can take."""
        if self.needs is None or profile.lengths is None or self.needs in profile.lengths.modes:
            return None
        return (
            f"{self.name} needs {self.needs} chunks, and the profile's model takes only "
            f"{' and '.join(profile.lengths.modes)} ones (see [Note: packed sequences] in umopt/zoo.py)"
        )

    def plan(self, request: Request) -> Optional[Plan]:
        """The method's plan of the request's minibatch, with the time it took to make; None where
        the profile's model cannot take it or no plan fits the memory limit."""
        if self.unavailable(request.profile) or (request.several and not self.chunked):
            return None
        t0 = time.perf_counter()
        try:
            got = self._plan(request)
        except NoFit:
            return None
        if got is not None:
            got.planning_ms = (time.perf_counter() - t0) * 1e3
        return got

    def _plan(self, request: Request) -> Optional[Plan]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<method {self.name}>"
