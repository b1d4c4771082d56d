"""The run report (``umopt run --report``): what a run measured, beside what the profile predicted.

The runtime writes it; ``umopt run`` and ``umopt tune`` print it, ``umopt calibrate`` fits a
profile to it, :func:`umopt.measure.noise.run_warnings` reads what went wrong from it. Reports written by
older versions lack some fields: they load with those empty, and what needs them says so
(calibrate needs ``ops``). docs/formats.md lists the fields.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from ..errors import UmoptError
from ..fileio import read_json, write_json
from ..limits import MAX_MINIBATCH, MAX_MS
from .profile import AllReduceProfile, pydantic_error_line
from .schedule import Schedule

__all__ = [
    "LengthsRun",
    "Decision",
    "MeasuredPredicted",
    "PeakMemory",
    "OpTiming",
    "RunReport",
    "as_report",
    "load_report",
    "save_report",
]

_Ms = Annotated[StrictFloat | StrictInt, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]

# one op of a stage: [kind, lo, hi, measured median ms, the profile's ms]
OpTiming = tuple[Literal["F", "B", "W"], StrictInt, StrictInt, _Ms, _Ms]


class MeasuredPredicted(BaseModel):
    """Per stage: what the run measured and what the profile predicted."""

    measured: list[_Ms]
    predicted: list[_Ms]


class PeakMemory(BaseModel):
    """Per rank: the most memory the run allocated (CUDA's ``max_memory_allocated`` over every
    step; none on CPUs) and the most the cost model predicts for the schedules it played."""

    measured: list[StrictInt]
    predicted: list[StrictInt]


class Decision(BaseModel):
    """``umopt run --decide``: which schedule the paired test over rounds keeps (umopt.measure.decide)."""

    winner: str
    reference: str
    confidence: float
    decided: bool
    confidence_asked: float
    reason: str


class SelectionEntry(BaseModel):
    name: str
    equal: bool
    predicted_ms: float
    measured_ms: Optional[float]  # its median step while the schedules took turns
    steps: int


class Selection(BaseModel):
    """A schedule file's pick and candidates measured in turns over the first steps of the run;
    the winner played the rest ([Note: selection while training] in umopt/selection.py)."""

    pick: str  # the solve's recommendation
    winner: str
    reference: str  # the equal schedule the others were tested against
    confidence: float
    decided: bool
    steps: int  # spent measuring (they trained too)
    cost_ms: float  # what those steps took beyond the winner's pace
    cost_spread_ms: float = 0.0  # what noise alone would give that sum (about 95%): a cost within it is noise
    reason: str
    note: Optional[str] = None  # where the winner is not the pick: what that says of the profile
    candidates: list[SelectionEntry]


class LengthsRun(BaseModel):
    """A run of sequences of different lengths: each step its own minibatch and plan, so the
    iteration figures are means over the measured steps (not medians), and the prediction is each
    step's plan's."""

    method: str  # who planned the steps: umopt, or a peer (umopt.search.peers)
    data: str  # where the sequences came from
    tokens: list[int]  # each measured step's real tokens (no padding), all replicas together
    predicted_step_ms: list[float]  # each measured step's plan's prediction (the slowest replica's)
    tokens_per_s: float  # measured: the tokens over the measured steps' time
    predicted_tokens_per_s: float
    predicted_peak_memory_bytes: list[int] = []  # per rank, the most any of replica 0's plans needs
    # replica 0's ops of every measured step: (mode, virtual stage, kind, predicted ms by the step's
    # plan, measured ms): what `umopt calibrate` fits the costs by tokens to
    op_pairs: list[tuple[str, StrictInt, Literal["F", "B", "W"], _Ms, _Ms]] = []
    # the last measured steps' plans (replica 0's, at most 64; op_pairs are theirs), the last of
    # the report's step_ms: what `umopt calibrate` predicts again on the fitted costs, to fit what
    # a step costs beyond its ops
    plans: list[Schedule] = []
    cut: Optional[str] = None  # what the profile's longest length cut from --lengths, said once
    assign: Optional[str] = None  # with several replicas: who gave each its share of the global minibatch


class RunReport(BaseModel):
    model_config = ConfigDict(extra="allow")

    # what ran
    schedule: str = ""
    profile: Optional[str] = None
    backend: str = ""
    stages: Optional[StrictInt] = None
    dp: StrictInt = 1
    allreduce: Optional[AllReduceProfile] = None  # what the prediction took the replicas' all-reduce to cost
    minibatch: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_MINIBATCH)]] = None
    recompute: StrictBool = False
    steps: StrictInt = 0  # measured, over all rounds
    warmup: StrictInt = 0
    selection_steps: StrictInt = 0  # of selection's turns, before the measured steps
    trained_steps: StrictInt = 0  # every step: warm-up, selection and measured (what `losses` covers)
    rounds: StrictInt = 1  # played (with --decide, until decided or out of budget)
    schedules_in_turn: StrictInt = 1
    # what it measured
    measured_iteration_ms: Optional[
        Annotated[StrictFloat | StrictInt, Field(gt=0, le=MAX_MS, allow_inf_nan=False)]
    ] = None
    predicted_iteration_ms: Optional[float] = None  # the simulator's, for this run's profile
    measured_over_predicted: Optional[float] = None
    step_ms: list[float] = []
    round_ms: list[float] = []  # the median step of each round
    busy_ms: Optional[MeasuredPredicted] = None
    allreduce_ms: Optional[MeasuredPredicted] = None  # with data-parallel replicas
    peak_memory_bytes: Optional[PeakMemory] = None
    ops: Optional[list[list[OpTiming]]] = None  # per stage, every op: what `umopt calibrate` fits
    losses: list[float] = []
    reference_ms: list[float] = []  # a fixed matmul's median time on each stage's device
    numerics_differ: list[str] = []  # TF32 / cuDNN settings other than the profile's
    decision: Optional[Decision] = None
    selection: Optional[Selection] = None
    chunks: Optional[dict[str, Any]] = None  # several chunks per rank: the schedule's chunks block
    lengths: Optional[LengthsRun] = None  # sequences of different lengths, each step planned

    def chunks_per_rank(self) -> int:
        """Model chunks each rank held in the run (1 without a chunks block)."""
        return len(self.chunks["ranks"]) // max(1, self.stages or 1) if self.chunks else 1


def as_report(raw: Any, name: str) -> RunReport:
    """A report read from JSON (or already typed), checked; ``name`` heads its one-line errors."""
    if isinstance(raw, RunReport):
        return raw
    if not isinstance(raw, dict) or "measured_iteration_ms" not in raw:
        raise UmoptError(f"{name}: not a report of umopt run")
    try:
        return RunReport.model_validate(raw)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        ops = raw.get("ops")
        if len(loc) >= 3 and loc[0] == "ops" and isinstance(ops, list) and isinstance(ops[loc[1]], list):
            raise UmoptError(
                f"{name}: stage {loc[1]} has a malformed op entry {str(ops[loc[1]][loc[2]])[:80]}"
            ) from None
        raise UmoptError(f"{name}: {pydantic_error_line(exc)}") from None


def load_report(path: str | os.PathLike) -> RunReport:
    """A report file, checked; one-line errors."""
    return as_report(read_json(path), str(path))


def save_report(report: RunReport, path: str | os.PathLike) -> None:
    write_json(path, report.model_dump(mode="json", exclude_none=False))
