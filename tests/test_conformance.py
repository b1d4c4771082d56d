"""One conformance suite for every implementation of the cost model (docs/formats.md, "Cost model").

The reference simulator (:func:`umopt.costmodel.simulate`) is the single source of predicted
times; every other copy of the model must time a given schedule as it does: the population
evaluators (numpy, and compiled where built) and the exact models (CP-SAT in GPipe and in free
order, with and without W ops; the MILP in GPipe and in free order). An exact model is checked
by pinning its variables to the schedule (its partitions, and in free order each stage's op
order) and minimising: its optimum is then that schedule's makespan. Sizes are those people
solve (4 and 8 stages, minibatches up to 64), with recompute, W ops, a memory limit, the
runtime's per-op and per-message costs and data-parallel replicas.

The cost tables are rounded to whole microseconds first, so the CP-SAT models (integer
microseconds, durations rounded down) are compared exactly, not within a rounding allowance.
Adding an implementation of the model (a new schedule family's evaluator, say) means adding it
to :data:`IMPLEMENTATIONS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest

from umopt.costmodel import CostTables, simulate
from umopt.errors import UmoptError
from umopt.formats.profile import AllReduceProfile
from umopt.search.problem import Candidate, Problem
from umopt.synthetic import synthetic_profile


@dataclass(frozen=True)
class Case:
    S: int
    B: int
    mx: int
    order: str  # "gpipe" or "1f1b" (random per-stage warm-ups)
    recompute: bool = False
    weights: bool = False  # every stage's backward split, a W op per B chunk
    memory: Optional[str] = None  # None, "fits" (the schedule's own peak) or "short" (a byte under it)
    overhead: float = 0.0
    replicas: int = 1
    seed: int = 0
    lengths: Optional[str] = None  # sequences of different lengths, drawn from this sampler
    mode: str = "packed"
    work: bool = (
        False  # ops' and the optimizer step's temporaries ([Note: what an op allocates while it runs])
    )

    @property
    def id(self) -> str:
        parts = [f"S{self.S}", f"B{self.B}", f"mx{self.mx}", self.order]
        parts += [f"{self.lengths}-{self.mode}"] if self.lengths else []
        parts += [k for k in ("recompute", "weights", "work") if getattr(self, k)]
        parts += [f"mem-{self.memory}"] if self.memory else []
        parts += ["overhead"] if self.overhead else []
        parts += [f"dp{self.replicas}"] if self.replicas > 1 else []
        return "-".join(parts + [f"seed{self.seed}"])


CASES = [
    Case(4, 16, 8, "gpipe", seed=1),
    Case(4, 32, 16, "1f1b", seed=2),
    Case(8, 64, 16, "1f1b", seed=3),
    Case(8, 64, 32, "gpipe", overhead=0.37, replicas=4, seed=4),
    Case(4, 32, 16, "gpipe", recompute=True, seed=5),
    Case(4, 24, 8, "1f1b", recompute=True, overhead=0.2, seed=6),
    Case(4, 24, 8, "1f1b", weights=True, seed=7),
    Case(8, 32, 8, "gpipe", weights=True, replicas=2, seed=8),
    Case(4, 24, 8, "1f1b", memory="fits", seed=9),
    Case(4, 24, 8, "1f1b", memory="short", seed=10),
    Case(4, 16, 8, "gpipe", recompute=True, memory="fits", seed=11),
    Case(4, 16, 8, "gpipe", recompute=True, memory="short", seed=13),
    Case(4, 16, 8, "gpipe", memory="short", seed=14),
    Case(4, 16, 8, "1f1b", weights=True, memory="fits", seed=12),
    # sequences of different lengths: every cost by sample range ([Note: costs by sample range])
    Case(4, 24, 24, "1f1b", lengths="chat", seed=21),
    Case(4, 24, 24, "gpipe", lengths="long-context", mode="padded", seed=22),
    Case(4, 16, 16, "1f1b", recompute=True, lengths="chat", overhead=0.2, seed=23),
    Case(4, 16, 16, "1f1b", weights=True, lengths="lmsys", seed=24),
    Case(8, 32, 16, "gpipe", weights=True, lengths="instruction", mode="padded", replicas=2, seed=25),
    Case(4, 16, 16, "gpipe", recompute=True, weights=True, lengths="chat", seed=26),
    Case(4, 24, 24, "1f1b", lengths="chat", memory="fits", seed=27),
    Case(4, 24, 24, "1f1b", lengths="long-context", mode="padded", memory="short", seed=28),
    # what ops allocate while they run, on top of what they keep
    Case(4, 24, 8, "1f1b", memory="short", work=True, seed=31),
    Case(4, 16, 8, "gpipe", recompute=True, memory="fits", work=True, seed=32),
    Case(4, 16, 8, "1f1b", weights=True, memory="short", work=True, seed=33),
    Case(4, 24, 24, "gpipe", lengths="chat", memory="short", work=True, seed=34),
]


def _us(a: Optional[np.ndarray]) -> Optional[np.ndarray]:
    if a is None:
        return None
    out = np.round(a, 3)
    out.setflags(write=False)
    return out


def _partition(rng, total: int, mx: int) -> list[int]:
    parts = []
    while total:
        b = int(rng.integers(1, min(total, mx) + 1))
        parts.append(b)
        total -= b
    return parts


def _lengths_tables(case: Case, rng, dp) -> CostTables:
    """A transformer's costs by tokens (bfloat16 on a GPU), for a minibatch drawn from the case's sampler."""
    from umopt.costmodel import tables_for_lengths
    from umopt.samplers import minibatches
    from umopt.synthetic import synthetic_token_profile

    prof = synthetic_token_profile(case.S, blocks=2 * case.S, op_ms=0.05 + case.overhead, max_length=32768)
    stages = [
        st.model_copy(update={"param_bytes": int(rng.integers(1 << 20, 1 << 26))}) for st in prof.stages
    ]
    prof = prof.model_copy(update={"stages": stages})
    lengths = minibatches(case.lengths, 1, case.B, seed=case.seed)[0]
    return tables_for_lengths(prof, lengths, case.mode, case.recompute, dp)


def make_case(case: Case) -> tuple[Problem, Candidate]:
    """The problem (tables in whole microseconds) and a random schedule of the case's kind."""
    rng = np.random.default_rng(case.seed)
    prof = synthetic_profile(
        case.S,
        max_size=case.mx,
        seed=case.seed,
        latency_ms=0.05,
        bytes_per_ms=float(rng.uniform(1e4, 1e6)),
        op_overhead_ms=case.overhead,
        message_overhead_ms=case.overhead / 2,
        param_bytes=list(rng.integers(1 << 20, 1 << 26, case.S)),
    )
    dp = (
        AllReduceProfile(
            replicas=case.replicas, latency_ms=0.2, bus_bytes_per_ms=float(rng.uniform(1e5, 1e6))
        )
        if case.replicas > 1
        else None
    )
    t = CostTables.from_profile(prof, case.recompute, dp)
    if case.lengths:
        t = _lengths_tables(case, rng, dp)
    t = dataclasses.replace(
        t,
        fwd=_us(t.fwd),
        bwd=_us(t.bwd),
        link=_us(t.link),
        allreduce_ms=_us(t.allreduce_ms),
        bwd_input=_us(t.bwd_input),
        bwd_weight=_us(t.bwd_weight),
        optimizer_ms=round(t.optimizer_ms, 3),
    )
    S, B = case.S, case.B
    if case.work:  # temporaries about the size of what a few samples (or tokens) keep
        unit = (
            t.stash_bytes if t.ranged is None else t.ranged.stash[:, 0, B] // int(t.ranged.range_tokens[0, B])
        )
        t = dataclasses.replace(
            t,
            work_bytes=rng.integers(0, 4 * unit + 1),
            work_per_unit=rng.integers(0, 2 * unit + 1),
            optimizer_work_bytes=rng.integers(0, t.static_bytes // 2 + 1),
        )
    fs = [_partition(rng, B, case.mx) for _ in range(S)]
    bs = [_partition(rng, B, case.mx) for _ in range(S)] if case.recompute else fs
    warm = [int(w) for w in rng.integers(0, B + 1, S)] if case.order == "1f1b" else None
    # W ops: every B chunk's W, each stage holding back a random number of them (wcap)
    wcap = [int(c) for c in rng.integers(0, B + 1, S)] if case.weights else None
    cand = Candidate(fs, bs, case.order, warmup=warm, wcap=wcap)
    problem = Problem(t, B)
    if case.memory:
        peak = max(np.asarray(simulate(t, cand.ops(), B).peak_memory_bytes) - t.static_bytes)
        limit = int(t.static_bytes.max() + peak) if case.memory == "fits" else None
        if case.memory == "short":  # a byte under the stage that needs the most room
            s = int(np.argmax(np.asarray(simulate(t, cand.ops(), B).peak_memory_bytes) - t.static_bytes))
            limit = int(simulate(t, cand.ops(), B).peak_memory_bytes[s]) - 1
            t = dataclasses.replace(t, static_bytes=np.full(S, t.static_bytes[s]))
        problem = Problem(dataclasses.replace(t, memory_limit=limit), B)
    return problem, cand


def reference_ms(problem: Problem, cand: Candidate) -> Optional[float]:
    """The simulator's iteration, or None where the schedule does not fit the memory limit."""
    tl = simulate(problem.tables, cand.ops(), problem.minibatch)
    limit = problem.memory_limit
    if limit is not None and max(tl.peak_memory_bytes) > limit:
        return None
    return tl.iteration_ms


# --- the implementations ---------------------------------------------------------------------------
# each: (problem, candidate) -> iteration ms, None where the schedule does not fit the memory
# limit


def _population(compiled: bool) -> Callable[[Problem, Candidate], Optional[float]]:
    def run(problem: Problem, cand: Candidate) -> Optional[float]:
        import umopt.schedules.population_sim as vec
        from umopt.schedules.population_sim import evaluate_1f1b, evaluate_gpipe

        if compiled and vec._compiled is None:
            pytest.skip("the compiled evaluators were not built")
        t, S = problem.tables, problem.num_stages
        width = max(len(p) for p in cand.fsizes + cand.bsizes)
        pad = lambda parts: np.array([[p + [0] * (width - len(p)) for p in parts]])  # noqa: E731
        fs, bs = pad(cand.fsizes), pad(cand.bsizes) if problem.recompute else None
        wcap = np.array([cand.wcap]) if cand.wcap is not None else None
        saved = vec._compiled
        if not compiled:
            vec._compiled = None
        try:
            if cand.order == "gpipe":
                score = evaluate_gpipe(t, fs, bs, wcap=wcap)
            else:
                score = evaluate_1f1b(t, fs, np.array([cand.warmups]), bs, wcap=wcap)
        finally:
            vec._compiled = saved
        ms = float(score.iteration_ms[0])
        if problem.memory_limit is not None and (score.peak_memory_bytes[0] > problem.memory_limit).any():
            return None
        assert np.isfinite(ms) and S == score.busy_ms.shape[1]
        return ms

    return run


def _restrict_chunks(monkeypatch, module, cand: Candidate) -> None:
    """Pinning by construction: the model's candidate chunks are the schedule's own (every other
    chunk's variable would be pinned to 0, which switches off each of its constraints), so a model
    of a 64-sample minibatch builds in a second."""
    chunks = sorted({c for parts in cand.fsizes + cand.bsizes for c in _chunks(parts)})
    monkeypatch.setattr(module, "candidate_chunks", lambda problem: chunks)


def _chunks(parts: list[int]) -> list[tuple[int, int]]:
    ends = np.cumsum([0, *parts])
    return [(int(a), int(b)) for a, b in zip(ends, ends[1:])]


def _durations(problem: Problem, s: int, weights: bool) -> dict[str, np.ndarray]:
    t = problem.tables
    return {
        "F": t.fwd[s],
        "B": (t.bwd_input if weights else t.bwd)[s],
        "W": t.bwd_weight[s] if weights else None,
    }


def _cpsat(order: str) -> Callable:
    def run(problem: Problem, cand: Candidate, monkeypatch) -> Optional[float]:
        from ortools.sat.python import cp_model

        import umopt.search.solvers.cpsat as cpsat

        weights = cand.wcap is not None
        _restrict_chunks(monkeypatch, cpsat, cand)
        horizon = cpsat._us(1e6)
        if order == "gpipe":
            m, x, y, makespan = cpsat.build_gpipe_model(problem, horizon)
            starts = None
        else:
            m, x, y, fstart, bstart, makespan, wstart = cpsat.build_free_model(
                problem, horizon, weights=weights
            )
            starts = {"F": fstart, "B": bstart, "W": wstart}
        ops = cand.ops()
        for s in range(problem.num_stages):
            fch, bch = set(_chunks(cand.fsizes[s])), set(_chunks(cand.bsizes[s]))
            for c in x[s]:
                m.add(x[s][c] == int(c in fch))
                if problem.recompute:
                    m.add(y[s][c] == int(c in bch))
            if starts is not None:  # each stage's op order as the schedule has it
                dur = _durations(problem, s, weights)
                for a, b in zip(ops[s], ops[s][1:]):
                    m.add(
                        starts[b.kind][s][(b.lo, b.hi)]
                        >= starts[a.kind][s][(a.lo, a.hi)] + cpsat._us(dur[a.kind][a.hi - a.lo])
                    )
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = 60
        solver.parameters.num_workers = 2
        status = solver.solve(m)
        if status == cp_model.INFEASIBLE:
            return None
        assert status == cp_model.OPTIMAL, solver.status_name(status)
        return solver.objective_value / 1000 + problem.tables.optimizer_ms

    return run


def _milp(order: str) -> Callable:
    def run(problem: Problem, cand: Candidate, monkeypatch) -> Optional[float]:
        import pulp

        import umopt.search.solvers.milp as milp

        _restrict_chunks(monkeypatch, milp, cand)
        if order == "gpipe":
            lp, x, y, makespan = milp.build_milp(problem, 1e5)
            starts = None
        else:
            lp, x, y, fstart, bstart, makespan = milp.build_free_milp(problem, 1e5)
            starts = {"F": fstart, "B": bstart}
        ops = cand.ops()
        for s in range(problem.num_stages):
            fch, bch = set(_chunks(cand.fsizes[s])), set(_chunks(cand.bsizes[s]))
            for c in x[s]:
                lp += x[s][c] == int(c in fch)
                if problem.recompute:
                    lp += y[s][c] == int(c in bch)
            if starts is not None:
                dur = _durations(problem, s, False)
                for a, b in zip(ops[s], ops[s][1:]):
                    lp += starts[b.kind][s][(b.lo, b.hi)] >= starts[a.kind][s][(a.lo, a.hi)] + float(
                        dur[a.kind][a.hi - a.lo]
                    )
        lp.solve(milp._solver(60, warm=False))
        if pulp.LpStatus[lp.status] == "Infeasible":
            return None
        assert pulp.LpStatus[lp.status] == "Optimal", pulp.LpStatus[lp.status]
        return float(makespan.value()) + problem.tables.optimizer_ms

    return run


def _reference(problem: Problem, cand: Candidate) -> Optional[float]:
    return reference_ms(problem, cand)


def _exact_covers(solver: str, order: str, case: Case) -> bool:
    """Whether an exact model times ``case``: they cost chunks by size (no sequences of different
    lengths yet), relax the ops' temporaries under a memory limit (their bounds stay bounds); the
    GPipe models time GPipe order, CP-SAT's without W ops and the MILP none with them; the
    free-order MILP has no memory limit (CP-SAT's free model has)."""
    if case.lengths or (case.memory and case.work):
        return False
    if order == "gpipe" and (case.order != "gpipe" or case.weights):
        return False
    if solver == "cpsat":
        return not (case.weights and case.recompute)
    return not case.weights and not (order == "free" and case.memory)


IMPLEMENTATIONS = {
    "simulate": (lambda p, c, _m: _reference(p, c), lambda case: True),
    "numpy": (lambda p, c, _m: _population(False)(p, c), lambda case: True),
    "compiled": (lambda p, c, _m: _population(True)(p, c), lambda case: True),
    **{
        f"{solver}-{order}": (
            (_cpsat if solver == "cpsat" else _milp)(order),
            lambda case, solver=solver, order=order: _exact_covers(solver, order, case),
        )
        for solver in ("cpsat", "milp")
        for order in ("gpipe", "free")
    },
}
# the float models (the MILP) are solved to a tolerance; the others are exact in whole microseconds
TOLERANCE_MS = {"milp-gpipe": 1e-3, "milp-free": 1e-3}
# only the cases an implementation covers: every test here runs (the compiled evaluators aside,
# where the machine could not build them)
PAIRS = [(impl, case) for impl, (_, covers) in IMPLEMENTATIONS.items() for case in CASES if covers(case)]


@pytest.mark.parametrize("impl,case", PAIRS, ids=[f"{c.id}-{i}" for i, c in PAIRS])
def test_every_implementation_times_a_schedule_as_the_simulator_does(impl, case, monkeypatch):
    problem, cand = make_case(case)
    want = reference_ms(problem, cand)
    if case.memory == "short":
        assert want is None  # the case is built to be a byte over
    elif case.memory == "fits":
        assert want is not None
    got = IMPLEMENTATIONS[impl][0](problem, cand, monkeypatch)
    if want is None:
        assert got is None, f"{impl} accepts a schedule a byte over the memory limit ({got} ms)"
        return
    assert got is not None, f"{impl} refuses a schedule that fits the memory limit"
    assert abs(got - want) <= TOLERANCE_MS.get(impl, 1e-6), f"{impl}: {got} ms, the simulator {want} ms"


def test_a_deadlocking_order_is_an_error_in_the_simulator():
    from umopt.costmodel import Op

    problem, _ = make_case(Case(2, 4, 4, "gpipe"))
    ops = [
        [Op("F", 0, 4), Op("B", 0, 4)],
        [Op("B", 0, 4), Op("F", 0, 4)],
    ]  # stage 1 backwards before its forward
    with pytest.raises(UmoptError):
        simulate(problem.tables, ops, 4)
