"""``umopt.Pipeline``: this rank's part of a pipeline that runs a umopt schedule, in your own loop.

On each rank you build your stage's module (or, for a schedule with several chunks per rank,
the rank's chunk modules as a list, in virtual stage order), load the schedule that ``umopt
solve`` wrote, and call :meth:`Pipeline.step` once per iteration; the optimizer, scaler,
clipping, logging and checkpoints stay yours::

    pipe = umopt.Pipeline(stage_module, "schedule.json", loss_fn=nn.CrossEntropyLoss())
    loss = pipe.step(inputs)              # first stage; the last passes targets=..., the others nothing
    optimizer.step(); optimizer.zero_grad()

A step plays the rank's op list (:mod:`umopt.run.player`) over its virtual stages
(:mod:`umopt.run.stage`; one chunk per rank is one virtual stage per rank), its messages in the
order both ends agree on (:mod:`umopt.run.links`). The gradients left in the modules' parameters
are those of ``loss_fn(whole_model(x), y).backward()`` in one process on the whole minibatch
(:mod:`umopt.run.losses` says how each chunk's loss counts). Where the schedule file has candidates,
the first steps measure them in turns and keep the fastest (:mod:`umopt.run.selection`).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..costmodel import ALLREDUCE_BUCKET_BYTES, ChunkOp, OpKind
from ..devices import TensorSpec, check_trainable, numerics, numerics_differences, to_device
from ..errors import UmoptError
from ..formats.profile import Profile, load_profile
from ..formats.report import Selection
from ..formats.schedule import (
    Schedule,
    load_schedule,
    require_pick_layout,
)
from ..parts import IGNORE
from ..predict import check_against_profile, checked
from ..search.replicas import assign as assign_replicas
from .comm import Comm, PipelineBroken, TorchComm, describe
from .failures import guarded
from .links import StepLinks, directions, messages
from .losses import ChunkLoss, chunk_loss
from .player import Player, StepTimer, joined_output
from .selection import Turns
from .stage import Stage, check_samples, check_spec, tensors, warn_batch_norm
from .tokens import TokenRows

__all__ = ["Pipeline", "schedule_and_profile", "average_gradients"]

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]

_said: set[str] = set()


def _warn_numerics(profile: Profile) -> None:
    """Say once per process where this process's TF32 / cuDNN settings differ from the profile's."""
    differ = numerics_differences(profile.device.numerics, numerics())
    line = "; ".join(differ)
    if differ and line not in _said:
        _said.add(line)
        logging.getLogger("umopt").warning(
            "this process runs with other numerics than the profile was timed under (%s): its predicted times may not hold",
            line,
        )


# [Note: one plan a step, one maker]
# With sequences of different lengths every rank must play the same plan each step (a rank that
# plays another waits on messages that never come, or, where the shapes happen to agree, trains
# on the wrong rows without a word). The rank holding the first stage has the minibatch's
# sequences, so it is the maker: the plan it plays at step n (None: the last one again) goes into
# the store under step n's key, and every other rank plays what it reads there; one that was
# handed a plan of its own compares it (Schedule.plays_alike) and, where they differ, the step
# fails on every rank before its first op. The maker checks a plan against the profile once
# (a plan made ahead is checked in its planning process: the mark travels with it), and the
# others play it unchecked. The maker may share step n + 1's plan between the steps
# (share_next), as `umopt run` does with a plan made ahead that is ready: the others then find
# it at once, and the store is read off the step's critical path. A plan given as a function is
# called inside the step: waiting for a late plan counts in the step's time, and the others wait
# on the store meanwhile (bounded, and cut short by a failure), never in a collective under a
# watchdog. Data-parallel replicas each have their own minibatch and so their own plan: the key
# names the replica by its maker's rank. The maker cannot be more than a step ahead of any rank
# (its step n ends only once every rank has played its part of step n), so it deletes step
# n - PLAN_KEPT's key, read by then, and the store holds a few plans, not one per step of the
# run. Planning itself is the maker's, ahead of the step (umopt.run.ahead.PlanAhead plans in a
# process of its own).
PLAN_KEPT = 4


def plan_wait_s() -> float:
    """How long a rank waits for the maker's plan of a step at most: the maker's own wait for a
    plan made ahead is bounded (``PlanAhead.next``, and a planning process that dies is said
    within seconds), so this only ends a wait for a maker that left without a word
    (UMOPT_PLAN_TIMEOUT_S, default 300 s)."""
    return float(os.environ.get("UMOPT_PLAN_TIMEOUT_S", 300))


def schedule_and_profile(
    schedule: Union[str, Path, Schedule], profile: Optional[Union[str, Path, Profile]]
) -> tuple[Schedule, Profile]:
    """The schedule (a file or loaded) and its profile (given, else the file it names), checked
    against each other."""
    sched = schedule if isinstance(schedule, Schedule) else load_schedule(str(schedule))
    prof = profile if isinstance(profile, Profile) else load_profile(str(profile or sched.profile.path))
    check_against_profile(sched, prof)
    return sched, prof


def loss_scale(
    comm: Comm, loss: ChunkLoss, ys: tuple[torch.Tensor, ...], minibatch: int, dp_group, device: torch.device
) -> Callable[[int, int], Any]:
    """What each chunk's loss counts by (:mod:`umopt.run.losses`); with data-parallel replicas a
    normalizer is the global minibatch's (its replicas' sum), the gradients' average undone."""
    if loss.rule != "normalized":
        return loss.scale(ys[0] if len(ys) == 1 else ys, minibatch)
    total = torch.as_tensor(
        loss.normalizer(ys[0] if len(ys) == 1 else ys), dtype=torch.float32, device=device
    )
    replicas = len(comm.group_ranks(dp_group)) if dp_group is not None else 1
    if replicas > 1:
        total = total.clone()
        comm.all_reduce(total, dp_group)
        total = total / replicas
    return lambda lo, hi: 1.0 / total


