"""Faults, interrupts and hostile files: checkpoints that are not what they claim, ranks that die,
users who press Ctrl-C, time limits at the largest sizes."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_runtime import mlp_profile, write_schedule

from umopt.errors import UmoptError
from umopt.run.checkpoint import MANIFEST, read_manifest
from umopt.run.launch import RunFailed, launch
from umopt.run.options import RunOptions


class _Payload:
    """Unpickling this runs a command: what a hostile checkpoint carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def checkpoint_set(tmp_path_factory):
    """A 2-stage run's checkpoint set after one step, and the schedule that made it."""
    tmp = tmp_path_factory.mktemp("ck")
    profile = mlp_profile(tmp, 2)
    path, _ = write_schedule(tmp, profile, "gpipe", False, 3)
    launch(RunOptions(schedules=[path], steps=1, warmup=0, checkpoint=str(tmp / "ck")), quiet=True)
    return tmp, path, profile


def _copy_set(checkpoint_set, tmp_path) -> tuple[Path, dict]:
    src, path, _ = checkpoint_set
    ck = tmp_path / "ck"
    shutil.copytree(src / "ck", ck)
    return ck, json.loads((ck / MANIFEST).read_text())


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_without_running_it(checkpoint_set, tmp_path):
    _, path, _ = checkpoint_set
    ck, manifest = _copy_set(checkpoint_set, tmp_path)
    marker = tmp_path / "pwned"
    victim = ck / manifest["files"][0]["path"]
    torch.save({"model": _Payload(marker), "optimizer": {}, "step": 1}, victim, pickle_protocol=2)
    # its hash no longer matches the manifest: refused before any process starts
    with pytest.raises(UmoptError, match="does not match its hash"):
        launch(RunOptions(schedules=[path], steps=1, warmup=0, checkpoint=str(ck), resume=True), quiet=True)
    # and with the manifest forged to match, the rank loads plain tensors only and refuses it
    import hashlib

    manifest["files"][0]["sha256"] = hashlib.sha256(victim.read_bytes()).hexdigest()
    (ck / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        RunFailed, match=r"rank 0 \(stage 0\) failed: UmoptError: --resume: .* is not stage 0's state"
    ):
        launch(RunOptions(schedules=[path], steps=1, warmup=0, checkpoint=str(ck), resume=True), quiet=True)
    assert not marker.exists()
    assert pickle.dumps(_Payload(marker))  # the payload itself is real


def test_a_mixed_or_incomplete_checkpoint_set_is_refused(checkpoint_set, tmp_path):
    _, path, profile = checkpoint_set
    ck, manifest = _copy_set(checkpoint_set, tmp_path)
    resume = RunOptions(schedules=[path], steps=1, warmup=0, checkpoint=str(ck), resume=True)
    # stage 1's file replaced by a state of another step: not the set the manifest made
    other = ck / manifest["files"][1]["path"]
    state = torch.load(other, weights_only=True)
    state["step"] = 7
    torch.save(state, other)
    with pytest.raises(UmoptError, match="stage1-step1-.*does not match its hash"):
        launch(resume, quiet=True)
    other.unlink()
    with pytest.raises(UmoptError, match="is missing: the set of step 1 is incomplete"):
        launch(resume, quiet=True)
    (ck / MANIFEST).unlink()
    with pytest.raises(UmoptError, match="no complete checkpoint set .*1 stage file"):
        launch(resume, quiet=True)
    # a set of another optimizer is not this run's either
    ck2, _ = _copy_set(checkpoint_set, tmp_path / "b")
    with pytest.raises(UmoptError, match="a checkpoint of the sgd optimizer, this run uses adamw"):
        read_manifest(ck2, profile, "adamw")


def test_a_failed_checkpoint_write_keeps_the_last_complete_set(tmp_path, monkeypatch):
    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "gpipe", False, 4)
    ck = tmp_path / "ck"
    # rank 1 can no longer write a file over 1 KiB from step 1 on: the set of step 1 completes,
    # the set of step 2 fails on rank 1
    monkeypatch.setenv("UMOPT_FAULT", "1:1:diskfull")
    with pytest.raises(RunFailed, match=r"rank 1 \(stage 1\) failed: OSError"):
        launch(
            RunOptions(schedules=[path], steps=3, warmup=0, checkpoint=str(ck), checkpoint_every=1),
            quiet=True,
        )
    assert read_manifest(ck, profile, "sgd").step == 1  # every file there, every hash right


