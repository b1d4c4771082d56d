"""What a one-chunk schedule family is, and the families umopt searches.

A family turns genes into every stage's op list and scores a whole population of genes at once.
The genes every family shares are the stages' forward and backward partitions (chunk sizes in
sample order; the backward ones are the forward ones without recompute); 1F1B adds each stage's
warm-up; W placement (:mod:`.weights`) adds a cap per stage to any family. Solvers ask a family
by name (:data:`FAMILIES`, :func:`family`) rather than comparing order strings.

Adding a family: a module with its op-list builder, a :class:`ScheduleFamily` here, and its
implementations registered in ``tests/test_conformance.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..costmodel import CostTables, Op
from ..errors import UmoptError
from .gpipe import gpipe_ops
from .onef1b import onef1b_schedule
from .population_sim import PopulationScore, evaluate_1f1b, evaluate_gpipe

__all__ = ["ScheduleFamily", "GPIPE", "ONEF1B", "FREE", "FAMILIES", "RULED", "family"]


class ScheduleFamily:
    """One family: its name (the schedule files' ``order``), its op lists, its scores."""

    name: str = ""
    warmups: bool = False  # its genes include each stage's warm-up (forwards before its first backward)
    by_rule: bool = True  # its op lists follow from its partitions by a rule (else the order is a gene)

    def stage_ops(
        self,
        fsizes: Sequence[Sequence[int]],
        bsizes: Sequence[Sequence[int]],
        warmup: Optional[Sequence[int]],
    ) -> list[list[Op]]:
        """Every stage's op list for these partitions (and warm-ups, where the family has them)."""
        raise NotImplementedError

    def evaluate(
        self, tables: CostTables, fsizes: np.ndarray, bsizes: Optional[np.ndarray], warmup, wcap
    ) -> PopulationScore:
        raise UmoptError(f"the {self.name} family has no population evaluator (score its op lists)")

    def score(
        self,
        tables: CostTables,
        fsizes: np.ndarray,
        bsizes: Optional[np.ndarray] = None,
        warmup: Optional[np.ndarray] = None,
        wcap: Optional[np.ndarray] = None,
    ) -> tuple[np.ndarray, PopulationScore]:
        """Iteration ms of each of P individuals (zero-padded ``(P, S, K)`` partitions; ``bsizes``
        None: the forward ones; ``warmup`` (P, S) where the family has them; ``wcap`` (P, S): W
        ops placed with those caps), ``inf`` where one breaks the memory limit; and the scores,
        all on ``tables`` (a :class:`umopt.search.problem.Problem`'s)."""
        sc = self.evaluate(tables, fsizes, bsizes, warmup, wcap)
        it = sc.iteration_ms
        if tables.memory_limit is not None:
            it = np.where(sc.peak_memory_bytes.max(axis=1) <= tables.memory_limit, it, np.inf)
        return it, sc


class GPipe(ScheduleFamily):
    """Every forward, then every backward in reverse sample order (:mod:`.gpipe`)."""

    name = "gpipe"

    def stage_ops(self, fsizes, bsizes, warmup=None) -> list[list[Op]]:
        return [gpipe_ops(f, b) for f, b in zip(fsizes, bsizes)]

    def evaluate(self, tables, fsizes, bsizes, warmup, wcap) -> PopulationScore:
        return evaluate_gpipe(tables, fsizes, bsizes, wcap)


class OneF1B(ScheduleFamily):
    """1F1B with a warm-up per stage (:mod:`.onef1b`; None: PipeDream-flush's)."""

    name = "1f1b"
    warmups = True

    def stage_ops(self, fsizes, bsizes, warmup=None) -> list[list[Op]]:
        return onef1b_schedule(fsizes, bsizes, warmup)

    def evaluate(self, tables, fsizes, bsizes, warmup, wcap) -> PopulationScore:
        return evaluate_1f1b(tables, fsizes, warmup, bsizes, wcap)


class Free(ScheduleFamily):
    """Any order per stage, chosen op by op (the exact models' answers, polished orders): its
    op lists are its genes, kept whole (:class:`umopt.search.problem.Candidate`'s ``explicit_ops``)."""

    name = "free"
    by_rule = False

    def stage_ops(self, fsizes, bsizes, warmup=None) -> list[list[Op]]:
        raise UmoptError("a free-order schedule's ops are its own: they cannot be built from partitions")


GPIPE, ONEF1B, FREE = GPipe(), OneF1B(), Free()
FAMILIES: dict[str, ScheduleFamily] = {f.name: f for f in (GPIPE, ONEF1B, FREE)}
RULED = [f for f in FAMILIES.values() if f.by_rule]  # the families a solver builds from partitions


def family(name: str) -> ScheduleFamily:
    """The family of a schedule order name ("gpipe", "1f1b", "free")."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UmoptError(f"unknown schedule order {name!r} (one of {', '.join(FAMILIES)})") from None
