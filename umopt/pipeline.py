"""``umopt.Pipeline``: one stage of a pipeline that runs a umopt schedule, inside your own training loop.

On each rank you build your stage's module (your layers, on your device), load the schedule that
``umopt solve`` wrote, and call :meth:`Pipeline.step` once per iteration; the optimizer, scaler,
clipping, logging and checkpoints stay yours::

    pipe = umopt.Pipeline(stage_module, "schedule.json", loss_fn=nn.CrossEntropyLoss())
    loss = pipe.step(inputs)              # first stage; the last passes targets=..., the others nothing
    optimizer.step(); optimizer.zero_grad()

``step`` plays the stage's op list: ``F(lo, hi)`` runs the forward of samples ``[lo, hi)`` and sends
its output on, ``B(lo, hi)`` runs their backward (recomputing the forward under ``recompute``) and
sends the input gradients back. Neighbours may chunk differently, so a stage receives activations
and gradients into one buffer per boundary tensor for the whole minibatch and reads its chunks as
views of it. The messages of each link are issued by both ends in one agreed order (the cost
model's send times), receives as early as that order allows, so compute overlaps communication
and NCCL, which runs a pair's messages in issue order, cannot deadlock. The gradients left in the
module's parameters are those of ``loss_fn(whole_model(x), y).backward()`` in one process on the
whole minibatch: with ``loss_reduction="mean"`` (torch's default) a chunk's loss counts by its
share of the minibatch, with ``"sum"`` as it is.

What crosses a boundary may be one tensor or a tuple of tensors, each split on dim 0. Their
per-sample shapes and dtypes are given (``input_specs``) or learned once, at the first step, from
one forward of one sample on the stage before; they are never exchanged per step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .costmodel import CostTables, Op, simulate
from .devices import TensorSpec, autocast, check_trainable, numerics, numerics_differences
from .errors import UmoptError
from .formats.profile import Profile, load_profile
from .formats.schedule import Schedule, check_against_profile, load_schedule
from .splitbackward import backward_input

__all__ = ["Pipeline", "StepTimer", "link_order", "link_groups", "BUCKET_BYTES"]

# gradients all-reduced together across data-parallel replicas, at most (torch DDP's default)
BUCKET_BYTES = 25 << 20

# [Note: one process group per link]
# Every link (s, s+1) has a process group of its own, and its messages go through it only: so,
# under NCCL, each link has its own communicator and CUDA stream. With one group for all of a
# rank's messages, NCCL runs them on one stream in issue order: after
# `init_process_group(device_id=...)` (eager init, what the runtime does) every point-to-point op
# of the world group uses the world's single communicator instead of one per peer pair, so a middle
# stage's receive from s-1, posted early, blocks its later send to s+1, and the stages serialize
# (measured far above prediction on 3+ GPUs, and a probe fit would take that for a per-message
# cost). The cost model orders messages per link only; a group per link is what makes that true.
# NCCL makes a subgroup by splitting the world's communicator, which every rank of the world takes
# part in, in one order: so every rank creates every link's group, other replicas' links too.

_LINKS: dict[str, Any] = {"world": None, "groups": {}}


def link_groups(pipelines: Sequence[Sequence[int]]) -> dict[tuple[int, int], Any]:
    """A process group for each link of each pipeline (its global ranks by stage), made once per
    world and reused (several Pipelines of one set of ranks share them). Collective: every rank of
    the world calls it with the same pipelines (see [Note: one process group per link])."""
    world = dist.distributed_c10d._get_default_group()
    if _LINKS["world"] is not world:  # a new world: the groups of the last one are gone
        _LINKS.update(world=world, groups={})
    groups: dict[tuple[int, int], Any] = _LINKS["groups"]
    pairs = sorted({tuple(sorted((p[s], p[s + 1]))) for p in pipelines for s in range(len(p) - 1)})
    for pair in pairs:
        if pair not in groups:
            groups[pair] = dist.new_group(list(pair))
    return {pair: groups[pair] for pair in pairs}

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


_said: set[str] = set()


def _warn_numerics(profile: Profile) -> None:
    """Say once per process where this process's TF32 / cuDNN settings differ from the profile's."""
    differ = numerics_differences(profile.device.numerics, numerics())
    line = "; ".join(differ)
    if differ and line not in _said:
        _said.add(line)
        logging.getLogger("umopt").warning(
            "this process runs with other numerics than the profile was timed under (%s): its predicted times may not hold", line
        )


def link_order(profile: Profile, schedule: Schedule) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """For each link (s, s+1): its messages in the order both ends issue them.

    A message is ("act", lo, hi) from s to s+1 or ("grad", lo, hi) from s+1 to s, ordered by the
    cost model's send time (then direction and sample), which both ends compute identically.
    """
    tables = CostTables.from_profile(profile, schedule.recompute)
    tl = simulate(tables, schedule.op_lists(), schedule.minibatch)
    order: dict[tuple[int, int], list] = {(s, s + 1): [] for s in range(len(schedule.stages) - 1)}
    for m in sorted(tl.messages, key=lambda m: (m.sent, m.direction != "fwd", m.lo)):
        order[(m.link, m.link + 1)].append(("act" if m.direction == "fwd" else "grad", m.lo, m.hi))
    return order


class StepTimer:
    """Milliseconds since the step started: perf_counter on CPU, CUDA events on GPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, mark) -> float:
        return self.t0.elapsed_time(mark) if self.cuda else (mark - self.t0) * 1e3

    def stop(self) -> float:
        end = self.mark()
        if self.cuda:
            torch.cuda.synchronize()
        return self.ms(end)


