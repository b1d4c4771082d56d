"""`umopt tune` end to end on a tiny model, and README's commands are the ones CI runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from umopt.cli import main

ROOT = Path(__file__).resolve().parent.parent


# the link given, not measured: these tests are about tune's steps (the link's measurement is
# tests/test_profiler.py's), and measuring it spawns a pair of processes
FAST_LINK = ["--link-latency-ms", "0.05", "--link-gbps", "10"]


@pytest.mark.slow  # (the suite within 10 minutes: CI runs the slow ones too)
def test_tune_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """Profile (backward split into B and W, probe runs), solve, then every schedule measured in
    turns: the equal GPipe and 1F1B, umopt's with and without W ops, ZB-H1's equal schedule."""
    out = tmp_path / "tune"
    main(
        [
            "tune",
            "--model",
            "mlp",
            "--model-arg",
            "layers=4",
            "--model-arg",
            "width=32",
            "--stages",
            "2",
            "--minibatch",
            "7",  # prime: the best equal count divides it only at 1 or 7 (the quickstart's 11/11/10 case)
            "--steps",
            "2",
            "--rounds",
            "2",
            "--budget",
            "20",
            "--time-limit",
            "1",
            "--zero-bubble",
            *FAST_LINK,
            "--out",
            str(out),
        ]
    )
    stdout = capsys.readouterr().out
    for name in ("gpipe_equal", "1f1b_equal", "umopt", "zbh1_equal"):
        assert name in stdout
        report = json.loads((out / f"report_{name}.json").read_text())  # the file, as JSON
        assert report["measured_iteration_ms"] > 0 and report["predicted_iteration_ms"] > 0
        assert (out / f"measured_{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "profile.json").exists() and (out / "umopt.json").exists()
    # umopt's schedule ran once: where it is an equal one, its report is that run's
    umopt = json.loads((out / "umopt.json").read_text())["stages"]
    for eq in ("gpipe_equal", "1f1b_equal"):
        if json.loads((out / f"{eq}.json").read_text())["stages"] == umopt:
            assert (out / f"report_{eq}.json").read_bytes() == (out / "report_umopt.json").read_bytes()
    # the profile was fitted to probe runs of the runtime (the machine has a core per stage)
    meta = json.loads((out / "profile.json").read_text())["meta"]
    assert meta["probes"]["ran"] and meta["calibration"]["op_overhead_ms"] >= 0
    # the profile says how to measure it again: the umopt profile command tune ran
    assert meta["command"].startswith(
        "umopt profile --model mlp --model-arg layers=4 --model-arg width=32 --stages 2"
    )
    assert "--split-backward" in meta["command"]
    prof = json.loads((out / "profile.json").read_text())
    assert all(st["backward_input_ms"] and st["backward_weight_ms"] for st in prof["stages"])
    zb = json.loads((out / "zbh1_equal.json").read_text())
    assert any(op[0] == "W" for st in zb["stages"] for op in st["ops"])
    # what measured fastest is recommended, and it is one of the schedules that ran
    assert "recommended (*):" in stdout and "confidence" in stdout
    report = json.loads((out / "report_gpipe_equal.json").read_text())
    assert report["rounds"] >= 2 and report["decision"]["confidence_asked"] == 0.95
    recommended = json.loads((out / "recommended.json").read_text())
    ran = [
        json.loads(p.read_text())
        for p in out.glob("*.json")
        if p.stem in ("gpipe_equal", "1f1b_equal", "umopt", "umopt_w", "zbh1_equal", "umopt_best", "ramp")
    ]
    assert any(r["stages"] == recommended["stages"] for r in ran)
    # the sentences cite the table: the lower bound's line names the fastest row at its time
    text = " ".join(stdout.split())
    pred = {}
    for line in stdout.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            pred[cells[0].split(" (=")[0].rstrip(" *")] = float(cells[2])
    m = re.search(r"the fastest schedule predicted, (\S+) \(([\d.]+) ms\)", text)
    assert m and pred[m[1]] == float(m[2]) == min(pred.values()), text
    # a bound above the fastest schedule holds only for those without W ops, and says so
    bound = re.search(r"lower bound ([\d.]+) ms for ([^:]+):", text)
    if float(bound[1]) > min(pred.values()) + 0.005:
        assert "without W ops" in bound[2] and "is below it" in text, text
    assert not re.search(r"-[\d.]+% faster than", text), text  # a gain below zero is not "faster"


def test_tune_refuses_cuda_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--device", "cuda", "--out", str(tmp_path / "t")])
    assert exc.value.code == 2
    assert "--device cuda asked for, but torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--lengths", "chat", "-B", "10", "--dp", "3"], "-B 10 sequences do not split among 3 replicas"),
        (["--lengths", "chat", "--dp", "2", "--peer-assign", "sorted"], "--peer-assign: unknown 'sorted'"),
        (["--dp", "2"], "--dp is for --lengths so far"),
    ],
)
def test_tune_refuses_replicas_it_cannot_split_in_one_line(tmp_path, capsys, argv, msg):
    """Before anything is profiled or written: exit 2, one line naming the problem."""
    with pytest.raises(SystemExit) as exc:
        main(["tune", *argv, "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and msg in err and "Traceback" not in err
    assert not (tmp_path / "t").exists()


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_quickstart_is_two_commands_and_ci_runs_the_test_one():
    commands = _quickstart_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    install_and_run, test = commands
    assert "umopt tune" in install_and_run
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines()


@pytest.mark.slow
def test_tune_with_chunks_measures_torch_multi_chunk_schedules_beside_one_chunk(tmp_path, capsys):
    """`umopt tune --chunks 2`: a layer-by-layer profile, and torch's fastest multi-chunk
    schedule measured in the same turns as the one-chunk ones (each layout its own model copy),
    as an equal reference the recommendation must beat."""
    out = tmp_path / "tune"
    argv = ["tune", "--model", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32", "--stages", "2"]
    argv += ["--minibatch", "8", "--steps", "2", "--rounds", "2", "--budget", "10", "--time-limit", "3"]
    main([*argv, "--chunks", "2", "--no-probes", *FAST_LINK, "--out", str(out)])
    stdout = capsys.readouterr().out
    prof = json.loads((out / "profile.json").read_text())
    assert len(prof["layers"]) >= 4
    torch_rows = [p for p in out.glob("torch_*.json")]
    assert len(torch_rows) == 1 and torch_rows[0].stem in stdout
    sched = json.loads(torch_rows[0].read_text())
    report = json.loads((out / f"report_{torch_rows[0].stem}.json").read_text())
    assert sched["chunks"]["ranks"] == report["chunks"]["ranks"] and len(sched["chunks"]["ranks"]) == 4
    assert report["measured_iteration_ms"] > 0 and report["rounds"] >= 2
    for name in ("gpipe_equal", "1f1b_equal", "umopt_one_chunk", "umopt"):
        assert name in stdout and (out / f"report_{name}.json").exists()
    assert "recommended (*):" in stdout and (out / "recommended.json").exists()


def _tune_lengths_argv(tmp_path, monkeypatch, layers: bool) -> list[str]:
    """``umopt tune --lengths chat --max-length 48`` of test_varlen_run's GPT, its profile by
    tokens a synthetic one of the same model (profiling by tokens is
    tests/test_lengths_profile.py's), layer by layer where ``layers``."""
    import sys

    import umopt.tune

    sys.path.insert(0, str(Path(__file__).parent))
    from test_varlen_run import ARGS, _run_profile

    monkeypatch.setattr(umopt.tune, "_profile", lambda *a, **k: _run_profile(tmp_path, layers=layers))
    args = [f"--model-arg={k}={v}" for k, v in ARGS.items() if k != "seq_len"]
    return ["tune", "--model", "gpt", *args, "--lengths", "chat", "--max-length", "48"]


@pytest.mark.slow
def test_tune_with_lengths_measures_umopt_plans_against_a_peers_on_the_same_minibatches(
    tmp_path, capsys, monkeypatch
):
    """``umopt tune --lengths``: a profile by tokens (here a synthetic one of the same gpt, for
    time: profiling by tokens is tests/test_lengths_profile.py's), then the steps planned by
    umopt, packing and DynaPipe in turns (after a probe run of umopt's plans fitted the costs by
    tokens), each on the layout its plan of the first minibatch chose
    among one chunk per rank and two (``--chunks 2``; DynaPipe has one only), each layout its own
    model copy; a sampler longer than --max-length is scaled to it."""
    out = tmp_path / "tune"
    argv = _tune_lengths_argv(tmp_path, monkeypatch, layers=True) + ["-B", "8"]
    argv += ["--methods", "umopt,pack,dynapipe", "--chunks", "2", "--steps", "1", "--rounds", "2"]
    main([*argv, "--budget", "1", "--out", str(out)])
    cap = capsys.readouterr()
    assert "chat's lengths scaled down" in cap.err and "layouts, each method's fastest" in cap.err
    # the costs by tokens were fitted to a probe run of sequences before the layouts were chosen
    fitted = json.loads((out / "profile.json").read_text())["meta"]["calibration"]["tokens"]
    assert "a probe run of sequences" in cap.err and (out / "probes" / "report_umopt.json").exists()
    # padding's plans probed too: the padded costs are fitted, not dropped (pad would go with them)
    assert (out / "probes" / "report_pad.json").exists()
    assert json.loads((out / "profile.json").read_text())["lengths"]["modes"] == ["packed", "padded"]
    assert fitted["iteration"]["steps"] == 8 and any(k.startswith("stage1.") for k in fitted)  # 4 of each
    methods = ("umopt", "pack", "dynapipe")
    reports = {m: json.loads((out / f"report_{m}.json").read_text()) for m in methods}
    plans = {m: json.loads((out / f"plan_{m}.json").read_text()) for m in methods}
    assert plans["dynapipe"]["chunks"] is None
    for m in methods:  # each method's steps on its own plan's layout, on the same minibatches
        assert reports[m]["chunks"] == plans[m]["chunks"], m
        assert reports[m]["lengths"]["tokens"] == reports["umopt"]["lengths"]["tokens"]
    assert all(r["lengths"]["data"] == "--lengths chat/85.3333" for r in reports.values())
    row = next(line for line in cap.out.splitlines() if line.startswith("│ pack"))
    got = float(row.split("│")[3]) * 1e3
    assert got == pytest.approx(reports["pack"]["lengths"]["tokens_per_s"], rel=0.01)
    # the last line trains what was recommended: its planner, on its plan's layout
    winner = reports["umopt"]["decision"]["winner"]
    assert (out / "plan.json").read_bytes() == (out / f"plan_{winner}.json").read_bytes()
    train = " ".join(cap.out.split("train with", 1)[1].split())
    assert f"({winner}'s plans)" in train and (
        "--methods" not in train if winner == "umopt" else f"--methods {winner}" in train
    )


@pytest.mark.slow
def test_tune_with_lengths_across_replicas_measures_each_as_it_would_train(tmp_path, capsys, monkeypatch):
    """``umopt tune --lengths --dp 2``: 2 stages x 2 replicas (4 processes), -B the global
    minibatch; umopt's steps on umopt's assignment, packing's on the contiguous split (as torch's
    DistributedSampler gives it), the same global minibatches; the table says who assigned each,
    and the line to train with carries --dp (and a peer's assignment where a peer won)."""
    out = tmp_path / "tune"
    argv = _tune_lengths_argv(tmp_path, monkeypatch, layers=False) + ["-B", "12", "--dp", "2"]
    argv += ["--methods", "umopt,pack", "--steps", "1", "--rounds", "2", "--no-probes", "--budget", "1"]
    main([*argv, "--out", str(out)])
    cap = capsys.readouterr()
    said, shown = " ".join(cap.err.split()), " ".join(cap.out.split())
    assert "across 2 replicas (each replica's share: umopt's steps by umopt's assignment" in said
    assert "2 stages x 2 replicas" in shown
    reports = {m: json.loads((out / f"report_{m}.json").read_text()) for m in ("umopt", "pack")}
    assert reports["umopt"]["dp"] == 2 and reports["pack"]["dp"] == 2
    assert reports["umopt"]["lengths"]["assign"] == "umopt"
    assert reports["pack"]["lengths"]["assign"] == "contiguous"
    # the same global minibatches (12 sequences a step), each replica's plan of its own 6 or so
    assert reports["umopt"]["lengths"]["tokens"] == reports["pack"]["lengths"]["tokens"]
    assert len(json.loads((out / "plan_umopt.json").read_text())["lengths"]["lengths"]) == 6
    assert "assigned by" in shown and "contiguous" in shown
    winner = reports["umopt"]["decision"]["winner"]
    train = shown.split("train with", 1)[1]
    assert "--dp 2" in train and ("--assign contiguous" in train) == (winner != "umopt")


def test_tunes_last_line_says_a_sure_pick_is_sure_when_only_the_others_are_open(capsys):
    """umopt decided faster than the best peer at 99.8% while two peers were not told apart: the
    pick is said to be decided, not "not decided" (which read as if the recommendation were unsure);
    a pick that is the reference by default stays "not decided"."""
    from umopt.cli.tune import _state

    from umopt.measure.decide import decide, pick_sure
    from umopt.tune import LengthsResult

    rounds = {
        "umopt": [90.0, 91.0, 89.0, 90.5, 90.2, 89.8],
        "pack": [100.0, 99.0, 101.0, 100.5, 99.5, 100.2],
        "dynapipe": [96.0, 104.0, 99.0, 106.0, 97.0, 103.0],  # about pack's, too noisy to tell apart
    }
    d = decide(rounds, equal=["pack", "dynapipe"])
    assert d.winner == "umopt" and not d.decided
    result = LengthsResult([], "", d.winner, d.reason, d.decided, [], [], pick_sure=pick_sure(d))
    assert _state(result) == "; the pick is decided, not every other pair when the budget ended"
    close = decide({"umopt": [100.0, 99.0, 101.0], "pack": [99.0, 101.0, 100.0]}, equal=["pack"])
    assert close.winner == "pack" and not pick_sure(close)
    result = LengthsResult(
        [], "", close.winner, close.reason, close.decided, [], [], pick_sure=pick_sure(close)
    )
    assert "not decided when the budget ended" in _state(result)
    # tune --lengths reads the decision from the run's report: the same rule on its record
    from umopt.formats.report import Decision as Recorded

    recorded = Recorded(
        winner="umopt", reference="pack", confidence=0.998, decided=False, confidence_asked=0.95, reason=""
    )
    assert pick_sure(recorded) and not pick_sure(recorded.model_copy(update={"winner": "pack"}))
