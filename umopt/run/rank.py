"""One rank of ``umopt run``: build its part of the profile's model, play the schedule, report.

Every rank rebuilds the profile's model with the same seed, keeps its stage's layers (or its
chunks) and plays its op list through :class:`umopt.run.pipeline.Pipeline`, the class users run
in their own loops, its selection of a schedule file's candidates included: the same code path,
timed op by op here for the report. The zoo's losses are sums over samples; divided by the
minibatch, an iteration's gradients equal those of the whole minibatch in one process.

Several schedule files (of one profile) take turns on the same processes, ``--rounds`` times:
one model per layout, trained by each in turn, and one machine state, so that drift meets them
all alike; each gets its own report.

A plan for sequences of different lengths (``umopt solve --lengths``) trains on a minibatch of
sequences each step, each step planned anew by its method while the step before runs
(:mod:`umopt.run.feed`); several methods (``--methods umopt,pad,pack``) take turns as schedules
do, every method of a round on the same minibatches, so that their tokens per second compare.

Run locally with ``umopt run`` (it starts a rank per stage, :mod:`umopt.run.launch`), or on
several machines with ``torchrun --nnodes ... -m umopt.cli run SCHEDULE [options]`` (each
process one rank): the same code path.
"""

from __future__ import annotations

import logging
import os
import secrets
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..costmodel import Chunking, OpKind, simulate
from ..devices import (
    TensorSpec,
    boundary_tensors,
    numerics,
    numerics_differences,
    rank_device,
    reference_ms,
    replica_cores,
    to_device,
)
from ..errors import UmoptError, first_line
from ..formats.profile import Profile
from ..formats.report import LengthsRun, Selection
from ..formats.schedule import Schedule
from ..measure.decide import Decision, decide, is_equal
from ..measure.memory import held_bytes, peak_during, state_tensors
from ..parts import Layers, ModelParts, Sequences
from ..predict import schedule_tables
from ..samplers import cut_note
from ..search.methods import METHODS, UMOPT
from ..zoo import build_model
from . import checkpoint, faults
from .comm import TorchComm
from .feed import SequenceFeed, sequence_source
from .losses import valid_targets
from .options import RunConfig, RunOptions, data_function, lengths_spec, preflight
from .pipeline import Pipeline
from .player import StepTimer
from .report import Measured, run_allreduce, write_report
from .signals import (
    Progress,
    exit_on_termination,
    io_timeout_s,
    phase,
    report_failure,
    setup_logging,
    status_writer,
    step_timeout_s,
    waiting,
)

__all__ = ["StageSetup", "build_stage", "build_chunks", "init_distributed", "run_rank", "main"]

_log = logging.getLogger("umopt.runtime")


class StageModule(Layers):
    """A stage's (or a chunk's) layers, run one after the other, named by their index in the model."""

    def __init__(self, layers, first: int):
        torch.nn.Module.__init__(self)
        self.layers = torch.nn.ModuleDict({str(first + i): m for i, m in enumerate(layers)})


@dataclass
class StageSetup:
    """One rank's modules on its device (a stage, or its chunks in virtual stage order), and what
    crosses the edges of a one-chunk stage."""

    modules: list[torch.nn.Module]
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input: Optional[
        TensorSpec
    ]  # what the stage receives (stage 0: the model's input); None: agreed by the Pipeline
    output: Optional[TensorSpec]
    device: torch.device
    dtype: str  # the profile's autocast dtype
    sequences: Optional[Sequences] = None  # how the model takes sequences of different lengths
    tied: dict[str, torch.nn.Parameter] = field(default_factory=dict)  # [Note: tied weights]

    @property
    def module(self) -> torch.nn.Module:
        """All of the rank's layers as one module (its state is the checkpoint's)."""
        return self.modules[0] if len(self.modules) == 1 else torch.nn.ModuleList(self.modules)


def build_stage(profile: Profile, s: int, device: torch.device) -> StageSetup:
    """Stage ``s`` of the profile's model, built with the profile's seed, on ``device``.

    The shapes and dtypes at its edges come from one sample run on ``device`` under the profile's
    autocast, through the layers before it too (each freed after its step): what crosses a link
    under autocast is what the stage before really sends, not what a float32 pass on the CPU gives.
    """
    parts: ModelParts = build_model(profile.model.name, profile.model.args, seed=profile.model.seed)
    a, b = profile.stages[s].layers
    module = StageModule(parts.layers[a:b], a).to(device)
    edges = boundary_tensors(
        parts.layers[:b], parts.make_batch(1, 0)[0], device, profile.device.dtype, release_before=a
    )
    setup = StageSetup(
        [module],
        parts.make_batch,
        parts.loss,
        TensorSpec.of(edges[a]),
        TensorSpec.of(edges[b]),
        device,
        profile.device.dtype,
        parts.sequences,
        parts.tied_in(range(a, b), parts.layers[a:b]),
    )
    parts.layers.clear()  # the module holds this stage's layers; the others are not this rank's
    return setup


