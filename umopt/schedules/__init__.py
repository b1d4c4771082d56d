"""Schedule families: how a family's genes become the op lists of every rank.

One chunk per rank: :mod:`.gpipe` (every forward, then every backward), :mod:`.onef1b` (1F1B
with a warm-up per stage) and the free order of the exact models, each a
:class:`~.family.ScheduleFamily` (:data:`FAMILIES`: op lists from partitions, a population
scored at once); :mod:`.weights`, W placement, modifies any of them. Several chunks per rank:
:mod:`.multichunk` (looped or V-shaped, each virtual stage with its own partition, the ranks'
orders built by list scheduling). The families are imported from :mod:`.family` by name: they
score populations with :mod:`umopt.schedules.population_sim`, which builds op lists with the modules here,
so this package does not import them.
"""

from .gpipe import gpipe_ops
from .multichunk import ChunkGenes, build_ops
from .onef1b import onef1b_schedule, pipedream_warmup
from .weights import place_weights, with_weight_ops

__all__ = [
    "gpipe_ops",
    "onef1b_schedule",
    "pipedream_warmup",
    "with_weight_ops",
    "place_weights",
    "ChunkGenes",
    "build_ops",
]
