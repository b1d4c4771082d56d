"""Selection while training: a schedule file's pick and candidates take turns over the first
steps of a run and the fastest plays the rest (``umopt.Pipeline``, and so ``umopt run``).

[Note: selection while training] is the why; :mod:`umopt.measure.decide` the test; :class:`Turns` the
one mechanism. What takes turns is anything with a ``name``, its ``schedule`` and the steps
measured so far.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..formats.report import Selection, SelectionEntry
from ..formats.schedule import Schedule
from ..measure.decide import Decision, compare, decide, is_equal
from ..words import count
from .comm import Comm
from .player import StepTimer
from .steps import (
    MIN_SELECT_ROUNDS,
    SELECT_MAX_STEPS,
    SELECT_MOST,
    SELECT_SHARE,
    TURN_STEPS,
    select_budget,
    selection_steps_needed,
)


class TurnTaker(Protocol):
    """What takes turns: a Pipeline (the one that owns the turns, or a candidate's over its modules)."""

    schedule: Schedule
    comm: Comm
    device: torch.device
    selected: Optional[str]
    selection: Optional[Selection]

    def share_buffers(self, other: Any) -> None: ...

    def release(self) -> None: ...


__all__ = [
    "MIN_SELECT_ROUNDS",
    "SELECT_CONFIDENCE",
    "SELECT_COST",
    "SELECT_MAX_STEPS",
    "SELECT_SHARE",
    "TURN_STEPS",
    "Turn",
    "Turns",
    "decide_turns",
    "keep_measuring",
    "winner_of",
    "select_budget",
    "selection_steps_needed",
    "selection_record",
]


class Turn(Protocol):
    name: str
    step_ms: list[float]  # the measured step of each turn
    turn_ms: list[float]  # every step of its turns, the first (unmeasured) one too: what they cost

    @property
    def schedule(self) -> Schedule: ...


# [Note: selection while training]
# Every schedule of a profile gives one process's gradients, so the schedules a solve could not
# tell apart (its pick and the file's `candidates`) can take turns over the first steps of a
# real run, on the real machine, without changing the training at all. A turn is TURN_STEPS
# steps of one schedule, the last measured (the first follows another schedule's step and may
# run slower than that schedule would alone); each round a turn each, the paired test of
# umopt.measure.decide after each round from the third on. A schedule the test finds slower than the
# fastest so far stops taking turns (it only costs time), and measuring stops when the test has
# decided, when what the turns cost beyond the fastest one's pace reaches SELECT_COST of the run,
# or when the steps allowed for it (--select-steps) are spent. The winner plays the rest: the
# test's winner where it decided, else the one measured fastest (never the prediction against
# the measurement: with equal gradients, speed is all that is at stake). Every rank of the job
# (all replicas) has the same step times (all-reduced), but the job's first rank alone decides
# and tells the others, so no rank can go on with another schedule than its neighbours or its
# replicas. Only one schedule's activations are alive at a time (a step ends with its
# backwards); the candidates share receive buffers, and the losers are let go at the decision.
SELECT_CONFIDENCE = 0.95
SELECT_COST = 0.03  # of the run's time at the fastest schedule's pace: measuring stops there


def decide_turns(turns: Sequence[Turn]) -> Decision:
    """The paired test over the rounds so far (one step each per round)."""
    rounds = {t.name: list(t.step_ms) for t in turns}
    # the equal schedules are the reference; with none among them, the first (the solve's pick)
    equal = [t.name for t in turns if is_equal(t.schedule.op_lists())] or [turns[0].name]
    return decide(rounds, equal, confidence=SELECT_CONFIDENCE)


def winner_of(turns: Sequence[Turn], decision: Decision, active: Sequence[int]) -> int:
    """The schedule to keep: the test's winner where it decided, else the one of those still
    taking turns that measured fastest (see [Note: selection while training])."""
    if decision.decided:
        return [t.name for t in turns].index(decision.winner)
    return min(active, key=lambda k: statistics.median(turns[k].step_ms))


def keep_measuring(
    plays: Sequence[Turn], active: list[int], decision: Decision, run_steps: Optional[int]
) -> tuple[bool, list[int]]:
    """Whether selection stops now, and the schedules that go on taking turns if not: a schedule
    the test finds slower than the fastest so far (at the same confidence) stops playing, and
    measuring stops once it has cost SELECT_COST of the run at the fastest one's pace."""
    medians = {k: statistics.median(plays[k].step_ms) for k in active}
    lead = min(active, key=medians.get)
    left = [
        k
        for k in active
        if k == lead
        or compare(plays[k].name, plays[lead].step_ms, plays[k].step_ms).faster > 1 - SELECT_CONFIDENCE
    ]
    pace = medians[lead]
    cost = sum(ms - pace for p in plays for ms in p.turn_ms)
    stop = (
        decision.decided
        or len(left) < 2
        or (run_steps is not None and cost >= SELECT_COST * run_steps * pace)
    )
    return stop, left


def _percent(p: float) -> str:
    return ">99.9%" if p > 0.999 else f"{100 * p:.1f}%" if p > 0.99 else f"{100 * p:.0f}%"


def selection_record(
    plays: Sequence[Turn],
    chosen: Turn,
    decision: Optional[Decision],
    spent: int,
    active: Sequence[int],
) -> Selection:
    """What selection measured and why it kept ``chosen``, for the report."""
    medians = {p.name: statistics.median(p.step_ms) if p.step_ms else None for p in plays}
    won = medians[chosen.name]
    steps = [ms for p in plays for ms in p.turn_ms]
    cost = spread = 0.0
    if won is not None and len(steps) > 1:
        over = [ms - won for ms in steps]
        cost = sum(over)
        spread = 2 * statistics.stdev(over) * math.sqrt(len(over))  # about 95% of what noise alone gives
    if decision is None:
        n = len(plays)
        reason = (
            f"not measured: too few steps allowed to measure {MIN_SELECT_ROUNDS} rounds of {n} schedules "
            f"(--steps {math.ceil(selection_steps_needed(n) / SELECT_MOST)} or --select-steps {selection_steps_needed(n)} measures them)"
        )
    elif decision.decided:
        reason = decision.reason
    else:
        rivals = [k for k in active if plays[k] is not chosen]
        reason = f"not decided within {spent} steps: kept the fastest by median"
        if rivals:
            second = min(rivals, key=lambda k: statistics.median(plays[k].step_ms))
            c = compare(chosen.name, plays[second].step_ms, chosen.step_ms)
            reason += (
                f"; round by round it was {100 * abs(c.gain):.1f}% {'faster' if c.gain >= 0 else 'slower'} than "
                f"{plays[second].name} on average over {count(len(chosen.step_ms), 'round')} ({_percent(c.faster)} "
                "confidence that it is faster)"
            )
    note = None
    if decision is not None and chosen is not plays[0] and won is not None:
        gain = medians[plays[0].name] / won - 1
        note = (
            f"{chosen.name} measured {100 * gain:.1f}% faster than the solve's pick {plays[0].name}: the profile does not "
            "describe this run as well as it could; fit it to this report: umopt calibrate PROFILE REPORT -o PROFILE2"
        )
    return Selection(
        pick=plays[0].name,
        winner=chosen.name,
        reference=decision.reference if decision else plays[0].name,
        confidence=decision.confidence if decision else 0.0,
        decided=bool(decision and decision.decided),
        steps=spent,
        cost_ms=cost,
        cost_spread_ms=spread,
        reason=reason,
        note=note,
        candidates=[
            SelectionEntry(
                name=p.name,
                equal=is_equal(p.schedule.op_lists()),
                predicted_ms=p.schedule.predicted.iteration_ms,
                measured_ms=medians[p.name],
                steps=len(p.turn_ms),
            )
            for p in plays
        ],
    )


@dataclass
class _Turn:
    name: str
    schedule: Schedule
    pipe: Optional[TurnTaker] = None  # built only where the turns will play it
    step_ms: list[float] = field(default_factory=list)
    turn_ms: list[float] = field(default_factory=list)


class Turns:
    """A Pipeline's pick and candidates taking turns over the first steps, TURN_STEPS each per
    round (the last measured) after a first round of a step each, unmeasured, that learns shapes
    (see [Note: selection while training]). The job's first rank decides and tells the others."""

    def __init__(
        self,
        owner: TurnTaker,
        rival: Callable[[Schedule], TurnTaker],
        select_steps: Optional[int],
        run_steps: Optional[int],
    ):
        sched = owner.schedule
        pick = sched.solver.recommended or "pick"
        self.owner, self.run_steps = owner, run_steps
        self.turns = [_Turn(pick, sched, owner)] + [
            _Turn(c.name, sched.candidate_schedule(k)) for k, c in enumerate(sched.candidates)
        ]
        n = len(self.turns)
        self.budget = select_budget(run_steps, select_steps, n)
        for t in self.turns[1:] if self.budget else []:  # each over the owner's own modules
            t.pipe = rival(t.schedule)
        self.active = list(range(n))
        self.queue: list[tuple[int, int]] = [(k, TURN_STEPS - 1) for k in self.active]
        self.warming = True  # the first round: a step each, to learn its shapes, unmeasured
        self.rounds = self.spent = 0
        self.decision: Optional[Decision] = None
        self.winner: TurnTaker = owner
        self.record: Optional[Selection] = None
        self.played: str = pick  # the schedule of the last step
        if self.budget == 0:
            self._finish(0)

    @property
    def done(self) -> bool:
        return self.record is not None

    @property
    def up_next(self) -> str:
        """The schedule the next step plays."""
        return self.turns[self.queue[0][0]].name if not self.done else self.turns_of(self.winner)

    def turns_of(self, pipe: TurnTaker) -> str:
        return next(t.name for t in self.turns if t.pipe is pipe)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.turns]

    def step(self, run: Callable[[TurnTaker], Any]) -> Any:
        """One step in turn: ``run(pipeline)`` on the schedule whose turn it is, timed over the job."""
        k, j = self.queue.pop(0)  # the turn's first step follows another schedule's: not measured
        play = self.turns[k].pipe
        assert play is not None
        comm, group, device = (
            self.owner.comm,
            None,
            self.owner.device,
        )  # the job: the world (it builds every Pipeline)
        comm.barrier(group, device)
        timer = StepTimer(device)
        timer.start()
        self.played = self.turns[k].name
        out = run(play)
        worst = torch.tensor([timer.stop()], dtype=torch.float64, device=device)
        comm.all_reduce(worst, group, op="max")
        self.spent += 1
        if not self.warming:
            self.turns[k].turn_ms.append(float(worst.item()))
            if j == TURN_STEPS - 1:
                self.turns[k].step_ms.append(float(worst.item()))
        if not self.queue:
            self._end_of_round()
        return out

    def _end_of_round(self) -> None:
        if self.warming:
            self.warming = False
            for t in self.turns[1:]:  # their steps never overlap: one set of receive buffers
                assert t.pipe is not None
                t.pipe.share_buffers(self.owner)
        else:
            self.rounds += 1
        if self.rounds >= MIN_SELECT_ROUNDS:
            self.decision = decide_turns(self.turns)
            said = torch.zeros(3, dtype=torch.int64)
            comm, group = self.owner.comm, None
            if comm.rank == 0:
                stop, left = keep_measuring(self.turns, self.active, self.decision, self.run_steps)
                stop = stop or self.spent + TURN_STEPS * len(left) > self.budget
                said = torch.tensor(
                    [stop, winner_of(self.turns, self.decision, left), sum(1 << k for k in left)]
                )
            said = said.to(self.owner.device)
            comm.broadcast(said, 0, group)
            self.active = [k for k in range(len(self.turns)) if int(said[2].item()) >> k & 1]
            if bool(said[0].item()):
                return self._finish(int(said[1].item()))
        elif self.spent + TURN_STEPS * len(self.active) > self.budget:
            return self._finish(
                min(self.active, key=lambda k: statistics.median(self.turns[k].step_ms or [math.inf]))
            )
        self.queue = [(k, j) for k in self.active for j in range(TURN_STEPS)]

    def _finish(self, k: int) -> None:
        chosen = self.turns[k]
        assert chosen.pipe is not None
        self.winner = chosen.pipe
        self.record = selection_record(self.turns, chosen, self.decision, self.spent, self.active)
        self.owner.selected = chosen.name
        self.owner.selection = self.record
        if self.owner.comm.rank == 0:
            logging.getLogger("umopt").info("selected %s: %s", chosen.name, self.record.reason)
        for t in self.turns:  # the losers' buffers go with them (the winner's own stay)
            if t is not chosen and t.pipe is not None:
                t.pipe.release()
