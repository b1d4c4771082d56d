"""``umopt run``: execute schedule files in torch.distributed, one process per stage.

Every rank rebuilds the profile's model with the same seed, keeps its stage's layers and plays its
op list through :class:`umopt.pipeline.Pipeline`, the class users run in their own loops: the same
code path, timed op by op here for the report. The zoo's losses are sums over samples; divided by
the minibatch, an iteration's gradients equal those of the whole minibatch in one process.

Several schedules (of one profile) take turns on the same processes, ``--rounds`` times: one
model, trained by each in turn, and one machine state, so that drift meets them all alike; each
gets its own report.

Run locally with ``umopt run`` (it starts a rank per stage), or on several machines with
``torchrun --nnodes ... -m umopt.cli run SCHEDULE [options]`` (each process one rank): the same
code path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import select
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint import (
    file_sha256,
    read_manifest,
    remove_stale,
    stage_file,
    write_manifest,
)
from .costmodel import CostTables, OpKind, Span, Timeline, simulate
from .decide import Decision, decide, is_equal
from .devices import (
    TensorSpec,
    boundary_tensors,
    numerics,
    numerics_differences,
    rank_device,
    reference_ms,
    to_device,
)
from .errors import UmoptError, first_line
from .fileio import write_atomic
from .formats.profile import AllReduceProfile, Profile
from .formats.report import Decision as ReportDecision
from .formats.report import MeasuredPredicted, RunReport, Selection, save_report
from .formats.schedule import Schedule
from .noise import run_warnings
from .pipeline import Pipeline, StepTimer, share_buffers
from .run_options import RunConfig, RunOptions, data_function, preflight
from .selection import (
    MIN_SELECT_ROUNDS,
    TURN_STEPS,
    decide_turns,
    keep_measuring,
    select_budget,
    selection_record,
    winner_of,
)
from .zoo import ModelParts, build_model

__all__ = [
    "StageSetup",
    "build_stage",
    "init_distributed",
    "run_rank",
    "main",
]


# --- one rank ----------------------------------------------------------------------------------


class _StageModule(torch.nn.Module):
    def __init__(self, layers, first: int):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(first + i): m for i, m in enumerate(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers.values():
            x = m(x)
        return x


_log = logging.getLogger("umopt.runtime")


def _slower_s(path: str) -> float:
    """Fault injection for the tests of --decide: UMOPT_FAULT_SLOWER="name:ms[,...]" makes every
    step of schedule ``name`` (its file's stem) take ``ms`` longer, for step times by construction."""
    for spec in filter(None, os.environ.get("UMOPT_FAULT_SLOWER", "").split(",")):
        name, ms = spec.rsplit(":", 1)
        if name == Path(path).stem:
            return float(ms) / 1e3
    return 0.0


_slow_io_s: list[float] = []  # injected: seconds every checkpoint write of this rank takes longer


def _fault(rank: int, step: int, module: torch.nn.Module) -> None:
    """Fault injection for the tests and bench/faults.py:
    UMOPT_FAULT="rank:step:raise|midstep|kill|hang|diskfull|slowio[,...]" (midstep: the stage's
    second forward of that step raises, with the step's messages in flight; slowio: this rank's
    checkpoint writes take UMOPT_FAULT_SLOW_S (5) seconds longer from then on)."""
    for spec in filter(None, os.environ.get("UMOPT_FAULT", "").split(",")):
        r, st, kind = spec.split(":")
        if int(r) != rank or int(st) != step:
            continue
        if kind == "midstep":
            calls = []

            def hook(*_):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError(f"injected fault in the middle of step {step}")

            module.register_forward_pre_hook(hook)
            continue
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":  # as a rank blocked on the GPU or in a collective: it never raises
            threading.Event().wait()
        if kind == "slowio":
            _slow_io_s.append(float(os.environ.get("UMOPT_FAULT_SLOW_S", "5")))
            continue
        if kind == "diskfull":  # from now on this rank cannot write a file over 1 KiB (a real OSError)
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            continue
        raise RuntimeError(f"injected fault at step {step}")


@dataclass
class _Play:
    """One schedule as this rank plays it (a :class:`umopt.pipeline.Pipeline`), and what it measured."""

    pipe: Pipeline
    name: str = ""  # the schedule file's stem, or a candidate's name
    path: str = ""  # the schedule file it came from
    step_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    spans_last: list = field(default_factory=list)
    op_ms: list[list[float]] = field(default_factory=list)  # each op's duration in every measured step
    slower_s: float = 0.0  # injected (UMOPT_FAULT_SLOWER)
    turn_ms: list[float] = field(default_factory=list)  # selection: every step of its turns
    # the model copy it trains: the rank's own, or one of its layout (layers on ranks) where the
    # schedules taking turns place the layers differently (a one-chunk and a V-shaped schedule)
    module: Optional[torch.nn.Module] = None
    opt: Optional[torch.optim.Optimizer] = None
    first: bool = False  # this rank feeds the inputs
    last: bool = False  # this rank computes the loss

    @property
    def schedule(self) -> Schedule:
        return self.pipe.schedule

    @property
    def ops(self) -> list:
        return self.pipe.ops


@dataclass
class StageSetup:
    """One stage's module on its device, and what crosses its edges."""

    module: torch.nn.Module
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input: TensorSpec  # what it receives from the stage before (stage 0: the model's input)
    output: TensorSpec  # what it sends to the stage after (the last stage: the model's output)
    device: torch.device
    dtype: str  # the profile's autocast dtype


def build_stage(profile: Profile, s: int, device: torch.device) -> StageSetup:
    """Stage ``s`` of the profile's model, built with the profile's seed, on ``device``.

    The shapes and dtypes at its edges come from one sample run on ``device`` under the profile's
    autocast, through the layers before it too (each freed after its step): what crosses a link
    under autocast is what the stage before really sends, not what a float32 pass on the CPU gives.
    """
    seed = int(profile.model.model_extra.get("seed", 0))
    parts: ModelParts = build_model(profile.model.name, profile.model.args, seed=seed)
    a, b = profile.stages[s].layers
    module = _StageModule(parts.layers[a:b], a).to(device)
    edges = boundary_tensors(
        parts.layers[:b], parts.make_batch(1, 0)[0], device, profile.device.dtype, release_before=a
    )
    setup = StageSetup(
        module,
        parts.make_batch,
        parts.loss,
        TensorSpec.of(edges[a]),
        TensorSpec.of(edges[b]),
        device,
        profile.device.dtype,
    )
    parts.layers.clear()  # the module holds this stage's layers; the others are not this rank's
    return setup


def build_chunks(profile: Profile, chunks, rank: int, device: torch.device) -> StageSetup:
    """This rank's chunks of a schedule with several per rank, as one ``ModuleList`` (in virtual
    stage order), built with the profile's seed on ``device``; the boundary shapes are agreed by
    the chunked Pipeline itself."""
    seed = int(profile.model.model_extra.get("seed", 0))
    parts: ModelParts = build_model(profile.model.name, profile.model.args, seed=seed)
    mods = [
        _StageModule(parts.layers[lo:hi], lo) for (lo, hi), r in zip(chunks.layers, chunks.ranks) if r == rank
    ]
    spec = TensorSpec.of(parts.make_batch(1, 0)[0])
    setup = StageSetup(
        torch.nn.ModuleList(mods).to(device),
        parts.make_batch,
        parts.loss,
        spec,
        spec,
        device,
        profile.device.dtype,
    )
    parts.layers.clear()
    return setup


@dataclass
class _Rank:
    """What one rank holds for the run: its place in the pipelines, its stage and optimizer, its data."""

    cfg: RunConfig
    device: torch.device
    rank: int
    world: int
    replica: int
    s: int  # its stage
    stage: torch.nn.Module
    opt: torch.optim.Optimizer
    setup: StageSetup
    data_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    timing: StepTimer
    io_group: Any
    run_id: str
    start_step: int
    pipe_group: Any = None
    dp_group: Any = None
    speeds: list[float] = field(
        default_factory=list
    )  # a fixed matmul's time on this rank's device, each round

    def ends(self, chunks) -> tuple[bool, bool]:
        """Whether this rank feeds the inputs and whether it computes the loss, in a layout."""
        if chunks is None:
            return self.s == 0, self.s == self.cfg.num_stages - 1
        return chunks.ranks[0] == self.s, chunks.ranks[-1] == self.s


def _set_up(cfg: RunConfig, device: torch.device) -> _Rank:
    opts = cfg.options
    rank, world = dist.get_rank(), dist.get_world_size()
    S, dp = cfg.num_stages, opts.dp
    if world != S * dp:
        raise UmoptError(
            f"the schedule has {S} stages x --dp {dp} replicas but {world} processes were started"
        )
    replica, s = divmod(rank, S)  # rank r: stage r % S of replica r // S
    pipe_group = dp_group = None
    if dp > 1:  # every rank creates every group, in one order
        pipes = [dist.new_group([k * S + j for j in range(S)]) for k in range(dp)]
        stage_groups = [dist.new_group([k * S + j for k in range(dp)]) for j in range(S)]
        pipe_group, dp_group = pipes[replica], stage_groups[s]
    if device.type == "cpu":
        torch.set_num_threads(opts.threads or int(cfg.profile.device.model_extra.get("threads", 1)))
    chunks = cfg.schedules[0].chunks
    setup = (
        build_stage(cfg.profile, s, device)
        if chunks is None
        else build_chunks(cfg.profile, chunks, s, device)
    )
    opt = _optimizer(opts, setup.module)
    start_step = _resume(cfg, s, setup.module, opt, device) if opts.resume else 0
    io_group = dist.new_group(timeout=timedelta(seconds=io_timeout_s()))  # [Note: two timeouts]
    waiting = "the other ranks to build their stages" + (" and load the checkpoint" if opts.resume else "")
    with _waiting(waiting, io=True):
        drawn = [secrets.token_hex(4) if rank == 0 else None]  # one name for this run's checkpoint files
        dist.broadcast_object_list(drawn, src=0, group=io_group)
    if opts.data:
        data_fn = data_function(opts.data)
    else:
        data_fn = lambda step, n: setup.make_batch(n, step)  # noqa: E731
    return _Rank(
        cfg,
        device,
        rank,
        world,
        replica,
        s,
        setup.module,
        opt,
        setup,
        data_fn,
        StepTimer(device),
        io_group,
        str(drawn[0]),
        start_step,
        pipe_group,
        dp_group,
    )


def _optimizer(opts: RunOptions, module: torch.nn.Module) -> torch.optim.Optimizer:
    lr = opts.lr if opts.lr is not None else (0.01 if opts.optimizer == "sgd" else 1e-3)
    params = list(module.parameters())
    if opts.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def _plays(rk: _Rank, entries: list[tuple[str, str, Schedule]]) -> list[_Play]:
    """A Pipeline for each (name, report path, schedule), over the same stage module; a schedule
    that places the layers otherwise than the first gets a model copy and optimizer of its layout
    (built with the profile's seed: the same starting weights). The zoo's losses are sums over
    samples: divided by the minibatch, the chunks' losses add up to the minibatch's mean, as in
    one process."""
    plays = []
    layouts = {str(rk.cfg.schedules[0].chunks): (rk.stage, rk.opt)}
    for name, path, sched in entries:
        B = sched.minibatch
        key = str(sched.chunks)
        if key not in layouts:
            setup = (
                build_stage(rk.cfg.profile, rk.s, rk.device)
                if sched.chunks is None
                else build_chunks(rk.cfg.profile, sched.chunks, rk.s, rk.device)
            )
            layouts[key] = (setup.module, _optimizer(rk.cfg.options, setup.module))
        module, opt = layouts[key]
        first, last = rk.ends(sched.chunks)
        mine = {"module": module, "opt": opt, "first": first, "last": last}
        if sched.chunks is not None:  # several chunks per rank: a ChunkedPipeline over them
            pipe = Pipeline(
                list(module),
                sched,
                loss_fn=lambda out, y, B=B: rk.setup.loss(out, y) / B,
                loss_reduction="sum",
                profile=rk.cfg.profile,
                device=rk.device,
                timer=rk.timing,
                group=rk.pipe_group,
                dp_group=rk.dp_group,
                on_failure=_report_failure,
                select=False,  # the runtime's own turns choose (_select)
            )
            pipe.prepare(to_device(rk.data_fn(0, B)[0], rk.device) if first else None)
            plays.append(
                _Play(pipe, name, path, op_ms=[[] for _ in pipe.ops], slower_s=_slower_s(name), **mine)
            )
            continue
        pipe = Pipeline(
            module,
            sched,
            rk.s,
            loss_fn=lambda out, y, B=B: rk.setup.loss(out, y) / B,
            loss_reduction="sum",
            profile=rk.cfg.profile,
            device=rk.device,
            input_specs=[rk.setup.input],
            output_specs=[rk.setup.output],
            timer=rk.timing,
            group=rk.pipe_group,
            dp_group=rk.dp_group,
            on_failure=_report_failure,
            select=False,  # the runtime's own turns choose (_select)
        )
        pipe.prepare()  # the boundary shapes agreed now, not inside the first timed step
        plays.append(_Play(pipe, name, path, op_ms=[[] for _ in pipe.ops], slower_s=_slower_s(name), **mine))
    one_chunk = [p.pipe for p in plays if isinstance(p.pipe, Pipeline) and p.module is rk.stage]
    if one_chunk:
        share_buffers(one_chunk)
    return plays


def _step(rk: _Rank, play: _Play, it: int, measured: bool, save_grads: bool) -> float:
    """Step ``it`` of the run with ``play``'s schedule, then the optimizer; the slowest rank's
    time of it (every rank gets the same), recorded in ``play`` where ``measured``."""
    opts, B, dp = rk.cfg.options, play.schedule.minibatch, rk.cfg.options.dp
    _fault(rk.rank, it - rk.start_step, play.module)
    inputs = targets = None
    if play.first or play.last:  # the stages between never touch the data
        x, y = rk.data_fn(it, B * dp)  # the global minibatch: this replica's slice of it
        if len(x) != B * dp or len(y) != B * dp:  # not cut silently: the user meant other samples
            raise UmoptError(
                f"--data {opts.data} returned {len(x)} inputs and {len(y)} targets for step {it}; the minibatch is {B * dp}"
            )
        x, y = x[rk.replica * B : (rk.replica + 1) * B], y[rk.replica * B : (rk.replica + 1) * B]
        inputs = to_device(x, rk.device) if play.first else None
        targets = to_device(y, rk.device) if play.last else None
    _barrier(rk.device)
    timing = rk.timing
    timing.start()
    if rk.rank == 0 and play.slower_s:
        time.sleep(play.slower_s)
    loss_sum = play.pipe.step(inputs, targets=targets)
    spans = list(play.pipe.spans)
    # the gradients themselves, not copies: neither optimizer as built changes a gradient in
    # place, and zero_grad only drops the parameters' references to them
    grads = (
        {k: p.grad for k, p in play.module.named_parameters() if p.grad is not None} if save_grads else None
    )
    t_opt = timing.mark()
    play.opt.step()
    play.opt.zero_grad(set_to_none=True)
    spans.append(("OPT", 0, 0, t_opt, timing.mark()))
    elapsed = timing.stop()
    if grads is not None and rk.replica == 0:  # outside the step's time; the replicas' gradients are equal
        Path(opts.save_grads).mkdir(parents=True, exist_ok=True)
        _save_atomic(
            {k: g.detach().cpu() for k, g in grads.items()}, Path(opts.save_grads) / f"grads_stage{rk.s}.pt"
        )
    worst = torch.tensor([elapsed], dtype=torch.float64).to(rk.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ms = float(worst.item())
    if play.last:
        play.losses.append(float(loss_sum))
    if measured:
        play.step_ms.append(ms)
        play.spans_last = [(k, lo, hi, timing.ms(t0), timing.ms(t1)) for k, lo, hi, t0, t1 in spans]
        for d, (_, _, _, t0, t1) in zip(play.op_ms, spans[: len(play.ops)]):
            d.append(timing.ms(t1) - timing.ms(t0))
    return ms


class _Steps:
    """The run's step counter: each step's checkpoint (--checkpoint-every) and progress follow it."""

    def __init__(self, rk: _Rank, total: int, progress: Optional[_Progress]):
        self.rk, self.it, self.last, self.progress = rk, rk.start_step, rk.start_step + total - 1, progress

    def play(self, play: _Play, measured: bool, end_of_round: bool) -> float:
        rk, opts = self.rk, self.rk.cfg.options
        ms = _step(rk, play, self.it, measured, bool(opts.save_grads) and self.it == self.last)
        self.it += 1
        if self.progress:
            self.progress.step(
                f"round {len(rk.speeds)}, {play.name}", ms, play.schedule.predicted.iteration_ms, end_of_round
            )
        every = opts.checkpoint_every
        if opts.checkpoint and every and (self.it - rk.start_step) % every == 0 and self.it <= self.last:
            _checkpoint(rk.cfg, rk.s, rk.stage, rk.opt, self.it, rk.run_id, rk.io_group)
            _phase("the steps")
        return ms


def _turns(rk: _Rank, plays: list[_Play], steps: _Steps) -> tuple[int, Optional[Decision]]:
    """The schedules given take turns, --rounds times (with --decide until decided), so that
    whatever drifts on the machine meets each alike. Returns the rounds played and the decision."""
    opts = rk.cfg.options
    decision: Optional[Decision] = None
    began = time.monotonic()
    turn = 0
    while turn < opts.rounds or (decision is not None and not decision.decided):
        if turn >= opts.rounds and not _another_round(opts, turn, time.monotonic() - began, rk.device):
            break
        rk.speeds.append(reference_ms(rk.device))
        for k, play in enumerate(plays):
            n = (opts.warmup if turn == 0 else 0) + opts.steps
            for j in range(n):
                steps.play(
                    play,
                    measured=turn > 0 or j >= opts.warmup,
                    end_of_round=j == n - 1 and k == len(plays) - 1,
                )
        turn += 1
        if opts.decide is not None:  # every rank has the same step times (all-reduced), so the same decision
            decision = _decision(plays, opts.steps, opts.decide)
    return turn, decision


def run_rank(cfg: RunConfig, device: torch.device) -> None:
    opts = cfg.options
    rk = _set_up(cfg, device)
    sched = cfg.schedules[0]
    selecting = _selects(cfg)
    budget = select_budget(opts.steps, opts.select_steps, 1 + len(sched.candidates)) if selecting else 0
    if selecting:  # [Note: selection while training] (umopt/selection.py)
        pick = sched.solver.model_extra.get("recommended") or "pick"
        entries = [(pick, opts.schedules[0], sched)]
        if budget:  # the candidates' Pipelines only where they will play
            entries += [
                (c.name, opts.schedules[0], sched.candidate_schedule(k))
                for k, c in enumerate(sched.candidates)
            ]
    else:
        entries = [(Path(p).stem, p, sc) for p, sc in zip(opts.schedules, cfg.schedules)]
    plays = _plays(rk, entries)
    total = (
        len(plays) * (opts.warmup + opts.rounds * opts.steps)
        if not selecting
        else len(plays) * opts.warmup + opts.steps
    )
    if rk.rank == 0:
        _log.info(
            "%d ranks (%d stages x %d replicas), %s on %s: %s",
            rk.world,
            cfg.num_stages,
            opts.dp,
            opts.backend,
            device.type,
            ", ".join(p.name for p in plays),
        )
    steps = _Steps(rk, total, _Progress(None if opts.decide else total) if rk.rank == 0 else None)
    _phase("the steps")
    selection = None
    if selecting:
        winner, selection = _select(rk, plays, steps, budget, [c.name for c in sched.candidates])
        for _ in range(opts.steps - selection.steps):  # the rest of the run: the winner alone
            steps.play(winner, measured=True, end_of_round=False)
        reported, rounds, decision = [winner], 1, None
    else:
        rounds, decision = _turns(rk, plays, steps)
        reported = plays
    if opts.checkpoint:
        _checkpoint(cfg, rk.s, rk.stage, rk.opt, steps.it, rk.run_id, rk.io_group)
    _phase("the report")
    differ = numerics_differences(
        cfg.profile.device.numerics, numerics()
    )  # as the profile timed its kernels?
    for play in reported:
        gathered: list = [None] * rk.world
        medians = [[op[0], op[1], op[2], statistics.median(d)] for op, d in zip(play.ops, play.op_ms)]
        mine = {
            "spans": play.spans_last,
            "losses": play.losses,
            "op_ms": medians,
            "reference_ms": statistics.median(rk.speeds),
            "numerics_differ": differ,
        }
        with _waiting("the other ranks' measurements", io=True):  # rank 0 writes the last report meanwhile
            dist.all_gather_object(gathered, mine, group=rk.io_group)
        if rk.rank == 0:  # replica 0's stages (the others ran the same ops on their own samples)
            _report(cfg, play, gathered[: cfg.num_stages], rounds, decision, selection)


def _round_medians(step_ms: list[float], steps: int) -> list[float]:
    """A schedule's median step in each round (``steps`` measured steps a round)."""
    return [statistics.median(step_ms[k : k + steps]) for k in range(0, len(step_ms), steps)]


def _decision(plays: list[_Play], steps: int, confidence: float) -> Decision:
    rounds = {p.name: _round_medians(p.step_ms, steps) for p in plays}
    # the equal schedules are the reference; with none among them, the first (the solve's pick)
    equal = [p.name for p in plays if is_equal(p.schedule.op_lists())] or [plays[0].name]
    return decide(rounds, equal, confidence=confidence)


def _selects(cfg: RunConfig) -> bool:
    opts = cfg.options
    return (
        opts.select
        and len(cfg.schedules) == 1
        and bool(cfg.schedules[0].candidates)
        and opts.decide is None
        and opts.rounds == 1
    )


def _select(
    rk: _Rank, plays: list[_Play], steps: _Steps, budget: int, rivals: list[str]
) -> tuple[_Play, Selection]:
    """[Note: selection while training]: the winner, and what was measured to choose it."""
    opts = rk.cfg.options
    for play in plays:  # warm-ups, not measured
        for _ in range(opts.warmup):
            steps.play(play, measured=False, end_of_round=False)
    decision, rounds, winner, spent = None, 0, 0, 0
    active = list(range(len(plays)))
    while budget and spent + TURN_STEPS * len(active) <= budget:
        rk.speeds.append(reference_ms(rk.device))
        for n, k in enumerate(active):
            for j in range(TURN_STEPS):  # the first step of a turn follows another schedule's: not measured
                last = j == TURN_STEPS - 1
                ms = steps.play(plays[k], measured=last, end_of_round=last and n == len(active) - 1)
                plays[k].turn_ms.append(ms)
        spent += TURN_STEPS * len(active)
        rounds += 1
        if rounds < MIN_SELECT_ROUNDS:
            continue
        decision = decide_turns(plays)
        said = torch.zeros(3, dtype=torch.int64)
        if rk.rank == 0:  # rank 0's call, for every rank
            stop, left = keep_measuring(plays, active, decision, opts.steps)
            said = torch.tensor([stop, winner_of(plays, decision), sum(1 << k for k in left)])
        said = said.to(rk.device)
        dist.broadcast(said, src=0)
        winner = int(said[1].item())
        active = [k for k in range(len(plays)) if int(said[2].item()) >> k & 1]
        if bool(said[0].item()):
            break
    if not rk.speeds:
        rk.speeds.append(reference_ms(rk.device))
    chosen = plays[winner]
    record = selection_record(plays, chosen, decision, spent, opts.steps, len(rivals))
    if spent < opts.steps:  # the winner's figures are those of the steps after selection
        chosen.step_ms, chosen.op_ms = [], [[] for _ in chosen.ops]
    if rk.rank == 0:
        _log.info("selected %s: %s", chosen.name, record.reason)
        for p in plays:
            _log.debug("%s: turns %s", p.name, " ".join(f"{ms:.2f}" for ms in p.turn_ms))
    return chosen, record


def _another_round(opts: RunOptions, turn: int, spent_s: float, device: torch.device) -> bool:
    """Whether an undecided comparison gets another round: rank 0's clock says, for every rank."""
    more = torch.tensor(
        [turn < opts.max_rounds and spent_s * (turn + 1) / turn <= opts.budget], dtype=torch.int32
    ).to(device)
    dist.broadcast(more, src=0)
    return bool(more.item())


def _save_atomic(obj, path: Path) -> None:
    try:
        write_atomic(path, lambda tmp: torch.save(obj, tmp))
    except (OSError, RuntimeError) as exc:
        # torch.save reports a full disk as "unexpected pos 128 vs 0": say what failed, and how
        # much room there was
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        first = first_line(exc, 120) or exc.__class__.__name__
        raise OSError(
            f"cannot write {path} ({free / 2**20:.0f} MiB free there; disk full or a file size limit?): {first}"
        ) from None


def _checkpoint(
    cfg: RunConfig,
    s: int,
    stage: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    run_id: str,
    io_group,
) -> None:
    """This stage's part of the checkpoint set of ``step`` (:mod:`umopt.checkpoint`): its file,
    then, once every stage has written its own, the manifest (rank 0), then the old files go.
    Replica 0 writes (with --dp the replicas' states are equal)."""
    _phase(f"the checkpoint of step {step}")
    folder = Path(cfg.options.checkpoint)
    name = stage_file(s, step, run_id)
    writes = dist.get_rank() < cfg.num_stages
    if writes:
        time.sleep(sum(_slow_io_s))
        _save_atomic(
            {"model": stage.state_dict(), "optimizer": opt.state_dict(), "step": step}, folder / name
        )
    hashes: list = [None] * dist.get_world_size()
    with _waiting(f"every stage's checkpoint file of step {step}", io=True):
        dist.all_gather_object(
            hashes, file_sha256(folder / name) if writes else None, group=io_group
        )  # returns once every stage has written
    if dist.get_rank() == 0:
        schedules = [
            {"path": str(p), "sha256": hashlib.sha256(Path(p).read_bytes()).hexdigest()}
            for p in cfg.options.schedules
        ]
        write_manifest(
            folder, step, run_id, cfg.profile, cfg.options.optimizer, hashes[: cfg.num_stages], schedules
        )
    with _waiting(f"the checkpoint manifest of step {step}", io=True):
        _barrier(next(stage.parameters()).device, io_group)
    if writes:
        remove_stale(folder, s, name)


def _resume(
    cfg: RunConfig, s: int, stage: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device
) -> int:
    """Load this stage's file of the folder's last complete set; the step it was written after."""
    man = read_manifest(cfg.options.checkpoint, cfg.profile, cfg.options.optimizer, verify=[s])
    path = Path(cfg.options.checkpoint) / man.files[s].path
    try:
        # weights_only: a checkpoint is data; unpickling anything else could run code
        state = torch.load(path, map_location=device, weights_only=True)
        stage.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, it is not this stage's state
        first = first_line(exc)
        raise UmoptError(
            f"--resume: {path} is not stage {s}'s state ({exc.__class__.__name__}: {first})"
        ) from None
    return man.step


def _measured_timeline(per_rank: list) -> Timeline:
    spans = []
    busy = []
    for s, rec in enumerate(per_rank):
        mine = [Span(s, k, lo, hi, t0, t1) for k, lo, hi, t0, t1 in rec["spans"] if k in (OpKind.F, OpKind.B)]
        spans.append(mine)
        busy.append(sum(sp.end - sp.start for sp in mine))
    end = max((t1 for rec in per_rank for k, lo, hi, t0, t1 in rec["spans"]), default=0.0)
    finish = [sp[-1].end if sp else 0.0 for sp in spans]
    # the all-reduce span (data-parallel replicas) runs from the stage's last op to its end
    ar = [
        max([t1 for k, lo, hi, t0, t1 in rec["spans"] if k == "AR"], default=f) - f
        for rec, f in zip(per_rank, finish)
    ]
    return Timeline(
        iteration_ms=end, busy_ms=busy, peak_memory_bytes=[], spans=spans, finish_ms=finish, allreduce_ms=ar
    )


def run_allreduce(cfg: RunConfig, schedule: Schedule) -> Optional[AllReduceProfile]:
    """The all-reduce the prediction of ``schedule`` includes with ``--dp`` replicas: at the speed
    the schedule was solved with, else the one its profile measured (None: one pipeline, or no
    speed known, which the report says)."""
    speed = schedule.dp or cfg.profile.allreduce
    return (
        None
        if cfg.options.dp <= 1 or speed is None
        else speed.model_copy(update={"replicas": cfg.options.dp})
    )


def _report(
    cfg: RunConfig,
    play: _Play,
    per_rank: list,
    rounds: int,
    decision: Optional[Decision],
    selection: Optional[Selection],
) -> None:
    """Schedule ``play``'s report: logged, written, traced and plotted where asked."""
    opts = cfg.options
    k = opts.schedules.index(play.path)
    tl = _measured_timeline(per_rank)
    allreduce = run_allreduce(cfg, play.schedule)
    tables = CostTables.from_profile(
        cfg.profile, play.schedule.recompute, allreduce, play.schedule.chunking()
    )
    pred_tl = simulate(tables, play.schedule.op_lists(), play.schedule.minibatch)
    report = _run_report(cfg, play, per_rank, (tl, pred_tl), rounds, decision, selection, allreduce)
    measured, predicted = report.measured_iteration_ms, report.predicted_iteration_ms
    report_path, trace_path, plot_path = (cfg.output(t, k) for t in (opts.report, opts.trace, opts.plot))
    _log.info(
        "%s: measured %.2f ms, predicted %.2f ms (measured / predicted %.3f) over %d steps%s",
        play.name,
        measured,
        predicted,
        measured / predicted,
        len(play.step_ms),
        f"; report {report_path}" if opts.report else "",
    )
    if decision is not None and k == len(cfg.schedules) - 1:
        _log.info(
            "keep %s: %s%s",
            decision.winner,
            decision.reason,
            "" if decision.decided else " (not decided when the turns ended)",
        )
    for line in run_warnings(report):
        _log.warning(line)
    if report_path:
        save_report(report, report_path)
    panels = [("predicted", pred_tl), ("measured (last step)", tl)]
    if trace_path:
        from .trace import write_trace

        write_trace(panels, trace_path)
    if plot_path:
        from .plot import gantt

        gantt(
            panels,
            plot_path,
            title=f"{cfg.profile.model.name}: measured {measured:.1f} ms vs predicted {predicted:.1f} ms",
        )


def _run_report(
    cfg: RunConfig,
    play: _Play,
    per_rank: list,
    timelines: tuple[Timeline, Timeline],
    rounds: int,
    decision: Optional[Decision],
    selection: Optional[Selection],
    allreduce: Optional[AllReduceProfile],
) -> RunReport:
    """The report of one schedule: its measured timeline (last step) beside the simulator's."""
    opts, schedule, step_ms = cfg.options, play.schedule, play.step_ms
    tl, pred_tl = timelines
    measured = statistics.median(step_ms)
    predicted = pred_tl.iteration_ms  # the simulator's, not what the file says
    return RunReport(
        schedule=str(play.path),
        profile=cfg.profile.path,
        backend=opts.backend,
        stages=cfg.num_stages,
        dp=opts.dp,
        allreduce=allreduce,  # what the prediction took each stage's all-reduce to cost (None: one pipeline, or left out)
        minibatch=schedule.minibatch,
        recompute=schedule.recompute,
        steps=len(step_ms),
        warmup=opts.warmup,
        rounds=rounds,
        round_ms=_round_medians(step_ms, opts.steps),
        schedules_in_turn=len(cfg.schedules),  # the schedules that took turns with it on the same processes
        measured_iteration_ms=measured,
        predicted_iteration_ms=predicted,
        measured_over_predicted=measured / predicted,
        step_ms=step_ms,
        busy_ms=MeasuredPredicted(measured=tl.busy_ms, predicted=pred_tl.busy_ms),
        allreduce_ms=MeasuredPredicted(measured=tl.allreduce_ms, predicted=pred_tl.allreduce_ms)
        if opts.dp > 1
        else None,
        # per stage, every op with its median measured duration and the profile's: what
        # `umopt calibrate` fits a profile to
        ops=[
            [(kind, lo, hi, ms, sp.end - sp.start) for (kind, lo, hi, ms), sp in zip(rec["op_ms"], pred)]
            for rec, pred in zip(per_rank, pred_tl.spans)
        ],
        losses=per_rank[schedule.chunks.ranks[-1] if schedule.chunks is not None else -1]["losses"],
        reference_ms=[rec["reference_ms"] for rec in per_rank],
        numerics_differ=sorted({d for rec in per_rank for d in rec.get("numerics_differ", [])}),
        decision=None
        if decision is None
        else ReportDecision(
            winner=decision.winner,
            reference=decision.reference,
            confidence=decision.confidence,
            decided=decision.decided,
            confidence_asked=opts.decide,
            reason=decision.reason,
        ),
        selection=selection,
        **({"chunks": schedule.chunks.model_dump()} if schedule.chunks is not None else {}),
    )


def init_distributed(backend: str, timeout_s: float) -> torch.device:
    """Join the process group and return this rank's device.

    Under NCCL the device is set from LOCAL_RANK *before* the group exists and handed to it
    (``device_id``), so that NCCL binds each rank to its own GPU at once instead of guessing
    (and barriers do not hang on a device nobody uses).
    """
    device = rank_device(backend)
    # `umopt run` gives its ranks a file store (no port to listen on); torchrun, env:// as usual
    store = os.environ.get("UMOPT_STORE")
    where = (
        dict(
            init_method=f"file://{store}",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
        if store
        else {}
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device, **where)
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **where)
    return device


def _barrier(device: torch.device, group=None) -> None:
    dist.barrier(group=group, device_ids=[device.index]) if device.type == "cuda" else dist.barrier(
        group=group
    )


# [Note: two timeouts]
# A wait in the steps (a message, the step's all-reduce, its barrier) that lasts a minute has a
# dead or hung peer behind it; a wait behind another rank's file I/O (writing and hashing a
# checkpoint, loading one with --resume, writing the report and its plot) can rightly last many
# minutes. NCCL's watchdog reads one timeout per process group, so the I/O waits run on a group of
# their own: the world's timeout is UMOPT_TIMEOUT_S (60 s), theirs UMOPT_IO_TIMEOUT_S (1800 s). A
# wait that fails says which it was (_waiting), and the status file says what a rank was doing,
# so a rank that NCCL's watchdog aborts (SIGABRT, no Python left to speak) is named with it.
def step_timeout_s() -> float:
    return float(os.environ.get("UMOPT_TIMEOUT_S", "60"))


def io_timeout_s() -> float:
    return float(os.environ.get("UMOPT_IO_TIMEOUT_S", "1800"))


# what this rank tells its launcher it is doing (set by main: the rank's status file)
_status: Callable[..., None] = lambda *_, **__: None  # noqa: E731


_reported: list[BaseException] = []


def _report_failure(exc: BaseException) -> None:
    """The rank's "failed" status, once: the first failure is the cause, what follows its echo."""
    if _reported:
        return
    _reported.append(exc)
    first = first_line(exc, 1000)
    _status("failed", f"{exc.__class__.__name__}: {first}" if first else exc.__class__.__name__)


def _phase(what: str) -> None:
    _status("started", phase=what)


def _setup_logging(rank: int) -> None:
    """Rank-prefixed lines on stderr. Under torchrun rank 0 says what it does (INFO) and the others
    only warn; ``umopt run`` passes its -v / -q as UMOPT_LOG_LEVEL."""
    level = os.environ.get("UMOPT_LOG_LEVEL") or ("INFO" if rank == 0 else "WARNING")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RankFormatter(rank))
    logging.basicConfig(handlers=[handler], level=level, force=True)


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        kind = (
            "warning: "
            if record.levelno == logging.WARNING
            else "error: "
            if record.levelno >= logging.ERROR
            else ""
        )
        return f"[rank {self.rank}] umopt: {kind}{record.getMessage()}"


class _Progress:
    """Rank 0's steps: to the launcher's status file (``umopt run`` draws them) at most once a
    second, and as a log line at most every ``every`` seconds and at each round's end."""

    def __init__(self, total: Optional[int], every: float = 10.0):
        self.total, self.every = total, every
        self.done, self.t_status, self.t_log = 0, 0.0, time.monotonic()

    def step(self, what: str, ms: float, predicted_ms: float, end_of_round: bool) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.t_status >= 1.0 or end_of_round:
            _status(
                "started", phase="the steps", progress={"done": self.done, "total": self.total, "what": what}
            )
            self.t_status = now
        if now - self.t_log >= self.every or end_of_round:
            of = f"/{self.total}" if self.total else ""
            _log.info("step %d%s, %s: %.1f ms (predicted %.1f ms)", self.done, of, what, ms, predicted_ms)
            self.t_log = now


@contextmanager
def _waiting(what: str, io: bool = False):
    """A wait for the other ranks, named in its failure, with the bound it had (see [Note: two timeouts])."""
    bound = f"UMOPT_IO_TIMEOUT_S={io_timeout_s():g} s" if io else f"UMOPT_TIMEOUT_S={step_timeout_s():g} s"
    _phase(f"a wait for {what} (at most {bound})")
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - whatever broke the wait, say which wait it was
        raise UmoptError(
            f"waiting for {what} (at most {bound}): {exc.__class__.__name__}: {first_line(exc, 300)}"
        ) from None


def _exit_on_termination(status: Callable[[str, str], None]) -> None:
    """End this rank at once, with a status line, on SIGTERM or SIGINT or when its parent (the
    launcher or the torchrun agent) is gone.

    The launcher (and torchrun) stops the other ranks with SIGTERM when one fails; a rank waiting inside NCCL or
    gloo never returns to Python, so a Python signal handler would not run until the wait times
    out. The signal's number reaches a pipe (``signal.set_wakeup_fd``) whatever the main thread
    is doing, and a thread watching that pipe writes the status and leaves; the status then tells
    the launcher that this rank was stopped, not that it failed.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # the watcher acts; without a handler SIGTERM kills silently
    # the launcher says who it is: had it died while this rank was starting, getppid() here
    # would already name the process that adopted the orphan
    parent = int(os.environ.get("UMOPT_LAUNCHER_PID", os.getppid()))

    def watch() -> None:
        while True:
            ready, _, _ = select.select([r], [], [], 0.5)
            got = os.read(r, 64) if ready else b""
            for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
                if int(sig) in got:
                    if _reported:  # it failed first and was stopped while leaving: keep "failed"
                        os._exit(1)
                    status("terminated", signal.Signals(sig).name)
                    os._exit(code)
            if os.getppid() != parent:
                # nobody is left to read the status folder: the first rank out removes it
                if os.environ.get("UMOPT_STATUS_DIR"):
                    shutil.rmtree(os.environ["UMOPT_STATUS_DIR"], ignore_errors=True)
                os._exit(143)

    threading.Thread(target=watch, name="umopt-termination", daemon=True).start()


# [Note: a failed rank leaves at once]
# A rank that raises writes its status and traceback first and then leaves with os._exit, never
# through destroy_process_group: under NCCL that waits for the communicators' in-flight kernels,
# and a rank that failed in the middle of a step (a CUDA out-of-memory error, say) has receives
# posted that will never complete, so it would block until the watchdog's SIGABRT and its error
# would be lost ("ended without a word"). Leaving frees the communicators with the process; the
# launcher (or torchrun) then stops the other ranks. gloo does not wait, which is why only a GPU
# showed it.
def main(options: Optional[RunOptions] = None) -> None:
    """Entry point of each rank: ``umopt run`` under torchrun hands it its options, the ranks
    ``umopt run`` starts itself (``python -m umopt.runtime OPTIONS.json``) read them from the
    launcher's file."""
    global _status
    status_dir = os.environ.get("UMOPT_STATUS_DIR")
    rank = int(os.environ.get("RANK", "0"))

    def status(state: str, message: str = "", phase: str = "", progress: Optional[dict] = None) -> None:
        # not into a folder the launcher has removed (it has stopped waiting for this rank)
        if status_dir and Path(status_dir).is_dir():
            line = json.dumps(
                {
                    "state": state,
                    "time": time.time(),
                    "message": message,
                    "phase": phase,
                    "progress": progress,
                }
            )
            write_atomic(Path(status_dir) / f"rank{rank}", lambda tmp: Path(tmp).write_text(line))

    _status = status
    status("started", phase="set-up")
    _setup_logging(rank)

    _exit_on_termination(status)
    try:
        opts = options if options is not None else RunOptions.read(sys.argv[1])
        cfg = preflight(opts, verify_stages=[])  # each rank checks its own checkpoint file
        device = init_distributed(cfg.backend, step_timeout_s())
        run_rank(cfg, device)
        dist.destroy_process_group()
    except BaseException as exc:  # see [Note: a failed rank leaves at once]
        _report_failure(exc)  # unless the Pipeline already did, before its links broke
        if not isinstance(exc, (UmoptError, KeyboardInterrupt)):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    status("done")
    # Leave without running C++ static destructors: after a finished run, gloo's threads
    # sometimes abort there ("terminate called without an active exception", SIGABRT), which
    # turned finished runs into failures. Everything this rank writes is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
