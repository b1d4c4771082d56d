"""What the pipeline runtime asks of torch.distributed, in one place.

A :class:`Comm` is this process's view of the world as the pipelines use it: the process groups
of the links (one per link and direction, made once per world and connected before any step),
the set-up exchanges over the world's store (every wait bounded, named in its error, and cut
short at once by a failure on another rank), the messages of the steps, and the few collectives
of selection and data parallelism. :class:`TorchComm` is torch.distributed. The tests play the
same runtime through a model of NCCL's semantics, in threads (tests/lazycomm.py), which
implements the primitives below; everything above them is shared.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import UmoptError, first_line

__all__ = ["Comm", "TorchComm", "Direction", "PipelineBroken", "rounds", "setup_timeout_s"]

Direction = tuple[int, int]  # (sender, receiver), global ranks


class PipelineBroken(UmoptError):
    """A step failed because another rank's step failed first (its words inside), or this
    pipeline can no longer step (see [Note: a failed step breaks the pipeline] in failures.py)."""


# [Note: one process group per link and direction]
# Every direction of every link between two ranks (activations one way, gradients the other) has
# a process group of its own, and its messages go through it only: under NCCL each direction has
# its own communicator and CUDA stream. NCCL runs one communicator's operations in issue order:
# with one group for all of a rank's messages, a receive from the stage before, posted early, held
# back the rank's later send to the stage after (measured far above prediction on 3+ GPUs); with
# one group per link, an early gradient receive would hold back the next activation send on the
# same link. The cost model gives each direction of each link its own queue (docs/formats.md);
# a group per direction is what makes that true. NCCL makes a subgroup by splitting the world's
# communicator, which every rank of the world takes part in, in one order: so every rank makes
# every replica's link groups, in as few splits as the links allow (`rounds`: each split a set of
# disjoint pairs), and no group that nothing uses.

# [Note: lazy connections]
# NCCL connects a point-to-point direction between two ranks lazily: the first send or receive
# of a direction on a communicator blocks its host until the peer posts its first operation of
# that direction (gloo connects every pair when a group is made, so the CPU cannot show it). A
# step posts its receives as early as it can, so on a looped pipeline of 3+ ranks the first
# step's gradient receives would wait on one another in a ring. So every direction a layout uses
# is connected at set-up, before any step: one small message per direction, in one global order
# (the rounds of disjoint pairs, then the pair), which cannot deadlock: the earliest unfinished
# exchange of that order always has both its ranks at it. tests/test_lazy.py plays every kind
# of schedule through a model of this rule.


def rounds(directions: Iterable[Direction]) -> list[list[Direction]]:
    """``directions`` in rounds of disjoint pairs of ranks (greedily, in sorted order): what one
    split of the world's communicator can make at once, and what can connect at once."""
    out: list[list[Direction]] = []
    busy: list[set[int]] = []
    for a, b in sorted(set(directions)):
        k = next((k for k, used in enumerate(busy) if a not in used and b not in used), len(out))
        if k == len(out):
            out.append([])
            busy.append(set())
        out[k].append((a, b))
        busy[k] |= {a, b}
    return out


def setup_timeout_s(default: float) -> float:
    """How long a set-up wait for another rank lasts at most: UMOPT_SETUP_TIMEOUT_S, else ``default``."""
    return float(os.environ.get("UMOPT_SETUP_TIMEOUT_S", default))


