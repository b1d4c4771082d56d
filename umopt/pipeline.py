"""``umopt.Pipeline``: one stage of a pipeline that runs a umopt schedule, inside your own training loop.

On each rank you build your stage's module (your layers, on your device), load the schedule that
``umopt solve`` wrote, and call :meth:`Pipeline.step` once per iteration; the optimizer, scaler,
clipping, logging and checkpoints stay yours::

    pipe = umopt.Pipeline(stage_module, "schedule.json", loss_fn=nn.CrossEntropyLoss())
    loss = pipe.step(inputs)              # first stage; the last passes targets=..., the others nothing
    optimizer.step(); optimizer.zero_grad()

``step`` plays the stage's op list: ``F(lo, hi)`` runs the forward of samples ``[lo, hi)`` and sends
its output on, ``B(lo, hi)`` runs their backward (recomputing the forward under ``recompute``) and
sends the input gradients back. Neighbours may chunk differently, so a stage receives activations
and gradients into one buffer per boundary tensor for the whole minibatch and reads its chunks as
views of it. The messages of each link are issued by both ends in one agreed order (the cost
model's send times), receives as early as that order allows, so compute overlaps communication
and NCCL, which runs a pair's messages in issue order, cannot deadlock. The gradients left in the
module's parameters are those of ``loss_fn(whole_model(x), y).backward()`` in one process on the
whole minibatch: with ``loss_reduction="mean"`` (torch's default) a chunk's loss counts by its
share of the minibatch, with ``"sum"`` as it is.

What crosses a boundary may be one tensor or a tuple of tensors, each split on dim 0. Their
per-sample shapes and dtypes are given (``input_specs``) or learned once, at the first step, from
one forward of one sample on the stage before; they are never exchanged per step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .costmodel import CostTables, Op, OpKind, simulate
from .decide import Decision
from .devices import TensorSpec, autocast, check_trainable, numerics, numerics_differences
from .errors import UmoptError, first_line
from .formats.profile import Profile, load_profile
from .formats.report import Selection
from .formats.schedule import (
    Schedule,
    check_against_profile,
    load_schedule,
    require_one_chunk,
    require_pick_layout,
)
from .losses import ChunkLoss, chunk_loss
from .selection import (
    MIN_SELECT_ROUNDS,
    SELECT_MAX_STEPS,
    TURN_STEPS,
    decide_turns,
    keep_measuring,
    select_budget,
    selection_record,
    winner_of,
)
from .splitbackward import backward_input

if TYPE_CHECKING:  # (it builds on this module)
    from .chunked_pipeline import ChunkedPipeline

__all__ = [
    "Pipeline",
    "PipelineBroken",
    "StepTimer",
    "link_order",
    "link_groups",
    "share_buffers",
    "BUCKET_BYTES",
]


class PipelineBroken(UmoptError):
    """A step failed because another rank's step failed first (its words inside), or this
    pipeline can no longer step (see [Note: a failed step breaks the pipeline])."""


# gradients all-reduced together across data-parallel replicas, at most (torch DDP's default)
BUCKET_BYTES = 25 << 20

# [Note: one process group per link]
# Every link (s, s+1) has a process group of its own, and its messages go through it only: so,
# under NCCL, each link has its own communicator and CUDA stream. With one group for all of a
# rank's messages, NCCL runs them on one stream in issue order: after
# `init_process_group(device_id=...)` (eager init, what the runtime does) every point-to-point op
# of the world group uses the world's single communicator instead of one per peer pair, so a middle
# stage's receive from s-1, posted early, blocks its later send to s+1, and the stages serialize
# (measured far above prediction on 3+ GPUs, and a probe fit would take that for a per-message
# cost). The cost model orders messages per link only; a group per link is what makes that true.
# NCCL makes a subgroup by splitting the world's communicator, which every rank of the world takes
# part in, in one order: so every rank creates every link's group, other replicas' links too.

_LINKS: dict[str, Any] = {"world": None, "groups": {}, "failed": "", "watching": None}


def link_groups(pipelines: Sequence[Sequence[int]]) -> dict[tuple[int, int], Any]:
    """A process group for each link of each pipeline (its global ranks by stage), made once per
    world and reused (several Pipelines of one set of ranks share them). Collective: every rank of
    the world calls it with the same pipelines (see [Note: one process group per link])."""
    world = dist.distributed_c10d._get_default_group()
    if _LINKS["world"] is not world:  # a new world: the groups (and any failure) of the last one are gone
        _LINKS.update(world=world, groups={}, failed="", watching=None)
    groups: dict[tuple[int, int], Any] = _LINKS["groups"]
    pairs = sorted({tuple(sorted((p[s], p[s + 1]))) for p in pipelines for s in range(len(p) - 1)})
    for pair in pairs:
        if pair not in groups:
            groups[pair] = dist.new_group(list(pair))
    return {pair: groups[pair] for pair in pairs}


Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


# [Note: a failed step breaks the pipeline]
# A step that raises on one rank (a bad batch, an out-of-memory error) leaves messages half done:
# its neighbours wait for messages that will never come, or have sent ones nobody will read, so
# the next step could only hang or exchange the wrong data. So a failed step breaks this process's
# links for good (every later step raises a one-line error saying why), and makes the others fail
# at once, not after the process group's timeout (30 minutes by default): the rank writes why into
# the world's store, then drops every request and destroys its link groups, which closes gloo's
# connections, so a neighbour waiting on that link gets an error at once; it then reads the first
# failure from the store, reports that, and breaks its own links, and so on along the pipeline.
# NCCL does not notice a peer's communicator going away, so under NCCL every process also has a
# thread waiting on the store's key, which aborts its communicators when it appears: the main
# thread's wait then fails instead of hanging. A process whose pipeline broke needs a new process
# group to train on; catching the error and going on is not possible.
def _failure_elsewhere() -> str:
    """The first failure another rank wrote into the store (empty: none)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.get(_FAILED_KEY).decode() if store.check([_FAILED_KEY]) else ""
    except Exception:  # noqa: BLE001 - no store, or it is gone: nothing to read
        return ""


