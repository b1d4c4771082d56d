"""Solvers: GA finds the brute-force optimum on tiny instances; baselines and solvers keep their
limits and report their bounds (the bounds themselves: tests/test_bounds.py)."""

from __future__ import annotations

import itertools
import subprocess
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umopt.costmodel import CostTables, simulate
from umopt.errors import UmoptError
from umopt.formats.profile import AllReduceProfile, load_profile
from umopt.schedules.family import GPIPE, ONEF1B
from umopt.schedules.partition import chunks, equal_sizes
from umopt.schedules.population_sim import evaluate_1f1b
from umopt.search.baselines import gpipe_equal, onef1b_equal
from umopt.search.bounds import (
    fast_bound_ms,
    spec_bound,
)
from umopt.search.bounds.fast import min_work
from umopt.search.problem import Candidate, Problem, pack, ticking
from umopt.search.solvers import SOLVERS
from umopt.search.solvers.dp import shared_partition
from umopt.search.solvers.local import aligned_moves, hill_climb, iterated_climb
from umopt.search.solvers.ramp import ramped_partitions
from umopt.synthetic import synthetic_profile


def compositions(n, mx):
    if n == 0:
        yield []
        return
    for b in range(1, min(n, mx) + 1):
        for rest in compositions(n - b, mx):
            yield [b] + rest


def brute_force(problem: Problem, warmups: bool = True) -> float:
    """Best schedule over every per-stage (forward, backward) partition pair, in GPipe order and
    in 1F1B order with every per-stage warm-up (the GA's search space; only PipeDream-flush's
    with ``warmups=False``). GPipe order is scored by the simulator; the 1F1B family, too large
    for it, by the vectorized evaluator (itself tested against the simulator)."""
    S, B = problem.num_stages, problem.minibatch
    parts = list(compositions(B, problem.max_size))
    per_stage = list(itertools.product(parts, parts)) if problem.recompute else [(p, p) for p in parts]
    best = np.inf
    for combo in itertools.product(per_stage, repeat=S):
        best = min(
            best,
            Candidate([f for f, _ in combo], [b for _, b in combo], "gpipe").simulate(problem).iteration_ms,
        )
    frows, brows, wus = [], [], []
    for combo in itertools.product(per_stage, repeat=S):
        ranges = [range(len(f) + 1) for f, _ in combo] if warmups else [[S - 1 - s] for s in range(S)]
        for w in itertools.product(*ranges):
            frows.append([f for f, _ in combo])
            brows.append([b for _, b in combo])
            wus.append(w)
    for i in range(0, len(frows), 20_000):
        sl = slice(i, i + 20_000)
        sc = evaluate_1f1b(problem.tables, pack(frows[sl]), np.array(wus[sl]), pack(brows[sl]))
        best = min(best, float(sc.iteration_ms.min()))
    return best


TINY = [(2, 5, False, 1), (3, 5, False, 2), (3, 4, False, 3), (2, 4, True, 4), (3, 3, True, 5)]


@pytest.mark.parametrize("S,B,recompute,seed", TINY)
def test_ga_finds_brute_force_optimum(S, B, recompute, seed):
    prof = synthetic_profile(S, max_size=4, seed=seed, latency_ms=0.3, bytes_per_ms=2e5)
    problem = Problem(CostTables.from_profile(prof, recompute), B)
    best = brute_force(problem)
    res = SOLVERS["ga"](problem, time_limit=10, seed=0, stall_generations=60, max_restarts=2, polish_kicks=50)
    got = res.candidate.simulate(problem).iteration_ms
    assert got == pytest.approx(best, abs=1e-9)
    assert spec_bound(problem) <= best + 1e-9


@pytest.mark.parametrize("S,B,recompute", [(4, 32, False), (4, 24, True), (8, 64, False)])
def test_every_solver_gives_a_valid_schedule_never_below_the_bound(S, B, recompute):
    prof = synthetic_profile(S, max_size=16, seed=S + B)
    problem = Problem(CostTables.from_profile(prof, recompute), B)
    lb = spec_bound(problem)
    gp = gpipe_equal(problem).iteration_ms
    for name, solve in SOLVERS.items():
        if name in ("cpsat", "milp") and S * B > 128:
            continue  # building their models alone takes longer than this test should
        res = solve(problem, time_limit=0.75, seed=1)  # (what is checked holds whatever they find)
        it = res.candidate.simulate(problem).iteration_ms
        assert it >= lb - 1e-9, name
        if name in ("auto", "ga", "equal", "ramp"):
            assert it <= gp + 1e-9, name  # seeded with / containing the best equal GPipe schedule


