"""``umopt tune``: profile, solve, run the candidates in turns, and recommend what measured fastest.

Profiles the model on this machine (fitted to probe runs of the runtime where there is a core or
GPU per stage: :mod:`umopt.probes`), solves for the minibatch, and runs the few schedules worth
choosing between (umopt's recommendation, the best schedule found if that is another, one shared
ramped partition as a simpler runner-up, and the best equal GPipe and 1F1B schedules; with
``zero_bubble``, umopt's schedule with W ops and the best equal ZB-H1 too) on the same
processes, taking turns, so that a machine's drift meets them all alike. The prediction chose the
candidates; the measurement chooses among them, taking turns until a paired test over the rounds
decides at a stated confidence or a time budget ends (:mod:`umopt.measure.decide`): ``recommended.json``
is an unequal schedule only where it measured faster than the best equal schedule at that
confidence, else the best equal schedule. With ``chunks`` the profile is taken layer by layer
and the candidates are those of ``umopt solve --chunks`` (:mod:`umopt.search.solve_chunks`): umopt's
pick with several chunks per rank, torch's fastest multi-chunk schedule (an equal reference
too), umopt's one-chunk schedule and the equal GPipe and 1F1B, each layout training its own copy
of the model in the same turns.
Everything it makes lands in one folder: the profile, the schedules, the run reports and the
Gantt pictures.

With sequences of different lengths (:func:`tune_lengths`, ``umopt tune --lengths SAMPLER``) the
profile is costed by tokens too, and ``umopt run`` trains on minibatches drawn from the sampler,
each step planned ahead by umopt's planner and, in turns on the same minibatches, by the peers
(padding to the longest, packing, DynaPipe ...): the measured tokens per second decide.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from .chunks import placement_name
from .costmodel import OpKind, simulate
from .devices import replica_cores
from .errors import UmoptError
from .fileio import check_writable
from .formats.profile import Profile, load_profile, save_profile
from .formats.schedule import Schedule, make_schedule, save_schedule
from .measure import ProfileOptions, check_profile_options
from .measure.calibrate_tokens import calibrate_tokens
from .measure.decide import CONFIDENCE, Decision, decide, pick_sure
from .measure.noise import OFF_PREDICTION
from .probes import profile_for_chunks, profile_in_pipeline
from .run.launch import launch
from .run.options import RunOptions
from .samplers import SAMPLERS, cut_note, minibatch_of_step
from .search.layouts import choose_layouts
from .search.methods import METHODS
from .search.peers.schedules import TORCH_MULTI
from .search.plan import Plan
from .search.problem import Candidate
from .search.replicas import check_assignment
from .search.solve import make_problem, solve
from .search.solve_chunks import solve_chunked
from .search.solve_lengths import plan_schedule
from .search.solvers import SOLVERS
from .search.zerobubble import zb_h1
from .words import count
from .zoo import build_model

__all__ = [
    "DEFAULT",
    "EQUAL",
    "LENGTHS_METHODS",
    "LengthsRow",
    "LengthsResult",
    "TuneRow",
    "TuneResult",
    "pick",
    "tune",
    "tune_lengths",
    "tune_asked",
]

# a small GPT on 2 stages: tune's whole loop within minutes on a laptop's cores
DEFAULT = {
    "model": "gpt",
    "model_args": {"layers": 4, "d_model": 128, "heads": 4, "vocab": 2048, "seq_len": 64},
    "stages": 2,
    "minibatch": 32,
}
EQUAL = ("gpipe_equal", "1f1b_equal")
LENGTHS_METHODS = ("umopt", "pad", "pack", "dynapipe")  # what tune --lengths measures in turns


@dataclass
class TuneRow:
    name: str
    chunks: str
    predicted_ms: float
    measured_ms: float  # the median of every measured step
    rounds_ms: list[float]  # the median of each round
    schedule: str
    report: str
    plot: str
    same_as: Optional[str] = None  # the row whose schedule this is (the same ops): measured once, as that


@dataclass
class TuneResult:
    rows: list[TuneRow]
    lower_bound_ms: float
    bound_holds_for: str
    out_dir: str
    recommended: str  # the name of the row written as recommended.json
    reason: str
    confidence: float  # of the decision (umopt.measure.decide): the winner faster, or no candidate worth it
    decided: bool  # reached the asked confidence before the budget ended, every pair told apart
    warnings: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why the solve recommended what it did, where it matters
    pick_sure: bool = False  # the pick reached the asked confidence (what may be left open: the others)

    def row(self, name: str) -> TuneRow:
        return next(r for r in self.rows if r.name == name)

    def speedup(self, row: TuneRow, measured: bool = True) -> float:
        base = self.rows[0]
        return (base.measured_ms / row.measured_ms) if measured else (base.predicted_ms / row.predicted_ms)


def pick(rows: list[TuneRow], confidence: float = CONFIDENCE, equal: Sequence[str] = EQUAL) -> Decision:
    """The row to recommend, by the paired test over rounds of :mod:`umopt.measure.decide` against the
    fastest of the ``equal`` rows (the schedules people run today)."""
    return decide({r.name: r.rounds_ms for r in rows}, equal, confidence)


def _check_runnable(opts: ProfileOptions) -> None:
    """What would fail only after minutes of timing, checked before any."""
    check_profile_options(opts)
    if opts.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < (opts.stages or 1):
            raise UmoptError(
                f"umopt tune runs each stage on its own GPU: {opts.stages} stages, {gpus} GPU(s) here (use --stages {gpus})"
            )


def _counts_the_layers_allow(opts: ProfileOptions, chunks: Sequence[int], say) -> tuple[int, ...]:
    """``--chunks auto``'s counts (several asked) that the model's layers allow on its stages; a
    single count asked is kept (too few layers for it is an error, said by the profile)."""
    many = [c for c in chunks if c > 1]
    if len(many) < 2:
        return tuple(chunks)
    layers = len(build_model(opts.model, opts.model_args, seed=opts.seed).layers)
    kept = tuple(c for c in chunks if c * (opts.stages or 1) <= layers)
    if len(kept) < len(chunks):
        say(f"{opts.model} has {layers} layers: up to {max(kept)} chunks per rank on {opts.stages} stages")
    return kept


def _profile(opts: ProfileOptions, probes: bool, probe_minibatch: int, chunks: int) -> Profile:
    """The profile (with ``chunks`` > 1, layer by layer: :func:`umopt.probes.profile_for_chunks`);
    on CUDA measured in a child process, so that the CUDA context and whatever the allocator keeps
    leave with it and the run's stage 0 finds its GPU as empty as the others."""
    # the profile says how to measure it again: the umopt profile command that asks for the same
    how = dict(
        probes=probes, probe_minibatch=probe_minibatch, argv=opts.command(chunks, probes, probe_minibatch)
    )
    job = (
        functools.partial(profile_in_pipeline, opts, **how)
        if chunks == 1
        else functools.partial(profile_for_chunks, opts, chunks, **how)
    )
    if opts.device != "cuda":
        return job()
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(job).result()


