"""The runtime on CPU with gloo: real processes, gradients equal to one process, faults handled."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from umopt.costmodel import CostTables
from umopt.devices import numerics
from umopt.errors import UmoptError
from umopt.formats.profile import load_profile, save_profile
from umopt.formats.report import RunReport
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.measure.noise import run_warnings
from umopt.run.launch import RunFailed, launch
from umopt.run.options import RunOptions
from umopt.search.problem import Candidate
from umopt.synthetic import synthetic_profile
from umopt.zoo import build_model

MLP = {"layers": 6, "width": 24, "in_features": 12, "num_classes": 5}
B = 12


def mlp_profile(tmp_path, S):
    """A profile of the zoo's mlp split into S stages, with synthetic costs (device "sim")."""
    prof = synthetic_profile(S, max_size=8, seed=S, bytes_per_sample=MLP["width"] * 4)
    cuts = np.linspace(0, MLP["layers"], S + 1).round().astype(int).tolist()
    prof = prof.model_copy(
        update={
            "model": prof.model.model_copy(update={"name": "mlp", "args": dict(MLP)}),
            "stages": [
                st.model_copy(update={"layers": [cuts[s], cuts[s + 1]]}) for s, st in enumerate(prof.stages)
            ],
        }
    )
    path = tmp_path / f"mlp{S}.json"
    save_profile(prof, path)
    from umopt.formats.profile import load_profile

    return load_profile(path)


def checkpoint_state(folder, s):
    """Stage s's state in the folder's last complete checkpoint set."""
    import json

    manifest = json.loads((folder / "checkpoint.json").read_text())
    return torch.load(folder / manifest["files"][s]["path"], weights_only=True)


def assert_trained_as_one_process(folder, steps, lr, stages=2):
    """The last checkpoint set in ``folder`` holds the model one process has after ``steps``
    SGD steps at ``lr`` (see :func:`reference`)."""
    want = reference(steps=steps, lr=lr)
    got = {}
    for s in range(stages):
        state = checkpoint_state(folder, s)
        assert state["step"] == steps
        got.update(state["model"])
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def random_partition(rng, total, mx):
    parts = []
    while total:
        b = int(rng.integers(1, min(total, mx) + 1))
        parts.append(b)
        total -= b
    return parts


def write_schedule(tmp_path, profile, order, recompute, seed, name="s.json"):
    rng = np.random.default_rng(seed)
    S = profile.num_stages
    f = [random_partition(rng, B, 8) for _ in range(S)]
    b = [random_partition(rng, B, 8) for _ in range(S)] if recompute else f
    cand = Candidate(f, b, order)
    tables = CostTables.from_profile(profile, recompute)
    from umopt.costmodel import simulate

    ops = cand.ops()
    tl = simulate(tables, ops, B)
    sched = make_schedule(
        profile, B, recompute, ops, tl, {"name": "test", "status": "feasible", "seconds": 0.0}, {}
    )
    path = tmp_path / name
    save_schedule(sched, str(path))
    return str(path), cand


def reference(steps=1, lr=None):
    """Gradients (steps=1, no update) or parameters after `steps` SGD steps, in one process."""
    parts = build_model("mlp", MLP, seed=0)
    model = torch.nn.Sequential(*parts.layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr or 0.01, momentum=0.9)
    for step in range(steps):
        x, y = parts.make_batch(B, step)
        loss = parts.loss(model(x), y) / B
        loss.backward()
        if lr is not None:
            opt.step()
            opt.zero_grad()
    key = lambda n: "layers." + n  # noqa: E731  (Sequential names "3.0.weight")
    if lr is None:
        return {key(n): p.grad for n, p in model.named_parameters()}
    return {key(n): p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    # (every order, recompute and W placement plays through the same Pipeline in tests/test_lazy.py;
    # these run it through umopt run's launcher and ranks)
    "S,order,recompute,seed",
    [(2, "gpipe", False, 1), (3, "1f1b", True, 2)],
)
def test_gradients_equal_single_process(tmp_path, S, order, recompute, seed):
    profile = mlp_profile(tmp_path, S)
    path, cand = write_schedule(tmp_path, profile, order, recompute, seed)
    assert any(p != cand.fsizes[0] for p in cand.fsizes[1:]) or recompute  # stages chunk differently
    launch(RunOptions(schedules=[path], steps=1, warmup=0, save_grads=str(tmp_path / "g")), quiet=True)
    got = {}
    for s in range(S):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))
    want = reference()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # (the suite within 10 minutes: CI runs the slow ones too)
