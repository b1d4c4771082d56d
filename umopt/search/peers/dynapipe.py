"""``dynapipe``: DynaPipe (Jiang et al., EuroSys'24): sort by length, then a dynamic program over the
sorted sequences that minimises ``(S - 1) t_max + sum of t`` over microbatches (t a microbatch's
time on the slowest stage, each under a cap ``t_max``, every cap tried), within the memory limit;
microbatches padded to their own longest, as the paper's, or packed, and played in sorted order
or its reverse, GPipe or 1F1B, whichever is fastest.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...formats.profile import AllReduceProfile, Profile
from ..method import Method, Request
from ..plan import Layout, Plan
from .equal import best_shared


def _microbatch_ms(tables, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A microbatch's forward and backward on the slowest stage (DynaPipe's microbatch time)."""
    R = tables.ranged
    return (R.fwd[:, lo, hi] + R.bwd[:, lo, hi]).max(axis=0)


def dynapipe(
    profile: Profile,
    lengths,
    S: int,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    caps: int = 48,
) -> Optional[Plan]:
    """``caps``: how many caps on a microbatch's time the DP tries (quantiles of every range's
    time; the paper's search over the cap, sampled)."""
    L = np.asarray(lengths)
    B = len(L)
    order = np.argsort(L, kind="stable")
    choices = []
    for mode in profile.lengths.modes:
        layout = Layout.of_order(order, mode)
        tables = layout.tables(profile, L, recompute, dp)
        lo, hi = np.triu_indices(B + 1, 1)
        t = np.full((B + 1, B + 1), np.inf)
        t[lo, hi] = _microbatch_ms(tables, lo, hi)
        if tables.memory_limit is not None:  # a microbatch alone must fit (DynaPipe's constraint)
            need = tables.static_bytes.max() + tables.ranged.stash[:, lo, hi].max(axis=0)
            t[lo[need > tables.memory_limit], hi[need > tables.memory_limit]] = np.inf
        finite = np.sort(t[np.isfinite(t)])
        partitions = []
        for cap in np.unique(finite[np.linspace(0, len(finite) - 1, min(caps, len(finite))).astype(int)]):
            capped = np.where(t <= cap, t, np.inf)
            best, arg = np.full(B + 1, np.inf), np.zeros(B + 1, dtype=int)
            best[0] = 0.0
            for j in range(1, B + 1):  # best[j]: least sum of times cutting [0, j)
                c = best[:j] + capped[:j, j]
                arg[j] = int(np.argmin(c))
                best[j] = c[arg[j]]
            if not np.isfinite(best[B]):
                continue
            sizes, j = [], B
            while j > 0:
                sizes.append(j - arg[j])
                j = arg[j]
            partitions.append(((S - 1) * float(cap) + float(best[B]), sizes[::-1]))
        partitions.sort(key=lambda x: x[0])
        keep = [p for _, p in partitions[:8]]  # the DP's best by its objective (and a few more)
        choices.append((layout, keep, {"mode": mode, "microbatch_order": "ascending"}))
        rev = Layout.of_order(order[::-1], mode)
        choices.append((rev, [p[::-1] for p in keep], {"mode": mode, "microbatch_order": "descending"}))
    return best_shared("dynapipe", profile, L, choices, S, recompute, dp)


class DynaPipe(Method):
    name = "dynapipe"
    position = 5

    def _plan(self, r: Request) -> Optional[Plan]:
        return dynapipe(r.profile, r.lengths, r.stages, r.recompute, r.dp)
