"""A schedule file's prediction: the cost tables it is predicted on (by sample count, or by the
sequences each sample holds), and its ops validated and simulated against a profile.

The schedule file (:mod:`umopt.formats.schedule`) is data; the cost model
(:mod:`umopt.costmodel`) reads profiles; this module, above both, is where a file meets the model:
every reader that trusts a schedule (``umopt show``, ``umopt run``, ``umopt.Pipeline``, a plan
made ahead) calls :func:`check_against_profile` or :func:`checked` first.
"""

from __future__ import annotations

from typing import Optional

from .costmodel import CostTables, Timeline, simulate, tables_for_samples
from .errors import UmoptError
from .formats.ops import Chunking
from .formats.profile import AllReduceProfile, Profile
from .formats.schedule import LengthsSpec, Schedule, ScheduleCandidate, validate_ops

__all__ = ["lengths_tables", "schedule_tables", "check_against_profile", "checked"]


def lengths_tables(
    spec: LengthsSpec,
    profile: Profile,
    recompute: bool,
    dp: Optional[AllReduceProfile],
    chunks: Optional[Chunking] = None,
) -> CostTables:
    """The cost tables of a plan's samples (see costmodel's [Note: costs by sample range]), per
    virtual stage with ``chunks``."""
    held = sorted(i for u in spec.samples for i in u)
    if spec.row is None and held != list(range(len(spec.lengths))):
        raise UmoptError("lengths.samples must hold every sequence once")
    if spec.row is not None and set(held) != set(range(len(spec.lengths))):
        raise UmoptError("lengths.samples must hold every sequence (a long one may span rows)")
    return tables_for_samples(
        profile, spec.lengths, spec.samples, spec.mode, spec.row, spec.pad_to, recompute, dp, chunks
    )


def schedule_tables(schedule: Schedule, profile: Profile) -> CostTables:
    """The cost tables ``schedule``'s prediction is made on: by sample count, or by the sequences
    each sample holds."""
    if schedule.lengths is not None:
        if len(schedule.lengths.samples) != schedule.minibatch:
            raise UmoptError(
                f"lengths.samples has {len(schedule.lengths.samples)} samples but the minibatch is {schedule.minibatch}"
            )
        return lengths_tables(schedule.lengths, profile, schedule.recompute, schedule.dp, schedule.chunking())
    return CostTables.from_profile(
        profile, schedule.recompute, schedule.dp, schedule.chunking(), schedule.minibatch
    )


def check_against_profile(schedule: Schedule, profile: Profile, *, strict_hash: bool = True) -> Timeline:
    """Validate ``schedule`` for ``profile`` and return its simulated timeline.

    A schedule made for another profile (stage count, sha256), with invalid ops, deadlocking, or
    over the profile's memory limit is refused with a one-line :class:`UmoptError`.
    """
    if len(schedule.stages) != profile.num_stages:
        raise UmoptError(
            f"schedule has {len(schedule.stages)} stages but profile {profile.path} has {profile.num_stages}"
        )
    chunks = schedule.chunking()
    if strict_hash and schedule.profile.sha256 != profile.sha256:
        raise UmoptError(
            f"schedule was made for another profile (sha256 {schedule.profile.sha256[:12]}..., this one {profile.sha256[:12]}...)"
        )
    ops = schedule.op_lists()
    tables = schedule_tables(schedule, profile)
    # by sequences, a chunk's costs are those of the sequences it holds, whatever its size
    largest = profile.max_size if schedule.lengths is None else schedule.minibatch
    validate_ops(ops, schedule.minibatch, largest, schedule.recompute, chunks)
    timeline = simulate(tables, ops, schedule.minibatch)
    limit = profile.memory_limit_bytes
    for name, tl in [("", timeline)] + [
        (f"candidate {c.name}: ", _candidate_timeline(c, schedule, profile, tables))
        for c in schedule.candidates
    ]:
        if limit is not None:
            for s, peak in enumerate(tl.peak_memory_bytes):
                if peak > limit:
                    raise UmoptError(
                        f"{name}{'rank' if chunks else 'stage'} {s} needs {peak} bytes at its peak, over the memory limit of {limit}"
                    )
    schedule._checked = profile.sha256
    return timeline


def checked(schedule: Schedule, profile: Profile) -> None:
    """``schedule`` checked against ``profile`` (:func:`check_against_profile`), unless it was
    already, where it was made (its mark travels with it, pickled to another process)."""
    if schedule._checked != profile.sha256:
        check_against_profile(schedule, profile)


def _candidate_timeline(
    c: ScheduleCandidate, schedule: Schedule, profile: Profile, tables: CostTables
) -> Timeline:
    if len(c.stages) != len(schedule.stages):
        raise UmoptError(
            f"candidate {c.name} has {len(c.stages)} stages, the schedule {len(schedule.stages)}"
        )
    ops = c.op_lists()
    try:
        if c.chunking() != schedule.chunking():
            tables = CostTables.from_profile(
                profile, schedule.recompute, schedule.dp, c.chunking(), schedule.minibatch
            )
        validate_ops(ops, schedule.minibatch, profile.max_size, schedule.recompute, c.chunking())
        return simulate(tables, ops, schedule.minibatch)
    except UmoptError as exc:
        raise UmoptError(f"candidate {c.name}: {exc}") from None
