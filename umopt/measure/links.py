"""The links between stages and the all-reduce among replicas, measured between real processes.

A link is a ping-pong between two torch.distributed processes (under NCCL on the GPUs its stages
run on), fitted as one-way time = latency + bytes / bandwidth; the all-reduce is timed among
``replicas`` processes and fitted as :func:`umopt.costmodel.allreduce_ms` takes it. Both run in
processes started by one helper, which also says what to do when a child dies before it runs
(most often a script without a main guard).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from ..errors import UmoptError, first_line

__all__ = ["measure_link", "measure_links", "measure_allreduce", "pingpong_sizes", "link_plan"]

# all-reduces timed together per repeat in measure_allreduce
_BACK_TO_BACK = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pingpong_ms(buf: torch.Tensor, rank: int, cuda: bool) -> float:
    """One way of one exchange between ranks 0 and 1."""
    import torch.distributed as dist

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
        return start.elapsed_time(end) / 2
    return (time.perf_counter() - t0) * 1e3 / 2


def _allreduce_ms(buf: torch.Tensor, rank: int, cuda: bool) -> float:
    """One all-reduce among every rank, out of a few back to back: the collectives pace each
    other, so the ranks' skew out of the barrier is paid once, not per all-reduce."""
    import torch.distributed as dist

    dist.barrier(device_ids=[torch.cuda.current_device()]) if cuda else dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(_BACK_TO_BACK):
        dist.all_reduce(buf)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / _BACK_TO_BACK


_KINDS = {"pingpong": _pingpong_ms, "allreduce": _allreduce_ms}


def _worker(
    rank: int, port: int, backend: str, sizes: list[int], reps: int, devices: tuple, out_path: str, kind: str
) -> None:
    """One process of a measurement: ``kind``'s time per message size (the median of ``reps``
    after two untimed), written by rank 0 as [(bytes, ms), ...]."""
    import torch.distributed as dist

    cuda = backend == "nccl"
    device = torch.device("cuda", devices[rank]) if cuda else torch.device("cpu")
    extra = {}
    if cuda:
        torch.cuda.set_device(device)
        extra["device_id"] = device
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=len(devices), **extra)
    timed = _KINDS[kind]
    results = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = [timed(buf, rank, cuda) for _ in range(reps + 2)][2:]
        results.append((buf.numel() * 4, statistics.median(times)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _spawn(kind: str, backend: str, sizes: list[int], reps: int, groups: list[tuple]) -> list[list]:
    """Each group of devices measured at the same time, a process per device; what each group's
    rank 0 wrote."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"{kind}{k}.json") for k in range(len(groups))]
        running = [
            mp.start_processes(
                _worker,
                args=(_free_port(), backend, sizes, reps, devices, path, kind),
                nprocs=len(devices),
                start_method="spawn",
                join=False,
            )
            for devices, path in zip(groups, paths)
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
        out = []
        for path in paths:
            with open(path) as f:
                out.append(json.load(f))
        return out


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
    sizes = pingpong_sizes(backend, max_bytes)
    rounds: list[list[tuple[int, int]]] = []
    for pair in dict.fromkeys(pairs):  # each pair once, in order
        free = next((r for r in rounds if not any(set(pair) & set(q) for q in r)), None)
        if free is None:
            rounds.append([pair])
        else:
            free.append(pair)
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for together in rounds:
        for pair, results in zip(together, _spawn("pingpong", backend, sizes, reps, together)):
            out[pair] = _fit(results)
    return out


def _fit(results: list) -> tuple[float, float]:
    """(latency ms, bytes per ms) of [(bytes, ms), ...]. A least-squares line is thrown off by one
    slow size (a scheduler hiccup on a busy machine); the latency is the smallest message's time,
    the bandwidth comes from the largest message, which is big enough for the transfer to dwarf
    the latency."""
    x = np.array([r[0] for r in results], dtype=float)
    t = np.array([r[1] for r in results], dtype=float)
    return float(t[0]), float((x[-1] - x[0]) / max(t[-1] - t[0], 1e-6))


def measure_allreduce(
    backend: str, replicas: int, max_bytes: int = 1 << 24, reps: int = 10
) -> tuple[float, float]:
    """All-reduces among ``replicas`` processes (under NCCL on GPUs 0..replicas-1): the latency
    (the smallest one's time) and the bus bandwidth from the largest, as
    :func:`umopt.costmodel.allreduce_ms` takes them: time = latency + 2 (N - 1) / N * bytes / bus.

    Returns ``(latency_ms, bus_bytes_per_ms)``.
    """
    if backend == "nccl" and torch.cuda.device_count() < replicas:
        raise UmoptError(
            f"--dp {replicas}: measuring the all-reduce needs a GPU per replica, {torch.cuda.device_count()} here"
        )
    sizes = pingpong_sizes(backend, max_bytes)
    (results,) = _spawn("allreduce", backend, sizes, reps, [tuple(range(replicas))])
    latency, bpm = _fit(results)
    return latency, 2 * (replicas - 1) / replicas * bpm


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
