"""A rank's op list, played over its virtual stages: one training step, or the forwards only.

``F(lo, hi)`` on virtual stage j runs the forward of samples [lo, hi) and sends its output on,
``B(lo, hi)`` runs their backward (recomputing the forward under ``recompute``) and sends the
input gradients back, ``W(lo, hi)`` the weight gradients of B chunks whose backward was split (a
stage with W ops). Every chunk's backward runs on exactly what its forward saw, so the gradients
are one process's. As torch.distributed.pipelining splits ``PipelineStage`` from the schedule that
plays a rank's actions, :class:`Player` plays and :class:`~umopt.run.stage.Stage` computes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..costmodel import ChunkOp, OpKind
from ..devices import autocast
from ..splitbackward import backward_input
from .links import StepLinks
from .stage import Stage, tensors

__all__ = ["Player", "StepTimer"]

Span = tuple[str, int, int, int, Any, Any]  # (kind, lo, hi, virtual stage, start mark, end mark)
ChunkLossFn = Callable[
    [Any, int, int], torch.Tensor
]  # (last stage's output, lo, hi) -> its share of the loss


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


class Player:
    """Plays one rank's ``ops`` (virtual stage named in each) over ``stages``; ``links()`` makes
    one step's :class:`~umopt.run.links.StepLinks`, ``forward_links()`` those of a forwards-only pass."""

    def __init__(
        self,
        ops: Sequence[ChunkOp],
        stages: dict[int, Stage],
        links: Callable[[], StepLinks],
        forward_links: Callable[[], StepLinks],
        recompute: bool,
        timer: Optional[StepTimer] = None,
    ):
        self.ops, self.stages, self.links, self.forward_links = list(ops), stages, links, forward_links
        self.recompute, self.timer = recompute, timer
        # B computes the input gradient only, W the weights', on a stage with W ops
        self.split = {j: any(op.kind == OpKind.W and op.stage == j for op in self.ops) for j in stages}

    def step(self, xs: tuple[torch.Tensor, ...], chunk_loss: ChunkLossFn) -> tuple[torch.Tensor, list[Span]]:
        """One iteration's ops; gradients accumulate in the modules' parameters. Returns the sum
        of the last stage's chunk losses (zero where this rank does not hold it) and each op's span."""
        # one piece: a step's ops share its saved activations, deferred weight gradients and links;
        # the loop reads in the order the ops run, as simulate plays them
        recompute = self.recompute
        links = self.links()
        saved: dict[tuple[int, int, int], tuple] = {}
        weights_later: dict[tuple[int, int, int], Callable[[], None]] = {}  # B chunks whose W is to come
        device = next(iter(self.stages.values())).device
        loss_sum = torch.zeros((), device=device)
        spans: list[Span] = []
        mark = self.timer.mark if self.timer is not None else (lambda: None)

        def forward(stage: Stage, x, lo: int, hi: int):
            with autocast(stage.device, stage.dtype):
                out = stage.forward(x, lo, hi)
                return chunk_loss(out, lo, hi) if stage.last else out

        try:
            links.start()
            for kind, lo, hi, j in self.ops:
                stage = self.stages[j]
                links.wait(kind, j, lo, hi)
                t0 = mark()
                if kind == OpKind.F:
                    x = stage.inputs(lo, hi, xs, not recompute)
                    with torch.set_grad_enabled(not recompute):
                        out = forward(stage, x, lo, hi)
                    if stage.last:
                        loss_sum += out.detach().float()
                    if not recompute:
                        saved[(j, lo, hi)] = (x, out)
                    if not stage.last:
                        links.send("act", j, lo, hi, stage.outgoing(out, lo, hi))
                elif kind == OpKind.B:
                    if recompute:
                        x = stage.inputs(lo, hi, xs, True)
                        out = forward(stage, x, lo, hi)
                    else:
                        x, out = saved.pop((j, lo, hi))
                    roots, grads = stage.backward_roots(out, lo, hi)
                    if self.split[j]:  # the input gradient now, the weight gradient at this chunk's W
                        weights_later[(j, lo, hi)] = backward_input(x, roots, grads, stage.module)
                    elif roots:
                        torch.autograd.backward(roots, grads)
                    if not stage.first:
                        links.send("grad", j - 1, lo, hi, stage.input_grads(x))
                else:  # W: the weight gradients of the B chunks in [lo, hi)
                    for chunk in sorted(c for c in weights_later if c[0] == j and lo <= c[1] and c[2] <= hi):
                        weights_later.pop(chunk)()
                spans.append((kind, lo, hi, j, t0, mark()))
                links.reap()  # [Note: a send let go]
            links.finish()
        except BaseException:
            links.drop()  # no request of this step may keep a link open (see [Note: a failed step breaks the pipeline])
            raise
        return loss_sum, spans

    def forwards(
        self, xs: tuple[torch.Tensor, ...], chunk_loss: ChunkLossFn, keep: bool
    ) -> tuple[torch.Tensor, dict[int, Any]]:
        """The schedule's forwards only, under ``torch.no_grad()``: the sum of the last stage's
        chunk losses and, with ``keep``, its output of each chunk by first sample."""
        links = self.forward_links()
        device = next(iter(self.stages.values())).device
        loss_sum = torch.zeros((), device=device)
        kept: dict[int, Any] = {}
        try:
            with torch.no_grad():
                links.start()
                for kind, lo, hi, j in self.ops:
                    if kind != OpKind.F:
                        continue
                    stage = self.stages[j]
                    links.wait(kind, j, lo, hi)
                    with autocast(stage.device, stage.dtype):
                        out = stage.forward(stage.inputs(lo, hi, xs, False), lo, hi)
                        if stage.last:
                            loss_sum += chunk_loss(out, lo, hi).float()
                    if stage.last and keep:
                        kept[lo] = out
                    if not stage.last:
                        links.send("act", j, lo, hi, stage.outgoing(out, lo, hi))
                links.finish()
        except BaseException:
            links.drop()
            raise
        return loss_sum, kept


def joined_output(kept: dict[int, Any]) -> Any:
    """The last stage's outputs of every chunk, in sample order, as one output of the minibatch."""
    parts = [kept[lo] for lo in sorted(kept)]
    first = tensors(parts[0], "the last stage's output")
    output = tuple(
        torch.cat([tensors(p, "the last stage's output")[i] for p in parts]) for i in range(len(first))
    )
    return output[0] if len(output) == 1 else output
