"""``umopt tune``: profile, solve, run the candidates in turns, and recommend what measured fastest.

Profiles the model on this machine (fitted to probe runs of the runtime where there is a core or
GPU per stage: :mod:`umopt.probes`), solves for the minibatch, and runs the few schedules worth
choosing between (umopt's recommendation, the best schedule found if that is another, one shared
ramped partition as a simpler runner-up, and the best equal GPipe and 1F1B schedules; with
``zero_bubble``, umopt's schedule with W ops and the best equal ZB-H1 too) on the same
processes, taking turns, so that a machine's drift meets them all alike. The prediction chose the
candidates; the measurement chooses among them, taking turns until a paired test over the rounds
decides at a stated confidence or a time budget ends (:mod:`umopt.decide`): ``recommended.json``
is an unequal schedule only where it measured faster than the best equal schedule at that
confidence, else the best equal schedule.
Everything it makes lands in one folder: the profile, the schedules, the run reports and the
Gantt pictures.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from .decide import CONFIDENCE, Decision, decide
from .errors import UmoptError
from .fileio import check_writable
from .formats.profile import Profile, load_profile, save_profile
from .formats.schedule import make_schedule, save_schedule
from .launch import launch
from .noise import OFF_PREDICTION
from .probes import profile_in_pipeline
from .problem import Candidate
from .profiler import ProfileOptions, check_profile_options
from .solve import make_problem, solve
from .solvers import SOLVERS
from .zerobubble import zb_h1

__all__ = ["DEFAULT", "EQUAL", "TuneRow", "TuneResult", "pick", "tune"]

# about a minute on a 2-core CPU: a small GPT on 2 stages, 2 local ranks, ~140 ms iterations
DEFAULT = {
    "model": "gpt",
    "model_args": {"layers": 4, "d_model": 128, "heads": 4, "vocab": 2048, "seq_len": 64},
    "stages": 2,
    "minibatch": 32,
}
EQUAL = ("gpipe_equal", "1f1b_equal")


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


@dataclass
class TuneResult:
    rows: list[TuneRow]
    lower_bound_ms: float
    out_dir: str
    recommended: str  # the name of the row written as recommended.json
    reason: str
    confidence: float  # of the decision (umopt.decide): the winner faster, or no candidate worth it
    decided: bool  # reached the asked confidence before the budget ended
    warnings: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def row(self, name: str) -> TuneRow:
        return next(r for r in self.rows if r.name == name)

    def speedup(self, row: TuneRow, measured: bool = True) -> float:
        base = self.rows[0]
        return (base.measured_ms / row.measured_ms) if measured else (base.predicted_ms / row.predicted_ms)


def pick(rows: list[TuneRow], confidence: float = CONFIDENCE) -> Decision:
    """The row to recommend, by the paired test over rounds of :mod:`umopt.decide`."""
    return decide({r.name: r.rounds_ms for r in rows}, EQUAL, confidence)


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


def _profile(opts: ProfileOptions, probes: bool, probe_minibatch: int) -> Profile:
    """The profile; on CUDA measured in a child process, so that the CUDA context and whatever the
    allocator keeps leave with it and the run's stage 0 finds its GPU as empty as the others."""
    if opts.device != "cuda":
        return profile_in_pipeline(
            opts, probes=probes, probe_minibatch=probe_minibatch, argv=["umopt", "tune"]
        )
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(
            profile_in_pipeline, opts, probes=probes, probe_minibatch=probe_minibatch, argv=["umopt", "tune"]
        ).result()


