"""The cost model: how long a schedule takes and how much memory it needs.

This module is the single source of predicted times. :func:`simulate` is the plain reference
simulator of docs/formats.md ("Cost model"): it plays any op lists (GPipe, 1F1B or any other order)
and returns the iteration time, per-stage busy time and peak memory, and the timeline of every op
and message. Solvers that need speed use :mod:`umopt.population_sim`, which must agree with this to
1e-9 and is tested against it.

Times are milliseconds. Chunk sizes are whole samples, so per-size costs are tabulated once, with
linear interpolation between the profile's measured sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from .errors import UmoptError
from .limits import MAX_MS

if TYPE_CHECKING:  # (the formats import the cost model to check schedules)
    from .formats.profile import AllReduceProfile, Profile

__all__ = ["Op", "CostTables", "Span", "Message", "Timeline", "simulate", "stage_peak_memory", "allreduce_ms"]


class Op(NamedTuple):
    """One op of a stage: the forward (``kind`` "F"), backward ("B") or weight gradient ("W") of
    samples ``[lo, hi)``. On a stage with W ops, B computes only the input gradient.

    A tuple, so it reads and writes as ``["F", lo, hi]`` in schedule files and unpacks as
    ``kind, lo, hi``."""

    kind: str
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class CostTables:
    """Per-size costs of one profile, indexed by chunk size ``b`` (index 0 is an empty chunk).

    ``fwd[s, b]`` and ``bwd[s, b]`` are the durations of an F and a B op of ``b`` samples on stage
    ``s``; with ``recompute`` a B op re-runs the forward, so ``bwd`` already includes it.
    ``link[s, b]`` is the time of a ``b``-sample message over link ``s`` (either direction).
    ``allreduce_ms[s]`` is the all-reduce of stage ``s``'s gradients among its data-parallel
    replicas, after its last op (zeros for one pipeline). ``bwd_input`` and ``bwd_weight`` are the
    B and W ops of a stage whose backward is split (None where the profile has no split).
    """

    fwd: np.ndarray
    bwd: np.ndarray
    link: np.ndarray
    optimizer_ms: float
    recompute: bool
    static_bytes: np.ndarray
    stash_bytes: np.ndarray
    input_bytes: np.ndarray
    memory_limit: int | None
    allreduce_ms: np.ndarray
    bwd_input: np.ndarray | None = None
    bwd_weight: np.ndarray | None = None  # one B chunk's weight gradient as a W op
    op_overhead: np.ndarray | None = None  # (S,) the runtime's cost per op, inside every entry above

    @property
    def num_stages(self) -> int:
        return self.fwd.shape[0]

    @property
    def max_size(self) -> int:
        return self.fwd.shape[1] - 1

    @classmethod
    def from_profile(
        cls, profile: Profile, recompute: bool = False, dp: AllReduceProfile | None = None
    ) -> "CostTables":
        """The tables of ``profile``; with ``dp`` (replicas and their all-reduce speed), each stage's
        gradient all-reduce among them."""
        sizes = np.asarray(profile.sizes, dtype=float)
        b = np.arange(profile.max_size + 1, dtype=float)
        # an op costs its compute and the runtime's own cost per op; a message its transfer and
        # the runtime's cost per message (both 0 unless fitted to runs: docs/formats.md)
        over = np.array([[st.op_overhead_ms] for st in profile.stages])
        fwd = np.array([np.interp(b, sizes, st.forward_ms) for st in profile.stages]) + over
        bwd = np.array([np.interp(b, sizes, st.backward_ms) for st in profile.stages]) + over
        split = {}
        if all(st.backward_input_ms is not None for st in profile.stages):
            split["bwd_input"] = (
                np.array([np.interp(b, sizes, st.backward_input_ms) for st in profile.stages]) + over
            )
            split["bwd_weight"] = (
                np.array([np.interp(b, sizes, st.backward_weight_ms) for st in profile.stages]) + over
            )
            split["op_overhead"] = over[:, 0].copy()
        if recompute:  # the recomputed forward runs inside the B op: one op, one overhead
            bwd = bwd + fwd - over
            if split:
                split["bwd_input"] = split["bwd_input"] + fwd - over
        fwd[:, 0] = bwd[:, 0] = 0.0
        for key in ("bwd_input", "bwd_weight"):
            if key in split:
                split[key][:, 0] = 0.0
        link = np.array(
            [
                np.where(
                    b > 0,
                    ln.latency_ms + ln.message_overhead_ms + b * st.output_bytes_per_sample / ln.bytes_per_ms,
                    0.0,
                )
                for ln, st in zip(profile.links, profile.stages)
            ]
        ).reshape(len(profile.links), len(b))
        checked = [
            ("an F op of {b} samples on stage {s}", fwd),
            ("a B op of {b} samples on stage {s}", bwd),
            ("a message of {b} samples over link {s}", link),
        ]
        checked += [
            (f"a {k} op of {{b}} samples on stage {{s}}", split[key])
            for k, key in (("B", "bwd_input"), ("W", "bwd_weight"))
            if key in split
        ]
        for what, arr in checked:
            if arr.size and not arr.max() <= MAX_MS:  # not <=: also NaN
                s, b = np.unravel_index(int(np.argmax(np.where(np.isnan(arr), np.inf, arr))), arr.shape)
                raise UmoptError(
                    f"{what.format(s=s, b=b)} would take {arr[s, b]:.3g} ms, over umopt's limit of {MAX_MS:.0e} ms"
                )
            arr.setflags(write=False)
        return cls(
            fwd=fwd,
            bwd=bwd,
            link=link,
            optimizer_ms=max(st.optimizer_ms for st in profile.stages),
            recompute=recompute,
            static_bytes=np.array([st.static_bytes for st in profile.stages], dtype=np.int64),
            stash_bytes=np.array([st.stash_bytes_per_sample for st in profile.stages], dtype=np.int64),
            input_bytes=np.array([st.input_bytes_per_sample for st in profile.stages], dtype=np.int64),
            memory_limit=profile.memory_limit_bytes,
            allreduce_ms=_allreduce_per_stage(profile, dp),
            **split,
        )


def allreduce_ms(dp: AllReduceProfile, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` among ``dp.replicas`` replicas (a ring: every byte crosses
    2 (N - 1) / N times the bus bandwidth); 0 for one replica."""
    n = dp.replicas
    return 0.0 if n <= 1 else dp.latency_ms + 2 * (n - 1) / n * nbytes / dp.bus_bytes_per_ms


