"""A user's own training script around ``umopt.Pipeline`` (run by tests/test_pipeline.py, one
process per stage): the user's modules, loss, optimizer and loop; umopt only runs the schedule.

    RANK=r python tests/pipeline_user.py CASE SCHEDULE STORE OUT STEPS
    RANK=r python tests/pipeline_user.py torch PLAN.csv MICROBATCHES STORE OUT STEPS   (torch's runtime)

CASE "mlp3" runs three stages and records, for every message, the process group it went through.
The loop itself is :func:`train`, which the tests also run as threads over a model of the transport.
CASE "tokens-LOSS" is a token model under nn.CrossEntropyLoss with LOSS one of "ignore", "weight",
"smooth": padded targets (-100), one chunk of them all ignored; it also checks eval_step.
CASE "catch" raises in the last stage's loss at step 1; the user catches it and steps again.
CASE "select" is "mlp" with a schedule file that has candidates: the Pipeline measures them in
turns over the first steps and keeps one (``selected``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import umopt

B, D = 12, 6
V, T = 7, 5  # the token cases: vocabulary and sequence length


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, x):
        return torch.tanh(self.emb(x))


class Logits(nn.Module):
    """(B, T, D) -> (B, V, T): the class dimension second, as nn.CrossEntropyLoss takes it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, V)

    def forward(self, h):
        return self.lin(h).transpose(1, 2)


def token_loss(kind: str) -> nn.Module:
    if kind == "weight":
        return nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, V))
    if kind == "smooth":
        return nn.CrossEntropyLoss(label_smoothing=0.1, weight=torch.linspace(0.5, 2.0, V))
    return nn.CrossEntropyLoss(ignore_index=-100)


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of uneven valid length, padded with -100; samples 0-2 all padding."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[:3] = 0
    y[torch.arange(T)[None, :] >= lengths[:, None]] = -100
    return x, y


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
    if case.startswith("tokens"):
        return [Embed(), Logits()]
    if case == "mlp3":
        return [
            nn.Sequential(nn.Linear(D, D), nn.Tanh()),
            nn.Sequential(nn.Linear(D, D), nn.Tanh()),
            nn.Linear(D, 1),
        ]
    return [  # "mlp", "select", "catch"
        nn.Sequential(nn.Linear(D, D), nn.Tanh()),
        nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1)),
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, D, generator=g), torch.randn(B, 1, generator=g)


def reference(case: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """One process, the whole minibatch: each stage's parameters after ``steps`` AdamW steps (for
    the token cases also its validation loss on the next batch, under "eval_loss")."""
    stages = model(case)
    opt = torch.optim.AdamW([p for m in stages for p in m.parameters()], lr=0.01)
    if case.startswith("tokens"):
        loss_fn = token_loss(case.split("-")[1])
        for step in range(steps):
            x, y = token_batch(step)
            loss_fn(stages[1](stages[0](x)), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            x, y = token_batch(steps)
            eval_loss = loss_fn(stages[1](stages[0](x)), y)
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in stages] + [
            {"eval_loss": eval_loss}
        ]
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
    if case == "catch":
        return catch_main(rank, schedule, out)
    state = train(case, model(case)[rank], rank, world, schedule, steps)
    torch.save(
        {**state, **({"groups_used": groups_used} if groups_used else {})},
        os.path.join(out, f"stage{rank}.pt"),
    )
    dist.destroy_process_group()


def train(case: str, stage: nn.Module, rank: int, world: int, schedule: str, steps: int, comm=None) -> dict:
    """One rank's loop over its own stage module: its state after ``steps`` AdamW steps (the
    token cases: then an eval_step on the next batch, its loss on the last stage). ``comm``: the
    transport (tests/lazycomm.py runs these loops as threads); None: torch.distributed."""
    more = {"_comm": comm} if comm is not None else {}
    if case.startswith("tokens"):  # the loss module as it is
        pipe = umopt.Pipeline(stage, schedule, loss_fn=token_loss(case.split("-")[1]), **more)
    else:
        select = {"select_steps": 18} if case == "select" else {}  # the schedule file has candidates
        pipe = umopt.Pipeline(stage, schedule, loss_fn=nn.MSELoss(), **select, **more)
    opt = torch.optim.AdamW(stage.parameters(), lr=0.01)
    last = rank == world - 1
    for step in range(steps):
        x, y = token_batch(step) if case.startswith("tokens") else batch(step)
        pipe.step(x) if rank == 0 else pipe.step(target=y, losses=[]) if last else pipe.step()
        opt.step()
        opt.zero_grad()
    extra = {}
    if case == "select":
        extra = {"selected": pipe.selected, "selection_steps": pipe.selection.steps}
    if case.startswith("tokens"):
        x, y = token_batch(steps)
        before = {k: v.clone() for k, v in stage.state_dict().items()}
        got = pipe.eval_step(x) if rank == 0 else pipe.eval_step(target=y, outputs=True)
        assert all(torch.equal(before[k], v) for k, v in stage.state_dict().items()) and all(
            p.grad is None for p in stage.parameters()
        )
        if last:
            loss, logits = got
            assert logits.shape == (B, V, T)
            extra = {"eval_loss": loss}
    return {**{k: v.detach().clone() for k, v in stage.state_dict().items()}, **extra}


def catch_main(rank: int, schedule: str, out: str) -> None:
    """The skip-a-bad-batch pattern: the last stage's loss raises at step 1, the user catches it
    and goes on; every rank must get a one-line error within seconds, none may hang."""
    import time

    stage = model("mlp")[rank]

    def loss_fn(out, y):
        if step == 1:
            raise ValueError("a bad batch")
        return nn.functional.mse_loss(out, y)

    pipe = umopt.Pipeline(stage, schedule, loss_fn=loss_fn)
    said = []
    t0 = time.monotonic()
    for step in range(3):
        x, y = batch(step)
        try:
            pipe.step(x) if rank == 0 else pipe.step(target=y)
        except Exception as exc:  # the user's skip-a-bad-batch
            said.append(f"{type(exc).__name__}: {exc}")
    torch.save({"said": said, "seconds": time.monotonic() - t0}, os.path.join(out, f"stage{rank}.pt"))
    os._exit(0)


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

    plan, microbatches, store, out, steps = (
        sys.argv[2],
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
        int(sys.argv[6]),
    )
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    stage = model("mlp")[rank]
    runtime = _PipelineScheduleRuntime(
        [PipelineStage(stage, rank, 2, torch.device("cpu"))],
        n_microbatches=microbatches,
        loss_fn=nn.MSELoss(),
    )
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
