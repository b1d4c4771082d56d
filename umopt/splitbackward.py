"""The backward of a chunk split in two: the input gradient now, the weight gradient later.

Zero-bubble schedules (W ops) run a chunk's B as the input gradient only, which the stage before
waits for, and its W, the weight gradient, later, where the stage would idle. The runtime and
the profiler split it the same way, so what the profile times is what a run does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["backward_input"]


def backward_input(
    x: tuple[torch.Tensor, ...],
    roots: list[torch.Tensor],
    grads: Optional[list[torch.Tensor]],
    module: torch.nn.Module,
) -> Callable[[], None]:
    """The B op of a stage with W ops: the gradients of the inputs ``x`` now (left in their
    ``.grad``, to be sent), keeping what the weight gradients need; returns the W part.

    torch.distributed.pipelining's split (``stage_backward_input`` / ``stage_backward_weight``):
    the input gradient's backward records, through hooks, the output gradients of the nodes where
    the weights' paths join it, and the W part resumes from there, so nothing runs twice. Where
    no input carries a gradient (the first stage), the input gradient is empty and the whole
    backward is the W part."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    inputs = [t for t in x if t.requires_grad]
    if not roots:
        return lambda: None
    if not inputs:
        return lambda: torch.autograd.backward(roots, grads)
    if grads is not None:
        roots, grads = map(list, zip(*(_own_tensor(r, g) for r, g in zip(roots, grads))))
    _, groups = stage_backward_input(roots, grads, inputs, module.parameters())
    return lambda: stage_backward_weight(module.parameters(), groups)


def _own_tensor(root: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``root`` and its gradient as a tensor that is not a view: torch's input-gradient backward
    frees each output's graph in place (``detach_``), which a view refuses (a packed chunk's
    rows are its module's output without the batch dimension; a module may return a slice).
    A view of all of its base, in the same order, is its base (no copy); another is copied."""
    if not root._is_view():
        return root, grad
    base = root._base
    if (
        base.numel() == root.numel()
        and root.is_contiguous()
        and base.is_contiguous()
        and root.storage_offset() == base.storage_offset()
    ):
        return base, grad.reshape(base.shape)
    return root.clone(), grad
