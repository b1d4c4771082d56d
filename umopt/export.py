"""Schedules in other runtimes' formats: ``umopt export SCHEDULE --format torch-csv -o plan.csv``.

torch.distributed.pipelining runs a schedule given as a CSV of actions, one row per rank, each
cell ``{stage}F{microbatch}`` or ``{stage}B{microbatch}`` in the order the rank runs them
(``_PipelineScheduleRuntime._load_csv``, which adds the sends and receives itself). On a stage
with W ops (zero bubble) B is torch's ``I`` (the input gradient) and each W its ``W`` action, one
per microbatch: a W op over several microbatches becomes their W actions in a row, which is
what umopt's runtime computes too (each chunk's own saved backward). torch splits
the minibatch into equal microbatches, the same for every stage, and averages their losses, so
only schedules with one partition of equal chunks on every stage can be written; their op order,
per-stage warm-ups included, is kept (torch's built-in 1F1B has one warm-up rule for all). Any
other schedule is refused with the reason.
"""

from __future__ import annotations

import csv
import io
import itertools

from .costmodel import OpKind
from .errors import UmoptError
from .formats.schedule import Schedule
from .schedules.partition import partitions_from_ops

__all__ = ["FORMATS", "torch_csv"]

FORMATS = ("torch-csv",)


def torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's compute-only pipeline CSV (one row per rank; with several chunks
    per rank, each action names its virtual stage, as torch's multi-stage schedules do)."""
    if schedule.recompute:
        raise UmoptError(
            "torch-csv: torch's schedules cannot recompute inside a backward as this schedule does"
        )
    # every op as (stage, kind, lo, hi), per rank
    rows = [
        [(op[3] if len(op) == 4 else r, op[0], op[1], op[2]) for op in rank_ops]
        for r, rank_ops in enumerate(schedule.op_lists())
    ]
    V = len(schedule.chunks.ranks) if schedule.chunks is not None else len(rows)
    per_stage: list[list] = [[] for _ in range(V)]
    for rank_ops in rows:
        for j, kind, lo, hi in rank_ops:
            per_stage[j].append((kind, lo, hi))
    parts = [partitions_from_ops(o) for o in per_stage]
    first = parts[0][0]
    for s, (f, b) in enumerate(parts):
        if f != first:
            raise UmoptError(
                f"torch-csv: stage {s} splits the minibatch as {f}, stage 0 as {first}; torch gives every stage the same microbatches"
            )
    if len(set(first)) > 1:
        raise UmoptError(
            f"torch-csv: chunks of {' and '.join(map(str, sorted(set(first))))} samples; torch splits the minibatch into equal "
            "microbatches and averages their losses (which is the minibatch's mean only when they are equal)"
        )
    ends = list(itertools.accumulate(first))
    index = {(lo, hi): i for i, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends))}
    split = [any(kind == OpKind.W for kind, _, _ in o) for o in per_stage]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank_ops in rows:
        row = []
        for j, kind, lo, hi in rank_ops:
            if kind == OpKind.W:  # every microbatch it covers, in sample order
                row += [f"{j}W{i}" for (a, z), i in index.items() if lo <= a and z <= hi]
            else:
                row.append(f"{j}{'I' if split[j] and kind == 'B' else kind}{index[(lo, hi)]}")
        writer.writerow(row)
    return out.getvalue()
