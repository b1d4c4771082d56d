"""Fault injection, for the tests and bench/faults.py: environment variables that make a rank of
``umopt run`` fail, hang, slow down or lose its disk at a given step, so that what the runtime
does then (name the rank, stop the others, keep the last checkpoint set) is tested for real.

- ``UMOPT_FAULT="rank:step:raise|midstep|kill|hang|diskfull|slowio[,...]"`` (step counted from
  the run's start or resume; midstep: the rank's second forward of that step raises, with the
  step's messages in flight; slowio: its checkpoint writes take ``UMOPT_FAULT_SLOW_S`` (5) s
  longer from then on);
- ``UMOPT_FAULT_SLOWER="name:ms[,...]"``: every step of the schedule ``name`` (its file's stem,
  or a candidate's name) takes ``ms`` longer, for step times by construction.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch

__all__ = ["slower_s", "slow_down", "inject", "slow_io_s"]

_slow_io_s: list[float] = []  # injected: seconds every checkpoint write of this rank takes longer


def slow_io_s() -> float:
    return sum(_slow_io_s)


def slower_s(name: str) -> float:
    """Seconds every step of schedule ``name`` takes longer (UMOPT_FAULT_SLOWER)."""
    for spec in filter(None, os.environ.get("UMOPT_FAULT_SLOWER", "").split(",")):
        who, ms = spec.rsplit(":", 1)
        if who == name:
            return float(ms) / 1e3
    return 0.0


def slow_down(pipe: Any, name: str) -> None:
    """Make every step of each schedule of ``pipe`` (a Pipeline: its pick ``name`` and the
    candidates taking turns with it) that UMOPT_FAULT_SLOWER names that much longer, inside the
    step (where selection times it)."""
    plays = [(t.name, t.pipe) for t in pipe.turns.turns] if pipe.turns is not None else [(name, pipe)]
    for who, p in plays:
        delay = slower_s(who)
        if delay and p is not None:
            play = p.player.step

            def step(*args, play=play, delay=delay, **kwargs):
                time.sleep(delay)
                return play(*args, **kwargs)

            p.player.step = step


def inject(rank: int, step: int, modules: list[torch.nn.Module]) -> None:
    """What UMOPT_FAULT asks of ``rank`` at ``step``, before the step runs."""
    for spec in filter(None, os.environ.get("UMOPT_FAULT", "").split(",")):
        r, st, kind = spec.split(":")
        if int(r) != rank or int(st) != step:
            continue
        if kind == "midstep":
            calls = []

            def hook(*_):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError(f"injected fault in the middle of step {step}")

            for m in modules:
                m.register_forward_pre_hook(hook)
            continue
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":  # as a rank blocked on the GPU or in a collective: it never raises
            threading.Event().wait()
        if kind == "slowio":
            _slow_io_s.append(float(os.environ.get("UMOPT_FAULT_SLOW_S", "5")))
            continue
        if kind == "diskfull":  # from now on this rank cannot write a file over 1 KiB (a real OSError)
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            continue
        raise RuntimeError(f"injected fault at step {step}")
