"""Timing stages: rounds of repeats, the machine's drift taken out, stages timed together.

:func:`time_stages` times every (stage, chunk size) entry once per round, in alternating order,
with more rounds while an entry's spread is wide (within a budget); what every entry saw in a
round is the machine's speed then, which :func:`umopt.measure.noise.round_speeds` takes out. On a CPU
:func:`time_concurrently` runs each stage in a process of its own at the same time, as a run
will. :func:`layer_ms` times each layer alone (for balancing the stages).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..devices import autocast, reference_ms
from ..errors import UmoptError
from ..splitbackward import backward_input
from ..zoo import ModelParts, build_model
from .chunk import ProfiledStage, StageProbe, Timer, boundaries, optimizer_step_ms
from .noise import Summary, drift_figure, monotone_fit, round_speeds, summarize
from .options import ProfileOptions, ProgressFn

__all__ = ["StageTimes", "time_stages", "time_concurrently", "fitted", "layer_ms"]


@dataclass
class StageTimes:
    """What timing one stage found: per size, the forward, the backward and (with the split) its
    input- and weight-gradient parts; how much the machine drifted; a fixed matmul's time on
    the stage's device, to compare devices by."""

    forward: list[Summary]
    backward: list[Summary]
    backward_input: list[Summary]
    backward_weight: list[Summary]
    drift: float
    reference_ms: float


def time_stages(
    timed: list[StageProbe],
    sizes: Sequence[int],
    opts: ProfileOptions,
    progress: Optional[ProgressFn],
    label: str,
    budget_s: float,
) -> list[StageTimes]:
    """Each stage's forward and backward times at each size, and with ``opts.split_backward`` the
    backward's input and weight gradients split as W ops run them (:mod:`umopt.splitbackward`,
    after a forward of their own): the median and spread of the repeats, with more repeats (up
    to ``opts.max_repeats``, within ``budget_s``) while a spread is wider than
    ``opts.spread_target``. Several stages given are timed in one another's rounds (stages
    sharing one device)."""
    device = timed[0].device
    timer = Timer(device)
    reference = []
    deadline = time.perf_counter() + budget_s
    # first calls allocate and pick kernels; keep that out of every size's numbers
    for t in timed:
        for b in (sizes[-1], sizes[0]):
            t.run(b)

    def repeat(unit: tuple[int, int], rep: int, split: bool) -> tuple[float, ...]:
        t, b = timed[unit[0]], unit[1]
        tf, tb = t.run(b, rep, timer)
        if not split:
            return tf, tb
        x, y = t.inputs(b, rep)
        out = t.forward(x, y)
        grad = None if t.last else [t.output_grad(out)]
        tbi, weights = timer(lambda: backward_input((x,), [out], grad, t.stage))
        tbw, _ = timer(weights)
        t.stage.zero_grad(set_to_none=True)
        return tf, tb, tbi, tbw

    # sizes (and stages sharing the device) are timed in rounds, one repeat of each per round,
    # rather than one after another: a machine whose speed drifts over seconds
    # then slows every entry alike instead of bending a curve where one size happened to be
    # timed, or tilting the balance toward the stage timed in a slow moment. The order
    # alternates so that no size always follows the largest.
    units = [(j, b) for j in range(len(timed)) for b in sizes]
    runs: dict[tuple[int, int], dict[int, tuple[float, ...]]] = {
        u: {} for u in units
    }  # unit -> round -> times
    for rnd in range(opts.warmup + opts.repeats):
        for u in units if rnd % 2 == 0 else units[::-1]:
            # the split's parts are timed in the first repeats only (they cost a forward and
            # a backward more each); the forward and the whole backward decide on more repeats
            r = repeat(u, rnd, opts.split_backward and rnd >= opts.warmup)
            if rnd >= opts.warmup:
                runs[u][rnd] = r
        reference.append(reference_ms(device))
        if progress:
            progress(len(units) / (opts.warmup + opts.repeats), 0, f"{label} round {rnd + 1}")

    def wide(u) -> bool:
        return any(summarize([r[k] for r in runs[u].values()]).spread > opts.spread_target for k in range(2))

    rnd = opts.warmup + opts.repeats
    while time.perf_counter() <= deadline:
        # while any entry is wide, every entry below the cap runs again: one timed alone in a
        # round has nobody to tell its own noise from the machine's
        if not any(len(runs[u]) < opts.max_repeats and wide(u) for u in units):
            break
        todo = [u for u in units if len(runs[u]) < opts.max_repeats]
        for u in todo if rnd % 2 == 0 else todo[::-1]:
            runs[u][rnd] = repeat(u, rnd, False)
        rnd += 1
    # what every entry saw in a round is the machine's speed then, not the entry's own cost
    rounds = list(range(opts.warmup, rnd))
    table = np.array(
        [[runs[u][r][k] if r in runs[u] else np.nan for r in rounds] for u in units for k in range(2)]
    )
    speed = round_speeds(table, [i for i in range(len(units)) for _ in range(2)])
    machine_ms = statistics.median(reference[opts.warmup :] or reference)
    return [
        _stage_times(j, units, runs, rounds, table, speed, machine_ms, opts.split_backward)
        for j in range(len(timed))
    ]


