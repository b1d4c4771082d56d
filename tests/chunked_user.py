"""A user's training script around ``umopt.Pipeline`` given several chunk modules per rank (run by
tests/test_multichunk.py, one process per rank): the user's layers, loss, optimizer and loop.

    RANK=r WORLD=R python tests/chunked_user.py SCHEDULE STORE OUT STEPS
    RANK=r WORLD=R python tests/chunked_user.py SCHEDULE STORE OUT STEPS PLAN.csv   (torch's runtime)

With SELECT_STEPS=n in the environment the Pipeline measures the schedule file's candidates in
turns over at most n steps (``select_steps``) and OUT/rank{r}.txt says which it kept.

With PLAN.csv (``umopt export --format torch-csv`` of SCHEDULE, an equal one), torch's
``_PipelineScheduleRuntime`` runs it with a stock ``PipelineStage`` per chunk instead.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import umopt
from umopt.formats.profile import load_profile
from umopt.formats.schedule import load_schedule

D = 5


def layer(i: int, layers: int) -> nn.Module:
    torch.manual_seed(100 + i)
    lin = nn.Linear(D, D if i + 1 < layers else 1)
    return nn.Sequential(lin, nn.Tanh()) if i + 1 < layers else lin


def batch(step: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, D, generator=g), torch.randn(B, 1, generator=g)


def reference(layers: int, B: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, the whole minibatch: every layer's parameters after ``steps`` AdamW steps."""
    model = nn.Sequential(*[layer(i, layers) for i in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step, B)
        opt.zero_grad()
        nn.MSELoss()(model(x), y).backward()
        opt.step()
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(model) for k, v in m.state_dict().items()}


def train(schedule, rank: int, steps: int, chunks: list[nn.Module], select_steps=None, comm=None):
    """The user's loop on umopt.Pipeline over this rank's chunk modules: every layer's state after
    ``steps`` AdamW steps, and the schedule kept (with ``select_steps``). ``comm``: the transport
    (the tests run this loop as threads over tests/lazycomm.py's model); None: torch.distributed."""
    layout = schedule.layout(load_profile(schedule.profile.path))  # as docs/pipeline.md says
    spans = layout.layers
    mine = [j for j, r in enumerate(layout.ranks) if r == rank]
    V, B = len(layout.ranks), schedule.minibatch
    more = {"select_steps": select_steps} if select_steps is not None else {}
    if comm is not None:
        more["_comm"] = comm
    pipe = umopt.Pipeline(chunks, schedule, loss_fn=nn.MSELoss(), **more)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=0.01)
    for step in range(steps):
        x, y = batch(step, B)
        opt.zero_grad()
        pipe.step(x if 0 in mine else None, target=y if V - 1 in mine else None)
        opt.step()
    state = {}
    for j, c in zip(mine, chunks):
        for k, m in enumerate(c):
            for name, v in m.state_dict().items():
                state[f"{spans[j][0] + k}.{name}"] = v.detach().clone()
    return state, pipe.selected


def main() -> None:
    schedule_path, store, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    schedule = load_schedule(schedule_path)
    layout = schedule.layout(load_profile(schedule.profile.path))
    spans = layout.layers
    layers = spans[-1][1]
    mine = [j for j, r in enumerate(layout.ranks) if r == rank]
    chunks = [nn.Sequential(*[layer(i, layers) for i in range(*spans[j])]) for j in mine]
    if len(sys.argv) > 5:  # torch's runtime on the exported plan
        state = torch_train(schedule, rank, steps, chunks, sys.argv[5])
    else:
        select = int(os.environ["SELECT_STEPS"]) if "SELECT_STEPS" in os.environ else None
        state, selected = train(schedule, rank, steps, chunks, select)
        if select is not None:
            with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
                f.write(str(selected))
    torch.save(state, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def torch_train(schedule, rank: int, steps: int, chunks: list[nn.Module], plan: str) -> dict:
    """The same loop on torch's _PipelineScheduleRuntime with a stock PipelineStage per chunk."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    spans = schedule.chunks.layers
    mine = [j for j, r in enumerate(schedule.chunks.ranks) if r == rank]
    V, B = len(schedule.chunks.ranks), schedule.minibatch
    microbatches = len([op for op in schedule.stages[rank].ops if op[0] == "F" and op[3] == mine[0]])
    runtime = _PipelineScheduleRuntime(
        [PipelineStage(c, j, V, torch.device("cpu")) for j, c in zip(mine, chunks)],
        n_microbatches=microbatches,
        loss_fn=nn.MSELoss(),
    )
    runtime._load_csv(plan)
    opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=0.01)
    for step in range(steps):
        x, y = batch(step, B)
        opt.zero_grad()
        if 0 in mine:
            runtime.step(x)
        elif V - 1 in mine:
            runtime.step(target=y, losses=[])
        else:
            runtime.step()
        opt.step()
    return {
        f"{spans[j][0] + k}.{name}": v
        for j, c in zip(mine, chunks)
        for k, m in enumerate(c)
        for name, v in m.state_dict().items()
    }


if __name__ == "__main__":
    main()
