"""``umopt tune``: profile, solve and run in one go, and compare with the best equal schedules.

Profiles the model on this machine, calibrates the profile with short runs of equal schedules
(:mod:`umopt.calibrate`; a profile times stages one chunk at a time, and inside a running
pipeline ops run at another speed), solves for the minibatch, writes the umopt schedule and the
best equal GPipe and 1F1B schedules, runs all three with the runtime (on the same processes,
taking turns, so that a machine's drift meets all three alike) and returns one row per schedule:
predicted and measured iteration time and the measured speedup over equal GPipe.
Everything it makes lands in one folder: the profile, the schedules, the run reports and the
Gantt pictures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .baselines import Baseline
from .calibrate import calibrate as fit
from .errors import UmoptError
from .fileio import read_json
from .launch import launch
from .problem import Candidate
from .formats.profile import Profile, load_profile, save_profile
from .profiler import ProfileOptions, check_profile_options, profile_model
from .formats.schedule import make_schedule, save_schedule
from .solve import make_problem, solve

__all__ = ["DEFAULT", "TuneRow", "TuneResult", "calibration_runs", "tune"]

# about a minute on a 2-core CPU: a small GPT on 2 stages, 2 local ranks, ~140 ms iterations
# (much smaller and per-op overheads the profile does not see start to dominate)
DEFAULT = {
    "model": "gpt",
    "model_args": {"layers": 4, "d_model": 128, "heads": 4, "vocab": 2048, "seq_len": 64},
    "stages": 2,
    "minibatch": 32,
}


@dataclass
class TuneRow:
    name: str
    chunks: str
    predicted_ms: float
    measured_ms: float
    schedule: str
    report: str
    plot: str


@dataclass
class TuneResult:
    rows: list[TuneRow]
    lower_bound_ms: float
    out_dir: str
    files: list[str] = field(default_factory=list)

    def speedup(self, row: TuneRow, measured: bool = True) -> float:
        base = self.rows[0]
        return (base.measured_ms / row.measured_ms) if measured else (base.predicted_ms / row.predicted_ms)


def _check_runnable(opts: ProfileOptions) -> None:
    """What would fail only after minutes of timing, checked before any."""
    check_profile_options(opts)
    if opts.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < (opts.stages or 1):
            raise UmoptError(f"umopt tune runs each stage on its own GPU: {opts.stages} stages, {gpus} GPU(s) here (use --stages {gpus})")


def _profile(opts: ProfileOptions) -> Profile:
    """The profile; on CUDA measured in a child process, so that the CUDA context and whatever the
    allocator keeps leave with it and the run's stage 0 finds its GPU as empty as the others."""
    if opts.device != "cuda":
        return profile_model(opts, argv=["umopt", "tune"])
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(profile_model, opts, None, ["umopt", "tune"]).result()


