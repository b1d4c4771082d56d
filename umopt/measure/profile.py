"""A whole profile: the stages cut, timed and sized, the links and all-reduce measured, assembled.

:func:`profile_model` is ``umopt profile`` as a library call (the zoo's or a user's factory
model); :func:`profile_stages` profiles a user's own stage modules (layer by layer too, for
several chunks per rank: ``umopt profile --chunks`` is :func:`umopt.probes.profile_for_chunks`,
which fits the layers to probe runs of the runtime). Each follows the same steps: the cut points (given, or
balanced on measured layer times), every stage timed (:mod:`.timing`) and its memory counted
(:mod:`.chunk`), the links and the all-reduce (:mod:`.links`), then the profile file's model.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..devices import TensorSpec, default_memory_limit, numerics
from ..errors import UmoptError
from ..formats.profile import PROFILE_FORMAT, ProbesMeta, Profile
from ..zoo import ModelParts, build_model
from .chunk import StageProbe, boundaries, optimizer_for, optimizer_step_ms, optimizer_work_bytes
from .links import link_plan, measure_allreduce, measure_links
from .noise import drift_warning, load_warning, noise_figure, noisy_warning, uneven_devices_warning
from .options import ProfileOptions, ProgressFn, check_profile_options
from .split import balanced_split
from .timing import StageTimes, fitted, layer_ms, probes_of, time_concurrently, time_stages
from .tokens import MODES, check_lengths, stage_token_costs

__all__ = ["profile_model", "profile_stages", "fit_layers", "with_links"]


def profile_model(
    opts: ProfileOptions, progress: Optional[ProgressFn] = None, argv: Optional[list[str]] = None
) -> Profile:
    """Measure the model of ``opts`` and return its profile (not yet written anywhere)."""
    try:
        return _profile_model(opts, progress, argv)
    finally:
        if opts.device == "cuda" and torch.cuda.is_available():
            # a run started next from this process (umopt tune) puts stage 0 on this GPU: leave
            # it nothing the model's tensors had cached
            gc.collect()
            torch.cuda.empty_cache()


def with_links(opts: ProfileOptions, layered: Profile, progress: Optional[ProgressFn] = None) -> Profile:
    """``layered`` with the links its ranks use: between neighbours, and from the last rank back
    to the first (looped placement), each measured between the devices the ranks run on (or
    given in ``opts``)."""
    device = torch.device(opts.device)
    biggest = max(st.output_bytes_per_sample for st in layered.stages) * max(layered.sizes)
    links, wrap = _links(opts, device, layered.num_stages, biggest, _Ticks(progress, 0), wrap=True)
    return Profile.model_validate({**layered.model_dump(mode="json"), "links": links, "wrap_link": wrap})


_TIMES = ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms")


def fit_layers(layered: Profile, whole: Profile) -> Profile:
    """``layered`` with each stage's op times those of ``whole`` (the same stages timed whole, as
    they run, and fitted to probe runs of the runtime) and its layers' times scaled alike, per
    kind and chunk size: a layer keeps its share of its stage, timed alone, and a virtual stage
    made of a whole stage is timed as that stage is. (Timed one after another on an idle
    machine, the layers alone had under-predicted every multi-chunk run.)"""
    stages, layers = [], list(layered.layers or [])
    for st, timed in zip(layered.stages, whole.stages):
        if st.layers != timed.layers:
            raise UmoptError(f"the stages were cut differently: layers {st.layers} and {timed.layers}")
        update = {}
        for key in _TIMES:
            mine, theirs = getattr(st, key), getattr(timed, key)
            if mine is None or theirs is None:
                continue
            scale = [t / m if m > 0 else 1.0 for m, t in zip(mine, theirs)]
            for i in range(*st.layers):
                times = getattr(layers[i], key)
                layers[i] = layers[i].model_copy(update={key: [x * f for x, f in zip(times, scale)]})
            update[key] = list(theirs)
            iqr = key.replace("_ms", "_iqr_ms")
            if iqr in type(st).model_fields:
                update[iqr] = getattr(timed, iqr)
        if st.tokens is not None and timed.tokens is not None:
            _fit_layer_tokens(layers, st.layers, timed.tokens)
            update["tokens"] = timed.tokens
        stages.append(st.model_copy(update=update))
    return layered.model_copy(update={"stages": stages, "layers": layers})


def _fit_layer_tokens(layers: list, span: Sequence[int], whole: dict) -> None:
    """The costs by tokens of the layers ``span`` (in place) scaled term by term so that they sum
    to ``whole``'s, their stage's timed whole: as :func:`fit_layers` scales their times (a term the
    layers alone did not show is shared among them equally)."""
    lo, hi = span
    for mode, theirs in whole.items():
        if any(layers[i].tokens is None or mode not in layers[i].tokens for i in range(lo, hi)):
            continue
        for kind in ("forward", "backward", "backward_input", "backward_weight"):
            target = getattr(theirs, kind)
            fits = [getattr(layers[i].tokens[mode], kind) for i in range(lo, hi)]
            if target is None or any(f is None for f in fits):
                continue
            new = [{} for _ in fits]
            for term in ("a_ms", "b_ms", "c_ms", "d_ms"):
                total, want = sum(getattr(f, term) for f in fits), getattr(target, term)
                for k, f in enumerate(fits):
                    new[k][term] = getattr(f, term) * want / total if total > 0 else want / len(fits)
            for k, i in enumerate(range(lo, hi)):
                costs = layers[i].tokens[mode].model_copy(update={kind: fits[k].model_copy(update=new[k])})
                layers[i] = layers[i].model_copy(update={"tokens": {**layers[i].tokens, mode: costs}})


def profile_stages(
    stages: Sequence[nn.Module],
    sample: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    loss_reduction: str = "mean",
    name: str = "user",
    sizes: Optional[Sequence[int]] = None,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
    repeats: int = 5,
    optimizer: str = "sgd",
    link_latency_ms: Optional[float] = None,
    link_gbps: Optional[float] = None,
    memory_limit_bytes: Optional[int] = None,
    progress: Optional[ProgressFn] = None,
    layers: bool = False,
) -> Profile:
    """Profile your own pipeline stages: the same profile file ``umopt profile`` writes, for
    ``umopt solve`` and :class:`umopt.Pipeline`.

    Args:
        stages: one module per stage, in order; each takes the tensor the one before returns.
        sample: ``(inputs, targets)``, a batch of at least the largest chunk size of samples;
            chunks of each size are cut from it.
        loss_fn: ``loss_fn(output, targets)`` of the last stage, reduced by ``loss_reduction``
            (``"mean"``, torch's default, or ``"sum"``).
        name: what the profile calls the model (``umopt run`` cannot rebuild it: run the schedule
            with :class:`umopt.Pipeline`).
        sizes: chunk sizes to measure (default: powers of two up to the sample's size, at most 64).
        layers: also time each stage's layers one by one, as ``umopt profile --chunks`` does, so
            that ``umopt solve --chunks`` can cut a rank's stage into several chunks: each stage
            an ``nn.Sequential`` of its layers; the layers' times are scaled to their stage's,
            timed whole (:func:`fit_layers`), and the link back from the last stage to the first
            is measured too (looped placement).
        The other arguments are ``umopt profile``'s options of the same names.

    The stages are timed one after another in this process; the links are measured (or given)
    as by ``umopt profile``; no probe runs of the runtime follow (it cannot rebuild your modules).
    """
    if loss_reduction not in ("mean", "sum"):
        raise UmoptError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    x_all, y_all = sample
    n = x_all.shape[0]
    if n < 1 or y_all.shape[0] != n:
        raise UmoptError(
            f"the sample's inputs and targets must have the same number of samples, got {n} and {y_all.shape[0]}"
        )
    if sizes is not None and max(sizes) > n:
        raise UmoptError(f"chunk size {max(sizes)} needs a sample of at least that many samples, got {n}")

    def make_batch(b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        idx = (torch.arange(b) + seed * b) % n  # each seed another window of the sample
        return x_all[idx], y_all[idx]

    def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the profiler's losses are sums
        return loss_fn(out, y) * (y.shape[0] if loss_reduction == "mean" else 1)

    if layers:
        bad = next((s for s, st in enumerate(stages) if not isinstance(st, nn.Sequential)), None)
        if bad is not None:
            raise UmoptError(
                f"layers=True times each stage's layers one by one: give every stage as an nn.Sequential of its "
                f"layers (stage {bad} is a {type(stages[bad]).__name__})"
            )
        flat = [m for st in stages for m in st]
        cuts = [0]
        for st in stages:
            cuts.append(cuts[-1] + len(st))
        parts = ModelParts(flat, make_batch, summed)
    else:
        parts = ModelParts(list(stages), make_batch, summed)
        cuts = list(range(len(parts.layers) + 1))
    opts = ProfileOptions(
        model=name,
        split=cuts,
        sizes=list(sizes) if sizes else None,
        max_size=min(64, n),
        device=device,
        dtype=dtype,
        threads=threads,
        repeats=repeats,
        optimizer=optimizer,
        link_latency_ms=link_latency_ms,
        link_gbps=link_gbps,
        memory_limit_bytes=memory_limit_bytes,
        concurrent=False,
    )
    prof = _profile_model(opts, progress, ["umopt.profile_stages"], parts=parts)
    if layers:
        prof = _with_layers(opts, prof, parts, progress)
    why = "stages given as modules: the runtime cannot rebuild them (fit with umopt calibrate to your own runs' reports)"
    for line in prof.meta.warnings:  # as the CLI prints them
        logging.getLogger("umopt").warning(line)
    return prof.model_copy(
        update={"meta": prof.meta.model_copy(update={"probes": ProbesMeta(ran=False, why=why)})}
    )


def _with_layers(
    opts: ProfileOptions, whole: Profile, parts: ModelParts, progress: Optional[ProgressFn]
) -> Profile:
    """``whole`` (the user's stages timed whole) with per-layer entries: every layer timed as a
    stage of its own, grouped back into the stages, scaled to their times (:func:`fit_layers`);
    the links ``whole``'s, the one back from the last stage to the first measured besides."""
    from dataclasses import replace

    from ..chunks import stages_from_layers

    L = len(parts.layers)
    per_layer = _profile_model(
        replace(opts, split=list(range(L + 1)), link_latency_ms=0.0, link_gbps=1e6),
        progress,
        ["umopt.profile_stages"],
        parts=parts,
    )
    cuts = list(opts.split or [])
    layered = fit_layers(stages_from_layers(per_layer, cuts), whole)
    device = torch.device(opts.device)
    biggest = max(st.output_bytes_per_sample for st in layered.stages) * max(layered.sizes)
    _, wrap = _links(opts, device, len(cuts) - 1, biggest, _Ticks(progress, 0), wrap=True)
    return Profile.model_validate(
        {
            **layered.model_dump(mode="json"),
            "links": [ln.model_dump(mode="json") for ln in whole.links],
            "wrap_link": wrap,
            "meta": whole.meta.model_dump(mode="json"),
        }
    )


def _allreduce(opts: ProfileOptions, device: torch.device, stages: list[dict], ticks: _Ticks) -> tuple:
    """The gradient all-reduce among ``opts.dp`` processes: (latency ms, bus bytes per ms)."""
    ticks.say(f"all-reduce among {opts.dp} processes")
    biggest = max(st["param_bytes"] for st in stages)
    return measure_allreduce(
        "nccl" if device.type == "cuda" else "gloo", opts.dp, max_bytes=max(biggest, 1 << 16)
    )


def _noise(measured: list[StageTimes], device_type: str) -> tuple[dict, list[str]]:
    """The profile's ``meta.noise`` from every stage's timing rounds, and the warnings it calls for."""
    entries = [e for t in measured for e in t.forward + t.backward]
    median_spread, p90_spread = noise_figure([e.median for e in entries], [e.iqr for e in entries])
    drifts = [t.drift for t in measured]
    references = [t.reference_ms for t in measured]
    warnings = [
        line
        for line in (
            noisy_warning("profile entries", median_spread),
            drift_warning(max(drifts)),
            uneven_devices_warning(references, device_type),
        )
        if line
    ]
    noise = {
        "median_spread": round(median_spread, 4),
        "p90_spread": round(p90_spread, 4),
        "max_repeats": max(e.kept for e in entries),
        "drift": [round(d, 4) for d in drifts],
        "reference_ms": [round(r, 4) for r in references],
    }
    return noise, warnings


def _profile_model(
    opts: ProfileOptions,
    progress: Optional[ProgressFn],
    argv: Optional[list[str]],
    parts: Optional[ModelParts] = None,
) -> Profile:
    sizes, device = check_profile_options(opts)
    parts = parts or build_model(opts.model, opts.model_args, seed=opts.seed)
    if opts.lengths is not None:
        modes = opts.length_modes or (parts.sequences.modes if parts.sequences is not None else MODES)
        max_length = check_lengths(parts, opts.model, opts.lengths, modes)
    prev_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(opts.threads)
    try:
        for m in parts.layers:
            m.to(device)
        try:
            bounds = boundaries(parts, device, opts.dtype)
        except Exception as exc:  # a user model that does not run is the user's input problem
            raise UmoptError(
                f"model {opts.model}: a forward pass of one sample failed ({exc.__class__.__name__}: {exc})"
            ) from None
        cuts, per_layer = _cuts(opts, parts, bounds, device, sizes)
        S = len(cuts) - 1
        ticks = _Ticks(progress, S * len(sizes))
        concurrent = (
            opts.concurrent
            if opts.concurrent is not None
            else (device.type == "cpu" and S > 1 and S * opts.threads <= (os.cpu_count() or 1))
        )
        load = (
            load_warning(S * opts.threads if concurrent else opts.threads) if device.type == "cpu" else None
        )
        warnings = [load] if load else []
        probes = probes_of(parts, cuts, bounds, device, opts.dtype)
        if concurrent:
            timed = time_concurrently(opts, cuts, sizes, ticks)
        else:
            together = time_stages(probes, sizes, opts, ticks, "stages", opts.budget_s)
            timed = {s: (t, optimizer_step_ms(probes[s].stage, opts, device)) for s, t in enumerate(together)}
        stages = [_stage_entry(s, probes[s], cuts, bounds, *timed[s], opts, sizes) for s in range(S)]
        if opts.lengths is not None:
            by_tokens = stage_token_costs(
                probes,
                bounds,
                cuts,
                max_length,
                modes,
                opts.repeats,
                opts.warmup,
                opts.budget_s,
                ticks.lengths,
            )
            for st, costs in zip(stages, by_tokens):
                st["tokens"] = costs
        # stage 0's input is the model input; every later stage receives what the one before sent
        for s in range(1, S):
            stages[s]["input_bytes_per_sample"] = stages[s - 1]["output_bytes_per_sample"]
        biggest = max(st["output_bytes_per_sample"] for st in stages) * sizes[-1]
        links, _ = _links(opts, device, S, biggest, ticks)
        allreduce = _allreduce(opts, device, stages, ticks) if opts.dp > 1 else None
        noise, noisy = _noise([t for t, _ in timed.values()], device.type)
        warnings += noisy
        memory_limit, memory_limit_source = opts.memory_limit_bytes, None
        if memory_limit is None and device.type == "cuda":
            memory_limit, memory_limit_source = default_memory_limit(device)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    finally:
        torch.set_num_threads(prev_threads)

    data = {
        "format": PROFILE_FORMAT,
        "model": {"name": opts.model, "args": opts.model_args, "seed": opts.seed},
        "device": {
            "type": device.type,
            "name": device_name,
            "dtype": opts.dtype,
            "threads": opts.threads,
            "numerics": numerics(),
        },
        "sizes": sizes,
        "stages": stages,
        "links": links,
        "memory_limit_bytes": memory_limit,
        **(
            {"allreduce": {"replicas": opts.dp, "latency_ms": allreduce[0], "bus_bytes_per_ms": allreduce[1]}}
            if allreduce
            else {}
        ),
        "split": cuts,
        "layer_ms": per_layer,
        **({"lengths": {"max_length": max_length, "modes": list(modes)}} if opts.lengths is not None else {}),
        "meta": {
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(argv if argv is not None else sys.argv),
            "optimizer": opts.optimizer,
            "warmup": opts.warmup,
            "repeats": opts.repeats,
            "stages_timed_concurrently": concurrent,
            "noise": noise,
            "warnings": warnings,
            **({"memory_limit": memory_limit_source} if memory_limit_source else {}),
        },
    }
    return Profile.model_validate(data)


class _Ticks:
    """The progress of the stages' timing (``progress(done, total, what)``), and what comes after."""

    def __init__(self, progress: Optional[ProgressFn], total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, n: float, _total: int, what: str) -> None:
        self.done += n
        self.say(what)

    def say(self, what: str) -> None:
        if self.progress:
            self.progress(self.done, self.total, what)

    def lengths(self, done: float, total: int, what: str) -> None:
        if self.progress:
            self.progress(done, total, what)


def _cuts(
    opts: ProfileOptions, parts: ModelParts, bounds: list, device: torch.device, sizes: Sequence[int]
) -> tuple[list[int], Optional[list[float]]]:
    """The stages' cut points: ``opts.split`` checked, or balanced on the layers' measured times
    into ``opts.stages`` (and those times)."""
    L = len(parts.layers)
    if opts.split is not None:
        cuts = list(opts.split)
        if cuts[0] != 0 or cuts[-1] != L or any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise UmoptError(
                f"--split must rise strictly from 0 to the model's {L} layers, got {','.join(map(str, cuts))}"
            )
        if opts.stages is not None and opts.stages != len(cuts) - 1:
            raise UmoptError(f"--stages {opts.stages} disagrees with --split of {len(cuts) - 1} stages")
        return cuts, None
    if opts.stages > L:
        raise UmoptError(f"--stages {opts.stages}: more stages than the model {opts.model} has layers ({L})")
    # balance on the sum of two chunk sizes: a split that only fits one size would be
    # noise-prone where layers are close, and stages run many sizes
    small = layer_ms(parts, bounds, device, opts, min(8, sizes[-1]))
    large = layer_ms(parts, bounds, device, opts, sizes[-1])
    per_layer = [a + b for a, b in zip(small, large)]
    return balanced_split(per_layer, opts.stages), per_layer


def _stage_entry(
    s: int,
    probe: StageProbe,
    cuts: Sequence[int],
    bounds: list[torch.Tensor],
    measured: StageTimes,
    opt_ms: float,
    opts: ProfileOptions,
    sizes: Sequence[int],
) -> dict:
    """Stage ``s``'s entry of the profile file: its timed curves, memory, bytes sent and optimizer step."""
    a, b = cuts[s], cuts[s + 1]
    stage = probe.stage
    fwd, bwd = measured.forward, measured.backward
    nparam = sum(p.numel() * p.element_size() for p in stage.parameters())
    _, nstate = optimizer_for(opts.optimizer, [torch.zeros(1, requires_grad=True)])
    split = measured.backward_input
    entry = {
        "layers": [a, b],
        "forward_ms": fitted(fwd),
        "backward_ms": fitted(bwd),
        "forward_iqr_ms": [e.iqr for e in fwd],
        "backward_iqr_ms": [e.iqr for e in bwd],
        **(
            {"backward_input_ms": fitted(split), "backward_weight_ms": fitted(measured.backward_weight)}
            if split
            else {}
        ),
        "input_bytes_per_sample": int(TensorSpec.of(bounds[a]).bytes_per_sample),
        "output_bytes_per_sample": 0 if probe.last else int(TensorSpec.of(bounds[b]).bytes_per_sample),
        "stash_bytes_per_sample": int(probe.stash_bytes_per_sample()),
        "static_bytes": int(nparam * (2 + nstate)),
        "param_bytes": int(sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)),
        "optimizer_ms": opt_ms,
    }
    entry["work_bytes"], entry["work_bytes_per_sample"] = probe.work_bytes()
    entry["optimizer_work_bytes"] = optimizer_work_bytes(stage, opts, probe.device)
    if opts.trace_dir:
        probe.trace(sizes[-1], os.path.join(opts.trace_dir, f"stage{s}.json"))
    return entry


def _links(
    opts: ProfileOptions, device: torch.device, S: int, max_bytes: int, ticks: _Ticks, wrap: bool = False
) -> tuple[list[dict], Optional[dict]]:
    """The links between ``S`` stages, given or measured between the devices their stages run on
    (messages up to ``max_bytes``), and with ``wrap`` the one from the last stage's device back
    to the first's (None without, or with two stages: that is the link between them)."""
    wrap = wrap and S > 2
    if opts.link_latency_ms is not None:
        given = {
            "latency_ms": opts.link_latency_ms,
            "bytes_per_ms": opts.link_gbps * 1e9 / 8 / 1e3,
            "source": "given",
        }
        return [dict(given) for _ in range(S - 1)], dict(given) if wrap else None
    if S == 1:
        return [], None
    backend = "nccl" if device.type == "cuda" else "gloo"
    plan = link_plan(S, device.type, torch.cuda.device_count() if device.type == "cuda" else 0)
    back = (S - 1, 0) if backend == "nccl" and plan[-1] == (S - 2, S - 1) else plan[0]
    ticks.say(f"link ping-pongs ({len(set(plan))} pairs of GPUs)" if backend == "nccl" else "link ping-pong")
    measured = measure_links(backend, plan + ([back] if wrap else []), max_bytes=max(max_bytes, 1 << 16))

    def entry(pair: tuple[int, int]) -> dict:
        extra = {"devices": list(pair)} if backend == "nccl" else {}
        return {
            "latency_ms": measured[pair][0],
            "bytes_per_ms": measured[pair][1],
            "source": "measured",
            **extra,
        }

    return [entry(pair) for pair in plan], entry(back) if wrap else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
