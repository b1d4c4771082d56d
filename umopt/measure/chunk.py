"""One stage under measurement, and the one primitive every measurement runs on it: a chunk's
forward and backward.

:class:`StageProbe` holds a stage's module (the last stage also computes the summed loss), the
tensor entering it and whether it is the first or the last; :meth:`StageProbe.run` makes a chunk
of ``b`` samples (the model's own batch on the first stage, random activations of the right
shape and dtype elsewhere), runs its forward under the profile's autocast and its backward, and
returns both times (CUDA events on GPUs, ``perf_counter`` on CPUs). Timing rounds, the busy loop
of concurrent timing, layer balancing and traces all call it; what differs between them is
which sizes they ask for and what they do with the times. The memory a stage keeps for backward
(:func:`stash_bytes`), what it allocates while it runs, and its optimizer step are measured here
too.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ..devices import boundary_tensors
from ..errors import UmoptError
from ..parts import ModelParts, run_layers
from .memory import peak_during
from .options import ProfileOptions

__all__ = [
    "ProfiledStage",
    "StageProbe",
    "Timer",
    "boundaries",
    "stash_bytes",
    "optimizer_for",
    "optimizer_step_ms",
    "optimizer_work_bytes",
]

Cast = Callable[[], ContextManager]


class ProfiledStage(nn.Module):
    """A contiguous slice of the layers; the last stage also computes the (summed) loss."""

    def __init__(self, layers: Sequence[nn.Module], loss: Optional[Callable] = None):
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.loss = loss

    def forward(
        self, x: torch.Tensor, y: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        out = run_layers(self.body, x, lengths)  # lengths: a packed row's documents
        return self.loss(out, y) if self.loss is not None else out


class Timer:
    """Milliseconds of a call: CUDA events on a GPU (the device's own clock), else ``perf_counter``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out


def boundaries(parts: ModelParts, device: torch.device, dtype: str) -> list[torch.Tensor]:
    """The tensor entering each layer (and the model's output) for a batch of one sample, as the
    layers on ``device`` produce it under the autocast of ``dtype``: their dtypes are what the
    links carry."""
    return boundary_tensors(parts.layers, parts.make_batch(1, 0)[0], device, dtype)


@dataclass
class StageProbe:
    """A stage to measure: its module, the tensor entering it, whether it is the first or last,
    and how it runs (the model's batches, the device, the autocast)."""

    stage: nn.Module
    boundary: torch.Tensor
    first: bool
    last: bool
    parts: ModelParts
    device: torch.device
    cast: Cast

    def inputs(self, b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk of ``b`` samples entering the stage, and the targets (used on the last)."""
        x, y = self.parts.make_batch(b, seed)
        if self.first:
            return x.to(self.device), y.to(self.device)
        shape = (b,) + tuple(self.boundary.shape[1:])
        if self.boundary.is_floating_point():
            act = torch.randn(shape, dtype=self.boundary.dtype, device=self.device).requires_grad_(True)
        else:
            act = torch.zeros(shape, dtype=self.boundary.dtype, device=self.device)
        return act, y.to(self.device)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, lengths: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        with self.cast():
            return self.stage(x, y if self.last else None, lengths)

    def output_grad(self, out: torch.Tensor) -> torch.Tensor:
        """What flows back into the stage: 1 into the last stage's loss, a random gradient elsewhere."""
        return torch.ones_like(out) if self.last else torch.randn_like(out)

    def run(self, b: int, seed: int = 0, timer: Optional[Timer] = None) -> tuple[float, float]:
        """A chunk of ``b`` samples forward and backward; (forward ms, backward ms) with
        ``timer``, else zeros. The gradients are dropped after."""
        x, y = self.inputs(b, seed)
        timer = timer or _untimed
        tf, out = timer(lambda: self.forward(x, y))
        grad = self.output_grad(out)
        tb, _ = timer(lambda: out.backward(grad))
        self.stage.zero_grad(set_to_none=True)
        return tf, tb

    def stash_bytes_per_sample(self, lo: int = 2, hi: int = 6) -> int:
        """What one more sample in a chunk adds to what autograd keeps for backward."""
        (x_lo, y_lo), (x_hi, y_hi) = self.inputs(lo), self.inputs(hi)
        with self.cast():
            grow = stash_bytes(self.stage, x_hi, y_hi if self.last else None) - stash_bytes(
                self.stage, x_lo, y_lo if self.last else None
            )
        return max(0, grow // (hi - lo))

    def _forward_backward(self, x, y) -> None:
        out = self.forward(x, y)
        out.backward(self.output_grad(out))

    def work_bytes(self, lo: int = 2, hi: int = 6) -> tuple[int, int]:
        """(fixed, per sample): what a chunk's forward and backward allocate at their peak beyond
        what the chunk keeps for backward, fitted on two sizes (CUDA's count, or on CPUs torch's
        profiler: :mod:`umopt.measure.memory`). See costmodel's [Note: what an op allocates while
        it runs]."""
        work = []
        x, y = self.inputs(lo)
        out = self.forward(x, y)
        out.backward(self.output_grad(out))  # the gradients allocated, as in a run
        del out
        for b in (lo, hi):
            x, y = self.inputs(b)
            with self.cast():
                kept = stash_bytes(self.stage, x, y if self.last else None)
            _, peak = peak_during(lambda: self._forward_backward(x, y), self.device)
            work.append(peak - kept)
        self.stage.zero_grad(set_to_none=True)
        per = max(0, (work[1] - work[0]) // (hi - lo))
        return max(0, work[0] - lo * per), per

    def trace(self, size: int, path: str) -> None:
        """One chunk's forward and backward under torch's profiler, as a Chrome trace."""
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            self.run(size)
        prof.export_chrome_trace(path)


def _untimed(fn: Callable[[], object]) -> tuple[float, object]:
    return 0.0, fn()


def stash_bytes(
    stage: nn.Module,
    x: torch.Tensor,
    y: Optional[torch.Tensor] = None,
    lengths: Optional[torch.Tensor] = None,
) -> int:
    """Bytes a chunk keeps from its forward to its backward: the distinct non-parameter tensors
    autograd saves, and the chunk's output, which the runtime keeps as its backward's root (and,
    until it is through, a send's tensor: [Note: a send let go] in umopt/run/links.py), each
    storage once."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x, y, lengths) if lengths is not None else stage(x, y)
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(saved.values())


def optimizer_for(name: str, params) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer and how many parameter-sized state tensors it keeps."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9), 1
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3), 2
    raise UmoptError(f"unknown optimizer {name!r} (sgd or adamw)")


def optimizer_work_bytes(stage: nn.Module, opts: ProfileOptions, device: torch.device) -> int:
    """What one optimizer step over the stage's parameters allocates beyond its state (its
    temporaries: CUDA's count, or on CPUs torch's profiler)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return 0
    opt, _ = optimizer_for(opts.optimizer, params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # its state, made at the first step
    _, work = peak_during(opt.step, device)
    stage.zero_grad(set_to_none=True)
    return int(work)


def optimizer_step_ms(stage: nn.Module, opts: ProfileOptions, device: torch.device) -> float:
    """The median time of one optimizer step over the stage's parameters."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return 0.0
    opt, _ = optimizer_for(opts.optimizer, params)
    for p in params:
        p.grad = torch.randn_like(p)
    timer = Timer(device)
    runs = [timer(opt.step)[0] for _ in range(opts.warmup + opts.repeats)]
    stage.zero_grad(set_to_none=True)
    return statistics.median(runs[opts.warmup :])
