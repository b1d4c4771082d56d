"""Solvers: GA finds the brute-force optimum on tiny instances; baselines and bound behave."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from umopt.baselines import gpipe_equal, lower_bound, min_work, onef1b_equal
from umopt.costmodel import CostTables
from umopt.problem import Candidate, Problem
from umopt.solvers import SOLVERS
from umopt.solvers.dp import shared_partition
from umopt.synthetic import synthetic_profile


def compositions(n, mx):
    if n == 0:
        yield []
        return
    for b in range(1, min(n, mx) + 1):
        for rest in compositions(n - b, mx):
            yield [b] + rest


def brute_force(problem: Problem) -> float:
    """Best schedule over every per-stage (forward, backward) partition pair, in GPipe order and,
    without recompute, in 1F1B order (the GA's search space), each scored by the simulator."""
    S, B = problem.num_stages, problem.minibatch
    parts = list(compositions(B, problem.max_size))
    per_stage = list(itertools.product(parts, parts)) if problem.recompute else [(p, p) for p in parts]
    orders = ["gpipe"] if problem.recompute else ["gpipe", "1f1b"]
    best = np.inf
    for combo in itertools.product(per_stage, repeat=S):
        for order in orders:
            cand = Candidate([f for f, _ in combo], [b for _, b in combo], order)
            best = min(best, cand.simulate(problem).iteration_ms)
    return best


TINY = [(2, 5, False, 1), (3, 5, False, 2), (3, 4, False, 3), (2, 4, True, 4), (3, 3, True, 5)]


@pytest.mark.parametrize("S,B,recompute,seed", TINY)
def test_ga_finds_brute_force_optimum(S, B, recompute, seed):
    prof = synthetic_profile(S, max_size=4, seed=seed, latency_ms=0.3, bytes_per_ms=2e5)
    problem = Problem(CostTables.from_profile(prof, recompute), B)
    best = brute_force(problem)
    res = SOLVERS["ga"](problem, time_limit=10, seed=0, stall_generations=60, max_restarts=0)
    got = res.candidate.simulate(problem).iteration_ms
    assert got == pytest.approx(best, abs=1e-9)
    assert lower_bound(problem) <= best + 1e-9


@pytest.mark.parametrize("S,B,recompute", [(4, 32, False), (4, 24, True), (8, 64, False)])
def test_every_solver_gives_a_valid_schedule_never_below_the_bound(S, B, recompute):
    prof = synthetic_profile(S, max_size=16, seed=S + B)
    problem = Problem(CostTables.from_profile(prof, recompute), B)
    lb = lower_bound(problem)
    gp = gpipe_equal(problem).iteration_ms
    for name, solve in SOLVERS.items():
        res = solve(problem, time_limit=1.5, seed=1)
        it = res.candidate.simulate(problem).iteration_ms
        assert it >= lb - 1e-9, name
        if name in ("auto", "ga", "equal"):
            assert it <= gp + 1e-9, name  # seeded with / containing the best equal GPipe schedule


def test_auto_beats_equal_on_heterogeneous_stages():
    prof = synthetic_profile(4, max_size=64, overhead_ms=[0.2, 3.0, 0.2, 2.0], per_sample_ms=[0.8, 0.2, 0.8, 0.3])
    problem = Problem(CostTables.from_profile(prof), 64)
    res = SOLVERS["auto"](problem, time_limit=3, seed=0)
    assert res.candidate.simulate(problem).iteration_ms < 0.97 * gpipe_equal(problem).iteration_ms


def test_ga_is_reproducible_with_a_seed():
    prof = synthetic_profile(3, max_size=16, seed=7)
    problem = Problem(CostTables.from_profile(prof), 24)
    a = SOLVERS["ga"](problem, time_limit=30, seed=5, max_generations=40)
    b = SOLVERS["ga"](problem, time_limit=30, seed=5, max_generations=40)
    assert a.candidate.fsizes == b.candidate.fsizes


def test_equal_baselines_pick_the_best_m():
    prof = synthetic_profile(3, max_size=16, seed=1)
    problem = Problem(CostTables.from_profile(prof), 16)
    gp = gpipe_equal(problem)
    for m in range(1, 17):
        sizes = [16 // m + (i < 16 % m) for i in range(m)]
        if max(sizes) <= 16:
            assert Candidate.uniform(sizes, 3).simulate(problem).iteration_ms >= gp.iteration_ms - 1e-9
    of = onef1b_equal(problem)
    assert of.microbatches >= 3


def test_min_work_knapsack():
    cost = np.array([0.0, 1.0, 1.5, 10.0])  # sizes 1..3
    assert min_work(cost, 4) == pytest.approx(3.0)  # 2 + 2
    assert min_work(cost, 3) == pytest.approx(2.5)  # 2 + 1


def test_dp_minimises_the_terapipe_estimate():
    prof = synthetic_profile(4, max_size=8, seed=2)
    problem = Problem(CostTables.from_profile(prof), 12)
    t = (problem.tables.fwd + problem.tables.bwd).max(axis=0)

    def estimate(parts):
        c = [t[b] for b in parts]
        return sum(c) + 3 * max(c)

    best = min(estimate(p) for p in compositions(12, 8))
    assert estimate(shared_partition(problem)) == pytest.approx(best)


def test_memory_limit_is_respected_by_baselines_and_ga():
    prof = synthetic_profile(2, max_size=8, seed=3)
    t = CostTables.from_profile(prof, True)
    # recompute: peak = static + held inputs + running chunk x stash, so the limit caps the chunks
    # that run while most samples are held (the last F and the first B) at 3 samples
    limit = int(t.static_bytes.max() + 16 * t.input_bytes.max() + 3 * t.stash_bytes.max())
    free = Problem(t, 16)
    unlimited = SOLVERS["auto"](free, time_limit=1, seed=0).candidate.simulate(free)
    assert max(unlimited.peak_memory_bytes) > limit  # the limit binds
    problem = Problem(CostTables.from_profile(prof.with_memory_limit(limit), True), 16)
    for name in ("auto", "ga", "greedy", "dp", "equal"):
        res = SOLVERS[name](problem, time_limit=1, seed=0)
        tl = res.candidate.simulate(problem)
        assert max(tl.peak_memory_bytes) <= limit, name


def _microsecond_profile(S, seed):
    """Costs in whole microseconds, so that the exact model's integer times are exact."""
    prof = synthetic_profile(S, max_size=4, seed=seed)
    return prof.model_copy(
        update={
            "stages": [st.model_copy(update={"forward_ms": [round(v, 3) for v in st.forward_ms], "backward_ms": [round(v, 3) for v in st.backward_ms]}) for st in prof.stages],
            "links": [ln.model_copy(update={"latency_ms": 0.3, "bytes_per_ms": 65536 * 1000.0}) for ln in prof.links],
        }
    )


def brute_force_gpipe(problem: Problem) -> float:
    parts = list(compositions(problem.minibatch, problem.max_size))
    per_stage = list(itertools.product(parts, parts)) if problem.recompute else [(p, p) for p in parts]
    return min(
        Candidate([f for f, _ in c], [b for _, b in c], "gpipe").simulate(problem).iteration_ms
        for c in itertools.product(per_stage, repeat=problem.num_stages)
    )


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
@pytest.mark.parametrize("S,B,recompute,seed", [(2, 5, False, 1), (3, 5, False, 2), (2, 6, False, 3), (2, 4, True, 4), (3, 3, True, 5)])
def test_exact_models_prove_the_brute_force_gpipe_optimum(solver, S, B, recompute, seed):
    problem = Problem(CostTables.from_profile(_microsecond_profile(S, seed), recompute), B)
    best = brute_force_gpipe(problem)
    res = SOLVERS[solver](problem, time_limit=10, seed=0)
    assert res.status == "optimal" and res.candidate.order == "gpipe"
    assert res.candidate.simulate(problem).iteration_ms == pytest.approx(best, abs=1e-6)
    assert res.lower_bound_ms <= best + 1e-9
    assert res.lower_bound_ms == pytest.approx(best, abs=S * 2 * B * 1e-3)  # within the microsecond rounding


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
@pytest.mark.parametrize("seed", [11, 12])
def test_exact_bounds_never_exceed_any_gpipe_schedule_found(solver, seed):
    prof = synthetic_profile(3, max_size=8, seed=seed, latency_ms=0.2, bytes_per_ms=1e5)
    problem = Problem(CostTables.from_profile(prof), 12)
    res = SOLVERS[solver](problem, time_limit=3, seed=0)
    found = [res.candidate.simulate(problem).iteration_ms, gpipe_equal(problem).iteration_ms]
    found.append(SOLVERS["ga"](problem, time_limit=1, seed=1, orders=("gpipe",)).candidate.simulate(problem).iteration_ms)
    assert res.lower_bound_ms <= min(found) + 1e-9


def test_auto_restricted_to_gpipe_reports_the_exact_models_proof():
    problem = Problem(CostTables.from_profile(_microsecond_profile(2, 1)), 5)
    res = SOLVERS["auto"](problem, time_limit=6, seed=0, order="gpipe")
    best = brute_force_gpipe(problem)
    assert res.status == "optimal" and res.extra["bound_scope"] == "gpipe order"
    assert res.candidate.simulate(problem).iteration_ms == pytest.approx(best, abs=1e-6)
    assert res.lower_bound_ms <= best + 1e-9
    # searching both orders, a GPipe-only proof says nothing about 1F1B schedules
    assert SOLVERS["auto"](problem, time_limit=2, seed=0).status == "feasible"