def build_chunks(profile: Profile, chunks: Chunking, rank: int, device: torch.device) -> StageSetup:
    """This rank's chunks of a schedule with several per rank (in virtual stage order), built with
    the profile's seed on ``device``; the boundary shapes are agreed by the Pipeline itself."""
    parts: ModelParts = build_model(profile.model.name, profile.model.args, seed=profile.model.seed)
    mine = [(lo, hi) for (lo, hi), r in zip(chunks.layers, chunks.ranks) if r == rank]
    mods = [StageModule(parts.layers[lo:hi], lo).to(device) for lo, hi in mine]
    held = [i for lo, hi in mine for i in range(lo, hi)]
    setup = StageSetup(
        mods,
        parts.make_batch,
        parts.loss,
        None,
        None,
        device,
        profile.device.dtype,
        parts.sequences,
        parts.tied_in(held, [parts.layers[i] for i in held]),
    )
    parts.layers.clear()
    return setup


def _build(profile: Profile, chunks: Optional[Chunking], s: int, device: torch.device) -> StageSetup:
    return build_stage(profile, s, device) if chunks is None else build_chunks(profile, chunks, s, device)


@dataclass
class _Rank:
    """What one rank holds for the run: its place in the pipelines, its stage and optimizer, its data."""

    cfg: RunConfig
    device: torch.device
    rank: int
    world: int
    replica: int
    s: int  # its stage (its rank in the pipeline)
    setup: StageSetup
    opt: torch.optim.Optimizer
    data_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    timing: StepTimer
    io_group: Any
    run_id: str
    start_step: int
    pipe_ranks: list[int]  # the global ranks of this rank's pipeline, by stage
    dp_group: Any = None
    speeds: list[float] = field(
        default_factory=list
    )  # a fixed matmul's time on this rank's device, each round
    feed: Optional[SequenceFeed] = None  # sequences of different lengths: each step's, and its plan

    def ends(self, chunks: Optional[Chunking]) -> tuple[bool, bool]:
        """Whether this rank feeds the inputs and whether it computes the loss, in a layout."""
        if chunks is None:
            return self.s == 0, self.s == self.cfg.num_stages - 1
        return chunks.ranks[0] == self.s, chunks.ranks[-1] == self.s


def _set_up(cfg: RunConfig, device: torch.device) -> _Rank:
    opts = cfg.options
    comm = TorchComm.current()
    rank, world = comm.rank, comm.world
    S, dp = cfg.num_stages, cfg.dp
    if world != S * dp:
        raise UmoptError(
            f"the schedule has {S} stages x --dp {dp} replicas but {world} processes were started"
        )
    replica, s = divmod(rank, S)  # rank r: stage r % S of replica r // S
    dp_group = None
    if dp > 1:  # a group per stage over its replicas: disjoint, so one split makes them all
        dp_group = comm.split([[k * S + j for k in range(dp)] for j in range(S)])
    if device.type == "cpu":
        torch.set_num_threads(opts.threads or cfg.profile.device.threads or 1)
        cores = replica_cores(replica, dp, world)
        if cores is not None:
            os.sched_setaffinity(0, cores)
    setup = _build(cfg.profile, cfg.schedules[0].chunks, s, device)
    opt = _optimizer(opts, setup.module)
    start_step = _resume(cfg, s, setup.module, opt, device) if opts.resume else 0
    io_group = comm.world_group(io_timeout_s())  # [Note: two timeouts]
    with waiting(
        "the other ranks to build their stages" + (" and load the checkpoint" if opts.resume else ""), io=True
    ):
        # one name for this run's checkpoint files
        drawn = comm.broadcast_object(secrets.token_hex(4) if rank == 0 else None, 0, io_group)
    data_fn = data_function(opts.data) if opts.data else (lambda step, n: setup.make_batch(n, step))
    feed = _feed(cfg, setup, replica, s) if cfg.varlen else None
    return _Rank(
        cfg,
        device,
        rank,
        world,
        replica,
        s,
        setup,
        opt,
        data_fn,
        StepTimer(device),
        io_group,
        str(drawn),
        start_step,
        [replica * S + j for j in range(S)],
        dp_group,
        feed=feed,
    )


