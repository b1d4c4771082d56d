"""Predictions users can trust: noise noticed, curves that cannot follow it, a choice that does not
trade a schedule the profile cannot tell apart from a simpler one, and tune's measured pick."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umopt.costmodel import CostTables
from umopt.formats.profile import ProfileMeta
from umopt.formats.report import RunReport
from umopt.measure import noise
from umopt.measure.noise import (
    drift_figure,
    drift_warning,
    monotone_fit,
    noise_figure,
    noisy_warning,
    round_speeds,
    run_warnings,
    summarize,
    uneven_devices_warning,
)
from umopt.search.choice import choose, complexity
from umopt.search.problem import Problem
from umopt.synthetic import synthetic_profile
from umopt.tune import TuneRow, pick


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=12),
    st.lists(st.floats(0.01, 100.0), min_size=12, max_size=12),
)
def test_monotone_fit_never_falls_and_never_leaves_the_measured_range(values, weights):
    fit = monotone_fit(values, weights[: len(values)])
    assert len(fit) == len(values)
    assert all(a <= b + 1e-9 * max(1.0, abs(b)) for a, b in zip(fit, fit[1:]))
    assert min(values) - 1e-6 <= min(fit) and max(fit) <= max(values) + 1e-6
    if all(a <= b for a, b in zip(values, values[1:])):
        assert fit == pytest.approx(values)  # a curve that already rises is kept as it is


def test_monotone_fit_trusts_tight_entries_more():
    # the second entry dips; it is loose, the first is tight: the pooled value stays near the first
    assert monotone_fit([10.0, 8.0], [100.0, 1.0]) == pytest.approx([9.98, 9.98], abs=0.01)


def test_outliers_are_dropped_before_the_median():
    s = summarize([10.0, 10.2, 9.9, 10.1, 10.0, 55.0])
    assert s.median == pytest.approx(10.0, abs=0.1) and s.kept == 5 and s.spread < 0.05


def test_the_noise_warning_fires_on_a_noisy_series_and_not_on_a_quiet_one():
    rng = np.random.default_rng(0)
    quiet = [summarize(10 + 0.1 * rng.standard_normal(9)) for _ in range(12)]
    noisy = [summarize(10 * (1 + 0.4 * rng.random(9))) for _ in range(12)]
    for runs, fires in ((quiet, False), (noisy, True)):
        median_spread, p90 = noise_figure([s.median for s in runs], [s.iqr for s in runs])
        assert (noisy_warning("entries", median_spread) is not None) == fires
        assert p90 >= median_spread
    # a run: far off its prediction, and scattered steps
    report = RunReport(
        schedule="s.json", measured_over_predicted=1.3, step_ms=list(10 * (1 + 0.5 * rng.random(12)))
    )
    lines = run_warnings(report)
    assert len(lines) == 2 and "1.30x its prediction" in lines[0] and "umopt calibrate" in lines[0]
    assert run_warnings(RunReport(measured_over_predicted=1.05, step_ms=[10.0, 10.1, 9.9, 10.0])) == []
    # a rank allocating more than 10% over its predicted peak is said, by rank; within it, nothing
    mem = {"predicted": [100 * 2**20, 50 * 2**20], "measured": [105 * 2**20, 60 * 2**20]}
    lines = run_warnings(RunReport(schedule="s.json", measured_over_predicted=1.0, peak_memory_bytes=mem))
    assert len(lines) == 1 and "rank 1 allocated 60.0 MiB" in lines[0] and "20% over" in lines[0]
    mem["measured"][1] = 54 * 2**20
    assert run_warnings(RunReport(measured_over_predicted=1.0, peak_memory_bytes=mem)) == []


def test_round_speeds_take_out_a_drift_that_all_sizes_saw():
    # six sizes, forward and backward, twelve rounds; the machine slows by 40% from round six on
    # and every timing has 2% noise of its own
    rng = np.random.default_rng(1)
    sizes = [1, 2, 4, 8, 16, 32]
    true = np.array([[b * k for _ in range(12)] for b in sizes for k in (1.0, 2.0)])
    speed = np.where(np.arange(12) >= 6, 1.4, 1.0)
    times = true * speed * (1 + 0.02 * rng.standard_normal(true.shape))
    times[3, 2] = np.nan  # a size not timed in a round
    groups = [b for b in sizes for _ in range(2)]
    f = round_speeds(times, groups)
    raw = [summarize(r[~np.isnan(r)]) for r in times]
    fixed = [summarize((r / q)[~np.isnan(r)]) for r, q in zip(times, f)]
    assert max(e.spread for e in fixed) < 0.06 < min(e.spread for e in raw)
    # the drift is seen and said; the same machine without it is quiet
    assert 0.3 < drift_figure(times) < 0.45 and "speed changed by 3" in drift_warning(drift_figure(times))
    assert drift_figure(true * (1 + 0.02 * rng.standard_normal(true.shape))) < 0.05
    assert drift_warning(0.05) is None
    # one size alone in a round cannot tell its own noise from the machine's: left as timed
    alone = np.full((4, 3), np.nan)
    alone[:, 0] = [1.0, 2.0, 3.0, 4.0]
    alone[:2, 1:] = [[1.5, 1.0], [3.0, 2.0]]
    assert round_speeds(alone, [1, 1, 2, 2])[:2, 1:].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_devices_of_unequal_speed_and_a_busy_machine_are_said(monkeypatch):
    line = uneven_devices_warning([1.12, 1.65], "cpu")
    assert line is not None and "1.12 to 1.65 ms" in line and "47% apart" in line and "cores" in line
    assert (
        uneven_devices_warning([1.12, 1.18], "cuda") is None and uneven_devices_warning([1.0], "cpu") is None
    )
    ran = run_warnings(
        RunReport(schedule="s.json", backend="gloo", measured_over_predicted=1.0, reference_ms=[1.0, 1.3])
    )
    assert len(ran) == 1 and "30% apart) while s.json ran" in ran[0]
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(noise, "busy_cores", lambda seconds=0.5: 2.6)
    assert "2.6 of the machine's 4 cores were busy" in noise.load_warning(2)
    monkeypatch.setattr(noise, "busy_cores", lambda seconds=0.5: 0.3)
    assert noise.load_warning(2) is None


def _problem_with_spread(spread: float, rms: float):
    prof = synthetic_profile(2, max_size=16, seed=3, latency_ms=0.05, bytes_per_ms=1e6)
    stages = [
        s.model_copy(
            update={
                "forward_iqr_ms": [spread * v for v in s.forward_ms],
                "backward_iqr_ms": [spread * v for v in s.backward_ms],
            }
        )
        for s in prof.stages
    ]
    prof = prof.model_copy(
        update={"stages": stages, "meta": ProfileMeta.model_validate({"calibration": {"residual_rms": rms}})}
    )
    return prof, Problem(CostTables.from_profile(prof), 32)


def _candidates(problem):
    from umopt.search.baselines import gpipe_equal, onef1b_equal
    from umopt.search.solvers import SOLVERS

    gp, of = gpipe_equal(problem), onef1b_equal(problem)
    # (a generation cap and no kicks: the same schedule on every machine)
    best = SOLVERS["ga"](problem, time_limit=100, seed=0, max_generations=30, polish_kicks=0).candidate
    return [("umopt auto", best), (gp.name, gp.candidate), (of.name, of.candidate)]


def test_a_schedule_the_profile_cannot_tell_from_the_best_equal_one_is_not_recommended():
    prof, problem = _problem_with_spread(0.0, 0.0)
    cands = _candidates(problem)
    times = {n: c.simulate(problem).iteration_ms for n, c in cands}
    ref = min(times["gpipe_equal"], times["1f1b_equal"])
    gain = ref / times["umopt auto"] - 1
    assert 0 < gain < 0.2  # the schedule found is ahead, but not by much
    assert complexity(problem, cands[0][1]) > max(
        complexity(problem, c) for _, c in cands[1:]
    )  # and it runs more ops
    # no stated uncertainty: the fastest predicted, with its gain
    c = choose(prof, problem, cands, equal=("gpipe_equal", "1f1b_equal"))
    assert c.name == "umopt auto" and c.gain == pytest.approx(gain) and c.uncertainty == 0.0
    # a fit to the runtime that is off by more than the gain: the simpler, equal schedule
    prof, problem = _problem_with_spread(0.0, gain)
    c = choose(prof, problem, cands, equal=("gpipe_equal", "1f1b_equal"))
    fastest_equal = min(("gpipe_equal", "1f1b_equal"), key=lambda n: times[n])
    assert c.name == fastest_equal and c.uncertainty == pytest.approx(2 * np.sqrt(2) * gain)
    assert "within the profile's uncertainty" in c.reason
    # entries with a wide spread: the same, from the spread alone
    prof, problem = _problem_with_spread(0.6, 0.0)
    c = choose(prof, problem, cands, equal=("gpipe_equal", "1f1b_equal"))
    assert c.uncertainty > gain and c.name == fastest_equal
    # a tight profile: the gain stands
    prof, problem = _problem_with_spread(0.01, 0.001)
    c = choose(prof, problem, cands, equal=("gpipe_equal", "1f1b_equal"))
    assert c.name == "umopt auto" and 0 < c.uncertainty < gain


def test_where_the_model_cannot_tell_gpipe_from_1f1b_the_probe_runs_decide():
    prof, problem = _problem_with_spread(0.0, 0.5)  # a loose fit: every pick falls back to an equal schedule
    cands = _candidates(problem)
    times = {n: c.simulate(problem).iteration_ms for n, c in cands}
    faster, slower = sorted(("gpipe_equal", "1f1b_equal"), key=lambda n: times[n])
    assert choose(prof, problem, cands, equal=("gpipe_equal", "1f1b_equal")).name == faster
    # the probe runs of the faster-predicted order measured 20% over the fitted model, the other's 2% under
    order = {"gpipe_equal": "gpipe", "1f1b_equal": "1f1b"}
    ratio = {order[faster]: 1.2, order[slower]: 0.98}
    assert times[slower] * 0.98 < times[faster] * 1.2  # (the probes outweigh the prediction's difference)
    probed = prof.model_copy(
        update={
            "meta": ProfileMeta.model_validate(
                {**prof.meta.model_dump(), "probes": {"ran": True, "order_ratio": ratio}}
            )
        }
    )
    c = choose(probed, problem, cands, equal=("gpipe_equal", "1f1b_equal"))
    assert c.name == slower and f"{slower} over {faster}" in c.reason and f"{order[faster]} 1.20x" in c.reason
    assert c.gain == pytest.approx(times[faster] / times["umopt auto"] - 1)  # the gain stays the model's
    # probes that agree with the model change nothing
    level = prof.model_copy(
        update={
            "meta": ProfileMeta.model_validate(
                {
                    **prof.meta.model_dump(),
                    "probes": {"ran": True, "order_ratio": {"gpipe": 1.0, "1f1b": 1.0}},
                }
            )
        }
    )
    assert choose(level, problem, cands, equal=("gpipe_equal", "1f1b_equal")).name == faster


def test_run_ratios_are_measured_over_the_profiles_prediction():
    from umopt.costmodel import simulate
    from umopt.measure.calibrate import run_ratios

    prof, problem = _problem_with_spread(0.0, 0.0)
    cands = _candidates(problem)
    reports = []
    for k, (_, c) in enumerate(cands):
        predicted = simulate(problem.tables, c.ops(), 32).iteration_ms
        reports.append(
            RunReport(
                minibatch=32,
                recompute=False,
                measured_iteration_ms=predicted * (1 + 0.1 * k),
                ops=[[(kind, lo, hi, 0.0, 0.0) for kind, lo, hi in st] for st in c.ops()],
            )
        )
    assert run_ratios(prof, reports) == pytest.approx([1.0, 1.1, 1.2])


def _row(name: str, rounds_ms: list[float]) -> TuneRow:
    return TuneRow(name, "", 0.0, float(np.median(rounds_ms)), rounds_ms, "", "", "")


def test_tune_recommends_what_measured_fastest_and_never_worse_than_the_best_equal():
    gp, of = _row("gpipe_equal", [110, 112, 111, 113]), _row("1f1b_equal", [105, 104, 106, 105])
    # faster in every round, by about as much: recommended at a stated confidence
    d = pick([gp, of, _row("umopt", [100, 101, 99, 100])])
    assert (
        d.winner == "umopt"
        and "faster than 1f1b_equal over 4 paired rounds" in d.reason
        and d.confidence >= 0.95
    )
    # faster overall but only in two rounds of four: not at 95%
    d = pick([gp, of, _row("umopt", [100, 108, 99, 107])])
    assert d.winner == "1f1b_equal" and not d.decided
    # slower than the best equal one: never recommended, even if faster than the other equal one
    assert pick([gp, of, _row("umopt", [107, 107, 108, 107])]).winner == "1f1b_equal"
    # of two that beat it, the faster
    assert pick([gp, of, _row("umopt", [100, 101, 99, 100]), _row("ramp", [98, 99, 97, 99])]).winner == "ramp"
