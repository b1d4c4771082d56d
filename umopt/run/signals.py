"""What a rank of ``umopt run`` tells the world: its status file, its log lines and progress, its
bounded waits, and how it ends when stopped.

Each rank writes a one-line status file (``UMOPT_STATUS_DIR/rank{r}``) that the launcher reads:
what it is doing (the phase and the steps done), and how it ended (failed, with why; stopped by a
signal). That is how the launcher names the rank that failed first and what it was waiting for.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from ..errors import UmoptError, first_line
from ..fileio import write_atomic

__all__ = [
    "step_timeout_s",
    "io_timeout_s",
    "status_writer",
    "report_failure",
    "phase",
    "setup_logging",
    "Progress",
    "waiting",
    "exit_on_termination",
]

_log = logging.getLogger("umopt.runtime")


# [Note: two timeouts]
# A wait in the steps (a message, the step's all-reduce, its barrier) that lasts a minute has a
# dead or hung peer behind it; a wait behind another rank's file I/O (writing and hashing a
# checkpoint, loading one with --resume, writing the report and its plot) can rightly last many
# minutes. NCCL's watchdog reads one timeout per process group, so the I/O waits run on a group of
# their own: the world's timeout is UMOPT_TIMEOUT_S (60 s), theirs UMOPT_IO_TIMEOUT_S (1800 s). A
# wait that fails says which it was (waiting), and the status file says what a rank was doing,
# so a rank that NCCL's watchdog aborts (SIGABRT, no Python left to speak) is named with it.
def step_timeout_s() -> float:
    return float(os.environ.get("UMOPT_TIMEOUT_S", "60"))


def io_timeout_s() -> float:
    return float(os.environ.get("UMOPT_IO_TIMEOUT_S", "1800"))


# what this rank tells its launcher it is doing (set by status_writer: the rank's status file)
_status: Callable[..., None] = lambda *_, **__: None  # noqa: E731
_reported: list[BaseException] = []


def status_writer(rank: int) -> Callable[..., None]:
    """This rank's status file's writer (nothing where the launcher gave no folder), made the
    one the module's functions write through."""
    global _status
    status_dir = os.environ.get("UMOPT_STATUS_DIR")

    def status(state: str, message: str = "", phase: str = "", progress: Optional[dict] = None) -> None:
        # not into a folder the launcher has removed (it has stopped waiting for this rank)
        if status_dir and Path(status_dir).is_dir():
            line = json.dumps(
                {
                    "state": state,
                    "time": time.time(),
                    "message": message,
                    "phase": phase,
                    "progress": progress,
                }
            )
            write_atomic(Path(status_dir) / f"rank{rank}", lambda tmp: Path(tmp).write_text(line))

    _status = status
    return status


def report_failure(exc: BaseException) -> None:
    """The rank's "failed" status, once: the first failure is the cause, what follows its echo."""
    if _reported:
        return
    _reported.append(exc)
    first = first_line(exc, 1000)
    _status("failed", f"{exc.__class__.__name__}: {first}" if first else exc.__class__.__name__)


def phase(what: str) -> None:
    _status("started", phase=what)


def setup_logging(rank: int) -> None:
    """Rank-prefixed lines on stderr, rank 0 alone saying what it does (INFO) and the others only
    warning; ``umopt run`` passes its -v / -q as UMOPT_LOG_LEVEL. Under torchrun the command's own
    console handler is replaced, so that every message is printed once."""
    level = os.environ.get("UMOPT_LOG_LEVEL") or ("INFO" if rank == 0 else "WARNING")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RankFormatter(rank))
    logging.basicConfig(handlers=[handler], level=level, force=True)
    for name in ("umopt", "umopt.runtime"):  # their own handlers (the command's) would print it again
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        kind = (
            "warning: "
            if record.levelno == logging.WARNING
            else "error: "
            if record.levelno >= logging.ERROR
            else ""
        )
        return f"[rank {self.rank}] umopt: {kind}{record.getMessage()}"


class Progress:
    """Rank 0's steps: to the launcher's status file (``umopt run`` draws them) at most once a
    second, and as a log line at most every ``every`` seconds and at each round's end."""

    def __init__(self, total: Optional[int], every: float = 10.0):
        self.total, self.every = total, every
        self.done, self.t_status, self.t_log = 0, 0.0, time.monotonic()

    def step(self, what: str, ms: float, predicted_ms: Optional[float], end_of_round: bool) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.t_status >= 1.0 or end_of_round:
            _status(
                "started", phase="the steps", progress={"done": self.done, "total": self.total, "what": what}
            )
            self.t_status = now
        if now - self.t_log >= self.every or end_of_round:
            of = f"/{self.total}" if self.total else ""
            said = f" (predicted {predicted_ms:.1f} ms)" if predicted_ms is not None else ""
            _log.info("step %d%s, %s: %.1f ms%s", self.done, of, what, ms, said)
            self.t_log = now


@contextmanager
def waiting(what: str, io: bool = False):
    """A wait for the other ranks, named in its failure, with the bound it had (see [Note: two timeouts])."""
    bound = f"UMOPT_IO_TIMEOUT_S={io_timeout_s():g} s" if io else f"UMOPT_TIMEOUT_S={step_timeout_s():g} s"
    phase(f"a wait for {what} (at most {bound})")
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - whatever broke the wait, say which wait it was
        raise UmoptError(
            f"waiting for {what} (at most {bound}): {exc.__class__.__name__}: {first_line(exc, 300)}"
        ) from None


def exit_on_termination(status: Callable[[str, str], None]) -> None:
    """End this rank at once, with a status line, on SIGTERM or SIGINT or when its parent (the
    launcher or the torchrun agent) is gone.

    The launcher (and torchrun) stops the other ranks with SIGTERM when one fails; a rank waiting
    inside NCCL or gloo never returns to Python, so a Python signal handler would not run until
    the wait times out. The signal's number reaches a pipe (``signal.set_wakeup_fd``) whatever the
    main thread is doing, and a thread watching that pipe writes the status and leaves; the status
    then tells the launcher that this rank was stopped, not that it failed.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # the watcher acts; without a handler SIGTERM kills silently
    # the launcher says who it is: had it died while this rank was starting, getppid() here
    # would already name the process that adopted the orphan
    parent = int(os.environ.get("UMOPT_LAUNCHER_PID", os.getppid()))

    def watch() -> None:
        while True:
            ready, _, _ = select.select([r], [], [], 0.5)
            got = os.read(r, 64) if ready else b""
            for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
                if int(sig) in got:
                    if _reported:  # it failed first and was stopped while leaving: keep "failed"
                        os._exit(1)
                    status("terminated", signal.Signals(sig).name)
                    os._exit(code)
            if os.getppid() != parent:
                # nobody is left to read the status folder: the first rank out removes it
                if os.environ.get("UMOPT_STATUS_DIR"):
                    shutil.rmtree(os.environ["UMOPT_STATUS_DIR"], ignore_errors=True)
                os._exit(143)

    threading.Thread(target=watch, name="umopt-termination", daemon=True).start()
