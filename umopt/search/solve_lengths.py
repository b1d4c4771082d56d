"""``umopt solve --lengths``: one minibatch of sequences planned (a schedule file), or a stream of
them planned step after step (tokens per second), each beside what people run.

One minibatch: umopt's fast plan (what a training step would use), the long search from it for
what is left of the time limit, and every peer at its best knobs (:mod:`.peers`); the schedule
file holds the best of umopt's plans, with the sequences each sample holds (``lengths``) and the
peers as its baselines. With several chunks per rank, umopt's multi-chunk plan
(:func:`.chunks.plan_chunks`) takes half of the search's time and competes with the one-chunk
plans, and padding and packing run torch's multi-chunk schedules too (each at its best count up
to the largest asked). A stream: every minibatch planned warm-started from the one before, as in
training, with the peers beside it, until the stream or the time limit ends; with several chunks
per rank, each multi-chunk method keeps the layout of its first plan (a pipeline's modules).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..chunks import placement_name
from ..costmodel import Chunking
from ..errors import NoFit, UmoptError
from ..formats.profile import AllReduceProfile, Profile
from ..formats.schedule import LengthsSpec, Schedule, make_schedule
from .method import Request
from .methods import METHODS, UMOPT
from .peers import PEERS
from .peers.schedules import TORCH_EXIT_S, load_torch_schedules
from .plan import Plan
from .solvers.per_step import search

__all__ = [
    "MinibatchReport",
    "StreamReport",
    "solve_minibatch",
    "solve_stream",
    "schedule_of",
    "plan_schedule",
]

# what is kept back from the time limit for writing the file and the picture (and with several
# chunks per rank, the peers having imported torch's schedules, for the process's exit)
_MARGIN_S = 1.5
# the rows of several chunks per rank ("pack, chunked": packing on torch's multi-chunk schedules)
CHUNKED = "chunked"


@dataclass
class MinibatchReport:
    lengths: np.ndarray
    fast: Plan  # the planner's, within its budget
    best: Plan  # the better of the fast plan and the long search's
    peers: dict[str, Optional[Plan]]  # None: does not fit the memory limit
    search_s: float  # seconds the long search ran (0: none)
    chunked: Optional[Plan] = (
        None  # umopt's plan with several chunks per rank (None: not asked, or none fits)
    )


def _check(profile: Profile, lengths: np.ndarray) -> None:
    if profile.lengths is None:
        raise UmoptError(
            f"profile {profile.path or ''} has no costs by tokens: --lengths needs a profile timed over "
            "sequence lengths (a variable-length sim profile, see docs/varlen.md)"
        )
    if len(lengths) < profile.num_stages:
        raise UmoptError(
            f"a minibatch of {len(lengths)} sequences cannot fill {profile.num_stages} stages: give -B >= {profile.num_stages}"
        )


def solve_minibatch(
    profile: Profile,
    lengths,
    time_limit: float,
    budget_ms: float = 15.0,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    seed: int = 0,
    chunks: Sequence[int] = (1,),
) -> MinibatchReport:
    """One minibatch (see the module docstring), within ``time_limit`` seconds; ``chunks``: the
    counts of chunks per rank to plan (``--chunks``: one count, or auto's 1-4)."""
    t0 = time.perf_counter()
    L = np.asarray(lengths, dtype=np.int64)
    _check(profile, L)
    many = tuple(c for c in chunks if c > 1)
    one = Request(profile, L, recompute, dp, budget_ms=budget_ms, seed=seed)
    fast = UMOPT.plan(one)
    if fast is None:
        raise NoFit()
    peers = {name: m.plan(one) for name, m in PEERS.items()}
    if many:  # torch's multi-chunk schedules at their best count (up to the largest), M and cut
        load_torch_schedules()  # imported before a plan's clock runs (seconds on a CPU)
        for name, m in PEERS.items():
            if m.chunked:
                peers[f"{name}, {CHUNKED}"] = m.plan(one.but(chunks=many))
    margin = _MARGIN_S + (TORCH_EXIT_S if many else 0.0)
    left = time_limit - (time.perf_counter() - t0) - margin
    chunked = None
    if many:  # None: none within the memory limit, and the one-chunk plans still compete
        chunked = UMOPT.plan(one.but(chunks=many, budget_ms=1e3 * max(0.2, left / 2)))
        left = time_limit - (time.perf_counter() - t0) - margin
    best, ran = fast, 0.0
    if left > 0.5:
        t = time.perf_counter()
        best = search(profile, L, fast, seconds=left, recompute=recompute, dp=dp, seed=seed)
        ran = time.perf_counter() - t
        if best is not fast:
            best.planning_ms = fast.planning_ms + 1e3 * ran
    if chunked is not None and chunked.iteration_ms < best.iteration_ms:
        best = chunked
    return MinibatchReport(L, fast, best, peers, ran, chunked)


def schedule_of(report: MinibatchReport, profile: Profile, recompute: bool, dp) -> Schedule:
    """The schedule file of the report's best plan: its ops, its samples' sequences, the peers."""
    p = report.best
    baselines = {
        name: {
            "microbatches": None if q is None else len(q.ops[0]) // 2,
            "iteration_ms": None if q is None else q.timeline.iteration_ms,
        }
        for name, q in report.peers.items()
    }
    seconds = report.fast.planning_ms / 1e3 + report.search_s
    status = "searched" if p is not report.fast else "planned"
    return plan_schedule(p, profile, recompute, dp, status, seconds, baselines)


def plan_schedule(
    p: Plan,
    profile: Profile,
    recompute: bool = False,
    dp=None,
    status: str = "planned",
    seconds: Optional[float] = None,
    baselines: Optional[dict] = None,
) -> Schedule:
    """One minibatch's plan as a schedule (what ``umopt.Pipeline.step(plan=...)`` plays): its
    ops, and its samples' sequences in the ``lengths`` block."""
    sched = make_schedule(
        profile,
        len(p.layout.units),
        recompute,
        p.ops,
        p.timeline,
        {
            "name": "umopt-lengths",
            "status": status,
            "seconds": p.planning_ms / 1e3 if seconds is None else seconds,
        },
        baselines or {},
        dp,
        chunks=p.chunking,
        placement=placement_name(p.chunking.ranks, profile.num_stages) if p.chunking else "custom",
    )
    spec = LengthsSpec(
        mode=p.layout.mode,
        lengths=[int(x) for x in p.lengths],
        samples=[[int(i) for i in u] for u in p.layout.units],
        row=p.layout.row,
        pad_to=p.layout.pad_to,
    )
    return sched.model_copy(update={"lengths": spec})


@dataclass
class StreamReport:
    planned: int  # minibatches planned within the time limit
    asked: int
    tokens: list[int] = field(default_factory=list)  # each minibatch's real tokens
    ms: dict[str, list[Optional[float]]] = field(
        default_factory=dict
    )  # method: iteration ms (None: does not fit)
    planning_ms: dict[str, list[float]] = field(default_factory=dict)

    def tokens_per_s(self, method: str, among: Optional[set[int]] = None) -> Optional[float]:
        """Real tokens over the summed iteration times, over the minibatches ``method`` fits (and
        ``among``, where given)."""
        ks = [k for k, m in enumerate(self.ms[method]) if m is not None and (among is None or k in among)]
        return 1e3 * sum(self.tokens[k] for k in ks) / sum(self.ms[method][k] for k in ks) if ks else None

    def fits(self, method: str) -> set[int]:
        return {k for k, m in enumerate(self.ms[method]) if m is not None}


def solve_stream(
    profile: Profile,
    batches: Sequence[np.ndarray],
    time_limit: float,
    budget_ms: float = 15.0,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    chunks: Sequence[int] = (1,),
) -> StreamReport:
    """Every minibatch planned after the one before (see the module docstring), until the stream
    or ``time_limit`` ends. With ``chunks`` above 1, umopt's, padding's and packing's plans on
    several chunks per rank too, each method keeping the layout its plan of the first minibatch
    chose (as a pipeline keeps its modules)."""
    t0 = time.perf_counter()
    many = tuple(c for c in chunks if c > 1)
    out = StreamReport(0, len(batches))
    # each method on one chunk per rank, then each that has them on several
    columns = [(name, m, False) for name, m in METHODS.items()]
    columns += [(f"{name}, {CHUNKED}", m, True) for name, m in METHODS.items() if many and m.chunked]
    if many:  # imported before the clock of any plan runs (seconds on a CPU)
        load_torch_schedules()
    out.ms = {name: [] for name, _, _ in columns}
    out.planning_ms = {name: [] for name, _, _ in columns}
    on: dict[str, Chunking] = {}  # each multi-chunk method's layout, once its first plan chose it
    last: dict[str, Plan] = {}  # each method's last plan, where umopt's planner starts from
    margin = _MARGIN_S + (TORCH_EXIT_S if many else 0.0)
    for k, L in enumerate(batches):
        L = np.asarray(L, dtype=np.int64)
        _check(profile, L)
        if k and time.perf_counter() - t0 > time_limit - margin:
            break
        one = Request(profile, L, recompute, dp, budget_ms=budget_ms, seed=k)
        out.tokens.append(int(L.sum()))
        for name, m, several in columns:
            q = m.plan(
                one.but(previous=last.get(name), **({"chunks": many, "on": on.get(name)} if several else {}))
            )
            out.ms[name].append(None if q is None else q.iteration_ms)
            if q is not None:
                out.planning_ms[name].append(q.planning_ms)
                last[name] = q
                if several:
                    on.setdefault(name, q.chunking)
        out.planned = k + 1
        if progress:
            progress(k + 1, len(batches))
    return out
