"""What umopt agrees to hold: the largest minibatch, chunk, pipeline and number it accepts.

Every array umopt allocates grows with the minibatch, the largest chunk size and the number of
stages, and every time and byte count is summed over many ops. Files and options are checked
against these limits before anything is allocated, so a typo (``-B 1000000``) or a hostile file
(a chunk size of 10^9, a time of 1e308) ends in one line naming the limit, not in an
out-of-memory kill or an overflow deep inside the solver. :func:`check_problem_size` adds what
the machine itself can hold.

The limits are far above any pipeline in use (samples per pipeline per iteration, not tokens),
and small enough that the sums of times and bytes over a whole schedule stay exact in float64
and int64.
"""

from __future__ import annotations

import os
from typing import Optional

from .errors import UmoptError

__all__ = [
    "MAX_MINIBATCH",
    "MAX_STAGES",
    "MAX_CELLS",
    "MAX_MS",
    "MAX_BYTES",
    "check_problem_size",
    "available_memory_bytes",
]

MAX_MINIBATCH = 8192  # samples per pipeline per iteration; also the largest chunk a profile may hold
MAX_STAGES = 1024
MAX_CELLS = 1 << 20  # stages x minibatch: what the searches' per-sample arrays grow with
MAX_MS = 1e7  # one op or message (about 2.8 hours): sums over a schedule stay far from overflow
MAX_BYTES = 1 << 50  # bytes per sample, static bytes, memory limits (1 PiB)

# bytes the solve holds per (stage, sample) cell: the GA's population of per-sample arrays and
# the population simulator's scratch, with room to spare
_BYTES_PER_CELL = 16384


def available_memory_bytes() -> Optional[int]:
    """Memory this process may still take (MemAvailable), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_problem_size(num_stages: int, minibatch: int) -> None:
    """Refuse, before allocating, a problem beyond umopt's limits or this machine's memory."""
    if minibatch > MAX_MINIBATCH:
        raise UmoptError(
            f"minibatch {minibatch} is over umopt's limit of {MAX_MINIBATCH} samples per pipeline per iteration"
        )
    cells = num_stages * minibatch
    if cells > MAX_CELLS:
        raise UmoptError(
            f"{num_stages} stages x minibatch {minibatch} = {cells} cells, over umopt's limit of {MAX_CELLS} "
            "(fewer stages or a smaller minibatch per pipeline)"
        )
    need, have = cells * _BYTES_PER_CELL, available_memory_bytes()
    if have is not None and need > have:
        raise UmoptError(
            f"{num_stages} stages x minibatch {minibatch} needs about {need / 2**30:.1f} GiB to solve; "
            f"this machine has {have / 2**30:.1f} GiB available"
        )
