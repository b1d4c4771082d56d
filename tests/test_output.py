"""What umopt prints where there is no terminal (CI, nohup, torchrun): progress as plain lines,
-q for none, the runtime's own rank-prefixed lines under torchrun, library warnings as lines."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from umopt.cli import main


def test_solve_shows_plain_progress_lines_without_a_terminal_and_none_with_q(tmp_path, capsys):
    main(["solve", "gpt-sim", "-B", "16", "--time-limit", "2", "-o", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("umopt solve (auto): best ")]
    assert lines and all("\x1b[" not in ln for ln in lines), err  # plain text: no bar, no escape codes
    main(["-q", "solve", "gpt-sim", "-B", "16", "--time-limit", "1", "-o", str(tmp_path / "s.json")])
    captured = capsys.readouterr()
    assert "umopt solve" not in captured.err and "wrote" in captured.out


def test_library_warnings_reach_the_command_line_as_lines(capsys):
    from umopt.cli import _log_to, err

    _log_to(err, logging.INFO)
    logging.getLogger("umopt.measure").warning("a warning from deep inside")
    assert "umopt: warning: a warning from deep inside" in capsys.readouterr().err


@pytest.mark.slow
def test_run_shows_its_steps_as_lines_and_torchrun_ranks_speak_for_themselves(tmp_path, capsys, monkeypatch):
    from test_runtime import mlp_profile, write_schedule

    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "1f1b", False, 6)
    monkeypatch.setenv(
        "UMOPT_FAULT_SLOWER", "s:400"
    )  # steps long enough to be shown (a line a second at most)
    main(["run", path, "--steps", "4", "--warmup", "1"])
    monkeypatch.delenv("UMOPT_FAULT_SLOWER")
    err = capsys.readouterr().err
    assert "umopt run: " in err and "round 1, s" in err, err
    # under torchrun nothing of umopt's launcher is there: rank 0 says what it does, prefixed
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "umopt.cli",
            "run",
            path,
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "[rank 0] umopt: 2 ranks (2 stages x 1 replicas), gloo on cpu" in ran.stderr
    assert "[rank 0] umopt: s: measured" in ran.stderr and "[rank 1] umopt: s:" not in ran.stderr
    # every message once: not also through the command's own console
    assert ran.stderr.count("2 ranks (2 stages x 1 replicas)") == 1, ran.stderr[-2000:]
    assert ran.stderr.count("s: measured") == 1, ran.stderr[-2000:]
    # a CPU build of torch asked for NCCL: each rank says so in one line (exit code 2, no traceback
    # of ours) before it meets the others, so one process in torchrun's environment shows it
    # (torchrun itself, launcher and ranks, is three more starts of torch: 4 s of the suite)
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "t", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    env |= {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    ran = subprocess.run(
        [sys.executable, "-m", "umopt.cli", "run", path, "--steps", "1", "--backend", "nccl"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert re.fullmatch(r"\[rank 1\] umopt: error: --backend nccl needs CUDA GPUs[^\n]*\n", ran.stderr), (
        ran.stderr[-2000:]
    )
    assert "AttributeError" not in ran.stderr and "umopt/run" not in ran.stderr, ran.stderr[-2000:]


@pytest.mark.parametrize("text", ["--data mydata:ok", ":smile: [bold]x[/bold]"])
def test_errors_print_the_users_text_as_written(tmp_path, capsys, text):
    with pytest.raises(SystemExit):
        main(["run", str(tmp_path / f"{text}.json")])
    assert f"{text}.json" in capsys.readouterr().err


def test_solve_says_when_the_profile_caps_the_chunks(tmp_path, capsys):
    main(["solve", "gpt-sim", "-B", "96", "--time-limit", "1", "-o", str(tmp_path / "s.json")])
    assert "chunks are at most 64 samples: the profile was measured up to 64" in capsys.readouterr().out
    main(["solve", "gpt-sim", "-B", "32", "--time-limit", "1", "-o", str(tmp_path / "s.json")])
    assert "chunks are at most" not in capsys.readouterr().out


def test_tensor_spec_is_exported_for_input_specs():
    import torch

    import umopt

    assert umopt.TensorSpec((16, 8), torch.bfloat16).shape == (16, 8) and "TensorSpec" in umopt.__all__