def test_three_steps_and_resume_match_single_process_training(tmp_path):
    profile = mlp_profile(tmp_path, 3)
    path, _ = write_schedule(tmp_path, profile, "1f1b", False, 7)
    launch(
        RunOptions(schedules=[path], steps=2, warmup=0, lr=0.05, checkpoint=str(tmp_path / "ck")),
        quiet=True,
    )
    launch(
        RunOptions(
            schedules=[path], steps=1, warmup=0, lr=0.05, checkpoint=str(tmp_path / "ck"), resume=True
        ),
        quiet=True,
    )
    want = reference(steps=3, lr=0.05)
    got = {}
    for s in range(3):
        state = checkpoint_state(tmp_path / "ck", s)
        assert state["step"] == 3
        got.update(state["model"])
    got = {
        "layers." + k.removeprefix("layers.") if not k.startswith("layers.") else k: v for k, v in got.items()
    }
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_schedules_take_turns_and_train_one_model(tmp_path, capsys):
    """Two schedules on the same processes, in turns: each gets its report, and the model they
    train together is the one a single process trains with the same batches."""
    from umopt.cli import main

    profile = mlp_profile(tmp_path, 2)
    a, _ = write_schedule(tmp_path, profile, "gpipe", False, 1, name="a.json")
    b, _ = write_schedule(tmp_path, profile, "1f1b", False, 2, name="b.json")
    ck = tmp_path / "ck"
    main(
        [
            "run",
            a,
            b,
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--lr",
            "0.05",
            "--checkpoint",
            str(ck),
            "--report",
            str(tmp_path / "r_{name}.json"),
        ]
    )
    stdout = capsys.readouterr().out
    assert "speedups over" in stdout and "a.json" in stdout and "b.json" in stdout
    import json

    for name in ("a", "b"):
        r = json.loads((tmp_path / f"r_{name}.json").read_text())
        assert r["schedule"].endswith(f"{name}.json") and r["rounds"] == 2 and r["schedules_in_turn"] == 2
        assert len(r["step_ms"]) == 2 and len(r["losses"]) == 3  # a warm-up and a step in each of two rounds
    # a: steps 0, 1; b: 2, 3; a: 4; b: 5 -- six SGD steps on batches 0..5
    assert_trained_as_one_process(ck, steps=6, lr=0.05)
    with pytest.raises(UmoptError, match=r"--report with 2 schedules needs \{name\}"):
        launch(RunOptions(schedules=[a, b], report=str(tmp_path / "r.json")))
    with pytest.raises(UmoptError, match="two schedules named a.json"):
        launch(RunOptions(schedules=[a, a]))


def _no_runtime_left():
    """The ranks this process launched that are still there (others' runs on the machine are not ours)."""
    mine = f"UMOPT_LAUNCHER_PID={os.getpid()}".encode()
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mine in (proc / "environ").read_bytes().split(b"\0"):
                left.append(proc.name)
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return left


@pytest.mark.parametrize(
    "fault,expected",
    [
        ("1:1:raise", "rank 1 (stage 1) failed: RuntimeError: injected fault at step 1"),
        ("1:1:kill", "rank 1 (stage 1) ended without a word: killed by SIGKILL"),
        # rank 0 waits forever (as on a GPU, where waiting ranks never raise) and the launcher
        # stops it with SIGTERM: that rank is not the one to blame
        ("0:1:hang,1:1:raise", "rank 1 (stage 1) failed: RuntimeError: injected fault at step 1"),
    ],
)
def test_a_failing_rank_ends_the_run(tmp_path, monkeypatch, fault, expected):
    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "gpipe", False, 5)
    monkeypatch.setenv("UMOPT_FAULT", fault)
    t0 = time.perf_counter()
    with pytest.raises(RunFailed) as exc:
        launch(RunOptions(schedules=[path], steps=5, warmup=0), quiet=True)
    assert time.perf_counter() - t0 < 60
    assert expected in str(exc.value) and exc.value.exit_code == 1
    time.sleep(0.5)
    assert _no_runtime_left() == []