def _feed(cfg: RunConfig, setup: StageSetup, replica: int, s: int) -> Optional[SequenceFeed]:
    """The sequences of the ranks that hold them (the first and last stage of each replica), and
    the plans, made by each replica's first stage."""
    if s not in (0, cfg.num_stages - 1):
        return None
    opts, sched, profile = cfg.options, cfg.schedules[0], cfg.profile
    assert sched.lengths is not None and profile.lengths is not None
    source = sequence_source(
        data_function(opts.data) if opts.data else None,
        setup.sequences.make if setup.sequences is not None else None,
        lengths_spec(opts.lengths) if opts.lengths else None,
        sched,
        profile.lengths.max_length,
        f"--data {opts.data}" if opts.data else f"model {profile.model.name}",
    )
    return SequenceFeed(
        source,
        len(sched.lengths.lengths) * cfg.dp,
        cfg.dp,
        replica,
        profile,
        sched.recompute,
        run_allreduce(cfg, sched),
        {m: sc.chunking() for m, sc in zip(cfg.methods, cfg.schedules)} if s == 0 else {},
        dict(zip(cfg.methods, cfg.assigns)),
    )


def _optimizer(opts: RunOptions, module: torch.nn.Module) -> torch.optim.Optimizer:
    lr = opts.lr if opts.lr is not None else (0.01 if opts.optimizer == "sgd" else 1e-3)
    params = list(module.parameters())
    if opts.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


KEPT_PLANS = 64  # measured steps of sequences whose plans and ops a report keeps (the last ones)


@dataclass
class _Play:
    """One schedule file as this rank plays it (a Pipeline over a model copy of its layout), and
    what it measured."""

    pipe: Pipeline
    name: str  # the schedule file's stem (with selection: the schedule kept)
    path: str  # the schedule file it came from
    setup: StageSetup
    opt: torch.optim.Optimizer
    first: bool  # this rank feeds the inputs
    last: bool  # this rank computes the loss
    step_ms: list[float] = field(default_factory=list)  # measured steps
    busy_ms: list[float] = field(default_factory=list)  # this rank's busy time in each measured step
    allreduce_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # every step's
    spans_last: list = field(default_factory=list)
    op_ms: list[list[float]] = field(default_factory=list)  # each op's duration in every measured step
    warmup: int = 0
    selection_steps: int = 0
    method: Optional[str] = None  # sequences of different lengths: who plans its steps
    tokens: list[int] = field(default_factory=list)  # each measured step's real tokens (all replicas)
    predicted_ms: list[float] = field(default_factory=list)  # each measured step's plan's prediction
    predicted_peak: list[int] = field(default_factory=list)  # per rank, the most any plan played needs
    peak_bytes: Optional[int] = (
        None  # this rank's peak: CPU, in the step measured for it; CUDA, over its steps
    )
    peak_predicted: list[int] = field(default_factory=list)  # ... and that step's plan's, per rank
    # sequences of different lengths: this rank's prediction of the peak it measured, its plan's
    # with what the rank's pools hold beyond the plan's buffers ([Note: one pool of token rows])
    own_peak_predicted: Optional[int] = None
    # sequences of different lengths: each measured step's plan and this rank's ops' durations in it
    # (predicted at the report, not between steps): what `umopt calibrate` fits the costs by tokens to
    step_ops: list[tuple[Schedule, list[float]]] = field(default_factory=list)

    @property
    def schedule(self) -> Schedule:
        """The schedule it plays (sequences of different lengths: the last step's plan)."""
        pipe = self.pipe.playing
        return pipe.plan if pipe.plan.lengths is not None else pipe.schedule


