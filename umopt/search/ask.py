"""What ``umopt solve`` is asked, checked in one place, and the one call that answers it.

A :class:`SolveAsk` holds every option of the command. :meth:`SolveAsk.check` refuses, in one line
each and before anything is computed or written, what cannot be answered. :func:`answer` runs the
solve asked for; the costs choose it, not the caller: by sizes (one chunk per rank,
:mod:`.solve`, or several, :mod:`.solve_chunks`) or by the lengths of the sequences (one
minibatch or a stream of them, :mod:`.solve_lengths`, or a global minibatch across replicas,
:mod:`.replicas`). Each returns its report, which the command prints.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional

import numpy as np

from ..errors import UmoptError
from ..fileio import check_writable
from ..formats.profile import AllReduceProfile, Profile

__all__ = ["SolveAsk", "answer", "check_time_limit", "CHUNKS_MIN_TIME_LIMIT"]

# the least --time-limit a solve with several chunks per rank keeps: it imports torch's schedules
# (seconds on a CPU) and scores them before its own search
CHUNKS_MIN_TIME_LIMIT = 5.0

# a progress callback: the share done, and the best predicted ms so far (None: not known)
Progress = Callable[[float, Optional[float]], None]


def check_time_limit(seconds: float) -> None:
    """``--time-limit`` is a positive number of seconds (checked first: what is left of it is
    computed from it)."""
    if not (0 < seconds < math.inf):  # also NaN
        raise UmoptError(f"--time-limit must be a positive number of seconds, got {seconds}")


@dataclass
class SolveAsk:
    """Every option of ``umopt solve`` (see ``umopt solve --help``); ``started``: the
    ``time.perf_counter()`` the time limit counts from."""

    profile: Profile
    minibatch: int
    started: float
    time_limit: float = 20.0
    recompute: bool = False
    solver: str = "auto"
    order: str = "auto"
    seed: int = 0
    dp: int = 1
    dp_gbps: Optional[float] = None
    zero_bubble: bool = False
    chunks: tuple[int, ...] = (1,)
    lengths: Optional[str] = None
    minibatches: int = 1
    budget_ms: float = 15.0
    output: Optional[str] = None
    plot: Optional[str] = None
    trace: Optional[str] = None

    @property
    def kind(self) -> str:
        """ "sizes", "chunks" (several per rank), "minibatch", "stream" or "replicas" (by lengths)."""
        if self.lengths is None:
            return "sizes" if self.chunks == (1,) else "chunks"
        if self.dp > 1:
            return "replicas"
        return "minibatch" if self.minibatches == 1 else "stream"

    @property
    def files(self) -> list[str]:
        return [p for p in (self.output, self.plot, self.trace) if p]

    def left_s(self) -> float:
        """What is left of the time limit."""
        return self.time_limit - (time.perf_counter() - self.started)

    def check(self) -> None:
        """Refuse what cannot be answered, in one line (see the module docstring)."""
        if self.lengths is not None:
            self._check_lengths()
        else:
            self._check_sizes()
        for path in self.files:
            check_writable(path)
        self.allreduce  # a --dp the profile cannot price is said here, before any solve

    def _check_sizes(self) -> None:
        if self.output is None:
            raise UmoptError("give -o/--output, the schedule file to write")
        if self.minibatches != 1:
            raise UmoptError("--minibatches plans a stream of sequences of different lengths: give --lengths")
        if self.kind == "chunks":
            if self.solver != "auto" or self.order != "auto":
                raise UmoptError("--chunks searches on its own: it takes no --solver or --order")
            if self.time_limit < CHUNKS_MIN_TIME_LIMIT:
                raise UmoptError(
                    f"--chunks needs --time-limit {CHUNKS_MIN_TIME_LIMIT:g} or more (it imports torch's schedules, "
                    f"seconds on a CPU, and scores them before its own search), got {self.time_limit:g}"
                )

    def _check_lengths(self) -> None:
        given = [
            name
            for name, on in (
                ("--solver", self.solver != "auto"),
                ("--order", self.order != "auto"),
                ("--zero-bubble", self.zero_bubble),
            )
            if on
        ]
        if given:
            raise UmoptError(f"--lengths plans on its own: it takes no {', '.join(given)}")
        if self.minibatches < 1:
            raise UmoptError(f"--minibatches must be at least 1, got {self.minibatches}")
        if self.budget_ms <= 0:
            raise UmoptError(f"--budget-ms must be positive, got {self.budget_ms}")
        if self.minibatches > 1 and (self.output or self.plot or self.trace):
            raise UmoptError(
                "a stream (--minibatches > 1) writes no files: plan one minibatch for a schedule file"
            )
        if self.minibatches == 1 and self.output is None:
            raise UmoptError("give -o/--output, the schedule file to write")
        if self.dp > 1 and (self.minibatches > 1 or self.chunks != (1,) or self.plot or self.trace):
            raise UmoptError(
                "--dp with --lengths plans one global minibatch across the replicas, one chunk per rank: "
                "no --minibatches, --chunks, --plot or --trace (bench/replicas.py plays streams)"
            )

    @cached_property
    def allreduce(self) -> Optional[AllReduceProfile]:
        from .solve import allreduce_for

        return allreduce_for(self.profile, self.dp, self.dp_gbps)

    @property
    def spec(self) -> str:
        """``--lengths`` as a sampler's spec (a file's lengths: ``file:PATH``)."""
        assert self.lengths is not None
        return f"file:{self.lengths}" if os.path.isfile(self.lengths) else self.lengths

    @property
    def source(self) -> str:
        """Where the sequences come from, in words."""
        return self.lengths if not self.spec.startswith("file:") else f"file {self.lengths}"

    @cached_property
    def batches(self) -> list[np.ndarray]:
        """The minibatches of sequence lengths, seeded, cut to the profile's longest."""
        from ..samplers import minibatches

        cap = self.profile.lengths.max_length if self.profile.lengths is not None else None
        return minibatches(self.spec, self.minibatches, self.minibatch, seed=self.seed, cap=cap)

    def cut_note(self) -> Optional[str]:
        """What was cut to the profile's longest sequence, in words (None: nothing)."""
        from ..samplers import cut_note, minibatches

        if self.lengths is None or self.profile.lengths is None:
            return None
        drawn = minibatches(self.spec, self.minibatches, self.minibatch, seed=self.seed)
        return cut_note(self.spec, self.profile.lengths.max_length, drawn)


