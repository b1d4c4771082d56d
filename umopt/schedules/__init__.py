"""Schedule families: how a family's genes become the op lists of every rank.

``multichunk``: several model chunks (virtual stages) per rank, looped or V-shaped, each virtual
stage with its own unequal partition, the ranks' orders built by list scheduling. (The one-chunk
families, GPipe, 1F1B with per-stage warm-ups and W placement, still live in
:mod:`umopt.partition`, :mod:`umopt.population_sim` and :mod:`umopt.zerobubble`.)
"""

from .multichunk import ChunkGenes, build_ops

__all__ = ["ChunkGenes", "build_ops"]