def _as_tuple(x: Optional[Tensors]) -> tuple[torch.Tensor, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _grad_carrying(spec: TensorSpec) -> bool:
    return spec.dtype.is_floating_point or spec.dtype.is_complex


class Pipeline:
    """One stage of a umopt schedule, run in your own training loop.

    Args:
        module: this stage's layers, on ``device``; called with the boundary tensor (or tuple).
        schedule: a schedule file's path or a loaded :class:`~umopt.formats.schedule.Schedule`.
        stage: which stage this rank runs (default: its rank in ``group``).
        loss_fn: ``loss_fn(output, targets)`` on the last stage (required there).
        loss_reduction: ``"mean"`` (torch's default: the loss is a mean over the samples it is
            given) or ``"sum"``.
        profile: the profile the schedule was made for (default: the file the schedule names); the
            message order both ends of a link agree on, and the autocast dtype, come from it.
        group: the process group of this pipeline (default: the world); stage ``s`` is its rank ``s``.
        device: where the buffers live (default: the module's first parameter's device).
        input_specs, output_specs: per-sample shape and dtype of each tensor this stage receives
            and sends (default: agreed at the first step, each stage telling the next what one
            forward of one sample gives; given ones are checked against what the stage before says).
        dtype: the autocast dtype of forwards (default: the profile's).
        timer: a :class:`StepTimer` to record each op's span (``spans`` after a step).
        dp_group: the ranks that run this same stage in the other data-parallel replicas of the
            pipeline, each on its own slice of the global minibatch: at the end of each step the
            stage's gradients are averaged over them (bucketed all-reduces), so that they are the
            global minibatch's mean-loss gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        schedule: Union[str, Path, Schedule],
        stage: Optional[int] = None,
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        loss_reduction: str = "mean",
        profile: Optional[Union[str, Path, Profile]] = None,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        input_specs: Optional[Sequence[TensorSpec]] = None,
        output_specs: Optional[Sequence[TensorSpec]] = None,
        dtype: Optional[str] = None,
        timer: Optional[StepTimer] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
    ):
        self.schedule = schedule if isinstance(schedule, Schedule) else load_schedule(str(schedule))
        self.profile = profile if isinstance(profile, Profile) else load_profile(str(profile or self.schedule.profile.path))
        check_against_profile(self.schedule, self.profile)
        self.group = group
        S = len(self.schedule.stages)
        self.stage = dist.get_rank(group) if stage is None else stage
        if dist.get_world_size(group) != S:
            raise UmoptError(f"the schedule has {S} stages but the process group has {dist.get_world_size(group)} ranks")
        if not 0 <= self.stage < S:
            raise UmoptError(f"stage {self.stage} of a {S}-stage schedule")
        if loss_reduction not in ("mean", "sum"):
            raise UmoptError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.first, self.last = self.stage == 0, self.stage == S - 1
        if self.last and loss_fn is None:
            raise UmoptError("the last stage needs loss_fn")
        self.module, self.loss_fn, self.loss_reduction = module, loss_fn, loss_reduction
        param = next(module.parameters(), None)
        self.device = device or (param.device if param is not None else torch.device("cpu"))
        self.dtype = dtype or self.profile.device.dtype
        check_trainable(self.dtype)
        _warn_numerics(self.profile)
        self.timer = timer
        self.dp_group = dp_group
        self.spans: list[tuple[str, int, int, Any, Any]] = []
        order = link_order(self.profile, self.schedule)
        self.ops: list[Op] = self.schedule.op_lists()[self.stage]
        self._split = any(op.kind == "W" for op in self.ops)  # B: the input gradient only; W: the weights'
        self.up, self.down = order.get((self.stage - 1, self.stage), []), order.get((self.stage, self.stage + 1), [])
        ranks = list(range(S)) if group is None else dist.get_process_group_ranks(group)
        self.peer_up = ranks[self.stage - 1] if not self.first else -1
        self.peer_down = ranks[self.stage + 1] if not self.last else -1
        if group is None:
            pipelines = [ranks]
        else:  # every rank of the world makes every replica's links: gather the pipelines
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ranks)
            pipelines = sorted({tuple(r) for r in gathered})
        links = link_groups(pipelines)
        me = ranks[self.stage]
        self.link_up = links[tuple(sorted((self.peer_up, me)))] if not self.first else None
        self.link_down = links[tuple(sorted((me, self.peer_down)))] if not self.last else None
        self.input_specs: Optional[list[TensorSpec]] = list(input_specs) if input_specs is not None else None
        self.output_specs: Optional[list[TensorSpec]] = list(output_specs) if output_specs is not None else None
        self._ready = False
        self._act: list[torch.Tensor] = []  # one buffer per received tensor, the whole minibatch
        self._grad: list[torch.Tensor] = []  # one per sent tensor that carries a gradient back

    # --- set-up, once ------------------------------------------------------------------------
    def _learn_specs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """The shapes at this stage's edges, agreed once along the pipeline: each stage tells the
        next what it sends (given, or from one forward of one sample)."""
        if self.first:
            self.input_specs = [TensorSpec.of(t) for t in inputs]
        else:
            told: list = [None]
            dist.recv_object_list(told, src=self.peer_up, group=self.link_up)
            if self.input_specs is not None and list(self.input_specs) != list(told[0]):
                raise UmoptError(f"stage {self.stage} expects {self.input_specs} but stage {self.stage - 1} sends {told[0]}")
            self.input_specs = list(told[0])
        if not self.last:
            if self.output_specs is None:
                if self.first and not inputs:
                    raise UmoptError("stage 0 learns what it sends from one forward: pass its inputs to prepare() or step()")
                sample = tuple(t[:1] for t in inputs) if self.first else tuple(spec.empty(1, self.device).zero_() for spec in self.input_specs)
                with torch.no_grad(), autocast(self.device, self.dtype):
                    out = self.module(*sample) if len(sample) > 1 else self.module(sample[0])
                self.output_specs = [TensorSpec.of(t) for t in _as_tuple(out)]
            dist.send_object_list([self.output_specs], dst=self.peer_down, group=self.link_down)
        B = self.schedule.minibatch
        self._act = [spec.empty(B, self.device) for spec in self.input_specs] if not self.first else []
        self._grad = [spec.empty(B, self.device) for spec in self.output_specs if _grad_carrying(spec)] if not self.last else []
        self._ready = True

    def prepare(self, inputs: Optional[Tensors] = None) -> None:
        """Agree on the boundary shapes now (stage 0 passes a batch of its inputs) rather than in
        the first step, e.g. to keep that step's time clean. Every stage must call it, or none."""
        if not self._ready:
            self._learn_specs(_as_tuple(inputs))

    # --- one iteration -----------------------------------------------------------------------
    def step(self, inputs: Optional[Tensors] = None, *, targets: Optional[Tensors] = None) -> Optional[torch.Tensor]:
        """Run one iteration's forwards and backwards on this stage; gradients accumulate in the
        module's parameters (the optimizer step is yours). Returns the minibatch's loss on the
        last stage (detached), None elsewhere."""
        B, recompute = self.schedule.minibatch, self.schedule.recompute
        xs, ys = _as_tuple(inputs), _as_tuple(targets)
        if self.first and (not xs or any(t.shape[0] != B for t in xs)):
            raise UmoptError(f"stage 0's step needs inputs of {B} samples (the schedule's minibatch)")
        if self.last and (not ys or any(t.shape[0] != B for t in ys)):
            raise UmoptError(f"the last stage's step needs targets of {B} samples")
        if not self._ready:
            self._learn_specs(xs)
        links = _Links(self)
        saved: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], Any]] = {}
        weights_later: dict[tuple[int, int], Callable[[], None]] = {}  # B chunks whose W is to come
        loss_sum = torch.zeros((), device=self.device)
        spans = []
        mark = self.timer.mark if self.timer is not None else (lambda: None)

        def chunk_input(lo: int, hi: int, grad: bool) -> tuple[torch.Tensor, ...]:
            if self.first:
                return tuple(t[lo:hi] for t in xs)
            return tuple(
                buf[lo:hi].detach().requires_grad_(grad and _grad_carrying(spec)) for buf, spec in zip(self._act, self.input_specs)
            )

        def forward(x: tuple[torch.Tensor, ...], lo: int, hi: int):
            with autocast(self.device, self.dtype):
                out = self.module(*x) if len(x) > 1 else self.module(x[0])
                if not self.last:
                    return out
                y = tuple(t[lo:hi] for t in ys)
                loss = self.loss_fn(out, y[0] if len(y) == 1 else y)
                return loss * ((hi - lo) / B) if self.loss_reduction == "mean" else loss

        links.advance()
        for kind, lo, hi in self.ops:
            if kind == "F":
                links.wait_acts(lo, hi)
                t0 = mark()
                x = chunk_input(lo, hi, not recompute)
                with torch.set_grad_enabled(not recompute):
                    out = forward(x, lo, hi)
                if self.last:
                    loss_sum += out.detach().float()
                if not recompute:
                    saved[(lo, hi)] = (x, out)
                if not self.last:
                    links.send_acts(lo, hi, [t.detach() for t in _as_tuple(out)])
            elif kind == "B":
                links.wait_grads(lo, hi)
                t0 = mark()
                if recompute:
                    x = chunk_input(lo, hi, True)
                    out = forward(x, lo, hi)
                else:
                    x, out = saved.pop((lo, hi))
                if self.last:
                    roots, grads = [out], None
                else:
                    outs = [t for t, spec in zip(_as_tuple(out), self.output_specs) if _grad_carrying(spec)]
                    pairs = [(o, g[lo:hi]) for o, g in zip(outs, self._grad) if o.requires_grad]
                    roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
                if self._split:  # the input gradient now, the weight gradient at this chunk's W
                    weights_later[(lo, hi)] = backward_input(x, roots, grads, self.module)
                elif roots:
                    torch.autograd.backward(roots, grads)
                if not self.first:
                    links.send_grads(lo, hi, [t.grad if t.grad is not None else torch.zeros_like(t) for t, spec in zip(x, self.input_specs) if _grad_carrying(spec)])
            else:  # W: the weight gradients of the B chunks in [lo, hi)
                t0 = mark()
                for chunk in sorted(c for c in weights_later if lo <= c[0] and c[1] <= hi):
                    weights_later.pop(chunk)()
            spans.append((kind, lo, hi, t0, mark()))
            links.advance()
        links.finish()
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            # after this stage's last messages are through (see [Note: the all-reduce after the sends])
            t0 = mark()
            self._average_gradients()()
            spans.append(("AR", 0, 0, t0, mark()))
        self.spans = spans
        return loss_sum if self.last else None

    # [Note: the all-reduce after the sends]
    # The data-parallel all-reduce runs on a communicator of its own (dp_group) and would start
    # while this stage's last sends (its last input gradients) are still in flight on the links'.
    # NCCL promises progress for two communicators in flight at once only if both kernels can run
    # at the same time, which nothing guarantees (a full GPU, or a peer that starts them in the
    # other order, deadlocks). So the all-reduce starts once the links are done. The cost model
    # starts it at the stage's last op: the last message's time, on a GPU link microseconds, is
    # not counted.
    def _average_gradients(self) -> Callable[[], None]:
        """Start averaging this stage's gradients over its data-parallel replicas: flat buckets of
        about :data:`BUCKET_BYTES`, all-reduced together; the function returned waits for them,
        divides and copies back."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for g in grads:
            if size and size + g.numel() * g.element_size() > BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += g.numel() * g.element_size()
        n = dist.get_world_size(self.dp_group)
        flat = [torch.cat([g.reshape(-1) for g in b]) for b in buckets if b]
        works = [dist.all_reduce(f, group=self.dp_group, async_op=True) for f in flat]

        def finish() -> None:
            for w, f, b in zip(works, flat, [b for b in buckets if b]):
                w.wait()
                f /= n
                offset = 0
                for g in b:
                    g.copy_(f[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

        return finish


class _Links:
    """The point-to-point messages of one stage for one iteration.

    Both ends of a link issue its messages in the agreed order; a receive is posted as soon as
    every earlier message of that order has been issued, a send when its data is ready. A message
    of a tuple boundary is one transfer per tensor (gradients: per tensor that carries one).
    """

    def __init__(self, pipe: Pipeline):
        self.p = pipe
        self.pos = {"up": 0, "down": 0}
        self.recv_act: dict[tuple[int, int], list] = {}
        self.recv_grad: dict[tuple[int, int], list] = {}
        self.pending_sends: list = []
        self.ready: dict[tuple[str, int, int], list[torch.Tensor]] = {}

    def _issue(self, side: str) -> None:
        p = self.p
        seq = p.up if side == "up" else p.down
        peer = p.peer_up if side == "up" else p.peer_down
        link = p.link_up if side == "up" else p.link_down  # [Note: one process group per link]
        while self.pos[side] < len(seq):
            kind, lo, hi = seq[self.pos[side]]
            base = self.pos[side] * 64  # tags: the message's place in the order, then the tensor
            if (kind == "act") == (side == "up"):  # incoming
                bufs = p._act if side == "up" else p._grad
                works = [dist.irecv(buf[lo:hi], src=peer, tag=base + i, group=link) for i, buf in enumerate(bufs)]
                (self.recv_act if side == "up" else self.recv_grad)[(lo, hi)] = works
            else:
                data = self.ready.pop((kind, lo, hi), None)
                if data is None:
                    return  # not computed yet: later messages of this link wait their turn
                for i, t in enumerate(data):
                    self.pending_sends.append((dist.isend(t, dst=peer, tag=base + i, group=link), t))
            self.pos[side] += 1

    def advance(self) -> None:
        self._issue("up")
        self._issue("down")

    def send_acts(self, lo: int, hi: int, ts: list[torch.Tensor]) -> None:
        self.ready[("act", lo, hi)] = [t.contiguous() for t in ts]
        self._issue("down")

    def send_grads(self, lo: int, hi: int, ts: list[torch.Tensor]) -> None:
        self.ready[("grad", lo, hi)] = [t.contiguous() for t in ts]
        self._issue("up")

    @staticmethod
    def _wait(works: dict, lo: int, hi: int) -> None:
        for mlo, mhi in list(works):
            if mlo < hi and lo < mhi:
                for w in works.pop((mlo, mhi)):
                    w.wait()

    def wait_acts(self, lo: int, hi: int) -> None:
        self.advance()
        self._wait(self.recv_act, lo, hi)

    def wait_grads(self, lo: int, hi: int) -> None:
        self.advance()
        self._wait(self.recv_grad, lo, hi)

    def finish(self) -> None:
        self.advance()
        for works in (self.recv_act, self.recv_grad):
            for ws in works.values():
                for w in ws:
                    w.wait()
        for work, _data in self.pending_sends:
            work.wait()