class Comm:
    """This process's view of the world, as the pipelines use it (see the module docstring).

    Subclasses implement the primitives (the store, groups, messages, collectives); the links'
    groups, their connection, the bounded set-up waits and the failure flag are written here once.
    """

    rank: int  # this process's global rank
    world: int
    backend: str
    device: torch.device  # where a connection's small message lives
    polls_sends = True  # a send's request says when it is complete, without a wait ([Note: a send let go])

    def __init__(self, rank: int, world: int, backend: str, prefix: str):
        self.rank, self.world, self.backend, self.prefix = rank, world, backend, prefix
        self.device = torch.device("cpu")
        self.links: dict[Direction, Any] = {}  # every direction's group made so far in this world
        self.connected: set[Direction] = set()
        self.failed = ""  # why this process's links were broken ("" while they are not)
        self._ids = 0

    # --- primitives ------------------------------------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _check(self, key: str) -> bool:
        raise NotImplementedError

    def _get(self, key: str) -> bytes:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def _first(self, key: str, value: str) -> None:
        """Set ``key`` to ``value`` unless it is set already."""
        raise NotImplementedError

    def _make_groups(self, members: list[list[Direction]]) -> dict[Direction, Any]:
        """Collective over the world: a group for each direction, made in rounds of disjoint pairs."""
        raise NotImplementedError

    def _drop(self, groups: list[Any]) -> None:
        """Abort and destroy ``groups``: a rank waiting on one of them gets an error at once."""
        raise NotImplementedError

    def group_ranks(self, group: Any) -> list[int]:
        """The global ranks of ``group`` (None: the world; a list of ranks: itself)."""
        raise NotImplementedError

    def isend(self, t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
        raise NotImplementedError

    def irecv(self, t: torch.Tensor, src: int, group: Any, tag: int) -> Any:
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor, group: Any, op: str = "sum", async_op: bool = False) -> Any:
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        raise NotImplementedError

    def barrier(self, group: Any, device: torch.device) -> None:
        raise NotImplementedError

    def all_gather_object(self, obj: Any, group: Any) -> list:
        """Collective over ``group``: every rank's ``obj``, by rank."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, src: int, group: Any) -> Any:
        """Collective over ``group``: ``src``'s ``obj`` on every rank."""
        raise NotImplementedError

    def new_group(self, ranks: Sequence[int]) -> Any:
        """Collective over the world: a group of ``ranks``."""
        raise NotImplementedError

    def groups_of(self, members: Sequence[Sequence[int]]) -> dict[tuple[int, ...], Any]:
        """Collective over the world: a group for each of ``members`` not made yet in this world
        (every rank passes the same, in one order), and those this rank is in, by members."""
        made = self.__dict__.setdefault("_groups", {})
        for m in members:
            key = tuple(sorted(m))
            if key not in made:
                made[key] = self.new_group(key)
        return {tuple(sorted(m)): made[tuple(sorted(m))] for m in members if self.rank in m}

    def timeout_s(self) -> float:
        """The world's own timeout: what a set-up wait lasts by default."""
        return 1800.0

    # --- set-up exchanges over the store -----------------------------------------------------
    def next_id(self) -> str:
        """A fresh name for one collective set-up (a Pipeline, say): every rank draws the same
        names in the same order, since they construct their pipelines in one order."""
        self._ids += 1
        return f"p{self._ids}"

    def put(self, name: str, value: Any) -> None:
        self._set(self.prefix + name, pickle.dumps(value))

    def forget(self, name: str) -> None:
        """Delete what was ``put`` under ``name`` (the store keeps it otherwise)."""
        self._delete(self.prefix + name)

    def get(
        self, name: str, what: str, failed: Optional[str] = None, timeout_s: Optional[float] = None
    ) -> Any:
        """What another rank ``put`` under ``name``, waiting for it at most ``timeout_s``
        (default: :func:`setup_timeout_s`); a failure elsewhere (or one put under ``failed``:
        a set-up's own) ends the wait at once."""
        key = self.prefix + name
        self._poll(lambda: self._check(key), what, timeout_s, failed)
        return pickle.loads(self._get(key))

    def wait(self, work: Any, what: str) -> None:
        """Wait for a set-up message ``work``, within the group's timeout (gloo's point-to-point
        requests say they are done only when waited on, so they cannot be polled); a failure
        names what it waited for, or the failure elsewhere that ended it."""
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - say which wait it was, and why it ended
            elsewhere = self.failure()
            if elsewhere:
                raise PipelineBroken(f"{elsewhere} (rank {self.rank} was waiting for {what})") from None
            raise UmoptError(f"rank {self.rank} waiting for {what}: {describe(exc)}") from None

    def _poll(self, done, what: str, timeout_s: Optional[float], failed: Optional[str] = None) -> None:
        bound = timeout_s if timeout_s is not None else setup_timeout_s(self.timeout_s())
        end = time.monotonic() + bound
        pause = 0.001
        while not done():
            elsewhere = self.failure()
            if not elsewhere and failed is not None and self._check(self.prefix + failed):
                elsewhere = pickle.loads(self._get(self.prefix + failed))
            if elsewhere:
                raise PipelineBroken(f"{elsewhere} (rank {self.rank} was waiting for {what})")
            if time.monotonic() > end:
                raise UmoptError(
                    f"rank {self.rank} waited {bound:g} s for {what} (UMOPT_SETUP_TIMEOUT_S): is every rank "
                    "constructing its pipelines, in the same order?"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    # --- failures ------------------------------------------------------------------------------
    def failure(self) -> str:
        """The first failure any rank wrote (empty: none)."""
        try:
            key = self.prefix + "failed"
            return self._get(key).decode() if self._check(key) else ""
        except Exception:  # noqa: BLE001 - no store, or it is gone: nothing to read
            return ""

    def fail(self, reason: str) -> None:
        """Say why in the store (unless another rank said first), then drop every link group of
        this process (see [Note: a failed step breaks the pipeline] in failures.py)."""
        if self.failed:
            return
        self.failed = reason
        try:
            self._first(self.prefix + "failed", reason)
        except Exception:  # noqa: BLE001 - the links are still dropped below
            pass
        groups = [g for g in self.links.values() if g is not None]
        self.links = {}
        self._drop(groups)

    # --- the links ---------------------------------------------------------------------------
    def link_groups(self, directions: Iterable[Direction]) -> None:
        """Make the group of each direction not made yet in this world (see [Note: one process
        group per link and direction]), then connect them (see [Note: lazy connections]).
        Collective over the world: every rank passes the same directions."""
        if self.failed:
            raise PipelineBroken(f"this process's pipelines cannot step again: {self.failed}")
        new = sorted(set(directions) - set(self.links))
        if not new:
            return
        self.links.update(self._make_groups(rounds(new)))
        for a, b in (d for r in rounds(new) for d in r):
            if self.rank not in (a, b):
                continue
            probe = torch.zeros(1, device=self.device)
            if self.rank == a:
                work = self.isend(probe, b, self.links[(a, b)], tag=0)
            else:
                work = self.irecv(probe, a, self.links[(a, b)], tag=0)
            self.wait(work, f"rank {b if self.rank == a else a} to connect the link {a} -> {b}")
            self.connected.add((a, b))

    def group(self, direction: Direction) -> Any:
        """The process group of a direction (looked up, not held: a failure drops them)."""
        got = self.links.get(direction)
        if got is None:
            raise PipelineBroken(
                f"this process's pipelines cannot step again: {self.failed or f'no link {direction}'}"
            )
        return got


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchComm(Comm):
    """torch.distributed's default group and store, as the pipelines use them."""

    _current: Optional["TorchComm"] = None

    @staticmethod
    def start(backend: str, timeout_s: float, device: torch.device, **where) -> None:
        """This process joins the world (``where``: init_process_group's ``init_method``, ``rank``,
        ``world_size``; none: env:// as under torchrun), bound to ``device`` where it is a GPU."""
        bound = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **bound, **where)

    @staticmethod
    def end() -> None:
        """This process leaves the world (see [Note: a failed rank leaves at once] for when not)."""
        dist.destroy_process_group()

    @classmethod
    def current(cls) -> "TorchComm":
        """This process's Comm for the world it is in now (a new world gets a new one)."""
        if not dist.is_available() or not dist.is_initialized():
            raise UmoptError(
                "umopt.Pipeline needs torch.distributed: call torch.distributed.init_process_group first"
            )
        pg = dist.distributed_c10d._get_default_group()
        if cls._current is None or cls._current.pg is not pg:
            cls._current = cls(pg)
        return cls._current

    def __init__(self, pg: Any):
        super().__init__(
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_backend(),
            # a torchrun restart keeps its store: the keys of an earlier attempt are not this one's
            prefix=f"umopt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
        )
        self.pg = pg
        self.polls_sends = self.backend == "nccl"  # gloo's say so only when waited on
        self.store = dist.distributed_c10d._get_default_store()
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.watching: Optional[threading.Thread] = None
        atexit.register(_release_at_exit, weakref.ref(self))

    def release(self) -> None:
        """Let go of this world's groups (see [Note: groups freed before the interpreter ends])."""
        self.links = {}
        self.pg = None
        if TorchComm._current is self:
            TorchComm._current = None
        gc.collect()

    def _set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def _check(self, key: str) -> bool:
        return self.store.check([key])

    def _get(self, key: str) -> bytes:
        return self.store.get(key)

    def _delete(self, key: str) -> None:
        self.store.delete_key(key)

    def _first(self, key: str, value: str) -> None:
        self.store.compare_set(key, "", value)

    def timeout_s(self) -> float:
        try:
            device = self.device if self.backend == "nccl" else torch.device("cpu")
            return self.pg._get_backend(device).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - a backend that does not say: the default
            return super().timeout_s()

    def _make_groups(self, members: list[list[Direction]]) -> dict[Direction, Any]:
        made: dict[Direction, Any] = {}
        split = (
            self.backend == "nccl" and self.pg.bound_device_id is not None and hasattr(dist, "split_group")
        )
        for pairs in members:
            if split:  # one split of the world's communicator per round of disjoint pairs
                mine = dist.split_group(split_ranks=[sorted(p) for p in pairs], timeout=self._timeout())
                for p in pairs:
                    made[p] = mine if self.rank in p else None
            else:
                for p in pairs:
                    g = dist.new_group(sorted(p), timeout=self._timeout())
                    made[p] = g if self.rank in p else None
        return {p: g for p, g in made.items() if g is not None}

    def _drop(self, groups: list[Any]) -> None:
        for g in groups:
            if g == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            try:
                if self.backend == "nccl":
                    dist.distributed_c10d._abort_process_group(g)
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - broken already is what we want
                pass

    def group_ranks(self, group: Any) -> list[int]:
        if group is None:
            return list(range(self.world))
        if isinstance(group, (list, tuple)):
            return [int(r) for r in group]
        return list(dist.get_process_group_ranks(group))

    def isend(self, t: torch.Tensor, dst: int, group: Any, tag: int) -> Any:
        return dist.isend(t, dst=dst, group=group, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, group: Any, tag: int) -> Any:
        return dist.irecv(t, src=src, group=group, tag=tag)

    def all_reduce(self, t: torch.Tensor, group: Any, op: str = "sum", async_op: bool = False) -> Any:
        return dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int, group: Any) -> None:
        dist.broadcast(t, src=src, group=group)

    def barrier(self, group: Any, device: torch.device) -> None:
        if device.type == "cuda":  # NCCL's barrier on this rank's own GPU, not on GPU 0
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)

    def _timeout(self) -> timedelta:
        """The world's timeout, for every group made from it (torch's default for a new group is
        its own 10 or 30 minutes, not the world's: a stuck link would then wait that long)."""
        return timedelta(seconds=self.timeout_s())

    def new_group(self, ranks: Sequence[int]) -> Any:
        return dist.new_group(sorted(ranks), timeout=self._timeout())

    def world_group(self, timeout_s: float) -> Any:
        """Collective over the world: a group of every rank with a timeout of its own."""
        return dist.new_group(timeout=timedelta(seconds=timeout_s))

    def all_gather_object(self, obj: Any, group: Any) -> list:
        out: list = [None] * (self.world if group is None else len(self.group_ranks(group)))
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: Any, src: int, group: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def split(self, members: list[list[int]]) -> Any:
        """Collective over the world: a group for each of the disjoint ``members``; returns this
        rank's (None where it is in none). Under NCCL one split of the world's communicator."""
        if self.backend == "nccl" and self.pg.bound_device_id is not None and hasattr(dist, "split_group"):
            return dist.split_group(split_ranks=[sorted(m) for m in members], timeout=self._timeout())
        mine = None
        for m in members:
            g = dist.new_group(sorted(m), timeout=self._timeout())
            if self.rank in m:
                mine = g
        return mine

    def watch_for_failures(self) -> None:
        """Under NCCL: a thread that breaks this process's links when another rank writes a
        failure (NCCL does not notice a peer's communicator going away). It waits on a store of
        its own: a store client holds its lock for the whole of a wait, so on the world's store
        every other call of this process (a failing rank's own report among them) would wait
        behind it."""
        if self.watching is None and self.backend == "nccl":
            self.watch()

    def watch(self) -> None:
        """Start the thread of :meth:`watch_for_failures` (whatever the backend)."""
        store = self.store.clone()
        key = self.prefix + "failed"

        def watch() -> None:
            while True:
                began = time.monotonic()
                try:
                    store.wait([key], timedelta(seconds=60))
                    break
                except Exception:  # noqa: BLE001 - a wait that timed out: wait again; a world gone: stop
                    if TorchComm._current is not self or not dist.is_initialized():
                        return
                    if time.monotonic() - began < 1.0:  # an error, not a timeout: do not spin on it
                        time.sleep(1.0)
            try:
                self.fail(store.get(key).decode())
            except Exception:  # noqa: BLE001 - the world went away meanwhile: nothing to break
                pass

        self.watching = threading.Thread(target=watch, name="umopt-pipeline-failures", daemon=True)
        self.watching.start()


# [Note: groups freed before the interpreter ends]
# A user's script that trains with umopt.Pipeline on gloo, calls destroy_process_group() and
# returns died at exit with SIGABRT ("terminate called without an active exception") in about
# 1 run of 15 (2 of 30 on this machine; the same loop without umopt's groups: 0 of 30). torch's
# registry lets go of the groups at destroy_process_group(), but this module still held them (the
# world's Comm, its links), so they were freed while the interpreter was being torn down, and
# gloo's threads and pending work died there. At exit, while the interpreter is whole, the Comm
# lets go of them: 0 of 60 runs aborted after. umopt's own ranks leave by os._exit (rank.py).
def _release_at_exit(ref: "weakref.ReferenceType[TorchComm]") -> None:
    comm = ref()
    if comm is not None:
        comm.release()


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception, as failures are told to other ranks."""
    return f"{exc.__class__.__name__}: {first_line(exc, limit)}"
