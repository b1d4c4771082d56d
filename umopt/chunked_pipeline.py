"""One rank of a schedule with several model chunks per rank, in your own training loop.

``umopt.Pipeline([chunk_a, chunk_b], schedule)`` (a list of this rank's chunk modules, as torch's
``PipelineScheduleMulti`` takes several stages) gives a :class:`ChunkedPipeline`: it plays the
rank's ops in the schedule's order, each on the chunk of its virtual stage. A hand-off between
two chunks of this rank is a copy into the next chunk's buffer; one to another rank is a message
over the process group of that pair of ranks (see [Note: one process group per link] in
umopt/pipeline.py), in the order the cost model sends them, which both ends compute alike.
Gradients are one process's: every chunk's backward runs on exactly what its forward saw, and
each chunk's loss share is the same as one process's mean over the minibatch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .costmodel import ChunkOp, CostTables, OpKind, simulate
from .devices import TensorSpec, autocast, check_trainable
from .errors import UmoptError
from .formats.profile import Profile
from .formats.report import Selection
from .formats.schedule import Schedule
from .losses import ChunkLoss, chunk_loss
from .pipeline import (
    _LINKS,
    StepTimer,
    _as_tuple,
    _grad_carrying,
    _tensors,
    _Turns,
    average_gradients,
    guarded,
    link_groups,
    loss_scale,
    schedule_and_profile,
)
from .splitbackward import backward_input

__all__ = ["ChunkedPipeline", "chunk_message_order"]


def chunk_message_order(
    profile: Profile, schedule: Schedule
) -> dict[tuple[int, int], list[tuple[str, int, int, int]]]:
    """For each pair of ranks that talk: its messages, ("act" | "grad", boundary j, lo, hi), in the
    order both ends issue them (the cost model's send time, then direction, boundary, sample)."""
    chunks = schedule.chunking()
    tables = CostTables.from_profile(profile, schedule.recompute, chunks=chunks)
    tl = simulate(tables, schedule.op_lists(), schedule.minibatch)
    order: dict[tuple[int, int], list] = {}
    for m in sorted(tl.messages, key=lambda m: (m.sent, m.direction != "fwd", m.link, m.lo)):
        a, b = chunks.ranks[m.link], chunks.ranks[m.link + 1]
        if a != b:
            order.setdefault(tuple(sorted((a, b))), []).append(
                ("act" if m.direction == "fwd" else "grad", m.link, m.lo, m.hi)
            )
    return order


class ChunkedPipeline:
    """This rank's chunks of a schedule with several chunks per rank (see the module docstring).

    Args:
        modules: this rank's chunk modules, in the order of their virtual stages.
        schedule: a schedule file (or loaded Schedule) with ``chunks``.
        loss_fn, loss_reduction, loss_normalizer, profile, group, device, dtype, timer,
            dp_group, on_failure: as :class:`umopt.Pipeline`'s (``loss_fn`` on the rank that
            holds the last chunk; ``dp_group`` the same rank of the other data-parallel replicas,
            among which the gradients of all this rank's chunks are averaged after each step).

    A step that raises breaks the links as :class:`umopt.Pipeline`'s does.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        schedule: Union[str, Schedule],
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        loss_reduction: Optional[str] = None,
        loss_normalizer: Optional[Callable[[Any], Any]] = None,
        profile: Optional[Union[str, Profile]] = None,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[str] = None,
        timer: Optional[StepTimer] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
        on_failure: Optional[Callable[[BaseException], None]] = None,
        select: bool = True,
        select_steps: Optional[int] = None,
        steps: Optional[int] = None,
    ):
        self.schedule, self.profile = schedule_and_profile(schedule, profile)
        self.dp_group = dp_group
        chunks = self.schedule.chunking()
        if chunks is None:
            raise UmoptError(
                "a list of chunk modules needs a schedule with several chunks per rank (umopt solve --chunks)"
            )
        self.group = group
        R = len(self.schedule.stages)
        if dist.get_world_size(group) != R:
            raise UmoptError(
                f"the schedule has {R} ranks but the process group has {dist.get_world_size(group)}"
            )
        self.rank = dist.get_rank(group)
        self.ranks_of = list(chunks.ranks)
        self.V = len(self.ranks_of)
        self.local = [j for j in range(self.V) if self.ranks_of[j] == self.rank]
        if len(modules) != len(self.local):
            raise UmoptError(
                f"rank {self.rank} holds virtual stages {self.local} of the schedule, but was given {len(modules)} modules"
            )
        self.modules = dict(zip(self.local, modules))
        self.last = self.V - 1 in self.modules
        if self.last and loss_fn is None:
            raise UmoptError("the rank holding the last chunk needs loss_fn")
        self._loss: Optional[ChunkLoss] = (
            chunk_loss(loss_fn, loss_reduction, loss_normalizer) if loss_fn else None
        )
        param = next((p for m in modules for p in m.parameters()), None)
        self.device = device or (param.device if param is not None else torch.device("cpu"))
        self.dtype = dtype or self.profile.device.dtype
        check_trainable(self.dtype)
        self.timer, self.on_failure = timer, on_failure
        self.spans: list[tuple[str, int, int, Any, Any]] = []
        self.ops: list[ChunkOp] = self.schedule.op_lists()[self.rank]
        self._split = {j: any(op.kind == OpKind.W and op.stage == j for op in self.ops) for j in self.local}
        world = list(range(R)) if group is None else dist.get_process_group_ranks(group)
        self._global = world
        order = chunk_message_order(self.profile, self.schedule)
        pairs = sorted(order) + sorted(
            {tuple(sorted((a, b))) for a, b in zip(self.ranks_of, self.ranks_of[1:]) if a != b} - set(order)
        )
        mine = [(world[a], world[b]) for a, b in pairs]
        if group is not None:  # every rank of the world makes every replica's links: gather them
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            mine = sorted({pair for got in gathered for pair in got})
        link_groups(mine)
        self.order = {pair: seq for pair, seq in order.items() if self.rank in pair}
        self.specs_in: dict[int, list[TensorSpec]] = {}
        self.specs_out: dict[int, list[TensorSpec]] = {}
        self._act: dict[int, list[torch.Tensor]] = {}
        self._grad: dict[int, list[torch.Tensor]] = {}
        self._ready = False
        self.selected: Optional[str] = None  # the schedule kept, once chosen
        self.selection: Optional[Selection] = None
        self._turns: Optional[_Turns] = None
        if select and self.schedule.candidates:  # the candidates' pipelines, over the same chunks
            kwargs = dict(
                loss_fn=loss_fn,
                loss_reduction=loss_reduction,
                loss_normalizer=loss_normalizer,
                profile=self.profile,
                group=group,
                device=self.device,
                dtype=dtype,
                timer=timer,
                dp_group=dp_group,
                on_failure=on_failure,
                select=False,
            )
            self._turns = _Turns.of_candidates(
                self, lambda sc: ChunkedPipeline(modules, sc, **kwargs), select_steps, steps
            )

    def _group(self, a: int, b: int):
        return _LINKS["groups"].get(tuple(sorted((self._global[a], self._global[b]))))

    def _forward(self, j: int, x: tuple[torch.Tensor, ...]) -> Any:
        m = self.modules[j]
        return m(*x) if len(x) > 1 else m(x[0])

    def _learn_specs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Each boundary's shapes, agreed in virtual stage order (a chain: no rank waits on a later one)."""
        B = self.schedule.minibatch
        for j in self.local:
            if j == 0:
                self.specs_in[0] = [TensorSpec.of(t) for t in inputs]
            elif self.ranks_of[j - 1] == self.rank:
                self.specs_in[j] = self.specs_out[j - 1]
            else:
                told: list = [None]
                src = self.ranks_of[j - 1]
                dist.recv_object_list(told, src=self._global[src], group=self._group(src, self.rank))
                self.specs_in[j] = list(told[0])
            if j < self.V - 1:
                sample = (
                    tuple(t[:1] for t in inputs)
                    if j == 0
                    else tuple(spec.empty(1, self.device).zero_() for spec in self.specs_in[j])
                )
                with torch.no_grad(), autocast(self.device, self.dtype):
                    out = self._forward(j, sample)
                self.specs_out[j] = [TensorSpec.of(t) for t in _tensors(out, f"virtual stage {j}'s output")]
                dst = self.ranks_of[j + 1]
                if dst != self.rank:
                    dist.send_object_list(
                        [self.specs_out[j]], dst=self._global[dst], group=self._group(self.rank, dst)
                    )
        for j in self.local:
            self._act[j] = [spec.empty(B, self.device) for spec in self.specs_in[j]] if j > 0 else []
            self._grad[j] = (
                [spec.empty(B, self.device) for spec in self.specs_out[j] if _grad_carrying(spec)]
                if j < self.V - 1
                else []
            )
        self._ready = True

    def prepare(self, inputs: Any = None) -> None:
        """Agree on the boundary shapes now (the rank holding the first chunk passes a batch of
        its inputs) rather than in the first step. Every rank must call it, or none."""
        if not self._ready:
            xs = _tensors(inputs, "the inputs") if 0 in self.modules else ()
            guarded(lambda: self._learn_specs(xs), f"rank {self.rank}", self.on_failure)

    def step(
        self,
        *args: Any,
        inputs: Any = None,
        targets: Any = None,
        target: Any = None,
        losses: Optional[list] = None,
    ) -> Optional[torch.Tensor]:
        """One iteration's ops of this rank; gradients accumulate in the chunks' parameters.
        The rank holding virtual stage 0 passes the inputs, the one holding the last its targets;
        returns the minibatch's loss there (None elsewhere). Where the schedule file has
        candidates, the first steps play them in turns and the fastest is kept (``selected``), as
        :class:`umopt.Pipeline` does."""
        if self._turns is not None and self.selected is None:
            return self._turns.step(args, inputs, targets, target, losses)
        play = self._turns.winner if self._turns is not None else self
        return play._guarded(lambda: play._step(*play._inputs(args, inputs, targets, target), losses=losses))

    def _inputs(
        self, args, inputs, targets, target
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        B = self.schedule.minibatch
        xs = (
            _tensors(args[0] if len(args) == 1 else (args or inputs), "the inputs")
            if 0 in self.modules
            else ()
        )
        ys = _tensors(targets if targets is not None else target, "the targets") if self.last else ()
        if 0 in self.modules and (not xs or any(t.shape[0] != B for t in xs)):
            raise UmoptError(f"the first chunk's step needs inputs of {B} samples (the schedule's minibatch)")
        if self.last and (not ys or any(t.shape[0] != B for t in ys)):
            raise UmoptError(f"the last chunk's step needs targets of {B} samples")
        return xs, ys

    def _guarded(self, run: Callable[[], Any]) -> Any:
        return guarded(run, f"rank {self.rank}", self.on_failure)

    def _step(self, xs, ys, losses) -> Optional[torch.Tensor]:
        # one piece: a step's ops share its saved activations, deferred weight gradients and links;
        # the loop reads in the order the ops run, as simulate plays them
        if not self._ready:
            self._learn_specs(xs)
        recompute = self.schedule.recompute
        scale = None
        if self.last:
            assert self._loss is not None
            scale = loss_scale(self._loss, ys, self.schedule.minibatch, self.dp_group, self.device)
        links = _PairLinks(self)
        saved: dict[tuple[int, int, int], tuple] = {}
        weights_later: dict[tuple[int, int, int], Callable[[], None]] = {}
        loss_sum = torch.zeros((), device=self.device)
        spans = []
        mark = self.timer.mark if self.timer is not None else (lambda: None)

        def chunk_input(j: int, lo: int, hi: int, grad: bool) -> tuple[torch.Tensor, ...]:
            if j == 0:
                return tuple(t[lo:hi] for t in xs)
            return tuple(
                buf[lo:hi].detach().requires_grad_(grad and _grad_carrying(spec))
                for buf, spec in zip(self._act[j], self.specs_in[j])
            )

        def forward(j: int, x, lo: int, hi: int):
            with autocast(self.device, self.dtype):
                out = self._forward(j, x)
                if j < self.V - 1:
                    return out
                y = tuple(t[lo:hi] for t in ys)
                loss = self._loss.fn(out, y[0] if len(y) == 1 else y)
                if losses is not None:
                    losses.append(loss.detach())
                return loss * scale(lo, hi)

        try:
            links.advance()
            for kind, lo, hi, j in self.ops:
                if kind == OpKind.F:
                    links.wait("act", j, lo, hi)
                    t0 = mark()
                    x = chunk_input(j, lo, hi, not recompute)
                    with torch.set_grad_enabled(not recompute):
                        out = forward(j, x, lo, hi)
                    if j == self.V - 1:
                        loss_sum += out.detach().float()
                    if not recompute:
                        saved[(j, lo, hi)] = (x, out)
                    if j < self.V - 1:
                        outs = [t.detach() for t in _tensors(out, f"virtual stage {j}'s output")]
                        links.send("act", j, lo, hi, outs)
                elif kind == OpKind.B:
                    links.wait("grad", j, lo, hi)
                    t0 = mark()
                    if recompute:
                        x = chunk_input(j, lo, hi, True)
                        out = forward(j, x, lo, hi)
                    else:
                        x, out = saved.pop((j, lo, hi))
                    if j == self.V - 1:
                        roots, grads = [out], None
                    else:
                        outs = [
                            t for t, spec in zip(_as_tuple(out), self.specs_out[j]) if _grad_carrying(spec)
                        ]
                        pairs = [(o, g[lo:hi]) for o, g in zip(outs, self._grad[j]) if o.requires_grad]
                        roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
                    if self._split[j]:
                        weights_later[(j, lo, hi)] = backward_input(x, roots, grads, self.modules[j])
                    elif roots:
                        torch.autograd.backward(roots, grads)
                    if j > 0:
                        links.send(
                            "grad",
                            j - 1,
                            lo,
                            hi,
                            [
                                t.grad if t.grad is not None else torch.zeros_like(t)
                                for t, spec in zip(x, self.specs_in[j])
                                if _grad_carrying(spec)
                            ],
                        )
                else:
                    t0 = mark()
                    for chunk in sorted(c for c in weights_later if c[0] == j and lo <= c[1] and c[2] <= hi):
                        weights_later.pop(chunk)()
                spans.append((kind, lo, hi, t0, mark()))
                links.advance()
            links.finish()
        except BaseException:
            links.drop()  # no request of this step may keep a link open (see _break_links)
            raise
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            # after this rank's last messages are through (see [Note: the all-reduce after the sends])
            t0 = mark()
            average_gradients([p for m in self.modules.values() for p in m.parameters()], self.dp_group)()
            spans.append(("AR", 0, 0, t0, mark()))
        self.spans = spans
        return loss_sum if self.last else None


class _PairLinks:
    """One step's messages of a rank with several chunks: per pair of ranks, issued in the agreed
    order (a receive posted as soon as every earlier message of the pair is issued, a send when its
    data is ready); a hand-off between two chunks of this rank is a copy."""

    def __init__(self, pipe: ChunkedPipeline):
        self.p = pipe
        self.pos = {pair: 0 for pair in pipe.order}
        self.recv: dict[tuple[str, int], dict[tuple[int, int], list]] = {}
        self.ready: dict[tuple[str, int, int, int], list[torch.Tensor]] = {}
        self.sends: list = []

    def _dest(self, kind: str, j: int) -> tuple[int, list[torch.Tensor]]:
        """Who receives a message across boundary j, and into which buffers."""
        p = self.p
        if kind == "act":
            return p.ranks_of[j + 1], p._act.get(j + 1, [])
        return p.ranks_of[j], p._grad.get(j, [])

    def _issue(self, pair: tuple[int, int]) -> None:
        p = self.p
        seq = p.order[pair]
        peer = pair[0] if pair[1] == p.rank else pair[1]
        group = p._group(*pair)
        while self.pos[pair] < len(seq):
            kind, j, lo, hi = seq[self.pos[pair]]
            base = self.pos[pair] * 64
            to, bufs = self._dest(kind, j)
            if to == p.rank:
                works = [
                    dist.irecv(buf[lo:hi], src=p._global[peer], tag=base + i, group=group)
                    for i, buf in enumerate(bufs)
                ]
                self.recv.setdefault((kind, j), {})[(lo, hi)] = works
            else:
                data = self.ready.pop((kind, j, lo, hi), None)
                if data is None:
                    return
                for i, t in enumerate(data):
                    self.sends.append((dist.isend(t, dst=p._global[peer], tag=base + i, group=group), t))
            self.pos[pair] += 1

    def advance(self) -> None:
        for pair in self.pos:
            self._issue(pair)

    def send(self, kind: str, j: int, lo: int, hi: int, ts: list[torch.Tensor]) -> None:
        to, bufs = self._dest(kind, j)
        if to == self.p.rank:  # a hand-off between two chunks of this rank
            # written through .data, as a receive writes: no version bump, so the earlier chunks'
            # inputs (views of the same buffer, kept for their backward) stay usable by autograd
            for buf, t in zip(bufs, ts):
                buf.data[lo:hi].copy_(t)
            return
        self.ready[(kind, j, lo, hi)] = [t.contiguous() for t in ts]
        self._issue(tuple(sorted((self.p.rank, to))))

    def wait(self, kind: str, j: int, lo: int, hi: int) -> None:
        """Wait for the messages into virtual stage ``j``'s samples [lo, hi) (F: activations from
        j - 1; B: gradients from j + 1)."""
        self.advance()
        works = self.recv.get((kind, j - 1 if kind == "act" else j), {})
        for mlo, mhi in list(works):
            if mlo < hi and lo < mhi:
                for w in works.pop((mlo, mhi)):
                    w.wait()

    def drop(self) -> None:
        """Forget every request of this step (a failed step's must not keep its links open)."""
        self.recv.clear()
        self.ready.clear()
        self.sends.clear()

    def finish(self) -> None:
        self.advance()
        for works in self.recv.values():
            for ws in works.values():
                for w in ws:
                    w.wait()
        for work, _ in self.sends:
            work.wait()
