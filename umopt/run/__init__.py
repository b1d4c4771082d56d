"""The runtime: one pipeline rank playing a schedule, in ``umopt run`` and in your own loop.

Read it in this order:

- :mod:`.comm`: what the runtime asks of torch.distributed, in one place (the links' process
  groups, one per link and direction, connected before the first step; the set-up exchanges,
  each wait bounded; messages and the few collectives);
- :mod:`.failures`: a failed step breaks the pipeline, and every rank hears of it at once;
- :mod:`.stage`: one virtual stage on this rank (its module, what crosses its edges, its buffers);
- :mod:`.links`: one step's messages, in the order both ends agree on;
- :mod:`.player`: a rank's op list played over its stages (a step, or forwards only);
- :mod:`.selection`: a schedule file's pick and candidates taking turns, the fastest kept;
- :mod:`.pipeline`: :class:`~umopt.run.pipeline.Pipeline`, the user's object (one module or a
  list of chunk modules), built from the pieces above;
- ``umopt run``: :mod:`.options` (what it is asked), :mod:`.launch` (the ranks on this machine),
  :mod:`.rank` (one rank's run), :mod:`.report`, :mod:`.checkpoint`, :mod:`.signals`,
  :mod:`.faults` (fault injection for the tests).

A pipeline with one chunk per rank is the case of one virtual stage per rank: there is one code
path for every layout.
"""
