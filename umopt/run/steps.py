"""Step counts of a run: its defaults, and the steps selection while training may take
([Note: selection while training] in :mod:`.selection`). Plain arithmetic without torch, so
that ``umopt solve``'s next-step hint reads it without paying for torch's import.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "RUN_STEPS",
    "RUN_WARMUP",
    "MIN_SELECT_ROUNDS",
    "TURN_STEPS",
    "SELECT_SHARE",
    "SELECT_MAX_STEPS",
    "SELECT_MOST",
    "selection_steps_needed",
    "select_budget",
]

RUN_STEPS = 40  # umopt run's steps, by default
RUN_WARMUP = 2  # ...and its warm-up steps before them

MIN_SELECT_ROUNDS = 3
# steps in a turn: the first follows another schedule's step (other memory to allocate, other
# messages in flight; docs/results.md, "Selection while training") and is not measured; the
# second is
TURN_STEPS = 2
SELECT_SHARE = 0.25  # of the run's steps, by default, and at most SELECT_MAX_STEPS...
SELECT_MAX_STEPS = 60
SELECT_MOST = 0.5  # ...but at least what MIN_SELECT_ROUNDS rounds need, up to this share of the run


def selection_steps_needed(n: int) -> int:
    """Steps that measure ``n`` schedules over MIN_SELECT_ROUNDS rounds, after a first round."""
    return n + MIN_SELECT_ROUNDS * TURN_STEPS * n


def select_budget(run_steps: Optional[int], select_steps: Optional[int], n: int) -> int:
    """Steps that may be spent on ``n`` schedules in turns, the first round's included (0: too
    few for a decision).

    Given ``select_steps``, that many (within the run); else a quarter of the run (at most
    SELECT_MAX_STEPS), raised to what MIN_SELECT_ROUNDS rounds need where that is at most half of
    the run; without a known run, SELECT_MAX_STEPS."""
    need = selection_steps_needed(n)
    if select_steps is not None:
        budget = select_steps if run_steps is None else min(select_steps, run_steps)
    elif run_steps is None:
        budget = max(SELECT_MAX_STEPS, need)
    else:
        budget = min(SELECT_MAX_STEPS, int(SELECT_SHARE * run_steps))
        if budget < need <= SELECT_MOST * run_steps:
            budget = need
    return budget if budget >= need else 0
