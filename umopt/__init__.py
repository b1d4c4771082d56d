"""umopt: unequal per-stage microbatch partitions for pipeline-parallel training."""

__version__ = "0.1.0"
