"""What a one-chunk schedule family is, and the families umopt searches.

A family turns genes into every stage's op list and scores a whole population of genes at once.
The genes every family shares are the stages' forward and backward partitions (chunk sizes in
sample order; the backward ones are the forward ones without recompute); 1F1B adds each stage's
warm-up; W placement (:mod:`.weights`) adds a cap per stage to any family. The solvers, the
baselines, the bounds' scope and the CLI ask a family what they need (does it have warm-ups, are
its backwards in sample order, how few chunks an equal schedule of it takes) and never compare
order names: ``--order`` is parsed to a family once, at the edge (:func:`parse_order`).

Adding a family: a module with its op-list builder and a :class:`ScheduleFamily` passed to
:func:`register` (here, for umopt's own); the GA then searches it under ``--order auto``, and
``--order NAME`` searches it alone. Without a population evaluator of its own it is scored by the
simulator, one individual at a time (correct, slower); a vectorized one joins
``tests/test_conformance.py``'s implementations.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..costmodel import CostTables, Op, simulate, stage_peak_memory
from ..errors import UmoptError
from .gpipe import gpipe_ops
from .onef1b import onef1b_schedule
from .population_sim import PopulationScore, evaluate_1f1b, evaluate_gpipe
from .weights import place_weights

__all__ = [
    "ScheduleFamily",
    "GPIPE",
    "ONEF1B",
    "FREE",
    "FAMILIES",
    "family",
    "ruled",
    "register",
    "parse_order",
]


class ScheduleFamily:
    """One family: its name (the schedule files' ``order``), its op lists, its scores."""

    name: str = ""
    warmups: bool = False  # its genes include each stage's warm-up (forwards before its first backward)
    by_rule: bool = True  # its op lists follow from its partitions by a rule (else the order is a gene)
    # every stage runs its B ops in sample order whatever the partitions: the in-order bounds
    # (:class:`umopt.search.bounds.scope.Scope`) hold for all of its schedules
    backwards_in_sample_order: bool = False

    @property
    def equal_name(self) -> str:
        """Its best equal schedule's name in reports ("gpipe_equal")."""
        return f"{self.name}_equal"

    def fewest_equal_chunks(self, num_stages: int) -> int:
        """The fewest microbatches its equal schedule is run with (torch's 1F1B wants one per stage)."""
        return 1

    def first_wcaps(self, largest: np.ndarray, num_stages: int, minibatch: int) -> np.ndarray:
        """Where a search starts each stage's W cap (``largest``: the stage's largest chunk, any
        shape): by default every W at the end (the minibatch)."""
        return np.full(np.shape(largest), minibatch)

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
        """The scores of P individuals; by default each one's op lists played by the simulator
        (a family with a vectorized evaluator overrides this)."""
        P, S = fsizes.shape[:2]
        out = PopulationScore(np.empty(P), np.empty((P, S)), np.empty((P, S)), np.zeros((P, S), np.int64))
        rows = lambda a: [[int(x) for x in row if x] for row in a]  # noqa: E731
        for p in range(P):
            fs = rows(fsizes[p])
            warm = None if warmup is None or not self.warmups else warmup[p]
            ops = self.stage_ops(fs, fs if bsizes is None else rows(bsizes[p]), warm)
            if wcap is not None:
                ops = place_weights(ops, wcap[p])
            tl = simulate(tables, ops, sum(fs[0]), record=False)
            out.iteration_ms[p], out.finish_ms[p], out.busy_ms[p] = tl.iteration_ms, tl.finish_ms, tl.busy_ms
            out.peak_memory_bytes[p] = [stage_peak_memory(tables, s, o) for s, o in enumerate(ops)]
        return out

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
    backwards_in_sample_order = True

    def fewest_equal_chunks(self, num_stages: int) -> int:
        return num_stages

    def first_wcaps(self, largest, num_stages, minibatch) -> np.ndarray:
        # ZB-H1: 1F1B's own peak, S of the stage's largest chunks
        return np.minimum(num_stages * np.asarray(largest), minibatch)

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
FAMILIES: dict[str, ScheduleFamily] = {}


def register(fam: ScheduleFamily) -> ScheduleFamily:
    """Make ``fam`` a family umopt knows: schedule files may name it, ``--order`` may pick it,
    and, built by rule, ``--order auto`` searches it."""
    if not fam.name or fam.name == "auto":
        raise UmoptError(f"a schedule family needs a name other than 'auto', got {fam.name!r}")
    FAMILIES[fam.name] = fam
    return fam


for _fam in (GPIPE, ONEF1B, FREE):
    register(_fam)


def ruled() -> list[ScheduleFamily]:
    """The families a solver builds from partitions (all but the free order), in registration order."""
    return [f for f in FAMILIES.values() if f.by_rule]


def family(name: str) -> ScheduleFamily:
    """The family of a schedule order name ("gpipe", "1f1b", "free")."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UmoptError(f"unknown schedule order {name!r} (one of {', '.join(FAMILIES)})") from None


def parse_order(value: "str | ScheduleFamily | None") -> Optional[ScheduleFamily]:
    """``--order``'s value as the family to search alone; None for "auto" (every family, and the
    free order where an exact model runs)."""
    if value is None or isinstance(value, ScheduleFamily):
        return value
    if value == "auto":
        return None
    names = ", ".join(["auto"] + [f.name for f in ruled()])
    fam = FAMILIES.get(value)
    if fam is None or not fam.by_rule:
        raise UmoptError(f"--order must be one of {names}, got {value!r}")
    return fam
