"""The global minibatch across data-parallel replicas: which sequences each replica's pipeline
trains on, so that they finish together, before each replica's own plan.

With D replicas a step ends when the slowest pipeline's does (its gradients' all-reduce waits
for it). Torch's DistributedSampler, Megatron-LM and DeepSpeed give each replica a contiguous
D-th of the global minibatch, whatever its sequences cost. umopt assigns them by the predicted
step of each replica's pipeline ([Note: assigning sequences to replicas]); its peers at their
best (each followed by umopt's own planner on every replica, so that the assignment's gain is
apart from the planner's, :func:`plan_global`): contiguous (DistributedSampler), sorted and dealt
round-robin (snake order), greedy by tokens, greedy by WLB-LLM's workload (``b L + c L^2``,
Wang et al., OSDI'25), and Hydraulis's dispatch (Li et al., SIGMOD'26, from its code,
``examples/hydraulis/strategy/new_dynamic.py`` of PKU-DAIR/Hetu: the best of 100 shuffled greedy
passes, each sequence to the replica that keeps the largest of ``sum of costs + (S - 1) x the
largest cost`` least). :func:`lower_bound_ms` says how close to the best possible each is.

[Note: assigning sequences to replicas]
A replica's step with umopt's per-stage plan is its busiest stage's work on the sequences it
holds (each stage cuts its own chunks, so the work, not the chunks, sets it), and the pipeline's
fill and drain around it: a sequence is not cut, so the replica's heaviest sequence passes
through the other S - 1 stages before and after the busiest one's share (the term Hydraulis's
dispatch counts in full). The other sequences' work hides part of it, the more the shallower the
pipeline: umopt counts ``1 - 2 / S`` of it (at least a tenth; :func:`fill_share`). umopt takes each
sequence, heaviest first, to the replica where its busiest stage's work plus (S - 1) times that
share of its heaviest sequence's stays least, then moves or swaps sequences off the slowest
replica while that lowers it. (Counting all of it, as first built, gained 1.04-1.16x contiguous on
synthetic profiles of 2-16 stages where this share gains 1.07-1.18x, but on the 8-stage profile
the rule was first developed on, 1.13x against 1.12x; a bound by the larger of the busiest stage's
work and the longest sequence's path, tried before, 1.10x on chat at D=8; see docs/varlen.md.)
Work is a sequence's own part of the profile's costs by tokens (``b L + c L^2 + d`` a stage,
forward and backward; a chunk's fixed cost is the plan's to share out), in whole nanoseconds:
every rank that assigns a step's minibatch gets the same assignment, on any machine, without a
word exchanged. A replica with a very long sequence thus gets fewer others: the balance is of
predicted step time, not of tokens or work.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..costmodel import tables_for_lengths
from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from ..formats.replicas import REPLICAS_FORMAT, ReplicaPlan, ReplicasFile, ReplicasPredicted
from ..formats.schedule import ProfileRef
from .plan import Plan
from .solve_lengths import plan_schedule
from .solvers.per_step import plan

PASSES = 3  # the local search's moves, at most this many per replica
CANDIDATES, TARGETS = 16, 4  # a move's sequences (the worst's heaviest) and replicas (the least loaded)

__all__ = [
    "ASSIGNERS",
    "Assignment",
    "GlobalPlan",
    "GlobalReport",
    "assign",
    "check_assignment",
    "delay_outliers",
    "fill_share",
    "lower_bound_ms",
    "plan_global",
    "replicas_file",
    "solve_global",
    "work_of",
]


@dataclass
class Assignment:
    """Each replica's sequences (indices into the global minibatch's lengths, ascending), and
    what the assignment took; ``held``: outliers kept for a later step (outlier delay)."""

    method: str
    replicas: list[list[int]]
    seconds: float = 0.0
    held: list[int] = field(default_factory=list)


def work_of(profile: Profile, lengths, mode: str = "packed") -> tuple[np.ndarray, np.ndarray]:
    """(W, P): each sequence's own work on each stage, forward and backward, (sequences,
    stages), and its own path through every stage (each op's fixed cost counted), in whole
    nanoseconds (see [Note: assigning sequences to replicas])."""
    if profile.lengths is None:
        raise UmoptError("the profile has no costs by tokens (umopt profile --lengths)")
    mode = mode if mode in profile.lengths.modes else profile.lengths.modes[0]
    L = np.asarray(lengths, dtype=float)[:, None]
    costs = [st.tokens[mode] for st in profile.stages]
    b = np.array([c.forward.b_ms + c.backward.b_ms for c in costs])[None, :]
    c2 = np.array([c.forward.c_ms + c.backward.c_ms for c in costs])[None, :]
    d = np.array([c.forward.d_ms + c.backward.d_ms for c in costs])[None, :]
    a = np.array([c.forward.a_ms + c.backward.a_ms for c in costs])[None, :]
    own = b * L + c2 * L * L + d
    W = np.rint(own * 1e6).astype(np.int64)
    P = np.rint((own + a).sum(axis=1) * 1e6).astype(np.int64)
    return W, P


def fill_share(stages: int) -> float:
    """Of a replica's heaviest sequence's work on each other stage, the share its fill and drain
    add to the busiest stage's: ``1 - 2 / S``, at least 0.1 (see [Note: assigning sequences to
    replicas])."""
    return max(0.1, 1.0 - 2.0 / stages)


def _umopt(W: np.ndarray, P: np.ndarray, D: int) -> list[list[int]]:
    """See [Note: assigning sequences to replicas]."""
    G, S = W.shape
    # what a sequence adds to a replica's fill and drain per other stage: the share of its work on
    # its slowest stage that the other sequences' work does not hide (see the Note)
    c = np.rint(W.max(axis=1) * fill_share(S)).astype(np.int64)
    loads = np.zeros((D, S), dtype=np.int64)
    top = np.zeros(D, dtype=np.int64)  # each replica's largest such
    owner = np.empty(G, dtype=np.int64)
    grown = np.empty_like(loads)
    cand = np.empty(D, dtype=np.int64)
    fill = np.empty(D, dtype=np.int64)
    for i in np.lexsort((np.arange(G), -P, -c)):  # heaviest first (in place: a step's budget is ms)
        np.add(loads, W[i], out=grown)
        grown.max(axis=1, out=cand)
        np.maximum(top, c[i], out=fill)
        fill *= S - 1
        cand += fill
        r = int(cand.argmin())  # ties: the first replica (deterministic)
        loads[r] += W[i]
        if c[i] > top[r]:
            top[r] = c[i]
        owner[i] = r

    # moves and swaps off the slowest replica while they lower it, at most PASSES x D of them
    # (each lowers the largest bound: the result is the same on every machine, and a step's
    # assignment stays within milliseconds)
    for _ in range(PASSES * D):
        bounds = loads.max(axis=1) + (S - 1) * top
        worst = int(np.argmax(bounds))
        mine = np.flatnonzero(owner == worst)
        if len(mine) <= 1:
            break
        # the worst's heaviest sequences on its busiest stage, to the least loaded replicas: the
        # moves that can lower it most (all pairs cost a millisecond a replica at 64 sequences each)
        busiest = int(np.argmax(loads[worst]))
        mine = mine[np.argsort(-W[mine, busiest], kind="stable")[:CANDIDATES]]
        cm = c[mine]
        order = np.argsort(-cm, kind="stable")
        first, second = cm[order[0]], (cm[order[1]] if len(cm) > 1 else 0)
        rest = np.where(np.arange(len(mine)) == order[0], second, first)  # its heaviest without each
        stay = (loads[worst][None, :] - W[mine]).max(axis=1) + (S - 1) * rest  # (m,): worst without i
        best = (int(bounds[worst]), -1, -1, -1)  # (the larger new bound of the two, i, q, j)
        for q in (int(q) for q in np.argsort(bounds, kind="stable")[:TARGETS] if q != worst):
            go = (loads[q][None, :] + W[mine]).max(axis=1) + (S - 1) * np.maximum(top[q], cm)
            got = np.maximum(stay, go)
            k = int(np.argmin(got))
            if got[k] < best[0]:
                best = (int(got[k]), int(mine[k]), q, -1)
            others = np.flatnonzero(owner == q)
            if not len(others):
                continue
            co = c[others]
            o_order = np.argsort(-co, kind="stable")
            o1, o2 = co[o_order[0]], (co[o_order[1]] if len(co) > 1 else 0)
            o_rest = np.where(np.arange(len(others)) == o_order[0], o2, o1)
            # (i, j): i to q, j to worst
            w_new = (loads[worst][None, None, :] - W[mine][:, None, :] + W[others][None, :, :]).max(axis=2)
            w_new = w_new + (S - 1) * np.maximum(rest[:, None], co[None, :])
            q_new = (loads[q][None, None, :] - W[others][None, :, :] + W[mine][:, None, :]).max(axis=2)
            q_new = q_new + (S - 1) * np.maximum(o_rest[None, :], cm[:, None])
            pair = np.maximum(w_new, q_new)
            k = int(np.argmin(pair))
            ki, kj = divmod(k, len(others))
            if pair[ki, kj] < best[0]:
                best = (int(pair[ki, kj]), int(mine[ki]), q, int(others[kj]))
        _, i, q, j = best
        if i < 0:
            break
        loads[worst] -= W[i]
        loads[q] += W[i]
        owner[i] = q
        if j >= 0:
            loads[q] -= W[j]
            loads[worst] += W[j]
            owner[j] = worst
        for r in (worst, q):
            held = np.flatnonzero(owner == r)
            top[r] = int(c[held].max()) if len(held) else 0
    return [sorted(np.flatnonzero(owner == r).tolist()) for r in range(D)]


def _contiguous(W, P, D, L) -> list[list[int]]:
    return [c.tolist() for c in np.array_split(np.arange(len(P)), D)]


def _snake(W, P, D, L) -> list[list[int]]:
    """Sorted by length, longest first, dealt in snake order (0..D-1, D-1..0, ...)."""
    out: list[list[int]] = [[] for _ in range(D)]
    for k, i in enumerate(sorted(range(len(L)), key=lambda i: (-int(L[i]), i))):
        turn, pos = divmod(k, D)
        out[pos if turn % 2 == 0 else D - 1 - pos].append(i)
    return [sorted(x) for x in out]


def _greedy(weights: np.ndarray, D: int) -> list[list[int]]:
    """Heaviest first, each to the replica of least weight so far (LPT)."""
    load = np.zeros(D)
    out: list[list[int]] = [[] for _ in range(D)]
    for i in sorted(range(len(weights)), key=lambda i: (-float(weights[i]), i)):
        r = int(np.argmin(load))
        out[r].append(i)
        load[r] += weights[i]
    return [sorted(x) for x in out]


def _tokens(W, P, D, L) -> list[list[int]]:
    return _greedy(np.asarray(L, dtype=float), D)


def _wlb(W, P, D, L, profile: Profile) -> list[list[int]]:
    """WLB-LLM's workload, ``b L + c L^2`` summed over the stages (its packing's measure)."""
    costs = [st.tokens["packed" if "packed" in profile.lengths.modes else "padded"] for st in profile.stages]
    b = sum(c.forward.b_ms + c.backward.b_ms for c in costs)
    c2 = sum(c.forward.c_ms + c.backward.c_ms for c in costs)
    Lf = np.asarray(L, dtype=float)
    return _greedy(b * Lf + c2 * Lf * Lf, D)


def _hydraulis(W, P, D, L, trials: int = 100) -> list[list[int]]:
    """Hydraulis's dispatch (see the module docstring): a sequence's cost its time on the
    slowest stage, a replica's ``sum of its costs + (S - 1) x its largest``, the best of
    ``trials`` greedy passes over shuffled orders (its MINI_TRIAL_NUM, its seeds 0..99)."""
    cost = W.max(axis=1)
    S = W.shape[1]
    best, best_max = None, None
    for trial in range(trials):
        order = list(range(len(cost)))
        random.Random(trial).shuffle(order)
        acc = np.zeros(D, dtype=np.int64)
        warm = np.zeros(D, dtype=np.int64)
        out: list[list[int]] = [[] for _ in range(D)]
        top = 0
        for i in order:
            cand = np.maximum(top, acc + cost[i] + np.maximum(warm, cost[i] * (S - 1)))
            r = int(np.argmin(cand))
            acc[r] += cost[i]
            warm[r] = max(warm[r], cost[i] * (S - 1))
            top = max(top, int(acc[r] + warm[r]))
            out[r].append(i)
        if any(not x for x in out):
            continue  # a replica left empty: its rule refuses the trial
        if best_max is None or top < best_max:
            best, best_max = out, top
    if best is None:
        raise UmoptError(f"hydraulis: no trial gave each of {D} replicas a sequence")
    return [sorted(x) for x in best]


ASSIGNERS: dict[str, Callable] = {
    "umopt": lambda W, P, D, L, profile: _umopt(W, P, D),
    "contiguous": lambda W, P, D, L, profile: _contiguous(W, P, D, L),
    "round-robin": lambda W, P, D, L, profile: _snake(W, P, D, L),
    "tokens": lambda W, P, D, L, profile: _tokens(W, P, D, L),
    "wlb": lambda W, P, D, L, profile: _wlb(W, P, D, L, profile),
    "hydraulis": lambda W, P, D, L, profile: _hydraulis(W, P, D, L),
}


def check_assignment(name: str, flag: str) -> None:
    """``flag``'s ``name`` is one of :data:`ASSIGNERS`, else a one-line error naming both."""
    if name not in ASSIGNERS:
        raise UmoptError(f"{flag}: unknown {name!r}: one of {', '.join(ASSIGNERS)}")


