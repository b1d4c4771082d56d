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

from .chunk import ProfiledStage, StageProbe, stash_bytes
from .links import link_plan, measure_allreduce, measure_link, measure_links, pingpong_sizes
from .options import ProfileOptions, ProgressFn, check_profile_options
from .profile import profile_model, profile_stages
from .split import balanced_split

__all__ = [
    "ProfileOptions",
    "ProgressFn",
    "check_profile_options",
    "profile_model",
    "profile_stages",
    "balanced_split",
    "ProfiledStage",
    "StageProbe",
    "stash_bytes",
    "measure_link",
    "measure_links",
    "measure_allreduce",
    "pingpong_sizes",
    "link_plan",
]