def _profiled(
    opts: ProfileOptions, out_dir: str, probes: bool, probe_minibatch: int, chunks: int, say
) -> tuple[Path, Profile]:
    """The output folder, and the profile measured into it (checked runnable first)."""
    _check_runnable(opts)
    out = Path(out_dir)
    check_writable(out / "profile.json")
    out.mkdir(parents=True, exist_ok=True)
    tokens = f", by tokens up to {opts.lengths}" if opts.lengths else ""
    say(
        f"profiling {opts.model} on {opts.device}, {opts.stages} stages{tokens}"
        + (", then probe runs of the runtime" if probes else "")
    )
    save_profile(_profile(opts, probes, probe_minibatch, chunks), out / "profile.json")
    return out, load_profile(out / "profile.json")


def _microbatches(schedule: Schedule) -> str:
    """The F ops of each stage (each virtual stage with several chunks per rank), as a range."""
    per_stage: dict[int, int] = {}
    for r, ops in enumerate(schedule.op_lists()):
        for op in ops:
            if op[0] == OpKind.F:
                j = op[3] if len(op) == 4 else r
                per_stage[j] = per_stage.get(j, 0) + 1
    counts = sorted(set(per_stage.values()))
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"


def _one_chunk_plans(
    prof: Profile, minibatch: int, time_limit: float, seed: int, zero_bubble: bool, notes: list[str]
) -> tuple[dict[str, Schedule], tuple[float, str]]:
    """The one-chunk candidates worth measuring (umopt's recommendation named "umopt"), and the
    solve's lower bound with what it holds for; ``notes`` gets why the solve recommended what it
    did where that is not its fastest schedule."""
    report = solve(prof, minibatch, time_limit=time_limit, seed=seed, zero_bubble=zero_bubble)
    problem = make_problem(prof, minibatch, False)

    def plan(name: str, cand: Candidate) -> Schedule:
        return make_schedule(
            prof,
            minibatch,
            False,
            cand.ops(),
            cand.simulate(problem),
            {"name": name, "status": "feasible", "seconds": 0.0},
            {},
        )

    plans: dict[str, Schedule] = {}
    for b in (report.gpipe, report.onef1b):
        if b.candidate is not None:
            plans[b.name] = plan(b.name, b.candidate)
    plans["umopt"] = plan("umopt", report.choice.candidate)
    if report.result.candidate.ops() != report.choice.candidate.ops():
        plans["umopt_best"] = plan("umopt_best", report.result.candidate)  # where the choice was simpler
        notes.append(
            f"umopt is what the solve recommends, not its fastest schedule (umopt_best): {report.choice.reason}"
        )
    ramp = SOLVERS["ramp"](problem).candidate
    ramp_ms = ramp.simulate(problem).iteration_ms
    if ramp_ms < min(plans[n].predicted.iteration_ms for n in EQUAL if n in plans):
        plans["ramp"] = plan("ramp", ramp)  # one shared partition: a simpler runner-up
    if (
        zero_bubble
    ):  # W ops where the solve placed them (if they paid in prediction), and the best equal ZB-H1
        with_w = report.schedule.op_lists()
        if any(op.kind == OpKind.W for st in with_w for op in st):
            plans["umopt_w"] = plan("umopt_w", Candidate.from_ops(with_w))
        zb = zb_h1(problem, seconds=1.0)
        if zb is not None:
            plans["zbh1_equal"] = plan("zbh1_equal", Candidate.from_ops(zb[1]))
    lb = report.schedule.solver.lower_bound_ms or report.lower_bound_ms
    if not any(op[0] == "W" for p in plans.values() for st in p.stages for op in st.ops):
        return plans, (lb, "one chunk per rank")
    lb_w = report.schedule.solver.lower_bound_w_ms
    if lb_w is not None:  # each bound holds for its own kind of schedule: the smaller for both
        return plans, (min(lb, lb_w), "one chunk per rank, with W ops or without")
    return plans, (lb, "one chunk per rank without W ops")