def test_a_rank_failing_in_the_middle_of_a_step_is_named_at_once(tmp_path, monkeypatch):
    """The middle rank of three raises at its second forward, with receives posted on both of its
    links and its neighbours' sends in flight: its own words reach the launcher, within seconds
    (not after a communicator's teardown waits for them, or a watchdog's timeout)."""
    profile = mlp_profile(tmp_path, 3)
    path, _ = write_schedule(tmp_path, profile, "1f1b", False, 7)
    monkeypatch.setenv("UMOPT_FAULT", "1:1:midstep")
    monkeypatch.setenv("UMOPT_TIMEOUT_S", "300")  # a wait that timed out would not end within the bound below
    t0 = time.perf_counter()
    with pytest.raises(
        RunFailed, match=r"rank 1 \(stage 1\) failed: RuntimeError: injected fault in the middle of step 1"
    ):
        launch(RunOptions(schedules=[path], steps=5, warmup=0), quiet=True)
    assert time.perf_counter() - t0 < 60  # (seconds: a rank waiting for its lost peer would take 300)
    time.sleep(0.5)
    assert _no_runtime_left() == []


def test_a_run_says_when_its_numerics_differ_from_the_profiles_and_refuses_float16(tmp_path):
    """The profile says it was timed with TF32 matmuls, this run has them off: the report lists
    the difference and the run's warnings say so; a float16 profile is refused before any process."""
    profile = mlp_profile(tmp_path, 2)
    now = numerics()
    timed = profile.model_copy(
        update={
            "device": profile.device.model_copy(
                update={"numerics": {**now, "matmul_tf32": not now["matmul_tf32"]}}
            )
        }
    )
    save_profile(timed, tmp_path / "timed.json")
    path, _ = write_schedule(tmp_path, load_profile(tmp_path / "timed.json"), "gpipe", False, 3)
    report = launch(RunOptions(schedules=[path], steps=1, warmup=0), quiet=True).report
    assert report.numerics_differ == [
        f"matmul_tf32: profiled {not now['matmul_tf32']}, now {now['matmul_tf32']}"
    ]
    assert any("other numerics than its profile was timed under" in w for w in run_warnings(report))
    half = profile.model_copy(update={"device": profile.device.model_copy(update={"dtype": "float16"})})
    save_profile(half, tmp_path / "half.json")
    path, _ = write_schedule(
        tmp_path, load_profile(tmp_path / "half.json"), "gpipe", False, 3, name="s16.json"
    )
    with pytest.raises(UmoptError, match="float16 training needs loss scaling .* use bfloat16"):
        launch(RunOptions(schedules=[path]))


def test_mismatched_schedule_is_rejected_before_any_process(tmp_path):
    p2, p3 = mlp_profile(tmp_path, 2), mlp_profile(tmp_path, 3)
    path, _ = write_schedule(tmp_path, p2, "gpipe", False, 5)
    with pytest.raises(UmoptError, match="schedule has 2 stages but profile"):
        launch(RunOptions(schedules=[path], profile=p3.path))
    save_profile(p2.with_memory_limit(10**12), tmp_path / "other.json")  # same model, other numbers
    with pytest.raises(UmoptError, match="made for another profile"):
        launch(RunOptions(schedules=[path], profile=str(tmp_path / "other.json")))


def test_run_options_are_the_command_lines_and_what_the_ranks_read(tmp_path, monkeypatch):
    """umopt run's click options become one RunOptions; the ranks read it back from the
    launcher's file, and a schedule given where that file belongs is refused with the torchrun hint."""
    from umopt.cli import cli

    import umopt.run.launch

    seen = []

    class Launched(Exception):
        pass

    def launched(opts, **kw):  # what umopt run hands the launcher, instead of starting ranks
        seen.append(opts)
        raise Launched

    monkeypatch.setattr(umopt.run.launch, "launch", launched)
    argv = ["a.json", "b.json", "--steps", "3", "--no-select", "--decide", "0.9", "--checkpoint-every", "2"]
    with pytest.raises(Launched):
        cli.main(["run", *argv], standalone_mode=False)
    assert seen == [
        RunOptions(schedules=["a.json", "b.json"], steps=3, select=False, decide=0.9, checkpoint_every=2)
    ]
    path = tmp_path / "options.json"
    path.write_text(seen[0].model_dump_json())
    assert RunOptions.read(path) == seen[0]
    profile = mlp_profile(tmp_path, 2)
    schedule, _ = write_schedule(tmp_path, profile, "gpipe", False, 2)
    with pytest.raises(UmoptError, match=r"not the options file .* -m umopt.cli run SCHEDULE"):
        RunOptions.read(schedule)


