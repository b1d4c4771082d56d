"""One step's messages between this rank and its neighbours, in the order both ends agree on.

A message crosses boundary ``j`` (virtual stage j to j + 1): activations ("act") after an F op
of j, gradients ("grad") after a B op of j + 1. Where both virtual stages are on one rank it is a
copy into the receiver's buffer; otherwise it goes over the group of its direction (see [Note:
one process group per link and direction] in comm.py). Each direction carries its messages in
the order its sender produces them, which both ends know from the schedule (:func:`messages`):
the sender sends each as soon as it is computed, the receiver posts every receive of the step at
its start, and an op waits only for the messages it reads. That is the cost model's link
(docs/formats.md: each direction of a link one message at a time, in send order), and, with
every direction connected at set-up, nothing can wait in a ring (see [Note: lazy connections]).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..costmodel import ChunkOp, OpKind
from .comm import Comm, Direction
from .stage import Stage

__all__ = ["Message", "messages", "directions", "StepLinks"]

Message = tuple[str, int, int, int]  # ("act" | "grad", boundary j, lo, hi)
TAG_STRIDE = 64  # a message's tensors are tagged (its place in its direction) x TAG_STRIDE + i


def messages(ops: Sequence[Sequence[ChunkOp]], ranks_of: Sequence[int]) -> dict[Direction, list[Message]]:
    """Each direction's messages (pipeline ranks), in the order its sender's ops produce them."""
    V = len(ranks_of)
    out: dict[Direction, list[Message]] = {}
    for r, rank_ops in enumerate(ops):
        for kind, lo, hi, j in rank_ops:
            if kind == OpKind.F and j + 1 < V and ranks_of[j + 1] != r:
                out.setdefault((r, ranks_of[j + 1]), []).append(("act", j, lo, hi))
            elif kind == OpKind.B and j > 0 and ranks_of[j - 1] != r:
                out.setdefault((r, ranks_of[j - 1]), []).append(("grad", j - 1, lo, hi))
    return out


def directions(ranks_of: Sequence[int]) -> set[Direction]:
    """Every direction a layout's messages can take (pipeline ranks): both ways across each
    boundary between two ranks."""
    out = set()
    for a, b in zip(ranks_of, ranks_of[1:]):
        if a != b:
            out |= {(a, b), (b, a)}
    return out


# [Note: a send let go]
# A message's tensors must live until its send is through, so the step keeps them beside the
# send's request; kept until the step's end, every chunk's output stayed after its backward (the
# memory of all the step's outputs at once on a middle stage, where the model counts those of the
# chunks in flight). So after each op the sends that are through are let go: under NCCL those
# whose request says it is complete (asking costs nothing; waiting would make the compute stream
# wait for the send); gloo's requests say so only when waited on, so there the sends issued
# before the op that just ran are waited on, which returns at once in practice (every receive of
# the step was posted at its start, so a send needs nothing more of its receiver).


class StepLinks:
    """The messages of one step (or of one forwards-only pass) of one rank.

    ``order`` is every direction's messages (pipeline ranks, :func:`messages`), ``ranks`` the
    pipeline's global ranks, ``stages`` this rank's virtual stages by index.
    """

    def __init__(
        self,
        comm: Comm,
        me: int,
        ranks: Sequence[int],
        ranks_of: Sequence[int],
        order: dict[Direction, list[Message]],
        stages: dict[int, Stage],
    ):
        self.comm, self.me, self.ranks, self.ranks_of, self.stages = comm, me, ranks, ranks_of, stages
        self.incoming = {d: seq for d, seq in order.items() if d[1] == me}
        self.outgoing = {d: seq for d, seq in order.items() if d[0] == me}
        self.pos = dict.fromkeys(self.outgoing, 0)  # the next message to send, per direction
        self.ready: dict[Message, list[torch.Tensor]] = {}  # computed, not yet its turn
        self.recv: dict[tuple[str, int], dict[tuple[int, int], list[Any]]] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self._issued = 0  # of the sends, those issued before the last op (gloo: waited on at the next reap)

    def _receiver(self, kind: str, j: int) -> tuple[int, Stage | None]:
        """Who receives a message across boundary j, and its stage where it is this rank."""
        v = j + 1 if kind == "act" else j
        return self.ranks_of[v], self.stages.get(v)

    def start(self) -> None:
        """Post every receive of the step, in each direction's order."""
        for (src, dst), seq in self.incoming.items():
            group = self.comm.group((self.ranks[src], self.ranks[dst]))
            for pos, (kind, j, lo, hi) in enumerate(seq):
                _, stage = self._receiver(kind, j)
                assert stage is not None
                works = [
                    self.comm.irecv(buf, self.ranks[src], group, pos * TAG_STRIDE + i)
                    for i, buf in enumerate(stage.recv_buffers(kind, lo, hi))
                ]
                self.recv.setdefault((kind, j), {})[(lo, hi)] = works

    def send(self, kind: str, j: int, lo: int, hi: int, ts: list[torch.Tensor]) -> None:
        """Hand chunk [lo, hi)'s activations ("act", from virtual stage j) or input gradients
        ("grad", from j + 1) across boundary j."""
        to, stage = self._receiver(kind, j)
        if stage is not None:  # a hand-off between two chunks of this rank
            # written through .data, as a receive writes: no version bump, so the earlier chunks'
            # inputs (views of the same buffer, kept for their backward) stay usable by autograd
            for buf, t in zip(stage.recv_buffers(kind, lo, hi), ts):
                buf.data.copy_(t)
            return
        self.ready[(kind, j, lo, hi)] = [t.contiguous() for t in ts]
        self._issue((self.me, to))

    def _issue(self, d: Direction) -> None:
        seq = self.outgoing[d]
        group = self.comm.group((self.ranks[d[0]], self.ranks[d[1]]))
        while self.pos[d] < len(seq):
            data = self.ready.pop(seq[self.pos[d]], None)
            if data is None:
                return  # not computed yet: later messages of this direction wait their turn
            base = self.pos[d] * TAG_STRIDE
            for i, t in enumerate(data):
                self.sends.append((self.comm.isend(t, self.ranks[d[1]], group, base + i), t))
            self.pos[d] += 1

    def wait(self, kind: str, j: int, lo: int, hi: int) -> None:
        """Wait for the messages virtual stage ``j`` reads for samples [lo, hi): F its
        activations from j - 1, B its output gradients from j + 1."""
        works = self.recv.get(("act", j - 1) if kind == OpKind.F else ("grad", j), {})
        for mlo, mhi in list(works):
            if mlo < hi and lo < mhi:
                for w in works.pop((mlo, mhi)):
                    w.wait()

    def reap(self) -> None:
        """Let go of the sends that are through (see [Note: a send let go]): those the transport
        says are complete, and under a transport whose sends cannot be asked (gloo) those issued
        before the op that just ran, waited on (their receives were posted at the step's start)."""
        if not self.sends:
            return
        if self.comm.polls_sends:
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
            return
        older, self.sends = self.sends[: self._issued], self.sends[self._issued :]
        for work, _ in older:
            work.wait()
        self._issued = len(self.sends)

    def finish(self) -> None:
        """Wait for everything in flight; every message of the step was sent."""
        for works in self.recv.values():
            for ws in works.values():
                for w in ws:
                    w.wait()
        for work, _ in self.sends:
            work.wait()
        unsent = [(d, seq[self.pos[d]]) for d, seq in self.outgoing.items() if self.pos[d] < len(seq)]
        assert not unsent, f"messages never sent: {unsent[:3]}"

    def drop(self) -> None:
        """Forget every request of this step: a failed step's requests must not keep its links open."""
        self.recv.clear()
        self.ready.clear()
        self.sends.clear()