def _break_links(reason: str) -> None:
    """Say why in the store (unless another rank already did), then drop every link group of this
    process (see [Note: a failed step breaks the pipeline])."""
    if _LINKS["failed"]:
        return
    _LINKS["failed"] = reason
    try:
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(_FAILED_KEY, "", reason)  # the first failure stays
    except Exception:  # noqa: BLE001 - the links are still dropped below
        pass
    nccl = dist.get_backend() == "nccl"
    groups = [
        g for g in _LINKS["groups"].values() if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER
    ]
    _LINKS["groups"] = {}
    for g in groups:
        try:
            if nccl:
                dist.distributed_c10d._abort_process_group(g)
            dist.destroy_process_group(g)
        except Exception:  # noqa: BLE001 - broken already is what we want
            pass


def _watch_for_failures() -> None:
    """Under NCCL: a thread that breaks this process's links when another rank's step fails."""
    if _LINKS["watching"] is not None or dist.get_backend() != "nccl":
        return
    store = dist.distributed_c10d._get_default_store()

    def watch() -> None:
        try:
            store.wait([_FAILED_KEY], timedelta(days=365))
            _break_links(store.get(_FAILED_KEY).decode())
        except Exception:  # noqa: BLE001 - the store went away with the process group: nothing to watch
            pass

    _LINKS["watching"] = threading.Thread(target=watch, name="umopt-pipeline-failures", daemon=True)
    _LINKS["watching"].start()


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


def schedule_and_profile(
    schedule: Union[str, Path, Schedule], profile: Optional[Union[str, Path, Profile]]
) -> tuple[Schedule, Profile]:
    """The schedule (a file or loaded) and its profile (given, else the file it names), checked
    against each other."""
    sched = schedule if isinstance(schedule, Schedule) else load_schedule(str(schedule))
    prof = profile if isinstance(profile, Profile) else load_profile(str(profile or sched.profile.path))
    check_against_profile(sched, prof)
    return sched, prof


def guarded(run: Callable[[], Any], who: str, on_failure: Optional[Callable[[BaseException], None]]) -> Any:
    """Run ``run`` unless a step has failed; if it raises, break the links (see [Note: a failed
    step breaks the pipeline]) and raise, with the failure that came first named (``who``: this
    rank, as "stage 2" or "rank 2")."""
    if _LINKS["failed"]:
        raise PipelineBroken(f"this pipeline cannot step again: {_LINKS['failed']}")
    try:
        return run()
    except BaseException as exc:
        first = _failure_elsewhere()
        if first and not isinstance(exc, UmoptError):  # this rank's error is the echo of another's
            exc = PipelineBroken(f"{first} ({who} stopped: {exc.__class__.__name__}: {first_line(exc, 160)})")
        if on_failure is not None:
            on_failure(exc)  # before the links break: the peers fail at once after that
        _break_links(first or f"{who} failed: {exc.__class__.__name__}: {first_line(exc, 300)}")
        if isinstance(exc, PipelineBroken):
            raise exc from None
        raise


def link_order(profile: Profile, schedule: Schedule) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """For each link (s, s+1): its messages in the order both ends issue them.

    A message is ("act", lo, hi) from s to s+1 or ("grad", lo, hi) from s+1 to s, ordered by the
    cost model's send time (then direction and sample), which both ends compute identically.
    """
    tables = CostTables.from_profile(profile, schedule.recompute)
    tl = simulate(tables, schedule.op_lists(), schedule.minibatch)
    order: dict[tuple[int, int], list] = {(s, s + 1): [] for s in range(len(schedule.stages) - 1)}
    for m in sorted(tl.messages, key=lambda m: (m.sent, m.direction != "fwd", m.lo)):
        order[(m.link, m.link + 1)].append(("act" if m.direction == "fwd" else "grad", m.lo, m.hi))
    return order


