"""The search: from a profile to the schedule to run (``umopt solve``).

- :mod:`.solve`: one chunk per rank: the problem made once, the solvers (umopt/search/solvers/), the
  bounds (umopt/search/bounds/), the baselines and the zero-bubble schedules, and what to recommend;
- :mod:`.solve_chunks`: several chunks per rank, beside torch's schedules, on one clock;
- :mod:`.peers`: torch's multi-chunk schedules, their orders taken from torch itself;
- :mod:`.zerobubble`: the ZB-H1 reference and umopt's W placement search;
- :mod:`.choice`: what to recommend where the profile cannot tell schedules apart.
- :mod:`.problem`: the one-chunk problem every solver sees (cost tables, a candidate's genes);
  :mod:`.baselines`, the best equal schedules; :mod:`.stoppable`, CP-SAT searches Ctrl-C stops;
- :mod:`.solvers`: the GA, the exact CP-SAT and MILP models, the baselines' searches and the rest;
- :mod:`.bounds`: the lower bounds, proved by each model or computed apart.

Its modules are imported by name; this package imports none of them.
"""