def _allreduce_per_stage(profile: Profile, dp: AllReduceProfile | None) -> np.ndarray:
    S = profile.num_stages
    if dp is None or dp.replicas <= 1:
        out = np.zeros(S)
    else:
        missing = [s for s, st in enumerate(profile.stages) if st.param_bytes is None]
        if missing:
            raise UmoptError(
                f"stage {missing[0]} of the profile has no param_bytes: its gradient all-reduce cannot be predicted (profile again)"
            )
        out = np.array([allreduce_ms(dp, st.param_bytes) for st in profile.stages])
        if not out.max() <= MAX_MS:
            raise UmoptError(
                f"an all-reduce would take {out.max():.3g} ms, over umopt's limit of {MAX_MS:.0e} ms"
            )
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class Span:
    """One op as it runs on a stage."""

    stage: int
    kind: str
    lo: int
    hi: int
    start: float
    end: float


@dataclass(frozen=True)
class Message:
    """One message on a link: ``direction`` is "fwd" (activations) or "bwd" (gradients)."""

    link: int
    direction: str
    lo: int
    hi: int
    sent: float
    start: float
    end: float


@dataclass
class Timeline:
    iteration_ms: float
    busy_ms: list[float]
    peak_memory_bytes: list[int]
    spans: list[list[Span]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    finish_ms: list[float] = field(default_factory=list)  # end of each stage's last op
    allreduce_ms: list[float] = field(default_factory=list)  # each stage's gradient all-reduce after it

    @property
    def makespan_ms(self) -> float:
        """End of the last op or all-reduce, without the optimizer step."""
        return max(f + a for f, a in zip(self.finish_ms, self.allreduce_ms or [0.0] * len(self.finish_ms)))

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time idle between 0 and the makespan, averaged over stages."""
        m = self.makespan_ms
        return 0.0 if m <= 0 else 1.0 - sum(self.busy_ms) / (m * len(self.busy_ms))


def stage_peak_memory(tables: CostTables, stage: int, ops: Sequence[Op]) -> int:
    """Peak bytes of one stage over its op list (the spec's memory model; it does not depend on time).

    On a stage with W ops, what a sample keeps for backward is released by its W, not its B
    (the weight gradient needs the layers' inputs and output gradients); with recompute, the
    activations its B recomputed are kept until its W too."""
    s = stage
    release = "W" if any(op[0] == "W" for op in ops) else "B"
    stashed = 0  # samples forwarded and not yet released
    awaiting = 0  # with recompute and W ops: samples whose B recomputed activations their W needs
    peak = int(tables.static_bytes[s])
    for kind, lo, hi in ops:
        b = hi - lo
        if kind == "F":
            stashed += b
        if tables.recompute:
            running = b if kind != "W" else 0  # a W runs on what its B kept (awaiting)
            mem = (
                tables.static_bytes[s]
                + stashed * tables.input_bytes[s]
                + (awaiting + running) * tables.stash_bytes[s]
            )
        else:
            mem = tables.static_bytes[s] + stashed * tables.stash_bytes[s]
        peak = max(peak, int(mem))
        if kind == release:
            stashed -= b
            awaiting -= b if kind == "W" and tables.recompute else 0
        elif kind == "B" and release == "W" and tables.recompute:
            awaiting += b
    return peak


def weight_ms(tables: CostTables, stage: int, b_chunks: Sequence[tuple[int, int]]) -> float:
    """A W op over whole B chunks: each chunk's weight gradient as measured (the runtime resumes
    each chunk's own saved backward; their graphs cannot be batched), one op's overhead."""
    over = float(tables.op_overhead[stage])
    return sum(float(tables.bwd_weight[stage, hi - lo]) - over for lo, hi in b_chunks) + over


def simulate(
    tables: CostTables, ops: Sequence[Sequence[Op]], minibatch: int, *, record: bool = True
) -> Timeline:
    """Play the op lists of all stages under the cost model.

    With ``record=False`` the timeline keeps no spans or messages and peak memory is not computed
    (searches that only need times run faster); every time is the same either way.

    Raises :class:`UmoptError` if the schedule deadlocks (some stage waits forever), a B op
    comes before the F of its samples on its stage, or a W op before their B.
    """
    S = tables.num_stages
    if len(ops) != S:
        raise UmoptError(f"schedule has {len(ops)} stages, the profile {S}")
    split = [any(op[0] == "W" for op in stage) for stage in ops]
    if any(split) and tables.bwd_input is None:
        raise UmoptError(
            "the schedule has W ops but the profile has no backward_input_ms / backward_weight_ms (profile with --split-backward)"
        )
    never = float("inf")  # not sent yet; max() over a chunk then says "not ready" by itself
    # act_at[s][i]: when sample i's activation is ready on stage s (stage 0: at time 0).
    # grad_at[s][i]: when sample i's gradient is ready on stage s (last stage: its F's end there).
    act_at = [[0.0] * minibatch] + [[never] * minibatch for _ in range(S - 1)]
    grad_at = [[never] * minibatch for _ in range(S)]
    fwd_done = [[False] * minibatch for _ in range(S)]
    bwd_done = [[False] * minibatch for _ in range(S)]
    b_chunks = [
        sorted((lo, hi) for kind, lo, hi in stage if kind == "B") if split[s] else []
        for s, stage in enumerate(ops)
    ]
    link_free = {("fwd", s): 0.0 for s in range(S - 1)} | {("bwd", s): 0.0 for s in range(S - 1)}
    clock = [0.0] * S
    busy = [0.0] * S
    ptr = [0] * S
    spans: list[list[Span]] = [[] for _ in range(S)]
    messages: list[Message] = []
    fwd, bwd, link = tables.fwd, tables.bwd, tables.link

    def send(direction: str, ln: int, lo: int, hi: int, sent: float, dest: list[float]) -> None:
        start = max(sent, link_free[(direction, ln)])
        end = start + float(link[ln, hi - lo])
        link_free[(direction, ln)] = end
        dest[lo:hi] = [end] * (hi - lo)
        if record:
            messages.append(Message(ln, direction, lo, hi, sent, start, end))

    progress = True
    while progress:
        progress = False
        for s in range(S):
            todo = ops[s]
            while ptr[s] < len(todo):
                kind, lo, hi = todo[ptr[s]]
                if kind == "F":
                    ready = max(act_at[s][lo:hi])
                    dur = float(fwd[s, hi - lo])
                elif kind == "B":
                    if not all(fwd_done[s][lo:hi]):
                        raise UmoptError(f"stage {s}: B({lo},{hi}) comes before the F of its samples")
                    ready = max(grad_at[s][lo:hi])
                    dur = float((tables.bwd_input if split[s] else bwd)[s, hi - lo])
                else:  # W: local, after the B of its samples on this stage, which ran before it
                    if not all(bwd_done[s][lo:hi]):
                        raise UmoptError(f"stage {s}: W({lo},{hi}) comes before the B of its samples")
                    ready = 0.0
                    dur = weight_ms(tables, s, [c for c in b_chunks[s] if lo <= c[0] and c[1] <= hi])
                if ready == never:  # an input has not been sent yet
                    break
                start = max(clock[s], ready)
                end = start + dur
                clock[s] = end
                busy[s] += dur
                if record:
                    spans[s].append(Span(s, kind, lo, hi, start, end))
                if kind == "F":
                    fwd_done[s][lo:hi] = [True] * (hi - lo)
                    if s + 1 < S:
                        send("fwd", s, lo, hi, end, act_at[s + 1])
                    else:
                        grad_at[s][lo:hi] = [end] * (hi - lo)
                elif kind == "B":
                    bwd_done[s][lo:hi] = [True] * (hi - lo)
                    if s > 0:
                        send("bwd", s - 1, lo, hi, end, grad_at[s - 1])
                ptr[s] += 1
                progress = True
    stuck = [s for s in range(S) if ptr[s] < len(ops[s])]
    if stuck:
        s = stuck[0]
        kind, lo, hi = ops[s][ptr[s]]
        raise UmoptError(f"schedule deadlocks: stage {s} waits forever at {kind}({lo},{hi})")
    ar = [float(a) for a in tables.allreduce_ms]
    return Timeline(
        iteration_ms=max(c + a for c, a in zip(clock, ar)) + tables.optimizer_ms,
        busy_ms=busy,
        peak_memory_bytes=[stage_peak_memory(tables, s, ops[s]) for s in range(S)] if record else [],
        spans=spans,
        messages=messages,
        finish_ms=clock,
        allreduce_ms=ar,
    )