def _plays(rk: _Rank, entries: list[tuple[str, str, Schedule]], select: bool) -> list[_Play]:
    """A Pipeline for each (name, report path, schedule), over the rank's model; a schedule that
    places the layers otherwise than the first gets a model copy and optimizer of its layout
    (built with the profile's seed: the same starting weights). The zoo's losses are sums over
    samples: divided by the minibatch, the chunks' losses add up to the minibatch's mean, as in
    one process."""
    opts = rk.cfg.options
    plays = []
    layouts = {str(rk.cfg.schedules[0].chunks): (rk.setup, rk.opt)}
    for k, (name, path, sched) in enumerate(entries):
        B = sched.minibatch
        key = str(sched.chunks)
        if key not in layouts:
            setup = _build(rk.cfg.profile, sched.chunks, rk.s, rk.device)
            layouts[key] = (setup, _optimizer(opts, setup.module))
        setup, opt = layouts[key]
        first, last = rk.ends(sched.chunks)
        # sequences of different lengths: a mean over the minibatch's tokens, however grouped
        per_token = dict(loss_fn=rk.setup.loss, loss_normalizer=valid_targets())
        pipe = Pipeline(
            setup.modules if sched.chunks is not None else setup.modules[0],
            sched,
            **(per_token if rk.cfg.varlen else dict(loss_fn=lambda out, y, B=B: rk.setup.loss(out, y) / B)),
            loss_reduction="sum",
            profile=rk.cfg.profile,
            device=rk.device,
            # sequences of different lengths: each message's shape from the step's plan
            input_specs=[setup.input] if setup.input is not None and not rk.cfg.varlen else None,
            output_specs=[setup.output] if setup.output is not None and not rk.cfg.varlen else None,
            timer=rk.timing,
            group=rk.pipe_ranks,
            dp_group=rk.dp_group,
            on_failure=report_failure,
            select=select,
            select_steps=opts.select_steps,
            steps=opts.warmup + opts.steps,
            causal=setup.sequences is not None and setup.sequences.causal,
            tied=setup.tied,
        )
        if rk.rank == 0:
            faults.slow_down(pipe, name)
        if not rk.cfg.varlen:  # the boundary shapes agreed now, not inside the first timed step
            pipe.prepare(to_device(rk.data_fn(0, B * opts.dp)[0][:B], rk.device) if first else None)
            # the schedules of a layout take turns: one set of receive buffers (a layout's
            # sequences share their pools by themselves: [Note: one pool of token rows])
            same = next((p for p in plays if str(p.pipe.schedule.chunks) == key), None)
            if same is not None:
                pipe.share_buffers(same.pipe)
        method = rk.cfg.methods[k] if rk.cfg.varlen else None
        plays.append(_Play(pipe, name, path, setup, opt, first, last, method=method))
    return plays


@dataclass
class _Turn:
    """Which minibatch a step of sequences of different lengths trains on (its data step: every
    method of a round plays the same ones), and the step after it (its data step, and the play
    whose method plans it), sent to be planned while this one runs."""

    data: int
    following: Optional[tuple[int, _Play]]