@pytest.mark.slow
def test_checkpoint_waits_are_bounded_by_the_io_timeout_not_the_steps(tmp_path, monkeypatch):
    """[Note: two timeouts]: rank 1 writes its checkpoint file 3 s late. With the steps' bound at
    2 s the run still completes (the wait for it is an I/O wait); with the I/O bound at 2 s the
    waiting rank fails, naming the wait and its bound."""
    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "gpipe", False, 4)
    monkeypatch.setenv("UMOPT_FAULT", "1:0:slowio")
    monkeypatch.setenv("UMOPT_FAULT_SLOW_S", "3")
    monkeypatch.setenv("UMOPT_TIMEOUT_S", "2")
    launch(RunOptions(schedules=[path], steps=1, warmup=0, checkpoint=str(tmp_path / "a")), quiet=True)
    assert read_manifest(tmp_path / "a", profile, "sgd").step == 1
    monkeypatch.setenv("UMOPT_TIMEOUT_S", "60")
    monkeypatch.setenv("UMOPT_IO_TIMEOUT_S", "2")
    with pytest.raises(
        RunFailed,
        match=r"rank 0 \(stage 0\) failed: UmoptError: waiting for every stage's checkpoint file of step 1 \(at most UMOPT_IO_TIMEOUT_S=2 s\)",
    ):
        launch(RunOptions(schedules=[path], steps=1, warmup=0, checkpoint=str(tmp_path / "b")), quiet=True)


@pytest.mark.parametrize("k", [1, 2])
def test_a_killed_rank_is_the_one_named(tmp_path, monkeypatch, k):
    profile = mlp_profile(tmp_path, 3)
    path, _ = write_schedule(tmp_path, profile, "1f1b", False, 5)
    monkeypatch.setenv("UMOPT_FAULT", f"{k}:1:kill")
    with pytest.raises(RunFailed, match=rf"rank {k} \(stage {k}\) ended without a word: killed by SIGKILL"):
        launch(RunOptions(schedules=[path], steps=4, warmup=0), quiet=True)


def _detached() -> None:
    """In the child before exec: a new sid (its pid), and SIGINT's default action."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(argv: list[str], tmp_path: Path) -> subprocess.Popen:
    """``umopt ...`` detached (setsid: it and every process it starts share its pid as their
    sid), with Ctrl-C's default (a shell's background job would ignore SIGINT), temp files in
    ``tmp_path``."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen(
        [sys.executable, "-m", "umopt.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_detached,
    )


def _processes_of(sid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()
    return [p for p in out if int(p) != os.getpid()]


def _gone_within(sid: int, seconds: float) -> float:
    t0 = time.monotonic()
    while _processes_of(sid) and time.monotonic() - t0 < seconds + 10:
        time.sleep(0.05)
    assert not _processes_of(sid), f"left running: {_processes_of(sid)}"
    return time.monotonic() - t0


def _wait_for_ranks(sid: int, n: int, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        out = subprocess.run(
            ["pgrep", "-s", str(sid), "-f", "umopt.run.rank"], capture_output=True, text=True
        ).stdout.split()
        if len(out) >= n:
            time.sleep(4)  # into the steps
            return
        time.sleep(0.2)
    raise AssertionError("the ranks did not start")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGKILL, None)])
def test_an_interrupted_run_leaves_no_process_and_no_temp_folder(tmp_path, sig, code):
    profile = mlp_profile(tmp_path, 2)
    path, _ = write_schedule(tmp_path, profile, "gpipe", False, 6)
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = _start(["run", path, "--steps", "100000", "--warmup", "0"], temp)
    _wait_for_ranks(proc.pid, 2)
    os.kill(proc.pid, sig)  # SIGKILL: the launcher itself dies, the ranks must notice
    t0 = time.monotonic()
    proc.wait(timeout=30)
    assert time.monotonic() - t0 + _gone_within(proc.pid, 30) < 30  # (seconds; a rank left behind: never)
    if code is not None:
        assert proc.returncode == code and "interrupted by SIGINT" in proc.stderr.read()
        assert list(temp.glob("umopt-run-*")) == []


def test_an_interrupted_solve_leaves_no_process_and_no_file(tmp_path):
    out = tmp_path / "s.json"
    proc = _start(["solve", "gpt-sim", "-B", "32", "--time-limit", "60", "-o", str(out)], tmp_path)
    time.sleep(4)  # the GA and the bounds beside it at work
    os.kill(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    proc.wait(timeout=30)
    assert time.monotonic() - t0 + _gone_within(proc.pid, 30) < 30  # (seconds; a rank left behind: never)
    assert proc.returncode == 130 and not out.exists()


def test_the_time_limit_holds_for_the_whole_command_at_large_minibatches(tmp_path, capsys):
    from conftest import run_cli

    run_cli(
        ["solve", "gpt-sim", "-B", "64", "--time-limit", "0.5", "-o", str(tmp_path / "warm.json")], capsys
    )
    t0 = time.perf_counter()
    code, _, err = run_cli(
        ["solve", "gpt-sim", "-B", "2048", "--time-limit", "2", "-o", str(tmp_path / "s.json")], capsys
    )
    assert code == 0, err
    assert time.perf_counter() - t0 < 2 * 1.05 + 2  # the promise: the time limit, 5% and 2 s