def _chunked_plans(
    prof: Profile, minibatch: int, chunks: Sequence[int], time_limit: float, seed: int, zero_bubble: bool
) -> tuple[dict[str, Schedule], tuple[float, str]]:
    """The candidates with up to ``max(chunks)`` chunks per rank: the equal one-chunk GPipe and
    1F1B, umopt's one-chunk schedule, torch's fastest multi-chunk schedule (its own order, at its
    best v and M) and umopt's pick (named "umopt"), and its lower bound with what it holds for."""
    report = solve_chunked(prof, minibatch, chunks, time_limit=time_limit, seed=seed, zero_bubble=zero_bubble)
    found = report.layouts
    problem = make_problem(prof, minibatch, False)
    plans: dict[str, Schedule] = {}
    for b in (report.gpipe, report.onef1b):
        if b.candidate is not None:
            plans[b.name] = make_schedule(
                prof,
                minibatch,
                False,
                b.candidate.ops(),
                b.candidate.simulate(problem),
                {"name": b.name, "status": "feasible", "seconds": 0.0},
                {},
            )
    plans["umopt_one_chunk"] = found.one_chunk_schedule
    peers = [(name, p) for name, p in found.peers.items() if p.iteration_ms is not None]
    if peers:
        name, p = min(peers, key=lambda kv: kv[1].iteration_ms)
        plans[f"torch_{name.removeprefix('Schedule')}"] = make_schedule(
            prof,
            minibatch,
            False,
            p.ops,
            simulate(p.tables, p.ops, minibatch),
            {"name": name, "status": "feasible", "seconds": 0.0},
            {},
            chunks=p.chunking,
            placement=TORCH_MULTI[name][0],
        )
    plans["umopt"] = report.schedule
    solver = report.schedule.solver
    scope = solver.bound_holds_for or "one chunk per rank"
    return plans, (solver.lower_bound_ms or 0.0, scope)


