"""Selection while training: a schedule file's pick and candidates take turns over the first
steps of a run and the fastest plays the rest (``umopt run`` and ``umopt.Pipeline``).

[Note: selection while training] is the why; :mod:`umopt.decide` the test. What takes turns is
anything with a ``name``, its ``schedule`` and the ``step_ms`` measured so far (the runtime's
plays, the Pipeline's children); how a step runs and how ranks agree is the caller's.
"""

from __future__ import annotations

import statistics
from typing import Optional, Protocol, Sequence

from .decide import Decision, compare, decide, is_equal
from .formats.report import Selection, SelectionEntry
from .formats.schedule import Schedule

__all__ = [
    "MIN_SELECT_ROUNDS",
    "SELECT_CONFIDENCE",
    "SELECT_COST",
    "SELECT_MAX_STEPS",
    "SELECT_SHARE",
    "TURN_STEPS",
    "Turn",
    "decide_turns",
    "keep_measuring",
    "winner_of",
    "select_budget",
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
# umopt.decide after each round from the third on. A schedule the test finds
# slower than the fastest so far stops taking turns (it only costs time), and measuring stops
# when the test has decided, when what the turns cost beyond the fastest one's pace reaches
# SELECT_COST of the run, or when the steps allowed for it (--select-steps) are spent; the
# winner plays the rest. Every rank has the same (all-reduced) step times, but rank 0 alone
# decides and tells the others, so no rank can go on with another schedule than its neighbours.
# Only one schedule's activations are alive at a time (a step ends with its backwards); what
# measuring cost in time is reported (`selection.cost_ms`).
MIN_SELECT_ROUNDS = 3
# steps in a turn: the first follows another schedule's step (other memory to allocate, other
# messages in flight; docs/results.md, "Selection while training") and is not measured; the
# second is
TURN_STEPS = 2
SELECT_SHARE = 0.25  # of the run's steps at most, by default, and at most SELECT_MAX_STEPS
SELECT_MAX_STEPS = 60
SELECT_CONFIDENCE = 0.95
SELECT_COST = 0.03  # of the run's time at the fastest schedule's pace: measuring stops there


def select_budget(run_steps: int, select_steps: Optional[int], n: int) -> int:
    """Steps that may be spent measuring ``n`` schedules in turns (0: too few for a decision)."""
    budget = (
        select_steps if select_steps is not None else min(SELECT_MAX_STEPS, int(SELECT_SHARE * run_steps))
    )
    budget = min(budget, run_steps)
    return budget if budget >= MIN_SELECT_ROUNDS * TURN_STEPS * n else 0


def decide_turns(turns: Sequence[Turn]) -> Decision:
    """The paired test over the rounds so far (one step each per round)."""
    rounds = {t.name: list(t.step_ms) for t in turns}
    # the equal schedules are the reference; with none among them, the first (the solve's pick)
    equal = [t.name for t in turns if is_equal(t.schedule.op_lists())] or [turns[0].name]
    return decide(rounds, equal, confidence=SELECT_CONFIDENCE)


def winner_of(turns: Sequence[Turn], decision: Decision) -> int:
    """The schedule to keep: the test's winner where it decided or where it is faster than the
    solve's pick (the first) at the test's confidence; else the pick, as predicted: where the
    measurement cannot tell, the prediction is the better guess."""
    w = [t.name for t in turns].index(decision.winner)
    if decision.decided or w == 0:
        return w
    return w if compare(turns[w].name, turns[0].step_ms, turns[w].step_ms).faster >= SELECT_CONFIDENCE else 0


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


def selection_record(
    plays: Sequence[Turn],
    chosen: Turn,
    decision: Optional[Decision],
    spent: int,
    run_steps: Optional[int],
    rivals: int,
) -> Selection:
    medians = {p.name: statistics.median(p.step_ms) if p.step_ms else None for p in plays}
    won = medians[chosen.name]
    cost = sum(ms - won for p in plays for ms in p.turn_ms) if won is not None else 0.0
    if decision is None:
        reason = (
            f"not measured: too few steps allowed to measure {MIN_SELECT_ROUNDS} rounds of {1 + rivals} schedules "
            f"(--select-steps or select_steps= {MIN_SELECT_ROUNDS * TURN_STEPS * (1 + rivals)} or more measures them)"
        )
    else:
        reason = decision.reason
        if not decision.decided:
            # (the reason's own comparison may be sure; some other pair was not told apart)
            reason += f"; not every pair told apart within {spent} steps" + (
                ", so the solve's pick is kept"
                if chosen is plays[0] and decision.winner != chosen.name
                else ""
            )
    note = None
    if decision is not None and chosen is not plays[0]:
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
