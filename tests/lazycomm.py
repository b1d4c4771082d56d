"""A model of NCCL's semantics that the runtime can run on: every rank a thread of one process,
the transport a :class:`umopt.run.comm.Comm` whose primitives behave as NCCL's do where it matters
for deadlock, and a detector that says where every rank waits once none can go on.

What it models:
- **lazy connection**: the first operation of a direction (sender, receiver) on a group blocks its
  host until the peer posts its first operation of that direction (NCCL's ncclTransportP2pSetup;
  gloo connects at group creation, so the CPU tests cannot show it);
- **in-order matching**: the k-th send of a direction on a group meets its k-th receive (NCCL
  ignores tags; the model checks that both ends gave the same tag and shape, so an order the two
  ends disagree on is an error here, not silent garbage);
- **rendezvous**: a send completes once its receive is posted, a receive once its send is;
- **collectives**: every member of the group meets at its n-th collective, which must be the same
  operation on all of them; making groups is collective over the world.

A rank that waits while every other live rank waits too is a deadlock: every waiting rank then
raises :class:`Deadlock`, which says what each one waited for.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from umopt.run.comm import Comm, Direction


class Deadlock(RuntimeError):
    pass


class Broken(RuntimeError):
    pass


@dataclass(eq=False)
class Group:
    gid: int
    members: tuple[int, ...]
    broken: bool = False


@dataclass
class Channel:
    arrived: set = field(default_factory=set)  # "send", "recv": the ends that posted their first op
    sends: list = field(default_factory=list)  # (tag, tensor)
    recvs: list = field(default_factory=list)  # (tag, buffer)


class World:
    def __init__(self, n: int, lazy: bool = True):
        self.n, self.lazy = n, lazy
        self.cond = threading.Condition()
        self.store: dict[str, bytes] = {}
        self.alive = n
        self.blocked = 0
        self.waiting: dict[int, tuple[str, Callable[[], bool]]] = {}
        self.deadlock = ""
        self.channels: dict[tuple[int, int, int], Channel] = {}
        self.meetings: dict[tuple, dict[int, Any]] = {}
        self.groups: dict[tuple, Group] = {}
        self.next_gid = 0
        self.connections: set[tuple[int, int, int]] = set()  # (group, sender, receiver) connected

    def wait(self, rank: int, what: str, ready: Callable[[], bool]) -> None:
        """Block ``rank`` (holding ``cond``) until ``ready()``; a deadlock raises on every waiter."""
        if ready():
            return
        self.blocked += 1
        self.waiting[rank] = (what, ready)
        try:
            while not ready():
                if self.deadlock:
                    raise Deadlock(self.deadlock)
                # every live rank waits, and none of them has been let go (a notified rank that has
                # not run yet still counts as waiting): nothing can happen any more
                if self.blocked >= self.alive and not any(go() for _, go in self.waiting.values()):
                    self.deadlock = "; ".join(
                        f"rank {r} waits for {w}" for r, (w, _) in sorted(self.waiting.items())
                    )
                    self.cond.notify_all()
                    raise Deadlock(self.deadlock)
                self.cond.wait(0.5)
        finally:
            self.blocked -= 1
            self.waiting.pop(rank, None)

    def group(self, key: tuple, members: Sequence[int]) -> Group:
        if key not in self.groups:
            self.groups[key] = Group(self.next_gid, tuple(sorted(members)))
            self.next_gid += 1
        return self.groups[key]

    def run(self, fn: Callable[["LazyComm"], Any], timeout_s: float = 300.0) -> list[Any]:
        """``fn(comm)`` on every rank, each in a thread; their results by rank, or the first
        rank's error (a deadlock first)."""
        results: list[Any] = [None] * self.n
        errors: list[Optional[BaseException]] = [None] * self.n

        def body(r: int) -> None:
            try:
                results[r] = fn(LazyComm(self, r))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors[r] = exc
            finally:
                with self.cond:
                    self.alive -= 1
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in threads), "a rank neither finished nor waited"
        deadlocks = [e for e in errors if isinstance(e, Deadlock)]
        if deadlocks:
            raise deadlocks[0]
        for e in errors:
            if e is not None:
                raise e
        return results


class _Work:
    def __init__(self, comm: "LazyComm", ready: Callable[[], bool], what: str, done: Callable[[], None]):
        self.comm, self.ready, self.what, self.done = comm, ready, what, done
        self.finished = False

    def is_completed(self) -> bool:
        with self.comm.w.cond:
            return self.ready()

    def wait(self, timeout=None) -> bool:
        w = self.comm.w
        with w.cond:
            w.wait(self.comm.rank, self.what, self.ready)
            if not self.finished:
                self.done()
                self.finished = True
        return True


