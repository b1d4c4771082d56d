"""The replicas file (``umopt-replicas/1``): a global minibatch of sequences split among
data-parallel replicas, and each replica's plan (``umopt solve --lengths --dp D -o``).

Each replica's entry holds the sequences it trains on (indices into the global minibatch's
lengths, ascending) and its plan as a schedule file of its own (docs/formats.md), so that any tool
that reads a plan reads each; the predicted step is the slowest replica's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Len
from pydantic import BaseModel, ConfigDict, Field

from ..errors import UmoptError
from ..fileio import write_json
from .profile import load_model_file
from .schedule import ProfileRef, Schedule, find_profile, stored_profile_path

__all__ = ["REPLICAS_FORMAT", "ReplicaPlan", "ReplicasFile", "load_replicas", "save_replicas"]

REPLICAS_FORMAT = "umopt-replicas/1"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ReplicaPlan(_Strict):
    sequences: Annotated[list[Annotated[int, Field(ge=0)]], Len(1)]  # into the global lengths
    plan: Schedule


class ReplicasPredicted(_Strict):
    step_ms: float  # the slowest replica's plan
    replica_ms: list[float]
    lower_bound_ms: float  # no assignment's step is shorter (umopt.search.replicas.lower_bound_ms)


class ReplicasFile(_Strict):
    format: Literal["umopt-replicas/1"]
    profile: ProfileRef
    lengths: Annotated[list[Annotated[int, Field(ge=1)]], Len(1)]  # the global minibatch
    method: str  # who assigned the sequences (umopt.search.replicas.ASSIGNERS)
    replicas: Annotated[list[ReplicaPlan], Len(1)]
    predicted: ReplicasPredicted
    baselines: dict[str, float] = {}  # each other assignment's step, each replica planned by umopt

    def check(self) -> None:
        """Every sequence in exactly one replica, each replica's plan of exactly its sequences."""
        held = sorted(i for r in self.replicas for i in r.sequences)
        if held != list(range(len(self.lengths))):
            raise UmoptError("the replicas do not hold every sequence of the global minibatch exactly once")
        for k, r in enumerate(self.replicas):
            if r.plan.lengths is None or r.plan.lengths.lengths != [self.lengths[i] for i in r.sequences]:
                raise UmoptError(f"replica {k}'s plan is not of its sequences")


def save_replicas(data: ReplicasFile, path: str) -> None:
    out = data.model_dump(mode="json")
    out["profile"]["path"] = stored_profile_path(data.profile.path, Path(path))
    for r in out["replicas"]:
        r["plan"]["profile"]["path"] = out["profile"]["path"]
    write_json(path, out)


def load_replicas(path: str) -> ReplicasFile:
    data = load_model_file(path, ReplicasFile, REPLICAS_FORMAT, "replicas")
    found = find_profile(Path(path), data.profile.path, data.profile.sha256)
    if found is not None:
        data.profile.path = str(found)
        for r in data.replicas:
            r.plan.profile.path = str(found)
    data.check()
    return data
