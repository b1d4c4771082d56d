"""A user's own training script around ``umopt.Pipeline`` (run by tests/test_pipeline.py, one
process per stage): the user's modules, loss, optimizer and loop; umopt only runs the schedule.

    RANK=r python tests/pipeline_user.py CASE SCHEDULE STORE OUT STEPS
    RANK=r python tests/pipeline_user.py torch PLAN.csv MICROBATCHES STORE OUT STEPS   (torch's runtime)

CASE "mlp3" runs three stages and records, for every message, the process group it went through.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import umopt

B, D = 12, 6


class Head(nn.Module):
    """Stage 0 of the "tuple" case: sends a float tensor and an integer mask (no gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x)), (x[:, 0] > 0).long()


class Tail(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, h, mask):
        return self.lin(h * (1 + mask[:, None]))


def model(case: str) -> list[nn.Module]:
    """The whole model as its two stages, the same weights in every process."""
    torch.manual_seed(0)
    if case == "tuple":
        return [Head(), Tail()]
    if case == "mlp3":
        return [nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, 1)]
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1))]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, D, generator=g), torch.randn(B, 1, generator=g)


def reference(case: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """One process, the whole minibatch: each stage's parameters after ``steps`` AdamW steps."""
    stages = model(case)
    opt = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        h = stages[0](x)
        out = stages[1](*h) if isinstance(h, tuple) else stages[1](h)
        for later in stages[2:]:
            out = later(out)
        nn.MSELoss()(out, y).backward()
        opt.step()
        opt.zero_grad()
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in stages]


def main() -> None:
    case, schedule, store, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    rank, world = int(os.environ["RANK"]), 3 if case == "mlp3" else 2
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    groups_used = _spy_on_messages() if case == "mlp3" else []
    stage = model(case)[rank]  # the user's own module for this stage
    pipe = umopt.Pipeline(stage, schedule, loss_fn=nn.MSELoss())
    opt = torch.optim.AdamW(stage.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        pipe.step(x) if rank == 0 else pipe.step(targets=y) if rank == world - 1 else pipe.step()
        opt.step()
        opt.zero_grad()
    torch.save({**stage.state_dict(), **({"groups_used": groups_used} if groups_used else {})}, os.path.join(out, f"stage{rank}.pt"))
    dist.destroy_process_group()


def _spy_on_messages() -> list:
    """Record every point-to-point call's peer and the ranks of the group it went through."""
    seen: list = []
    for name in ("isend", "irecv", "send_object_list", "recv_object_list"):
        real = getattr(dist, name)

        def spy(*args, _real=real, **kwargs):
            group = kwargs.get("group")
            peer = kwargs.get("dst", kwargs.get("src"))
            seen.append((peer, None if group is None else dist.get_process_group_ranks(group)))
            return _real(*args, **kwargs)

        setattr(dist, name, spy)
    return seen




def torch_main() -> None:
    """The same loop on torch.distributed.pipelining's runtime, the schedule an exported CSV."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    plan, microbatches, store, out, steps = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    stage = model("mlp")[rank]
    runtime = _PipelineScheduleRuntime([PipelineStage(stage, rank, 2, torch.device("cpu"))], n_microbatches=microbatches, loss_fn=nn.MSELoss())
    runtime._load_csv(plan)
    opt = torch.optim.AdamW(stage.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        runtime.step(x) if rank == 0 else runtime.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
    torch.save(stage.state_dict(), os.path.join(out, f"stage{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch_main() if sys.argv[1] == "torch" else main()
