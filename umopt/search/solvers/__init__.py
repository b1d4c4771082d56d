"""Solvers: each turns a :class:`umopt.search.problem.Problem` into a :class:`umopt.search.problem.SolverResult`.

One module each: ``equal`` (best equal chunks), ``dp`` (one shared partition by dynamic
programming), ``ramp`` (one shared partition, small chunks first and last), ``greedy`` (stage-by-stage local choice), ``ga`` (the paper's dual-chromosome
genetic algorithm on the vectorized evaluator), ``cpsat`` and ``milp`` (exact models in OR-Tools
CP-SAT and in PuLP, of free-order or GPipe-order schedules, seeded with the GA's best; their
lower bounds come with :mod:`umopt.search.bounds`) and ``auto`` (the heuristics within a time budget).
"""

from .auto import solve_auto
from .cpsat import solve_cpsat
from .dp import solve_dp
from .equal import solve_equal
from .ga import solve_ga
from .greedy import solve_greedy
from .milp import solve_milp
from .ramp import solve_ramp

SOLVERS = {
    "auto": solve_auto,
    "ga": solve_ga,
    "greedy": solve_greedy,
    "dp": solve_dp,
    "ramp": solve_ramp,
    "equal": solve_equal,
    "cpsat": solve_cpsat,
    "milp": solve_milp,
}

__all__ = [
    "SOLVERS",
    "solve_auto",
    "solve_ga",
    "solve_greedy",
    "solve_dp",
    "solve_ramp",
    "solve_equal",
    "solve_cpsat",
    "solve_milp",
]
