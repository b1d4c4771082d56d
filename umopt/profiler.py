"""``umopt profile`` as a library call: measure what each pipeline stage costs, with torch.

For every stage and every chunk size: forward and backward milliseconds of one chunk (after
warm-up, the median of repeats; CUDA events on GPUs, ``perf_counter`` on CPUs), the bytes autograd
saves for backward (counted with ``saved_tensors_hooks``), the bytes a stage receives and sends,
its static memory (parameters, gradients, optimizer state) and one optimizer step. Links are
measured by a ping-pong between two torch.distributed processes, or given by the user.

Stages are contiguous layer ranges: given as cut points, or balanced by measured per-layer time
(dynamic programming that minimises the slowest stage).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .devices import (
    TensorSpec,
    autocast,
    boundary_tensors,
    check_trainable,
    default_memory_limit,
    numerics,
    reference_ms,
)
from .errors import UmoptError, first_line
from .formats.profile import PROFILE_FORMAT, ProbesMeta, Profile, default_sizes
from .noise import (
    Summary,
    drift_figure,
    drift_warning,
    load_warning,
    monotone_fit,
    noise_figure,
    noisy_warning,
    round_speeds,
    summarize,
    uneven_devices_warning,
)
from .splitbackward import backward_input
from .zoo import ModelParts, build_model

__all__ = [
    "ProfileOptions",
    "profile_stages",
    "check_profile_options",
    "balanced_split",
    "profile_for_chunks",
    "stash_bytes",
    "measure_link",
    "measure_allreduce",
    "pingpong_sizes",
    "measure_links",
    "link_plan",
    "profile_model",
    "default_sizes",
]

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


# --- stage splitting ---------------------------------------------------------------------------


def balanced_split(layer_ms: Sequence[float], num_stages: int) -> list[int]:
    """Cut points ``[0, c1, ..., L]`` of contiguous stages minimising the slowest stage's time."""
    L = len(layer_ms)
    if num_stages > L:
        raise UmoptError(f"{num_stages} stages asked for a model of {L} layers")
    prefix = np.concatenate(([0.0], np.cumsum(layer_ms)))
    # best[k][j]: slowest stage when the first j layers form k stages; arg keeps the last cut
    best = np.full((num_stages + 1, L + 1), np.inf)
    arg = np.zeros((num_stages + 1, L + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, L + 1):
            i = np.arange(k - 1, j)
            cost = np.maximum(best[k - 1, i], prefix[j] - prefix[i])
            m = int(np.argmin(cost))
            best[k, j], arg[k, j] = cost[m], i[m]
    cuts = [L]
    for k in range(num_stages, 0, -1):
        cuts.append(int(arg[k, cuts[-1]]))
    return cuts[::-1]


# --- measuring one stage -----------------------------------------------------------------------


class _Stage(nn.Module):
    """A contiguous slice of the layers; the last stage also computes the (summed) loss."""

    def __init__(self, layers: Sequence[nn.Module], loss: Optional[Callable] = None):
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.body(x)
        return self.loss(out, y) if self.loss is not None else out


def stash_bytes(stage: nn.Module, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves during one forward."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x, y)
    return sum(saved.values())


class _Timer:
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


def _boundaries(parts: ModelParts, device: torch.device, dtype: str) -> list[torch.Tensor]:
    """The tensor entering each layer (and the model's output) for a batch of one sample, as the
    layers on ``device`` produce it under the autocast of ``dtype``: their dtypes are what the
    links carry."""
    return boundary_tensors(parts.layers, parts.make_batch(1, 0)[0], device, dtype)


def _input(parts: ModelParts, boundary: torch.Tensor, first: bool, b: int, device: torch.device, seed: int):
    x, y = parts.make_batch(b, seed)
    if first:
        return x.to(device), y.to(device)
    shape = (b,) + tuple(boundary.shape[1:])
    if boundary.is_floating_point():
        act = torch.randn(shape, dtype=boundary.dtype, device=device).requires_grad_(True)
    else:
        act = torch.zeros(shape, dtype=boundary.dtype, device=device)
    return act, y.to(device)


@dataclass
class _StageTimes:
    """What timing one stage found: per size, the forward, the backward and (with the split) its
    input- and weight-gradient parts; how much the machine drifted; a fixed matmul's time on
    the stage's device, to compare devices by."""

    forward: list[Summary]
    backward: list[Summary]
    backward_input: list[Summary]
    backward_weight: list[Summary]
    drift: float
    reference_ms: float


@dataclass
class _Timed:
    """A stage to time: its module, the tensor entering it, whether it is the first or last."""

    stage: nn.Module
    boundary: torch.Tensor
    first: bool
    last: bool


def _time_stages(
    timed: list[_Timed], parts, sizes, device, opts, cast, progress, label, budget_s: float
) -> list[_StageTimes]:
    """Each stage's forward and backward times at each size, and with ``opts.split_backward`` the
    backward's input and weight gradients split as W ops run them (:mod:`umopt.splitbackward`,
    after a forward of their own): the median and spread of the repeats, with more repeats (up
    to ``opts.max_repeats``, within ``budget_s``) while a spread is wider than
    ``opts.spread_target``. Several stages given are timed in one another's rounds (stages
    sharing one device)."""
    timer = _Timer(device)
    reference = []
    deadline = time.perf_counter() + budget_s
    # first calls allocate and pick kernels; keep that out of every size's numbers
    for t in timed:
        for b in (sizes[-1], sizes[0]):
            x, y = _input(parts, t.boundary, t.first, b, device, 0)
            with cast():
                out = t.stage(x, y if t.last else None)
            out.backward(torch.ones_like(out) if t.last else torch.randn_like(out))
            t.stage.zero_grad(set_to_none=True)

    def repeat(unit: tuple[int, int], rep: int, split: bool) -> tuple[float, ...]:
        t, b = timed[unit[0]], unit[1]
        stage, last = t.stage, t.last
        x, y = _input(parts, t.boundary, t.first, b, device, rep)
        with cast():
            tf, out = timer(lambda: stage(x, y if last else None))
        grad = torch.ones_like(out) if last else torch.randn_like(out)
        tb, _ = timer(lambda: out.backward(grad))
        stage.zero_grad(set_to_none=True)
        if not split:
            return tf, tb
        x, y = _input(parts, t.boundary, t.first, b, device, rep)
        with cast():
            out = stage(x, y if last else None)
        tbi, weights = timer(lambda: backward_input((x,), [out], None if last else [grad], stage))
        tbw, _ = timer(weights)
        stage.zero_grad(set_to_none=True)
        return tf, tb, tbi, tbw

    # sizes (and stages sharing the device) are timed in rounds, one repeat of each per round,
    # rather than one after another: a machine whose speed drifts over seconds
    # then slows every entry alike instead of bending a curve where one size happened to be
    # timed, or tilting the balance toward the stage timed in a slow moment. The order
    # alternates so that no size always follows the largest.
    units = [(j, b) for j in range(len(timed)) for b in sizes]
    runs: dict[tuple[int, int], dict[int, tuple[float, ...]]] = {
        u: {} for u in units
    }  # unit -> round -> times
    for rnd in range(opts.warmup + opts.repeats):
        for u in units if rnd % 2 == 0 else units[::-1]:
            # the split's parts are timed in the first repeats only (they cost a forward and
            # a backward more each); the forward and the whole backward decide on more repeats
            r = repeat(u, rnd, opts.split_backward and rnd >= opts.warmup)
            if rnd >= opts.warmup:
                runs[u][rnd] = r
        reference.append(reference_ms(device))
        if progress:
            progress(len(units) / (opts.warmup + opts.repeats), 0, f"{label} round {rnd + 1}")

    def wide(u) -> bool:
        return any(summarize([r[k] for r in runs[u].values()]).spread > opts.spread_target for k in range(2))

    rnd = opts.warmup + opts.repeats
    while time.perf_counter() <= deadline:
        # while any entry is wide, every entry below the cap runs again: one timed alone in a
        # round has nobody to tell its own noise from the machine's
        if not any(len(runs[u]) < opts.max_repeats and wide(u) for u in units):
            break
        todo = [u for u in units if len(runs[u]) < opts.max_repeats]
        for u in todo if rnd % 2 == 0 else todo[::-1]:
            runs[u][rnd] = repeat(u, rnd, False)
        rnd += 1
    # what every entry saw in a round is the machine's speed then, not the entry's own cost
    rounds = list(range(opts.warmup, rnd))
    table = np.array(
        [[runs[u][r][k] if r in runs[u] else np.nan for r in rounds] for u in units for k in range(2)]
    )
    speed = round_speeds(table, [i for i in range(len(units)) for _ in range(2)])
    out = []
    for j in range(len(timed)):
        got_all: list[list[Summary]] = [[], [], [], []]
        for i, u in enumerate(units):
            if u[0] != j:
                continue
            at = {r: speed[2 * i, c] for c, r in enumerate(rounds)}
            got = [summarize([t[k] / at[r] for r, t in runs[u].items()]) for k in range(2)]
            if opts.split_backward:
                got += [summarize([t[k] / at[r] for r, t in runs[u].items() if len(t) > 2]) for k in (2, 3)]
            for into, e in zip(got_all, got):
                into.append(e)
        mine = [2 * i + k for i, u in enumerate(units) if u[0] == j for k in range(2)]
        out.append(
            _StageTimes(
                *got_all, drift_figure(table[mine]), statistics.median(reference[opts.warmup :] or reference)
            )
        )
    return out


def _fitted(entries: list[Summary]) -> list[float]:
    """The curve over chunk sizes: non-decreasing, each entry weighted by how tight it is."""
    return monotone_fit([e.median for e in entries], [1.0 / (e.spread + 0.01) ** 2 for e in entries])


def _optimizer(name: str, params) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer and how many parameter-sized state tensors it keeps."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9), 1
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3), 2
    raise UmoptError(f"unknown optimizer {name!r} (sgd or adamw)")


def _optimizer_step_ms(stage: nn.Module, opts: ProfileOptions, device: torch.device) -> float:
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return 0.0
    opt, _ = _optimizer(opts.optimizer, params)
    for p in params:
        p.grad = torch.randn_like(p)
    timer = _Timer(device)
    runs = [timer(opt.step)[0] for _ in range(opts.warmup + opts.repeats)]
    stage.zero_grad(set_to_none=True)
    return statistics.median(runs[opts.warmup :])


# --- links ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pingpong_worker(
    rank: int, port: int, backend: str, sizes: list[int], reps: int, devices: tuple[int, int], out_path: str
) -> None:
    import json

    import torch.distributed as dist

    cuda = backend == "nccl"
    device = torch.device("cuda", devices[rank]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
        )
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(reps + 2):
            if cuda:  # the GPU's own clock: a host timer adds launch and synchronisation time
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if i >= 2:
                times.append(ms / 2)  # one way
        results.append((buf.numel() * 4, statistics.median(times)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def pingpong_sizes(backend: str, max_bytes: int) -> list[int]:
    """Message sizes of the ping-pong, 1 KiB up to at least what the stages send in one chunk.

    The largest must dwarf the latency, or the bandwidth reads low: 16 MiB suffices between
    processes on a CPU, NVLink (hundreds of GB/s) needs 256 MiB.
    """
    floor = 28 if backend == "nccl" else 24
    top = max(int(np.ceil(np.log2(max(max_bytes, 1)))), floor)
    return [1 << k for k in range(10, top + 1, 2)] + ([1 << top] if (top - 10) % 2 else [])


def measure_link(
    backend: str = "gloo", max_bytes: int = 1 << 24, reps: int = 20, devices: tuple[int, int] = (0, 1)
) -> tuple[float, float]:
    """Ping-pong between two processes (under NCCL on GPUs ``devices``); fit one-way time =
    latency + bytes / bandwidth.

    Returns ``(latency_ms, bytes_per_ms)``.
    """
    return measure_links(backend, [devices], max_bytes, reps)[devices]


def measure_links(
    backend: str, pairs: list[tuple[int, int]], max_bytes: int = 1 << 24, reps: int = 20
) -> dict[tuple[int, int], tuple[float, float]]:
    """:func:`measure_link` for each pair of devices; pairs that share no device are measured at
    the same time (on 8 GPUs the 7 links take two rounds instead of seven: the links of a running
    pipeline are busy at the same time too). Returns ``(latency_ms, bytes_per_ms)`` per pair."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    sizes = pingpong_sizes(backend, max_bytes)
    rounds: list[list[tuple[int, int]]] = []
    for pair in dict.fromkeys(pairs):  # each pair once, in order
        free = next((r for r in rounds if not any(set(pair) & set(q) for q in r)), None)
        if free is None:
            rounds.append([pair])
        else:
            free.append(pair)
    out: dict[tuple[int, int], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for together in rounds:
            paths = {pair: os.path.join(tmp, f"link{pair[0]}-{pair[1]}.json") for pair in together}
            running = [
                mp.start_processes(
                    _pingpong_worker,
                    args=(_free_port(), backend, sizes, reps, pair, paths[pair]),
                    nprocs=2,
                    start_method="spawn",
                    join=False,
                )
                for pair in together
            ]
            try:
                for ctx in running:
                    while not ctx.join():
                        pass
            except mp.ProcessExitedException as exc:
                # a child that died before its function ran: most often a script without a main
                # guard, which every spawned process imports again (and so profiles again)
                if getattr(sys.modules.get("__main__"), "__file__", None):
                    raise UmoptError(
                        f"a process measuring a link ended ({first_line(exc)}); the new processes import your script again: "
                        'put its code under `if __name__ == "__main__":`, or give the link (link_latency_ms=, link_gbps=)'
                    ) from None
                raise
            for pair in together:
                with open(paths[pair]) as f:
                    out[pair] = _fit_link(json.load(f))
    return out


def _fit_link(results: list) -> tuple[float, float]:
    x = np.array([r[0] for r in results], dtype=float)
    t = np.array([r[1] for r in results], dtype=float)
    # A least-squares line is thrown off by one slow size (a scheduler hiccup on a busy machine);
    # the latency is the smallest message's time, the bandwidth comes from the largest message,
    # which is big enough for the transfer to dwarf the latency.
    latency = float(t[0])
    bpm = float((x[-1] - x[0]) / max(t[-1] - t[0], 1e-6))
    return latency, bpm


# all-reduces timed together per repeat in measure_allreduce
_BACK_TO_BACK = 4


def _allreduce_worker(
    rank: int, world: int, port: int, backend: str, sizes: list[int], reps: int, out_path: str
) -> None:
    import json

    import torch.distributed as dist

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    extra = {}
    if cuda:
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **extra
    )
    results = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(reps + 2):
            dist.barrier(device_ids=[rank]) if cuda else dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            # back to back, the collectives pace each other: the ranks' skew out of the barrier
            # is paid once, not per all-reduce
            for _ in range(_BACK_TO_BACK):
                dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3 / _BACK_TO_BACK)
        results.append((buf.numel() * 4, statistics.median(times)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def measure_allreduce(
    backend: str, replicas: int, max_bytes: int = 1 << 24, reps: int = 10
) -> tuple[float, float]:
    """All-reduces among ``replicas`` processes (under NCCL on GPUs 0..replicas-1): the latency
    (the smallest one's time) and the bus bandwidth from the largest, as
    :func:`umopt.costmodel.allreduce_ms` takes them: time = latency + 2 (N - 1) / N * bytes / bus.

    Returns ``(latency_ms, bus_bytes_per_ms)``.
    """
    import json
    import tempfile

    import torch.multiprocessing as mp

    if backend == "nccl" and torch.cuda.device_count() < replicas:
        raise UmoptError(
            f"--dp {replicas}: measuring the all-reduce needs a GPU per replica, {torch.cuda.device_count()} here"
        )
    sizes = pingpong_sizes(backend, max_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        mp.start_processes(
            _allreduce_worker,
            args=(replicas, _free_port(), backend, sizes, reps, out),
            nprocs=replicas,
            start_method="spawn",
        )
        with open(out) as f:
            results = json.load(f)
    x = np.array([r[0] for r in results], dtype=float)
    t = np.array([r[1] for r in results], dtype=float)
    latency = float(t[0])
    bus = 2 * (replicas - 1) / replicas * (x[-1] - x[0]) / max(t[-1] - t[0], 1e-6)
    return latency, float(bus)


def link_plan(num_stages: int, device_type: str, gpus: int) -> list[tuple[int, int]]:
    """Which pair of devices each link (s, s+1) is measured between.

    On GPUs every link is measured between the GPUs its stages run on (a stage per GPU, as in the
    run); with fewer GPUs than stages, between GPUs 0 and 1 for all. On a CPU every link is the
    same loopback, measured once.
    """
    links = num_stages - 1
    if device_type == "cuda" and gpus >= num_stages:
        return [(s, s + 1) for s in range(links)]
    return [(0, 1)] * links


# --- the whole profile ---------------------------------------------------------------------------


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


def _autocast_for(opts: ProfileOptions, device: torch.device) -> Callable[[], ContextManager]:
    return lambda: autocast(device, opts.dtype)


def _timing_worker(s: int, opts: ProfileOptions, cuts: list[int], sizes: list[int], queue, stop) -> None:
    """Time one stage in its own process while the other stages are timed in theirs."""
    try:
        torch.set_num_threads(opts.threads)
        device = torch.device("cuda", s) if opts.device == "cuda" else torch.device("cpu")  # a GPU per stage
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parts = build_model(opts.model, opts.model_args, seed=opts.seed)
        for m in parts.layers:
            m.to(device)
        bounds = _boundaries(parts, device, opts.dtype)
        cast = _autocast_for(opts, device)
        a, b = cuts[s], cuts[s + 1]
        first, last = s == 0, s == len(cuts) - 2
        stage = _Stage(parts.layers[a:b], parts.loss if last else None).to(device)
        tick = lambda n, _t, what: queue.put(("tick", s, what, n))  # noqa: E731
        (measured,) = _time_stages(
            [_Timed(stage, bounds[a], first, last)],
            parts,
            sizes,
            device,
            opts,
            cast,
            tick,
            f"stage {s}",
            opts.budget_s,
        )
        opt_ms = _optimizer_step_ms(stage, opts, device)
        queue.put(("done", s, measured, opt_ms))
        # keep this core as busy as in a real run until every stage is timed
        x, y = _input(parts, bounds[a], first, sizes[len(sizes) // 2], device, 0)
        while not stop.is_set():
            with cast():
                out = stage(x, y if last else None)
            out.backward(torch.ones_like(out) if last else torch.randn_like(out))
            stage.zero_grad(set_to_none=True)
    except Exception as exc:  # reported by the parent as the user's problem or a bug, with the message
        queue.put(("error", s, f"{exc.__class__.__name__}: {exc}"))


def _time_concurrently(opts: ProfileOptions, cuts: list[int], sizes: list[int], tick) -> dict[int, tuple]:
    """Every stage timed at the same time in its own process, as they will run.

    On a CPU the stages of a run share caches, memory bandwidth and clock boost; timed alone, a
    stage looks faster than it will be (seen here: 10-20% on the small chunks of a GPT's last
    stage), and the solver then prefers small chunks that do not pay off.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    S = len(cuts) - 1
    procs = [
        ctx.Process(target=_timing_worker, args=(s, opts, cuts, sizes, queue, stop), daemon=True)
        for s in range(S)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        while len(results) < S:
            try:
                msg = queue.get(timeout=1.0)
            except Exception:
                dead = [s for s, p in enumerate(procs) if not p.is_alive() and s not in results]
                if dead:
                    raise UmoptError(
                        f"profiling stage {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                    ) from None
                continue
            if msg[0] == "tick":
                tick(msg[3], 0, msg[2])
            elif msg[0] == "done":
                _, s, measured, opt_ms = msg
                results[s] = (measured, opt_ms)
            else:
                raise UmoptError(f"profiling stage {msg[1]} failed: {msg[2]}")
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _layer_ms(parts, bounds, device, opts, cast, size) -> list[float]:
    """Forward plus backward time of each layer on its own, at one chunk size (for balancing)."""
    timer = _Timer(device)
    out = []
    for i, layer in enumerate(parts.layers):
        st = _Stage([layer], parts.loss if i == len(parts.layers) - 1 else None)
        runs = []
        for rep in range(opts.warmup + opts.repeats):
            x, y = _input(parts, bounds[i], i == 0, size, device, rep)
            last = i == len(parts.layers) - 1
            with cast():
                tf, o = timer(lambda: st(x, y if last else None))
            tb, _ = timer(lambda: o.backward(torch.ones_like(o) if last else torch.randn_like(o)))
            if rep >= opts.warmup:
                runs.append(tf + tb)
            st.zero_grad(set_to_none=True)
        out.append(statistics.median(runs))
    return out


def profile_model(
    opts: ProfileOptions, progress: Optional[ProgressFn] = None, argv: Optional[list[str]] = None
) -> Profile:
    """Measure the model of ``opts`` and return its profile (not yet written anywhere)."""
    try:
        return _profile_model(opts, progress, argv)
    finally:
        if opts.device == "cuda" and torch.cuda.is_available():
            # a run started next from this process (umopt tune) puts stage 0 on this GPU: leave
            # it nothing the model's tensors had cached
            gc.collect()
            torch.cuda.empty_cache()


def profile_for_chunks(
    opts: ProfileOptions,
    chunks: int,
    progress: Optional[ProgressFn] = None,
    argv: Optional[list[str]] = None,
    *,
    probes: bool = True,
    probe_minibatch: int = 32,
) -> Profile:
    """The model of ``opts`` profiled layer by layer (each layer timed as a stage of its own, one
    after another), then grouped into its stages (``opts.split``, or balanced on the layers' times
    into ``opts.stages``) with the per-layer entries kept: a profile whose ranks' layers can be cut
    into up to ``chunks`` chunks each (``umopt profile --chunks``).

    With ``probes``, the stages are also profiled whole and fitted to probe runs of the runtime
    (one chunk per rank), and the runtime's own costs that fit (per op, per message, per
    iteration) are the layered profile's too: the per-layer times hold no runtime."""
    from dataclasses import replace

    from .chunks import min_max_cut, stages_from_layers

    L = len(build_model(opts.model, opts.model_args, seed=opts.seed).layers)
    if opts.split is None and (opts.stages or 1) * chunks > L:
        raise UmoptError(
            f"{opts.stages} stages x {chunks} chunks need {(opts.stages or 1) * chunks} layers; {opts.model} has {L}"
        )
    per_layer = profile_model(
        replace(opts, split=list(range(L + 1)), stages=None, concurrent=False), progress, argv
    )
    if opts.split is not None:
        cuts = list(opts.split)
    else:
        # balanced on the layers' times, every stage with room for its chunks
        mid = len(per_layer.sizes) // 2
        cost = [st.forward_ms[mid] + st.backward_ms[mid] for st in per_layer.stages]
        cuts = [0] + [hi for _, hi in min_max_cut(cost, opts.stages or 1, chunks)]
    short = [s for s, (a, b) in enumerate(zip(cuts, cuts[1:])) if b - a < chunks]
    if short:
        raise UmoptError(
            f"stage {short[0]} has {cuts[short[0] + 1] - cuts[short[0]]} layers, too few for {chunks} chunks"
        )
    layered = stages_from_layers(per_layer, cuts)
    if not probes:
        return layered.model_copy(
            update={
                "meta": layered.meta.model_copy(update={"probes": ProbesMeta(ran=False, why="--no-probes")})
            }
        )
    from .calibrate import Overheads
    from .probes import profile_in_pipeline

    whole = profile_in_pipeline(
        replace(opts, split=cuts, stages=None),
        probes=True,
        probe_minibatch=probe_minibatch,
        progress=progress,
        argv=argv,
    )
    cal = whole.meta.calibration
    if cal is not None:
        layered = Overheads(cal.op_overhead_ms, cal.message_overhead_ms, cal.step_overhead_ms, 0.0).apply(
            layered
        )
    return layered.model_copy(
        update={"meta": layered.meta.model_copy(update={"probes": whole.meta.probes, "calibration": cal})}
    )


def profile_stages(
    stages: Sequence[nn.Module],
    sample: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    loss_reduction: str = "mean",
    name: str = "user",
    sizes: Optional[Sequence[int]] = None,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
    repeats: int = 5,
    optimizer: str = "sgd",
    link_latency_ms: Optional[float] = None,
    link_gbps: Optional[float] = None,
    memory_limit_bytes: Optional[int] = None,
    progress: Optional[ProgressFn] = None,
) -> Profile:
    """Profile your own pipeline stages: the same profile file ``umopt profile`` writes, for
    ``umopt solve`` and :class:`umopt.Pipeline`.

    Args:
        stages: one module per stage, in order; each takes the tensor the one before returns.
        sample: ``(inputs, targets)``, a batch of at least the largest chunk size of samples;
            chunks of each size are cut from it.
        loss_fn: ``loss_fn(output, targets)`` of the last stage, reduced by ``loss_reduction``
            (``"mean"``, torch's default, or ``"sum"``).
        name: what the profile calls the model (``umopt run`` cannot rebuild it: run the schedule
            with :class:`umopt.Pipeline`).
        sizes: chunk sizes to measure (default: powers of two up to the sample's size, at most 64).
        The other arguments are ``umopt profile``'s options of the same names.

    The stages are timed one after another in this process; the links are measured (or given)
    as by ``umopt profile``; no probe runs of the runtime follow (it cannot rebuild your modules).
    """
    if loss_reduction not in ("mean", "sum"):
        raise UmoptError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    x_all, y_all = sample
    n = x_all.shape[0]
    if n < 1 or y_all.shape[0] != n:
        raise UmoptError(
            f"the sample's inputs and targets must have the same number of samples, got {n} and {y_all.shape[0]}"
        )
    if sizes is not None and max(sizes) > n:
        raise UmoptError(f"chunk size {max(sizes)} needs a sample of at least that many samples, got {n}")

    def make_batch(b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        idx = (torch.arange(b) + seed * b) % n  # each seed another window of the sample
        return x_all[idx], y_all[idx]

    def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the profiler's losses are sums
        return loss_fn(out, y) * (y.shape[0] if loss_reduction == "mean" else 1)

    parts = ModelParts(list(stages), make_batch, summed)
    opts = ProfileOptions(
        model=name,
        split=list(range(len(parts.layers) + 1)),
        sizes=list(sizes) if sizes else None,
        max_size=min(64, n),
        device=device,
        dtype=dtype,
        threads=threads,
        repeats=repeats,
        optimizer=optimizer,
        link_latency_ms=link_latency_ms,
        link_gbps=link_gbps,
        memory_limit_bytes=memory_limit_bytes,
        concurrent=False,
    )
    prof = _profile_model(opts, progress, ["umopt.profile_stages"], parts=parts)
    why = "stages given as modules: the runtime cannot rebuild them (fit with umopt calibrate to your own runs' reports)"
    for line in prof.meta.warnings:  # as the CLI prints them
        logging.getLogger("umopt").warning(line)
    return prof.model_copy(
        update={"meta": prof.meta.model_copy(update={"probes": ProbesMeta(ran=False, why=why)})}
    )


def _profile_model(
    opts: ProfileOptions,
    progress: Optional[ProgressFn],
    argv: Optional[list[str]],
    parts: Optional[ModelParts] = None,
) -> Profile:
    sizes, device = check_profile_options(opts)
    parts = parts or build_model(opts.model, opts.model_args, seed=opts.seed)
    L = len(parts.layers)
    prev_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(opts.threads)
    try:
        for m in parts.layers:
            m.to(device)
        cast = _autocast_for(opts, device)
        try:
            bounds = _boundaries(parts, device, opts.dtype)
        except Exception as exc:  # a user model that does not run is the user's input problem
            raise UmoptError(
                f"model {opts.model}: a forward pass of one sample failed ({exc.__class__.__name__}: {exc})"
            ) from None

        layer_ms = None
        if opts.split is not None:
            cuts = list(opts.split)
            if cuts[0] != 0 or cuts[-1] != L or any(b <= a for a, b in zip(cuts, cuts[1:])):
                raise UmoptError(
                    f"--split must rise strictly from 0 to the model's {L} layers, got {','.join(map(str, cuts))}"
                )
            if opts.stages is not None and opts.stages != len(cuts) - 1:
                raise UmoptError(f"--stages {opts.stages} disagrees with --split of {len(cuts) - 1} stages")
        else:
            if opts.stages > L:
                raise UmoptError(
                    f"--stages {opts.stages}: more stages than the model {opts.model} has layers ({L})"
                )
            # balance on the sum of two chunk sizes: a split that only fits one size would be
            # noise-prone where layers are close, and stages run many sizes
            small, large = (
                _layer_ms(parts, bounds, device, opts, cast, min(8, sizes[-1])),
                _layer_ms(parts, bounds, device, opts, cast, sizes[-1]),
            )
            layer_ms = [a + b for a, b in zip(small, large)]
            cuts = balanced_split(layer_ms, opts.stages)
        S = len(cuts) - 1
        total = S * len(sizes)
        done = 0

        def tick(n, _t, what):
            nonlocal done
            done += n
            if progress:
                progress(done, total, what)

        concurrent = (
            opts.concurrent
            if opts.concurrent is not None
            else (device.type == "cpu" and S > 1 and S * opts.threads <= (os.cpu_count() or 1))
        )
        warnings = [
            w
            for w in [
                load_warning(S * opts.threads if concurrent else opts.threads)
                if device.type == "cpu"
                else None
            ]
            if w
        ]
        timed = _time_concurrently(opts, cuts, sizes, tick) if concurrent else {}
        modules = [
            _Stage(parts.layers[a:b], parts.loss if b == L else None).to(device)
            for a, b in zip(cuts, cuts[1:])
        ]
        if not concurrent:
            together = _time_stages(
                [_Timed(m, bounds[a], a == 0, b == L) for m, a, b in zip(modules, cuts, cuts[1:])],
                parts,
                sizes,
                device,
                opts,
                cast,
                tick,
                "stages",
                opts.budget_s,
            )
            timed = {s: (t, _optimizer_step_ms(modules[s], opts, device)) for s, t in enumerate(together)}
        stages = []
        entries: list[Summary] = []
        drifts: list[float] = []
        references: list[float] = []
        for s in range(S):
            a, b = cuts[s], cuts[s + 1]
            first, last = s == 0, s == S - 1
            stage = modules[s]
            measured, opt_ms = timed[s]
            fwd, bwd, bin_, bwt = (
                measured.forward,
                measured.backward,
                measured.backward_input,
                measured.backward_weight,
            )
            entries += fwd + bwd
            drifts.append(measured.drift)
            references.append(measured.reference_ms)
            lo, hi = (2, 6)
            x2, y2 = _input(parts, bounds[a], first, lo, device, 0)
            x6, y6 = _input(parts, bounds[a], first, hi, device, 0)
            with cast():
                stash = (
                    stash_bytes(stage, x6, y6 if last else None)
                    - stash_bytes(stage, x2, y2 if last else None)
                ) // (hi - lo)
            nparam = sum(p.numel() * p.element_size() for p in stage.parameters())
            _, nstate = _optimizer(opts.optimizer, [torch.zeros(1, requires_grad=True)])
            in_bytes = TensorSpec.of(bounds[a]).bytes_per_sample
            out_bytes = 0 if last else TensorSpec.of(bounds[b]).bytes_per_sample
            entry = {
                "layers": [a, b],
                "forward_ms": _fitted(fwd),
                "backward_ms": _fitted(bwd),
                "forward_iqr_ms": [e.iqr for e in fwd],
                "backward_iqr_ms": [e.iqr for e in bwd],
                **({"backward_input_ms": _fitted(bin_), "backward_weight_ms": _fitted(bwt)} if bin_ else {}),
                "input_bytes_per_sample": int(in_bytes),
                "output_bytes_per_sample": int(out_bytes),
                "stash_bytes_per_sample": int(max(stash, 0)),
                "static_bytes": int(nparam * (2 + nstate)),
                "param_bytes": int(
                    sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)
                ),
                "optimizer_ms": opt_ms,
            }
            if device.type == "cuda":
                entry["cuda_peak_bytes_per_sample"] = _cuda_check(
                    stage, parts, bounds[a], first, last, device, cast
                )
            if opts.trace_dir:
                _trace_stage(
                    stage,
                    parts,
                    bounds[a],
                    first,
                    last,
                    sizes[-1],
                    device,
                    cast,
                    os.path.join(opts.trace_dir, f"stage{s}.json"),
                )
            stages.append(entry)
        # stage 0's input is the model input; every later stage receives what the one before sent
        for s in range(1, S):
            stages[s]["input_bytes_per_sample"] = stages[s - 1]["output_bytes_per_sample"]

        if opts.link_latency_ms is not None:
            given = {
                "latency_ms": opts.link_latency_ms,
                "bytes_per_ms": opts.link_gbps * 1e9 / 8 / 1e3,
                "source": "given",
            }
            links = [dict(given) for _ in range(S - 1)]
        elif S == 1:
            links = []
        else:
            backend = "nccl" if device.type == "cuda" else "gloo"
            plan = link_plan(S, device.type, torch.cuda.device_count() if device.type == "cuda" else 0)
            if progress:
                progress(
                    done,
                    total,
                    f"link ping-pongs ({len(set(plan))} pairs of GPUs)"
                    if backend == "nccl"
                    else "link ping-pong",
                )
            biggest = max(st["output_bytes_per_sample"] for st in stages) * sizes[-1]
            measured = measure_links(backend, plan, max_bytes=max(biggest, 1 << 16))
            links = [
                {
                    "latency_ms": measured[pair][0],
                    "bytes_per_ms": measured[pair][1],
                    "source": "measured",
                    **({"devices": list(pair)} if backend == "nccl" else {}),
                }
                for pair in plan
            ]
        allreduce = None
        if opts.dp > 1:
            if progress:
                progress(done, total, f"all-reduce among {opts.dp} processes")
            biggest = max(st["param_bytes"] for st in stages)
            allreduce = measure_allreduce(
                "nccl" if device.type == "cuda" else "gloo", opts.dp, max_bytes=max(biggest, 1 << 16)
            )
        median_spread, p90_spread = noise_figure([e.median for e in entries], [e.iqr for e in entries])
        noisy = noisy_warning("profile entries", median_spread)
        if noisy:
            warnings.append(noisy)
        for line in (drift_warning(max(drifts)), uneven_devices_warning(references, device.type)):
            if line:
                warnings.append(line)
        memory_limit, memory_limit_source = opts.memory_limit_bytes, None
        if memory_limit is None and device.type == "cuda":
            memory_limit, memory_limit_source = default_memory_limit(device)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    finally:
        torch.set_num_threads(prev_threads)

    data = {
        "format": PROFILE_FORMAT,
        "model": {"name": opts.model, "args": opts.model_args, "seed": opts.seed},
        "device": {
            "type": device.type,
            "name": device_name,
            "dtype": opts.dtype,
            "threads": opts.threads,
            "numerics": numerics(),
        },
        "sizes": sizes,
        "stages": stages,
        "links": links,
        "memory_limit_bytes": memory_limit,
        **(
            {"allreduce": {"replicas": opts.dp, "latency_ms": allreduce[0], "bus_bytes_per_ms": allreduce[1]}}
            if allreduce
            else {}
        ),
        "split": cuts,
        "layer_ms": layer_ms,
        "meta": {
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(argv if argv is not None else sys.argv),
            "optimizer": opts.optimizer,
            "warmup": opts.warmup,
            "repeats": opts.repeats,
            "stages_timed_concurrently": bool(timed),
            "noise": {
                "median_spread": round(median_spread, 4),
                "p90_spread": round(p90_spread, 4),
                "max_repeats": max(e.kept for e in entries),
                "drift": [round(d, 4) for d in drifts],
                "reference_ms": [round(r, 4) for r in references],
            },
            "warnings": warnings,
            **({"memory_limit": memory_limit_source} if memory_limit_source else {}),
        },
    }
    return Profile.model_validate(data)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _cuda_check(stage, parts, boundary, first, last, device, cast) -> int:
    """Per-sample growth of max_memory_allocated over one forward, a cross-check of the hooks."""
    peaks = []
    for b in (2, 6):
        x, y = _input(parts, boundary, first, b, device, 0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with cast():
            out = stage(x, y if last else None)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del out
    return int((peaks[1] - peaks[0]) // 4)


def _trace_stage(stage, parts, boundary, first, last, size, device, cast, path) -> None:
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    x, y = _input(parts, boundary, first, size, device, 0)
    with profile(activities=acts) as prof:
        with cast():
            out = stage(x, y if last else None)
        out.backward(torch.ones_like(out) if last else torch.randn_like(out))
    prof.export_chrome_trace(path)
    stage.zero_grad(set_to_none=True)
