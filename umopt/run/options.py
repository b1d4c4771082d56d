"""What ``umopt run`` is asked to do, and everything checked before a rank starts.

:class:`RunOptions` is the typed value the command line becomes (``umopt run``'s click options
declare the same fields, docs/run.md says what each does); the launcher hands it to every rank it
starts, and under torchrun each rank builds its own from the same command line. :func:`preflight`
loads and checks the schedules, the profile and every output before any process starts, with
one-line errors, and returns the :class:`RunConfig` the ranks play.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from ..devices import check_trainable
from ..errors import UmoptError
from ..fileio import check_writable
from ..formats.profile import Profile, load_profile, pydantic_error_line
from ..formats.schedule import (
    Schedule,
    load_schedule,
    require_pick_layout,
)
from ..measure.decide import is_equal
from ..predict import check_against_profile
from ..samplers import minibatch_of_step
from ..search.methods import METHODS, chunked_names
from ..search.replicas import check_assignment
from ..words import count
from ..zoo import build_model, import_object, runnable
from .checkpoint import MANIFEST, read_manifest
from .steps import RUN_STEPS, RUN_WARMUP

__all__ = ["RunOptions", "RunConfig", "preflight", "data_function", "lengths_spec"]


class RunOptions(BaseModel):
    """The options of ``umopt run`` (same names, ``-`` for ``_``; ``schedules`` are its arguments).
    ``None`` is "as the schedule or the profile says": ``dp`` the replicas the schedules were
    solved for, ``backend`` NCCL on CUDA profiles, ``threads`` the profile's."""

    model_config = ConfigDict(extra="forbid")

    schedules: list[str]
    profile: Optional[str] = None
    steps: int = RUN_STEPS
    warmup: int = RUN_WARMUP
    rounds: int = 1
    decide: Optional[float] = None
    budget: float = 120.0
    max_rounds: int = 30
    select: bool = True
    select_steps: Optional[int] = None
    backend: Optional[Literal["gloo", "nccl"]] = None
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: Optional[float] = None
    dp: Optional[int] = None
    threads: Optional[int] = None
    data: Optional[str] = None
    lengths: Optional[str] = None  # a plan for sequences of different lengths: each step's drawn so
    methods: Optional[list[str]] = None  # ... and who plans each step (several take turns)
    # ... and who gives each data-parallel replica its share of the global minibatch: one name for
    # every method, or one per method, comma-separated (each method's steps on its own shares)
    assign: Optional[str] = None
    report: Optional[str] = None
    trace: Optional[str] = None
    plot: Optional[str] = None
    checkpoint: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    save_grads: Optional[str] = None

    @classmethod
    def read(cls, path: str | os.PathLike) -> RunOptions:
        """The options the launcher wrote for its ranks."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValidationError) as exc:
            what = pydantic_error_line(exc) if isinstance(exc, ValidationError) else str(exc)
            raise UmoptError(
                f"{path}: not the options file umopt run hands its ranks ({what}); under torchrun start "
                "umopt run itself: torchrun ... -m umopt.cli run SCHEDULE [options]"
            ) from None


@dataclass
class RunConfig:
    """A run as the ranks play it: the schedules (in the order given; they take turns in it), the
    profile, and the options with ``dp`` and ``backend`` resolved."""

    schedules: list[Schedule]
    profile: Profile
    options: RunOptions
    # what each schedule goes by in turns, logs and {name}: its file's stem, or with a plan for
    # sequences of different lengths the method that plans its steps (its file once per method)
    names: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)  # per schedule, its planning method (else empty)
    assigns: list[str] = field(default_factory=list)  # per schedule, who gives each replica its share

    def __post_init__(self) -> None:
        if not self.names:
            self.names = [Path(p).stem for p in self.options.schedules]

    @property
    def varlen(self) -> bool:
        """Whether the run trains on sequences of different lengths, each step its own plan."""
        return bool(self.methods)

    @property
    def num_stages(self) -> int:
        return len(self.schedules[0].stages)

    @property
    def dp(self) -> int:
        assert self.options.dp is not None  # resolved by preflight
        return self.options.dp

    @property
    def backend(self) -> str:
        assert self.options.backend is not None  # resolved by preflight
        return self.options.backend

    def output(self, template: Optional[str], k: int) -> Optional[str]:
        """Where schedule ``k`` writes what ``template`` (--report, --trace, --plot) names."""
        return None if template is None else template.replace("{name}", self.names[k])


def data_function(spec: str) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """The user's ``--data package.module:fn``, ``fn(step, minibatch) -> (inputs, targets)`` (with a
    plan for sequences of different lengths, lists of sequences: :mod:`umopt.run.feed`)."""
    fn = import_object(spec, "--data")
    if not callable(fn):
        raise UmoptError(f"--data {spec}: not a function")
    return fn


def preflight(opts: RunOptions, verify_stages: Optional[list[int]] = None) -> RunConfig:
    """Everything that can be checked before a process starts; one-line errors. With --resume,
    the checkpoint files of ``verify_stages`` (default: all) are checked against their hashes."""
    if not opts.schedules:
        raise UmoptError("umopt run needs a schedule file")
    schedules = [load_schedule(path) for path in opts.schedules]
    profile = load_profile(opts.profile or schedules[0].profile.path)
    for path, schedule in zip(opts.schedules, schedules):
        try:
            check_against_profile(schedule, profile)
        except UmoptError as exc:
            raise UmoptError(f"{path}: {exc}") from None
    _check_model(profile)
    _check_counts(opts)
    methods = _methods(opts, schedules, profile)
    if methods and len(schedules) == 1:  # one plan file, played once per method: each step planned by it
        schedules = [schedules[0]] * len(methods)
    names = methods or [Path(p).stem for p in opts.schedules]
    _check_turns(opts, schedules, names, methods)
    if len({str(sc.chunks) for sc in schedules}) > 1 and (opts.checkpoint or opts.resume or opts.save_grads):
        raise UmoptError(
            "the schedules place the model's layers on the ranks differently (each layout trains its own "
            "copy of the model): --checkpoint, --resume and --save-grads need one layout"
        )
    if opts.select and len(schedules) == 1:
        require_pick_layout(schedules[0], "give --no-select")
    if opts.resume:
        read_manifest(opts.checkpoint, profile, opts.optimizer, verify=verify_stages)
    dp = opts.dp if opts.dp is not None else _solved_for(schedules)
    if dp < 1:
        raise UmoptError(f"--dp must be at least 1, got {dp}")
    backend = opts.backend or ("nccl" if profile.device.type == "cuda" else "gloo")
    S = len(schedules[0].stages)
    if backend == "nccl" and not torch.cuda.is_available():
        build = (
            "a CPU build of torch" if torch.version.cuda is None else f"torch {torch.__version__} sees no GPU"
        )
        raise UmoptError(f"--backend nccl needs CUDA GPUs: this is {build} (use --backend gloo on CPUs)")
    if backend == "nccl" and torch.cuda.device_count() < S * dp and "LOCAL_WORLD_SIZE" not in os.environ:
        raise UmoptError(
            f"--backend nccl needs one GPU per stage and replica: {S} stages x {dp}, {torch.cuda.device_count()} GPUs here"
        )
    cfg = RunConfig(
        schedules,
        profile,
        opts.model_copy(update={"dp": dp, "backend": backend}),
        names,
        methods,
        _assigns(opts, methods),
    )
    # every output checked before a process starts, not found unwritable after the run
    outputs = [
        cfg.output(t, k) for t in (opts.report, opts.trace, opts.plot) if t for k in range(len(schedules))
    ]
    outputs += [str(Path(opts.checkpoint) / MANIFEST)] if opts.checkpoint else []
    outputs += [str(Path(opts.save_grads) / "grads_stage0.pt")] if opts.save_grads else []
    for path in outputs:
        check_writable(path)
    if opts.data:
        data_function(opts.data)
    return cfg


def _check_model(profile: Profile) -> None:
    check_trainable(profile.device.dtype)
    if not runnable(profile.model.name):
        raise UmoptError(
            f"unknown model {profile.model.name!r}: profile {profile.path} is synthetic (device "
            f"{profile.device.type}), a model nothing runs; profile your own to train it (umopt profile --model gpt "
            "or --model package.module:factory, see README)"
        )
    parts = build_model(profile.model.name, profile.model.args, seed=profile.model.seed)
    layers_needed = profile.stages[-1].layers[1]
    if layers_needed != len(parts.layers):
        raise UmoptError(
            f"profile {profile.path} splits {layers_needed} layers but model {profile.model.name} {profile.model.args} has {len(parts.layers)}"
        )


def _check_counts(opts: RunOptions) -> None:
    if opts.steps < 1 or opts.warmup < 0 or opts.rounds < 1:
        raise UmoptError("--steps and --rounds must be at least 1 and --warmup at least 0")
    if opts.select_steps is not None and opts.select_steps < 0:
        raise UmoptError(f"--select-steps must be at least 0, got {opts.select_steps}")
    if opts.resume and not opts.checkpoint:
        raise UmoptError("--resume needs --checkpoint DIR")
    if opts.checkpoint_every < 0:
        raise UmoptError(f"--checkpoint-every must be at least 0, got {opts.checkpoint_every}")


def _methods(opts: RunOptions, schedules: list[Schedule], profile: Profile) -> list[str]:
    """With a plan for sequences of different lengths, who plans the steps (one schedule's turn
    each); else none (and the options for it refused)."""
    if all(sc.lengths is None for sc in schedules):
        for flag, value in (
            ("--lengths", opts.lengths),
            ("--methods", opts.methods),
            ("--assign", opts.assign),
        ):
            if value is not None:
                raise UmoptError(
                    f"{flag} is for a plan for sequences of different lengths (umopt solve --lengths -o PLAN)"
                )
        return []
    if any(sc.lengths is None for sc in schedules):
        raise UmoptError(
            "a plan for sequences of different lengths runs with plans of sequences only (each step is "
            "planned anew): give --methods umopt,pad,pack for turns with what people run"
        )
    if len(schedules) > 1 and len(schedules) != len(opts.methods or ["umopt"]):
        raise UmoptError(
            f"{len(schedules)} plans of sequences: give one (every method plans on its layout) or one per "
            "--methods entry, in its order (each method on its plan's layout)"
        )
    if len({(len(sc.lengths.lengths), sc.recompute) for sc in schedules}) > 1:  # type: ignore[union-attr]
        raise UmoptError("the plans differ in their count of sequences or in --recompute: plan them alike")
    if profile.lengths is None:
        raise UmoptError(f"profile {profile.path} has no costs by tokens (umopt profile --lengths)")
    if opts.data and opts.lengths:
        raise UmoptError("give --data or --lengths, not both: --data says the sequences")
    if opts.lengths:  # an unknown sampler or a bad file fails here, in one line
        minibatch_of_step(lengths_spec(opts.lengths), 0, 1, profile.lengths.max_length)
    methods = list(opts.methods or ["umopt"])
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise UmoptError(f"--methods: unknown {bad[0]!r}: each of {', '.join(METHODS)}")
    for m, sc in zip(methods, schedules * len(methods) if len(schedules) == 1 else schedules):
        if sc.chunks is not None and not METHODS[m].chunked:
            raise UmoptError(
                f"--methods: {m} plans one chunk per rank, its plan has several: "
                f"each of {', '.join(chunked_names())} (or give {m} a plan of its own with one chunk)"
            )
    if len(set(methods)) < len(methods):
        raise UmoptError("--methods names a method twice")
    why = next((METHODS[m].unavailable(profile) for m in methods if METHODS[m].unavailable(profile)), None)
    if why:
        raise UmoptError(f"--methods: {why}")
    return methods


def _assigns(opts: RunOptions, methods: list[str]) -> list[str]:
    """Per method, who gives each replica its share of a step's global minibatch: ``--assign``'s
    one name for all of them (default umopt), or one per method in their order."""
    if not methods:
        return []
    given = [a.strip() for a in (opts.assign or "umopt").split(",")]
    for a in given:
        check_assignment(a, "--assign")
    if len(given) == 1:
        return given * len(methods)
    if len(given) != len(methods):
        raise UmoptError(
            f"--assign names {len(given)} assignments for {count(len(methods), 'method')}: one for all, or one per method"
        )
    return given


def lengths_spec(given: str) -> str:
    """``--lengths``: a sampler's name, or a file of lengths (as ``umopt solve --lengths``)."""
    return f"file:{given}" if os.path.isfile(given) else given