def test_run_command_reports_and_refuses_bad_input(tmp_path, capsys):
    from umopt.cli import main

    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "1f1b", False, 6)
    report, trace, png = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "m.png"
    argv = [
        "run",
        path,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--report",
        str(report),
        "--trace",
        str(trace),
        "--plot",
        str(png),
    ]
    main(argv)
    assert "measured / predicted" in capsys.readouterr().out
    import json

    r = json.loads(report.read_text())
    assert r["measured_iteration_ms"] > 0 and r["predicted_iteration_ms"] > 0
    assert r["measured_over_predicted"] == pytest.approx(
        r["measured_iteration_ms"] / r["predicted_iteration_ms"]
    )
    assert len(r["step_ms"]) == 2 and len(r["busy_ms"]["measured"]) == 2
    # every op's median time beside its prediction, which `umopt calibrate` fits the profile to
    from umopt.formats.schedule import load_schedule

    assert [[tuple(op[:3]) for op in st] for st in r["ops"]] == [
        [tuple(op) for op in st.ops] for st in load_schedule(path).stages
    ]
    assert all(op[3] > 0 and op[4] > 0 for st in r["ops"] for op in st)
    capsys.readouterr()
    main(["calibrate", profile.path, str(report), "-o", str(tmp_path / "cal.json")])
    assert "calibration" in json.loads((tmp_path / "cal.json").read_text())["meta"]
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert "process_name" in names and any(n.startswith("B(") for n in names)
    assert png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["run", str(tmp_path / "missing.json")])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_two_data_parallel_replicas_of_the_pipeline_train_as_one_process_on_the_global_minibatch(tmp_path):
    """PP=2 x DP=2, four processes: each replica runs its own unequal schedule on its half of the
    global minibatch, each stage's gradients averaged over the replicas."""
    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "1f1b", False, 9)
    report = launch(
        RunOptions(schedules=[path], dp=2, steps=1, warmup=0, save_grads=str(tmp_path / "g")), quiet=True
    ).report
    # the schedule was solved for one pipeline and the profile knows no all-reduce speed: said so
    assert report.dp == 2 and report.allreduce is None and len(report.allreduce_ms.measured) == 2
    assert any("leaves out their all-reduce" in w for w in run_warnings(report))
    got = {}
    for s in range(2):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt", weights_only=True))
    parts = build_model("mlp", MLP, seed=0)
    model = torch.nn.Sequential(*parts.layers)
    x, y = parts.make_batch(2 * B, 0)
    (parts.loss(model(x), y) / (2 * B)).backward()
    want = {"layers." + n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recompute,seed", [(True, 6)])
def test_zero_bubble_schedules_on_three_stages_give_single_process_gradients(tmp_path, recompute, seed):
    """W ops on every stage, the middle one included (inputs and outputs both carry gradients):
    umopt's W placement on a random unequal schedule, run by `umopt run`."""
    from umopt.costmodel import simulate
    from umopt.search.problem import Problem
    from umopt.search.zerobubble import best_with_weight_ops

    profile = mlp_profile(tmp_path, 3)
    _, cand = write_schedule(tmp_path, profile, "1f1b", recompute, seed)
    problem = Problem(CostTables.from_profile(profile, recompute), B)
    ops, tl = best_with_weight_ops(problem, cand.ops())
    assert all(any(op.kind == "W" for op in st) for st in ops)
    path = tmp_path / "w.json"
    save_schedule(
        make_schedule(
            profile,
            B,
            recompute,
            ops,
            simulate(problem.tables, ops, B),
            {"name": "w", "status": "feasible", "seconds": 0.0},
            {},
        ),
        str(path),
    )
    launch(RunOptions(schedules=[str(path)], steps=1, warmup=0, save_grads=str(tmp_path / "g")), quiet=True)
    got = {}
    for s in range(3):
        got.update(torch.load(tmp_path / "g" / f"grads_stage{s}.pt"))
    want = reference()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_a_run_on_more_ranks_than_cores_is_blamed_on_that_not_on_another_job(monkeypatch):
    import umopt.measure.noise as noise

    monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    report = RunReport(schedule="s.json", measured_over_predicted=2.6, backend="gloo", stages=8, dp=1)
    (line,) = run_warnings(report)
    assert "8 ranks on 2 cores" in line and "another job" not in line
    (line,) = run_warnings(report.model_copy(update={"stages": 2}))
    assert "another job on the machine" in line
