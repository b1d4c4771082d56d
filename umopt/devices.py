"""Where a stage runs: its device (on a CPU, the cores its replica keeps to), the autocast it
runs under, and the tensors crossing its edges.

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
    "replica_cores",
    "DTYPES",
    "autocast",
    "TensorSpec",
    "boundary_tensors",
    "rank_device",
    "to_device",
    "default_memory_limit",
    "reference_ms",
    "check_trainable",
    "numerics",
    "numerics_differences",
]

# the profile's dtype names and what autocast runs in (None: no autocast)
DTYPES: dict[str, Optional[torch.dtype]] = {
    "float32": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def check_trainable(dtype: str) -> None:
    """Refuse float16 for training: without loss scaling its small gradients flush to zero."""
    if dtype == "float16":
        raise UmoptError(
            "float16 training needs loss scaling (torch.amp.GradScaler), which umopt's runtime does not do: "
            "use bfloat16 (--dtype bfloat16: as fast on GPUs since Ampere, and no scaler needed)"
        )


def numerics() -> dict[str, object]:
    """The settings that choose which kernels float32 matmuls and convolutions run, and so how long
    they take: TF32 for matmuls and for cuDNN, the matmul precision, cuDNN's autotuning. A
    profile records them; a run warns where its own differ (:func:`numerics_differences`).

    torch 2.9+ has a second way to set TF32 (``torch.backends.cuda.matmul.fp32_precision``,
    ``torch.backends.cudnn.conv.fp32_precision``, ``torch.backends.fp32_precision``); once it is
    used, reading the old one raises, so where it is set the values come from it."""
    cudnn = torch.backends.cudnn
    matmul, conv = _fp32_precision("cuda.matmul"), _fp32_precision("cudnn.conv")
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # "a mix of the legacy and new APIs": the new one says
        precision = "high" if matmul == "tf32" else "highest"
    return {
        "float32_matmul_precision": precision,
        "matmul_tf32": _legacy(lambda: torch.backends.cuda.matmul.allow_tf32, matmul),
        "cudnn_tf32": _legacy(lambda: cudnn.allow_tf32, conv),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_deterministic": bool(cudnn.deterministic),
    }


def _fp32_precision(where: str) -> Optional[str]:
    """The new API's precision for ``where`` ("cuda.matmul", "cudnn.conv"), inherited from its
    parents where it says "none"; None where this torch has no new API."""
    node = torch.backends
    chain = [getattr(node, "fp32_precision", None)]
    for part in where.split("."):
        node = getattr(node, part, None)
        chain.append(getattr(node, "fp32_precision", None) if node is not None else None)
    if chain[-1] is None:
        return None
    return next((p for p in reversed(chain) if p not in (None, "none")), "none")


def _legacy(read, new: Optional[str]) -> bool:
    """The old API's TF32 flag, or what the new API says where the old one cannot be read."""
    try:
        return bool(read())
    except RuntimeError:
        return new == "tf32"


def numerics_differences(profiled: Optional[dict], now: dict) -> list[str]:
    """Each setting of :func:`numerics` that differs between a profile and this process, as
    ``name: profiled X, now Y`` (none where the profile recorded none)."""
    if not profiled:
        return []
    return [
        f"{k}: profiled {profiled[k]}, now {now[k]}" for k in now if k in profiled and profiled[k] != now[k]
    ]


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
    the layers of the stages before it. What they share with the layers kept (a tied embedding, a
    rotary embedding every decoder layer holds) is kept.
    """
    # what each layer from i on holds: a layer's step frees only what no later layer shares (the
    # layers before the kept ones may share a module among themselves, a rotary embedding)
    later: list[set[int]] = [set() for _ in range(len(layers) + 1)]
    for i in range(len(layers) - 1, -1, -1):
        later[i] = later[i + 1] | {id(t) for t in (*layers[i].parameters(), *layers[i].buffers())}
    h = x.to(device)
    out = [h]
    with torch.no_grad(), autocast(device, dtype):
        for i, layer in enumerate(layers):
            if i < release_before:
                layer.to(device)
            h = layer(h)
            if i < release_before:
                _release(layer, later[i + 1])
            out.append(h)
    return out


def _release(layer: nn.Module, kept: set[int]) -> None:
    """``layer``'s tensors on the meta device (freed), but for those in ``kept`` (by id)."""
    for m in layer.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) not in kept:
                m._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and id(b) not in kept:
                m._buffers[name] = b.to("meta")


def replica_cores(replica: int, dp: int, world: int) -> Optional[set[int]]:
    """The cores a CPU rank of ``replica`` keeps to where the ranks outnumber this machine's
    cores (None: no pinning). [Note: a replica's cores] With D replicas on fewer cores than
    ranks, the OS hands a replica that is done its cores for the others: the slowest replica then
    runs on more than its share, which hides what makes it slow (measured on 2 cores, 2 replicas
    x 2 stages: 0.996x and 1.014x against 1.09x and 1.08x predicted; docs/varlen.md). Each
    replica kept to cores of its own is a machine of its own, as on a cluster; its stages take
    turns on them, alike for every schedule a run measures."""
    if dp < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if world <= len(cores):
        return None
    if dp >= len(cores):
        return {cores[replica % len(cores)]}
    per = len(cores) // dp
    return set(cores[replica * per : (replica + 1) * per])


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
    return (
        limit,
        f"{DEFAULT_MEMORY_SHARE:.0%} of {props.name}'s {props.total_memory / 2**30:.1f} GiB (no --memory-limit given)",
    )


# the reference work: on a CPU three 256 x 256 float32 matmuls (about a millisecond); on a GPU
# three 4096 x 4096 bfloat16 ones (0.4 TFLOP, a few ms on any data-center GPU), so that launch
# gaps, which a small matmul on a GPU would measure instead, are a small part of it
_REFERENCE_N = {"cpu": 256, "cuda": 4096}


def reference_ms(device: torch.device) -> float:
    """How long a fixed piece of work takes on ``device`` now (a chain of three matmuls): the same
    work whatever the model, so that stages' devices can be compared by it. On a GPU it runs
    once untimed first (lazy module loading, cuBLAS's workspace) and is timed with CUDA events."""
    n = _REFERENCE_N.get(device.type, 256)
    if device.type == "cuda":
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        a @ a @ a @ a  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        a @ a @ a @ a
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    a = torch.randn(n, n, device=device)
    t0 = time.perf_counter()
    a @ a @ a @ a
    return (time.perf_counter() - t0) * 1e3
