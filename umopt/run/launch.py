"""Starting the runtime's processes on this machine (what ``umopt run`` does).

Checks everything it can before a process starts (:func:`umopt.run_options.preflight`), then
starts one rank per stage (``python -m umopt.run.rank OPTIONS.json``, the options resolved) in a
process group of its own and watches them. They meet through a file store in a private temp
folder, so a local run opens no port for its rendezvous, and gloo and NCCL are told to use the
loopback interface.

Being the ranks' parent is what makes failures and interrupts exact: the first rank to end badly
is known with its exit status (its own one-line status file says why it raised; a negative status
says which signal killed it), the others are stopped at once (SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`), and an interrupt of ``umopt run`` (SIGINT, SIGTERM) stops all of them
before it returns, with exit code 130 or 143. On several machines, ``torchrun`` starts
``umopt run`` once per rank instead (README), and each runs :func:`umopt.run.rank.main` itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..errors import UmoptError
from ..formats.report import RunReport, load_report
from .options import RunOptions, preflight

__all__ = ["RunFailed", "Interrupted", "RunResult", "launch", "STOP_GRACE_S"]

# how long the ranks get to leave on SIGTERM before they are killed
STOP_GRACE_S = 3.0
# how often the ranks are looked at
POLL_S = 0.05


class RunFailed(UmoptError):
    """The run started but a rank failed (exit code 1, unlike bad input)."""

    exit_code = 1


class Interrupted(UmoptError):
    """The user stopped the run (SIGINT: exit code 130, SIGTERM: 143); every rank was stopped."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: every rank stopped")


@dataclass
class RunResult:
    reports: list[RunReport]  # one per schedule, in the order given
    report_paths: list[str]  # where they were written ("" where --report was not given)

    @property
    def report(self) -> RunReport:
        return self.reports[0]


ProgressFn = Callable[[int, Optional[int], str], None]  # (steps done, of how many or None, what)


def launch(
    options: RunOptions,
    *,
    timeout_s: Optional[float] = None,
    quiet: bool = False,
    progress: Optional[ProgressFn] = None,
) -> RunResult:
    cfg = preflight(options)
    S = cfg.num_stages
    world = S * cfg.dp  # dp replicas of the pipeline: rank r runs stage r % S of replica r // S
    with tempfile.TemporaryDirectory(prefix="umopt-run-") as tmp:
        template = options.report
        if not template:
            template = str(Path(tmp) / ("report_{name}.json" if len(cfg.schedules) > 1 else "report.json"))
        paths = [cfg.output(template, k) for k in range(len(cfg.schedules))]
        handed = Path(tmp) / "options.json"  # what every rank reads, resolved
        handed.write_text(cfg.options.model_copy(update={"report": template}).model_dump_json())
        threads = options.threads or (cfg.profile.device.threads or 1)
        env = dict(os.environ)
        env.update(
            UMOPT_STATUS_DIR=tmp,
            UMOPT_LAUNCHER_PID=str(os.getpid()),  # a rank that outlives it ends itself
            UMOPT_STORE=str(Path(tmp) / "store"),  # the rendezvous: a file, no port
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0",
            GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
            NCCL_SOCKET_IFNAME=env.get("NCCL_SOCKET_IFNAME", "lo"),
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))
        log = Path(tmp) / "ranks.log"
        with open(log, "w") as out:
            codes, on_their_own = _supervise(
                world, handed, env, None if not quiet else out, out, timeout_s, progress
            )
        if any(c != 0 for c in codes.values()):
            raise RunFailed(_root_cause(Path(tmp), world, S, codes, on_their_own, log))
        reports = [load_report(p) for p in paths]
        return RunResult(reports, paths if options.report else [""] * len(paths))


