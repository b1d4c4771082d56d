"""Plans made ahead of the steps that play them, in a process of their own.

A data loader knows a minibatch's lengths before the step that trains on it (it prefetches), so
its plan can be made while the steps before it run, on a core the training does not use: the
step then costs no planning time. :class:`PlanAhead` is that process: :meth:`~PlanAhead.submit`
the lengths of a minibatch as soon as they are known, :meth:`~PlanAhead.next` the plans in the
order submitted (each warm-started from the one before, as :func:`umopt.search.solvers.per_step.plan`
does in a loop), as schedules ``umopt.Pipeline.step(plan=...)`` plays. ``method``: umopt's
planner, or one of the peers' (:data:`umopt.search.methods.METHODS`: what ``umopt tune --lengths``
measures umopt against, planned the same way). ``on``: the pipeline's layout where ranks hold
several chunks (every plan keeps it: umopt's multi-chunk planner, :func:`umopt.search.solvers.per_step_chunks.plan_chunks`,
or padding and packing on torch's multi-chunk schedules)::

    with PlanAhead(profile) as ahead:
        ahead.submit(lengths_of(batch0))
        for k, batch in enumerate(loader):
            if k + 1 < len(loader):
                ahead.submit(lengths_of(next_batch))      # the next one plans while this one trains
            pipe.step(inputs=..., plan=ahead.next)  # called inside the step: its wait counts there
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from typing import Optional

import numpy as np

from ..costmodel import Chunking
from ..errors import UmoptError
from ..formats.profile import AllReduceProfile, Profile
from ..formats.schedule import Schedule
from ..predict import check_against_profile
from ..search.method import Method, Request
from ..search.methods import chunked_names, named
from ..search.plan import Plan
from ..search.solve_lengths import plan_schedule

__all__ = ["PlanAhead", "plan_budget"]

# a plan's budget by default, one chunk per rank or several. Kept small: where the ranks use every
# core (a CPU run), what the planner takes the steps lose (with several chunks, 150 ms a plan
# predicted 5% faster plans and measured 25% slower steps: 2 CPU ranks, 50 ms steps). Warm
# started, a multi-chunk plan takes about 11 ms at 16 sequences (cold, the first: 30 ms)
BUDGET_MS, CHUNKED_BUDGET_MS = 15.0, 15.0
# A plan has one step to be made in: where steps are shorter than the budget (a small model, a
# CPU), a plan made in the full budget would be late every step and the step would wait for it.
# Warm started, a plan is budgeted at most this share of the last plan's predicted step (at least
# 1 ms; one CPU rank's 5 ms steps: plans of about 2 ms, waited for under 1 ms a step).
STEP_SHARE, LEAST_BUDGET_MS = 0.5, 1.0
POLL_S = 0.5  # how often a wait for a plan looks whether the planning process is still there


def plan_budget(budget_ms: float, previous: Optional[Plan]) -> float:
    """What the next plan may take: ``budget_ms``, at most :data:`STEP_SHARE` of the last plan's
    predicted step where there is one (at least :data:`LEAST_BUDGET_MS`)."""
    if previous is None:
        return budget_ms
    return min(budget_ms, max(LEAST_BUDGET_MS, STEP_SHARE * previous.iteration_ms))


def _plan_one(profile: Profile, m: Method, lengths: np.ndarray, budget_ms, recompute, dp, previous, on):
    got = m.plan(Request(profile, lengths, recompute, dp, on=on, budget_ms=budget_ms, previous=previous))
    if got is None:
        raise UmoptError(f"{m.name}: no plan of this minibatch fits the memory limit")
    return got


def _serve(
    profile: Profile, budget_ms: float, recompute: bool, dp, method: Method, on, parent: int, inbox, outbox
) -> None:
    """The planning process: one plan per lengths received, in order, until None. At a lower
    priority than the training processes: a plan has a whole step to be made in, and where the
    cores are all the ranks' (a CPU run), it should take its time from idle ones."""
    try:
        os.nice(5)
    except OSError:  # not allowed here: plan at the same priority
        pass
    previous = None
    while True:
        try:
            lengths = inbox.get(timeout=1.0)
        except queue.Empty:
            # a parent that left without closing this (a process ending by os._exit, as a failed
            # rank does) must not leave it behind holding the parent's output pipes open
            if os.getppid() != parent:
                return
            continue
        if lengths is None:
            return
        try:
            budget = plan_budget(budget_ms, previous)
            previous = _plan_one(profile, method, np.asarray(lengths), budget, recompute, dp, previous, on)
            sched = plan_schedule(previous, profile, recompute, dp)
            check_against_profile(sched, profile)  # here, once: the ranks play it unchecked
            outbox.put(sched)
        except UmoptError as exc:
            outbox.put(exc)


