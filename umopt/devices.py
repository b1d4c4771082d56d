"""Where a stage runs: its device, the autocast it runs under, and the tensors crossing its edges.

The profiler and the runtime share these, so that what one measures is what the other runs: the
same autocast dtype, and message buffers of the dtype that really crosses each link (under
autocast a Linear's output is bfloat16 while a transformer's residual stream, fp32 + bf16, stays
float32).
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Optional, Sequence

import torch
from torch import nn

from .errors import UmoptError

__all__ = [
    "DTYPES",
    "autocast",
    "TensorSpec",
    "boundary_tensors",
    "rank_device",
    "to_device",
    "default_memory_limit",
    "reference_ms",
]

# the profile's dtype names and what autocast runs in (None: no autocast)
DTYPES: dict[str, Optional[torch.dtype]] = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device: torch.device, dtype: str) -> ContextManager:
    """The autocast context a stage's forward runs in (backward runs outside it, as torch advises)."""
    if dtype not in DTYPES:
        raise UmoptError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    fast = DTYPES[dtype]
    if fast is None or device.type not in ("cpu", "cuda"):
        return nullcontext()
    return torch.autocast(device.type, dtype=fast)


@dataclass(frozen=True)
class TensorSpec:
    """One sample's shape and the dtype of a tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape[1:]), t.dtype)

    @property
    def bytes_per_sample(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def empty(self, n: int, device: torch.device) -> torch.Tensor:
        """A buffer for ``n`` samples."""
        return torch.empty((n, *self.shape), dtype=self.dtype, device=device)


def boundary_tensors(
    layers: Sequence[nn.Module], x: torch.Tensor, device: torch.device, dtype: str, *, release_before: int = 0
) -> list[torch.Tensor]:
    """The tensor entering each layer and the last layer's output, for the input batch ``x``
    (one sample is enough), computed on ``device`` under the autocast of ``dtype``, without grad.

    The first ``release_before`` layers are moved to ``device`` for their step only and then to
    the meta device, which frees them: a rank learns what its stage receives without ever holding
    the layers of the stages before it.
    """
    h = x.to(device)
    out = [h]
    with torch.no_grad(), autocast(device, dtype):
        for i, layer in enumerate(layers):
            if i < release_before:
                layer.to(device)
            h = layer(h)
            if i < release_before:
                layer.to("meta")
            out.append(h)
    return out


def rank_device(backend: str) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` under NCCL (torchrun sets LOCAL_RANK), else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU through pinned memory, without blocking the host."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# Headroom for what the memory model does not count: the CUDA context, the allocator's
# fragmentation, NCCL's buffers, workspace of kernels picked per chunk size
DEFAULT_MEMORY_SHARE = 0.9


def default_memory_limit(device: torch.device) -> tuple[int, str]:
    """The memory limit a CUDA profile gets when the user gives none, and a line saying why."""
    props = torch.cuda.get_device_properties(device)
    limit = int(DEFAULT_MEMORY_SHARE * props.total_memory)
    return limit, f"{DEFAULT_MEMORY_SHARE:.0%} of {props.name}'s {props.total_memory / 2**30:.1f} GiB (no --memory-limit given)"


def reference_ms(device: torch.device) -> float:
    """How long a fixed piece of work takes on ``device`` now (a chain of three 256 x 256 float32
    matmuls): the same work whatever the model, so that stages' devices can be compared by it."""
    a = torch.randn(256, 256, device=device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        a @ a @ a @ a
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    a @ a @ a @ a
    return (time.perf_counter() - t0) * 1e3