def test_auto_beats_equal_on_heterogeneous_stages():
    prof = synthetic_profile(
        4, max_size=64, overhead_ms=[0.2, 3.0, 0.2, 2.0], per_sample_ms=[0.8, 0.2, 0.8, 0.3]
    )
    problem = Problem(CostTables.from_profile(prof), 64)
    res = SOLVERS["auto"](problem, time_limit=3, seed=0)
    assert res.candidate.simulate(problem).iteration_ms < 0.97 * gpipe_equal(problem).iteration_ms


def test_ga_is_reproducible_with_a_seed():
    prof = synthetic_profile(3, max_size=16, seed=7)
    problem = Problem(CostTables.from_profile(prof), 24)
    a = SOLVERS["ga"](problem, time_limit=30, seed=5, max_generations=40, polish_kicks=20)
    b = SOLVERS["ga"](problem, time_limit=30, seed=5, max_generations=40, polish_kicks=20)
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


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 64))
def test_ramped_partitions_cover_the_minibatch_within_the_largest_size(B, mx):
    counts = [-(-B // mx), B]
    parts = ramped_partitions(B, mx, counts)
    assert all(sum(p) == B and 1 <= min(p) and max(p) <= mx for p in parts)
    assert len({tuple(p) for p in parts}) == len(parts)
    # the equal partitions it is given (the best equal ones) are in the family, so ramp is never
    # worse than the best equal schedule
    assert {tuple(equal_sizes(B, n)) for n in counts} <= {tuple(p) for p in parts}
    if B >= 16 and mx >= 8:  # and ramps: 1, 2, 4 up and down around chunks of 8
        assert [1, 2, 4] + [8] * ((B - 14) // 8) + ([(B - 14) % 8] if (B - 14) % 8 else []) + [
            4,
            2,
            1,
        ] in parts


def test_ramp_beats_equal_chunks_on_a_deep_pipeline():
    # eight stages with a fixed cost per op: equal chunks pay for the fill and the drain with
    # chunks as large as the middle ones, a ramp with chunks of 1 to 4 samples
    prof = synthetic_profile(8, max_size=64, overhead_ms=[0.5] * 8, per_sample_ms=[0.3] * 8)
    problem = Problem(CostTables.from_profile(prof), 128)
    ramp = SOLVERS["ramp"](problem)
    equal = SOLVERS["equal"](problem).candidate.simulate(problem).iteration_ms
    assert ramp.candidate.simulate(problem).iteration_ms < 0.97 * equal
    sizes = ramp.candidate.fsizes[0]
    assert all(p == sizes for p in ramp.candidate.fsizes)
    assert sizes[0] < max(sizes) and sizes[-1] < max(sizes)


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
    for name in ("auto", "ga", "greedy", "dp", "ramp", "equal"):
        res = SOLVERS[name](problem, time_limit=1, seed=0)
        tl = res.candidate.simulate(problem)
        assert max(tl.peak_memory_bytes) <= limit, name


def _start(problem: Problem):
    """Where the exact models start in these tests: the best equal GPipe schedule. (Left alone they
    run the GA for 30% of their time first, which the auto solver's tests cover; what these check,
    the models' proofs, does not depend on where they start.)"""
    return gpipe_equal(problem).candidate


def _microsecond_profile(S, seed):
    """Costs in whole microseconds, so that the exact model's integer times are exact."""
    prof = synthetic_profile(S, max_size=4, seed=seed)
    return prof.model_copy(
        update={
            "stages": [
                st.model_copy(
                    update={
                        "forward_ms": [round(v, 3) for v in st.forward_ms],
                        "backward_ms": [round(v, 3) for v in st.backward_ms],
                    }
                )
                for st in prof.stages
            ],
            "links": [
                ln.model_copy(update={"latency_ms": 0.3, "bytes_per_ms": 65536 * 1000.0}) for ln in prof.links
            ],
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
@pytest.mark.parametrize(
    "S,B,recompute,seed",
    [(2, 5, False, 1), (3, 5, False, 2), (2, 6, False, 3), (2, 4, True, 4), (3, 3, True, 5)],
)
def test_exact_models_prove_the_brute_force_gpipe_optimum(solver, S, B, recompute, seed):
    problem = Problem(CostTables.from_profile(_microsecond_profile(S, seed), recompute), B)
    best = brute_force_gpipe(problem)
    res = SOLVERS[solver](problem, time_limit=10, seed=0, order=GPIPE, hint=_start(problem))
    assert res.status == "optimal" and res.candidate.order == "gpipe"
    assert res.candidate.simulate(problem).iteration_ms == pytest.approx(best, abs=1e-6)
    assert res.lower_bound_ms <= best + 1e-9
    assert res.lower_bound_ms == pytest.approx(best, abs=S * 2 * B * 1e-3)  # within the microsecond rounding


def stage_orders(fsizes, bsizes):
    """Every op list of one stage: F chunks in sample order, each B after the F of its samples."""
    fch, bch = chunks(fsizes), chunks(bsizes)
    out = []

    def extend(nf, done, forwarded, seq):
        if nf == len(fch) and len(done) == len(bch):
            out.append(seq)
            return
        if nf < len(fch):
            extend(nf + 1, done, fch[nf][1], [*seq, ("F", *fch[nf])])
        for j, c in enumerate(bch):
            if j not in done and c[1] <= forwarded:
                extend(nf, done | {j}, forwarded, [*seq, ("B", *c)])

    extend(0, frozenset(), 0, [])
    return out


def brute_force_any_order(problem: Problem) -> float:
    """Best schedule over every partition pair and every op order of every stage."""
    parts = list(compositions(problem.minibatch, problem.max_size))
    per_stage = list(itertools.product(parts, parts)) if problem.recompute else [(p, p) for p in parts]
    lists = [ops for f, b in per_stage for ops in stage_orders(f, b)]
    best = np.inf
    for combo in itertools.product(lists, repeat=problem.num_stages):
        try:
            best = min(best, simulate(problem.tables, combo, problem.minibatch, record=False).iteration_ms)
        except UmoptError:  # this combination deadlocks
            pass
    return best


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
@pytest.mark.parametrize(
    "S,B,recompute,seed", [(2, 3, False, 1), (2, 4, False, 3), (2, 3, True, 4), (3, 3, False, 2)]
)
def test_exact_models_prove_the_brute_force_optimum_over_every_order(solver, S, B, recompute, seed):
    problem = Problem(CostTables.from_profile(_microsecond_profile(S, seed), recompute), B)
    best = brute_force_any_order(problem)
    res = SOLVERS[solver](problem, time_limit=20, seed=0, order=None, hint=_start(problem))
    assert res.status == "optimal" and res.bound_scope == "any order"
    assert res.candidate.simulate(problem).iteration_ms == pytest.approx(best, abs=1e-6)
    assert res.lower_bound_ms <= best + 1e-9
    assert res.lower_bound_ms == pytest.approx(best, abs=S * 2 * B * 1e-3)


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
def test_exact_models_prove_the_optimum_with_a_data_parallel_allreduce(solver):
    """Data-parallel replicas: the last stage's 8 ms all-reduce runs while stage 0 finishes its
    backwards. Found by brute force: the best schedule knowing that is 7% ahead of the best one
    without it (25.37 vs 27.32 ms, all-reduce included); the exact models must find the former."""
    prof = _microsecond_profile(2, 3)
    prof = prof.model_copy(
        update={
            "stages": [
                st.model_copy(update={"param_bytes": 8_000_000 * s}) for s, st in enumerate(prof.stages)
            ]
        }
    )
    dp = AllReduceProfile(replicas=2, latency_ms=0.0, bus_bytes_per_ms=1e6)
    problem = Problem(CostTables.from_profile(prof, False, dp), 4)
    assert list(problem.tables.allreduce_ms) == [0.0, 8.0]
    best = brute_force_any_order(problem)
    unaware_problem = Problem(CostTables.from_profile(prof, False), 4)
    unaware = SOLVERS[solver](
        unaware_problem, time_limit=20, seed=0, order=None, hint=_start(unaware_problem)
    ).candidate
    res = SOLVERS[solver](problem, time_limit=20, seed=0, order=None, hint=_start(problem))
    assert res.status == "optimal"
    assert (
        res.candidate.simulate(problem).iteration_ms
        == pytest.approx(best, abs=1e-6)
        == pytest.approx(25.372625, abs=1e-6)
    )
    assert unaware.simulate(problem).iteration_ms > best + 1.0
    assert res.lower_bound_ms <= best + 1e-9
    # the spec's bound counts the last stage's all-reduce after its own work: above the one without
    assert (
        spec_bound(Problem(CostTables.from_profile(prof, False), 4))
        < spec_bound(problem)
        <= fast_bound_ms(problem)
        <= best + 1e-9
    )


def test_solve_with_data_parallel_replicas_predicts_their_allreduce():
    from umopt.search.solve import allreduce_for, solve

    prof = load_profile("gpt-sim")
    with pytest.raises(UmoptError, match="no all-reduce speed"):
        allreduce_for(prof, 2)
    dp = allreduce_for(prof, 4, gbps=8.0)  # 1e6 bytes per ms
    report = solve(prof, 32, time_limit=2, dp=dp)
    assert report.schedule.dp == dp
    tables = CostTables.from_profile(prof, False, dp)
    want = [0.75 * 2 * st.param_bytes / 1e6 for st in prof.stages]  # 2 (N - 1) / N bytes over the bus
    np.testing.assert_allclose(tables.allreduce_ms, want)
    tl = simulate(tables, report.schedule.op_lists(), 32)
    assert report.schedule.predicted.iteration_ms == pytest.approx(tl.iteration_ms)
    assert tl.iteration_ms == pytest.approx(
        max(f + a for f, a in zip(tl.finish_ms, want)) + tables.optimizer_ms
    )
    # the equal baselines pay the all-reduce too
    assert report.gpipe.iteration_ms == pytest.approx(gpipe_equal(Problem(tables, 32)).iteration_ms)
    assert report.gpipe.iteration_ms > gpipe_equal(Problem(CostTables.from_profile(prof), 32)).iteration_ms


def test_free_order_beats_both_textbook_orders_when_they_waste_time():
    # found by brute force: here the best any-order schedule is 3.6% below the best of every
    # GPipe- and PipeDream-flush-order one (33.35 vs 32.14 ms); 1F1B with per-stage warm-ups,
    # the GA's space, reaches it
    prof = synthetic_profile(3, max_size=4, seed=0, latency_ms=0.3, bytes_per_ms=2e5)
    problem = Problem(CostTables.from_profile(prof), 3)
    best = brute_force_any_order(problem)
    res = SOLVERS["cpsat"](problem, time_limit=20, seed=0, order=None, hint=_start(problem))
    assert res.status == "optimal"
    assert res.candidate.iteration_ms == pytest.approx(best, abs=1e-2)
    assert res.candidate.iteration_ms < brute_force(problem, warmups=False) - 1.0
    assert res.candidate.order == "free"
    ga = SOLVERS["ga"](
        problem, time_limit=10, seed=0, stall_generations=60, max_restarts=2, polish_kicks=50
    ).candidate
    assert ga.simulate(problem).iteration_ms == pytest.approx(best, abs=1e-9)
    # and PipeDream-flush's order (--order 1f1b) is what it says
    assert (
        SOLVERS["ga"](
            problem,
            time_limit=10,
            seed=0,
            order=ONEF1B,
            stall_generations=60,
            max_restarts=0,
            polish_kicks=50,
        ).candidate.warmup
        is None
    )


def test_ticking_moves_the_bar_while_a_solver_cannot_report():
    calls = []
    start = time.perf_counter()
    with ticking(lambda frac, best: calls.append((frac, best)), start, 1.0, lambda: 42.0, every=0.02):
        time.sleep(0.2)
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n >= 3  # and it stops with the block
    fracs = [f for f, _ in calls]
    assert fracs == sorted(fracs) and 0 < fracs[0] and fracs[-1] < 0.5 and {b for _, b in calls} == {42.0}


@pytest.mark.parametrize("solver", ["cpsat", "milp"])
def test_exact_solvers_move_the_bar_and_end_it_at_the_schedule_found(solver):
    problem = Problem(CostTables.from_profile(synthetic_profile(3, max_size=4, seed=1)), 12)
    calls = []
    res = SOLVERS[solver](
        problem, time_limit=3, seed=0, progress=lambda frac, best: calls.append((frac, best))
    )
    assert len(calls) >= 3 and calls[-1] == (1.0, res.candidate.iteration_ms)
    assert all(0 <= f <= 1 for f, _ in calls)


def _random_partition(rng, B, mx):
    out = []
    while sum(out) < B:
        out.append(int(rng.integers(1, min(mx, B - sum(out)) + 1)))
    return out


@pytest.mark.parametrize("recompute", [False, True])
def test_memory_limited_schedules_stay_under_the_limit_in_every_order(recompute):
    prof = synthetic_profile(2, max_size=8, seed=3)
    t = CostTables.from_profile(prof, recompute)
    if recompute:
        limit = int(t.static_bytes.max() + 12 * t.input_bytes.max() + 3 * t.stash_bytes.max())
    else:  # without recompute the stash caps the samples in flight: GPipe order cannot hold all 12
        limit = int(t.static_bytes.max() + 7 * t.stash_bytes.max())
    problem = Problem(CostTables.from_profile(prof.with_memory_limit(limit), recompute), 12)
    unlimited = SOLVERS["ga"](Problem(t, 12), time_limit=0.5, seed=0).candidate.simulate(Problem(t, 12))
    assert max(unlimited.peak_memory_bytes) > limit  # the limit binds
    runs = [("cpsat", None), ("ga", None), ("auto", None)]
    runs += [("ga", ONEF1B)] + ([("cpsat", GPIPE), ("milp", GPIPE)] if recompute else [])
    for name, order in runs:
        res = SOLVERS[name](problem, time_limit=0.5, seed=0, order=order)
        tl = res.candidate.simulate(problem)
        assert max(tl.peak_memory_bytes) <= limit, (name, order)


def test_auto_reports_the_exact_models_proof_for_the_orders_it_searched():
    problem = Problem(CostTables.from_profile(_microsecond_profile(2, 1)), 5)
    res = SOLVERS["auto"](problem, time_limit=6, seed=0, order=GPIPE)
    best = brute_force_gpipe(problem)
    assert res.status == "optimal" and res.bound_scope == "gpipe order"
    assert res.candidate.simulate(problem).iteration_ms == pytest.approx(best, abs=1e-6)
    assert res.lower_bound_ms <= best + 1e-9
    # searching every order, the proof covers every schedule
    free = SOLVERS["auto"](problem, time_limit=6, seed=0)
    assert free.bound_scope == "any order"
    assert free.lower_bound_ms <= free.candidate.simulate(problem).iteration_ms <= best + 1e-9


class _FakeBeside:
    """Stands in for :class:`umopt.search.bounds.BackgroundBounds` in auto: records what auto asks, answers ``proved``.
    With ``meet``, every schedule offered is at once a bound it meets (a stand-in for a proof)."""

    made: list = []

    def __init__(self, job, problem, on_bound=None, proved=None, meet=False, **params):
        self.job, self.params, self.on_bound, self.offers, self.ended = job, params, on_bound, [], None
        self.proved, self.meet = dict(proved or {}), meet
        _FakeBeside.made.append(self)

    def offer(self, ms):
        self.offers.append(ms)
        if self.meet:
            self.proved["any order"] = ms
            self.on_bound("any order", ms)

    def wait(self, timeout=None):
        self.ended = "wait"
        return dict(self.proved)

    def stop(self):
        self.ended = "stop"
        return dict(self.proved)

    def close(self):
        pass


def _fake_beside(monkeypatch, **kw):
    import umopt.search.solvers.auto as auto

    _FakeBeside.made = []
    monkeypatch.setattr(
        auto,
        "BackgroundBounds",
        lambda job, problem, on_bound=None, **params: _FakeBeside(job, problem, on_bound, **kw, **params),
    )
    return _FakeBeside.made


def test_auto_reports_the_pair_bound_where_the_exact_model_does_not_run(monkeypatch):
    # S=4, B=12: too large for CP-SAT to prove anything (auto skips it), small enough for the pair
    # bounds, which run beside the GA and become the report's bounds
    problem = Problem(CostTables.from_profile(load_profile("vgg16-cpu")), 12)
    made = _fake_beside(monkeypatch, proved={"any order": 170.0, "1f1b order": 175.0})
    res = SOLVERS["auto"](problem, time_limit=2, seed=0)
    assert "cpsat" not in res.tried
    # first the pairs of every schedule, then the 1F1B family's, for the GA's time between them,
    # told the best fast schedule and then the GA's better ones; the GA's schedules are of that
    # family, so both are reported
    [job] = made
    assert job.job.__name__ == "pairs_job" and job.ended == "wait"
    assert (
        job.params["any_seconds"] == pytest.approx(2 * job.params["family_seconds"])
        and job.params["any_seconds"] + job.params["family_seconds"] >= 1.5
    )
    assert job.offers == sorted(job.offers, reverse=True) and job.offers[-1] == pytest.approx(
        res.candidate.iteration_ms
    )
    assert res.lower_bound_ms == 170.0 and res.bound_scope == "any order" and res.status == "feasible"
    assert res.lower_bound_1f1b_ms == 175.0
    # a bound that meets the schedule found proves it optimal (never reported above it)
    made = _fake_beside(monkeypatch, proved={"any order": 1e9, "1f1b order": 1e9})
    res = SOLVERS["auto"](problem, time_limit=2, seed=0)
    assert res.status == "optimal" and res.lower_bound_ms == res.candidate.iteration_ms
    # under --order 1f1b only the family's, beside the GA for all its time, and then the bound
    made = _fake_beside(monkeypatch, proved={"1f1b order": 175.0})
    res = SOLVERS["auto"](problem, time_limit=2, seed=0, order=ONEF1B)
    [job] = made
    assert job.params["any_seconds"] == 0 and job.params["family_seconds"] >= 1.5
    assert res.lower_bound_ms == 175.0 and res.bound_scope == "1f1b order"


def test_auto_stops_once_the_bound_meets_its_schedule(monkeypatch):
    # the pairs beside the GA report their bound as it rises; once the GA's best meets it, the
    # schedule is proven optimal and both stop, long before the time limit
    problem = Problem(CostTables.from_profile(load_profile("vgg16-cpu")), 12)
    made = _fake_beside(monkeypatch, meet=True)
    t0 = time.perf_counter()
    res = SOLVERS["auto"](problem, time_limit=30, seed=0)
    assert time.perf_counter() - t0 < 10  # a third of the limit: it stopped, and the pairs with it
    assert made[0].ended == "stop"
    found = res.candidate.simulate(problem).iteration_ms
    assert res.status == "optimal" and res.lower_bound_ms == pytest.approx(found)
    assert res.lower_bound_1f1b_ms == pytest.approx(found)


def test_ga_stops_when_asked_and_bounds_beside_end_at_once():
    problem = Problem(CostTables.from_profile(load_profile("gpt-sim")), 32)
    t0 = time.perf_counter()
    res = SOLVERS["ga"](problem, time_limit=30, seed=0, stop=lambda best_ms: True)
    assert time.perf_counter() - t0 < 10
    assert res.candidate.simulate(problem).iteration_ms <= onef1b_equal(problem).candidate.iteration_ms + 1e-9
    # the pairs beside (and the pair program's process below them) end at once when stopped,
    # with what they proved: nothing of them is left running
    from umopt.search.bounds import BackgroundBounds, pairs_job

    seen = []
    job = BackgroundBounds(
        pairs_job,
        problem,
        lambda scope, ms: seen.append((scope, ms)),
        any_seconds=60,
        family_seconds=0,
        seed=0,
        max_cells=1024,
        workers=1,
    )
    while not seen and time.perf_counter() - t0 < 30:  # the program's first lift
        time.sleep(0.1)
    t1 = time.perf_counter()
    proved = job.stop()
    job.close()
    assert time.perf_counter() - t1 < 2
    assert proved["any order"] >= fast_bound_ms(problem) - 1e-9
    time.sleep(0.5)
    left = subprocess.run(
        ["pgrep", "-f", "umopt.search.bounds.background"], capture_output=True, text=True
    ).stdout.split()
    assert left == []


def test_aligned_moves_move_a_shared_chunk_end_on_every_stage_holding_it():
    parts = [[2, 3, 3], [2, 6], [5, 3]]  # chunk ends {2, 5}, {2}, {5}
    got = list(aligned_moves(parts, max_size=6))
    # end 2 (stages 0 and 1) up by one; end 5 (stages 0 and 2) down and up by one. End 2 down
    # would give stage 1 a chunk of 7, and removing either end a chunk of 8: over the largest size
    assert got == [[[3, 2, 3], [3, 5], [5, 3]], [[2, 2, 4], [2, 6], [4, 4]], [[2, 4, 2], [2, 6], [6, 2]]]
    assert list(aligned_moves(parts, max_size=8))[-1] == [[2, 6], [2, 6], [8]]  # end 5 removed
    assert list(aligned_moves([[4, 4], [8]], max_size=8)) == []  # no end is shared


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(1, 4),
    B=st.integers(1, 20),
    mx=st.sampled_from([2, 3, 4, 8]),
    recompute=st.booleans(),
    order=st.sampled_from(["gpipe", "1f1b"]),
    seed=st.integers(0, 10_000),
)
def test_climb_neighbours_are_every_schedule_one_move_away(S, B, mx, recompute, order, seed):
    # the climb builds its neighbours as arrays; they are exactly the schedules that moves(),
    # aligned_moves() and a warm-up step make from the centre, as lists
    from umopt.search.solvers.local import _neighbours, _warmup, moves

    rng = np.random.default_rng(seed)
    problem = Problem(CostTables.from_profile(synthetic_profile(S, max_size=mx, seed=seed), recompute), B)
    mx = problem.max_size
    f = [_random_partition(rng, B, mx) for _ in range(S)]
    if S > 1 and seed % 2:
        f[1] = list(f[0])  # ends shared by two stages
    b = [_random_partition(rng, B, mx) for _ in range(S)] if recompute else f
    warm = [int(w) for w in rng.integers(0, B + 1, S)] if order == "1f1b" and seed % 3 else None
    cand = Candidate(f, b, order, warmup=warm)
    key = lambda f, b, w: (tuple(map(tuple, f)), tuple(map(tuple, b)), tuple(w) if order == "1f1b" else ())  # noqa: E731
    want = {key(g, b if recompute else g, cand.warmups) for g in aligned_moves(f, mx)}
    for s in range(S):
        want |= {
            key(f[:s] + [new] + f[s + 1 :], b if recompute else f[:s] + [new] + f[s + 1 :], cand.warmups)
            for new in moves(f[s], mx)
        }
        if recompute:
            want |= {key(f, b[:s] + [new] + b[s + 1 :], cand.warmups) for new in moves(b[s], mx)}
        if order == "1f1b":
            now, n = cand.warmups, len(f[s])
            for w in (min(now[s], n) - 1, min(now[s], n) + 1):
                if 0 <= w <= n and w != min(now[s], n):
                    want.add(key(f, b, now[:s] + [_warmup(w, n, B)] + now[s + 1 :]))
    want.discard(key(f, b, cand.warmups))  # an aligned move may change nothing
    fs, bs, wu, _ = _neighbours(problem, cand, free_warmup=True)
    rows = lambda a: [[int(x) for x in r if x] for r in a]  # noqa: E731
    got = [
        key(rows(fs[k]), rows(bs[k]) if recompute else rows(fs[k]), [int(x) for x in wu[k]])
        for k in range(len(fs))
    ]
    assert set(got) == want


def test_iterated_climb_escapes_a_local_optimum_of_single_moves():
    # gpt-sim, S=4, B=8: CP-SAT proves 47.194 ms optimal (README); this schedule is 48.000 and no
    # single move (nor aligned move, nor warm-up change) improves it, yet the optimum is several
    # stages' moves away
    problem = Problem(CostTables.from_profile(load_profile("gpt-sim")), 8)
    parts = [[1, 2, 1, 2, 1, 1]] * 3 + [[1, 3, 2, 1, 1]]
    start = Candidate(parts, parts, "1f1b", warmup=[8, 8, 8, 0])
    far = time.perf_counter() + 600
    climbed, _ = hill_climb(problem, start, far, free_warmup=True)
    assert climbed.iteration_ms == pytest.approx(48.0, abs=1e-3)
    best, _ = iterated_climb(problem, start, far, seed=0, free_warmup=True, max_kicks=25)
    assert best.iteration_ms == pytest.approx(47.194, abs=1e-3)
    assert best.simulate(problem).iteration_ms == pytest.approx(best.iteration_ms, abs=1e-9)


def test_solve_counts_the_bounds_before_the_solver_within_the_time_limit(monkeypatch):
    # the baselines and bounds computed before the solver (seconds at S=8, B=256) come out of
    # --time-limit, down to a tenth of it for the solver
    import umopt.search.solve as solve_mod

    seen = []

    def slow_bound(problem, scope="any order"):
        time.sleep(0.6)
        return fast_bound_ms(problem, scope)

    def recording(problem, time_limit, **kw):
        seen.append(time_limit)
        return SOLVERS["equal"](problem, time_limit=time_limit, **kw)

    monkeypatch.setattr(solve_mod, "fast_bound_ms", slow_bound)
    monkeypatch.setitem(solve_mod.SOLVERS, "recording", recording)
    prof = synthetic_profile(3, max_size=8, seed=2)
    report = solve_mod.solve(prof, 12, solver="recording", time_limit=4.0)
    assert 1.0 <= seen[0] <= 4.0 - 1.2  # both bounds (any order, 1F1B family) were counted
    assert report.schedule.solver.name == "recording"
    solve_mod.solve(prof, 12, solver="recording", time_limit=1.0)
    assert seen[1] == pytest.approx(
        solve_mod.MIN_SOLVER_SHARE
    )  # the bounds took more than the limit: the solver's share


def test_fast_bounds_run_beside_the_solver_where_they_take_seconds(monkeypatch):
    # past BOUNDS_BESIDE_CELLS a child process computes them while the solver keeps its whole
    # time limit; the report is the same as with the bounds computed here
    import umopt.search.solve as solve_mod

    seen = []

    def recording(problem, time_limit, **kw):
        seen.append(time_limit)
        return SOLVERS["equal"](problem, time_limit=time_limit, **kw)

    monkeypatch.setitem(solve_mod.SOLVERS, "recording", recording)
    prof = synthetic_profile(3, max_size=8, seed=2)
    here = solve_mod.solve(
        prof, 12, solver="recording", time_limit=4.0, order="1f1b"
    ).schedule.solver.model_dump()
    monkeypatch.setattr(solve_mod, "BOUNDS_BESIDE_CELLS", 0)
    monkeypatch.setattr(solve_mod.os, "cpu_count", lambda: 2)

    def not_here(*_):
        raise AssertionError("the bounds ran in this process")

    monkeypatch.setattr(solve_mod, "_fast_bounds", not_here)
    beside = solve_mod.solve(
        prof, 12, solver="recording", time_limit=4.0, order="1f1b"
    ).schedule.solver.model_dump()
    assert (
        seen[1] >= 4.0 - solve_mod.BESIDE_GRACE_S - 0.2
    )  # only the baselines came before it, and the wait for the bounds after
    for key in ("lower_bound_ms", "lower_bound_1f1b_ms"):
        assert beside[key] == here[key] is not None


def test_ga_with_w_caps_beats_its_seeds_with_w_ops_placed_and_keeps_to_memory():
    """The GA carrying W caps (zero bubble): its schedule has W ops, scores as the simulator
    says, stays within a memory limit that binds, and beats the best seed's W placement."""
    from umopt.search.solvers.ga import solve_ga
    from umopt.search.zerobubble import best_with_weight_ops

    prof = load_profile("gpt-sim")
    free = Problem(CostTables.from_profile(prof), 16)
    seed = onef1b_equal(free).candidate
    limit = int(max(simulate(free.tables, seed.ops(), 16).peak_memory_bytes))
    problem = Problem(CostTables.from_profile(prof.with_memory_limit(limit)), 16)
    res = solve_ga(problem, time_limit=3, seed=0, seeds=[seed], weights=True)
    cand = res.candidate
    assert cand.wcap is not None and any(op.kind == "W" for st in cand.ops() for op in st)
    tl = cand.simulate(problem)
    assert tl.iteration_ms == pytest.approx(cand.iteration_ms, abs=1e-9)
    assert max(tl.peak_memory_bytes) <= limit
    placed = best_with_weight_ops(problem, seed.ops())
    assert tl.iteration_ms < placed[1].iteration_ms


def test_an_exact_models_warm_start_ends_once_the_ga_stalls(monkeypatch):
    """The exact model gets what the GA does not need: the warm start stops after STALL_SHARE of
    the limit without a better schedule (a small instance's proof went unmade while the GA spent
    its whole share finding nothing better)."""
    import umopt.search.solvers.exact as exact
    import umopt.search.solvers.ga as ga

    clock = [100.0]
    monkeypatch.setattr(exact.time, "perf_counter", lambda: clock[0])
    problem = Problem(CostTables.from_profile(synthetic_profile(3, max_size=4, seed=1)), 4)
    asked = {}

    def fake_ga(problem, *, time_limit, seed, order, stop):
        asked["limit"] = time_limit
        ms = 50.0
        for step in range(1000):  # one generation a 0.01 s: better until step 100, then the same
            clock[0] += 0.01
            if step < 100:
                ms -= 0.01
            if stop(ms):
                break
        asked["stopped_at"] = clock[0] - 100.0
        return SOLVERS["equal"](problem, time_limit=1)

    monkeypatch.setattr(ga, "solve_ga", fake_ga)
    base, left, _ = exact.warm_start(problem, "milp", 20.0, 0, None, None)
    assert asked["limit"] == pytest.approx(0.3 * 20)
    # the last better schedule at 1 s, then 5% of 20 s without one: 2 s in all, 18 s left to the model
    assert asked["stopped_at"] == pytest.approx(1.0 + exact.STALL_SHARE * 20, abs=0.02)
    assert left == pytest.approx(20.0 - asked["stopped_at"], abs=1e-6)
