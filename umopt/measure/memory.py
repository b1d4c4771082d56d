"""Peak memory measured: CUDA's own count, or on CPUs torch's profiler (what the profile's memory
figures and ``umopt run``'s measured peaks are taken with).

[Note: a CPU step's peak memory]
torch's CPU allocator keeps no statistics (CUDA's ``max_memory_allocated`` has no CPU twin), and
tracemalloc sees Python's allocations, not tensors'. torch's profiler with ``profile_memory``
records every tensor allocation and free with the running total allocated since it started, so
one step run under it gives that step's peak over what was held when it began (its thread's
allocations and frees summed in order: other threads' are not the step's), as CUDA's
``max_memory_allocated`` minus ``memory_allocated`` before it does. Where the whole is wanted (a
rank's peak in ``umopt run``), what was held when the step began (the weights, the optimizer's
state, the runtime's receive buffers, and the gradients where they are kept between steps) is
counted from those tensors themselves, each storage once. The profiler slows what it watches, so
a run measures a warm-up step (the last one: the optimizer's state and the buffers exist by
then), never a timed one, and a profile measures memory apart from its timings.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["held_bytes", "peak_during", "state_tensors"]


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors`` (a storage viewed twice counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def peak_during(run: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """``run()``'s result, and the most bytes it had allocated at once beyond what was allocated
    when it began (see [Note: a CPU step's peak memory])."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = run()
        torch.cuda.synchronize(device)
        return out, int(torch.cuda.max_memory_allocated(device) - base)
    # kineto logs every start and stop of a profile to stderr at its "USDT" level (5): a run's
    # output is not the place; read when the profiler first starts (a setting given is kept)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="umopt-memory-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    # this thread's allocations and frees only: the running total the profiler keeps counts every
    # thread's, and a process may have others allocating meanwhile (a step's own run here)
    me = threading.get_native_id()
    mine = sorted(
        (e["ts"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e.get("tid") == me and e.get("args", {}).get("Device Type") == 0
    )
    running = np.cumsum([b for _, b in mine]) if mine else np.zeros(1)
    return out, int(max(0, running.max()))


def state_tensors(modules: Iterable[torch.nn.Module], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a rank holds between steps: its modules' parameters, buffers and kept gradients, and
    the optimizer's state."""
    out: list[torch.Tensor] = []
    for m in modules:
        for p in m.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(m.buffers())
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out
