"""Lower bounds on the iteration time: how far from optimal a schedule is at most.

Every bound here holds for every schedule of its :class:`Scope` under the cost model of
docs/formats.md; what each one relaxes, and why it is valid, is docs/bounds.md. Solvers and
reports call only what this module exports:

- :func:`fast_bound_ms`: the best bound that takes seconds at most (stage cuts, untied bound;
  on small instances the pair program);
- :func:`pair_bound_ms`: two adjacent stages at a time searched exactly, within a time limit;
- :func:`start_bound_ms`: the bound an exact model starts from;
- :class:`BackgroundBounds`: a bound computed in a process of its own while a solver searches;
- :func:`heads_and_tails`, :func:`int_tables`, :func:`linear_cuts`: what the exact models add as
  redundant constraints.
"""

from .background import BackgroundBounds
from .fast import fast_bound_ms, fast_job, spec_bound
from .heads import Heads, heads_and_tails, int_tables, linear_cuts
from .pair_models import IN_ORDER_MAX_CELLS, PAIR_MAX_CELLS
from .pairs import pair_bound_ms, pair_bound_runs, pairs_job, start_bound_ms
from .scope import Scope, bound_for, reported_bounds, scope_of

__all__ = [
    "Scope",
    "scope_of",
    "bound_for",
    "reported_bounds",
    "fast_bound_ms",
    "spec_bound",
    "pair_bound_ms",
    "pair_bound_runs",
    "start_bound_ms",
    "BackgroundBounds",
    "fast_job",
    "pairs_job",
    "Heads",
    "heads_and_tails",
    "int_tables",
    "linear_cuts",
    "PAIR_MAX_CELLS",
    "IN_ORDER_MAX_CELLS",
]
