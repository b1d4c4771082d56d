"""Selection while training ([Note: selection while training]): a schedule file carries the
schedules its solve could not tell apart from its pick, and `umopt run` measures them in turns
over the first steps and keeps the fastest, without changing the training."""

from __future__ import annotations

import json
import re

import pytest
import torch
from umopt.cli import main

from umopt.costmodel import CostTables, simulate
from umopt.formats.schedule import load_schedule, make_schedule, save_schedule
from umopt.measure.decide import is_equal
from umopt.predict import check_against_profile
from umopt.search.problem import Candidate


def test_solve_writes_the_pick_and_its_rivals(tmp_path, capsys):
    main(["solve", "gpt-sim", "-B", "16", "--time-limit", "2", "-o", str(tmp_path / "s.json")])
    sched = load_schedule(str(tmp_path / "s.json"))
    names = [c.name for c in sched.candidates]
    # the best equal GPipe and 1F1B are always there (unless the pick is one of them), each once
    assert {"gpipe_equal", "1f1b_equal"} - {sched.solver.recommended} <= set(names)
    assert len(names) == len(set(names)) and all(c.op_lists() != sched.op_lists() for c in sched.candidates)
    from umopt.formats.profile import load_profile

    profile = load_profile(sched.profile.path)
    check_against_profile(sched, profile)  # every candidate valid, within the memory limit
    tables = CostTables.from_profile(profile, False)
    for c in sched.candidates:
        assert c.equal == is_equal(c.op_lists())
        assert c.predicted_iteration_ms == pytest.approx(simulate(tables, c.op_lists(), 16).iteration_ms)


def _with_candidate(tmp_path, profile, B):
    """A schedule file whose pick is unequal and whose one candidate is the equal 1F1B."""
    tables = CostTables.from_profile(profile, False)
    un = Candidate([[2, 4, 6], [6, 4, 2]], [[2, 4, 6], [6, 4, 2]], "1f1b").ops()
    eq = Candidate([[4, 4, 4]] * 2, [[4, 4, 4]] * 2, "1f1b").ops()
    cand = {
        "name": "eq",
        "equal": True,
        "stages": [{"ops": [list(op) for op in st]} for st in eq],
        "predicted_iteration_ms": simulate(tables, eq, B).iteration_ms,
    }
    solver = {"name": "test", "status": "feasible", "seconds": 0.0, "recommended": "un"}
    sched = make_schedule(profile, B, False, un, simulate(tables, un, B), solver, {}, candidates=[cand])
    path = tmp_path / "s.json"
    save_schedule(sched, str(path))
    return str(path)


@pytest.mark.parametrize("slow,winner", [("un", "eq"), ("eq", "un")])
def test_run_keeps_the_faster_schedule_and_trains_as_one_process(tmp_path, monkeypatch, capsys, slow, winner):
    from test_runtime import B, assert_trained_as_one_process, mlp_profile

    profile = mlp_profile(tmp_path, 2)
    path = _with_candidate(tmp_path, profile, B)
    monkeypatch.setenv("UMOPT_FAULT_SLOWER", f"{slow}:40")  # 40 ms a step on top of a few
    ck = tmp_path / "ck"
    main(
        [
            "run",
            path,
            "--steps",
            "16",
            "--select-steps",
            "14",
            "--warmup",
            "1",
            "--lr",
            "0.05",
            "--checkpoint",
            str(ck),
            "--report",
            str(tmp_path / "r.json"),
        ]
    )
    stdout = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    sel = report["selection"]
    assert sel["pick"] == "un" and sel["winner"] == winner and sel["decided"] and sel["confidence"] >= 0.95
    assert (
        sel["steps"] <= 14
        and (sel["steps"] - 2) % 4 == 0  # a first round of a step each, then rounds of two each
        and [c["name"] for c in sel["candidates"]] == ["un", "eq"]
    )
    # the report is the winner's, over the steps after selection (the warm-up step was selection's first)
    assert report["steps"] == 17 - sel["steps"] and report["trained_steps"] == 17
    assert report["warmup"] + report["selection_steps"] == sel["steps"]
    kept = load_schedule(path) if winner == "un" else load_schedule(path).candidate_schedule(0)
    assert [[tuple(op[:3]) for op in st] for st in report["ops"]] == [
        [tuple(op) for op in st] for st in kept.op_lists()
    ]
    assert f"kept (*) {winner}" in stdout
    # the summary says which steps each figure covers, and they add up
    text = " ".join(stdout.split())
    m = re.search(
        r"(\d+) steps: (\d+) warm-up, (\d+) of selection's turns, then the (\d+) measured above", text
    )
    assert m and int(m[1]) == int(m[2]) + int(m[3]) + int(m[4]) == 17, text
    assert int(m[4]) == report["steps"] and f"losses of all {m[1]} steps" in text
    assert all(b <= report["measured_iteration_ms"] for b in report["busy_ms"]["measured"])
    if winner == "eq":  # the pick lost: the report says what that means for the profile
        assert "umopt calibrate" in sel["note"]
    # the warm-up, the turns and the winner's steps: 17 SGD steps on batches 0..16, as one process
    assert_trained_as_one_process(ck, steps=17, lr=0.05)


