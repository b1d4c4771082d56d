"""Measurement: what each pipeline stage costs, with torch, on this machine (``umopt profile``).

- :mod:`.options`: what to measure (:class:`ProfileOptions`) and the checks before any timing;
- :mod:`.chunk`: a stage under measurement and the one primitive every measurement runs on it,
  a chunk's forward and backward (:class:`StageProbe`), its memory and optimizer step;
- :mod:`.timing`: rounds of repeats, the machine's drift taken out, stages timed together;
- :mod:`.split`: contiguous stages balanced on measured layer times;
- :mod:`.links`: the links and the all-reduce, measured between real processes;
- :mod:`.profile`: the steps above assembled into a profile file's model.

It exposes what callers use; the rest stays inside its modules.
"""

import importlib

# what callers use, and the module it lives in: imported on first use, so that a caller of the
# light modules (the paired test, the noise) does not pay for torch's import (seconds on a CPU)
_WHERE = {
    "ProfileOptions": "options",
    "ProgressFn": "options",
    "check_profile_options": "options",
    "profile_model": "profile",
    "profile_stages": "profile",
    "balanced_split": "split",
    "ProfiledStage": "chunk",
    "StageProbe": "chunk",
    "stash_bytes": "chunk",
    "measure_link": "links",
    "measure_links": "links",
    "measure_allreduce": "links",
    "pingpong_sizes": "links",
    "link_plan": "links",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
