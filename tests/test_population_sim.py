"""The population evaluators equal the reference simulator, schedule by schedule, and the
compiled ones equal the numpy ones to the bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from umopt.costmodel import CostTables, simulate
from umopt.errors import UmoptError
from umopt.formats.profile import AllReduceProfile
from umopt.formats.schedule import validate_ops
from umopt.schedules import gpipe_ops, onef1b_schedule
from umopt.schedules.partition import ends_to_sizes, repair_ends, sizes_to_ends
from umopt.schedules.population_sim import evaluate_1f1b, evaluate_gpipe
from umopt.search.problem import Candidate
from umopt.synthetic import synthetic_profile


def _random_population(rng, P, S, B, mx, density):
    return repair_ends(rng.random((P, S, B)) < density, mx)


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(1, 5),
    B=st.integers(1, 40),
    mx=st.integers(1, 16),
    recompute=st.booleans(),
    density=st.floats(0.0, 1.0),
    latency=st.floats(0.0, 2.0),
    bandwidth=st.floats(1e3, 1e7),
    overhead=st.sampled_from([0.0, 0.0, 0.37]),
    replicas=st.sampled_from([1, 1, 2, 8]),
    seed=st.integers(0, 2**31),
)
def test_vectorized_equals_reference(
    S, B, mx, recompute, density, latency, bandwidth, overhead, replicas, seed
):
    rng = np.random.default_rng(seed)
    # the runtime's own costs per op and per message (fitted to runs) count as the ops' and messages'
    prof = synthetic_profile(
        S,
        max_size=mx,
        seed=seed % 1000,
        latency_ms=latency,
        bytes_per_ms=bandwidth,
        op_overhead_ms=overhead,
        message_overhead_ms=overhead / 2,
        param_bytes=list(rng.integers(0, 1 << 24, S)),
    )
    tables = CostTables.from_profile(prof, recompute, _allreduce(replicas, rng))
    P = 6  # 60 examples x 6 individuals = 360 random schedules
    fe = _random_population(rng, P, S, B, mx, density)
    be = _random_population(rng, P, S, B, mx, rng.random()) if recompute else fe
    fs, bs = ends_to_sizes(fe), ends_to_sizes(be)
    score = evaluate_gpipe(tables, fs, bs)
    _assert_same_in_numpy(score, evaluate_gpipe, tables, fs, bs)
    for p in range(P):
        ops = [gpipe_ops([x for x in fs[p, s] if x], [x for x in bs[p, s] if x]) for s in range(S)]
        _assert_equals_reference(score, p, simulate(tables, ops, B))


@settings(max_examples=100, deadline=None)
@given(
    S=st.integers(1, 5),
    B=st.integers(1, 40),
    mx=st.integers(1, 16),
    density=st.floats(0.0, 1.0),
    latency=st.floats(0.0, 2.0),
    bandwidth=st.floats(1e3, 1e7),
    own_backward=st.booleans(),
    overhead=st.sampled_from([0.0, 0.0, 0.37]),
    replicas=st.sampled_from([1, 1, 2, 8]),
    seed=st.integers(0, 2**31),
)
def test_vectorized_1f1b_equals_reference(
    S, B, mx, density, latency, bandwidth, own_backward, overhead, replicas, seed
):
    rng = np.random.default_rng(seed)
    prof = synthetic_profile(
        S,
        max_size=mx,
        seed=seed % 1000,
        latency_ms=latency,
        bytes_per_ms=bandwidth,
        op_overhead_ms=overhead,
        message_overhead_ms=overhead / 2,
        param_bytes=list(rng.integers(0, 1 << 24, S)),
    )
    # with recompute a stage's B chunks are free: then half the time a second partition of its own
    tables = CostTables.from_profile(prof, own_backward or seed % 3 == 0, _allreduce(replicas, rng))
    fs = ends_to_sizes(_random_population(rng, 6, S, B, mx, density))
    bs = ends_to_sizes(_random_population(rng, 6, S, B, mx, rng.random())) if own_backward else fs
    # PipeDream-flush's warm-ups for the first half, random per-stage ones (up to all forwards first) for the rest
    warm = np.where(
        np.arange(6)[:, None] < 3, np.arange(S - 1, -1, -1)[None, :], rng.integers(0, B + 1, (6, S))
    )
    score = evaluate_1f1b(tables, fs, warm, bs if own_backward else None)
    _assert_same_in_numpy(score, evaluate_1f1b, tables, fs, warm, bs if own_backward else None)
    for p in range(6):
        fparts = [[int(x) for x in fs[p, s] if x] for s in range(S)]
        bparts = [[int(x) for x in bs[p, s] if x] for s in range(S)]
        _assert_equals_reference(
            score, p, simulate(tables, onef1b_schedule(fparts, bparts, list(warm[p])), B)
        )  # raises if it deadlocked


@settings(max_examples=80, deadline=None)
@given(
    S=st.integers(1, 5),
    B=st.integers(1, 40),
    mx=st.integers(1, 16),
    density=st.floats(0.0, 1.0),
    onef1b=st.booleans(),
    recompute=st.booleans(),
    own_backward=st.booleans(),
    overhead=st.sampled_from([0.0, 0.0, 0.37]),
    weight_share=st.sampled_from([0.0, 0.3, 0.5, 0.9]),
    replicas=st.sampled_from([1, 1, 2]),
    seed=st.integers(0, 2**31),
)
def test_split_evaluator_equals_reference(
    S, B, mx, density, onef1b, recompute, own_backward, overhead, weight_share, replicas, seed
):
    """W ops (zero bubble) placed by each stage's cap, in both orders: the evaluator equals the
    reference simulator on the op lists Candidate.ops builds, deadlocks and memory included."""
    rng = np.random.default_rng(seed)
    prof = synthetic_profile(
        S,
        max_size=mx,
        seed=seed % 1000,
        latency_ms=float(rng.uniform(0, 2)),
        bytes_per_ms=float(rng.uniform(1e3, 1e7)),
        op_overhead_ms=overhead,
        message_overhead_ms=overhead / 2,
        param_bytes=list(rng.integers(0, 1 << 24, S)),
        weight_share=weight_share,
    )
    own_backward = own_backward and recompute
    tables = CostTables.from_profile(prof, recompute, _allreduce(replicas, rng))
    P = 6
    fs = ends_to_sizes(_random_population(rng, P, S, B, mx, density))
    bs = ends_to_sizes(_random_population(rng, P, S, B, mx, rng.random())) if own_backward else fs
    warm = np.where(
        np.arange(P)[:, None] < 3, np.arange(S - 1, -1, -1)[None, :], rng.integers(0, B + 1, (P, S))
    )
    # per stage: no W ops, every W at the end, or a random cap
    wcap = np.where(
        rng.random((P, S)) < 0.2, -1, np.where(rng.random((P, S)) < 0.3, B, rng.integers(0, B + 1, (P, S)))
    )
    if onef1b:
        score = evaluate_1f1b(tables, fs, warm, bs if own_backward else None, wcap=wcap)
    else:
        score = evaluate_gpipe(tables, fs, bs if own_backward else None, wcap=wcap)
    for p in range(P):
        cand = Candidate(
            [[int(x) for x in fs[p, s] if x] for s in range(S)],
            [[int(x) for x in bs[p, s] if x] for s in range(S)],
            "1f1b" if onef1b else "gpipe",
            warmup=[int(w) for w in warm[p]],
            wcap=[int(c) for c in wcap[p]],
        )
        ops = cand.ops()
        validate_ops(ops, B, mx, recompute)  # a valid schedule (deadlock aside)
        try:
            ref = simulate(tables, ops, B)
        except UmoptError:
            assert score.iteration_ms[p] == np.inf
            continue
        _assert_equals_reference(score, p, ref)


def test_split_evaluator_without_the_compiled_module():
    """Where the install did not compile, the reference simulator scores W schedules: the same."""
    import umopt.schedules.population_sim as vec

    rng = np.random.default_rng(3)
    S, B, mx = 4, 24, 8
    tables = CostTables.from_profile(
        synthetic_profile(S, max_size=mx, seed=3, op_overhead_ms=0.2), recompute=False
    )
    fs = ends_to_sizes(_random_population(rng, 8, S, B, mx, 0.3))
    wcap = rng.integers(-1, B + 1, (8, S))
    got = [evaluate_1f1b(tables, fs, None, None, wcap=wcap), evaluate_gpipe(tables, fs, None, wcap=wcap)]
    saved, vec._compiled = vec._compiled, None
    try:
        ref = [evaluate_1f1b(tables, fs, None, None, wcap=wcap), evaluate_gpipe(tables, fs, None, wcap=wcap)]
    finally:
        vec._compiled = saved
    for a, b in zip(got, ref):
        assert np.isfinite(a.iteration_ms).all()
        np.testing.assert_allclose(a.iteration_ms, b.iteration_ms, atol=1e-9, rtol=0)
        np.testing.assert_array_equal(a.peak_memory_bytes, b.peak_memory_bytes)


def _assert_equals_reference(score, p: int, ref) -> None:
    """Individual ``p``'s scores equal the reference simulator's timeline (1e-9 ms; bytes exactly)."""
    assert abs(score.iteration_ms[p] - ref.iteration_ms) <= 1e-9
    np.testing.assert_allclose(score.finish_ms[p], ref.finish_ms, atol=1e-9, rtol=0)
    np.testing.assert_allclose(score.busy_ms[p], ref.busy_ms, atol=1e-9, rtol=0)
    assert list(score.peak_memory_bytes[p].astype(np.int64)) == ref.peak_memory_bytes


def _allreduce(replicas: int, rng) -> AllReduceProfile | None:
    """Data-parallel replicas whose all-reduce takes a random share of an iteration (None: one)."""
    if replicas == 1:
        return None
    return AllReduceProfile(
        replicas=replicas, latency_ms=float(rng.uniform(0, 1)), bus_bytes_per_ms=float(rng.uniform(1e5, 1e7))
    )


def _assert_same_in_numpy(score, evaluate, *args):
    """The compiled evaluator (where built) and the numpy one give the same scores, infinite
    ones (deadlocks) included, and the same work and memory."""
    import umopt.schedules.population_sim as vec

    if vec._compiled is None:
        return
    saved, vec._compiled = vec._compiled, None
    try:
        py = evaluate(*args)
    finally:
        vec._compiled = saved
    np.testing.assert_array_equal(score.iteration_ms, py.iteration_ms)
    np.testing.assert_array_equal(score.finish_ms, py.finish_ms)
    np.testing.assert_array_equal(score.busy_ms, py.busy_ms)
    np.testing.assert_array_equal(score.peak_memory_bytes, py.peak_memory_bytes)


def test_compiled_evaluators_are_built_and_agree():
    """The install built them (CI has a compiler), and on a deep pipeline's population (with
    random warm-ups in 1F1B order) they score exactly as numpy does."""
    import umopt.schedules.population_sim as vec

    assert vec.COMPILED
    rng = np.random.default_rng(5)
    S, B, mx = 8, 48, 12
    tables = CostTables.from_profile(synthetic_profile(S, max_size=mx, seed=5), recompute=False)
    fs = ends_to_sizes(_random_population(rng, 64, S, B, mx, 0.3))
    warm = rng.integers(0, B + 1, (64, S))
    score = evaluate_1f1b(tables, fs, warm)
    assert np.isfinite(score.iteration_ms).all()
    _assert_same_in_numpy(score, evaluate_1f1b, tables, fs, warm)
    gp = evaluate_gpipe(tables, fs)
    assert np.isfinite(gp.iteration_ms).all()
    _assert_same_in_numpy(gp, evaluate_gpipe, tables, fs)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=30))
def test_sizes_ends_round_trip(sizes):
    B = sum(sizes)
    ends = sizes_to_ends(sizes, B)
    assert [x for x in ends_to_sizes(ends[None])[0] if x] == sizes


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.integers(1, 12), st.integers(0, 2**31))
def test_repair_splits_long_chunks_only(B, mx, seed):
    rng = np.random.default_rng(seed)
    ends = rng.random((3, B)) < 0.1
    before = ends.copy()
    repair_ends(ends, mx)
    sizes = ends_to_sizes(ends)
    assert sizes.max() <= mx and ends[:, -1].all()
    assert (ends | ~before).all()  # no end was removed
