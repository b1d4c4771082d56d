"""umopt: unequal per-stage microbatch partitions for pipeline-parallel training.

``umopt.Pipeline`` (:mod:`umopt.run.pipeline`) runs a schedule inside your own training loop and
``umopt.profile_stages`` (:mod:`umopt.measure`) profiles your own stage modules; both are imported
on first use, so that the commands that need no torch (``umopt solve``) start fast.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Pipeline", "TensorSpec", "profile_stages", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from .run.pipeline import Pipeline

        return Pipeline
    if name == "TensorSpec":  # what Pipeline's input_specs / output_specs take
        from .devices import TensorSpec

        return TensorSpec
    if name == "profile_stages":
        from .measure import profile_stages

        return profile_stages
    raise AttributeError(f"module 'umopt' has no attribute {name!r}")