def _step(
    rk: _Rank,
    play: _Play,
    it: int,
    measured: bool,
    save_grads: bool,
    turn: Optional[_Turn] = None,
    memory: bool = False,
) -> float:
    """Step ``it`` of the run with ``play``'s schedule, then the optimizer; the slowest rank's
    time of it (every rank gets the same), recorded in ``play`` where ``measured``. With
    sequences of different lengths, ``turn`` says which minibatch (default: ``it``'s) and what
    is planned next. ``memory``: a step whose peak memory is measured on a CPU (a warm-up step)."""
    opts, B, dp = rk.cfg.options, play.pipe.schedule.minibatch, rk.cfg.dp
    faults.inject(rk.rank, it - rk.start_step, play.setup.modules)
    inputs = targets = None
    planned: dict[str, Schedule] = {}  # this step's plan, where this rank makes it
    make_plan: Optional[Callable[[], Schedule]] = None
    if rk.cfg.varlen:
        turn = turn or _Turn(it, None)
        if rk.feed is not None:
            xs, ys = rk.feed.batch(turn.data, play.method or "umopt")
            inputs, targets = (xs if play.first else None), (ys if play.last else None)
            if rk.feed.methods:  # this replica's plan maker: the plan, the next one sent ahead
                feed, data = rk.feed, turn.data
                nxt = (turn.following[0], turn.following[1].method) if turn.following else None

                def make_plan() -> Schedule:
                    # waited for inside the step, after the barrier: a late plan is the method's
                    # cost, and one that never comes fails the step on every rank at once
                    planned["plan"] = feed.plan(data, play.method, nxt)
                    return planned["plan"]

    elif play.first or play.last:  # the stages between never touch the data
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
    grads: Optional[dict] = None

    def train() -> Any:
        nonlocal grads
        loss_sum = play.pipe.step(inputs=inputs, targets=targets, plan=make_plan)
        # the gradients themselves, not copies: neither optimizer as built changes a gradient in
        # place, and zero_grad only drops the parameters' references to them
        # named as the model's layers ("layers.3.weight"), whichever rank and chunk holds them
        if save_grads:
            grads = {
                k: p.grad for m in play.setup.modules for k, p in m.named_parameters() if p.grad is not None
            }
        t_opt = timing.mark()
        play.opt.step()
        return loss_sum, t_opt

    cuda = rk.device.type == "cuda"
    if memory and not cuda:  # see [Note: a CPU step's peak memory]
        buffers = [t for st in play.pipe.playing.stages.values() for t in (*st.act, *st.grad)]
        held = held_bytes(state_tensors(play.setup.modules, play.opt) + buffers)
        (loss_sum, t_opt), extra = peak_during(train, rk.device)
        play.peak_bytes = held + extra
        plan = planned.get("plan")
        play.peak_predicted = list(plan.predicted.peak_memory_bytes) if plan is not None else []
        play.own_peak_predicted = _own_peak(rk, play, plan)
    elif measured and cuda:  # each method's peak over its own steps, not the run's
        torch.cuda.reset_peak_memory_stats(rk.device)
        loss_sum, t_opt = train()
        play.peak_bytes = max(play.peak_bytes or 0, torch.cuda.max_memory_allocated(rk.device))
        own = _own_peak(rk, play, planned.get("plan"))
        if own is not None:
            play.own_peak_predicted = max(play.own_peak_predicted or 0, own)
    else:
        loss_sum, t_opt = train()
    plan = planned.get("plan")
    spans = list(play.pipe.spans)
    play.opt.zero_grad(set_to_none=True)
    spans.append(("OPT", 0, 0, -1, t_opt, timing.mark()))
    elapsed = timing.stop()
    if grads is not None and rk.replica == 0:  # outside the step's time; the replicas' gradients are equal
        Path(opts.save_grads).mkdir(parents=True, exist_ok=True)
        checkpoint.save_atomic(
            {k: g.detach().cpu() for k, g in grads.items()}, Path(opts.save_grads) / f"grads_stage{rk.s}.pt"
        )
    # the slowest rank's time; and the slowest replica's plan's prediction (only makers have one)
    predicted = plan.predicted.iteration_ms if plan is not None else 0.0
    worst = torch.tensor([elapsed, predicted], dtype=torch.float64).to(rk.device)
    TorchComm.current().all_reduce(worst, None, op="max")
    ms = float(worst[0].item())
    if play.last:
        play.losses.append(float(loss_sum))
    if measured and rk.cfg.varlen:
        assert turn is not None
        play.predicted_ms.append(float(worst[1].item()))
        play.tokens.append(rk.feed.tokens[turn.data] if rk.feed is not None else 0)
        if plan is not None:
            peaks = plan.predicted.peak_memory_bytes
            play.predicted_peak = [max(a, b) for a, b in zip(play.predicted_peak or peaks, peaks)]
        play.op_ms = []  # the ops are this step's plan's: their times are the last step's
    if measured:
        ops = play.pipe.playing.ops
        if not play.op_ms:
            play.op_ms = [[] for _ in ops]
        done = [(k, lo, hi, j, timing.ms(t0), timing.ms(t1)) for k, lo, hi, j, t0, t1 in spans]
        play.step_ms.append(ms)
        play.spans_last = done
        play.busy_ms.append(sum(t1 - t0 for k, *_, t0, t1 in done if k in (OpKind.F, OpKind.B, OpKind.W)))
        play.allreduce_ms.append(sum(t1 - t0 for k, *_, t0, t1 in done if k == "AR"))
        for d, (_, _, _, _, t0, t1) in zip(play.op_ms, done[: len(ops)]):
            d.append(t1 - t0)
        if rk.cfg.varlen:  # the last KEPT_PLANS steps': a long run's report stays small
            play.step_ops.append((play.pipe.playing.plan, [t1 - t0 for *_, t0, t1 in done[: len(ops)]]))
            del play.step_ops[:-KEPT_PLANS]
    if turn is not None and turn.following is not None and rk.feed is not None and rk.feed.methods:
        # between steps: the next step's plan, if made already, shared now, so that the other
        # ranks find it at once when it starts (read without a wait on the step's critical path)
        data, nxt = turn.following
        early = rk.feed.ready(data, nxt.method)
        if early is not None:
            nxt.pipe.share_next(early)
    return ms


def _own_peak(rk: _Rank, play: _Play, plan: Optional[Schedule]) -> Optional[int]:
    """This rank's predicted peak for a step of sequences: its plan's (the maker's; the others
    read the step's plan from the pipeline) with what its pools hold beyond the plan's buffers
    ([Note: one pool of token rows]); None for a schedule of one length (its report simulates it)."""
    pipe = play.pipe.playing
    plan = plan if plan is not None else pipe.plan
    if plan.lengths is None or not plan.predicted.peak_memory_bytes:
        return None
    return int(plan.predicted.peak_memory_bytes[rk.s]) + sum(st.slack_bytes for st in pipe.stages.values())


