"""One virtual stage on this rank: its module, what crosses its edges, and its receive buffers.

A pipeline with one chunk per rank has one virtual stage per rank (stage s is virtual stage s);
with several chunks per rank, each chunk module is one. What crosses a boundary is a tensor or a
tuple of tensors, each split on dim 0 by sample; a stage receives into one buffer per tensor for
the whole minibatch and reads its chunks as views of it (its neighbours may chunk otherwise).
:meth:`Stage.recv_buffers` is the one place that says what a message is received into: every
message's shape comes from there. With sequences of different lengths the rows are tokens, not
samples (see [Note: token rows] in umopt/run/tokens.py).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..devices import TensorSpec, autocast
from ..errors import UmoptError
from ..parts import takes_lengths
from .tokens import TokenRows

__all__ = ["Stage", "tensors", "grad_carrying", "batch_statistics_layers", "warn_batch_norm"]


def tensors(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    """``x`` as a tuple of tensors: a tensor, or a tuple or list of tensors, as what crosses a
    boundary in torch.distributed.pipelining; anything else is refused with one line."""
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    inner = (
        next((t for t in x if not isinstance(t, torch.Tensor)), None) if isinstance(x, (tuple, list)) else x
    )
    kind = (
        "a numpy array (make it a tensor: torch.from_numpy)"
        if type(inner).__module__ == "numpy"
        else f"a {type(inner).__name__}"
    )
    raise UmoptError(
        f"{what} is {kind}: umopt.Pipeline takes a tensor or a tuple of tensors there (dicts are not supported: use a tuple)"
    )


def grad_carrying(spec: TensorSpec) -> bool:
    return spec.dtype.is_floating_point or spec.dtype.is_complex


def check_samples(ts: Sequence[torch.Tensor], n: int, what: str) -> None:
    """Every tensor of a boundary has the chunk's ``n`` samples along dim 0 (see [Note: what
    crosses a boundary])."""
    for i, t in enumerate(ts):
        if t.dim() == 0 or t.shape[0] != n:
            raise UmoptError(
                f"{what} {i} has shape {tuple(t.shape)} for a chunk of {n} samples: what crosses a boundary is "
                "split on dim 0 by sample, so its first dimension must be the chunk's samples (a scalar or "
                "per-batch tensor cannot be chunked: compute it in the next stage, or give it a sample dimension)"
            )


# [Note: what crosses a boundary]
# A boundary tensor is cut by sample along dim 0: a chunk of samples [lo, hi) sends rows lo..hi-1
# and the receiver writes them into rows lo..hi-1 of its buffer for the whole minibatch. A tensor
# whose first dimension is not the chunk's samples (a 0-d loss term, a shape-(1,) flag, a
# per-batch statistic) has no such rows: received so, the buffer's other rows would stay
# uninitialised memory and be read as data. So its shape is checked where it is learnt (a forward
# of two samples: a per-batch tensor gives 1 row, not 2) and every time a chunk sends it, and it
# is refused in one line; docs/pipeline.md says what to do instead.


def check_spec(t: torch.Tensor, spec: TensorSpec, what: str) -> None:
    """A boundary tensor against the shape and dtype agreed at the first step (see [Note: fixed boundary shapes])."""
    if tuple(t.shape[1:]) != spec.shape or t.dtype != spec.dtype:
        raise UmoptError(
            f"{what} is {tuple(t.shape[1:])} {t.dtype} per sample, but was {spec.shape} {spec.dtype} at the first step: "
            "boundary shapes are fixed (pad every minibatch to one length, e.g. the longest sequence)"
        )


# [Note: fixed boundary shapes]
# Receive buffers are allocated once, for the whole minibatch, from the per-sample shapes agreed at
# the first step, and never exchanged again (a step would otherwise pay a round trip per link).
# A boundary whose shape changes between steps (dynamic padding) is caught where it is sent, with
# the shapes and the fix, instead of as a transport's "received data size doesn't match".

BATCH_STATISTICS = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones


def batch_statistics_layers(module: nn.Module) -> list[str]:
    """The layers of ``module`` whose output in training depends on the other samples of the
    batch (BatchNorm): chunked, they see a chunk's statistics, not the minibatch's."""
    return [
        name or module.__class__.__name__
        for name, m in module.named_modules()
        if isinstance(m, BATCH_STATISTICS)
    ]


def warn_batch_norm(module: nn.Module, where: str, strict: bool) -> None:
    """BatchNorm in training normalizes each chunk by its own statistics: say so (``strict``: refuse)."""
    batch_norms = batch_statistics_layers(module)
    if not batch_norms:
        return
    line = (
        f"{where} has BatchNorm layers ({', '.join(batch_norms[:3])}{', ...' if len(batch_norms) > 3 else ''}): in training "
        "they normalize each chunk by its own statistics, so gradients will not equal one process's on the whole minibatch; "
        "GroupNorm or LayerNorm chunk exactly"
    )
    if strict:
        raise UmoptError(line)
    logging.getLogger("umopt").warning(line)


# [Note: one pool of token rows]
# With sequences of different lengths a step's receive buffers are as long as its minibatch's
# token rows, which change every step. Each virtual stage keeps one pool and plays each step in
# a view of it; a longer minibatch grows the pool to 1.25 times what it held (or to the
# minibatch, if more), so that a run's first steps, each a little longer than the last, do not
# each allocate anew (with shapes changing every step a caching allocator's reserved memory runs
# ahead of what is allocated: on CUDA, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the
# reserved segments grow in place instead, docs/pipeline.md). Every Pipeline over the same module
# (the methods of a run in turns, selection's candidates) shares its pool: they play one at a
# time. What a rank holds is then the pool, not the step's view of it: the run's memory
# prediction counts the pool's slack beside the plan's own (run/rank.py).
GROWTH = 1.25


class Pool:
    """One virtual stage's receive buffers of token rows (see [Note: one pool of token rows])."""

    def __init__(self) -> None:
        self.rows = 0
        self.specs: tuple = ()
        self.act: list[torch.Tensor] = []
        self.grad: list[torch.Tensor] = []

    def hold(
        self, rows: int, act: Sequence[TensorSpec], grad: Sequence[TensorSpec], device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of ``rows`` rows of a buffer per spec, grown where it holds fewer."""
        specs = (tuple(act), tuple(grad))
        if rows > self.rows or specs != self.specs:
            n = max(rows, math.ceil(GROWTH * self.rows)) if specs == self.specs else rows
            self.act, self.grad = [], []  # the old pool let go before the new one is made
            self.act = [spec.empty(n, device) for spec in act]
            self.grad = [spec.empty(n, device) for spec in grad]
            self.rows, self.specs = n, specs
        return [b[:rows] for b in self.act], [b[:rows] for b in self.grad]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.act, *self.grad))


_POOLS: "weakref.WeakKeyDictionary[nn.Module, dict[int, Pool]]" = weakref.WeakKeyDictionary()


class Stage:
    """Virtual stage ``index`` of ``count``, on this rank.

    ``specs_in`` / ``specs_out`` are the per-sample shapes and dtypes of what it receives and
    sends (given, or agreed at the first step); ``act`` holds one buffer per received tensor
    and ``grad`` one per sent tensor that carries a gradient back, each for the whole minibatch.
    """

    def __init__(
        self,
        index: int,
        count: int,
        module: nn.Module,
        device: torch.device,
        dtype: str,
        specs_in: Optional[Sequence[TensorSpec]] = None,
        specs_out: Optional[Sequence[TensorSpec]] = None,
        label: str = "virtual stage",
    ):
        self.index, self.count, self.module, self.label = index, count, module, label
        self.device, self.dtype = device, dtype
        self.first, self.last = index == 0, index == count - 1
        self.specs_in: Optional[list[TensorSpec]] = list(specs_in) if specs_in is not None else None
        self.specs_out: Optional[list[TensorSpec]] = list(specs_out) if specs_out is not None else None
        self.act: list[torch.Tensor] = []
        self.grad: list[torch.Tensor] = []
        # sequences of different lengths: this step's samples as rows of tokens (None: one
        # row per sample, every sample one shape; see [Note: token rows] in tokens.py)
        self.tokens: Optional[TokenRows] = None
        self.takes_lengths = takes_lengths(module)  # a padded chunk's lengths go to it too
        # the ways of laying out chunks (mode, rows) its module was checked for
        self.modes_checked: set[tuple[str, bool]] = set()
        self.pool = _POOLS.setdefault(module, {}).setdefault(index, Pool())  # [Note: one pool of token rows]

    @property
    def name(self) -> str:
        return f"{self.label} {self.index}"

    def rows(self, lo: int, hi: int) -> slice:
        """The rows of a boundary tensor that samples [lo, hi) are."""
        return slice(lo, hi) if self.tokens is None else self.tokens.rows(lo, hi)

    def forward(self, x: tuple[torch.Tensor, ...], lo: int = 0, hi: int = 0) -> Any:
        """The module on chunk [lo, hi)'s boundary tensors (a tuple is passed as ``module(*x)``);
        with token rows, laid out for the module and its output back to rows."""
        if self.tokens is None:
            return self.module(*x) if len(x) > 1 else self.module(x[0])
        args, kw = self.tokens.to_module(x, lo, hi, self.takes_lengths)
        out = self.tokens.from_module(
            tensors(self.module(*args, **kw), f"{self.name}'s output"), lo, hi, f"{self.name}'s output"
        )
        return out[0] if len(out) == 1 else out

    def sample_forward(self, sample: tuple[torch.Tensor, ...]) -> Any:
        """One forward of ``sample``, leaving the module as it was: in eval mode (a small batch
        through BatchNorm in training would fail, or move its running statistics), its buffers
        put back after."""
        buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), autocast(self.device, self.dtype):
                return self.forward(sample, 0, 1)
        finally:
            self.module.train(training)
            with torch.no_grad():
                for name, b in self.module.named_buffers():
                    b.copy_(buffers[name])

    def learn_output(self, sample: tuple[torch.Tensor, ...]) -> list[TensorSpec]:
        """What this stage sends per sample, from one forward of ``sample`` (two samples where
        the minibatch has them: see [Note: what crosses a boundary])."""
        ts = tensors(self.sample_forward(sample), f"{self.name}'s output")
        check_samples(ts, sample[0].shape[0], f"{self.name}'s output")
        return [TensorSpec.of(t) for t in ts]

    def sample_inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """``n`` samples (with token rows: rows) of zeros shaped as this stage's inputs."""
        assert self.specs_in is not None
        return tuple(spec.empty(n, self.device).zero_() for spec in self.specs_in)

    def allocate(self, minibatch: int) -> None:
        """The receive buffers for a minibatch (with token rows: for its rows, views of the
        stage's pool: [Note: one pool of token rows]), from the agreed shapes."""
        assert self.specs_in is not None and (self.last or self.specs_out is not None)
        want_act = list(self.specs_in) if not self.first else []
        want_grad = [spec for spec in self.specs_out if grad_carrying(spec)] if not self.last else []
        if self.tokens is None:
            self.act = [spec.empty(minibatch, self.device) for spec in want_act]
            self.grad = [spec.empty(minibatch, self.device) for spec in want_grad]
            return
        self.act, self.grad = self.pool.hold(minibatch, want_act, want_grad, self.device)

    @property
    def slack_bytes(self) -> int:
        """What its pool holds beyond this step's buffers (0 without token rows)."""
        if self.tokens is None:
            return 0
        return self.pool.nbytes - sum(b.numel() * b.element_size() for b in (*self.act, *self.grad))

    def share(self, other: "Stage") -> None:
        """Use ``other``'s buffers where the shapes agree: pipelines of one stage whose steps never
        overlap (selection's candidates) need one set."""
        if (self.specs_in, self.specs_out) == (other.specs_in, other.specs_out) and len(self.act) == len(
            other.act
        ):
            self.act, self.grad = other.act, other.grad

    def recv_buffers(self, kind: str, lo: int, hi: int) -> list[torch.Tensor]:
        """What a message into this stage is received into: "act" from the stage before, "grad"
        (the gradients of this stage's outputs) from the stage after."""
        rows = self.rows(lo, hi)
        return [buf[rows] for buf in (self.act if kind == "act" else self.grad)]

    def inputs(self, lo: int, hi: int, xs: tuple[torch.Tensor, ...], grad: bool) -> tuple[torch.Tensor, ...]:
        """The chunk's inputs: the minibatch's on virtual stage 0, else views of the buffers as
        leaves of a graph of their own (``grad``: those that carry a gradient require one)."""
        rows = self.rows(lo, hi)
        if self.first:
            return tuple(t[rows] for t in xs)
        assert self.specs_in is not None
        return tuple(
            buf[rows].detach().requires_grad_(grad and grad_carrying(spec))
            for buf, spec in zip(self.act, self.specs_in)
        )

    def outgoing(self, out: Any, lo: int, hi: int) -> list[torch.Tensor]:
        """What this stage sends on for chunk [lo, hi): its output's tensors, detached, checked
        against the agreed shapes and the chunk's samples."""
        ts = tensors(out, f"{self.name}'s output")
        assert self.specs_out is not None
        if len(ts) != len(self.specs_out):
            raise UmoptError(
                f"{self.name}'s output has {len(ts)} tensors, but had {len(self.specs_out)} at the first step"
            )
        check_samples(
            ts, hi - lo if self.tokens is None else self.tokens.count(lo, hi), f"{self.name}'s output"
        )
        for i, (t, spec) in enumerate(zip(ts, self.specs_out)):
            check_spec(t, spec, f"{self.name}'s output {i}")
        return [t.detach() for t in ts]

    def backward_roots(
        self, out: Any, lo: int, hi: int
    ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """The tensors a B op differentiates and their output gradients (received from the stage
        after); on the last stage, the chunk's loss alone."""
        if self.last:
            return [out], None
        assert self.specs_out is not None
        outs = [
            t for t, spec in zip(tensors(out, f"{self.name}'s output"), self.specs_out) if grad_carrying(spec)
        ]
        rows = self.rows(lo, hi)
        pairs = [(o, g[rows]) for o, g in zip(outs, self.grad) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def input_grads(self, x: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """What a B op sends back: the gradient of each input that carries one (zeros where the
        module did not use it)."""
        assert self.specs_in is not None
        return [
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t, spec in zip(x, self.specs_in)
            if grad_carrying(spec)
        ]
