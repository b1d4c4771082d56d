"""Probe runs: short equal schedules through the real runtime, and the profile fitted to them.

A profile times each stage alone, one chunk at a time; inside a running pipeline ops run at
another speed and the runtime adds costs of its own (dispatching each op, posting and waiting on
messages, the optimizer step). Where there is a core (or a GPU) per stage, ``umopt profile`` ends
by running probe schedules with the same processes, backend and messages as ``umopt run``: the
equal GPipe and 1F1B schedules with chunks of 2, 4, 8 and 16 samples, taking turns on the same
processes. :func:`umopt.measure.calibrate.calibrate` then fits the profile to them (op times per size,
the runtime's costs per op, per message and per iteration), so that ``profile -> solve -> run``
predicts what the runtime will do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from .chunks import min_max_cut, stages_from_layers
from .errors import UmoptError
from .formats.profile import ProbesMeta, Profile
from .formats.report import load_report
from .formats.schedule import make_schedule, save_schedule
from .measure.calibrate import Overheads, calibrate, run_ratios
from .measure.options import ProfileOptions, ProgressFn
from .measure.profile import fit_layers, profile_model, with_links
from .run.launch import RunFailed, launch
from .run.options import RunOptions
from .schedules.family import ruled
from .search.problem import Candidate, Problem
from .zoo import build_model

__all__ = [
    "PROBE_SIZES",
    "PROBE_MINIBATCH",
    "why_no_probes",
    "probe_runs",
    "fit_to_probes",
    "profile_in_pipeline",
    "check_profile_ask",
    "profile_asked",
]

# chunk sizes of the probe schedules: ops of different sizes, and schedules with different
# numbers of ops, so that per-size op times and per-op costs can be told apart
PROBE_SIZES = (2, 4, 8, 16)
# the probes' minibatch: two or more chunks of every probe size
PROBE_MINIBATCH = 32


def why_no_probes(profile: Profile) -> Optional[str]:
    """Why probes cannot run here (None: they can): the runtime wants a core, or a GPU, per stage
    (and data-parallel replica, where the profile measured their all-reduce)."""
    dp = profile.allreduce.replicas if profile.allreduce else 1
    S = profile.num_stages * dp
    if profile.device.type == "sim":
        return "the profile is synthetic"
    if profile.device.type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        return (
            None
            if gpus >= S
            else f"{S} ranks need a GPU each, {gpus} here: the fit to the runtime is left out"
        )
    threads = profile.device.threads or 1
    cores = os.cpu_count() or 1
    return (
        None
        if S * threads <= cores
        else f"{S} ranks x {threads} threads need {S * threads} cores, {cores} here: the fit to the runtime is left out"
    )


def probe_runs(
    profile: Profile,
    minibatch: int,
    out: Path,
    *,
    steps: int = 3,
    warmup: int = 1,
    rounds: int = 2,
    sizes=PROBE_SIZES,
) -> list[str]:
    """Run each equal GPipe and 1F1B schedule with chunks of ``sizes`` (where the minibatch holds
    two or more and the profile measured them), all in one launch, taking turns; the reports'
    paths. ``profile`` must have been loaded from its file (the runtime reads it there)."""
    from .costmodel import CostTables

    out.mkdir(parents=True, exist_ok=True)
    # with the profile's replicas (umopt profile --dp), as the runs of its schedules will be
    dp = profile.allreduce
    problem = Problem(CostTables.from_profile(profile, False, dp, minibatch=minibatch), minibatch)
    names = []
    for b in sizes:
        chunk_sizes = [b] * (minibatch // b) + ([minibatch % b] if minibatch % b else [])
        if b > profile.max_size or len(chunk_sizes) < 2:
            continue
        for order in (f.name for f in ruled()):
            cand = Candidate.uniform(chunk_sizes, profile.num_stages, order)
            name = f"probe_{order}_b{b}"
            solver = {"name": name, "status": "feasible", "seconds": 0.0}
            save_schedule(
                make_schedule(profile, minibatch, False, cand.ops(), cand.simulate(problem), solver, {}, dp),
                str(out / f"{name}.json"),
            )
            names.append(name)
    if not names:
        return []
    # one launch for all of them: a start costs seconds, more than their steps
    launch(
        RunOptions(
            schedules=[str(out / f"{n}.json") for n in names],
            steps=steps,
            warmup=warmup,
            rounds=rounds,
            report=str(out / "{name}_report.json"),
        ),
        quiet=True,
    )
    return [str(out / f"{n}_report.json") for n in names]


def fit_to_probes(profile: Profile, minibatch: int, out: Path, **kw) -> Profile:
    """``profile`` fitted to probe runs made in ``out`` (``meta.probes`` says what ran)."""
    reports = probe_runs(profile, minibatch, out, **kw)
    if not reports:
        return profile
    runs = [load_report(r) for r in reports]
    fitted = calibrate(profile, runs, [Path(r).name for r in reports])
    # what the fit leaves per order: on a CPU an op after one of the other kind runs slower,
    # which the model (a time per kind and size) cannot hold and 1F1B meets at every step
    left = dict(zip((Path(r).name.removesuffix("_report.json") for r in reports), run_ratios(fitted, runs)))
    by_order = {
        o: [v for k, v in left.items() if k.startswith(f"probe_{o}_")] for o in (f.name for f in ruled())
    }
    probes = ProbesMeta(
        ran=True,
        minibatch=minibatch,
        schedules=len(reports),
        measured={
            "forward_ms": [st.forward_ms for st in profile.stages],
            "backward_ms": [st.backward_ms for st in profile.stages],
        },
        measured_over_fitted={k: round(v, 4) for k, v in left.items()},
        order_ratio={o: round(float(np.exp(np.mean(np.log(v)))), 4) for o, v in by_order.items() if v},
    )
    return fitted.model_copy(update={"meta": fitted.meta.model_copy(update={"probes": probes})})


def profile_in_pipeline(
    opts,
    *,
    probes: bool = True,
    probe_minibatch: int = PROBE_MINIBATCH,
    progress=None,
    argv=None,
    say=lambda _m: None,
) -> Profile:
    """:func:`umopt.measure.profile_model`, then, where a core or GPU per stage allows, fitted to
    probe runs of the real runtime (``meta.probes`` says whether they ran, and if not why)."""
    import tempfile

    from .formats.profile import load_profile, save_profile

    profile = profile_model(opts, progress=progress, argv=argv)
    why = "--no-probes" if not probes else why_no_probes(profile)
    if why is None and min(probe_minibatch, profile.max_size) < 2:
        why = "the largest chunk size measured is 1"
    if why is not None:
        return profile.model_copy(
            update={"meta": profile.meta.model_copy(update={"probes": ProbesMeta(ran=False, why=why)})}
        )
    say(
        f"probe runs of equal schedules (minibatch {probe_minibatch}) through the runtime, to fit the profile to it"
    )
    with tempfile.TemporaryDirectory(prefix="umopt-probes-") as tmp:
        save_profile(profile, Path(tmp) / "measured.json")
        try:
            return fit_to_probes(
                load_profile(Path(tmp) / "measured.json"), probe_minibatch, Path(tmp) / "probes"
            )
        except RunFailed as exc:  # the measured profile stands; the user hears why it is not fitted
            meta = profile.meta.model_copy(
                update={
                    "probes": ProbesMeta(ran=False, why=f"the probe runs failed: {exc}"),
                    "warnings": [
                        *profile.meta.warnings,
                        f"the probe runs failed ({exc}); the profile is as measured, without the runtime's own costs",
                    ],
                }
            )
            return profile.model_copy(update={"meta": meta})


def profile_for_chunks(
    opts: ProfileOptions,
    chunks: int,
    progress: Optional[ProgressFn] = None,
    argv: Optional[list[str]] = None,
    *,
    probes: bool = True,
    probe_minibatch: int = 32,
) -> Profile:
    """The model of ``opts`` profiled layer by layer (each layer timed as a stage of its own, one
    after another), then grouped into its stages (``opts.split``, or balanced on the layers' times
    into ``opts.stages``) with the per-layer entries kept: a profile whose ranks' layers can be cut
    into up to ``chunks`` chunks each (``umopt profile --chunks``).

    With ``probes``, the stages are also profiled whole and fitted to probe runs of the runtime
    (one chunk per rank): their op times become the stages' and scale their layers
    (:func:`fit_layers`), and the runtime's own costs that fit (per op, per message, per
    iteration) are the layered profile's too."""
    from dataclasses import replace

    L = len(build_model(opts.model, opts.model_args, seed=opts.seed).layers)
    if opts.split is None and (opts.stages or 1) * chunks > L:
        raise UmoptError(
            f"{opts.stages} stages x {chunks} chunks need {(opts.stages or 1) * chunks} layers; {opts.model} has {L}"
        )
    # the layers' own links mean nothing (they share a device): given as placeholders, replaced below
    per_layer = profile_model(
        replace(
            opts, split=list(range(L + 1)), stages=None, concurrent=False, link_latency_ms=0.0, link_gbps=1e6
        ),
        progress,
        argv,
    )
    if opts.split is not None:
        cuts = list(opts.split)
    else:
        # balanced on the layers' times, every stage with room for its chunks
        mid = len(per_layer.sizes) // 2
        cost = [st.forward_ms[mid] + st.backward_ms[mid] for st in per_layer.stages]
        cuts = [0] + [hi for _, hi in min_max_cut(cost, opts.stages or 1, chunks)]
    short = [s for s, (a, b) in enumerate(zip(cuts, cuts[1:])) if b - a < chunks]
    if short:
        raise UmoptError(
            f"stage {short[0]} has {cuts[short[0] + 1] - cuts[short[0]]} layers, too few for {chunks} chunks"
        )
    layered = stages_from_layers(per_layer, cuts)
    layered = with_links(opts, layered, progress)
    if not probes:
        return layered.model_copy(
            update={
                "meta": layered.meta.model_copy(update={"probes": ProbesMeta(ran=False, why="--no-probes")})
            }
        )
    whole = profile_in_pipeline(
        replace(opts, split=cuts, stages=None),
        probes=True,
        probe_minibatch=probe_minibatch,
        progress=progress,
        argv=argv,
    )
    cal = whole.meta.calibration
    if cal is not None:
        layered = Overheads(cal.op_overhead_ms, cal.message_overhead_ms, cal.step_overhead_ms, 0.0).apply(
            fit_layers(layered, whole)
        )
    return layered.model_copy(
        update={"meta": layered.meta.model_copy(update={"probes": whole.meta.probes, "calibration": cal})}
    )


