"""The paired test over rounds that decides between schedules measured in turns (umopt.measure.decide),
alone on constructed round times and in a run whose step times are made by construction."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from umopt.measure.decide import compare, decide, is_equal


def rounds(ms, n, spread, seed):
    """``n`` rounds of a schedule near ``ms``, each round's drift shared (as a machine's is) by the seed."""
    rng = np.random.default_rng(seed)
    drift = 1 + rng.uniform(-spread, spread, n)
    return (ms * drift).tolist()


def test_a_faster_schedule_wins_only_at_the_stated_confidence():
    # in turns the drift meets both alike, so 4.6% shows through a shared +-15% drift
    ref = rounds(100.0, 6, 0.15, seed=0)
    fast = [r / 1.046 * (1 + e) for r, e in zip(ref, np.random.default_rng(1).uniform(-0.01, 0.01, 6))]
    d = decide(
        {"gpipe_equal": ref, "1f1b_equal": [r * 1.1 for r in ref], "umopt": fast},
        ["gpipe_equal", "1f1b_equal"],
    )
    assert d.winner == "umopt" and d.reference == "gpipe_equal" and d.decided and d.confidence > 0.99
    assert re.search(r"4\.\d% faster than gpipe_equal over 6 paired rounds, at >99.9% confidence", d.reason)
    assert "not told apart" not in d.reason
    # the winner sure, two references not told apart by their noise: the turns go on, and say why
    twin = [r * (1 + e) for r, e in zip(ref, np.random.default_rng(2).uniform(-0.06, 0.06, 6))]
    d = decide({"pack": ref, "dynapipe": twin, "umopt": fast}, ["pack", "dynapipe"])
    assert d.winner == "umopt" and not d.decided and "not told apart yet" in d.reason
    # the case: 4.6% faster overall, but slower in 2 of 4 rounds: not at 95%, so not decided,
    # and the equal schedule is kept
    ref4 = [100.0, 100.0, 100.0, 100.0]
    mixed = [90.0, 88.0, 101.0, 102.0]
    c = compare("umopt", ref4, mixed)
    assert 0.5 < c.faster < 0.95
    d = decide({"1f1b_equal": ref4, "umopt": mixed}, ["gpipe_equal", "1f1b_equal"])
    assert d.winner == "1f1b_equal" and not d.decided and "closest: umopt" in d.reason


def test_a_schedule_no_faster_is_decided_against_when_the_rounds_are_tight():
    ref = rounds(100.0, 8, 0.2, seed=3)
    same = [r * (1 + e) for r, e in zip(ref, np.random.default_rng(4).uniform(-0.002, 0.002, 8))]
    d = decide({"gpipe_equal": ref, "umopt": same}, ["gpipe_equal"])
    assert d.winner == "gpipe_equal" and d.decided and d.confidence > 0.95
    with pytest.raises(ValueError, match="no equal schedule"):
        decide({"umopt": same}, ["gpipe_equal"])
    assert compare("x", [1.0], [0.5]).faster == 0.5  # one round says nothing


def test_an_equal_schedule_is_one_with_every_chunk_one_size():
    assert is_equal(
        [[("F", 0, 4), ("F", 4, 8), ("B", 0, 4), ("B", 4, 8)], [("F", 0, 4), ("F", 4, 8), ("W", 0, 4)]]
    )
    assert not is_equal([[("F", 0, 4), ("F", 4, 8)], [("F", 0, 2), ("F", 2, 8)]])
    # as equal as the minibatch allows: 11/11/10 of 32 is what torch and Megatron run
    thirds = [("F", 0, 11), ("F", 11, 22), ("F", 22, 32), ("B", 0, 11), ("B", 11, 22), ("B", 22, 32)]
    assert is_equal([thirds, thirds])
    assert not is_equal([[("F", 0, 12), ("F", 12, 22), ("F", 22, 32)]])  # 12/10/10 differ by two
    # sizes of one and two, but 2 chunks on one stage and 3 on the other: two partitions
    assert not is_equal([[("F", 0, 2), ("F", 2, 4)], [("F", 0, 1), ("F", 1, 2), ("F", 2, 4)]])


def _partition_schedule(tmp_path, profile, name, parts, minibatch):
    from umopt.costmodel import CostTables, simulate
    from umopt.formats.schedule import make_schedule, save_schedule
    from umopt.search.problem import Candidate

    ops = Candidate(parts, parts, "gpipe").ops()
    tables = CostTables.from_profile(profile, False)
    sched = make_schedule(
        profile,
        minibatch,
        False,
        ops,
        simulate(tables, ops, minibatch),
        {"name": name, "status": "feasible", "seconds": 0.0},
        {},
    )
    save_schedule(sched, str(tmp_path / f"{name}.json"))
    return str(tmp_path / f"{name}.json")


def test_decide_takes_an_equal_schedule_that_the_minibatch_does_not_divide(tmp_path):
    # the quickstart's first try: 3 microbatches best at B=32 gives 11/11/10, which --decide refused
    from test_runtime import mlp_profile

    from umopt.run.options import RunOptions, preflight

    profile = mlp_profile(tmp_path, 2)
    eq = _partition_schedule(tmp_path, profile, "eq", [[3, 3, 2]] * 2, 8)
    un = _partition_schedule(tmp_path, profile, "un", [[2, 6], [6, 2]], 8)
    cfg = preflight(RunOptions(schedules=[eq, un], decide=0.95))
    assert len(cfg.schedules) == 2


def test_schedules_of_different_minibatches_are_not_compared(tmp_path):
    from test_runtime import mlp_profile

    from umopt.errors import UmoptError
    from umopt.run.options import RunOptions, preflight

    profile = mlp_profile(tmp_path, 2)
    a = _partition_schedule(tmp_path, profile, "a", [[4, 4]] * 2, 8)
    b = _partition_schedule(tmp_path, profile, "b", [[4, 4, 1]] * 2, 9)
    with pytest.raises(UmoptError, match="a trains 8 samples a step and b 9: .*same minibatch"):
        preflight(RunOptions(schedules=[a, b]))


@pytest.mark.parametrize("slow,winner", [("eq", "un"), ("un", "eq")])
def test_a_run_takes_turns_until_the_faster_schedule_is_decided(tmp_path, monkeypatch, capsys, slow, winner):
    from test_runtime import B, mlp_profile
    from umopt.cli import main

    from umopt.costmodel import CostTables, simulate
    from umopt.formats.schedule import make_schedule, save_schedule
    from umopt.search.problem import Candidate

    profile = mlp_profile(tmp_path, 2)
    tables = CostTables.from_profile(profile, False)
    for name, parts in (("eq", [[4, 4, 4]] * 2), ("un", [[2, 4, 6], [6, 4, 2]])):
        ops = Candidate(parts, parts, "1f1b").ops()
        save_schedule(
            make_schedule(
                profile,
                B,
                False,
                ops,
                simulate(tables, ops, B),
                {"name": name, "status": "feasible", "seconds": 0.0},
                {},
            ),
            str(tmp_path / f"{name}.json"),
        )
    monkeypatch.setenv(
        "UMOPT_FAULT_SLOWER", f"{slow}:40"
    )  # 40 ms a step on top of a few: decided in a few rounds
    main(
        [
            "run",
            str(tmp_path / "eq.json"),
            str(tmp_path / "un.json"),
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--decide",
            "0.95",
            "--max-rounds",
            "12",
            "--report",
            str(tmp_path / "r_{name}.json"),
        ]
    )
    reports = {n: json.loads((tmp_path / f"r_{n}.json").read_text()) for n in ("eq", "un")}
    d = reports["eq"]["decision"]
    assert (
        d == reports["un"]["decision"] and d["winner"] == winner and d["decided"] and d["confidence"] >= 0.95
    )
    assert 2 <= reports["eq"]["rounds"] < 12 and len(reports["eq"]["round_ms"]) == reports["eq"]["rounds"]
    assert f"keep {winner}:" in capsys.readouterr().out


def test_decide_refuses_what_it_cannot_decide(tmp_path):
    from test_runtime import mlp_profile, write_schedule

    from umopt.errors import UmoptError
    from umopt.run.launch import launch
    from umopt.run.options import RunOptions

    profile = mlp_profile(tmp_path, 2)
    a, _ = write_schedule(tmp_path, profile, "gpipe", False, 1, name="a.json")
    b, _ = write_schedule(tmp_path, profile, "1f1b", False, 2, name="b.json")
    with pytest.raises(UmoptError, match="--decide compares with an equal schedule"):
        launch(RunOptions(schedules=[a, b], decide=0.95))
    with pytest.raises(UmoptError, match="--decide needs two schedules"):
        launch(RunOptions(schedules=[a], decide=0.95))
    with pytest.raises(UmoptError, match="--decide is a confidence between 0.5 and 1"):
        launch(RunOptions(schedules=[a, b], decide=95.0))


def test_with_methods_the_peers_plans_are_the_reference_umopt_must_beat():
    """A run of sequences (--methods): umopt's plans are the candidate, the peers' the reference;
    a peer measured faster, even where the rounds cannot say so at 95%, is kept, never umopt."""
    from types import SimpleNamespace

    from umopt.run.rank import _decision

    def play(method, ms):
        return SimpleNamespace(name=method, method=method, step_ms=ms, schedule=None)

    plays = [
        play("umopt", [100.0, 100.0, 100.0]),
        play("pack", [110.0, 111.0, 109.0]),
        play("dynapipe", [86.0, 101.0, 90.0]),  # faster, not decided over three rounds
    ]
    d = _decision(plays, steps=1, confidence=0.95)
    assert d.reference == "dynapipe" and d.winner == "dynapipe" and not d.decided
    # umopt faster than every peer at 95%: then it is kept
    plays[0].step_ms = [80.0, 81.0, 79.5]
    d = _decision(plays, steps=1, confidence=0.95)
    assert d.winner == "umopt" and d.reference == "dynapipe"