class StepTimer:
    """Milliseconds since the step started: perf_counter on CPU, CUDA events on GPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, mark) -> float:
        return self.t0.elapsed_time(mark) if self.cuda else (mark - self.t0) * 1e3

    def stop(self) -> float:
        end = self.mark()
        if self.cuda:
            torch.cuda.synchronize()
        return self.ms(end)


def _tensors(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    """``x`` as a tuple of tensors: a tensor, or a tuple or list of tensors, as what crosses a
    boundary in torch.distributed.pipelining; anything else is refused with one line."""
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    inner = (
        next((t for t in x if not isinstance(t, torch.Tensor)), None) if isinstance(x, (tuple, list)) else x
    )
    kind = (
        "a numpy array (make it a tensor: torch.from_numpy)"
        if type(inner).__module__ == "numpy"
        else f"a {type(inner).__name__}"
    )
    raise UmoptError(
        f"{what} is {kind}: umopt.Pipeline takes a tensor or a tuple of tensors there (dicts are not supported: use a tuple)"
    )


def _as_tuple(x: Optional[Tensors]) -> tuple[torch.Tensor, ...]:
    return _tensors(x, "a boundary")


def _grad_carrying(spec: TensorSpec) -> bool:
    return spec.dtype.is_floating_point or spec.dtype.is_complex


def _check_spec(t: torch.Tensor, spec: TensorSpec, what: str) -> None:
    """A boundary tensor against the shape and dtype agreed at the first step (see [Note: fixed boundary shapes])."""
    if tuple(t.shape[1:]) != spec.shape or t.dtype != spec.dtype:
        raise UmoptError(
            f"{what} is {tuple(t.shape[1:])} {t.dtype} per sample, but was {spec.shape} {spec.dtype} at the first step: "
            "boundary shapes are fixed (pad every minibatch to one length, e.g. the longest sequence)"
        )


# [Note: fixed boundary shapes]
# Receive buffers are allocated once, for the whole minibatch, from the per-sample shapes agreed at
# the first step, and never exchanged again (a step would otherwise pay a round trip per link).
# A boundary whose shape changes between steps (dynamic padding) is caught where it is sent, with
# the shapes and the fix, instead of as a transport's "received data size doesn't match".

BATCH_STATISTICS = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones


def batch_statistics_layers(module: nn.Module) -> list[str]:
    """The layers of ``module`` whose output in training depends on the other samples of the
    batch (BatchNorm): chunked, they see a chunk's statistics, not the minibatch's."""
    return [
        name or module.__class__.__name__
        for name, m in module.named_modules()
        if isinstance(m, BATCH_STATISTICS)
    ]


# What broke the links of this process's pipelines, once one step failed (see [Note: a failed step breaks the pipeline])
_FAILED_KEY = "umopt/pipeline-failed"


class Pipeline:
    """One stage of a umopt schedule, run in your own training loop.

    Args:
        module: this stage's layers, on ``device``; called with the boundary tensor (or tuple).
        schedule: a schedule file's path or a loaded :class:`~umopt.formats.schedule.Schedule`.
        stage: which stage this rank runs (default: its rank in ``group``).
        loss_fn: ``loss_fn(output, targets)`` on the last stage (required there). A torch loss
            module is read for what its mean is over (:func:`umopt.losses.chunk_loss`):
            ``nn.CrossEntropyLoss(ignore_index=..., weight=..., label_smoothing=...)`` gives one
            process's gradients as it is.
        loss_reduction: for a plain function: ``"mean"`` (over the samples it is given, the
            default) or ``"sum"``; a loss module's own ``reduction`` is used instead.
        loss_normalizer: ``loss_normalizer(targets)`` of the whole minibatch: what the mean is
            over (valid tokens, say). The loss is then a sum (``loss_reduction="sum"``; a loss
            module's mean is made one), divided by it.
        profile: the profile the schedule was made for (default: the file the schedule names); the
            message order both ends of a link agree on, and the autocast dtype, come from it.
        group: the process group of this pipeline (default: the world); stage ``s`` is its rank ``s``.
        device: where the buffers live (default: the module's first parameter's device).
        input_specs, output_specs: per-sample shape and dtype of each tensor this stage receives
            and sends (default: agreed at the first step, each stage telling the next what one
            forward of one sample gives; given ones are checked against what the stage before says).
        dtype: the autocast dtype of forwards (default: the profile's).
        timer: a :class:`StepTimer` to record each op's span (``spans`` after a step).
        dp_group: the ranks that run this same stage in the other data-parallel replicas of the
            pipeline, each on its own slice of the global minibatch: at the end of each step the
            stage's gradients are averaged over them (bucketed all-reduces), so that they are the
            global minibatch's mean-loss gradients.
        strict: refuse a module with BatchNorm layers (whose gradients cannot equal one
            process's) instead of warning.
        on_failure: called with a failed step's exception before the links break (the runtime
            writes its status there, so that the rank that failed first is the one named).
        select: where the schedule file has candidates (``umopt solve`` writes them), measure
            them and its pick in turns over the first steps and keep the fastest (see [Note:
            selection while training] in umopt/selection.py); every schedule gives the same
            gradients, so training is unchanged. ``selected`` names the winner once chosen,
            ``selection`` says what was measured.
        select_steps: steps at most spent measuring (default: a quarter of ``steps``, at most 60).
        steps: how many steps the run has, if known: measuring then also stops once it has cost
            3% of the run.

    Constructing a Pipeline is collective: every rank of the world takes part in making the
    links' process groups (see [Note: one process group per link]).

    Given a list of modules (this rank's chunks, in virtual stage order) and a schedule with
    several chunks per rank (``umopt solve --chunks``), it is a
    :class:`umopt.chunked_pipeline.ChunkedPipeline`.
    """

    def __new__(cls, module: Any = None, *args: Any, **kwargs: Any):
        if isinstance(module, (list, tuple)):
            from .chunked_pipeline import ChunkedPipeline

            return ChunkedPipeline(module, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        schedule: Union[str, Path, Schedule],
        stage: Optional[int] = None,
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        loss_reduction: Optional[str] = None,
        loss_normalizer: Optional[Callable[[Any], Any]] = None,
        profile: Optional[Union[str, Path, Profile]] = None,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        input_specs: Optional[Sequence[TensorSpec]] = None,
        output_specs: Optional[Sequence[TensorSpec]] = None,
        dtype: Optional[str] = None,
        timer: Optional[StepTimer] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
        strict: bool = False,
        on_failure: Optional[Callable[[BaseException], None]] = None,
        select: bool = True,
        select_steps: Optional[int] = None,
        steps: Optional[int] = None,
    ):
        self.schedule, self.profile = schedule_and_profile(schedule, profile)
        require_one_chunk(self.schedule, "the schedule")
        self.group = group
        S = len(self.schedule.stages)
        self.stage = dist.get_rank(group) if stage is None else stage
        if dist.get_world_size(group) != S:
            raise UmoptError(
                f"the schedule has {S} stages but the process group has {dist.get_world_size(group)} ranks"
            )
        if not 0 <= self.stage < S:
            raise UmoptError(f"stage {self.stage} of a {S}-stage schedule")
        self.first, self.last = self.stage == 0, self.stage == S - 1
        if self.last and loss_fn is None:
            raise UmoptError("the last stage needs loss_fn")
        self.module, self.loss_fn = module, loss_fn
        self._loss: Optional[ChunkLoss] = (
            chunk_loss(loss_fn, loss_reduction, loss_normalizer) if loss_fn is not None else None
        )
        _warn_batch_norm(module, self.stage, strict)
        param = next(module.parameters(), None)
        self.device = device or (param.device if param is not None else torch.device("cpu"))
        self.dtype = dtype or self.profile.device.dtype
        check_trainable(self.dtype)
        _warn_numerics(self.profile)
        self.timer = timer
        self.on_failure = on_failure
        self.dp_group = dp_group
        self.spans: list[tuple[str, int, int, Any, Any]] = []
        self.ops: list[Op] = self.schedule.op_lists()[self.stage]
        self._split = any(
            op.kind == OpKind.W for op in self.ops
        )  # B: the input gradient only; W: the weights'
        order = link_order(self.profile, self.schedule)
        self.up, self.down = (
            order.get((self.stage - 1, self.stage), []),
            order.get((self.stage, self.stage + 1), []),
        )
        self._connect(group, S)
        self.input_specs: Optional[list[TensorSpec]] = list(input_specs) if input_specs is not None else None
        self.output_specs: Optional[list[TensorSpec]] = (
            list(output_specs) if output_specs is not None else None
        )
        self._ready = False
        self._act: list[torch.Tensor] = []  # one buffer per received tensor, the whole minibatch
        self._grad: list[torch.Tensor] = []  # one per sent tensor that carries a gradient back
        self.selected: Optional[str] = None  # the schedule kept, once chosen
        self.selection: Optional[Selection] = None
        self._turns: Optional[_Turns] = None
        if select and self.schedule.candidates:  # the candidates' Pipelines, over the same module
            kwargs = dict(
                loss_fn=loss_fn,
                loss_reduction=loss_reduction,
                loss_normalizer=loss_normalizer,
                profile=self.profile,
                group=group,
                device=self.device,
                input_specs=input_specs,
                output_specs=output_specs,
                dtype=dtype,
                timer=timer,
                dp_group=dp_group,
                strict=strict,
                on_failure=on_failure,
                select=False,
            )
            self._turns = _Turns.of_candidates(
                self, lambda sc: Pipeline(module, sc, self.stage, **kwargs), select_steps, steps
            )

    def _connect(self, group: Optional[dist.ProcessGroup], S: int) -> None:
        """This stage's neighbours and the process group of each link (made by every rank of the
        world, for every replica's pipeline), and the watch for failures elsewhere."""
        ranks = list(range(S)) if group is None else dist.get_process_group_ranks(group)
        self.peer_up = ranks[self.stage - 1] if not self.first else -1
        self.peer_down = ranks[self.stage + 1] if not self.last else -1
        if group is None:
            pipelines = [ranks]
        else:  # every rank of the world makes every replica's links: gather the pipelines
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ranks)
            pipelines = sorted({tuple(r) for r in gathered})
        link_groups(pipelines)
        me = ranks[self.stage]
        # the groups are looked up, not held: a failed step drops them (_break_links)
        self._pair_up = tuple(sorted((self.peer_up, me))) if not self.first else None
        self._pair_down = tuple(sorted((me, self.peer_down))) if not self.last else None
        _watch_for_failures()

    @property
    def link_up(self):
        return _LINKS["groups"].get(self._pair_up) if self._pair_up else None

    @property
    def link_down(self):
        return _LINKS["groups"].get(self._pair_down) if self._pair_down else None

    # --- set-up, once ------------------------------------------------------------------------
    def _sample_forward(self, sample: tuple[torch.Tensor, ...]) -> Any:
        """One forward of ``sample``, leaving the module as it was: in eval mode (a batch of one
        through BatchNorm in training would fail, or move its running statistics), its buffers
        put back after."""
        buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), autocast(self.device, self.dtype):
                return self.module(*sample) if len(sample) > 1 else self.module(sample[0])
        finally:
            self.module.train(training)
            with torch.no_grad():
                for name, b in self.module.named_buffers():
                    b.copy_(buffers[name])

    def _learn_specs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """The shapes at this stage's edges, agreed once along the pipeline: each stage tells the
        next what it sends (given, or from one forward of one sample)."""
        if self.first:
            self.input_specs = [TensorSpec.of(t) for t in inputs]
        else:
            told: list = [None]
            dist.recv_object_list(told, src=self.peer_up, group=self.link_up)
            if self.input_specs is not None and list(self.input_specs) != list(told[0]):
                raise UmoptError(
                    f"stage {self.stage} expects {self.input_specs} but stage {self.stage - 1} sends {told[0]}"
                )
            self.input_specs = list(told[0])
        if not self.last:
            if self.output_specs is None:
                if self.first and not inputs:
                    raise UmoptError(
                        "stage 0 learns what it sends from one forward: pass its inputs to prepare() or step()"
                    )
                sample = (
                    tuple(t[:1] for t in inputs)
                    if self.first
                    else tuple(spec.empty(1, self.device).zero_() for spec in self.input_specs)
                )
                out = self._sample_forward(sample)
                self.output_specs = [TensorSpec.of(t) for t in _tensors(out, f"stage {self.stage}'s output")]
            dist.send_object_list([self.output_specs], dst=self.peer_down, group=self.link_down)
        B = self.schedule.minibatch
        self._act = [spec.empty(B, self.device) for spec in self.input_specs] if not self.first else []
        self._grad = (
            [spec.empty(B, self.device) for spec in self.output_specs if _grad_carrying(spec)]
            if not self.last
            else []
        )
        self._ready = True

    def prepare(self, inputs: Optional[Tensors] = None) -> None:
        """Agree on the boundary shapes now (stage 0 passes a batch of its inputs) rather than in
        the first step, e.g. to keep that step's time clean. Every stage must call it, or none."""
        if not self._ready:
            self._guarded(lambda: self._learn_specs(_tensors(inputs, "stage 0's inputs")))

    # --- one iteration -----------------------------------------------------------------------
    def _inputs(
        self, args: tuple, inputs: Any, targets: Any, target: Any
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The inputs and targets of a step, as torch's schedules take them (``step(x)``,
        ``step(target=y)``) or as umopt's (``inputs=``, ``targets=``), checked."""
        if args and inputs is not None:
            raise UmoptError("give stage 0's inputs once: step(x) or step(inputs=x)")
        if targets is not None and target is not None:
            raise UmoptError("give the targets once: step(target=y) or step(targets=y)")
        B = self.schedule.minibatch
        xs = _tensors(args[0] if len(args) == 1 else (args or inputs), "stage 0's inputs")
        ys = _tensors(targets if targets is not None else target, "the targets")
        if self.first and (not xs or any(t.shape[0] != B for t in xs)):
            raise UmoptError(
                f"stage 0's step needs inputs of {B} samples (the schedule's minibatch), got {[t.shape[0] for t in xs] or 'none'}"
            )
        if self.last and (not ys or any(t.shape[0] != B for t in ys)):
            raise UmoptError(
                f"the last stage's step needs targets of {B} samples, got {[t.shape[0] for t in ys] or 'none'}"
            )
        if self.first and self._ready:
            for i, (t, spec) in enumerate(zip(xs, self.input_specs)):
                _check_spec(t, spec, f"stage 0's input {i}")
        return xs, ys

    def _loss_scale(self, ys: tuple[torch.Tensor, ...]) -> Callable[[int, int], Any]:
        assert self._loss is not None
        return loss_scale(self._loss, ys, self.schedule.minibatch, self.dp_group, self.device)

    def step(
        self,
        *args: Any,
        inputs: Optional[Tensors] = None,
        targets: Optional[Tensors] = None,
        target: Optional[Tensors] = None,
        losses: Optional[list] = None,
    ) -> Optional[torch.Tensor]:
        """Run one iteration's forwards and backwards on this stage; gradients accumulate in the
        module's parameters (the optimizer step is yours). Stage 0 passes the minibatch's inputs
        (``step(x)``), the last stage its targets (``step(target=y)``; ``targets=`` too), the
        others nothing. Returns the minibatch's loss on the last stage (detached; exactly one
        process's), None elsewhere; ``losses``, a list, gets each chunk's own loss appended, as
        torch's schedules do.

        A step that raises leaves this pipeline (and every other of this process) unable to step
        again, and makes the other ranks' steps fail at once instead of waiting (see [Note: a
        failed step breaks the pipeline]).
        """
        if self._turns is not None and self.selected is None:
            return self._turns.step(args, inputs, targets, target, losses)
        play = self._turns.winner if self._turns is not None else self
        return play._guarded(lambda: play._step(*play._inputs(args, inputs, targets, target), losses=losses))

    def eval_step(
        self,
        *args: Any,
        inputs: Optional[Tensors] = None,
        targets: Optional[Tensors] = None,
        target: Optional[Tensors] = None,
        outputs: bool = False,
    ) -> Any:
        """Forwards only, under ``torch.no_grad()``, chunked as the schedule's forwards: nothing is
        stashed and no gradient is touched. Returns, on the last stage, the minibatch's loss
        exactly as one process computes it (with ``outputs=True``: ``(loss, output)``, the last
        stage's output of the whole minibatch), None elsewhere. Train or eval mode is the
        module's own, as in one process (call ``module.eval()`` for dropout)."""
        play = self._turns.winner if self._turns is not None else self
        return play._guarded(lambda: play._eval(*play._inputs(args, inputs, targets, target), keep=outputs))

    def _guarded(self, run: Callable[[], Any]) -> Any:
        return guarded(run, f"stage {self.stage}", self.on_failure)

    def _step(
        self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...], losses: Optional[list]
    ) -> Optional[torch.Tensor]:
        # one piece: a step's ops share its saved activations, deferred weight gradients and links;
        # the loop reads in the order the ops run, as simulate plays them
        recompute = self.schedule.recompute
        if not self._ready:
            self._learn_specs(xs)
        scale = self._loss_scale(ys) if self.last else None
        links = _Links(self)
        saved: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], Any]] = {}
        weights_later: dict[tuple[int, int], Callable[[], None]] = {}  # B chunks whose W is to come
        loss_sum = torch.zeros((), device=self.device)
        spans = []
        mark = self.timer.mark if self.timer is not None else (lambda: None)

        def chunk_input(lo: int, hi: int, grad: bool) -> tuple[torch.Tensor, ...]:
            if self.first:
                return tuple(t[lo:hi] for t in xs)
            return tuple(
                buf[lo:hi].detach().requires_grad_(grad and _grad_carrying(spec))
                for buf, spec in zip(self._act, self.input_specs)
            )

        def forward(x: tuple[torch.Tensor, ...], lo: int, hi: int):
            with autocast(self.device, self.dtype):
                out = self.module(*x) if len(x) > 1 else self.module(x[0])
                if not self.last:
                    return out
                return self._chunk_loss(out, ys, lo, hi, scale, losses)

        try:
            links.advance()
            for kind, lo, hi in self.ops:
                if kind == OpKind.F:
                    links.wait_acts(lo, hi)
                    t0 = mark()
                    x = chunk_input(lo, hi, not recompute)
                    with torch.set_grad_enabled(not recompute):
                        out = forward(x, lo, hi)
                    if self.last:
                        loss_sum += out.detach().float()
                    if not recompute:
                        saved[(lo, hi)] = (x, out)
                    if not self.last:
                        links.send_acts(lo, hi, self._outgoing(out))
                elif kind == OpKind.B:
                    links.wait_grads(lo, hi)
                    t0 = mark()
                    if recompute:
                        x = chunk_input(lo, hi, True)
                        out = forward(x, lo, hi)
                    else:
                        x, out = saved.pop((lo, hi))
                    if self.last:
                        roots, grads = [out], None
                    else:
                        outs = [
                            t for t, spec in zip(_as_tuple(out), self.output_specs) if _grad_carrying(spec)
                        ]
                        pairs = [(o, g[lo:hi]) for o, g in zip(outs, self._grad) if o.requires_grad]
                        roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
                    if self._split:  # the input gradient now, the weight gradient at this chunk's W
                        weights_later[(lo, hi)] = backward_input(x, roots, grads, self.module)
                    elif roots:
                        torch.autograd.backward(roots, grads)
                    if not self.first:
                        links.send_grads(
                            lo,
                            hi,
                            [
                                t.grad if t.grad is not None else torch.zeros_like(t)
                                for t, spec in zip(x, self.input_specs)
                                if _grad_carrying(spec)
                            ],
                        )
                else:  # W: the weight gradients of the B chunks in [lo, hi)
                    t0 = mark()
                    for chunk in sorted(c for c in weights_later if lo <= c[0] and c[1] <= hi):
                        weights_later.pop(chunk)()
                spans.append((kind, lo, hi, t0, mark()))
                links.advance()
            links.finish()
        except BaseException:
            links.drop()  # no request of this step may keep a link open (see _break_links)
            raise
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            # after this stage's last messages are through (see [Note: the all-reduce after the sends])
            t0 = mark()
            average_gradients(self.module.parameters(), self.dp_group)()
            spans.append(("AR", 0, 0, t0, mark()))
        self.spans = spans
        return loss_sum if self.last else None

    def _chunk_loss(
        self, out: Any, ys: tuple[torch.Tensor, ...], lo: int, hi: int, scale, losses: Optional[list]
    ) -> torch.Tensor:
        """The loss of samples ``[lo, hi)``, counted as its part of the minibatch's (:mod:`umopt.losses`)."""
        assert self._loss is not None
        y = tuple(t[lo:hi] for t in ys)
        y = y[0] if len(y) == 1 else y
        loss = self._loss.fn(out, y)
        if losses is not None:  # the chunk's own loss, as torch's schedules append it
            own = (
                loss / torch.as_tensor(self._loss.normalizer(y), dtype=torch.float32, device=loss.device)
                if self._loss.rule == "normalized"
                else loss
            )
            losses.append(own.detach())
        return loss * scale(lo, hi)

    def _outgoing(self, out: Any) -> list[torch.Tensor]:
        """What this stage sends on for a chunk: its output's tensors, checked against the agreed shapes."""
        ts = _tensors(out, f"stage {self.stage}'s output")
        if len(ts) != len(self.output_specs):
            raise UmoptError(
                f"stage {self.stage}'s output has {len(ts)} tensors, but had {len(self.output_specs)} at the first step"
            )
        for i, (t, spec) in enumerate(zip(ts, self.output_specs)):
            _check_spec(t, spec, f"stage {self.stage}'s output {i}")
        return [t.detach() for t in ts]

    def _eval(self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...], keep: bool) -> Any:
        if not self._ready:
            self._learn_specs(xs)
        forwards = [op for op in self.ops if op.kind == OpKind.F]
        # forwards only: each link carries activations alone, in the order the stage before runs its forwards
        links = _Links(
            self,
            up=[("act", lo, hi) for _, lo, hi in self._forwards_of(self.stage - 1)],
            down=[("act", lo, hi) for _, lo, hi in forwards],
        )
        scale = self._loss_scale(ys) if self.last else None
        loss_sum = torch.zeros((), device=self.device)
        kept: dict[int, Any] = {}
        try:
            with torch.no_grad():
                links.advance()
                for _, lo, hi in forwards:
                    links.wait_acts(lo, hi)
                    x = tuple(t[lo:hi] for t in xs) if self.first else tuple(buf[lo:hi] for buf in self._act)
                    with autocast(self.device, self.dtype):
                        out = self.module(*x) if len(x) > 1 else self.module(x[0])
                        if self.last:
                            loss_sum += self._chunk_loss(out, ys, lo, hi, scale, None).float()
                    if self.last and keep:
                        kept[lo] = out
                    if not self.last:
                        links.send_acts(lo, hi, self._outgoing(out))
                    links.advance()
                links.finish()
        except BaseException:
            links.drop()
            raise
        if not self.last:
            return None
        if not keep:
            return loss_sum
        parts = [kept[lo] for lo in sorted(kept)]
        first = _tensors(parts[0], "the last stage's output")
        output = tuple(
            torch.cat([_tensors(p, "the last stage's output")[i] for p in parts]) for i in range(len(first))
        )
        return loss_sum, output[0] if len(output) == 1 else output

    def _forwards_of(self, stage: int) -> list[Op]:
        return [op for op in self.schedule.op_lists()[stage] if op.kind == OpKind.F] if stage >= 0 else []