def test_run_says_when_too_few_steps_allow_no_selection_and_no_select_runs_the_pick(tmp_path, capsys):
    from test_runtime import B, mlp_profile

    profile = mlp_profile(tmp_path, 2)
    path = _with_candidate(tmp_path, profile, B)
    main(["run", path, "--steps", "4", "--warmup", "0", "--report", str(tmp_path / "r.json")])
    sel = json.loads((tmp_path / "r.json").read_text())["selection"]
    assert sel["winner"] == "un" and sel["steps"] == 0 and "--select-steps 14 measures them" in sel["reason"]
    main(["run", path, "--steps", "2", "--warmup", "0", "--no-select", "--report", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["selection"] is None and report["steps"] == 2


def test_a_schedule_found_slower_stops_taking_turns_and_measuring_stops_at_its_cost():
    from types import SimpleNamespace

    from umopt.measure.decide import decide
    from umopt.run.selection import SELECT_COST
    from umopt.run.selection import keep_measuring as _keep_measuring

    def plays(*series):
        return [SimpleNamespace(name=n, step_ms=list(ms), turn_ms=list(ms)) for n, ms in series]

    # c is 30% slower in every round: it stops; a and b cannot be told apart yet: they go on
    ps = plays(
        ("a", [10.0, 10.2, 9.9, 10.1]), ("b", [10.1, 10.0, 10.2, 9.9]), ("c", [13.0, 13.1, 12.9, 13.2])
    )
    d = decide({p.name: p.step_ms for p in ps}, ["a", "b", "c"])
    stop, left = _keep_measuring(ps, [0, 1, 2], d, run_steps=1000)
    assert left == [0, 1]
    # the same turns in a short run: they have already cost more than SELECT_COST of it
    cost = sum(ms - 10.05 for p in ps for ms in p.step_ms)
    stop, _ = _keep_measuring(ps, [0, 1, 2], d, run_steps=int(cost / (SELECT_COST * 10.05)) - 1)
    assert stop


def test_a_users_pipeline_selects_too_and_trains_as_one_process(tmp_path):
    """umopt.Pipeline in a user's own loop, on a schedule file with candidates: the ranks agree on
    one schedule within the steps allowed, and 30 steps train exactly as one process."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import pipeline_user
    from test_pipeline import _run, _save

    ops = Candidate([[4, 8], [2, 4, 6]], [[4, 8], [2, 4, 6]], "1f1b").ops()
    path = _save(tmp_path, ops, False)
    sched = load_schedule(path)
    from umopt.formats.profile import load_profile

    tables = CostTables.from_profile(load_profile(sched.profile.path), False)
    rivals = []
    for name, order in (("gpipe_equal", "gpipe"), ("1f1b_equal", "1f1b")):
        eq = Candidate([[4, 4, 4]] * 2, [[4, 4, 4]] * 2, order).ops()
        rivals.append(
            {
                "name": name,
                "equal": True,
                "stages": [{"ops": [list(op) for op in st]} for st in eq],
                "predicted_iteration_ms": simulate(tables, eq, 12).iteration_ms,
            }
        )
    with_rivals = sched.model_validate({**sched.model_dump(), "candidates": rivals})
    save_schedule(with_rivals, path)
    got = _run(tmp_path, "select", path, steps=30)
    assert got[0]["selected"] == got[1]["selected"] in ("pick", "gpipe_equal", "1f1b_equal")
    assert got[0]["selection_steps"] <= 18
    want = pipeline_user.reference("mlp", steps=30)
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


def test_schedules_taking_turns_start_each_round_with_the_next_one():
    """The first to play a minibatch meets its shapes first (caches of kernels and allocators): each
    round starts with the next schedule, and each turn says, in its order, what is planned after it."""
    from types import SimpleNamespace

    import torch

    from umopt.run.options import RunOptions
    from umopt.run.rank import _turns

    played = []

    class Steps:
        def play(self, play, measured, end_of_round, what, turn, memory):
            played.append((play.name, turn.data, turn.following[1].name, turn.following[0], end_of_round))

    plays = [SimpleNamespace(name=n, warmup=0) for n in ("a", "b", "c")]
    opts = RunOptions(schedules=["x"], rounds=3, steps=1, warmup=0)
    rk = SimpleNamespace(
        cfg=SimpleNamespace(options=opts), speeds=[], device=torch.device("cpu"), start_step=0
    )
    rounds, _ = _turns(rk, plays, Steps())
    assert rounds == 3
    assert [p[0] for p in played] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [p[1] for p in played] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every schedule of a round on its minibatch
    # what is planned next: the round's next schedule, and after its last the next round's first
    assert [(p[2], p[3]) for p in played[:4]] == [("b", 0), ("c", 0), ("b", 1), ("c", 1)]
    assert [p[4] for p in played] == [False, False, True] * 3