def calibration_runs(prof: Profile, minibatch: int, out: Path, *, steps: int = 3, warmup: int = 1, sizes=(2, 4, 8, 16)) -> list[str]:
    """Run each equal GPipe and 1F1B schedule with chunks of ``sizes`` briefly; return the reports.

    Their per-op times are what :func:`umopt.calibrate.calibrate` fits the profile to: both orders,
    because ops run at another speed when a stage interleaves F and B."""
    out.mkdir(parents=True, exist_ok=True)
    problem = make_problem(prof, minibatch, False)
    names = []
    for b in sizes:
        chunk_sizes = [b] * (minibatch // b) + ([minibatch % b] if minibatch % b else [])
        if b > prof.max_size or len(chunk_sizes) < 2:
            continue
        for order in ("gpipe", "1f1b"):
            cand = Candidate.uniform(chunk_sizes, prof.num_stages, order)
            name = f"{order}_b{b}"
            sched = make_schedule(prof, minibatch, False, cand.ops(), cand.simulate(problem), {"name": name, "status": "feasible", "seconds": 0.0}, {})
            save_schedule(sched, str(out / f"{name}.json"))
            names.append(name)
    if not names:
        return []
    # one launch for all of them: a start costs seconds, more than their steps
    launch([*(str(out / f"{n}.json") for n in names), "--steps", str(steps), "--warmup", str(warmup), "--report", str(out / "{name}_report.json")], quiet=True)
    return [str(out / f"{n}_report.json") for n in names]


def tune(
    model: str,
    model_args: dict,
    stages: int,
    minibatch: int,
    *,
    device: str = "cpu",
    steps: int = 5,
    warmup: int = 2,
    rounds: int = 4,
    out_dir: str = "umopt-tune",
    time_limit: float = 10.0,
    max_size: Optional[int] = None,
    seed: int = 0,
    calibrate: bool = True,
    dtype: str = "float32",
    link_latency_ms: Optional[float] = None,
    link_gbps: Optional[float] = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> TuneResult:
    opts = ProfileOptions(
        model=model, model_args=model_args, stages=stages, max_size=max_size or min(64, minibatch), device=device, dtype=dtype,
        seed=seed, link_latency_ms=link_latency_ms, link_gbps=link_gbps,
    )
    _check_runnable(opts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"profiling {model} on {device}, {stages} stages")
    prof = _profile(opts)
    if calibrate:
        save_profile(prof, out / "profile_measured.json")
        prof = load_profile(out / "profile_measured.json")
        say("calibrating: short runs of equal GPipe and 1F1B schedules")
        names = calibration_runs(prof, minibatch, out / "calibration")
        prof = fit(prof, [read_json(n) for n in names], names)
    save_profile(prof, out / "profile.json")
    prof = load_profile(out / "profile.json")
    say(f"solving for minibatch {minibatch} ({time_limit:g} s)")
    report = solve(prof, minibatch, time_limit=time_limit, seed=seed)
    save_schedule(report.schedule, str(out / "umopt.json"))
    problem = make_problem(prof, minibatch, False)

    def equal_schedule(b: Baseline, name: str) -> Optional[str]:
        if b.candidate is None:
            return None
        sched = make_schedule(prof, minibatch, False, b.candidate.ops(), b.candidate.simulate(problem), {"name": name, "status": "feasible", "seconds": 0.0}, {})
        path = str(out / f"{name}.json")
        save_schedule(sched, path)
        return path

    plans = [
        ("gpipe_equal", equal_schedule(report.gpipe, "gpipe_equal"), f"M={report.gpipe.microbatches}"),
        ("1f1b_equal", equal_schedule(report.onef1b, "1f1b_equal"), f"M={report.onef1b.microbatches}"),
        ("umopt", str(out / "umopt.json"), "/".join(str(len([o for o in st.ops if o[0] == "F"])) for st in report.schedule.stages) + f" ({report.result.candidate.order})"),
    ]
    plans = [p for p in plans if p[1] is not None]
    rounds = max(1, min(rounds, steps))
    say(f"running {', '.join(name for name, _, _ in plans)} in turns, {rounds} rounds")
    # on the same processes, taking turns: a machine that drifts (other load, clocks) would
    # otherwise favour whichever schedule ran in its good minute
    per_round = -(-steps // rounds)
    result = launch(
        [*(path for _, path, _ in plans), "--steps", str(per_round), "--warmup", str(warmup), "--rounds", str(rounds),
         "--report", str(out / "report_{name}.json"), "--plot", str(out / "measured_{name}.png")],
        quiet=True,
    )
    rows = [
        TuneRow(name, chunks, r["predicted_iteration_ms"], r["measured_iteration_ms"], path, rep, str(out / f"measured_{Path(path).stem}.png"))
        for (name, path, chunks), r, rep in zip(plans, result.reports, result.report_paths)
    ]
    return TuneResult(rows, report.schedule.solver.lower_bound_ms or report.lower_bound_ms, str(out), sorted(str(p) for p in out.iterdir()))