class _Steps:
    """The run's step counter: each step's checkpoint (--checkpoint-every) and progress follow it."""

    def __init__(self, rk: _Rank, total: int, progress: Optional[Progress]):
        self.rk, self.it, self.last, self.progress = rk, rk.start_step, rk.start_step + total - 1, progress

    def play(
        self,
        play: _Play,
        measured: bool,
        end_of_round: bool,
        what: str,
        turn: Optional[_Turn] = None,
        memory: bool = False,
    ) -> float:
        rk, opts = self.rk, self.rk.cfg.options
        ms = _step(rk, play, self.it, measured, bool(opts.save_grads) and self.it == self.last, turn, memory)
        self.it += 1
        if self.progress:
            predicted = play.predicted_ms[-1] if measured and play.predicted_ms else None
            if not rk.cfg.varlen:
                predicted = play.schedule.predicted.iteration_ms
            self.progress.step(what, ms, predicted, end_of_round)
        every = opts.checkpoint_every
        if opts.checkpoint and every and (self.it - rk.start_step) % every == 0 and self.it <= self.last:
            _checkpoint(rk, self.it)
            phase("the steps")
        return ms


def _selecting(rk: _Rank, play: _Play, steps: _Steps) -> Optional[Selection]:
    """The steps of a schedule file whose candidates take turns in its Pipeline ([Note: selection
    while training]): warm-up steps, then selection's turns, then the one kept; each step is
    counted as one of the three, and only the last are measured."""
    opts = rk.cfg.options
    total = opts.warmup + opts.steps
    for it in range(total):
        selecting = play.pipe.selected is None
        warm = it < opts.warmup
        if warm:
            play.warmup += 1
        elif selecting:
            play.selection_steps += 1
        what = "warm-up" if warm else "selection" if selecting else "measured"
        steps.play(
            play,
            measured=not warm and not selecting,
            end_of_round=it == total - 1,
            what=f"{what}, {play.pipe.up_next}",
            memory=it == opts.warmup - 1,
        )
    return play.pipe.selection


def _turns(rk: _Rank, plays: list[_Play], steps: _Steps) -> tuple[int, Optional[Decision]]:
    """The schedules given take turns, --rounds times (with --decide until decided), so that
    whatever drifts on the machine meets each alike, each round starting with the next one.
    Returns the rounds played and the decision."""
    opts = rk.cfg.options
    decision: Optional[Decision] = None
    began = time.monotonic()
    turn = 0
    base = rk.start_step  # the round's first data step (sequences of different lengths)
    while turn < opts.rounds or (decision is not None and not decision.decided):
        if turn >= opts.rounds and not _another_round(opts, turn, time.monotonic() - began, rk.device):
            break
        rk.speeds.append(reference_ms(rk.device))
        n = (opts.warmup if turn == 0 else 0) + opts.steps
        # the order turns each round: the first to play a minibatch meets its shapes first (the
        # kernels' and allocators' caches), which cost one CPU rank's steps 2x the next method's
        order = plays[turn % len(plays) :] + plays[: turn % len(plays)]
        after = plays[(turn + 1) % len(plays)]  # the next round's first
        for k, play in enumerate(order):
            for j in range(n):
                warm = turn == 0 and j < opts.warmup
                play.warmup += warm
                following = (
                    (base + j + 1, play)
                    if j + 1 < n
                    else (base, order[k + 1])
                    if k + 1 < len(order)
                    else (base + n, after)
                )
                steps.play(
                    play,
                    measured=not warm,
                    end_of_round=j == n - 1 and k == len(order) - 1,
                    what=f"round {turn + 1}, {play.name}" + (" (warm-up)" if warm else ""),
                    turn=_Turn(base + j, following),
                    memory=turn == 0 and j == opts.warmup - 1,
                )
        base += n
        turn += 1
        if opts.decide is not None:  # every rank has the same step times (all-reduced), so the same decision
            decision = _decision(plays, opts.steps, opts.decide)
    return turn, decision


