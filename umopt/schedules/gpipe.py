"""The GPipe family: every forward in sample order, then every backward in reverse sample order.

Its genes are the stages' forward and backward partitions; its op lists come from
:func:`gpipe_ops`; a population of it is scored by :func:`umopt.schedules.population_sim.evaluate_gpipe`
(numpy, or the compiled evaluator with W ops).
"""

from __future__ import annotations

from typing import Sequence

from ..costmodel import Op, OpKind
from .partition import chunks

__all__ = ["gpipe_ops"]


def gpipe_ops(fsizes: Sequence[int], bsizes: Sequence[int]) -> list[Op]:
    """One stage's GPipe order: every F in sample order, then every B in reverse sample order."""
    ops: list[Op] = [Op(OpKind.F, lo, hi) for lo, hi in chunks(fsizes)]
    ops += [Op(OpKind.B, lo, hi) for lo, hi in reversed(chunks(bsizes))]
    return ops
