"""Which schedules a bound (or a proof of optimality) holds for.

A bound proven among GPipe-order schedules says nothing about a 1F1B one, and one proven within
the 1F1B family (every stage runs its B ops in sample order) nothing about a free order; only an
any-order bound holds for every schedule. Reports compare each schedule with the best bound whose
scope covers it.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, Sequence

from ...costmodel import Op
from ...schedules.family import GPIPE, ScheduleFamily, family
from ...schedules.partition import backwards_in_sample_order

__all__ = ["Scope", "scope_of", "bound_for", "reported_bounds"]


class Scope(str, Enum):
    """The schedules a bound holds for; the value is what schedule files say (``solver.bound_scope``)."""

    ANY = "any order"
    IN_ORDER = "1f1b order"  # every stage runs its B ops in sample order: 1F1B with any warm-ups
    GPIPE = "gpipe order"

    def covers(self, ops: Sequence[Sequence[Op]], order: str) -> bool:
        """Is a schedule with these op lists, built in ``order`` ("gpipe", "1f1b", "free"), one of this scope's?"""
        if self is Scope.ANY:
            return True
        if self is Scope.GPIPE:
            return family(order) is GPIPE
        return backwards_in_sample_order(ops)


def scope_of(value: Optional[str]) -> Scope:
    """The scope a schedule file names (none named: the fast any-order bound)."""
    return Scope.ANY if value is None else Scope(value)


def bound_for(
    ops: Sequence[Sequence[Op]], order: str, bounds: dict[Scope, Optional[float]]
) -> Optional[float]:
    """The highest of ``bounds`` whose scope covers the schedule (None: none does)."""
    valid = [b for scope, b in bounds.items() if b is not None and scope.covers(ops, order)]
    return max(valid, default=None)


def reported_bounds(
    fast: dict["Scope", Optional[float]],
    solver_bound: Optional[float],
    solver_scope: Optional[str],
    solver_family_bound: Optional[float],
    ops: Sequence[Sequence[Op]],
    order: Optional[ScheduleFamily],
) -> tuple[float, Optional["Scope"], Optional[float]]:
    """What a schedule file reports: its bound, that bound's scope (None: the fast any-order
    one), and the 1F1B family's bound where the schedule is of that family (else None).

    ``fast``: the fast bounds by scope (:attr:`Scope.IN_ORDER` None where there is none); the
    solver's own bound and its scope; ``order``: the family ``--order`` searched (None: auto).
    Under ``--order 1f1b`` (a family whose backwards run in sample order) the family is the whole
    question, so its bound is the bound.
    """
    scope = None if solver_scope is None else Scope(solver_scope)
    bound = max(fast[Scope.ANY], solver_bound or fast[Scope.ANY])
    family = None
    in_order = order is not None and order.backwards_in_sample_order
    if fast.get(Scope.IN_ORDER) is not None and (in_order or backwards_in_sample_order(ops)):
        family = max(bound, fast[Scope.IN_ORDER], solver_family_bound or 0.0)
    if in_order and family is not None:
        bound, scope = family, Scope.IN_ORDER
    return bound, scope, family