def assign(profile: Profile, lengths, replicas: int, method: str = "umopt") -> Assignment:
    """The global minibatch ``lengths`` split among ``replicas`` by ``method`` (one of
    :data:`ASSIGNERS`); every replica gets at least one sequence."""
    L = np.asarray(lengths, dtype=np.int64)
    if method not in ASSIGNERS:
        raise UmoptError(f"unknown assignment {method!r}: one of {', '.join(ASSIGNERS)}")
    if replicas < 1 or len(L) < replicas:
        raise UmoptError(f"a global minibatch of {len(L)} sequences cannot feed {replicas} replicas")
    t0 = time.perf_counter()
    W, P = work_of(profile, L)
    got = ASSIGNERS[method](W, P, replicas, L, profile)
    seconds = time.perf_counter() - t0
    if any(not r for r in got):
        raise UmoptError(f"{method} left a replica without sequences (too few for {replicas} replicas)")
    return Assignment(method, got, seconds)


def lower_bound_ms(
    profile: Profile, lengths, replicas: int, recompute: bool = False, dp: Optional[AllReduceProfile] = None
) -> float:
    """No assignment's step is shorter: the larger of the longest sequence's own path and, for
    each stage, the mean replica's work on it spread perfectly, with the cheapest fill before and
    drain after (the spec's bound of one pipeline, docs/formats.md, for a replica of the mean
    work), each with the all-reduce and the optimizer step after; the least over the profile's
    modes (a replica's plan picks its own). Of plans of whole B ops, as the planner of sequences
    makes them (no W ops)."""
    return min(_bound(profile, lengths, replicas, mode, recompute, dp) for mode in profile.lengths.modes)