def _warn_batch_norm(module: nn.Module, stage: int, strict: bool) -> None:
    """BatchNorm in training normalizes each chunk by its own statistics: say so (``strict``: refuse)."""
    batch_norms = batch_statistics_layers(module)
    if not batch_norms:
        return
    line = (
        f"stage {stage} has BatchNorm layers ({', '.join(batch_norms[:3])}{', ...' if len(batch_norms) > 3 else ''}): in training "
        "they normalize each chunk by its own statistics, so gradients will not equal one process's on the whole minibatch; "
        "GroupNorm or LayerNorm chunk exactly"
    )
    if strict:
        raise UmoptError(line)
    logging.getLogger("umopt").warning(line)


def loss_scale(
    loss: ChunkLoss, ys: tuple[torch.Tensor, ...], minibatch: int, dp_group, device: torch.device
) -> Callable[[int, int], Any]:
    """What each chunk's loss counts by (:mod:`umopt.losses`); with data-parallel replicas a
    normalizer is the global minibatch's (its replicas' sum), the gradients' average undone."""
    if loss.rule != "normalized":
        return loss.scale(ys[0] if len(ys) == 1 else ys, minibatch)
    total = torch.as_tensor(
        loss.normalizer(ys[0] if len(ys) == 1 else ys), dtype=torch.float32, device=device
    )
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        total = total.clone()
        dist.all_reduce(total, group=dp_group)
        total = total / dist.get_world_size(dp_group)
    return lambda lo, hi: 1.0 / total


