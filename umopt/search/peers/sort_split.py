"""``sort-split``: sort by length and cut into contiguous microbatches of about equal tokens, each
padded to its own longest or packed, whichever is faster, the best count.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...formats.profile import AllReduceProfile, Profile
from ..method import Method, Request
from ..plan import Layout, Plan
from .equal import best_shared


def _equal_token_cuts(tokens: np.ndarray, m: int) -> list[int]:
    """Sizes of ``m`` contiguous groups of about equal tokens (each at least one sample)."""
    B = len(tokens)
    ends = np.searchsorted(np.cumsum(tokens), np.sum(tokens) * np.arange(1, m) / m, side="left") + 1
    cuts = [0]
    for e in ends:
        cuts.append(int(min(max(e, cuts[-1] + 1), B - (m - len(cuts)))))
    cuts.append(B)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def sort_split(
    profile: Profile, lengths, S: int, recompute: bool = False, dp: Optional[AllReduceProfile] = None
) -> Optional[Plan]:
    L = np.asarray(lengths)
    order = np.argsort(L, kind="stable")
    parts = [_equal_token_cuts(L[order], m) for m in range(1, len(L) + 1)]
    parts = [p for p in parts if max(p) <= len(L)]
    choices = [(Layout.of_order(order, mode), parts, {"mode": mode}) for mode in profile.lengths.modes]
    return best_shared("sort-split", profile, L, choices, S, recompute, dp)


class SortSplit(Method):
    name = "sort-split"
    position = 4

    def _plan(self, r: Request) -> Optional[Plan]:
        return sort_split(r.profile, r.lengths, r.stages, r.recompute, r.dp)