def _bound(profile: Profile, lengths, replicas: int, mode: str, recompute: bool, dp) -> float:
    L = np.asarray(lengths, dtype=np.int64)
    W, _ = work_of(profile, L, mode)
    one = tables_for_lengths(
        profile, [int(L.min())], mode, recompute, dp
    )  # the cheapest op: one shortest sequence
    own = W[int(np.argmin(L))] / 1e6  # its own work, of which each op's fixed cost is the rest
    r = one.ranged
    f, b = r.fwd[:, 0, 1], r.bwd[:, 0, 1]
    link = r.link[:, 0, 1] if profile.num_stages > 1 else np.zeros(0)
    ar = np.asarray(one.allreduce_ms, dtype=float)
    best = 0.0
    for s in range(profile.num_stages):
        fill = float(f[:s].sum() + link[:s].sum())
        tail = max(float(b[j:s].sum() + link[j:s].sum() + ar[j]) for j in range(s + 1))
        work = float(W[:, s].sum()) / replicas / 1e6 + float(f[s] + b[s] - own[s])  # at least one F and one B
        best = max(best, fill + work + tail)
    # the longest sequence's own path: forward through every stage, backward back, each message both ways
    big = tables_for_lengths(profile, [int(L.max())], mode, recompute, dp).ranged
    links = 2 * float(big.link[:, 0, 1].sum()) if profile.num_stages > 1 else 0.0
    path = float(big.fwd[:, 0, 1].sum() + big.bwd[:, 0, 1].sum()) + links
    return max(best, path + float(ar.min())) + one.optimizer_ms


