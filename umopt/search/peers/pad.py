"""``pad``: pad every sequence of the minibatch to its longest, then equal microbatches on every
stage (torch.distributed.pipelining and DeepSpeed with fixed shapes), the best microbatch count,
GPipe or 1F1B order; with several chunks per rank, torch's multi-chunk schedules.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...costmodel import Chunking
from ...formats.profile import AllReduceProfile, Profile
from ..method import Method, Request
from ..plan import Layout, Plan
from .equal import best_equal


def pad(
    profile: Profile,
    lengths,
    S: int,
    recompute: bool = False,
    dp: Optional[AllReduceProfile] = None,
    chunks: int = 1,
    on: Optional[Chunking] = None,
) -> Optional[Plan]:
    L = np.asarray(lengths)
    layout = Layout(tuple((i,) for i in range(len(L))), "padded", pad_to=int(L.max()))
    return best_equal("pad", profile, L, layout, S, recompute, dp, chunks, on, padded_to=int(L.max()))


class Pad(Method):
    name = "pad"
    position = 1
    needs = "padded"
    chunked = True

    def _plan(self, r: Request) -> Optional[Plan]:
        return pad(r.profile, r.lengths, r.stages, r.recompute, r.dp, max(r.chunks), r.on)
