"""What ``umopt profile`` is asked to measure, and the checks made before any timing starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..devices import check_trainable
from ..errors import UmoptError
from ..formats.profile import default_sizes

__all__ = ["ProfileOptions", "ProgressFn", "check_profile_options"]

# progress(done, total, what)
ProgressFn = Callable[[float, int, str], None]


@dataclass
class ProfileOptions:
    model: str
    model_args: dict = field(default_factory=dict)
    stages: Optional[int] = None
    split: Optional[list[int]] = None  # cut points, e.g. [0, 7, 17, 27]
    sizes: Optional[list[int]] = None
    max_size: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    warmup: int = 1
    repeats: int = 5  # at least, per entry
    max_repeats: int = 15  # at most, while an entry's spread is wider than spread_target
    spread_target: float = 0.05
    budget_s: float = 20.0  # for the repeats beyond the first ``repeats``, all stages together
    optimizer: str = "sgd"
    link_latency_ms: Optional[float] = None
    link_gbps: Optional[float] = None
    memory_limit_bytes: Optional[int] = None
    trace_dir: Optional[str] = None
    seed: int = 0
    concurrent: Optional[bool] = None  # time all stages at once, one process each (default: on CPU)
    # also time the backward's input and weight gradients apart (W ops: solve --zero-bubble);
    # off by default, as it costs about a quarter more profiling time
    split_backward: bool = False
    dp: int = 1  # data-parallel replicas to measure the gradient all-reduce among (1: not measured)
    # sequences of different lengths: time chunks of sequences up to this many tokens, in
    # length_modes, and fit each stage's costs by tokens (None: not profiled so; measure/tokens.py)
    lengths: Optional[int] = None
    length_modes: Optional[tuple[str, ...]] = None  # default: packed where the model packs, padded

    def command(self, chunks: int = 1, probes: bool = True, probe_minibatch: int = 32) -> list[str]:
        """The ``umopt profile`` command line that measures this (what a profile made by another
        command, ``umopt tune``, records as its ``meta.command``): the options that differ from
        the defaults."""
        argv = ["umopt", "profile", "--model", self.model]
        argv += [a for k, v in self.model_args.items() for a in ("--model-arg", f"{k}={v}")]
        argv += (
            ["--stages", str(self.stages)]
            if self.split is None
            else ["--split", ",".join(map(str, self.split))]
        )
        argv += (
            ["--sizes", ",".join(map(str, self.sizes))] if self.sizes else ["--max-size", str(self.max_size)]
        )
        given = {
            "--device": (self.device, "cpu"),
            "--dtype": (self.dtype, "float32"),
            "--threads": (self.threads, 1),
            "--warmup": (self.warmup, 1),
            "--repeats": (self.repeats, 5),
            "--optimizer": (self.optimizer, "sgd"),
            "--link-latency-ms": (self.link_latency_ms, None),
            "--link-gbps": (self.link_gbps, None),
            "--memory-limit": (self.memory_limit_bytes, None),
            "--seed": (self.seed, 0),
            "--dp": (self.dp, 1),
            "--chunks": (chunks, 1),
            "--lengths": (self.lengths, None),
            "--probe-minibatch": (probe_minibatch, 32),
        }
        argv += [
            a
            for k, (v, default) in given.items()
            if v != default
            for a in (k, f"{v:g}" if isinstance(v, float) else str(v))
        ]
        if self.length_modes:
            argv += ["--length-modes", ",".join(self.length_modes)]
        if self.split_backward:
            argv.append("--split-backward")
        if not probes:
            argv.append("--no-probes")
        return argv


def check_profile_options(opts: ProfileOptions) -> tuple[list[int], torch.device]:
    """The chunk sizes and the device of ``opts``; everything that would fail after the timing is
    refused before it, with one line."""
    sizes = opts.sizes or default_sizes(opts.max_size)
    if sizes[0] != 1:
        raise UmoptError(f"--sizes must start at 1, got {sizes[0]}")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise UmoptError(f"--sizes must be strictly ascending, got {','.join(map(str, sizes))}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UmoptError(
            "--device cuda asked for, but torch sees no CUDA device (is this a CPU build of torch?)"
        )
    if opts.device not in ("cpu", "cuda"):
        raise UmoptError(f"--device must be cpu or cuda, got {opts.device!r}")
    if opts.dtype not in ("float32", "bfloat16", "float16"):
        raise UmoptError(f"--dtype must be float32, bfloat16 or float16, got {opts.dtype!r}")
    check_trainable(opts.dtype)  # a profile the runtime could not train with is no use
    if opts.threads < 1 or opts.repeats < 1 or opts.warmup < 0:
        raise UmoptError("--threads and --repeats must be at least 1, --warmup at least 0")
    if (opts.link_latency_ms is None) != (opts.link_gbps is None):
        raise UmoptError(
            "give both --link-latency-ms and --link-gbps, or neither (then the link is measured)"
        )
    if opts.stages is None and opts.split is None:
        raise UmoptError("give --stages S or --split 0,...,L")
    if opts.stages is not None and opts.stages < 1:
        raise UmoptError(f"--stages must be at least 1, got {opts.stages}")
    # what can only fail after the timing is checked before it
    S = opts.stages if opts.split is None else len(opts.split) - 1
    if opts.device == "cuda":
        gpus = torch.cuda.device_count()
        if S > 1 and opts.link_latency_ms is None and gpus < 2:
            raise UmoptError(
                f"one GPU: the links between {S} stages cannot be measured; give --link-latency-ms and --link-gbps "
                "(NVLink: about 0.01 and 400; PCIe 4: about 0.02 and 200)"
            )
        if opts.concurrent and gpus < S:
            raise UmoptError(
                f"--concurrent on CUDA times each stage on its own GPU: {S} stages, {gpus} GPUs here (use --sequential)"
            )
    return sizes, torch.device(opts.device)
