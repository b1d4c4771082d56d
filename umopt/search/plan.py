"""A plan for one minibatch of sequences of different lengths: the pipeline's samples (which
sequences each holds, in which order, packed or padded), each stage's chunks and op order, and
what the cost model says of it.

Every method (umopt's planner, and the peers' in :mod:`.peers`) ends in a :class:`Plan` scored
the same way, by the reference simulator on the same costs by sample range (see [Note: costs by
sample range] in umopt/costmodel.py), so their tokens per second compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..costmodel import Chunking, CostTables, Op, Timeline, simulate, tables_for_samples
from ..formats.profile import AllReduceProfile, Profile

__all__ = ["Layout", "Plan", "score"]


@dataclass(frozen=True)
class Layout:
    """The pipeline's samples of one minibatch, in order: ``units[k]`` the sequences (indices
    into the minibatch's lengths) sample k holds, one each unless they are packed into rows.

    ``mode`` "packed": a chunk's sequences are concatenated (attention within each); "padded":
    each is padded to the chunk's longest. ``row``: packed rows of this many tokens (a row is
    padded to it, its attention its sequences' own). ``pad_to``: every sample padded to this
    length (pad-to-longest: every chunk one shape)."""

    units: tuple[tuple[int, ...], ...]
    mode: str = "packed"
    row: Optional[int] = None
    pad_to: Optional[int] = None

    @classmethod
    def of_order(cls, order: Sequence[int], mode: str = "packed") -> "Layout":
        return cls(tuple((int(i),) for i in order), mode)

    @property
    def order(self) -> list[int]:
        """The sequences in the order the pipeline runs them."""
        return [i for unit in self.units for i in unit]

    def tables(
        self,
        profile: Profile,
        lengths: np.ndarray,
        recompute: bool = False,
        dp: Optional[AllReduceProfile] = None,
        chunks: Optional[Chunking] = None,
    ) -> CostTables:
        return tables_for_samples(
            profile, lengths, self.units, self.mode, self.row, self.pad_to, recompute, dp, chunks
        )


@dataclass
class Plan:
    """One minibatch's plan (see the module docstring). ``timeline`` is the reference simulator's,
    computed when first asked for (a planner in the training loop needs the ops and the
    predicted time, which its evaluators give the same to the microsecond)."""

    method: str  # "umopt", "pad", "pack", "sort-split", "dynapipe", "wlb"
    layout: Layout
    ops: list[list[Op]]
    tables: CostTables
    tokens: int  # the minibatch's real tokens (no padding): what throughput counts
    lengths: np.ndarray  # the minibatch's sequences' lengths, in its own order
    planning_ms: float = 0.0
    knobs: dict = field(default_factory=dict)  # what the method chose (microbatches, order, row length)
    predicted_ms: Optional[float] = None  # as the planner's evaluator scored it (None: not yet)
    # several chunks per rank: each virtual stage's layers and rank (None: one chunk per rank)
    chunking: Optional[Chunking] = None
    _timeline: Optional[Timeline] = field(default=None, repr=False)

    @property
    def timeline(self) -> Timeline:
        if self._timeline is None:
            self._timeline = simulate(self.tables, self.ops, len(self.layout.units))
        return self._timeline

    @property
    def iteration_ms(self) -> float:
        return self.predicted_ms if self.predicted_ms is not None else self.timeline.iteration_ms

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.iteration_ms


def score(
    method: str,
    profile: Profile,
    lengths: np.ndarray,
    layout: Layout,
    ops: list[list[Op]],
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    tables: Optional[CostTables] = None,
    predicted_ms: Optional[float] = None,
    chunking: Optional[Chunking] = None,
    **knobs,
) -> Plan:
    """``ops`` on ``layout`` (its cost tables given, or built; per virtual stage with
    ``chunking``), played by the reference simulator (or, given ``predicted_ms``, when first
    asked)."""
    if tables is None:
        tables = layout.tables(profile, lengths, recompute, dp, chunking)
    plan = Plan(
        method,
        layout,
        ops,
        tables,
        int(np.asarray(lengths).sum()),
        np.asarray(lengths),
        knobs=knobs,
        predicted_ms=predicted_ms,
        chunking=chunking,
    )
    if predicted_ms is None:
        plan.timeline  # noqa: B018 - played now
    return plan
