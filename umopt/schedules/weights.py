"""W placement (zero bubble): a modifier of the other families, not a family of its own.

A stage whose backward is split runs B (the input gradient) and, later, a W op per B chunk (the
weight gradient). :func:`with_weight_ops` places them in a stage's F/B order under a cap on the
samples awaiting their W; :func:`place_weights` does it for every stage of any family's op lists.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

from ..costmodel import Op, OpKind

__all__ = ["with_weight_ops", "place_weights"]


def with_weight_ops(stage_ops: Sequence[Op], cap: Optional[int]) -> list[Op]:
    """One stage's F/B ops with a W op per B chunk, each as late as the stage can hold: before an F,
    the oldest W ops run until its samples fit under ``cap`` samples awaiting their W (forwarded,
    weight gradient not yet computed); after a B, while more than ``cap`` await. The rest run after
    the last op; ``None`` defers every W there.

    With ``cap`` at the stage's in-flight peak of the F/B order (ZB-H1: 1F1B's), memory stays what
    it was; in GPipe order, where all samples are in flight after the forwards, ``cap`` is how many
    samples' W ops wait for the end while the others run right after their B.
    """
    out: list[Op] = []
    pending: deque[Op] = deque()
    held = 0
    for op in stage_ops:
        if op.kind == OpKind.F:
            while pending and cap is not None and held + op.size > cap:
                w = pending.popleft()
                out.append(w)
                held -= w.size
            held += op.size
        out.append(op)
        if op.kind == OpKind.B:
            pending.append(Op(OpKind.W, op.lo, op.hi))
            while pending and cap is not None and held > cap:
                w = pending.popleft()
                out.append(w)
                held -= w.size
    return out + list(pending)


def place_weights(ops: Sequence[Sequence[Op]], wcap: Sequence[int]) -> list[list[Op]]:
    """Every stage's W ops placed under its cap (negative: the stage's backward stays whole)."""
    return [with_weight_ops(st, int(cap)) if cap >= 0 else list(st) for st, cap in zip(ops, wcap)]