def run_rank(cfg: RunConfig, device: torch.device) -> None:
    opts = cfg.options
    rk = _set_up(cfg, device)
    selecting = _selects(cfg)
    paths = opts.schedules if not cfg.varlen else opts.schedules * len(cfg.schedules)  # a file per method
    entries = list(zip(cfg.names, paths, cfg.schedules))
    plays = _plays(rk, entries, select=selecting)
    total = opts.warmup + opts.steps if selecting else len(plays) * (opts.warmup + opts.rounds * opts.steps)
    if rk.rank == 0:
        names = plays[0].pipe.turns.names if selecting and plays[0].pipe.turns else [p.name for p in plays]
        _log.info(
            "%d ranks (%d stages x %d replicas), %s on %s: %s",
            rk.world,
            cfg.num_stages,
            opts.dp,
            opts.backend,
            device.type,
            ", ".join(names),
        )
    steps = _Steps(rk, total, Progress(None if opts.decide else total) if rk.rank == 0 else None)
    if device.type == "cuda":  # the steps' peak, not the set-up's
        torch.cuda.reset_peak_memory_stats(device)
    phase("the steps")
    selection = None
    if selecting:
        rk.speeds.append(reference_ms(rk.device))
        selection = _selecting(rk, plays[0], steps)
        rounds, decision = 1, None
    else:
        try:
            rounds, decision = _turns(rk, plays, steps)
        finally:
            if rk.feed is not None:
                rk.feed.close()
    if opts.checkpoint:
        _checkpoint(rk, steps.it)
    phase("the report")
    differ = numerics_differences(
        cfg.profile.device.numerics, numerics()
    )  # as the profile timed its kernels?
    for k, play in enumerate(plays):
        if (
            selection is not None and not play.step_ms
        ):  # selection took every step: the turns' own measurements
            play.step_ms = list(selection_winner_ms(play))
        mine = {
            "spans": play.spans_last,
            "losses": play.losses,
            "op_ms": [
                [op[0], op[1], op[2], statistics.median(d) if d else 0.0]
                for op, d in zip(play.pipe.playing.ops, play.op_ms or [[] for _ in play.pipe.playing.ops])
            ],
            "busy_ms": statistics.median(play.busy_ms) if play.busy_ms else 0.0,
            "allreduce_ms": statistics.median(play.allreduce_ms) if play.allreduce_ms else 0.0,
            "reference_ms": statistics.median(rk.speeds),
            "peak_memory_bytes": play.peak_bytes,
            "peak_predicted_bytes": play.own_peak_predicted,
            "numerics_differ": differ,
        }
        if cfg.varlen:  # every step its own plan: the predicted busy time is those plans' too
            mine["op_pairs"], mine["busy_predicted_ms"] = _op_pairs(rk, play)
        with waiting("the other ranks' measurements", io=True):  # rank 0 writes the last report meanwhile
            gathered = TorchComm.current().all_gather_object(mine, rk.io_group)
        if rk.rank == 0:  # replica 0's stages (the others ran the same ops on their own samples)
            name = selection.winner if selection is not None else play.name
            measured = Measured(
                name,
                play.path,
                play.schedule,
                play.step_ms,
                play.warmup,
                play.selection_steps,
                len(play.losses) if play.last else play.warmup + play.selection_steps + len(play.step_ms),
                gathered[: cfg.num_stages],
                play.pipe.played_schedules(),
                lengths=_lengths_run(
                    cfg, play, [p for rec in gathered[: cfg.num_stages] for p in rec["op_pairs"]]
                )
                if cfg.varlen
                else None,
            )
            write_report(cfg, measured, k, rounds, decision, selection)


def _op_pairs(rk: _Rank, play: _Play) -> tuple[list[tuple[str, int, str, float, float]], float]:
    """This rank's ops of every measured step: (mode, virtual stage, kind, predicted ms by the
    step's plan, measured ms); and the median over those steps of the rank's predicted busy time
    (what its measured busy time, the same steps' median, compares with)."""
    out, busy = [], []
    for plan, measured in play.step_ops:
        assert plan.lengths is not None
        timeline = simulate(schedule_tables(plan, rk.cfg.profile), plan.op_lists(), plan.minibatch)
        for sp, ms in zip(timeline.spans[rk.s], measured):
            out.append((plan.lengths.mode, int(sp.chunk), str(sp.kind), sp.end - sp.start, ms))
        busy.append(timeline.busy_ms[rk.s])
    return out, statistics.median(busy) if busy else 0.0