class LazyComm(Comm):
    """One rank's transport in a :class:`World`."""

    def __init__(self, world: World, rank: int):
        super().__init__(rank, world.n, "nccl-model", prefix="umopt/0/")
        self.w = world
        self.seq: dict[Any, int] = {}  # this rank's count of collectives per group (and of group making)

    # --- the store
    def _set(self, key: str, value: bytes) -> None:
        with self.w.cond:
            self.w.store[key] = value
            self.w.cond.notify_all()

    def _check(self, key: str) -> bool:
        with self.w.cond:
            return key in self.w.store

    def _get(self, key: str) -> bytes:
        with self.w.cond:
            return self.w.store[key]

    def _delete(self, key: str) -> None:
        with self.w.cond:
            self.w.store.pop(key, None)

    def _first(self, key: str, value: str) -> None:
        with self.w.cond:
            self.w.store.setdefault(key, value.encode())
            self.w.cond.notify_all()

    def timeout_s(self) -> float:
        return 60.0

    # --- collectives (groups too)
    def _meet(self, group: Optional[Group], op: str, payload: Any) -> dict[int, Any]:
        """This rank's next collective on ``group``: every member's payload, once all have come."""
        members = tuple(range(self.w.n)) if group is None else group.members
        gid = -1 if group is None else group.gid
        n = self.seq.get(gid, 0)
        self.seq[gid] = n + 1
        key = (gid, n)
        w = self.w
        with w.cond:
            if group is not None and group.broken:
                raise Broken(f"group {members} was aborted")
            got = w.meetings.setdefault(key, {})
            got[self.rank] = (op, payload)
            w.cond.notify_all()
            w.wait(self.rank, f"{op} #{n} on {members}", lambda: len(got) == len(members))
            ops = {o for o, _ in got.values()}
            if len(ops) > 1:
                raise RuntimeError(f"collective #{n} on {members}: the ranks called {sorted(ops)}")
            return {r: p for r, (_, p) in got.items()}

    def _make_groups(self, members: list[list[Direction]]) -> dict[Direction, Any]:
        self._meet(None, "make link groups", pickle.dumps(members))
        made = {}
        with self.w.cond:
            for pairs in members:
                for p in pairs:
                    g = self.w.group(("link", p), p)
                    if self.rank in p:
                        made[p] = g
        return made

    def new_group(self, ranks: Sequence[int]) -> Any:
        self._meet(None, "new group", tuple(sorted(ranks)))
        with self.w.cond:
            return self.w.group(("group", tuple(sorted(ranks)), self.seq[-1]), ranks)

    def split(self, members: list[list[int]]) -> Any:
        self._meet(None, "split", pickle.dumps(members))
        mine = None
        with self.w.cond:
            for m in members:
                g = self.w.group(("split", tuple(sorted(m)), self.seq[-1]), m)
                if self.rank in m:
                    mine = g
        return mine

    def _drop(self, groups: list[Any]) -> None:
        with self.w.cond:
            for g in groups:
                g.broken = True
            self.w.cond.notify_all()

    def group_ranks(self, group: Any) -> list[int]:
        if group is None:
            return list(range(self.w.n))
        if isinstance(group, (list, tuple)):
            return [int(r) for r in group]
        return list(group.members)

    def all_reduce(self, t: torch.Tensor, group: Any, op: str = "sum", async_op: bool = False) -> Any:
        got = self._meet(group, f"all_reduce {op}", t.detach().clone())
        parts = [got[r] for r in sorted(got)]
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p if op == "sum" else torch.maximum(out, p)
        t.copy_(out)
        if async_op:
            return _Work(self, lambda: True, "", lambda: None)
        return None

    def broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        got = self._meet(group, f"broadcast from {src}", t.detach().clone())
        t.copy_(got[src])

    def barrier(self, group: Any, device: torch.device) -> None:
        self._meet(group, "barrier", None)

    # --- messages
    def _channel(self, group: Group, src: int, dst: int, side: str) -> Channel:
        """The channel of a direction, connected first where the model is lazy."""
        w = self.w
        assert src in group.members and dst in group.members, (src, dst, group.members)
        key = (group.gid, src, dst)
        if group.broken:
            raise Broken(f"group {group.members} was aborted")
        ch = w.channels.setdefault(key, Channel())
        if w.lazy and key not in w.connections:
            ch.arrived.add(side)
            w.cond.notify_all()
            w.wait(
                self.rank,
                f"rank {dst if side == 'send' else src} to post its first op of {src} -> {dst} (connecting)",
                lambda: len(ch.arrived) == 2 or group.broken,
            )
            w.connections.add(key)
        return ch

    def isend(self, t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
        w = self.w
        with w.cond:
            ch = self._channel(group, self.rank, dst, "send")
            k = len(ch.sends)
            ch.sends.append((tag, t.detach().clone()))
            w.cond.notify_all()
        return _Work(
            self,
            lambda: len(ch.recvs) > k or group.broken,
            f"rank {dst} to receive message #{k} of {self.rank} -> {dst}",
            lambda: self._check_broken(group),
        )

    def irecv(self, t: torch.Tensor, src: int, group: Any, tag: int) -> Any:
        w = self.w
        with w.cond:
            ch = self._channel(group, src, self.rank, "recv")
            k = len(ch.recvs)
            ch.recvs.append((tag, t))
            w.cond.notify_all()

        def done() -> None:
            self._check_broken(group)
            sent_tag, data = ch.sends[k]
            if sent_tag != tag or data.shape != t.shape or data.dtype != t.dtype:
                raise RuntimeError(
                    f"message #{k} of {src} -> {self.rank}: sent tag {sent_tag} {tuple(data.shape)} {data.dtype}, "
                    f"received as tag {tag} {tuple(t.shape)} {t.dtype}"
                )
            t.data.copy_(data)  # as a transport writes: no autograd version bump

        return _Work(
            self,
            lambda: len(ch.sends) > k or group.broken,
            f"rank {src} to send message #{k} of {src} -> {self.rank}",
            done,
        )

    @staticmethod
    def _check_broken(group: Group) -> None:
        if group.broken:
            raise Broken(f"group {group.members} was aborted")
