"""What a solver is asked (:class:`Problem`) and what it answers (:class:`Candidate`).

A candidate is one forward and one backward partition per stage plus an op order; it turns into
op lists with :mod:`umopt.schedules.partition` and is scored by the cost model. Every solver returns
candidates; the final numbers always come from :func:`umopt.costmodel.simulate` on their ops.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from ..costmodel import Chunking, CostTables, Op, Timeline, simulate, tables_for_lengths
from ..formats.profile import AllReduceProfile, Profile
from ..schedules import pipedream_warmup, place_weights
from ..schedules.family import FREE, GPIPE, ScheduleFamily, family
from ..schedules.partition import partitions_from_ops

__all__ = ["Problem", "LayoutProblem", "Candidate", "SolverResult", "Progress", "ticking", "pack"]

# progress(fraction_done, best_iteration_ms_so_far); solvers call it now and then, the CLI draws it.
# best is inf until a solver has a schedule.
Progress = Callable[[float, float], None]


@contextmanager
def ticking(
    progress: Optional[Progress], start: float, seconds: float, best: Callable[[], float], every: float = 0.5
) -> Iterator[None]:
    """Move ``progress`` with the clock while the block runs: every ``every`` seconds, the share
    of ``seconds`` gone since ``start`` (a ``time.perf_counter()``) and ``best()``.

    For solvers that cannot report from inside (CP-SAT and CBC search for the whole time limit
    in one call; CP-SAT lets other threads run meanwhile, CBC is another process)."""
    if progress is None:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            progress(min(1.0, (time.perf_counter() - start) / max(seconds, 1e-9)), best())

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@dataclass(frozen=True)
class Problem:
    tables: CostTables
    minibatch: int
    # what is computed once per problem and asked for by several solvers (the equal baselines)
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return self.tables.num_stages

    @property
    def max_size(self) -> int:
        return min(self.tables.max_size, self.minibatch)

    @property
    def recompute(self) -> bool:
        return self.tables.recompute

    @property
    def memory_limit(self) -> Optional[int]:
        return self.tables.memory_limit


@dataclass
class LayoutProblem:
    """``umopt solve --chunks``' problem: a profile with its layers at one minibatch, whose cost
    tables depend on how the layers are cut into virtual stages and placed on the ranks (a
    :class:`umopt.costmodel.Chunking`). Each cut's tables are built once, on first ask, and shared
    by everyone who scores schedules on it (torch's classes, umopt's search, the polish): what
    :class:`Problem` is to one chunk per rank. With ``tokens``, a minibatch of sequences of
    different lengths: sample k's tokens (in the planned order), costed by sample range in
    ``mode`` (``squares`` and ``docs`` where samples are rows of packed sequences; see
    :func:`umopt.costmodel.tables_for_lengths`)."""

    profile: Profile
    minibatch: int
    recompute: bool = False
    dp: Optional[AllReduceProfile] = None
    tokens: Optional[np.ndarray] = None
    mode: str = "packed"
    squares: Optional[np.ndarray] = None
    docs: Optional[np.ndarray] = None
    rows: Optional[np.ndarray] = None  # each sample's rows the runtime's buffers hold (default: its tokens)
    _tables: dict = field(default_factory=dict, repr=False, compare=False)

    def tables(self, chunking: Chunking) -> CostTables:
        """The cost tables of the layers cut and placed as ``chunking`` says."""
        if chunking not in self._tables:
            if self.tokens is None:
                self._tables[chunking] = CostTables.from_profile(
                    self.profile, self.recompute, self.dp, chunks=chunking, minibatch=self.minibatch
                )
            else:
                self._tables[chunking] = tables_for_lengths(
                    self.profile,
                    self.tokens,
                    self.mode,
                    self.recompute,
                    self.dp,
                    self.squares,
                    self.docs,
                    chunks=chunking,
                    rows=self.rows,
                )
        return self._tables[chunking]

    @property
    def num_ranks(self) -> int:
        return self.profile.num_stages

    @property
    def max_size(self) -> int:
        """The largest chunk: the profile's largest size timed (by sequences: any, each range is costed)."""
        return self.minibatch if self.tokens is not None else self.profile.max_size

    @property
    def split(self) -> bool:
        """Every layer's backward measured as B and W apart (W ops can be placed)."""
        layers = self.profile.layers
        return layers is not None and all(ly.backward_input_ms is not None for ly in layers)


