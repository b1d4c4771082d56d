"""Minibatches of sequences of different lengths: where each stage cuts them, and the peers' ways.

A minibatch's sequences are ordered and cut into microbatches by each stage on its own (UMPIPE's
unequal partitions, per stage, forward and backward apart), by tokens and attention work:
:mod:`.samplers` draws length distributions, :mod:`.plan` is a plan and its predicted time,
:mod:`.planner` searches plans within a step's planning budget, :mod:`.peers` holds what others
do (padding, packing, DynaPipe, WLB-LLM), each at its best settings, :mod:`.solve` makes a plan a
schedule (``umopt solve --lengths``, ``umopt.Pipeline.step(plan=)``), :mod:`.ahead` plans ahead
of the steps in a process of its own.
"""