# [Note: tied weights]
# A weight two layers share (tied embeddings: the first stage's token embedding is the LM head's
# matrix) is one parameter in one process, and its gradient the sum of both uses'. Where the two
# layers sit on two ranks, each holds a copy, built from the same seed (or loaded from the same
# file), and each step's backward leaves each copy its own use's gradient only. So after the step,
# before the optimizer (and before the data-parallel average, which commutes with it), the copies'
# gradients are summed over the ranks holding them, in a group of their own (Megatron-LM's
# embedding group): every copy then has one process's gradient, and the optimizers, stepping alike
# from alike, keep the copies equal. A rank holding both layers holds one parameter and takes part
# once. clip_grad_norm_ counts the weight once. The sum's time is in the step, not yet in the cost
# model (a few MiB for a small vocabulary; a large one's embedding is hundreds).


def sum_tied(comm: Comm, ties: dict[str, tuple[nn.Parameter, Any]]) -> None:
    """Sum each tied weight's gradient over the ranks holding a copy (see [Note: tied weights])."""
    for param, group in ties.values():
        if param.grad is None:  # this copy took no part in the step: it adds nothing
            param.grad = torch.zeros_like(param)
        comm.all_reduce(param.grad, group)


# [Note: the all-reduce after the sends]
# The data-parallel all-reduce runs on a communicator of its own (dp_group) and would start
# while this stage's last sends (its last input gradients) are still in flight on the links'.
# NCCL promises progress for two communicators in flight at once only if both kernels can run
# at the same time, which nothing guarantees (a full GPU, or a peer that starts them in the
# other order, deadlocks). So the all-reduce starts once the links are done. The cost model
# starts it at the stage's last op: the last message's time, on a GPU link microseconds, is
# not counted.
def average_gradients(comm: Comm, params, dp_group) -> None:
    """Average the gradients of ``params`` over the data-parallel replicas of ``dp_group``: flat
    buckets of about :data:`~umopt.costmodel.ALLREDUCE_BUCKET_BYTES`, all-reduced one after the
    other with the next in flight while one is copied back, so at most two buckets exist at once
    (what the memory model counts: [Note: what a step holds besides its activations])."""
    grads = [p.grad for p in params if p.grad is not None]
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if size and size + g.numel() * g.element_size() > ALLREDUCE_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    n = len(comm.group_ranks(dp_group))

    def start(b: list[torch.Tensor]) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
        flat = torch.cat([g.reshape(-1) for g in b])
        return comm.all_reduce(flat, dp_group, async_op=True), flat, b

    def finish(work: Any, flat: torch.Tensor, b: list[torch.Tensor]) -> None:
        work.wait()
        flat /= n
        offset = 0
        for g in b:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    in_flight = None
    for b in (b for b in buckets if b):
        started = start(b)
        if in_flight is not None:
            finish(*in_flight)
        in_flight = started
    if in_flight is not None:
        finish(*in_flight)