def tune(
    model: str,
    model_args: dict,
    stages: int,
    minibatch: int,
    *,
    device: str = "cpu",
    steps: int = 2,
    warmup: int = 2,
    rounds: int = 4,
    confidence: float = CONFIDENCE,
    budget: float = 120.0,
    out_dir: str = "umopt-tune",
    time_limit: float = 10.0,
    max_size: Optional[int] = None,
    seed: int = 0,
    probes: bool = True,
    dtype: str = "float32",
    link_latency_ms: Optional[float] = None,
    link_gbps: Optional[float] = None,
    zero_bubble: bool = False,
    chunks: Optional[Sequence[int]] = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> TuneResult:
    """Profile, solve, measure the candidates in turns, recommend; ``chunks`` (counts per rank,
    e.g. (1, 2, 3, 4)): also schedules with several chunks per rank, umopt's and torch's."""
    opts = ProfileOptions(
        model=model,
        model_args=model_args,
        stages=stages,
        max_size=max_size or min(64, minibatch),
        device=device,
        dtype=dtype,
        seed=seed,
        link_latency_ms=link_latency_ms,
        link_gbps=link_gbps,
        split_backward=zero_bubble,
    )
    chunks = _counts_the_layers_allow(opts, chunks or (1,), say)
    v = max(chunks)
    out, prof = _profiled(opts, out_dir, probes, min(minibatch, 32) if minibatch >= 4 else minibatch, v, say)
    warnings = list(prof.meta.warnings)
    say(
        f"solving for minibatch {minibatch} ({time_limit:g} s)"
        + (f", up to {v} chunks per rank" if v > 1 else "")
    )
    notes: list[str] = []
    if v > 1:
        plans, (lb, scope) = _chunked_plans(prof, minibatch, chunks, time_limit, seed, zero_bubble)
    else:
        plans, (lb, scope) = _one_chunk_plans(prof, minibatch, time_limit, seed, zero_bubble, notes)
    rows, decision, run_warnings = _measure(plans, out, steps, warmup, rounds, confidence, budget, say)
    warnings += run_warnings
    recommended = decision.winner
    shutil.copyfile(out / f"{recommended}.json", out / "recommended.json")
    return TuneResult(
        rows,
        lb,
        scope,
        str(out),
        recommended,
        decision.reason,
        decision.confidence,
        decision.decided,
        warnings,
        sorted(str(p) for p in out.iterdir()),
        notes,
        pick_sure(decision),
    )


def _measure(
    plans: dict[str, Schedule],
    out: Path,
    steps: int,
    warmup: int,
    rounds: int,
    confidence: float,
    budget: float,
    say: Callable[[str], None],
) -> tuple[list[TuneRow], Decision, list[str]]:
    """The candidates run in turns on the same processes until the paired test decides (or the
    budget ends); their rows in ``plans``' order, the decision against the equal ones (GPipe,
    1F1B, torch's), and what measured far off its prediction. A candidate the same as one before
    it (umopt's pick may be an equal schedule, or torch's) runs once; its row is that run's."""
    twin: dict[str, str] = {}
    for name, sched in plans.items():
        key = (str(sched.chunks), sched.op_lists())
        twin[name] = next(n for n, o in plans.items() if (str(o.chunks), o.op_lists()) == key)
    names = [n for n in plans if twin[n] == n]
    paths = []
    for n in names:
        paths.append(str(out / f"{n}.json"))
        save_schedule(plans[n], paths[-1])
    equal = [n for n in names if n in EQUAL or n.startswith("torch_")]
    alone = len(names) == 1  # (one stage: every partition runs its chunks one after another)
    if alone:
        say(
            f"{names[0]} is the only schedule worth measuring (the others are the same ops): running it, {rounds} x {steps} steps"
        )
    else:
        say(
            f"running {', '.join(names)} in turns, rounds of {count(steps, 'step')} each, until decided at {100 * confidence:.0f}% confidence (at least {count(rounds, 'round')}, at most {budget:g} s)"
        )
    options = RunOptions(
        schedules=paths,
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        decide=None if alone else confidence,
        budget=budget,
        report=str(out / "report_{name}.json"),
        plot=str(out / "measured_{name}.png"),
        select=False,
    )
    result = launch(options, quiet=True)
    measured, warnings = {}, []
    for name, path, r, rep in zip(names, paths, result.reports, result.report_paths):
        plot = str(out / f"measured_{name}.png")
        measured[name] = TuneRow(
            name,
            _microbatches(plans[name]),
            r.predicted_iteration_ms,
            r.measured_iteration_ms,
            r.round_ms,
            path,
            rep,
            plot,
        )
        off = r.measured_over_predicted - 1
        if abs(off) > OFF_PREDICTION:
            warnings.append(f"{name} measured {100 * off:+.0f}% off its prediction")
    rows = [measured[n] for n in names]
    if alone:
        decision = Decision(
            names[0],
            names[0],
            1.0,
            True,
            rounds,
            (),
            "the only schedule: every candidate runs these same ops",
        )
    else:
        decision = pick(rows, confidence, equal)  # the runtime's own, recomputed from the reports
    for k, name in enumerate(plans):
        same = twin[name]
        if same == name:
            continue
        for kind, ext in (("report", "json"), ("measured", "png")):
            shutil.copyfile(out / f"{kind}_{same}.{ext}", out / f"{kind}_{name}.{ext}")
        shutil.copyfile(out / f"{same}.json", out / f"{name}.json")
        files = dict(schedule=str(out / f"{name}.json"), report=str(out / f"report_{name}.json"))
        rows.insert(
            k,
            replace(measured[same], name=name, plot=str(out / f"measured_{name}.png"), same_as=same, **files),
        )
    return rows, decision, warnings


@dataclass
class LengthsRow:
    method: str  # who planned the steps
    tokens_per_s: float  # measured, real tokens
    predicted_tokens_per_s: float
    measured_ms: float  # the mean step
    predicted_ms: float
    rounds_ms: list[float]  # the median step of each round
    report: str
    plot: str
    chunks: int = 1  # per rank, in the layout the method chose
    assign: Optional[str] = None  # with several replicas: who gave each its share of the global minibatch


@dataclass
class LengthsResult:
    rows: list[LengthsRow]
    out_dir: str
    recommended: str  # the method that measured fastest at the confidence (else the best peer)
    reason: str
    decided: bool  # every pair told apart at the asked confidence before the budget ended
    warnings: list[str]
    files: list[str]
    dp: int = 1  # data-parallel replicas of the pipeline
    pick_sure: bool = False  # the pick reached the asked confidence (what may be left open: the others)


def tune_lengths(
    model: str,
    model_args: dict,
    stages: int,
    lengths: str,
    size: int,
    max_length: int,
    *,
    methods: Sequence[str] = LENGTHS_METHODS,
    device: str = "cpu",
    steps: int = 4,
    warmup: int = 2,
    rounds: int = 4,
    confidence: float = CONFIDENCE,
    budget: float = 120.0,
    out_dir: str = "umopt-tune",
    seed: int = 0,
    probes: bool = True,
    dtype: str = "float32",
    link_latency_ms: Optional[float] = None,
    link_gbps: Optional[float] = None,
    chunks: Sequence[int] = (1,),
    dp: int = 1,
    peer_assign: str = "contiguous",
    say: Callable[[str], None] = lambda _msg: None,
) -> LengthsResult:
    """Profile by tokens, then train on minibatches of ``size`` sequences drawn from ``lengths``
    (a sampler or ``file:PATH``; at most ``max_length`` tokens each), every step planned by each
    of ``methods`` in turns on the same minibatches, until the paired test over rounds decides
    between umopt's plans and the best peer's (or the budget ends); with ``probes``, the costs by
    tokens are first fitted to a probe run of sequences (:func:`_fit_tokens_to_runs`). ``chunks``: the counts of
    chunks per rank each method may hold (above 1: the model profiled layer by layer); each method
    trains on the layout its plan of the first minibatch chose (:mod:`umopt.search.layouts`).
    ``dp``: data-parallel replicas of the pipeline (``stages`` x ``dp`` processes), ``size`` then
    the global minibatch: umopt's steps on umopt's assignment of it to the replicas, each peer's
    on ``peer_assign``'s (default contiguous, as torch's DistributedSampler, Megatron-LM and
    DeepSpeed split it; :mod:`umopt.search.replicas`), so each is measured as it would train."""
    if "umopt" not in methods or len(methods) < 2:
        raise UmoptError("tune --lengths measures umopt's plans against at least one peer's")
    minibatch_of_step(lengths, 0, 1, max_length)  # an unknown sampler fails before any timing
    _check_replicas(size, dp, peer_assign)
    name, _, by = lengths.partition("/")
    if name in SAMPLERS and not by and SAMPLERS[name].cap > max_length:
        k = SAMPLERS[name].cap / max_length
        lengths = f"{name}/{k:g}"
        say(
            f"{name}'s lengths scaled down {k:g} times to at most {max_length} tokens, keeping their spread "
            f"({name}/1 cuts them at {max_length} instead)"
        )
    cut = cut_note(lengths, max_length)
    if cut:
        say(f"warning: {cut}")
    opts = ProfileOptions(
        model=model,
        model_args=model_args,
        stages=stages,
        max_size=min(64, size // dp),
        device=device,
        dtype=dtype,
        seed=seed,
        link_latency_ms=link_latency_ms,
        link_gbps=link_gbps,
        lengths=max_length,
    )
    chunks = _counts_the_layers_allow(opts, chunks, say)
    out, prof = _profiled(opts, out_dir, probes, min(size // dp, 32), max(chunks), say)
    for m in [m for m in methods if METHODS[m].unavailable(prof)]:
        say(f"{m} left out: {METHODS[m].unavailable(prof)}")
        methods = [k for k in methods if k != m]
    if len(methods) < 2:
        raise UmoptError("tune --lengths: no peer's plans can train this model to measure umopt's against")
    # a plan file is of one replica's share (``umopt run`` asks its sequences x dp a step): the
    # first global minibatch's first D-th chooses the layouts and warm-starts the planners
    first = minibatch_of_step(lengths, 0, size, max_length)[: size // dp]
    if probes:
        prof = _fit_tokens_to_runs(prof, out, lengths, first, say)
    chosen = choose_layouts(prof, first, methods, chunks)
    for m, p in chosen.items():
        save_schedule(plan_schedule(p, prof), str(out / f"plan_{m}.json"))
    if max(chunks) > 1:
        say(
            "layouts, each method's fastest on the first minibatch: "
            + ", ".join(f"{m} {_layout_name(p)}" for m, p in chosen.items())
        )
    assigns = ["umopt" if m == "umopt" else peer_assign for m in methods]
    if replica_cores(0, dp, stages * dp) is not None:
        say(
            f"{stages * dp} processes on {count(len(os.sched_getaffinity(0)), 'core')}: each replica kept to cores of "
            "its own, a machine of its own as on a cluster (its stages take turns there, so every method's steps "
            "measure above their predictions alike)"
        )
    replicas = (
        f" across {dp} replicas (each replica's share: umopt's steps by umopt's assignment, the peers' by {peer_assign})"
        if dp > 1
        else ""
    )
    say(
        f"training on minibatches of {size} sequences from {lengths}{replicas}, each step planned by "
        f"{', '.join(methods)} in turns (rounds of {count(steps, 'step')}, until decided at "
        f"{100 * confidence:.0f}% confidence: at least {count(rounds, 'round')}, at most {budget:g} s)"
    )
    options = RunOptions(
        schedules=[str(out / f"plan_{m}.json") for m in methods],
        methods=list(methods),
        lengths=lengths,
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        decide=confidence,
        budget=budget,
        report=str(out / "report_{name}.json"),
        plot=str(out / "measured_{name}.png"),
        select=False,
        dp=dp,
        assign=",".join(assigns) if dp > 1 else None,
    )
    result = launch(options, quiet=True)
    rows, warnings = [], list(prof.meta.warnings)
    for method, r, rep in zip(methods, result.reports, result.report_paths):
        assert r.lengths is not None
        rows.append(
            LengthsRow(
                method,
                r.lengths.tokens_per_s,
                r.lengths.predicted_tokens_per_s,
                r.measured_iteration_ms,
                r.predicted_iteration_ms,
                r.round_ms,
                rep,
                str(out / f"measured_{method}.png"),
                r.chunks_per_rank(),
                r.lengths.assign,
            )
        )
        off = r.measured_over_predicted - 1
        if abs(off) > OFF_PREDICTION:
            warnings.append(f"{method}'s steps measured {100 * off:+.0f}% off their plans' predictions")
    decision = result.reports[0].decision
    assert decision is not None
    # the one to train with: the recommended method's (its planner plans every step of a run)
    shutil.copyfile(out / f"plan_{decision.winner}.json", out / "plan.json")
    return LengthsResult(
        rows,
        str(out),
        decision.winner,
        decision.reason,
        decision.decided,
        warnings,
        sorted(str(p) for p in out.iterdir()),
        dp,
        pick_sure(decision),
    )


PROBE_STEPS = 4  # measured steps of the probe run of sequences (after one warm-up)


def _check_replicas(size: int, dp: int, peer_assign: str) -> None:
    """``--dp``: a global minibatch of whole replicas' shares; an assignment there is."""
    if dp < 1:
        raise UmoptError(f"--dp must be at least 1, got {dp}")
    if size % dp:
        raise UmoptError(f"-B {size} sequences do not split among {dp} replicas: give a multiple of --dp")
    check_assignment(peer_assign, "--peer-assign")


def _fit_tokens_to_runs(prof: Profile, out: Path, lengths: str, first, say) -> Profile:
    """The profile's costs by tokens fitted to a probe run of sequences (umopt's plans, one chunk
    per rank, packed and padded as it chooses; :mod:`umopt.measure.calibrate_tokens`), written
    over ``out``/profile.json. The costs by tokens come from each stage timed alone; inside a
    running pipeline its ops ran 1.2-1.45x those times on a 2-core CPU (2.3x padded), and every
    method's steps 0.91-1.12x their plans' predictions after the fit (docs/varlen.md)."""
    probes = out / "probes"
    probes.mkdir(exist_ok=True)
    save_schedule(
        plan_schedule(choose_layouts(prof, first, ["umopt"])["umopt"], prof), str(probes / "plan.json")
    )
    # umopt's plans and padding's in turns: the ops of every mode the model takes (umopt's plans
    # may all be packed, and a mode the runs held no op of would be dropped, padding with it)
    methods = ["umopt", *(["pad"] if not METHODS["pad"].unavailable(prof) else [])]
    say(
        f"a probe run of sequences ({PROBE_STEPS} steps of {' and '.join(methods)}'s plans), to fit the costs by "
        "tokens"
    )
    options = RunOptions(
        schedules=[str(probes / "plan.json")],
        methods=methods,
        lengths=lengths,
        steps=PROBE_STEPS,
        warmup=1,
        report=str(probes / "report_{name}.json"),
        select=False,
    )
    result = launch(options, quiet=True)
    fitted, refits = calibrate_tokens(prof, result.reports, result.report_paths)
    worst = max(refits, key=lambda f: f.rms_before)
    it = fitted.meta.calibration.tokens.get("iteration", {}) if fitted.meta.calibration else {}
    say(
        f"costs by tokens fitted to {sum(f.ops for f in refits)} ops (measured / predicted "
        f"{min(f.ratio for f in refits):.2f}-{max(f.ratio for f in refits):.2f}; the worst fit's error "
        f"{100 * worst.rms_before:.0f}% -> {100 * worst.rms_after:.0f}%), a step's own cost {it.get('step_ms', 0.0):+.1f} ms"
    )
    save_profile(fitted, out / "profile.json")
    return load_profile(out / "profile.json")


def _layout_name(p: Plan) -> str:
    """A plan's layout in a few words: "one chunk per rank", or "2 chunks per rank, vshape"."""
    if p.chunking is None:
        return "one chunk per rank"
    S = len(set(p.chunking.ranks))
    return f"{len(p.chunking.ranks) // S} chunks per rank, {placement_name(p.chunking.ranks, S)}"


def tune_asked(
    model: Optional[str],
    model_args: Sequence[str],
    stages: Optional[int],
    minibatch: Optional[int],
    chunks: str = "1",
    lengths: Optional[str] = None,
    max_length: int = 256,
    methods: Optional[str] = None,
    zero_bubble: bool = False,
    dp: int = 1,
    peer_assign: str = "contiguous",
    say: Callable[[str], None] = lambda _msg: None,
    **options,
) -> tuple[Union[TuneResult, LengthsResult], str]:
    """``umopt tune`` as its options give it (None: :data:`DEFAULT`'s; ``model_args``
    ``name=value`` strings; ``chunks`` ``--chunks``'s; ``methods`` a comma-separated list):
    :func:`tune`, or with ``lengths`` (a sampler or a file of lengths) :func:`tune_lengths`, which
    ``options`` (the keyword arguments both take) go to. Returns the result and its title (the
    model, the stages, the minibatch)."""
    from .search.solve_chunks import parse_chunks
    from .zoo import model_name, parse_model_args

    name = model_name(model or DEFAULT["model"])
    args = parse_model_args(list(model_args)) or (DEFAULT["model_args"] if not model else {})
    stages, minibatch = stages or DEFAULT["stages"], minibatch or DEFAULT["minibatch"]
    if lengths is None:
        if dp != 1:
            raise UmoptError("--dp is for --lengths so far (tune measures one pipeline of equal samples)")
        title = (
            f"{model or DEFAULT['model']}, {stages} stages, minibatch {minibatch}: speedups over equal GPipe"
        )
        result = tune(
            name, args, stages, minibatch, zero_bubble=zero_bubble, chunks=parse_chunks(chunks), say=say,
            **options,
        )  # fmt: skip
        return result, title
    if zero_bubble:
        raise UmoptError("--lengths plans without W ops so far: leave out --zero-bubble")
    if name == "gpt":
        args = {**args, "seq_len": max_length}  # the model takes the longest sequence
    options.pop("time_limit", None)  # the steps' plans have their own budget
    result = tune_lengths(
        name, args, stages, f"file:{lengths}" if os.path.isfile(lengths) else lengths, minibatch, max_length,
        methods=[m.strip() for m in (methods or ",".join(LENGTHS_METHODS)).split(",") if m.strip()],
        chunks=tuple(sorted({1, *parse_chunks(chunks)})),  # each method chooses its layout among them
        dp=dp, peer_assign=peer_assign, say=say, **options,
    )  # fmt: skip
    title = f"{name}, {stages} stages, {minibatch} sequences per minibatch from {lengths} (up to {max_length} tokens)"
    if dp > 1:
        title = f"{name}, {stages} stages x {dp} replicas, {minibatch} sequences per global minibatch from {lengths} (up to {max_length} tokens)"
    return result, title
