"""Layer balancing: contiguous stages of a model's layers that minimise the slowest stage."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import UmoptError

__all__ = ["balanced_split"]


def balanced_split(layer_ms: Sequence[float], num_stages: int) -> list[int]:
    """Cut points ``[0, c1, ..., L]`` of contiguous stages minimising the slowest stage's time."""
    L = len(layer_ms)
    if num_stages > L:
        raise UmoptError(f"{num_stages} stages asked for a model of {L} layers")
    prefix = np.concatenate(([0.0], np.cumsum(layer_ms)))
    # best[k][j]: slowest stage when the first j layers form k stages; arg keeps the last cut
    best = np.full((num_stages + 1, L + 1), np.inf)
    arg = np.zeros((num_stages + 1, L + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, L + 1):
            i = np.arange(k - 1, j)
            cost = np.maximum(best[k - 1, i], prefix[j] - prefix[i])
            m = int(np.argmin(cost))
            best[k, j], arg[k, j] = cost[m], i[m]
    cuts = [L]
    for k in range(num_stages, 0, -1):
        cuts.append(int(arg[k, cuts[-1]]))
    return cuts[::-1]