def _stage_times(
    j: int,
    units: list[tuple[int, int]],
    runs: dict[tuple[int, int], dict[int, tuple[float, ...]]],
    rounds: list[int],
    table: np.ndarray,
    speed: np.ndarray,
    machine_ms: float,
    split: bool,
) -> StageTimes:
    """Stage ``j``'s entries from the timing rounds, each repeat divided by its round's speed."""
    got_all: list[list[Summary]] = [[], [], [], []]
    for i, u in enumerate(units):
        if u[0] != j:
            continue
        at = {r: speed[2 * i, c] for c, r in enumerate(rounds)}
        got = [summarize([t[k] / at[r] for r, t in runs[u].items()]) for k in range(2)]
        if split:
            got += [summarize([t[k] / at[r] for r, t in runs[u].items() if len(t) > 2]) for k in (2, 3)]
        for into, e in zip(got_all, got):
            into.append(e)
    mine = [2 * i + k for i, u in enumerate(units) if u[0] == j for k in range(2)]
    return StageTimes(*got_all, drift_figure(table[mine]), machine_ms)


def fitted(entries: list[Summary]) -> list[float]:
    """The curve over chunk sizes: non-decreasing, each entry weighted by how tight it is."""
    return monotone_fit([e.median for e in entries], [1.0 / (e.spread + 0.01) ** 2 for e in entries])


def probes_of(
    parts: ModelParts, cuts: Sequence[int], bounds: list[torch.Tensor], device: torch.device, dtype: str
) -> list[StageProbe]:
    """A probe per stage of the cut points (the stage modules take the layers themselves)."""
    L = len(parts.layers)
    return [
        StageProbe(
            ProfiledStage(parts.layers[a:b], parts.loss if b == L else None).to(device),
            bounds[a],
            a == 0,
            b == L,
            parts,
            device,
            lambda: autocast(device, dtype),
        )
        for a, b in zip(cuts, cuts[1:])
    ]


def layer_ms(
    parts: ModelParts, bounds: list[torch.Tensor], device: torch.device, opts: ProfileOptions, size: int
) -> list[float]:
    """Forward plus backward time of each layer on its own, at one chunk size (for balancing)."""
    timer = Timer(device)
    out = []
    for probe in probes_of(parts, range(len(parts.layers) + 1), bounds, device, opts.dtype):
        runs = [sum(probe.run(size, rep, timer)) for rep in range(opts.warmup + opts.repeats)]
        out.append(statistics.median(runs[opts.warmup :]))
    return out


def _timing_worker(s: int, opts: ProfileOptions, cuts: list[int], sizes: list[int], queue, stop) -> None:
    """Time one stage in its own process while the other stages are timed in theirs."""
    try:
        torch.set_num_threads(opts.threads)
        device = torch.device("cuda", s) if opts.device == "cuda" else torch.device("cpu")  # a GPU per stage
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parts = build_model(opts.model, opts.model_args, seed=opts.seed)
        for m in parts.layers:
            m.to(device)
        probe = probes_of(parts, cuts, boundaries(parts, device, opts.dtype), device, opts.dtype)[s]
        tick = lambda n, _t, what: queue.put(("tick", s, what, n))  # noqa: E731
        (measured,) = time_stages([probe], sizes, opts, tick, f"stage {s}", opts.budget_s)
        opt_ms = optimizer_step_ms(probe.stage, opts, device)
        queue.put(("done", s, measured, opt_ms))
        # keep this core as busy as in a real run until every stage is timed
        while not stop.is_set():
            probe.run(sizes[len(sizes) // 2])
    except Exception as exc:  # reported by the parent as the user's problem or a bug, with the message
        queue.put(("error", s, f"{exc.__class__.__name__}: {exc}"))


def time_concurrently(opts: ProfileOptions, cuts: list[int], sizes: list[int], tick) -> dict[int, tuple]:
    """Every stage timed at the same time in its own process, as they will run.

    On a CPU the stages of a run share caches, memory bandwidth and clock boost; timed alone, a
    stage looks faster than it will be (seen here: 10-20% on the small chunks of a GPT's last
    stage), and the solver then prefers small chunks that do not pay off.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    S = len(cuts) - 1
    procs = [
        ctx.Process(target=_timing_worker, args=(s, opts, cuts, sizes, queue, stop), daemon=True)
        for s in range(S)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    try:
        while len(results) < S:
            try:
                msg = queue.get(timeout=1.0)
            except Exception:
                dead = [s for s, p in enumerate(procs) if not p.is_alive() and s not in results]
                if dead:
                    raise UmoptError(
                        f"profiling stage {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                    ) from None
                continue
            if msg[0] == "tick":
                tick(msg[3], 0, msg[2])
            elif msg[0] == "done":
                _, s, measured, opt_ms = msg
                results[s] = (measured, opt_ms)
            else:
                raise UmoptError(f"profiling stage {msg[1]} failed: {msg[2]}")
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results
