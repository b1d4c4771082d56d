"""The ops a schedule file holds and the layout it names: what the files, the cost model and the
runtime all speak of (docs/formats.md, "Schedule"). Plain tuples: they read and write as the
lists in a schedule file."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Sequence

__all__ = ["OpKind", "Op", "ChunkOp", "op_stage", "Chunking"]


class OpKind(str, Enum):
    """What an op computes: the forward (F), the backward (B; on a stage with W ops only the input
    gradient) or the weight gradient (W). A ``str``, so it compares equal to, and is written to
    schedule files as, its letter."""

    F = "F"
    B = "B"
    W = "W"

    # the letter on every Python version (3.11 changed how format() shows mixed-in enums)
    __str__ = str.__str__
    __format__ = str.__format__


class Op(NamedTuple):
    """One op of a stage: its kind on samples ``[lo, hi)``.

    A tuple, so it reads and writes as ``["F", lo, hi]`` in schedule files and unpacks as
    ``kind, lo, hi``."""

    kind: OpKind
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


class ChunkOp(NamedTuple):
    """An op of a rank that holds several model chunks: as :class:`Op`, on virtual stage
    ``stage`` (``["F", lo, hi, stage]`` in schedule files). On a one-chunk pipeline a rank's
    plain :class:`Op` runs on the virtual stage of the rank's own index."""

    kind: OpKind
    lo: int
    hi: int
    stage: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def op_stage(op: Sequence, rank: int) -> int:
    """The virtual stage an op of ``rank`` runs on."""
    return op[3] if len(op) == 4 else rank


class Chunking(NamedTuple):
    """How a multi-chunk pipeline cuts the model: virtual stage ``j`` holds the profile's layers
    ``layers[j]`` (contiguous, in model order) and runs on rank ``ranks[j]`` (docs/formats.md,
    "Several chunks per rank")."""

    layers: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...]

    @property
    def num_virtual(self) -> int:
        return len(self.ranks)