def _lengths_run(cfg: RunConfig, play: _Play, op_pairs: list) -> LengthsRun:
    """What a run of sequences of different lengths measured beyond the steps' times."""
    opts = cfg.options
    seconds = sum(play.step_ms) / 1e3
    return LengthsRun(
        method=play.method or "umopt",
        data=f"--data {opts.data}"
        if opts.data
        else f"--lengths {opts.lengths}"
        if opts.lengths
        else "the plan's lengths",
        tokens=play.tokens,
        predicted_step_ms=play.predicted_ms,
        tokens_per_s=sum(play.tokens) / seconds if seconds > 0 else 0.0,
        predicted_tokens_per_s=sum(play.tokens) * 1e3 / sum(play.predicted_ms)
        if sum(play.predicted_ms) > 0
        else 0.0,
        # what the measured peak is compared with: on CPUs, the measured step's plan's
        predicted_peak_memory_bytes=play.peak_predicted or play.predicted_peak,
        op_pairs=op_pairs,
        plans=[plan for plan, _ in play.step_ops],
        cut=cut_note(lengths_spec(opts.lengths), cfg.profile.lengths.max_length)
        if opts.lengths and cfg.profile.lengths is not None
        else None,
        assign=dict(zip(cfg.methods, cfg.assigns)).get(play.method or "umopt") if cfg.dp > 1 else None,
    )


def selection_winner_ms(play: _Play) -> list[float]:
    """The kept schedule's measured turn steps (where selection left no step after it)."""
    turns = play.pipe.turns
    if turns is None:
        return []
    return next((t.step_ms for t in turns.turns if t.pipe is play.pipe.playing), [])


def _decision(plays: list[_Play], steps: int, confidence: float) -> Decision:
    rounds = {
        p.name: [statistics.median(p.step_ms[k : k + steps]) for k in range(0, len(p.step_ms), steps)]
        for p in plays
    }
    # the equal schedules are the reference (sequences of different lengths: the peers' plans);
    # with none among them, the first (the solve's pick)
    if plays[0].method is not None:
        equal = [p.name for p in plays if METHODS[p.method] is not UMOPT]
    else:
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


def _another_round(opts: RunOptions, turn: int, spent_s: float, device: torch.device) -> bool:
    """Whether an undecided comparison gets another round: rank 0's clock says, for every rank."""
    more = torch.tensor(
        [turn < opts.max_rounds and spent_s * (turn + 1) / turn <= opts.budget], dtype=torch.int32
    ).to(device)
    TorchComm.current().broadcast(more, 0, None)
    return bool(more.item())


def _checkpoint(rk: _Rank, step: int) -> None:
    """This rank's part of the checkpoint set of ``step`` (:mod:`umopt.run.checkpoint`)."""
    phase(f"the checkpoint of step {step}")
    cfg = rk.cfg
    checkpoint.write_set(
        Path(cfg.options.checkpoint),
        rk.s,
        {"model": rk.setup.module.state_dict(), "optimizer": rk.opt.state_dict(), "step": step},
        step,
        rk.run_id,
        cfg.profile,
        cfg.options.optimizer,
        cfg.options.schedules,
        rk.io_group,
        writes=rk.rank < cfg.num_stages,  # replica 0 writes (with --dp the replicas' states are equal)
        device=rk.device,
        delay_s=faults.slow_io_s(),
    )


def _resume(
    cfg: RunConfig, s: int, module: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device
) -> int:
    """Load this stage's file of the folder's last complete set; the step it was written after."""
    state, step = checkpoint.load_stage(cfg.options.checkpoint, s, cfg.profile, cfg.options.optimizer, device)
    try:
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, it is not this stage's state
        raise UmoptError(
            f"--resume: the checkpoint is not stage {s}'s state ({exc.__class__.__name__}: {first_line(exc)})"
        ) from None
    return step


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
    TorchComm.start(backend, timeout_s, device, **where)
    return device


def _barrier(device: torch.device, group=None) -> None:
    TorchComm.current().barrier(group, device)


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
    ``umopt run`` starts itself (``python -m umopt.run.rank OPTIONS.json``) read them from the
    launcher's file."""
    rank = int(os.environ.get("RANK", "0"))
    status = status_writer(rank)
    status("started", phase="set-up")
    setup_logging(rank)
    exit_on_termination(status)
    try:
        opts = options if options is not None else RunOptions.read(sys.argv[1])
        cfg = preflight(opts, verify_stages=[])  # each rank checks its own checkpoint file
        device = init_distributed(cfg.backend, step_timeout_s())
        run_rank(cfg, device)
        TorchComm.end()
    except BaseException as exc:  # see [Note: a failed rank leaves at once]
        report_failure(exc)  # unless the Pipeline already did, before its links broke
        if not isinstance(exc, (UmoptError, KeyboardInterrupt)):
            traceback.print_exc()
        elif isinstance(exc, UmoptError) and not os.environ.get("UMOPT_STATUS_DIR"):
            # under torchrun no launcher says it: the rank does, in one line (bad input: exit code 2)
            _log.error("%s", exc)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.exit_code)
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
