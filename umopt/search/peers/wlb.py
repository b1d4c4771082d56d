"""``wlb``: WLB-LLM (Wang et al., OSDI'25): each sequence, heaviest first, into the microbatch of
least workload so far, a sequence's workload ``b L + c L^2`` from the profile's costs by tokens
(summed over stages), microbatches packed with attention masked per sequence, the best count.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...formats.profile import AllReduceProfile, Profile
from ..method import Method, Request
from ..plan import Layout, Plan
from .equal import best_shared


def wlb(
    profile: Profile, lengths, S: int, recompute: bool = False, dp: Optional[AllReduceProfile] = None
) -> Optional[Plan]:
    L = np.asarray(lengths)
    costs = [st.tokens["packed"] for st in profile.stages]
    b = sum(c.forward.b_ms + c.backward.b_ms for c in costs)
    c2 = sum(c.forward.c_ms + c.backward.c_ms for c in costs)
    work = b * L + c2 * L.astype(float) ** 2
    heaviest = np.argsort(-work, kind="stable")
    choices = []
    for m in range(1, len(L) + 1):
        load = np.zeros(m)
        groups: list[list[int]] = [[] for _ in range(m)]
        for i in heaviest:
            k = int(np.argmin(load))
            groups[k].append(int(i))
            load[k] += work[i]
        groups = [g for g in groups if g]
        order = [i for g in groups for i in g]
        choices.append((Layout.of_order(order, "packed"), [[len(g) for g in groups]], {"mode": "packed"}))
    return best_shared("wlb", profile, L, choices, S, recompute, dp)


class WLB(Method):
    name = "wlb"
    position = 6
    needs = "packed"

    def _plan(self, r: Request) -> Optional[Plan]:
        return wlb(r.profile, r.lengths, r.stages, r.recompute, r.dp)