def _chunks(ops_lists) -> str:
    counts = sorted({sum(1 for op in st if op[0] == "F") for st in ops_lists})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"


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
    say: Callable[[str], None] = lambda _msg: None,
) -> TuneResult:
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
    _check_runnable(opts)
    out = Path(out_dir)
    check_writable(out / "profile.json")
    out.mkdir(parents=True, exist_ok=True)
    say(
        f"profiling {model} on {device}, {stages} stages"
        + (", then probe runs of the runtime" if probes else "")
    )
    prof = _profile(opts, probes, min(minibatch, 32) if minibatch >= 4 else minibatch)
    save_profile(prof, out / "profile.json")
    prof = load_profile(out / "profile.json")
    warnings = list(prof.meta.warnings)
    say(f"solving for minibatch {minibatch} ({time_limit:g} s)")
    report = solve(prof, minibatch, time_limit=time_limit, seed=seed, zero_bubble=zero_bubble)
    problem = make_problem(prof, minibatch, False)

    def write(name: str, cand: Candidate) -> str:
        sched = make_schedule(
            prof,
            minibatch,
            False,
            cand.ops(),
            cand.simulate(problem),
            {"name": name, "status": "feasible", "seconds": 0.0},
            {},
        )
        path = str(out / f"{name}.json")
        save_schedule(sched, path)
        return path

    # the candidates: what the prediction says is worth measuring
    plans: dict[str, Candidate] = {}
    for b in (report.gpipe, report.onef1b):
        if b.candidate is not None:
            plans[b.name] = b.candidate
    # umopt's recommendation runs once: where it is one of the equal schedules, its row is that run's
    same = next((n for n, c in plans.items() if c.ops() == report.choice.candidate.ops()), None)
    if same is None:
        plans["umopt"] = report.choice.candidate
    if report.result.candidate.ops() != report.choice.candidate.ops():
        plans["umopt_best"] = report.result.candidate  # the fastest predicted, where the choice was simpler
    ramp = SOLVERS["ramp"](problem, order="auto").candidate
    ramp_ms = ramp.simulate(problem).iteration_ms
    if all(ramp.ops() != c.ops() for c in plans.values()) and ramp_ms < min(
        c.simulate(problem).iteration_ms for n, c in plans.items() if n in EQUAL
    ):
        plans["ramp"] = ramp  # one shared partition: a simpler runner-up
    if (
        zero_bubble
    ):  # W ops where the solve placed them (if they paid in prediction), and the best equal ZB-H1
        with_w = report.schedule.op_lists()
        if any(op.kind == "W" for st in with_w for op in st):
            plans["umopt_w"] = Candidate.from_ops(with_w)
        zb = zb_h1(problem, seconds=1.0)
        if zb is not None:
            plans["zbh1_equal"] = Candidate.from_ops(zb[1])
    names = list(plans)
    paths = [write(n, plans[n]) for n in names]
    say(
        f"running {', '.join(names)} in turns, rounds of {steps} steps each, until decided at {100 * confidence:.0f}% confidence (at least {rounds} rounds, at most {budget:g} s)"
    )
    result = launch(
        [
            *paths,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--rounds",
            str(rounds),
            "--decide",
            str(confidence),
            "--budget",
            str(budget),
            "--report",
            str(out / "report_{name}.json"),
            "--plot",
            str(out / "measured_{name}.png"),
        ],
        quiet=True,
    )
    rows = []
    for name, path, r, rep in zip(names, paths, result.reports, result.report_paths):
        rows.append(
            TuneRow(
                name,
                _chunks(plans[name].ops()),
                r.predicted_iteration_ms,
                r.measured_iteration_ms,
                r.round_ms,
                path,
                rep,
                str(out / f"measured_{name}.png"),
            )
        )
        off = r.measured_over_predicted - 1
        if abs(off) > OFF_PREDICTION:
            warnings.append(f"{name} measured {100 * off:+.0f}% off its prediction")
    decision = pick(rows, confidence)  # the runtime's own, recomputed from the reports
    if same is not None:
        for kind, ext in (("report", "json"), ("measured", "png")):
            shutil.copyfile(out / f"{kind}_{same}.{ext}", out / f"{kind}_umopt.{ext}")
        shutil.copyfile(out / f"{same}.json", out / "umopt.json")
        twin = next(r for r in rows if r.name == same)
        rows.insert(
            len(EQUAL),
            replace(
                twin,
                name="umopt",
                schedule=str(out / "umopt.json"),
                report=str(out / "report_umopt.json"),
                plot=str(out / "measured_umopt.png"),
            ),
        )
    recommended = decision.winner
    shutil.copyfile(out / f"{recommended}.json", out / "recommended.json")
    lb = report.schedule.solver.lower_bound_ms or report.lower_bound_ms
    return TuneResult(
        rows,
        lb,
        str(out),
        recommended,
        decision.reason,
        decision.confidence,
        decision.decided,
        warnings,
        sorted(str(p) for p in out.iterdir()),
    )