@dataclass
class Candidate:
    """Per-stage forward and backward partitions (chunk sizes in sample order) and an order.

    ``order`` names its family (:mod:`umopt.schedules.family`): one built by rule ("gpipe",
    "1f1b": op lists follow from the partitions) or "free": the op lists were chosen op by op (the
    exact models' free order) and are kept in ``explicit_ops``. In 1F1B order ``warmup[s]`` is how many forwards stage s runs before its first backward
    (None: PipeDream-flush's ``S - s - 1``). ``wcap[s]`` splits stage s's backward into B and W
    ops, placed by :func:`umopt.schedules.partition.with_weight_ops` with that cap (samples awaiting their
    W; the minibatch defers every W to the end; negative: the stage's backward stays whole);
    None: no W ops.
    """

    fsizes: list[list[int]]
    bsizes: list[list[int]]
    order: str = GPIPE.name
    iteration_ms: float = float("inf")  # as last scored; the simulator has the final word
    explicit_ops: Optional[list[list[Op]]] = None
    warmup: Optional[list[int]] = None
    wcap: Optional[list[int]] = None

    @classmethod
    def from_ops(cls, ops: Sequence[Sequence[Op]]) -> "Candidate":
        """A free-order candidate from per-stage op lists."""
        parts = [partitions_from_ops(o) for o in ops]
        return cls(
            [f for f, _ in parts],
            [b for _, b in parts],
            FREE.name,
            explicit_ops=[[Op(*op) for op in o] for o in ops],
        )

    @property
    def family(self) -> ScheduleFamily:
        """Its schedule family (``order`` is the family's name, as the files write it)."""
        return family(self.order)

    @property
    def warmups(self) -> list[int]:
        """Each stage's 1F1B warm-up forwards (PipeDream-flush's unless set)."""
        return list(self.warmup) if self.warmup is not None else pipedream_warmup(len(self.fsizes))

    def ops(self) -> list[list[Op]]:
        if not self.family.by_rule:
            assert self.explicit_ops is not None
            return [list(o) for o in self.explicit_ops]
        ops = self.family.stage_ops(self.fsizes, self.bsizes, self.warmup)
        return ops if self.wcap is None else place_weights(ops, self.wcap)

    def simulate(self, problem: Problem) -> Timeline:
        return simulate(problem.tables, self.ops(), problem.minibatch)

    def fits(self, timeline: Timeline, problem: Problem) -> bool:
        limit = problem.memory_limit
        return limit is None or max(timeline.peak_memory_bytes) <= limit

    @classmethod
    def uniform(cls, sizes: Sequence[int], num_stages: int, order: str = GPIPE.name) -> "Candidate":
        """The same partition on every stage, for forward and backward."""
        return cls([list(sizes) for _ in range(num_stages)], [list(sizes) for _ in range(num_stages)], order)


@dataclass
class SolverResult:
    name: str
    candidate: Candidate
    status: str  # "optimal" when proven, "feasible" otherwise
    lower_bound_ms: Optional[float] = None
    seconds: float = 0.0
    evaluated: int = 0  # schedules scored
    # which schedules lower_bound_ms holds for (a umopt.search.bounds.Scope value: "any order", ...)
    bound_scope: Optional[str] = None
    lower_bound_1f1b_ms: Optional[float] = None  # auto: a bound among schedules in 1F1B order
    lower_bound_w_ms: Optional[float] = None  # solve --zero-bubble, small instances: with W ops
    notes: list[str] = field(default_factory=list)  # what the user should know about the result
    winner: Optional[str] = None  # auto: the part whose schedule won
    tried: dict[str, float] = field(default_factory=dict)  # auto: each part's best iteration ms
    engine_status: Optional[str] = None  # cpsat, milp: the engine's own status name
    engine: Optional[str] = None  # milp: the MIP engine that ran
    generations: Optional[int] = None  # ga
    restarts: Optional[int] = None  # ga
    # other schedules it found on the way (auto: each part's best), for what comes after the
    # search: W ops placed in each (solve --zero-bubble)
    alternatives: list[Candidate] = field(default_factory=list)


def pack(partitions: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """(P, S, K) zero-padded array of P individuals' per-stage partitions."""
    K = max(len(part) for ind in partitions for part in ind)
    out = np.zeros((len(partitions), len(partitions[0]), K), dtype=np.int64)
    for p, ind in enumerate(partitions):
        for s, part in enumerate(ind):
            out[p, s, : len(part)] = part
    return out