class Pipeline:
    """This rank's part of a umopt schedule, run in your own training loop.

    Args:
        module: this rank's stage module, on ``device``; or, for a schedule with several chunks
            per rank (``umopt solve --chunks``), the rank's chunk modules as a list, in virtual
            stage order. Each is called with what crosses its input boundary (a tuple as
            ``module(*tuple)``).
        schedule: a schedule file's path or a loaded :class:`~umopt.formats.schedule.Schedule`.
        stage: which stage this rank runs, one chunk per rank (default: its rank in ``group``).
        loss_fn: ``loss_fn(output, targets)`` on the rank holding the last stage (required
            there); it returns a scalar. A torch loss module is read for what its mean is over
            (:func:`umopt.run.losses.chunk_loss`): ``nn.CrossEntropyLoss(ignore_index=...,
            weight=..., label_smoothing=...)`` gives one process's gradients as it is.
        loss_reduction: for a plain function: ``"mean"`` (over the samples it is given, the
            default) or ``"sum"``; a loss module's own ``reduction`` is used instead.
        loss_normalizer: ``loss_normalizer(targets)`` of the whole minibatch: what the mean is
            over (valid tokens, say). The loss is then a sum (``loss_reduction="sum"``; a loss
            module's mean is made one), divided by it.
        profile: the profile the schedule was made for (default: the file the schedule names);
            the autocast dtype comes from it.
        group: the process group of this pipeline, or its global ranks in stage order (default:
            the world); stage (rank) ``s`` of the schedule is its rank ``s``.
        device: where the buffers live (default: the module's first parameter's device).
        input_specs, output_specs: per-sample shape and dtype of each tensor this stage receives
            and sends (with a list of modules: a list of them per module; default: agreed at the
            first step, each stage telling the next what a forward of two samples gives; given
            ones are checked against what the stage before says).
        dtype: the autocast dtype of forwards (default: the profile's).
        timer: a :class:`~umopt.run.player.StepTimer` to record each op's span (``spans``).
        dp_group: the ranks that run this same rank of the pipeline in the other data-parallel
            replicas, each on its own slice of the global minibatch: at the end of each step the
            rank's gradients are averaged over them (bucketed all-reduces), so that they are the
            global minibatch's mean-loss gradients.
        strict: refuse a module with BatchNorm layers (whose gradients cannot equal one
            process's) instead of warning.
        on_failure: called with a failed step's exception before the links break (the runtime
            writes its status there, so that the rank that failed first is the one named).
        select: where the schedule file has candidates (``umopt solve`` writes them), measure
            them and its pick in turns over the first steps and keep the fastest (see [Note:
            selection while training] in umopt/run/selection.py); every schedule gives the same
            gradients, so training is unchanged. ``selected`` names the winner once chosen,
            ``selection`` says what was measured.
        select_steps: steps at most spent measuring (default: a quarter of ``steps``, at most 60,
            or what three rounds need where that is at most half of ``steps``).
        steps: how many steps the run has, if known: measuring then also stops once it has cost
            3% of the run.
        tied: this rank's copies of weights tied to other ranks' (an embedding the first stage
            and the LM head share), by a key every holder gives the same (``ModelParts.tied_in``
            names them): their gradients are summed over the ranks holding them after each step,
            as one process's tied weight gets both uses' (see [Note: tied weights]).
        causal: with sequences of different lengths, every layer of the modules is causal (a
            token never sees a later one), so a padded chunk's padding, after its tokens, never
            reaches them: modules that take no ``lengths=`` may then play padded plans (see
            [Note: packed sequences] in umopt/zoo.py).

    Constructing a Pipeline is collective over the world: every rank takes part in making the
    links' process groups (see [Note: one process group per link and direction]), and each of
    its set-up waits for another rank is bounded and named (UMOPT_SETUP_TIMEOUT_S, default the
    process group's timeout) and ends at once where another rank failed.
    """

    def __init__(
        self,
        module: Union[nn.Module, Sequence[nn.Module]],
        schedule: Union[str, Path, Schedule],
        stage: Optional[int] = None,
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        loss_reduction: Optional[str] = None,
        loss_normalizer: Optional[Callable[[Any], Any]] = None,
        profile: Optional[Union[str, Path, Profile]] = None,
        group: Any = None,
        device: Optional[torch.device] = None,
        input_specs: Optional[Sequence[Any]] = None,
        output_specs: Optional[Sequence[Any]] = None,
        dtype: Optional[str] = None,
        timer: Optional[StepTimer] = None,
        dp_group: Any = None,
        strict: bool = False,
        on_failure: Optional[Callable[[BaseException], None]] = None,
        select: bool = True,
        select_steps: Optional[int] = None,
        steps: Optional[int] = None,
        causal: bool = False,
        tied: Optional[dict[str, nn.Parameter]] = None,
        _comm: Optional[Comm] = None,  # the transport (tests: a model of NCCL's semantics)
    ):
        self.comm = _comm if _comm is not None else TorchComm.current()
        self.id = self.comm.next_id()  # every rank draws the same, in the order pipelines are made
        self.on_failure = on_failure
        self.who = f"rank {self.comm.rank}"
        self.selected: Optional[str] = None  # the schedule kept, once chosen
        self.selection: Optional[Selection] = None
        self.spans: list = []  # each op's (kind, lo, hi, virtual stage, start, end) in the last step (with a timer)
        self.played: Optional[str] = None  # the schedule the last step played (where there are candidates)
        kw = dict(
            loss_fn=loss_fn,
            loss_reduction=loss_reduction,
            loss_normalizer=loss_normalizer,
            group=group,
            device=device,
            input_specs=input_specs,
            output_specs=output_specs,
            dtype=dtype,
            timer=timer,
            dp_group=dp_group,
            strict=strict,
            on_failure=on_failure,
        )
        self.causal = causal
        self.tied = dict(tied or {})
        self._ties: dict[str, tuple[nn.Parameter, Any]] = {}  # key: (this rank's copy, its holders' group)
        self._tie_owner: dict[str, bool] = {}  # key: whether this rank counts it in the norm
        self._set_up(lambda: self._build(module, schedule, stage, profile, kw))
        self.turns: Optional[Turns] = None  # the pick and candidates taking turns (None: no candidates)
        if (
            select and self.schedule.candidates and self.schedule.lengths is None
        ):  # the candidates' Pipelines, over the same modules
            require_pick_layout(self.schedule, "pass select=False")
            rival_kw = dict(
                kw,
                profile=self.profile,
                device=self.device,
                select=False,
                causal=causal,
                tied=tied,
                _comm=self.comm,
            )
            self.turns = Turns(self, lambda sc: Pipeline(module, sc, stage, **rival_kw), select_steps, steps)

    # --- set-up ------------------------------------------------------------------------------
    def _set_up(self, build: Callable[[], None]) -> None:
        """Build this pipeline; where it fails, tell the other ranks at once (their set-up waits
        end with this rank's words). Before the links' groups are made, nothing is half done: the
        failure is this set-up's alone, and a Pipeline can be built again; after that, this
        process's links are broken (see [Note: a failed step breaks the pipeline])."""
        if self.comm.failed:
            raise PipelineBroken(f"this process's pipelines cannot step again: {self.comm.failed}")
        self._linking = False
        try:
            build()
        except PipelineBroken:
            raise  # another rank's failure, already told
        except BaseException as exc:
            if self.on_failure is not None:
                self.on_failure(exc)
            reason = f"{self.who} failed: {describe(exc)}"
            if self._linking:
                self.comm.fail(reason)
            else:
                self.comm.put(f"{self.id}/failed", reason)
            raise

    def _build(self, module, schedule, stage: Optional[int], profile, kw: dict) -> None:
        self.schedule, self.profile = schedule_and_profile(schedule, profile)
        sched, comm = self.schedule, self.comm
        self.group, self.dp_group = kw["group"], kw["dp_group"]
        self.ranks = comm.group_ranks(self.group)  # the global rank of each rank of the pipeline
        chunking = sched.chunking()
        R = len(sched.stages)
        if len(self.ranks) != R:
            raise UmoptError(
                f"the schedule has {R} {'ranks' if chunking else 'stages'} but the process group has {len(self.ranks)}"
            )
        self.me = self._my_rank(stage, R)
        self.who = f"stage {self.me}" if chunking is None else f"rank {self.me}"
        self.ranks_of = list(chunking.ranks) if chunking is not None else list(range(R))
        V = len(self.ranks_of)
        ops = [
            [ChunkOp(op[0], op[1], op[2], op[3] if len(op) == 4 else r) for op in rank_ops]
            for r, rank_ops in enumerate(sched.op_lists())
        ]
        local = [j for j in range(V) if self.ranks_of[j] == self.me]
        # the ranks this one exchanges messages with, and itself: whose ops a step's plan is read for
        self._near = {self.me} | {self.ranks_of[k] for j in local for k in (j - 1, j + 1) if 0 <= k < V}
        modules = self._modules(module, local, chunking is not None)
        self.holds_first, self.holds_last = 0 in local, V - 1 in local
        if self.holds_last and kw["loss_fn"] is None:
            raise UmoptError(
                "the last stage needs loss_fn"
                if chunking is None
                else "the rank holding the last chunk needs loss_fn"
            )
        self._loss: Optional[ChunkLoss] = (
            chunk_loss(kw["loss_fn"], kw["loss_reduction"], kw["loss_normalizer"])
            if kw["loss_fn"] is not None
            else None
        )
        param = next((p for m in modules for p in m.parameters()), None)
        self.device = kw["device"] or (param.device if param is not None else torch.device("cpu"))
        self.dtype = kw["dtype"] or self.profile.device.dtype
        check_trainable(self.dtype)
        _warn_numerics(self.profile)
        label = "stage" if chunking is None else "virtual stage"
        specs_in = _per_module(kw["input_specs"], len(modules), "input_specs")
        specs_out = _per_module(kw["output_specs"], len(modules), "output_specs")
        self.stages: dict[int, Stage] = {}
        for j, m, sin, sout in zip(local, modules, specs_in, specs_out):
            warn_batch_norm(m, f"{label} {j}", kw["strict"])
            self.stages[j] = Stage(j, V, m, self.device, self.dtype, sin, sout, label=label)
        self._timer = kw["timer"]
        self._plans_shared = 0  # steps whose plan was shared (sequences of different lengths)
        self._ahead: Optional[tuple[int, Schedule]] = None  # a step's plan shared before it (share_next)
        self._play(sched, ops)  # before the links: a module that cannot play the plan is refused alone
        self._connect(ops)
        self._ready = False

    def _play(self, sched: Schedule, ops: list[list[ChunkOp]]) -> None:
        """Play ``sched``'s ops from the next step on (with sequences of different lengths, its
        samples' token rows too: see [Note: token rows] in umopt/run/tokens.py)."""
        comm = self.comm
        self.plan = sched
        if sched.lengths is not None:
            ln = sched.lengths
            rows = TokenRows.of_plan(ln.lengths, ln.samples, ln.mode, ln.pad_to, ln.row)
            way = (rows.mode, rows.row is not None)
            for st in self.stages.values():
                if way not in st.modes_checked:  # once a way: the module stays the same
                    rows.check_module(st.module, st.name, self.causal)
                    st.modes_checked.add(way)
                st.tokens = rows
        self.ops = ops[self.me]
        order = messages(ops, self.ranks_of)
        forwards = messages([[op for op in o if op.kind == OpKind.F] for o in ops], self.ranks_of)
        self.player = Player(
            self.ops,
            self.stages,
            lambda: StepLinks(comm, self.me, self.ranks, self.ranks_of, order, self.stages),
            lambda: StepLinks(comm, self.me, self.ranks, self.ranks_of, forwards, self.stages),
            sched.recompute,
            self._timer,
        )

    def _my_rank(self, stage: Optional[int], R: int) -> int:
        if stage is not None:
            if self.schedule.chunks is not None:
                raise UmoptError("stage= is for one chunk per rank; with several, a rank runs its own chunks")
            if not 0 <= stage < R:
                raise UmoptError(f"stage {stage} of a {R}-stage schedule")
            if self.ranks[stage] != self.comm.rank:
                raise UmoptError(
                    f"stage {stage} is rank {self.ranks[stage]} of the process group, this process is rank {self.comm.rank}"
                )
            return stage
        if self.comm.rank not in self.ranks:
            raise UmoptError(
                f"this process (rank {self.comm.rank}) is not in the pipeline's group {self.ranks}"
            )
        return self.ranks.index(self.comm.rank)

    def _modules(self, module, local: list[int], chunked: bool) -> list[nn.Module]:
        """The modules given, one per virtual stage of this rank, or a one-line error saying what to give."""
        given = list(module) if isinstance(module, (list, tuple)) else [module]
        if not all(isinstance(m, nn.Module) for m in given):
            bad = next(m for m in given if not isinstance(m, nn.Module))
            raise UmoptError(
                f"umopt.Pipeline takes a module (or a list of chunk modules), got a {type(bad).__name__}"
            )
        if len(given) == len(local):
            return given
        if not chunked:
            raise UmoptError(
                f"the schedule has one chunk per rank, but stage {self.me} was given a list of {len(given)} modules: "
                "give the stage's module (for several chunks per rank, solve with --chunks)"
            )
        if not isinstance(module, (list, tuple)):
            raise UmoptError(
                f"rank {self.me} holds virtual stages {local} of the schedule: give umopt.Pipeline this rank's "
                "chunk modules as a list, in virtual stage order"
            )
        raise UmoptError(
            f"rank {self.me} holds virtual stages {local} of the schedule, but was given {len(given)} modules"
        )

    def _connect(self, ops: list[list[ChunkOp]]) -> None:
        """Every rank of the world says which directions its pipeline uses (so that every rank
        knows every replica's and makes their groups, and no rank goes on before all have got
        this far); then the links' groups are made and connected (umopt/run/comm.py)."""
        comm = self.comm
        mine = sorted((self.ranks[a], self.ranks[b]) for a, b in directions(self.ranks_of))
        failed = f"{self.id}/failed"
        comm.put(f"{self.id}/links/{comm.rank}", (mine, tuple(self.ranks), sorted(self.tied)))
        if comm.rank == 0:
            every: set = set()
            holders: dict[tuple, list[int]] = {}  # (pipeline, tied key): the ranks holding a copy
            for r in range(comm.world):
                links, pipeline, keys = comm.get(
                    f"{self.id}/links/{r}", f"rank {r} to build its pipeline", failed
                )
                every |= set(map(tuple, links))
                for key in keys:
                    holders.setdefault((pipeline, key), []).append(r)
            ties = sorted((key, tuple(h)) for (_, key), h in holders.items() if len(h) > 1)
            comm.put(f"{self.id}/links", (sorted(every), ties))
        every, ties = comm.get(f"{self.id}/links", "rank 0 to gather the pipelines' links", failed)
        self._linking = True
        comm.link_groups(map(tuple, every))
        groups = comm.groups_of([h for _, h in ties])  # [Note: tied weights]
        self._ties = {k: (self.tied[k], groups[h]) for k, h in ties if comm.rank in h}
        self._tie_owner = {k: min(h) == comm.rank for k, h in ties if comm.rank in h}
        if isinstance(comm, TorchComm):
            comm.watch_for_failures()

    def _learn_specs(self, xs: tuple[torch.Tensor, ...]) -> None:
        """The shapes at every boundary of this rank, agreed along the pipeline in virtual stage
        order (a chain: no rank waits on a later one): each stage tells the next what it sends
        (given, or from a forward of two samples, with token rows of the first sample: see [Note:
        what crosses a boundary])."""
        B = self._rows_total()
        for j, st in sorted(self.stages.items()):
            if st.first:
                st.specs_in = [TensorSpec.of(t) for t in xs]
            else:
                if j - 1 in self.stages:
                    told = self.stages[j - 1].specs_out
                else:
                    src = self.ranks[self.ranks_of[j - 1]]
                    told = self.comm.get(
                        f"{self.id}/specs/{j - 1}", f"rank {src} to say what {st.label} {j - 1} sends"
                    )
                if st.specs_in is not None and list(st.specs_in) != list(told):
                    raise UmoptError(f"{st.name} expects {st.specs_in} but {st.label} {j - 1} sends {told}")
                st.specs_in = list(told)
            if not st.last:
                if st.specs_out is None:
                    if st.first and not xs:
                        raise UmoptError(
                            f"{st.name} learns what it sends from a forward: pass its inputs to prepare() or step()"
                        )
                    n = min(2, B) if st.tokens is None else st.tokens.count(0, 1)
                    st.specs_out = st.learn_output(
                        tuple(t[:n] for t in xs) if st.first else st.sample_inputs(n)
                    )
                self.comm.put(f"{self.id}/specs/{j}", st.specs_out)
            st.allocate(B)
        self._ready = True

    def prepare(self, inputs: Optional[Tensors] = None) -> None:
        """Agree on the boundary shapes now (the rank holding the first stage passes a batch of
        its inputs) rather than in the first step, e.g. to keep that step's time clean. Every
        rank must call it, or none."""
        if not self._ready:
            xs = tensors(inputs, "the inputs") if self.holds_first else ()
            self._guarded(lambda: self._learn_specs(xs))

    def share_buffers(self, other: Pipeline) -> None:
        """Use ``other``'s receive buffers where the shapes agree (their steps never overlap)."""
        if self._ready and other._ready:
            for j, st in self.stages.items():
                st.share(other.stages[j])

    def release(self) -> None:
        """Let go of this pipeline's receive buffers (a schedule selection did not keep)."""
        for st in self.stages.values():
            st.act, st.grad = [], []
        self._ready = False

    # --- one iteration -----------------------------------------------------------------------
    def step(
        self,
        *args: Any,
        inputs: Optional[Tensors] = None,
        targets: Optional[Tensors] = None,
        target: Optional[Tensors] = None,
        losses: Optional[list] = None,
        plan: Union[None, Schedule, Callable[[], Schedule]] = None,
    ) -> Optional[torch.Tensor]:
        """Run one iteration's forwards and backwards on this rank; gradients accumulate in the
        modules' parameters (the optimizer step is yours). The rank holding the first stage passes
        the minibatch's inputs (``step(x)``), the one holding the last its targets
        (``step(target=y)``; ``targets=`` too), the others nothing. Returns the minibatch's loss
        where the last stage is (detached; exactly one process's; with ``dp_group``, this
        replica's share of the global minibatch's loss), None elsewhere; ``losses``, a list, gets
        each chunk's own loss appended, as torch's schedules do.

        With a plan for sequences of different lengths (``umopt solve --lengths``), the inputs
        and targets are lists of the minibatch's sequences (1-d tensors, as the plan's lengths
        list them), and ``plan`` is this minibatch's plan, given where the first stage is (the
        other ranks read it from there; one given them must play alike; default: the last
        step's, for a minibatch of the same lengths): its samples, each stage's chunks and op
        order (see [Note: token rows] in umopt/run/tokens.py). ``plan`` may be a function that
        returns it (``PlanAhead.next``): it is called inside the step, so waiting for a late plan
        counts in the step, and a plan that never comes fails the step on every rank.

        A step that raises leaves this pipeline (and every other of this process) unable to step
        again, and makes the other ranks' steps fail at once instead of waiting (see [Note: a
        failed step breaks the pipeline]).
        """

        def run(p: Pipeline) -> Optional[torch.Tensor]:
            out = p._guarded(
                lambda: (
                    p._use(p._shared(plan))
                    or p._step(*p._inputs(args, inputs, targets, target), losses=losses)
                )
            )
            self.spans = p.spans
            return out

        if self.turns is not None and not self.turns.done:
            out = self.turns.step(run)
            self.played = self.turns.played
            return out
        if self.turns is not None:
            self.played = self.selected
        return run(self.playing)

    @property
    def playing(self) -> Pipeline:
        """The pipeline that plays the steps: this one, or the candidate selection kept."""
        return self.turns.winner if self.turns is not None else self

    def played_schedules(self) -> list[Schedule]:
        """The schedules its steps have played: the pick, and the candidates that took turns."""
        if self.turns is None:
            return [self.schedule]
        return [t.schedule for t in self.turns.turns if t.pipe is not None]

    @property
    def up_next(self) -> Optional[str]:
        """The schedule the next step plays, where there are candidates (None: no candidates)."""
        return self.turns.up_next if self.turns is not None else None

    def eval_step(
        self,
        *args: Any,
        inputs: Optional[Tensors] = None,
        targets: Optional[Tensors] = None,
        target: Optional[Tensors] = None,
        outputs: bool = False,
        plan: Union[None, Schedule, Callable[[], Schedule]] = None,
    ) -> Any:
        """Forwards only, under ``torch.no_grad()``, chunked as the schedule's forwards: nothing is
        stashed and no gradient is touched. Returns, where the last stage is, the minibatch's loss
        exactly as one process computes it (with ``outputs=True``: ``(loss, output)``, the last
        stage's output of the whole minibatch, in its samples' order; with a plan of sequences of
        different lengths, a list of one output per sequence in the minibatch's order, each
        ``(length, ...)`` without padding, as the inputs were given), None elsewhere. Train or
        eval mode is the modules' own, as in one process (call ``module.eval()`` for dropout)."""
        play = self.playing
        return play._guarded(
            lambda: (
                play._use(play._shared(plan))
                or play._eval(*play._inputs(args, inputs, targets, target), keep=outputs)
            )
        )

    def share(self, sequences: Sequence[Any], *more: Sequence[Any], assign: str = "umopt") -> Any:
        """This replica's share of a global minibatch of sequences: with ``dp_group``, every
        replica reads the step's whole global minibatch (the same on each, e.g. from a sampler
        seeded by the step) and trains on the sequences this picks for it, by default those that
        make the replicas' pipelines finish together (:func:`umopt.search.replicas.assign`, the
        same on every rank without a word exchanged; ``assign="contiguous"``: the r-th of D
        contiguous parts, as torch's DistributedSampler). Replica ``r`` is the ``r``-th rank of
        ``dp_group``. ``sequences`` and each of ``more`` (the targets, say) are lists of 1-d
        tensors, one per sequence, taken alike; returns the share of each (one list where only
        ``sequences`` is given). The loss stays the global minibatch's: each step normalizes by
        all the replicas' tokens."""
        lists = [list(sequences), *(list(m) for m in more)]
        if any(len(x) != len(lists[0]) for x in lists):
            raise UmoptError(
                f"share: lists of {', '.join(str(len(x)) for x in lists)} sequences: give them alike"
            )
        ranks = self.comm.group_ranks(self.dp_group) if self.dp_group is not None else [self.comm.rank]
        if self.comm.rank not in ranks:
            raise UmoptError(f"share: rank {self.comm.rank} is not in its dp_group {ranks}")
        if self.profile.lengths is None:
            raise UmoptError("share: the profile has no costs by tokens to assign sequences by")
        if len(ranks) == 1:
            return lists[0] if not more else tuple(lists)
        lengths = [int(x.shape[0]) for x in lists[0]]
        mine = assign_replicas(self.profile, lengths, len(ranks), assign).replicas[
            ranks.index(self.comm.rank)
        ]
        out = [[x[i] for i in mine] for x in lists]
        return out[0] if not more else tuple(out)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every rank's parameters by their norm over the whole pipeline,
        as ``torch.nn.utils.clip_grad_norm_`` on the whole model in one process does (a rank's own
        norm is only its part of it). Collective over the pipeline's ranks (``group``); call it
        after ``step`` (with ``dp_group``, the gradients are already averaged, so the replicas
        agree). Returns the total norm."""
        if isinstance(self.group, (list, tuple)):
            raise UmoptError(
                "clip_grad_norm_ sums the norm over the pipeline's group: give group= a process group"
            )
        grads = [p.grad for st in self.stages.values() for p in st.module.parameters() if p.grad is not None]
        # a tied weight's copies hold one gradient: counted once, on its lowest rank, clipped on all
        others = {id(p) for k, (p, _) in self.playing._ties.items() if not self.playing._tie_owner[k]}
        counted = [
            p.grad
            for st in self.stages.values()
            for p in st.module.parameters()
            if p.grad is not None and id(p) not in others
        ]
        device = self.device
        if math.isinf(norm_type):
            local = (
                torch.stack([g.detach().abs().max().float() for g in counted]).max()
                if counted
                else torch.zeros(())
            )
            total = local.to(device).reshape(1)
            self.comm.all_reduce(total, self.group, op="max")
            norm = total[0]
        else:
            local = sum(
                (torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in counted),
                torch.zeros(()),
            )
            total = torch.as_tensor(local, device=device).reshape(1)
            self.comm.all_reduce(total, self.group)
            norm = total[0] ** (1.0 / norm_type)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def _guarded(self, run: Callable[[], Any]) -> Any:
        return guarded(self.comm, run, self.who, self.on_failure)

    def _inputs(
        self, args: tuple, inputs: Any, targets: Any, target: Any
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The inputs and targets of a step, as torch's schedules take them (``step(x)``,
        ``step(target=y)``) or as umopt's (``inputs=``, ``targets=``), checked."""
        if args and inputs is not None:
            raise UmoptError("give the inputs once: step(x) or step(inputs=x)")
        if targets is not None and target is not None:
            raise UmoptError("give the targets once: step(target=y) or step(targets=y)")
        if self.plan.lengths is not None:
            return (
                self._sequences(args[0] if len(args) == 1 else (args or inputs), "inputs", 0)
                if self.holds_first
                else (),
                self._sequences(targets if targets is not None else target, "targets", IGNORE)
                if self.holds_last
                else (),
            )
        B = self.schedule.minibatch
        xs = (
            tensors(args[0] if len(args) == 1 else (args or inputs), "the inputs") if self.holds_first else ()
        )
        ys = tensors(targets if targets is not None else target, "the targets") if self.holds_last else ()
        if self.holds_first:
            if not xs:
                raise UmoptError(
                    f"the first stage's step needs inputs of {B} samples (the schedule's minibatch), got none"
                )
            check_samples(xs, B, "the first stage's input (the schedule's minibatch)")
            if self._ready:
                for i, (t, spec) in enumerate(zip(xs, self.stages[0].specs_in)):
                    check_spec(t, spec, f"the first stage's input {i}")
        if self.holds_last:
            if not ys:
                raise UmoptError(f"the last stage's step needs targets of {B} samples, got none")
            check_samples(ys, B, "the last stage's target (the schedule's minibatch)")
        return xs, ys

    def _rows_total(self) -> int:
        """Rows of a boundary for the minibatch: its samples, or with token rows its tokens."""
        rows = next(iter(self.stages.values())).tokens
        return self.schedule.minibatch if rows is None else rows.total

    def _shared(self, plan: Union[None, Schedule, Callable[[], Schedule]]) -> Optional[Schedule]:
        """This step's plan, one maker for all (see [Note: one plan a step, one maker]): the
        maker's, checked once, where it is made; a plan another rank was handed must play alike,
        or the step ends before its first op, on every rank, in one line."""
        if self.schedule.lengths is None:
            return plan() if callable(plan) else plan
        n = self._plans_shared
        self._plans_shared += 1
        maker = self.ranks[self.ranks_of[0]]
        key = f"{self.id}/plan/{maker}/{n}"
        if self.holds_first and n >= PLAN_KEPT:
            self.comm.forget(f"{self.id}/plan/{maker}/{n - PLAN_KEPT}")
        if self._ahead is not None and self._ahead[0] == n:  # shared already (share_next)
            ahead, self._ahead = self._ahead[1], None
            given = plan() if callable(plan) else plan
            if given is not None and given is not ahead and not given.plays_alike(ahead):
                raise UmoptError(f"step {n} was given another plan than share_next() shared for it")
            return ahead
        if self.holds_first:
            plan = plan() if callable(plan) else plan  # waited for inside the step (a late plan is its cost)
            if plan is not None and plan.lengths is not None:
                checked(plan, self.profile)  # before it is shared: the others play it unchecked
            self.comm.put(key, plan)
            return plan
        theirs = self.comm.get(key, f"rank {maker} to say step {n}'s plan", timeout_s=plan_wait_s())
        mine = plan() if callable(plan) else plan
        if mine is not None and not mine.plays_alike(theirs if theirs is not None else self.plan):
            raise UmoptError(
                f"{self.who} was handed another plan for step {n} than rank {maker}, which holds the first stage "
                "and makes the plans: every rank plays the maker's, so pass plan= on that rank only (the others "
                "read it) or the same plan on every rank"
            )
        return theirs

    def share_next(self, plan: Schedule) -> None:
        """Share the next step's plan with the other ranks now, between steps, where this rank
        makes the plans: their next step then finds it at once instead of waiting on the maker's
        (see [Note: one plan a step, one maker]). The next ``step`` plays it (its ``plan=``, if
        given, must be this one)."""
        if self.schedule.lengths is None or not self.holds_first:
            raise UmoptError(
                "share_next() is for the rank holding the first stage of a pipeline of sequences"
            )

        def share() -> None:
            n = self._plans_shared
            maker = self.ranks[self.ranks_of[0]]
            checked(plan, self.profile)
            self.comm.put(f"{self.id}/plan/{maker}/{n}", plan)
            self._ahead = (n, plan)

        self._guarded(share)

    def _use(self, plan: Optional[Schedule]) -> None:
        """Play ``plan`` (a minibatch of sequences of different lengths) from this step on:
        checked against the profile (valid ops, within the memory limit), its token rows set,
        the receive buffers sized for it."""
        if plan is None or plan is self.plan:
            return
        if self.schedule.lengths is None or plan.lengths is None:
            raise UmoptError(
                "plan= is for a pipeline built with a plan for sequences of different lengths (umopt solve --lengths), "
                "and takes one such plan"
            )
        if plan.chunking() != self.schedule.chunking() or len(plan.stages) != len(self.schedule.stages):
            raise UmoptError("the step's plan lays out the stages otherwise than the pipeline's schedule")
        checked(plan, self.profile)  # where it was made: by the maker, or by its planning process
        # this rank's ops and its neighbours' (whose messages it receives): a step's plan of 8
        # stages has a thousand ops, and converting every rank's took a millisecond a step
        ops = [
            [ChunkOp(op[0], op[1], op[2], op[3] if len(op) == 4 else r) for op in st.op_list()]
            if r in self._near
            else []
            for r, st in enumerate(plan.stages)
        ]
        self._play(plan, ops)
        if self._ready:
            for st in self.stages.values():
                st.allocate(self._rows_total())

    def _sequences(self, given: Any, what: str, pad: int) -> tuple[torch.Tensor, ...]:
        """A minibatch's sequences (a list of tensors, as the plan's lengths list them) as one
        tensor of rows in the plan's order (a packed row's padding filled with ``pad``)."""
        ln = self.plan.lengths
        seqs = list(given) if isinstance(given, (list, tuple)) else None
        if not seqs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in seqs):
            raise UmoptError(
                f"the {what} of a minibatch of sequences of different lengths are a list of tensors, one per sequence"
            )
        if len(seqs) != len(ln.lengths):
            raise UmoptError(f"the plan is for {len(ln.lengths)} sequences, the {what} have {len(seqs)}")
        bad = next((i for i, (t, n) in enumerate(zip(seqs, ln.lengths)) if t.shape[0] != n), None)
        if bad is not None:
            raise UmoptError(
                f"sequence {bad} of the {what} has {seqs[bad].shape[0]} tokens, the plan says {ln.lengths[bad]}"
            )
        rows = next(iter(self.stages.values())).tokens
        assert rows is not None
        return (to_device(rows.arrange(seqs, pad), self.device),)  # pinned: no wait for the device

    def _loss_scale(self, ys: tuple[torch.Tensor, ...]) -> Callable[[int, int], Any]:
        assert self._loss is not None
        return loss_scale(self.comm, self._loss, ys, self._rows_total(), self.dp_group, self.device)

    def _chunk_loss(
        self, out: Any, ys: tuple[torch.Tensor, ...], lo: int, hi: int, scale, losses: Optional[list]
    ) -> torch.Tensor:
        """The loss of samples ``[lo, hi)``, counted as its part of the minibatch's (:mod:`umopt.run.losses`)."""
        assert self._loss is not None
        rows = self.stages[len(self.ranks_of) - 1].rows(lo, hi)
        lo, hi = rows.start, rows.stop  # with token rows the loss counts by token
        y = tuple(t[rows] for t in ys)
        y = y[0] if len(y) == 1 else y
        loss = self._loss.fn(out, y)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UmoptError(
                f"loss_fn returned {shape} for a chunk: it must return one number, the chunk's mean or sum "
                "(loss_reduction says which; reduce a per-sample loss with .mean() or .sum())"
            )
        if losses is not None:  # the chunk's own loss, as torch's schedules append it
            own = (
                loss / torch.as_tensor(self._loss.normalizer(y), dtype=torch.float32, device=loss.device)
                if self._loss.rule == "normalized"
                else loss
            )
            losses.append(own.detach())
        return loss * scale(lo, hi)

    def _step(
        self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...], losses: Optional[list]
    ) -> Optional[torch.Tensor]:
        if not self._ready:
            self._learn_specs(xs)
        scale = self._loss_scale(ys) if self.holds_last else None
        loss_sum, spans = self.player.step(
            xs, lambda out, lo, hi: self._chunk_loss(out, ys, lo, hi, scale, losses)
        )
        mark = self.player.timer.mark if self.player.timer is not None else (lambda: None)
        if self._ties:  # after this rank's last messages are through, as the all-reduce below
            t0 = mark()
            sum_tied(self.comm, self._ties)
            spans.append(("TIE", 0, 0, -1, t0, mark()))
        if self.dp_group is not None and len(self.comm.group_ranks(self.dp_group)) > 1:
            # after this rank's last messages are through (see [Note: the all-reduce after the sends])
            t0 = mark()
            params = [p for st in self.stages.values() for p in st.module.parameters()]
            average_gradients(self.comm, params, self.dp_group)
            spans.append(("AR", 0, 0, -1, t0, mark()))
        self.spans = spans
        return loss_sum if self.holds_last else None

    def _eval(self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...], keep: bool) -> Any:
        if not self._ready:
            self._learn_specs(xs)
        scale = self._loss_scale(ys) if self.holds_last else None
        loss_sum, kept = self.player.forwards(
            xs, lambda out, lo, hi: self._chunk_loss(out, ys, lo, hi, scale, None), keep
        )
        if not self.holds_last:
            return None
        if not keep:
            return loss_sum
        output = joined_output(kept)
        rows = self.stages[len(self.ranks_of) - 1].tokens
        if rows is not None:  # sequences: each its own output again, in the minibatch's order
            output = (
                rows.sequences(output)
                if isinstance(output, torch.Tensor)
                else list(zip(*(rows.sequences(t) for t in output)))
            )
        return loss_sum, output


def _per_module(specs: Optional[Sequence[Any]], n: int, what: str) -> list[Optional[list[TensorSpec]]]:
    """Given specs as one list per module (a flat list of TensorSpec where there is one module)."""
    if specs is None:
        return [None] * n
    specs = list(specs)
    if n == 1 and all(isinstance(s, TensorSpec) for s in specs):
        return [specs]
    if len(specs) == n and all(s is None or isinstance(s, (list, tuple)) for s in specs):
        return [None if s is None else list(s) for s in specs]
    raise UmoptError(f"{what}: give a list of TensorSpec per module ({n} modules)")