@dataclass
class GlobalPlan:
    """An assignment and each replica's plan of its sequences: the step is the slowest's."""

    assignment: Assignment
    plans: list[Plan]
    lengths: np.ndarray

    @property
    def step_ms(self) -> float:
        return max(p.iteration_ms for p in self.plans)

    @property
    def mean_ms(self) -> float:
        return float(np.mean([p.iteration_ms for p in self.plans]))

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * float(self.lengths.sum()) / self.step_ms


def plan_global(
    profile: Profile,
    lengths,
    replicas: int,
    method: str = "umopt",
    budget_ms: float = 15.0,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    previous: Optional[Sequence[Plan]] = None,
) -> GlobalPlan:
    """``method``'s assignment, then umopt's plan of each replica's sequences (warm-started
    from ``previous``, that replica's last), each within ``budget_ms``."""
    L = np.asarray(lengths, dtype=np.int64)
    a = assign(profile, L, replicas, method)
    plans = []
    for r, seqs in enumerate(a.replicas):
        warm = previous[r] if previous is not None else None
        plans.append(plan(profile, L[seqs], budget_ms=budget_ms, recompute=recompute, dp=dp, previous=warm))
    return GlobalPlan(a, plans, L)


@dataclass
class GlobalReport:
    """Every assignment of one global minibatch, each replica planned by umopt
    (``umopt solve --lengths --dp D``), and the bound none can beat."""

    lengths: np.ndarray
    replicas: int
    plans: dict[str, GlobalPlan]
    lower_bound_ms: float

    @property
    def pick(self) -> str:
        return "umopt"


