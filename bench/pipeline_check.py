"""One step of a schedule through ``umopt.Pipeline`` (as a user's loop runs it), each rank's
gradients against one process's on the whole minibatch, and its peak memory against the
prediction. Run under torchrun, a process per rank (bench/gpu_smoke.sh does):

    python -m torch.distributed.run --standalone --nproc-per-node R bench/pipeline_check.py \\
        SCHEDULE [--backend nccl|gloo] [--rtol 2e-2]

The model is the profile's (the zoo's, with its seed); each rank also builds the whole model on
its own device for the reference, so keep it small. Prints one line per rank; exits 1 where a
rank's gradients are off.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import umopt
from umopt.costmodel import CostTables, simulate
from umopt.devices import autocast
from umopt.formats.profile import load_profile
from umopt.formats.schedule import load_schedule
from umopt.run.rank import StageModule
from umopt.zoo import build_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("schedule")
    ap.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    ap.add_argument("--rtol", type=float, default=2e-2)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    sched = load_schedule(args.schedule)
    prof = load_profile(sched.profile.path)
    B = sched.minibatch
    parts = build_model(prof.model.name, prof.model.args, seed=prof.model.seed)
    layers = list(parts.layers)
    spans = (
        [tuple(c) for c in sched.chunks.layers] if sched.chunks else [tuple(st.layers) for st in prof.stages]
    )
    ranks_of = list(sched.chunks.ranks) if sched.chunks else list(range(len(prof.stages)))
    mine = [j for j, r in enumerate(ranks_of) if r == rank]
    import copy

    whole = StageModule(copy.deepcopy(layers), 0).to(device)  # the reference, before any step
    mods = [StageModule(layers[lo:hi], lo).to(device) for lo, hi in (spans[j] for j in mine)]
    x, y = parts.make_batch(B, 0)
    x, y = x.to(device), y.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) - sum(
            p.numel() * p.element_size() for m in mods for p in m.parameters()
        )
    pipe = umopt.Pipeline(
        mods if sched.chunks else mods[0],
        sched,
        loss_fn=lambda out, t: parts.loss(out, t) / B,
        loss_reduction="sum",
        device=device,
        select=False,
    )
    pipe.step(x if 0 in mine else None, target=y if len(ranks_of) - 1 in mine else None)
    measured = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    with autocast(device, prof.device.dtype):
        loss = parts.loss(whole(x), y) / B
    loss.backward()
    want = dict(whole.named_parameters())
    worst = 0.0
    for m in mods:
        for name, p in m.named_parameters():
            ref = want[name].grad
            err = ((p.grad - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            worst = max(worst, err)
    tables = CostTables.from_profile(prof, sched.recompute, chunks=sched.chunking(), minibatch=B)
    predicted = simulate(tables, sched.op_lists(), B).peak_memory_bytes[rank]
    memory = ""
    if device.type == "cuda":  # (the prediction counts an optimizer's state, which this step has none of)
        memory = f", peak memory {measured / 2**20:.1f} MiB measured / {predicted / 2**20:.1f} MiB predicted ({measured / predicted:.2f})"
    ok = worst <= args.rtol
    print(
        f"rank {rank}: virtual stages {mine}, gradients' largest relative error {worst:.2e} "
        f"({'within' if ok else 'over'} {args.rtol:g}){memory}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