class PlanAhead:
    """A planning process for ``profile``'s pipeline (see the module docstring): ``budget_ms``
    per plan, as :func:`umopt.search.solvers.per_step.plan` (None: :data:`BUDGET_MS`, or with ``on``
    :data:`CHUNKED_BUDGET_MS`), at most half the last plan's predicted step (:data:`STEP_SHARE`)."""

    def __init__(
        self,
        profile: Profile,
        budget_ms: Optional[float] = None,
        recompute: bool = False,
        dp: Optional[AllReduceProfile] = None,
        method: str = "umopt",
        on: Optional[Chunking] = None,
    ):
        if profile.lengths is None:
            raise UmoptError("the profile has no costs by tokens (profile with --lengths)")
        m = named(method)
        if m.unavailable(profile):
            raise UmoptError(m.unavailable(profile))
        if on is not None and not m.chunked:
            raise UmoptError(
                f"{method} plans one chunk per rank; with several: one of {', '.join(chunked_names())}"
            )
        if budget_ms is None:
            budget_ms = BUDGET_MS if on is None else CHUNKED_BUDGET_MS
        self.method = method
        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(
            target=_serve,
            args=(profile, budget_ms, recompute, dp, m, on, os.getpid(), self._inbox, self._outbox),
            daemon=True,
            name="umopt-plan-ahead",
        )
        self._process.start()
        self.pending = 0

    def submit(self, lengths) -> None:
        """Plan a minibatch of sequences of ``lengths`` (after those submitted before)."""
        self._inbox.put([int(n) for n in lengths])
        self.pending += 1

    def next(self, timeout_s: float = 120.0) -> Schedule:
        """The plan of the earliest minibatch submitted and not yet taken (waiting for it at most
        ``timeout_s``; a planning process that ends meanwhile is said within a second)."""
        if not self.pending:
            raise UmoptError("PlanAhead.next() with nothing submitted")
        end = time.monotonic() + timeout_s
        while True:
            try:
                got = self._outbox.get(timeout=max(0.01, min(POLL_S, end - time.monotonic())))
                break
            except queue.Empty:
                pass
            if not self._process.is_alive():
                try:  # it may have put the plan just before it ended
                    got = self._outbox.get(timeout=0.1)
                    break
                except queue.Empty:
                    code = self._process.exitcode
                    how = (
                        f"was killed by signal {-code}" if code and code < 0 else f"ended (exit code {code})"
                    )
                    raise UmoptError(
                        f"the planning process of {self.method}'s plans (umopt-plan-ahead, pid {self._process.pid}) "
                        f"{how} with {self.pending} plan(s) still to make"
                    ) from None
            if time.monotonic() >= end:
                raise UmoptError(
                    f"no plan within {timeout_s:g} s: the planning process of {self.method}'s plans is alive but "
                    "has not answered (a minibatch too large to plan in time?)"
                )
        self.pending -= 1
        if isinstance(got, BaseException):
            raise got
        return got

    def ready(self) -> Optional[Schedule]:
        """The plan :meth:`next` would return, if it is made already (None: not yet); it is then
        taken, as :meth:`next` takes it."""
        if not self.pending:
            return None
        try:
            got = self._outbox.get_nowait()
        except queue.Empty:
            return None
        self.pending -= 1
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self) -> None:
        if self._process.is_alive():
            self._inbox.put(None)
            self._process.join(5)
            if self._process.is_alive():
                self._process.terminate()

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