def _check_turns(opts: RunOptions, schedules: list[Schedule], names: list[str], methods: list[str]) -> None:
    """Several schedules: one output file each; --decide: something to decide between."""
    if len(schedules) > 1:
        if len(set(names)) < len(names):
            raise UmoptError(
                f"two schedules named {next(n for n in names if names.count(n) > 1)}.json: their reports would overwrite each other"
            )
        for opt in ("report", "trace", "plot"):
            if getattr(opts, opt) is not None and "{name}" not in getattr(opts, opt):
                raise UmoptError(
                    f"--{opt} with {len(schedules)} schedules needs {{name}} in its path (one file each)"
                )
        fixed = [(n, sc.minibatch) for n, sc in zip(names, schedules) if sc.lengths is None]
        if len({b for _, b in fixed}) > 1:
            (a, ba), (b, bb) = fixed[0], next(x for x in fixed if x[1] != fixed[0][1])
            raise UmoptError(
                f"{a} trains {ba} samples a step and {b} {bb}: schedules compared in turns must train the same "
                "minibatch (solve them with one -B)"
            )
    if opts.decide is None:
        return
    if not 0.5 < opts.decide < 1:
        raise UmoptError(f"--decide is a confidence between 0.5 and 1, got {opts.decide:g}")
    if len(schedules) < 2:
        raise UmoptError("--decide needs two schedules or more to decide between")
    if methods and "umopt" not in methods:
        raise UmoptError(
            "--decide with --methods compares umopt's plans with a peer's: give --methods umopt,pack"
        )
    if not methods and not any(is_equal(sc.op_lists()) for sc in schedules):
        raise UmoptError(
            "--decide compares with an equal schedule (every stage one partition, its chunks' sizes differing by at "
            "most one): give one, e.g. the solve's gpipe_equal"
        )
    if opts.save_grads or opts.checkpoint_every:
        raise UmoptError(
            "--decide runs an unknown number of steps: --save-grads and --checkpoint-every need a known last one"
        )
    if opts.max_rounds < opts.rounds:
        raise UmoptError(f"--max-rounds {opts.max_rounds} is less than --rounds {opts.rounds}")


def _solved_for(schedules: list[Schedule]) -> int:
    """The data-parallel replicas the schedules were solved for."""
    replicas = {sc.dp.replicas if sc.dp else 1 for sc in schedules}
    if len(replicas) > 1:
        raise UmoptError(
            f"the schedules were solved for {' and '.join(map(str, sorted(replicas)))} data-parallel replicas: give --dp"
        )
    return replicas.pop()
