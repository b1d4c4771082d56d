"""Schedules in other runtimes' formats: ``umopt export SCHEDULE --format torch-csv -o plan.csv``.

torch.distributed.pipelining runs a schedule given as a CSV of actions, one row per rank, each
cell ``{stage}F{microbatch}`` or ``{stage}B{microbatch}`` in the order the rank runs them
(``_PipelineScheduleRuntime._load_csv``, which adds the sends and receives itself). torch splits
the minibatch into equal microbatches, the same for every stage, and averages their losses, so
only schedules with one partition of equal chunks on every stage can be written; their op order,
per-stage warm-ups included, is kept (torch's built-in 1F1B has one warm-up rule for all). Any
other schedule is refused with the reason.
"""

from __future__ import annotations

import csv
import io
import itertools

from .errors import UmoptError
from .formats.schedule import Schedule
from .partition import partitions_from_ops

__all__ = ["FORMATS", "torch_csv"]

FORMATS = ("torch-csv",)


def torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's compute-only pipeline CSV (one row per stage/rank)."""
    if schedule.recompute:
        raise UmoptError("torch-csv: torch's schedules cannot recompute inside a backward as this schedule does")
    ops = schedule.op_lists()
    if any(op.kind == "W" for st in ops for op in st):
        raise UmoptError("torch-csv: W ops (weight gradients split off the backward) are not exported; solve without --zero-bubble")
    parts = [partitions_from_ops(o) for o in ops]
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
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for s, stage_ops in enumerate(ops):
        writer.writerow([f"{s}{kind}{index[(lo, hi)]}" for kind, lo, hi in stage_ops])
    return out.getvalue()
