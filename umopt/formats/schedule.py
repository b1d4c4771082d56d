"""The schedule file (``umopt-schedule/1``): who runs which chunk when, and what it should cost.

A schedule holds one ordered op list per stage (``["F", lo, hi]`` and ``["B", lo, hi]``), the
profile it was made for (path and sha256), the prediction of the cost model for exactly those ops,
the solver's status and bound, and the baselines. :func:`validate_ops` is the definition of a
valid schedule (docs/formats.md, "Validity"); :func:`load_schedule` applies it, together with the
format checks, and :func:`umopt.predict.check_against_profile` refuses a schedule made for another profile.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence

from annotated_types import Len
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from ..errors import UmoptError
from ..fileio import write_json
from ..limits import MAX_MINIBATCH, MAX_STAGES
from .ops import Chunking, ChunkOp, Op, OpKind
from .profile import AllReduceProfile, Profile, load_model_file

__all__ = [
    "SCHEDULE_FORMAT",
    "Schedule",
    "ScheduleCandidate",
    "ChunksSpec",
    "LengthsSpec",
    "validate_ops",
    "load_schedule",
    "save_schedule",
    "make_schedule",
    "require_one_chunk",
    "require_pick_layout",
]

SCHEDULE_FORMAT = "umopt-schedule/1"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ProfileRef(_Strict):
    path: str
    sha256: str


class StageOps(_Strict):
    # [kind, lo, hi], or [kind, lo, hi, virtual stage] where ranks hold several chunks
    ops: list[Annotated[list[Any], Len(3, 4)]]

    @field_validator("ops")
    @classmethod
    def _op_shape(cls, ops: list[list[Any]]) -> list[list[Any]]:
        for i, op in enumerate(ops):
            kind, lo, hi = op[:3]
            if (
                kind not in tuple(OpKind)
                or type(lo) is not int
                or type(hi) is not int
                or (len(op) == 4 and type(op[3]) is not int)
            ):
                raise ValueError(
                    f'op {i} is {op!r}, expected ["F"|"B"|"W", lo, hi] (or with a virtual stage after) with integers'
                )
        return ops

    def op_list(self) -> list:
        kind = _KINDS  # a dict lookup: OpKind(...) costs a microsecond an op, a step's plan thousands
        return [
            Op(kind[op[0]], op[1], op[2]) if len(op) == 3 else ChunkOp(kind[op[0]], op[1], op[2], op[3])
            for op in self.ops
        ]


_KINDS = {k.value: k for k in OpKind}


class ChunksSpec(_Strict):
    """Several chunks per rank: virtual stage j holds the profile's layers ``layers[j]`` and runs
    on rank ``ranks[j]`` (docs/formats.md, "Several chunks per rank")."""

    layers: list[Annotated[list[int], Len(2, 2)]]
    ranks: list[int]
    placement: str = "custom"  # "looped", "vshape" or "custom": what the ranks follow

    def chunking(self) -> Chunking:
        return Chunking(tuple(tuple(x) for x in self.layers), tuple(self.ranks))


Ms = Annotated[float, Field(allow_inf_nan=False)]


class Predicted(_Strict):
    # what the cost model said when the file was written; readers re-simulate rather than trust it
    iteration_ms: Ms
    busy_ms: list[Ms]
    peak_memory_bytes: list[int]


class SolverInfo(_Strict):
    name: str
    status: str
    lower_bound_ms: Optional[Ms] = None
    seconds: Ms
    # the name the pick goes by beside its candidates (umopt, or the equal schedule it is)
    recommended: Optional[str] = None
    # what the lower bound holds for, as the solve says it (auto's scope: "any order", ...)
    bound_scope: Optional[str] = None
    bound_holds_for: Optional[str] = None  # with several chunks per rank: the cut and placement
    lower_bound_1f1b_ms: Optional[float] = None  # the bound over 1F1B-ordered schedules alone
    lower_bound_w_ms: Optional[float] = None  # with --zero-bubble, no schedule with W ops is faster
    winner: Optional[str] = None  # which of auto's solvers found the pick


class Baseline(_Strict):
    microbatches: Optional[Annotated[int, Field(ge=1, le=MAX_MINIBATCH)]]
    iteration_ms: Optional[Ms]


class ScheduleCandidate(_Strict):
    """Another schedule of the same profile and minibatch that the solve could not tell apart
    from its pick within the profile's uncertainty: ``umopt run`` measures them in turns over
    the first steps and keeps the fastest ([Note: selection while training])."""

    name: str
    equal: bool  # every chunk one size: what other tools run
    stages: Annotated[list[StageOps], Len(1, MAX_STAGES)]
    predicted_iteration_ms: Ms
    chunks: Optional[ChunksSpec] = None  # its own (None: one chunk per rank)

    def op_lists(self) -> list[list[Op]]:
        return [st.op_list() for st in self.stages]

    def chunking(self) -> Optional[Chunking]:
        return None if self.chunks is None else self.chunks.chunking()


class LengthsSpec(_Strict):
    """A plan for one minibatch of sequences of different lengths (docs/formats.md, "Sequences
    of different lengths"): the sequences' lengths as the minibatch holds them, and the samples
    the ops count, in order: ``samples[k]`` the sequences sample k holds (one each, or a row of
    ``row`` tokens packed with several; every sample padded to ``pad_to`` where given). ``mode``:
    a chunk's sequences "packed" (concatenated, attention within each) or "padded" (to the
    chunk's longest)."""

    mode: Literal["packed", "padded"]
    lengths: Annotated[list[Annotated[int, Field(ge=1)]], Len(1, MAX_MINIBATCH)]
    samples: Annotated[list[list[Annotated[int, Field(ge=0)]]], Len(1, MAX_MINIBATCH)]
    row: Optional[Annotated[int, Field(ge=1)]] = None
    pad_to: Optional[Annotated[int, Field(ge=1)]] = None


class Schedule(_Strict):
    format: Literal["umopt-schedule/1"]
    profile: ProfileRef
    minibatch: Annotated[int, Field(ge=1, le=MAX_MINIBATCH)]
    recompute: bool
    stages: Annotated[list[StageOps], Len(1, MAX_STAGES)]
    predicted: Predicted
    solver: SolverInfo
    baselines: dict[str, Baseline]
    # data-parallel replicas the prediction includes the gradient all-reduce of (None: one pipeline)
    dp: Optional[AllReduceProfile] = None
    # the pick's rivals, measured while training (absent in files written before, and by hand)
    candidates: list[ScheduleCandidate] = []
    # several chunks per rank (absent: one chunk per rank, stage s on rank s)
    chunks: Optional[ChunksSpec] = None
    # a plan for sequences of different lengths (absent: every sample costs the same)
    lengths: Optional[LengthsSpec] = None
    # the sha256 of the profile it was checked against (umopt.predict), where it was made:
    # a plan made ahead is checked in the planning process, once, not by every rank in its step
    _checked: Optional[str] = PrivateAttr(default=None)

    def op_lists(self) -> list[list[Op]]:
        return [st.op_list() for st in self.stages]

    def plays_alike(self, other: "Schedule") -> bool:
        """Whether two ranks given these would play the same step: the same samples' sequences,
        layout and ops (what they were predicted or planned in may differ)."""
        return (self.lengths, self.chunks, self.recompute, self.minibatch) == (
            other.lengths,
            other.chunks,
            other.recompute,
            other.minibatch,
        ) and [st.ops for st in self.stages] == [st.ops for st in other.stages]

    def chunking(self) -> Optional[Chunking]:
        return None if self.chunks is None else self.chunks.chunking()

    def layout(self, profile: Profile) -> Chunking:
        """Each virtual stage's layer range and rank, for one chunk per rank too (stage s: the
        profile's ``stages[s].layers``, on rank s): what a rank builds its modules from,
        whichever kind of schedule the solve wrote."""
        if self.chunks is not None:
            return self.chunks.chunking()
        if len(profile.stages) != len(self.stages):
            raise UmoptError(f"the schedule has {len(self.stages)} stages, the profile {len(profile.stages)}")
        return Chunking(
            tuple((st.layers[0], st.layers[1]) for st in profile.stages), tuple(range(len(self.stages)))
        )

    def candidate_schedule(self, k: int) -> "Schedule":
        """Candidate ``k`` as a schedule of its own (same profile, minibatch, recompute, dp)."""
        c = self.candidates[k]
        return self.model_copy(
            update={
                "stages": c.stages,
                "chunks": c.chunks,
                "predicted": Predicted(
                    iteration_ms=c.predicted_iteration_ms, busy_ms=[], peak_memory_bytes=[]
                ),
                "candidates": [],
            }
        )


def validate_ops(
    ops: Sequence[Sequence[Op | ChunkOp]],
    minibatch: int,
    max_size: int,
    recompute: bool,
    chunks: Optional[Chunking] = None,
) -> None:
    """Raise :class:`UmoptError` unless the op lists form a valid schedule (deadlock aside).

    ``ops[r]`` is rank ``r``'s list; with ``chunks``, each op names its virtual stage, which must
    be on that rank, and every virtual stage is checked as a stage of its own. Deadlock is found
    by :func:`umopt.costmodel.simulate`, which every caller runs next.
    """
    if chunks is None:
        for s, stage_ops in enumerate(ops):
            if any(len(op) == 4 and op[3] != s for op in stage_ops):
                raise UmoptError(
                    f"stage {s}: an op names another stage, but the schedule has one chunk per rank"
                )
            _validate_stage(f"stage {s}", [op[:3] for op in stage_ops], minibatch, max_size, recompute)
        return
    per_stage: list[list] = [[] for _ in chunks.ranks]
    for r, rank_ops in enumerate(ops):
        for op in rank_ops:
            if len(op) != 4:
                raise UmoptError(
                    f"rank {r}: op {list(op)!r} names no virtual stage (the schedule has several chunks per rank)"
                )
            j = op[3]
            if not 0 <= j < len(chunks.ranks) or chunks.ranks[j] != r:
                raise UmoptError(
                    f"rank {r}: {op[0]}({op[1]},{op[2]}) names virtual stage {j}, which is not on rank {r}"
                )
            per_stage[j].append(op[:3])
    for j, stage_ops in enumerate(per_stage):
        _validate_stage(f"virtual stage {j}", stage_ops, minibatch, max_size, recompute)


def _validate_stage(where: str, stage_ops: Sequence, minibatch: int, max_size: int, recompute: bool) -> None:
    B = minibatch
    expect = 0  # F ops run in sample order: samples [0, expect) have had their forward
    f_ranges: set[tuple[int, int]] = set()
    b_ranges: list[tuple[int, int]] = []  # sorted and disjoint: intervals, not a flag per sample
    w_ranges: list[tuple[int, int]] = []
    for kind, lo, hi in stage_ops:
        if not (0 <= lo < hi <= B):
            raise UmoptError(f"{where}: {kind}({lo},{hi}) is not a chunk of samples 0..{B - 1}")
        if hi - lo > max_size:
            raise UmoptError(
                f"{where}: {kind}({lo},{hi}) has {hi - lo} samples, the profile measured at most {max_size}"
            )
        if kind == OpKind.W:
            _check_w(where, lo, hi, b_ranges, w_ranges)
            continue
        if kind == OpKind.F:
            if lo != expect:
                raise UmoptError(
                    f"{where}: F({lo},{hi}) out of order, expected a chunk starting at sample {expect}"
                )
            expect = hi
            f_ranges.add((lo, hi))
        else:
            if hi > expect:
                raise UmoptError(f"{where}: B({lo},{hi}) comes before the F of its samples")
            k = bisect.bisect_left(b_ranges, (lo, hi))
            if (k > 0 and b_ranges[k - 1][1] > lo) or (k < len(b_ranges) and b_ranges[k][0] < hi):
                raise UmoptError(f"{where}: B({lo},{hi}) covers samples a B op already covered")
            if not recompute and (lo, hi) not in f_ranges:
                raise UmoptError(
                    f"{where}: B({lo},{hi}) is not one F chunk; without recompute B must reuse F chunks"
                )
            b_ranges.insert(k, (lo, hi))
    if expect != B:
        raise UmoptError(f"{where}: F ops cover samples 0..{expect - 1}, not the minibatch 0..{B - 1}")
    end = _covered(b_ranges)
    if end != B:
        raise UmoptError(f"{where}: B ops miss sample {end}")
    end = _covered(w_ranges)
    if w_ranges and end != B:
        raise UmoptError(
            f"{where}: W ops miss sample {end} (a stage with W ops needs the weight gradient of every sample)"
        )


def _covered(ranges: list[tuple[int, int]]) -> int:
    """How far sorted, disjoint sample ranges cover 0, 1, ... without a gap."""
    end = 0
    for lo, hi in ranges:
        if lo != end:
            break
        end = hi
    return end


def _check_w(
    where: str, lo: int, hi: int, b_ranges: list[tuple[int, int]], w_ranges: list[tuple[int, int]]
) -> None:
    """A W op: whole B chunks that ran before it on the stage, each taken by one W only."""
    k = bisect.bisect_left(b_ranges, (lo, -1))
    end = lo
    while k < len(b_ranges) and b_ranges[k][0] == end and end < hi:
        end = b_ranges[k][1]
        k += 1
    if end != hi:
        raise UmoptError(
            f"{where}: W({lo},{hi}) is not whole B chunks that ran before it (a weight gradient follows its samples' B)"
        )
    j = bisect.bisect_left(w_ranges, (lo, hi))
    if (j > 0 and w_ranges[j - 1][1] > lo) or (j < len(w_ranges) and w_ranges[j][0] < hi):
        raise UmoptError(f"{where}: W({lo},{hi}) covers samples a W op already covered")
    w_ranges.insert(j, (lo, hi))


def require_one_chunk(schedule: Schedule, where: str) -> None:
    """Refuse, in one line, a schedule with several chunks per rank where only one is played."""
    if schedule.chunks is not None:
        raise UmoptError(
            f"{where} puts {len(schedule.chunks.ranks) // len(schedule.stages)} chunks on each rank: "
            "give umopt.Pipeline the rank's chunk modules as a list"
        )


def require_pick_layout(schedule: Schedule, instead: str) -> None:
    """Refuse, in one line, candidates that place the layers otherwise than the pick: selection
    switches schedules on one model ([Note: selection while training] in umopt/selection.py)."""
    other = [c.name for c in schedule.candidates if c.chunking() != schedule.chunking()]
    if other:
        raise UmoptError(
            f"candidate {other[0]} places the layers otherwise than the pick: selection switches "
            f"schedules on one model, so its candidates need the pick's layout (or {instead})"
        )


def make_schedule(
    profile: Profile,
    minibatch: int,
    recompute: bool,
    ops: Sequence[Sequence[Op]],
    timeline: Any,  # the cost model's Timeline of exactly ``ops``
    solver: dict,
    baselines: dict,
    dp: Optional[AllReduceProfile] = None,
    candidates: Sequence[dict] = (),
    chunks: Optional[Chunking] = None,
    placement: str = "custom",
) -> Schedule:
    """The schedule file's content for ``ops``, with the cost model's ``timeline`` of exactly them."""
    return Schedule.model_validate(
        {
            "format": SCHEDULE_FORMAT,
            "profile": {"path": profile.path or "", "sha256": profile.sha256},
            "minibatch": minibatch,
            "recompute": recompute,
            "stages": [{"ops": [list(op) for op in stage]} for stage in ops],
            "predicted": {
                "iteration_ms": timeline.iteration_ms,
                "busy_ms": timeline.busy_ms,
                "peak_memory_bytes": timeline.peak_memory_bytes,
                "bubble_fraction": timeline.bubble_fraction,
            },
            "solver": solver,
            "baselines": baselines,
            **({"dp": dp.model_dump()} if dp is not None else {}),
            "candidates": list(candidates),
            **(
                {
                    "chunks": {
                        "layers": [list(c) for c in chunks.layers],
                        "ranks": list(chunks.ranks),
                        "placement": placement,
                    }
                }
                if chunks is not None
                else {}
            ),
        }
    )


def load_schedule(path: str) -> Schedule:
    """Read a schedule file and check its format (ops are checked against a profile separately).

    Its profile is found wherever the schedule is read from (see [Note: a schedule finds its
    profile]); where none is found the path stays as written, and loading it says so."""
    schedule = load_model_file(path, Schedule, SCHEDULE_FORMAT, "schedule")
    found = find_profile(Path(path), schedule.profile.path, schedule.profile.sha256)
    if found is not None:
        schedule.profile.path = str(found)
    return schedule


# [Note: a schedule finds its profile]
# A schedule file names its profile by a path relative to the schedule's own folder (so a folder
# of both can be moved, and read from anywhere), or by name where the profile is bundled (a
# site-packages path would break in another environment). Reading it looks, in order: beside the
# schedule, at the path as written (older files: relative to where they were written), the
# bundled profile of that name, and then any profile beside the schedule or bundled whose sha256
# is the one the schedule was made for.
def find_profile(schedule_path: Path, named: str, sha256: str) -> Optional[Path]:
    from .profile import bundled_profiles

    if named:
        candidates = [schedule_path.parent / named, Path(named)]
        stem = named[:-5] if named.endswith(".json") else named
        if "/" not in stem and stem in bundled_profiles():
            candidates.append(Path(str(resources.files("umopt.profiles") / f"{stem}.json")))
        for c in candidates:
            if c.is_file():
                return c
    nearby = sorted(schedule_path.parent.glob("*.json"))[:200] + [
        Path(str(resources.files("umopt.profiles") / f"{n}.json")) for n in bundled_profiles()
    ]
    for c in nearby:
        try:
            if (
                c.resolve() != schedule_path.resolve()
                and hashlib.sha256(c.read_bytes()).hexdigest() == sha256
            ):
                return c
        except OSError:
            continue
    return None


def stored_profile_path(profile_path: str, schedule_path: Path) -> str:
    """How a schedule written at ``schedule_path`` names its profile (see [Note: a schedule finds its profile])."""
    if not profile_path:
        return profile_path
    p = Path(profile_path).resolve()
    bundled = Path(str(resources.files("umopt.profiles"))).resolve()
    if p.parent == bundled:
        return p.stem
    return os.path.relpath(p, schedule_path.resolve().parent)


def save_schedule(schedule: Schedule, path: str) -> None:
    data = schedule.model_dump(mode="json")
    data["profile"]["path"] = stored_profile_path(schedule.profile.path, Path(path))
    write_json(path, data)