def check_profile_ask(opts: ProfileOptions, chunks: int = 1, probe_minibatch: int = PROBE_MINIBATCH) -> None:
    """What ``umopt profile`` cannot measure as asked, refused in one line before anything runs."""
    if opts.max_size < 1:
        raise UmoptError(f"--max-size must be at least 1, got {opts.max_size}")
    if opts.dp < 1:
        raise UmoptError(f"--dp must be at least 1, got {opts.dp}")
    if not 1 <= chunks <= 4:
        raise UmoptError(f"--chunks must be 1-4, got {chunks}")
    if chunks > 1 and opts.dp > 1:
        raise UmoptError("--chunks with --dp is not supported yet")
    if probe_minibatch < 2:
        raise UmoptError(f"--probe-minibatch must be at least 2, got {probe_minibatch}")


def profile_asked(
    opts: ProfileOptions,
    chunks: int = 1,
    *,
    probes: bool = True,
    probe_minibatch: int = PROBE_MINIBATCH,
    progress: Optional[ProgressFn] = None,
    argv: Optional[list[str]] = None,
    say=lambda _m: None,
) -> Profile:
    """``umopt profile``: the stages of ``opts`` measured (:func:`profile_in_pipeline`), or with
    ``chunks`` above 1 their layers one by one (:func:`profile_for_chunks`)."""
    check_profile_ask(opts, chunks, probe_minibatch)
    if chunks > 1:
        return profile_for_chunks(
            opts, chunks, progress, argv, probes=probes, probe_minibatch=probe_minibatch
        )
    return profile_in_pipeline(
        opts, probes=probes, probe_minibatch=probe_minibatch, progress=progress, argv=argv, say=say
    )
