"""The 1F1B family (PipeDream-flush) with a warm-up per stage, for any per-stage partitions.

Its genes are the stages' partitions and each stage's warm-up (forwards before its first
backward: PipeDream-flush's ``S - s - 1`` by default, fewer or more as the search finds); its op
lists come from :func:`onef1b_schedule`; a population of it is scored by
:func:`umopt.schedules.population_sim.evaluate_1f1b`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..costmodel import Op, OpKind
from .partition import chunks

__all__ = ["pipedream_warmup", "onef1b_schedule"]


def pipedream_warmup(num_stages: int) -> list[int]:
    """PipeDream-flush's warm-up forwards per stage: ``S - s - 1``."""
    return list(range(num_stages - 1, -1, -1))


def onef1b_schedule(
    fsizes: Sequence[Sequence[int]], bsizes: Sequence[Sequence[int]], warmup: Optional[Sequence[int]] = None
) -> list[list[Op]]:
    """Every stage's 1F1B (PipeDream-flush) order, for any per-stage partitions.

    Stage ``s`` runs ``warmup[s]`` warm-up forwards (PipeDream-flush: ``S - s - 1``, the default),
    then one forward and at most one backward in turn (both in sample order), then the remaining
    backwards. Other warm-ups give the orders between 1F1B (few forwards in flight) and GPipe (all
    forwards first); a stage that holds the most work often wants fewer in flight than the
    textbook, and one that feeds it more. With unequal partitions a stage may
    only start a backward once it has forwarded every sample the stages below need before they
    can send that backward's gradients back; otherwise it would wait on a stage that waits on it.
    That requirement is worked out from the last stage up, and a backward whose requirement is
    not met yet waits for more forwards. With equal partitions this is the textbook 1F1B.
    """
    S = len(fsizes)
    warm = pipedream_warmup(S) if warmup is None else warmup
    out: list[list[Op]] = [[] for _ in range(S)]
    needed_below: list[int] = []  # per B chunk of stage s+1: samples it had forwarded when running it
    below_b: list[tuple[int, int]] = []
    for s in range(S - 1, -1, -1):
        fch, bch = chunks(fsizes[s]), chunks(bsizes[s])
        need = []
        for lo, hi in bch:
            n = hi
            if s + 1 < S:  # the B chunk of stage s+1 that holds this chunk's last sample
                k = next(i for i, (l2, h2) in enumerate(below_b) if l2 <= hi - 1 < h2)
                n = max(n, max(needed_below[: k + 1]))
            need.append(n)
        ops: list[Op] = []
        forwarded_when: list[int] = []
        i = j = forwarded = 0
        for _ in range(min(warm[s], len(fch))):
            ops.append(Op(OpKind.F, *fch[i]))
            forwarded = fch[i][1]
            i += 1
        while i < len(fch) or j < len(bch):
            if i < len(fch):
                ops.append(Op(OpKind.F, *fch[i]))
                forwarded = fch[i][1]
                i += 1
            while j < len(bch) and (need[j] <= forwarded or i == len(fch)):
                ops.append(Op(OpKind.B, *bch[j]))
                forwarded_when.append(forwarded)
                j += 1
                if i < len(fch):
                    break
        out[s] = ops
        needed_below, below_b = forwarded_when, bch
    return out