def answer(ask: SolveAsk, progress: Optional[Progress] = None) -> Any:
    """The report of the solve ``ask`` asks for (see the module docstring), within what is left
    of its time limit; ``ask`` checked."""
    kind = ask.kind
    if kind == "sizes":
        from .solve import solve

        return solve(
            ask.profile, ask.minibatch, recompute=ask.recompute, solver=ask.solver,
            time_limit=max(0.5, ask.left_s()), seed=ask.seed, progress=progress, order=ask.order,
            dp=ask.allreduce, zero_bubble=ask.zero_bubble,
        )  # fmt: skip
    if kind == "chunks":
        from .peers.schedules import TORCH_EXIT_S
        from .solve_chunks import solve_chunked

        return solve_chunked(
            ask.profile, ask.minibatch, ask.chunks, recompute=ask.recompute,
            # what is left of it, less the process's exit once torch's schedules are imported
            time_limit=max(0.5, ask.left_s() - TORCH_EXIT_S), seed=ask.seed,
            zero_bubble=ask.zero_bubble, progress=progress, dp=ask.allreduce,
        )  # fmt: skip
    L = ask.batches[0]
    if kind == "replicas":
        from .replicas import solve_global

        return solve_global(ask.profile, L, ask.dp, ask.budget_ms, ask.recompute, ask.allreduce)
    from .solve_lengths import solve_minibatch, solve_stream

    if kind == "minibatch":
        return solve_minibatch(
            ask.profile, L, ask.left_s(), ask.budget_ms, ask.recompute, ask.allreduce, ask.seed, ask.chunks
        )
    return solve_stream(
        ask.profile, ask.batches, ask.left_s(), ask.budget_ms, ask.recompute, ask.allreduce,
        progress=None if progress is None else (lambda done, total: progress(done / total, None)),
        chunks=ask.chunks,
    )  # fmt: skip
