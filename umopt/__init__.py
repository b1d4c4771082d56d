"""umopt: unequal per-stage microbatch partitions for pipeline-parallel training.

``umopt.Pipeline`` (:mod:`umopt.pipeline`) runs a schedule inside your own training loop; it is
imported on first use, so that the commands that need no torch (``umopt solve``) start fast.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Pipeline", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'umopt' has no attribute {name!r}")
