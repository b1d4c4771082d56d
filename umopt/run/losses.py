"""How the losses of a minibatch's chunks add up to the loss of the whole minibatch.

A pipeline computes the loss chunk by chunk, and one process computes it on the whole minibatch;
for the gradients to be equal, the chunks' losses must add up to that one loss exactly. A loss
that is a plain mean over samples (or over elements, every sample having as many) adds up when
each chunk's mean counts by its share of the samples. A loss whose mean is over something else
does not: ``CrossEntropyLoss(ignore_index=...)`` divides by the targets that are not ignored
(padding and prompt tokens in every language-model fine-tune), ``weight=`` by the sum of the
targets' class weights, and a chunk whose targets are all ignored has a mean of 0 / 0. So for
those the chunk's loss is its *sum*, divided by the normalizer of the whole minibatch (the count
of valid targets, or the sum of their weights), which the last stage knows before its first
forward because it holds all of the minibatch's targets: Megatron's per-token loss, made exact.

:func:`chunk_loss` reads a torch loss module's own settings (``reduction``, ``ignore_index``,
``weight``), so ``loss_fn=nn.CrossEntropyLoss(ignore_index=-100)`` is right as it is; for other
losses, ``normalizer(targets)`` says what the mean is over (and ``loss_fn`` then returns a sum).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import UmoptError

__all__ = ["ChunkLoss", "chunk_loss", "valid_targets"]

Number = Union[float, torch.Tensor]


@dataclass(frozen=True)
class ChunkLoss:
    """``fn(output, targets)`` of one chunk, and how it counts towards the minibatch's loss:
    ``"share"`` (a mean over the chunk's samples, times the chunk's share of the minibatch),
    ``"sum"`` (as it is) or ``"normalized"`` (a sum, divided by ``normalizer(all targets)``)."""

    fn: Callable[[Any, Any], torch.Tensor]
    rule: str
    normalizer: Optional[Callable[[Any], Number]] = None

    def scale(self, targets: Any, minibatch: int) -> Callable[[int, int], Number]:
        """What the loss of samples ``[lo, hi)`` is multiplied by, for the minibatch ``targets``."""
        if self.rule == "share":
            return lambda lo, hi: (hi - lo) / minibatch
        if self.rule == "sum":
            return lambda lo, hi: 1.0
        total = self.normalizer(targets)
        return lambda lo, hi: 1.0 / total


def valid_targets(
    ignore_index: int = -100, weight: Optional[torch.Tensor] = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The normalizer of torch's ``cross_entropy`` / ``nll_loss`` with ``reduction="mean"``: the
    number of targets that are not ``ignore_index`` (with ``weight``: the sum of their classes'
    weights); class-probability targets (floating point, ``(N, C, ...)``) count every position."""

    def normalizer(targets: torch.Tensor) -> torch.Tensor:
        y = targets[0] if isinstance(targets, (tuple, list)) else targets
        if y.is_floating_point():  # class probabilities: the mean is over N x d1 x ...
            return torch.tensor(float(y.numel() // y.shape[1]) if y.dim() > 1 else 1.0, device=y.device)
        valid = y != ignore_index
        if weight is None:
            return valid.sum().to(torch.float32)
        w = weight.to(y.device)[y.masked_fill(~valid, 0)]
        return (w * valid).sum().to(torch.float32)

    return normalizer


def chunk_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    reduction: Optional[str] = None,
    normalizer: Optional[Callable[[Any], Number]] = None,
) -> ChunkLoss:
    """How ``loss_fn``'s chunks add up (see the module's docstring).

    A torch loss module (it has ``reduction``) says itself whether it is a mean or a sum:
    ``CrossEntropyLoss`` and ``NLLLoss`` means become sums over the minibatch's valid targets
    (:func:`valid_targets` with their ``ignore_index`` and ``weight``), other means count by
    share (every sample has as many elements). A plain function is a mean over samples unless
    ``reduction="sum"``. With ``normalizer``, the loss is a sum (a module's mean is made one)
    divided by ``normalizer(all the minibatch's targets)``.
    """
    own = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    if own is not None:
        if own not in ("mean", "sum"):
            raise UmoptError(
                f"loss_fn {loss_fn.__class__.__name__} has reduction={own!r}: umopt needs a scalar loss, 'mean' or 'sum'"
            )
        if reduction is not None and reduction != own:
            raise UmoptError(
                f"loss_reduction={reduction!r} but loss_fn {loss_fn.__class__.__name__} has reduction={own!r}: leave loss_reduction out for a loss module"
            )
        if own == "mean" and (
            normalizer is not None or isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss))
        ):
            summed = copy.copy(loss_fn)  # the module's own settings, summed; the user's module stays as it is
            summed.reduction = "sum"
            if normalizer is None:
                normalizer = valid_targets(loss_fn.ignore_index, loss_fn.weight)
            return ChunkLoss(summed, "normalized", normalizer)
        reduction = own
    reduction = reduction or "mean"
    if reduction not in ("mean", "sum"):
        raise UmoptError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")
    if normalizer is not None:
        if reduction != "sum":
            raise UmoptError(
                "a loss normalizer divides a summed loss: give loss_reduction='sum' with a loss_fn that returns a sum"
            )
        return ChunkLoss(loss_fn, "normalized", normalizer)
    return ChunkLoss(loss_fn, "share" if reduction == "mean" else "sum")
