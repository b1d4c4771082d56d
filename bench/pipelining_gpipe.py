"""torch.distributed.pipelining's ScheduleGPipe on a zoo model: the reference the runtime is timed against.

Run under torchrun, one process per stage (bench/runtime_vs_predicted.py does this):

    torchrun --standalone --nproc-per-node 2 bench/pipelining_gpipe.py PROFILE M STEPS WARMUP OUT.json MINIBATCH

It builds the same model as umopt's runtime (same seed, same split from the profile, same
autocast dtype, on the same device: gloo on the CPU, NCCL with a GPU per stage for CUDA
profiles), splits the minibatch into M equal microbatches and times each iteration (barrier,
schedule.step, optimizer step) like umopt's runtime does; rank 0 writes the step times.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from umopt.devices import autocast, to_device
from umopt.formats.profile import load_profile
from umopt.run.rank import init_distributed
from umopt.zoo import build_model


class _Autocast(torch.nn.Module):
    """The stage's layers under the profile's autocast, as umopt's runtime runs them."""

    def __init__(self, body: torch.nn.Module, device: torch.device, dtype: str):
        super().__init__()
        self.body, self.device, self.dtype = body, device, dtype

    def forward(self, x):
        with autocast(self.device, self.dtype):
            return self.body(x)


def main() -> None:
    profile_path, m, steps, warmup, out, minibatch = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
        int(sys.argv[6]),
    )
    prof = load_profile(profile_path)
    device = init_distributed("nccl" if prof.device.type == "cuda" else "gloo", 60)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads((prof.device.threads or 1))
    parts = build_model(prof.model.name, prof.model.args, seed=prof.model.seed)
    a, b = prof.stages[rank].layers
    module = _Autocast(torch.nn.Sequential(*parts.layers[a:b]), device, prof.device.dtype).to(device)
    stage = PipelineStage(module, rank, world, device)
    sched = ScheduleGPipe(
        stage, n_microbatches=m, loss_fn=lambda out, y: parts.loss(out, y) / minibatch, scale_grads=False
    )
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    cuda = device.type == "cuda"
    times = []
    for step in range(warmup + steps):
        x, y = parts.make_batch(minibatch, step)
        x, y = to_device(x, device), to_device(y, device)
        dist.barrier(device_ids=[device.index]) if cuda else dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(dt))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_ms": times}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