# [Note: the all-reduce after the sends]
# The data-parallel all-reduce runs on a communicator of its own (dp_group) and would start
# while this stage's last sends (its last input gradients) are still in flight on the links'.
# NCCL promises progress for two communicators in flight at once only if both kernels can run
# at the same time, which nothing guarantees (a full GPU, or a peer that starts them in the
# other order, deadlocks). So the all-reduce starts once the links are done. The cost model
# starts it at the stage's last op: the last message's time, on a GPU link microseconds, is
# not counted.
def average_gradients(params, dp_group) -> Callable[[], None]:
    """Start averaging the gradients of ``params`` over the data-parallel replicas of
    ``dp_group``: flat buckets of about :data:`BUCKET_BYTES`, all-reduced together; the function
    returned waits for them, divides and copies back."""
    grads = [p.grad for p in params if p.grad is not None]
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if size and size + g.numel() * g.element_size() > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    n = dist.get_world_size(dp_group)
    flat = [torch.cat([g.reshape(-1) for g in b]) for b in buckets if b]
    works = [dist.all_reduce(f, group=dp_group, async_op=True) for f in flat]

    def finish() -> None:
        for w, f, b in zip(works, flat, [b for b in buckets if b]):
            w.wait()
            f /= n
            offset = 0
            for g in b:
                g.copy_(f[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    return finish


class _Links:
    """The point-to-point messages of one stage for one iteration.

    Both ends of a link issue its messages in the agreed order; a receive is posted as soon as
    every earlier message of that order has been issued, a send when its data is ready. A message
    of a tuple boundary is one transfer per tensor (gradients: per tensor that carries one).
    """

    def __init__(self, pipe: Pipeline, up: Optional[list] = None, down: Optional[list] = None):
        self.p = pipe
        self.up = pipe.up if up is None else up  # each link's messages in the order both ends issue them
        self.down = pipe.down if down is None else down
        self.pos = {"up": 0, "down": 0}
        self.recv_act: dict[tuple[int, int], list] = {}
        self.recv_grad: dict[tuple[int, int], list] = {}
        self.pending_sends: list = []
        self.ready: dict[tuple[str, int, int], list[torch.Tensor]] = {}

    def _issue(self, side: str) -> None:
        p = self.p
        seq = self.up if side == "up" else self.down
        peer = p.peer_up if side == "up" else p.peer_down
        link = p.link_up if side == "up" else p.link_down  # [Note: one process group per link]
        while self.pos[side] < len(seq):
            kind, lo, hi = seq[self.pos[side]]
            base = self.pos[side] * 64  # tags: the message's place in the order, then the tensor
            if (kind == "act") == (side == "up"):  # incoming
                bufs = p._act if side == "up" else p._grad
                works = [
                    dist.irecv(buf[lo:hi], src=peer, tag=base + i, group=link) for i, buf in enumerate(bufs)
                ]
                (self.recv_act if side == "up" else self.recv_grad)[(lo, hi)] = works
            else:
                data = self.ready.pop((kind, lo, hi), None)
                if data is None:
                    return  # not computed yet: later messages of this link wait their turn
                for i, t in enumerate(data):
                    self.pending_sends.append((dist.isend(t, dst=peer, tag=base + i, group=link), t))
            self.pos[side] += 1

    def advance(self) -> None:
        self._issue("up")
        self._issue("down")

    def send_acts(self, lo: int, hi: int, ts: list[torch.Tensor]) -> None:
        self.ready[("act", lo, hi)] = [t.contiguous() for t in ts]
        self._issue("down")

    def send_grads(self, lo: int, hi: int, ts: list[torch.Tensor]) -> None:
        self.ready[("grad", lo, hi)] = [t.contiguous() for t in ts]
        self._issue("up")

    @staticmethod
    def _wait(works: dict, lo: int, hi: int) -> None:
        for mlo, mhi in list(works):
            if mlo < hi and lo < mhi:
                for w in works.pop((mlo, mhi)):
                    w.wait()

    def wait_acts(self, lo: int, hi: int) -> None:
        self.advance()
        self._wait(self.recv_act, lo, hi)

    def wait_grads(self, lo: int, hi: int) -> None:
        self.advance()
        self._wait(self.recv_grad, lo, hi)

    def finish(self) -> None:
        self.advance()
        for works in (self.recv_act, self.recv_grad):
            for ws in works.values():
                for w in ws:
                    w.wait()
        for work, _data in self.pending_sends:
            work.wait()

    def drop(self) -> None:
        """Forget every request of this step: a failed step's requests must not keep its links open."""
        self.recv_act.clear()
        self.recv_grad.clear()
        self.pending_sends.clear()
        self.ready.clear()


def share_buffers(pipes: Sequence[Pipeline]) -> None:
    """Let Pipelines of one stage whose boundaries agree use the first one's receive buffers: their
    steps never overlap, so selection costs no more buffer memory than one schedule."""
    first = pipes[0]
    for p in pipes[1:]:
        if (
            p._ready
            and first._ready
            and (p.input_specs, p.output_specs) == (first.input_specs, first.output_specs)
        ):
            p._act, p._grad = first._act, first._grad


@dataclass
class _Turn:
    name: str
    pipe: Pipeline
    step_ms: list[float] = field(default_factory=list)
    turn_ms: list[float] = field(default_factory=list)

    @property
    def schedule(self) -> Schedule:
        return self.pipe.schedule


class _Turns:
    """A Pipeline's (or a ChunkedPipeline's) pick and candidates taking turns over the first
    steps, TURN_STEPS each per round (the last measured) after a first round that learns shapes (see [Note: selection
    while training] in umopt/selection.py). The group's rank 0 decides and tells the others."""

    def __init__(
        self,
        owner: Pipeline | ChunkedPipeline,
        rivals: list[Pipeline] | list[ChunkedPipeline],
        select_steps: Optional[int],
        run_steps: Optional[int],
    ):
        sched = owner.schedule
        pick = sched.solver.model_extra.get("recommended") or "pick"
        self.owner, self.run_steps = owner, run_steps
        self.turns = [_Turn(pick, owner)] + [_Turn(c.name, p) for c, p in zip(sched.candidates, rivals)]
        n = len(self.turns)
        self.budget = (
            select_budget(run_steps, select_steps, n)
            if run_steps is not None
            else max(
                select_steps if select_steps is not None else SELECT_MAX_STEPS,
                MIN_SELECT_ROUNDS * TURN_STEPS * n,
            )
        )
        self.active = list(range(n))
        self.queue: list[tuple[int, int]] = [(k, TURN_STEPS - 1) for k in self.active]
        self.warming = True  # the first round: a step each, to learn its shapes, unmeasured
        self.rounds = self.spent = 0
        self.decision: Optional[Decision] = None
        self.winner: Pipeline = owner
        if self.budget == 0:
            self._finish(0)

    @classmethod
    def of_candidates(
        cls,
        owner: Pipeline | ChunkedPipeline,
        rival: Callable[[Schedule], Any],
        select_steps: Optional[int],
        run_steps: Optional[int],
    ) -> _Turns:
        """``owner`` and its schedule's candidates in turns, each candidate ``rival(schedule)``, a
        pipeline over the owner's own modules (so the candidates must share its layout)."""
        require_pick_layout(owner.schedule, "pass select=False")
        sched = owner.schedule
        rivals = [rival(sched.candidate_schedule(k)) for k in range(len(sched.candidates))]
        return cls(owner, rivals, select_steps, run_steps)

    def step(self, args, inputs, targets, target, losses) -> Optional[torch.Tensor]:
        k, j = self.queue.pop(0)  # the turn's first step follows another schedule's: not measured
        play = self.turns[k].pipe
        group, device = self.owner.group, self.owner.device
        if device.type == "cuda":  # NCCL's barrier on this rank's own GPU, not on GPU 0
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)
        timer = StepTimer(device)
        timer.start()
        out = play._guarded(lambda: play._step(*play._inputs(args, inputs, targets, target), losses=losses))
        worst = torch.tensor([timer.stop()], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        if not self.warming:
            self.turns[k].turn_ms.append(float(worst.item()))
            if j == TURN_STEPS - 1:
                self.turns[k].step_ms.append(float(worst.item()))
            self.spent += 1
        if not self.queue:
            self._end_of_round()
        return out

    def _end_of_round(self) -> None:
        if self.warming:
            self.warming = False
            if all(isinstance(t.pipe, Pipeline) for t in self.turns):  # (a ChunkedPipeline keeps its own)
                share_buffers([t.pipe for t in self.turns])
        else:
            self.rounds += 1
        if self.rounds >= MIN_SELECT_ROUNDS:
            self.decision = decide_turns(self.turns)
            said = torch.zeros(3, dtype=torch.int64)
            group = self.owner.group
            if dist.get_rank(group) == 0:
                stop, left = keep_measuring(self.turns, self.active, self.decision, self.run_steps)
                stop = stop or self.spent + TURN_STEPS * len(left) > self.budget
                said = torch.tensor([stop, winner_of(self.turns, self.decision), sum(1 << k for k in left)])
            said = said.to(self.owner.device)
            dist.broadcast(said, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            self.active = [k for k in range(len(self.turns)) if int(said[2].item()) >> k & 1]
            if bool(said[0].item()):
                return self._finish(int(said[1].item()))
        elif self.spent + TURN_STEPS * len(self.active) > self.budget:
            return self._finish(0)
        self.queue = [(k, j) for k in self.active for j in range(TURN_STEPS)]

    def _finish(self, k: int) -> None:
        self.winner = self.turns[k].pipe
        self.owner.selected = self.turns[k].name
        self.owner.selection = selection_record(
            self.turns, self.turns[k], self.decision, self.spent, self.run_steps, len(self.turns) - 1
        )
        if dist.get_rank(self.owner.group) == 0:
            logging.getLogger("umopt").info(
                "selected %s: %s", self.owner.selected, self.owner.selection.reason
            )