def _supervise(
    n: int,
    options_file: Path,
    env: dict,
    stdout,
    stderr,
    timeout_s: Optional[float],
    progress: Optional[ProgressFn] = None,
) -> tuple[dict[int, int], set[int]]:
    """Start the n ranks in a process group of their own and wait for them. Returns each rank's
    exit status by rank, in the order they ended, and the ranks that ended on their own (before
    any was stopped). On the first bad exit, SIGINT or SIGTERM to this process or the timeout,
    the whole group is stopped before this returns (or raises)."""
    procs: list[subprocess.Popen] = []
    group = 0
    for r in range(n):
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        # rank 0 leads a new process group, the others join it: one killpg reaches every rank,
        # and a terminal's Ctrl-C reaches only this process, which then stops them all
        joined = (
            {"process_group": group}
            if sys.version_info >= (3, 11)
            else {"preexec_fn": lambda g=group: os.setpgid(0, g)}
        )
        p = subprocess.Popen(
            [sys.executable, "-m", "umopt.run.rank", str(options_file)],
            env=rank_env,
            stdout=stdout,
            stderr=stderr,
            **joined,
        )
        group = group or p.pid
        procs.append(p)
    got: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: got.append(signum))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ended: dict[int, int] = {}
    try:
        while len(ended) < n:
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = p.returncode
            if got:
                raise Interrupted(got[0])
            if any(c != 0 for c in ended.values()):
                break  # the others are stopped below; their statuses say they were
            if progress is not None:
                _show_progress(Path(env["UMOPT_STATUS_DIR"]) / "rank0", progress)
            if deadline is not None and time.monotonic() > deadline:
                raise RunFailed(f"the run did not finish within {timeout_s:.0f} s; every rank stopped")
            time.sleep(POLL_S)
    finally:
        _stop_group(group, procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    on_their_own = set(ended)
    for r, p in enumerate(procs):
        ended.setdefault(r, p.returncode)
    return ended, on_their_own


def _show_progress(status: Path, progress: ProgressFn) -> None:
    """Rank 0's steps as its status file says (the runtime writes them at most once a second)."""
    try:
        now = json.loads(status.read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return
    p = now.get("progress")
    if p:
        progress(int(p["done"]), p.get("total"), str(p.get("what", "")))
    elif now.get("phase"):
        progress(0, None, str(now["phase"]))


def _stop_group(group: int, procs: list[subprocess.Popen]) -> None:
    """SIGTERM to the ranks' process group (each writes "terminated" and leaves), SIGKILL to what
    is left after :data:`STOP_GRACE_S`; returns once every rank has been reaped."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        if all(p.poll() is not None for p in procs):
            break
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
    for p in procs:
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _root_cause(
    status_dir: Path, world: int, S: int, codes: dict[int, int], on_their_own: set[int], log: Path
) -> str:
    """The rank that failed first, with its message.

    ``codes`` holds each rank's exit status in the order the ranks ended, ``on_their_own`` the
    ranks that ended before the launcher stopped the rest. Each rank's status file
    says how it ended: "failed" (it raised: the first by time is the cause, later ones are its
    echo), "terminated" (stopped with a signal by this launcher or the user: never the cause
    while another rank failed), or still "started" (killed outright, crashed in C++: its exit
    status names the signal). The ranks' log is kept and named when their own words do not
    explain the failure.
    """
    statuses = {}
    for r in range(world):
        f = status_dir / f"rank{r}"
        try:
            statuses[r] = (
                json.loads(f.read_text())
                if f.exists()
                else {"state": "never started", "time": 0.0, "message": ""}
            )
        except ValueError:  # written as the rank died
            statuses[r] = {"state": "started", "time": 0.0, "message": ""}
    failed = sorted((st["time"], r, st["message"]) for r, st in statuses.items() if st["state"] == "failed")
    # a rank that ended badly without a word (killed, crashed) is the cause: the others' failures
    # ("connection closed by peer") are its echo
    silent = [
        r
        for r, c in codes.items()
        if r in on_their_own and c != 0 and statuses[r]["state"] in ("started", "never started")
    ]
    if silent:
        r = silent[0]
        lines = log.read_text().strip().splitlines()
        kept = Path(tempfile.gettempdir()) / f"umopt-ranks-{os.getpid()}-{int(time.time())}.log"
        kept.write_text("\n".join(lines) + "\n")
        during = f" during {statuses[r]['phase']}" if statuses[r].get("phase") else ""
        if codes[r] == -signal.SIGABRT:  # what NCCL's watchdog does to a rank whose wait timed out
            during += " (NCCL's watchdog aborts a rank whose wait outlasts its timeout)"
        return f"rank {r} (stage {r % S}) ended without a word: {_exit_words(codes[r])}{during} (log: {kept})"
    if failed:
        _, r, message = failed[0]
        return f"rank {r} (stage {r % S}) failed: {message}"
    stopped = sorted(
        (st["time"], r, st["message"]) for r, st in statuses.items() if st["state"] == "terminated"
    )
    if stopped:
        _, r, why = stopped[0]
        return f"the run was stopped from outside: rank {r} (stage {r % S}) first ({why})"
    bad = next(r for r, c in codes.items() if c != 0)
    return f"rank {bad} (stage {bad % S}) ended with {_exit_words(codes[bad])}"