def solve_global(
    profile: Profile,
    lengths,
    replicas: int,
    budget_ms: float = 15.0,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    methods: Sequence[str] = tuple(ASSIGNERS),
) -> GlobalReport:
    """Each of ``methods``' assignment of ``lengths`` among ``replicas``, each replica then
    planned by umopt within ``budget_ms``."""
    L = np.asarray(lengths, dtype=np.int64)
    plans = {m: plan_global(profile, L, replicas, m, budget_ms, recompute, dp) for m in methods}
    return GlobalReport(L, replicas, plans, lower_bound_ms(profile, L, replicas, recompute, dp))


def replicas_file(report: GlobalReport, profile: Profile, recompute: bool, dp) -> ReplicasFile:
    """The replicas file of the report's pick: each replica's sequences and its plan."""
    g = report.plans[report.pick]
    return ReplicasFile(
        format=REPLICAS_FORMAT,
        profile=ProfileRef(path=profile.path or "", sha256=profile.sha256),
        lengths=[int(x) for x in report.lengths],
        method=report.pick,
        replicas=[
            ReplicaPlan(sequences=seqs, plan=plan_schedule(p, profile, recompute, dp))
            for seqs, p in zip(g.assignment.replicas, g.plans)
        ],
        predicted=ReplicasPredicted(
            step_ms=g.step_ms,
            replica_ms=[p.iteration_ms for p in g.plans],
            lower_bound_ms=report.lower_bound_ms,
        ),
        baselines={m: q.step_ms for m, q in report.plans.items() if m != report.pick},
    )


def delay_outliers(batches: Sequence, threshold: int, most: int, group: int) -> tuple[list[np.ndarray], int]:
    """WLB-LLM's outlier delay on a stream of global minibatches (off by default: it changes the
    data's order): a sequence longer than ``threshold`` waits in a queue until ``group`` of them
    wait (one for each replica: released together, the assignment gives each replica one), the
    oldest first, and at most ``most`` steps (one that has waited ``most`` goes now, with as many
    others as keep a multiple of ``group`` where the queue has them); every sequence is trained
    once, the last step takes what is left. Returns the minibatches as trained, and how many
    sequences waited."""
    waiting: list[tuple[int, int]] = []  # (length, steps waited), the oldest first
    out, delayed = [], 0
    for k, b in enumerate(np.asarray(x, dtype=np.int64) for x in batches):
        waiting += [(int(x), 0) for x in b if x > threshold]
        due = sum(1 for _, w in waiting if w >= most)
        take = len(waiting) // group * group
        if due > take:
            take = min(len(waiting), -(-due // group) * group)
        if k == len(batches) - 1:
            take = len(waiting)
        now, later = waiting[:take], waiting[take:]
        delayed += sum(1 for _, w in later if w == 0)  # each sequence counted once, when it first waits
        waiting = [(n, w + 1) for n, w in later]
        out.append(np.array([int(x) for x in b if x <= threshold] + [n for n, _ in now], dtype=np.int64))
    return out, delayed
