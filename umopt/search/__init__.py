"""The search: from a profile to the schedule to run (``umopt solve``).

- :mod:`.solve`: one chunk per rank: the problem made once, the solvers (umopt/solvers/), the
  bounds (umopt/bounds/), the baselines and the zero-bubble schedules, and what to recommend;
- :mod:`.solve_chunks`: several chunks per rank, beside torch's schedules, on one clock;
- :mod:`.peers`: torch's multi-chunk schedules, their orders taken from torch itself;
- :mod:`.zerobubble`: the ZB-H1 reference and umopt's W placement search;
- :mod:`.choice`: what to recommend where the profile cannot tell schedules apart.

Its modules are imported by name; this package imports none of them.
"""
