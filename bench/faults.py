"""Faults injected into real runs of ``umopt run`` (3 ranks, gloo, a checkpoint set every step),
and what umopt did about each: how long until every process was gone, the exit code, the rank it
named, and whether the last complete checkpoint set was still there to resume from.

    python bench/faults.py            # about 4 minutes on 2 cores

Rows: kill -9 of each rank from outside; SIGINT and SIGTERM to ``umopt run``; SIGKILL to
``umopt run`` itself (the ranks' launcher); a full disk on one rank while it writes its checkpoint
(a file size limit: a real failed write); a corrupted stage file and a stage file carrying a pickle
payload, each given to ``--resume``. Target: every row ends within 5 s, names the right rank, and
keeps the last complete set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from umopt.errors import UmoptError
from umopt.formats.profile import load_profile, save_profile
from umopt.formats.schedule import make_schedule, save_schedule
from umopt.run.checkpoint import MANIFEST, read_manifest
from umopt.search.problem import Candidate
from umopt.search.solve import make_problem
from umopt.synthetic import synthetic_profile

S, B = 3, 24
MLP = {"layers": 6, "width": 512, "in_features": 256, "num_classes": 10}
TARGET_S = 5.0


def _setup(folder: Path) -> tuple[str, object]:
    """A 3-stage mlp profile (synthetic costs, the zoo's model) and a 1F1B schedule for it."""
    prof = synthetic_profile(S, max_size=8, seed=1, bytes_per_sample=MLP["width"] * 4)
    cuts = np.linspace(0, MLP["layers"], S + 1).round().astype(int).tolist()
    prof = prof.model_copy(
        update={
            "model": prof.model.model_copy(update={"name": "mlp", "args": dict(MLP)}),
            "stages": [
                st.model_copy(update={"layers": [cuts[s], cuts[s + 1]]}) for s, st in enumerate(prof.stages)
            ],
        }
    )
    save_profile(prof, folder / "profile.json")
    prof = load_profile(folder / "profile.json")
    problem = make_problem(prof, B, False)
    cand = Candidate.uniform([8, 8, 8], S, "1f1b")
    sched = make_schedule(
        prof,
        B,
        False,
        cand.ops(),
        cand.simulate(problem),
        {"name": "bench", "status": "feasible", "seconds": 0.0},
        {},
    )
    save_schedule(sched, str(folder / "s.json"))
    return str(folder / "s.json"), prof


def _detached() -> None:
    """In the child before exec: a new sid (its pid), and SIGINT's default action."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(argv: list[str], temp: Path, env: dict | None = None) -> subprocess.Popen:
    full = dict(os.environ, TMPDIR=str(temp), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "umopt.cli", *argv],
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_detached,
    )


def _processes_of(sid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _rank_pid(sid: int, rank: int) -> int:
    for pid in _processes_of(sid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"umopt.run.rank" in cmd and f"RANK={rank}".encode() in env:
            return pid
    raise RuntimeError(f"rank {rank} not found")


def _wait_for_step(ck: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until the checkpoint set of ``step`` is complete; its step."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        try:
            got = json.loads((ck / MANIFEST).read_text())["step"]
            if got >= step:
                return got
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise RuntimeError("the run did not reach its checkpoints")


def _gone(sid: int) -> float:
    t0 = time.monotonic()
    while _processes_of(sid) and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    return time.monotonic() - t0


def _named(stderr: str) -> str:
    import re

    m = re.search(r"rank (\d+) \(stage", stderr)
    return m.group(1) if m else "-"


def _resumable(ck: Path, prof, held: int) -> str:
    try:
        step = read_manifest(ck, prof, "sgd").step
    except UmoptError as exc:
        return f"no: {exc}"[:40]
    return f"yes (step {step})" if step >= held else f"lost steps {step + 1}..{held}"


def _live_fault(
    name: str, path: str, prof, work: Path, hit, expect_rank: str, env: dict | None = None
) -> list[str]:
    """Start a long run, let it complete a checkpoint set, then ``hit(proc)``; measure."""
    ck, temp = work / f"ck-{name}", work / f"tmp-{name}"
    temp.mkdir()
    proc = _start(
        [
            "run",
            path,
            "--steps",
            "100000",
            "--warmup",
            "0",
            "--checkpoint",
            str(ck),
            "--checkpoint-every",
            "1",
        ],
        temp,
        env,
    )
    held = _wait_for_step(ck, 2, proc)
    t0 = time.monotonic()
    hit(proc)
    _, err = proc.communicate(timeout=60)
    ended = time.monotonic() - t0
    total = ended + _gone(proc.pid)
    named = _named(err)
    left = list(temp.glob("umopt-run-*"))  # the launcher's own (torch leaves its cache folder there too)
    ok = total < TARGET_S and (expect_rank == named) and "yes" in _resumable(ck, prof, held)
    return [
        name,
        f"{total:.2f}",
        str(proc.returncode),
        named,
        expect_rank,
        _resumable(ck, prof, held),
        "yes" if not left else f"{len(left)} left",
        "ok" if ok else "MISSED",
    ]


def _resume_fault(name: str, path: str, prof, work: Path, spoil) -> list[str]:
    """A complete set, spoiled by ``spoil(folder, manifest)``, given to --resume."""
    ck, temp = work / f"ck-{name}", work / f"tmp-{name}"
    temp.mkdir()
    done = _start(["run", path, "--steps", "1", "--warmup", "0", "--checkpoint", str(ck)], temp)
    done.communicate()
    spoil(ck, json.loads((ck / MANIFEST).read_text()))
    t0 = time.monotonic()
    proc = _start(["run", path, "--steps", "1", "--warmup", "0", "--checkpoint", str(ck), "--resume"], temp)
    _, err = proc.communicate(timeout=120)
    total = time.monotonic() - t0 + _gone(proc.pid)
    refused = proc.returncode == 2 and "does not match its hash" in err
    return [
        name,
        f"{total:.2f}",
        str(proc.returncode),
        "-",
        "-",
        "refused" if refused else err.strip()[-40:],
        "yes",
        "ok" if refused else "MISSED",
    ]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    console = Console(width=150)
    with tempfile.TemporaryDirectory(prefix="umopt-faults-") as tmp:
        work = Path(tmp)
        path, prof = _setup(work)
        rows = []

        def kill_rank(k):
            return lambda proc: os.kill(_rank_pid(proc.pid, k), signal.SIGKILL)

        for k in range(S):
            rows.append(_live_fault(f"kill -9 rank {k}", path, prof, work, kill_rank(k), str(k)))
        rows.append(
            _live_fault("SIGINT to umopt run", path, prof, work, lambda p: os.kill(p.pid, signal.SIGINT), "-")
        )
        rows.append(
            _live_fault(
                "SIGTERM to umopt run", path, prof, work, lambda p: os.kill(p.pid, signal.SIGTERM), "-"
            )
        )
        rows.append(
            _live_fault(
                "SIGKILL to umopt run (the launcher)",
                path,
                prof,
                work,
                lambda p: os.kill(p.pid, signal.SIGKILL),
                "-",
            )
        )
        # rank 1 cannot write a file over 1 KiB from its step 3 on: its checkpoint of step 4 fails
        rows.append(
            _live_fault(
                "full disk on rank 1's checkpoint",
                path,
                prof,
                work,
                lambda p: None,
                "1",
                env={"UMOPT_FAULT": "1:3:diskfull"},
            )
        )

        def corrupt(ck, man):
            f = ck / man["files"][1]["path"]
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))

        def payload(ck, man):
            import pickle

            class Payload:
                def __reduce__(self):
                    return (os.system, (f"touch {ck}/pwned",))

            (ck / man["files"][0]["path"]).write_bytes(pickle.dumps({"model": Payload()}))

        rows.append(_resume_fault("corrupted stage file, --resume", path, prof, work, corrupt))
        rows.append(_resume_fault("pickle payload, --resume", path, prof, work, payload))

    table = Table(
        title=f"faults in a {S}-stage run (gloo, checkpoint set every step): target < {TARGET_S:.0f} s, the right rank, the last set kept"
    )
    for col in (
        "fault",
        "s until all gone",
        "exit",
        "named",
        "expected",
        "last checkpoint set",
        "temp folder removed",
        "",
    ):
        table.add_column(col, justify="right" if col.startswith("s ") or col == "exit" else "left")
    for row in rows:
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
