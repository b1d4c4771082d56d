"""Bounds computed beside a solver, each in a process of its own.

A bound that runs while the solver searches must not take the solver's core (the programs
written in Python hold the GIL) and must end the moment it is no longer wanted, wherever it is.
So it runs as ``python -m umopt.search.bounds.background``: the parent sends the problem as plain arrays
(``numpy`` ``.npy``, no pickle) after a JSON line naming the job (a function of this package,
by module and name), then, line by line, the best
schedule it knows (a tighter horizon for the pair models). The child prints every bound it
proves as a JSON line at once, so what it proved counts even when it is ended early. It ends
when its input closes: however the parent ends, nothing is left running.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import numpy as np

from ...costmodel import CostTables
from ..problem import Problem

__all__ = ["BackgroundBounds", "Job"]

# A job is a function of this package, ``job(problem, emit, upper, **params)``: ``emit(scope,
# value)`` for each bound it proves, ``upper()`` the best schedule's iteration ms the parent
# knows now (None: none)
Job = Callable[..., None]

_ARRAYS = ("fwd", "bwd", "link", "static_bytes", "stash_bytes", "input_bytes", "allreduce_ms")


class BackgroundBounds:
    """One job of :data:`JOBS` in a child process; every bound it proves, by scope, in :attr:`latest`.

    ``on_bound(scope, value)`` is called (in a reader thread) for each bound as it arrives.
    Use it as a context manager, or call :meth:`close`: the child must not outlive its use.
    """

    def __init__(
        self, job: Job, problem: Problem, on_bound: Optional[Callable[[str, float], None]] = None, **params
    ):
        if not job.__module__.startswith(__package__ + "."):
            raise ValueError(f"{job.__qualname__} is not a job of {__package__}")
        self.latest: dict[str, float] = {}
        self.finished = False  # the job ran to its end (not stopped, not failed)
        self._on_bound = on_bound
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "umopt.search.bounds.background"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        t = problem.tables
        header = {
            "job": [job.__module__, job.__qualname__],
            "params": params,
            "minibatch": problem.minibatch,
            "optimizer_ms": t.optimizer_ms,
            "recompute": t.recompute,
            "memory_limit": t.memory_limit,
        }
        data = io.BytesIO()  # (numpy reads and writes a pipe only through a buffer)
        for name in _ARRAYS:
            np.save(data, np.ascontiguousarray(getattr(t, name)), allow_pickle=False)
        header["nbytes"] = data.tell()
        try:
            self.proc.stdin.write(json.dumps(header).encode() + b"\n" + data.getvalue())
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died at start: the error is in its stderr, read by wait()
            pass
        self._reader = threading.Thread(
            target=self._read, name=f"umopt-beside-{job.__qualname__}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # something a library printed: not ours
                continue
            if msg.get("done"):
                self.finished = True
                continue
            scope, value = msg["scope"], float(msg["value"])
            with self._lock:
                self.latest[scope] = max(self.latest.get(scope, value), value)
            if self._on_bound:
                self._on_bound(scope, value)

    def offer(self, upper_ms: float) -> None:
        """Tell the job of a schedule of ``upper_ms`` (its models need search only below it)."""
        try:
            self.proc.stdin.write(json.dumps({"upper_ms": upper_ms}).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # ended already
            pass

    def wait(self, timeout: Optional[float] = None) -> dict[str, float]:
        """The bounds proven when the job ends, or at ``timeout`` seconds, when it is stopped.

        A job that failed raises its error here."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.stop()
        self._reader.join()
        if self.proc.returncode != 0 and not self.finished:
            err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"a bound beside the solver failed: {err[-1] if err else f'exit code {self.proc.returncode}'}"
            )
        return self.bounds()

    def stop(self) -> dict[str, float]:
        """End the job now; the bounds it proved so far."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join()
        return self.bounds()

    def bounds(self) -> dict[str, float]:
        with self._lock:
            return dict(self.latest)

    def close(self) -> None:
        """Stop the job if it still runs and release its pipes."""
        self.stop()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:  # (a broken pipe: it has ended)
                pass

    def __enter__(self) -> "BackgroundBounds":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child() -> None:
    """The child's side: read the job and the problem, run it, print what it proves."""
    stdin = sys.stdin.buffer
    header = json.loads(stdin.readline())
    data = io.BytesIO(stdin.read(header["nbytes"]))
    arrays = {name: np.load(data, allow_pickle=False) for name in _ARRAYS}
    tables = CostTables(
        arrays["fwd"],
        arrays["bwd"],
        arrays["link"],
        header["optimizer_ms"],
        header["recompute"],
        arrays["static_bytes"],
        arrays["stash_bytes"],
        arrays["input_bytes"],
        header["memory_limit"],
        arrays["allreduce_ms"],
    )
    problem = Problem(tables, header["minibatch"])
    module, name = header["job"]
    if not module.startswith(__package__ + "."):  # (the parent checks this too)
        raise ValueError(f"{module} is not a module of {__package__}")
    job = getattr(importlib.import_module(module), name)
    best = {"ms": None}

    def listen() -> None:
        for line in stdin:
            best["ms"] = json.loads(line).get("upper_ms", best["ms"])
        os._exit(0)  # the parent is gone or done with us: nothing may outlive it

    threading.Thread(target=listen, daemon=True).start()
    out = sys.stdout

    def emit(scope: str, value: float) -> None:
        out.write(json.dumps({"scope": scope, "value": value, "time": time.time()}) + "\n")
        out.flush()

    job(problem, emit, lambda: best["ms"], **header["params"])
    out.write(json.dumps({"done": True}) + "\n")
    out.flush()
    os._exit(0)  # without waiting for the listener, or for OR-Tools' teardown


if __name__ == "__main__":
    _child()
